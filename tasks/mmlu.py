"""
MMLU: 57-subject academic multiple-choice questions (4 choices, letters A-D).
subset "all" (splits dev / validation / test) or "auxiliary_train" (split train: ~100k MC questions from other
datasets, used by mid-training). HF: cais/mmlu. Local: <data_dir>/mmlu/<split dir>/*.csv where the split dir is
dev, test, validation (or val) or auxiliary_train. Two CSV flavours are read: ../shared/data's (header row
`question,choice0..choice3,answer`, answer 0-3) and the original Hendrycks release (no header, answer A-D).
"""

import csv

from nanochat.data.task_data import TaskDataNotFound, task_data_dir, load_hf_dataset
from tasks.common import Task, render_mc

LETTERS = ("A", "B", "C", "D")
# local directory names that hold each split (the Hendrycks tarball calls validation "val")
LOCAL_SPLIT_DIRS = {"dev": ["dev"], "validation": ["validation", "val"], "test": ["test"], "train": ["auxiliary_train"]}


class MMLU(Task):
    def __init__(self, subset, split, data_dir=None, **kwargs):
        super().__init__(**kwargs)
        if subset not in ("all", "auxiliary_train"):
            raise ValueError(f"MMLU subset must be 'all' or 'auxiliary_train', got {subset!r}")
        if subset == "all" and split not in ("dev", "validation", "test"):
            raise ValueError(f"MMLU subset 'all' has splits dev, validation, test; got {split!r}")
        if subset == "auxiliary_train" and split != "train":
            raise ValueError(f"MMLU subset 'auxiliary_train' has only split 'train', got {split!r}")
        self.subset, self.split = subset, split
        self.rows = load_mmlu(subset, split, data_dir)

    @property
    def eval_type(self):
        return "categorical"

    def num_examples(self):
        return len(self.rows)

    def get_example(self, index):
        row = self.rows[index]
        question, choices, answer = row["question"], list(row["choices"]), int(row["answer"])
        if len(choices) != 4 or not 0 <= answer < 4:
            raise ValueError(f"MMLU {self.subset}/{self.split} row {index}: expected 4 choices and answer 0-3")
        messages = [
            {"role": "user", "content": render_mc(question, LETTERS, choices)},
            {"role": "assistant", "content": LETTERS[answer]},
        ]
        return {"messages": messages, "subject": row.get("subject", ""), "letters": LETTERS}

    def evaluate(self, conversation, assistant_response):
        if assistant_response not in LETTERS:
            raise ValueError(f"MMLU answer {assistant_response!r} is not one of {LETTERS}")
        return assistant_response == conversation["messages"][-1]["content"]


def _read_mmlu_csv(path, subject):
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for i, rec in enumerate(csv.reader(f)):
            if i == 0 and rec and rec[0] == "question":
                continue  # header row of the ../shared/data flavour
            if len(rec) != 6:
                raise ValueError(f"{path} line {i + 1}: expected 6 columns (question, 4 choices, answer), got {len(rec)}")
            ans = rec[5].strip()
            answer = LETTERS.index(ans) if ans in LETTERS else int(ans)
            rows.append({"question": rec[0], "choices": rec[1:5], "answer": answer, "subject": subject})
    return rows


def load_mmlu(subset, split, data_dir=None):
    looked = []
    local = task_data_dir(data_dir)
    if local is not None:
        for dirname in LOCAL_SPLIT_DIRS[split]:
            d = local / "mmlu" / dirname
            files = sorted(d.glob("*.csv")) if d.is_dir() else []
            if files:
                rows = []
                for path in files:
                    # subject from "<subject>_<split>.csv"; auxiliary_train files are source datasets, not subjects
                    stem = path.stem
                    subject = "" if split == "train" else (stem.rsplit("_", 1)[0] if "_" in stem else stem)
                    rows.extend(_read_mmlu_csv(path, subject))
                return rows
            looked.append(f"local dir {d} (no *.csv files)")
    hf_split = "train" if subset == "auxiliary_train" else split
    ds = load_hf_dataset("cais/mmlu", subset, hf_split, looked)
    if ds is None:
        raise TaskDataNotFound(f"MMLU {subset} {split}", looked)
    if "train" in ds.column_names:
        # the auxiliary_train config nests each record under a "train" column
        return [row["train"] for row in ds]
    return ds
