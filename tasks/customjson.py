"""
CustomJSON: conversations from a JSONL file, one JSON array of {"role", "content"} messages per line
(nanochat's format for the identity conversations that teach the model who it is).
"""

import json
import os

from nanochat.data.task_data import TaskDataNotFound, task_data_dir
from nanochat.data.download import download_file
from tasks.common import Task, validate_messages

IDENTITY_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl"


class CustomJSON(Task):
    def __init__(self, filepath, **kwargs):
        super().__init__(**kwargs)
        self.filepath = filepath
        if not os.path.isfile(filepath):
            raise TaskDataNotFound("CustomJSON conversations", [f"{filepath} (missing)"])
        self.conversations = []
        with open(filepath, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    messages = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{filepath} line {lineno}: not valid JSON ({e})") from None
                if isinstance(messages, dict) and "messages" in messages:
                    messages = messages["messages"]  # also accept {"messages": [...]} lines
                validate_messages(messages, f"{filepath} line {lineno}")
                self.conversations.append(messages)

    @property
    def eval_type(self):
        return "generative"

    def num_examples(self):
        return len(self.conversations)

    def get_example(self, index):
        return {"messages": self.conversations[index]}


def identity_conversations_path(data_dir=None, base_dir=None, download=True, url=None):
    """
    Path of the identity conversations: <data_dir>/sft/identity_conversations.jsonl when a local data dir is set
    and has it, else <base_dir>/identity_conversations.jsonl, downloading it there from `url` (as speedrun.sh does)
    if it is missing and download=True. Raises TaskDataNotFound naming every place tried.
    """
    url = url or IDENTITY_URL
    looked = []
    local = task_data_dir(data_dir)
    if local is not None:
        path = local / "sft" / "identity_conversations.jsonl"
        if path.is_file():
            return str(path)
        looked.append(f"{path} (missing)")
    if base_dir is None:
        from nanochat.common import get_base_dir

        base_dir = get_base_dir()
    path = os.path.join(base_dir, "identity_conversations.jsonl")
    if os.path.isfile(path):
        return path
    looked.append(f"{path} (missing)")
    if download:
        try:
            download_file(url, path)
            return path
        except OSError as e:
            looked.append(f"download from {url} failed ({e})")
    raise TaskDataNotFound("the identity conversations", looked)
