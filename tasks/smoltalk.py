"""
SmolTalk (HuggingFaceTB/smol-smoltalk): ~460k train / ~24k test general chat conversations, the bulk of
mid-training and SFT. Local copies: <data_dir>/smoltalk/{split}.jsonl (one {"messages": [...]} or bare message
list per line), or a snapshot of the HF dataset repo at <data_dir>/smoltalk/data/{split}-*.parquet.
"""

import json

from nanochat.data.task_data import TaskDataNotFound, task_data_dir, load_hf_dataset
from tasks.common import Task, validate_messages


class SmolTalk(Task):
    def __init__(self, split, data_dir=None, **kwargs):
        super().__init__(**kwargs)
        if split not in ("train", "test"):
            raise ValueError(f"SmolTalk split must be train or test, got {split!r}")
        self.split = split
        self.ds = load_smoltalk(split, data_dir)

    @property
    def eval_type(self):
        return "generative"

    def num_examples(self):
        return len(self.ds)

    def get_example(self, index):
        row = self.ds[index]
        messages = row["messages"] if isinstance(row, dict) else row
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        validate_messages(messages, f"SmolTalk {self.split} example {index}")
        return {"messages": messages}


def load_smoltalk(split, data_dir=None):
    looked = []
    local = task_data_dir(data_dir)
    if local is not None:
        path = local / "smoltalk" / f"{split}.jsonl"
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        looked.append(f"local file {path} (missing)")
        shards = sorted((local / "smoltalk" / "data").glob(f"{split}-*.parquet"))
        if shards:
            import pyarrow.parquet as pq

            return [{"messages": m} for s in shards for m in pq.read_table(s, columns=["messages"]).column(0).to_pylist()]
        looked.append(f"local files {local / 'smoltalk' / 'data'}/{split}-*.parquet (none)")
    ds = load_hf_dataset("HuggingFaceTB/smol-smoltalk", None, split, looked)
    if ds is None:
        raise TaskDataNotFound(f"SmolTalk {split}", looked)
    return ds
