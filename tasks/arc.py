"""
ARC (AI2 Reasoning Challenge): grade-school science multiple-choice questions, Easy and Challenge subsets.
HF: allenai/ai2_arc; local: <data_dir>/arc/ARC-{Easy,Challenge}-{train,validation,test}.jsonl (same schema).
"""

import json

from nanochat.data.task_data import TaskDataNotFound, task_data_dir, load_hf_dataset
from tasks.common import Task, render_mc


class ARC(Task):
    def __init__(self, subset, split, data_dir=None, **kwargs):
        super().__init__(**kwargs)
        if subset not in ("ARC-Easy", "ARC-Challenge"):
            raise ValueError(f"ARC subset must be ARC-Easy or ARC-Challenge, got {subset!r}")
        if split not in ("train", "validation", "test"):
            raise ValueError(f"ARC split must be train, validation or test, got {split!r}")
        self.subset, self.split = subset, split
        self.ds = load_arc(subset, split, data_dir)

    @property
    def eval_type(self):
        return "categorical"

    def num_examples(self):
        return len(self.ds)

    def get_example(self, index):
        row = self.ds[index]
        letters = list(row["choices"]["label"])  # usually A-D; a few questions use 1-4 or have 3/5 choices
        answer = row["answerKey"]
        if answer not in letters:
            raise ValueError(f"ARC {self.subset}/{self.split} row {index}: answerKey {answer!r} not in {letters}")
        messages = [
            {"role": "user", "content": render_mc(row["question"], letters, list(row["choices"]["text"]))},
            {"role": "assistant", "content": answer},
        ]
        return {"messages": messages, "letters": letters}

    def evaluate(self, conversation, assistant_response):
        # categorical evaluation only ever answers with one of the letters; anything else is a caller bug
        if assistant_response not in conversation["letters"]:
            raise ValueError(f"ARC answer {assistant_response!r} is not one of {conversation['letters']}")
        return assistant_response == conversation["messages"][-1]["content"]


def load_arc(subset, split, data_dir=None):
    looked = []
    local = task_data_dir(data_dir)
    if local is not None:
        path = local / "arc" / f"{subset}-{split}.jsonl"
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        looked.append(f"local file {path} (missing)")
    ds = load_hf_dataset("allenai/ai2_arc", subset, split, looked)
    if ds is None:
        raise TaskDataNotFound(f"ARC {subset} {split}", looked)
    return ds
