"""
GSM8K: grade-school math word problems with worked solutions.
HF: openai/gsm8k (subsets main / socratic; splits train / test). Local: <data_dir>/gsm8k/{split}.jsonl for main,
<data_dir>/gsm8k/{split}_socratic.jsonl for socratic; each line {"question", "answer"}.

The reference solutions mark each arithmetic step as <<expr=result>>. We turn those into calculator tool calls,
so the assistant learns to write a python part and read back the tool output instead of doing arithmetic itself:
    "48/2 = <<48/2=24>>24 clips"  ->  text "48/2 = ", python "48/2", python_output "24", text "24 clips"
The final answer follows "#### " on the last line; reward is an exact match of that number.
"""

import json
import re

from nanochat.data.task_data import TaskDataNotFound, task_data_dir, load_hf_dataset
from tasks.common import Task

ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
CALC_RE = re.compile(r"(<<[^>]*>>)")


def extract_answer(completion):
    """The number after '#### ' (commas removed), or None if there is none."""
    match = ANSWER_RE.search(completion)
    if match is None:
        return None
    return match.group(1).strip().replace(",", "")


def answer_to_parts(answer):
    """Split a GSM8K solution into text / python / python_output parts at its <<expr=result>> spans."""
    parts = []
    for piece in CALC_RE.split(answer):
        if not piece:
            continue
        if piece.startswith("<<") and piece.endswith(">>"):
            expr, _, result = piece[2:-2].rpartition("=")
            if not _:  # "<<expr>>" with no "=": a bare expression, no known output
                expr, result = piece[2:-2], ""
            parts.append({"type": "python", "text": expr})
            parts.append({"type": "python_output", "text": result})
        else:
            parts.append({"type": "text", "text": piece})
    return parts


class GSM8K(Task):
    def __init__(self, subset="main", split="test", data_dir=None, **kwargs):
        super().__init__(**kwargs)
        if subset not in ("main", "socratic"):
            raise ValueError(f"GSM8K subset must be main or socratic, got {subset!r}")
        if split not in ("train", "test"):
            raise ValueError(f"GSM8K split must be train or test, got {split!r}")
        self.subset, self.split = subset, split
        self.ds = load_gsm8k(subset, split, data_dir)

    @property
    def eval_type(self):
        return "generative"

    def num_examples(self):
        return len(self.ds)

    def get_example(self, index):
        row = self.ds[index]
        messages = [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": answer_to_parts(row["answer"])},
        ]
        return {"messages": messages}

    def evaluate(self, conversation, assistant_response):
        """1 if the '#### n' number of the response equals the reference's, else 0."""
        content = conversation["messages"][-1]["content"]
        last_text = content[-1]["text"] if isinstance(content, list) else content
        ref = extract_answer(last_text)
        if ref is None:
            raise ValueError("GSM8K reference solution has no '#### n' answer line")
        return int(extract_answer(assistant_response) == ref)

    def reward(self, conversation, assistant_response):
        """RL reward: 1.0 for the right final number, else 0.0."""
        return float(self.evaluate(conversation, assistant_response))


def load_gsm8k(subset, split, data_dir=None):
    looked = []
    local = task_data_dir(data_dir)
    if local is not None:
        path = local / "gsm8k" / (f"{split}.jsonl" if subset == "main" else f"{split}_socratic.jsonl")
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        looked.append(f"local file {path} (missing)")
    ds = load_hf_dataset("openai/gsm8k", subset, split, looked)
    if ds is None:
        raise TaskDataNotFound(f"GSM8K {subset} {split}", looked)
    return ds
