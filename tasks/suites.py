"""
Which tasks each stage uses, and how a stage's tasks become one mixture.

- `build_mixture(specs, what)`: (name, factory) pairs -> one TaskMixture, leaving out (by name) the tasks whose data
  is nowhere to be found. The training scripts pass their own mixtures in (scripts/mid_train.py, chat_sft.py).
- `held_out_tasks()`: the validation conversations of mid-training and SFT.
- `build_eval_task(name)`: the evaluation split of each ChatCORE task (nanochat/chat_eval.py scores them).

Layers: this module uses nanochat (rank agreement, printing); nanochat never imports tasks/.
"""

from nanochat.chat_eval import TASK_NAMES
from nanochat.common import print0
from nanochat.data.conversations import build_on_every_rank
from nanochat.data.task_data import TaskDataNotFound
from nanochat.usage import Missing
from tasks.common import TaskMixture


def build_mixture(specs, what):
    """
    specs: list of (name, factory) where factory() builds a Task. A task whose data is nowhere to be found
    (TaskDataNotFound) is left out with a message naming it and where it was looked for; if none is left this is an
    error. Returns (TaskMixture, names of the tasks used). Under torchrun it is collective: a task is used only if
    every rank found it (`build_on_every_rank`), so every rank gets the same mixture.
    """
    tasks, used, missing = [], [], []
    for name, factory in specs:
        try:
            task = build_on_every_rank(name, factory)
        except TaskDataNotFound as e:
            missing.append(name)
            print0(f"[{what}] leaving out {name}: {e}")
            continue
        if len(task) == 0:
            missing.append(name)
            print0(f"[{what}] leaving out {name}: it has no examples")
            continue
        tasks.append(task)
        used.append(name)
    if not tasks:
        raise Missing(
            f"no data for the {what}: every task was unavailable ({', '.join(missing)}). Point NANOCHAT_DATA_DIR at a "
            f"directory laid out like ../shared/data (see docs/data.md) or run with access to the Hugging Face hub."
        )
    mixture = TaskMixture(tasks)
    print0(f"[{what}] {len(mixture):,} conversations from {', '.join(f'{n} ({len(t):,})' for n, t in zip(used, tasks))}")
    return mixture, used


def held_out_tasks():
    """
    Held-out conversations for the validation loss of mid-training and SFT (nanochat's mid-training validation
    set): SmolTalk test, the first 5200 of MMLU test, the first 420 of GSM8K test. One set for both stages, so
    their validation numbers are measured on the same conversations.
    """
    from tasks.gsm8k import GSM8K
    from tasks.mmlu import MMLU
    from tasks.smoltalk import SmolTalk

    return [
        ("SmolTalk test", lambda: SmolTalk(split="test")),
        ("MMLU test", lambda: MMLU(subset="all", split="test", stop=5200)),
        ("GSM8K test", lambda: GSM8K(subset="main", split="test", stop=420)),
    ]


def build_eval_task(name, data_dir=None, unsafe_sandbox=False):
    """The evaluation split of a ChatCORE task (raises TaskDataNotFound if its data is nowhere to be found)."""
    from tasks.arc import ARC
    from tasks.gsm8k import GSM8K
    from tasks.humaneval import HumanEval
    from tasks.mmlu import MMLU
    from tasks.spellingbee import SpellingBee

    builders = {
        "ARC-Easy": lambda: ARC(subset="ARC-Easy", split="test", data_dir=data_dir),
        "ARC-Challenge": lambda: ARC(subset="ARC-Challenge", split="test", data_dir=data_dir),
        "MMLU": lambda: MMLU(subset="all", split="test", data_dir=data_dir),
        "GSM8K": lambda: GSM8K(subset="main", split="test", data_dir=data_dir),
        "HumanEval": lambda: HumanEval(data_dir=data_dir, unsafe_sandbox=unsafe_sandbox),
        "SpellingBee": lambda: SpellingBee(size=256, split="test", data_dir=data_dir),
    }
    if name not in builders:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)} or all")
    return builders[name]()


def build_eval_task_on_every_rank(name, data_dir=None, unsafe_sandbox=False):
    """build_eval_task, agreed between ranks under torchrun (collective there): every rank gets the task, or every
    rank raises TaskDataNotFound (naming the ranks that lacked the data when only some did)."""
    if name not in TASK_NAMES:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)} or all")
    return build_on_every_rank(name, lambda: build_eval_task(name, data_dir, unsafe_sandbox))
