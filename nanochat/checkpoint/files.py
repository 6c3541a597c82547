"""
The bottom of the checkpoint package: the names of a checkpoint's files, atomic writes of torch and JSON files, and
the two guards that keep a save from stranding disk space (stale temp files of a killed save, a save that cannot
fit). Nothing here knows which steps are complete (steps.py decides that) or how a step is written (single-file in
nanochat/checkpoint_manager.py, sharded in sharded.py).

    <checkpoint_dir>/model_{step:06d}.pt           MODEL_FILE   the single-file format (nanochat's)
                     meta_{step:06d}.json          META_FILE    (in a sharded step's directory too)
                     optim_{step:06d}_rank{r}.pt   OPTIM_FILE
                     sharded_{step:06d}/           SHARDED_DIR  the sharded format (sharded.py)
                     sharded_{step:06d}.partial/                the same while it is being written
                     <file>.<random>.tmp                        an atomic write in flight (nanochat/atomic.py)
"""

import json
import logging
import os
import re
import shutil

import torch

from nanochat.atomic import atomic_write
from nanochat.usage import CannotRun

logger = logging.getLogger(__name__)

MODEL_FILE = "model_{step:06d}.pt"
META_FILE = "meta_{step:06d}.json"
OPTIM_FILE = "optim_{step:06d}_rank{rank:d}.pt"
SHARDED_DIR = "sharded_{step:06d}"
PARTIAL_SUFFIX = ".partial"


def step_paths(checkpoint_dir, step, rank=0):
    """(model, meta, optimizer-of-rank) paths of a single-file step."""
    return (
        os.path.join(checkpoint_dir, MODEL_FILE.format(step=step)),
        os.path.join(checkpoint_dir, META_FILE.format(step=step)),
        os.path.join(checkpoint_dir, OPTIM_FILE.format(step=step, rank=rank)),
    )


def sharded_step_dir(checkpoint_dir, step):
    return os.path.join(checkpoint_dir, SHARDED_DIR.format(step=step))


def steps_named(checkpoint_dir, pattern):
    """The step numbers of the entries of checkpoint_dir whose names match `pattern` (one group: the step)."""
    if not os.path.isdir(checkpoint_dir):
        return set()
    return {int(m.group(1)) for name in os.listdir(checkpoint_dir) if (m := re.fullmatch(pattern, name))}


def atomic_torch_save(obj, path):
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_json_save(obj, path):
    data = json.dumps(obj, indent=2).encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


# -----------------------------------------------------------------------------
# saves that cannot strand disk


TEMP_FILE = re.compile(r".+\.[^.]+\.tmp")  # what atomic_write names its temp files: <target>.<random>.tmp


def stale_temp_files(checkpoint_dir):
    """What killed saves left in checkpoint_dir: atomic writes' `*.tmp` files and sharded steps' `.partial`
    directories. Nothing else a run writes has these names, and a save in flight of this run cannot exist at start."""
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(os.path.join(checkpoint_dir, n) for n in os.listdir(checkpoint_dir)
                  if (TEMP_FILE.fullmatch(n) and os.path.isfile(os.path.join(checkpoint_dir, n)))
                  or (n.startswith("sharded_") and n.endswith(PARTIAL_SUFFIX)))


def remove_stale_temp_files(checkpoint_dir, log=print):
    """
    Remove stale_temp_files at the start of a run (rank 0, before any save of this run can be in flight), and say in
    one line what went and how much space it gave back. A save killed mid-write (a preempted node, kill -9) leaves its
    temp files behind, and at d64 one is tens of GB. Returns the removed paths.
    """
    stale = stale_temp_files(checkpoint_dir)
    if not stale:
        return []
    freed = 0
    for path in stale:
        try:  # on a filesystem the nodes share, every node's first rank tidies: another may remove a file first
            if os.path.isdir(path):
                freed += sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
                shutil.rmtree(path, ignore_errors=True)
            else:
                freed += os.path.getsize(path)
                os.unlink(path)
        except FileNotFoundError:
            pass
    log(f"Removed {len(stale)} temp file(s) of an interrupted save from {checkpoint_dir} ({format_bytes(freed)}): "
        f"{', '.join(os.path.basename(p) for p in stale)}")
    return stale


def format_bytes(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def state_bytes(obj):
    """Bytes of the tensors in a (nested) state dict / list: what a save of it writes, give or take the pickling."""
    if torch.is_tensor(obj):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


# a save writes its files beside the previous step's; this much more than the estimate must be free after it
FREE_SPACE_MARGIN = 1.05


def check_free_space(checkpoint_dir, need, what):
    """
    Before a save: CannotRun unless the filesystem of checkpoint_dir has `need` bytes free (with a 5% margin for the
    file format), naming the need, what is free and the way out. A save that runs out of space part way leaves a
    temp file the size of the free space and no new step; this says so before anything is written.
    """
    os.makedirs(checkpoint_dir, exist_ok=True)
    free = shutil.disk_usage(checkpoint_dir).free
    if free < need * FREE_SPACE_MARGIN:
        raise CannotRun(
            f"not enough disk space to save {what} in {checkpoint_dir}: it needs about {format_bytes(need)} "
            f"(parameters and optimizer state) and {format_bytes(free)} is free; free space there (older steps "
            f"you do not need, e.g. model_*/optim_*/sharded_* of earlier steps) or point NANOCHAT_BASE_DIR at a "
            f"larger disk, then resume with --resume_from_step=auto"
        )
