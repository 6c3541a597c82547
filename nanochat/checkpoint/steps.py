"""
Which steps a checkpoint directory holds, in which format, and whether each is complete: the one place that decides.

    step_format(checkpoint_dir, step)    "sharded" | "single" | None: THE answer to "is this step sharded" (and is it
                                         there at all); every reader and writer dispatches on it
    complete_steps(checkpoint_dir)       the complete steps, either format, sorted
    require_step(checkpoint_dir, step)   a start-up check: Missing naming the steps there
    step_problem / latest_resumable_step what automatic resume (--resume_from_step=auto) takes, and why it skips
    read_meta / torch_load_file          a step's files read back, a damaged one named with the way out

A step is complete in the single-file format when model_<step>.pt and meta_<step>.json are there (meta is written
last, after every rank's optimizer file), and in the sharded format when sharded_<step>/ holds DCP's .metadata and
the meta json (the directory is renamed into place only then). When both are there (consolidate_checkpoint wrote
the single files from the sharded step), the step is sharded: the single files are a copy, for tools that read
nanochat's files.
"""

import json
import logging
import os

from nanochat.atomic import short_error, torch_file_problem
from nanochat.checkpoint.files import META_FILE, sharded_step_dir, step_paths, steps_named
from nanochat.usage import BadValue, Missing

logger = logging.getLogger(__name__)

SINGLE, SHARDED = "single", "sharded"


def is_sharded_step_complete(checkpoint_dir, step):
    """True when sharded_<step>/ is renamed into place with DCP's .metadata and the meta json: a save cut short never
    passes this."""
    d = sharded_step_dir(checkpoint_dir, step)
    return os.path.isfile(os.path.join(d, ".metadata")) and os.path.isfile(os.path.join(d, META_FILE.format(step=step)))


def is_step_complete(checkpoint_dir, step):
    """True when the single-file step (model and meta) is there."""
    model_path, meta_path, _ = step_paths(checkpoint_dir, step)
    return os.path.exists(model_path) and os.path.exists(meta_path)


def step_format(checkpoint_dir, step):
    """The format of a complete step: "sharded", "single", or None when the step is not complete in either."""
    if is_sharded_step_complete(checkpoint_dir, step):
        return SHARDED
    if is_step_complete(checkpoint_dir, step):
        return SINGLE
    return None


def step_meta_path(checkpoint_dir, step):
    """Where step's meta json is: in its sharded directory for a sharded step, beside model_<step>.pt else."""
    if step_format(checkpoint_dir, step) == SHARDED:
        return os.path.join(sharded_step_dir(checkpoint_dir, step), META_FILE.format(step=step))
    return step_paths(checkpoint_dir, step)[1]


def model_steps(checkpoint_dir):
    """Every step with a model_<step>.pt in a checkpoint directory, complete or not."""
    return steps_named(checkpoint_dir, r"model_(\d+)\.pt")


def sharded_steps(checkpoint_dir):
    """The complete sharded steps in a checkpoint directory, sorted (`.partial` directories are not steps)."""
    return sorted(s for s in steps_named(checkpoint_dir, r"sharded_(\d+)") if is_sharded_step_complete(checkpoint_dir, s))


def complete_steps(checkpoint_dir):
    """The complete steps (either format) in a checkpoint directory, sorted."""
    candidates = model_steps(checkpoint_dir) | steps_named(checkpoint_dir, r"sharded_(\d+)")
    return sorted(s for s in candidates if step_format(checkpoint_dir, s) is not None)


# -----------------------------------------------------------------------------
# reading a step's files back, naming a damaged one


def move_aside_hint(checkpoint_dir, step):
    """What to do about a step whose files cannot be read: the earlier complete step, if there is one."""
    files = f"model_{step:06d}.pt, meta_{step:06d}.json, optim_{step:06d}_rank*.pt"
    earlier = [s for s in complete_steps(checkpoint_dir) if s < step]
    if earlier:
        return (
            f"copy it again if it came from elsewhere; or, to go back to the previous complete step {earlier[-1]}, "
            f"move step {step}'s files ({files}) out of {checkpoint_dir} and load step {earlier[-1]} "
            f"(--resume_from_step={earlier[-1]} to resume training; loading without a step then takes it)"
        )
    return f"copy it again if it came from elsewhere; there is no earlier complete step in {checkpoint_dir} to fall back to"


def torch_load_file(path, what, checkpoint_dir, step, **kwargs):
    """torch.load that names the file and the way out when it is truncated or not a torch file at all."""
    import torch

    try:
        return torch.load(path, **kwargs)
    except (PermissionError, IsADirectoryError, MemoryError):
        raise
    except Exception as e:
        why = torch_file_problem(path) or f"cannot be read ({short_error(e)})"
        also = (f" (the model of step {step} does not need it: later stages still load it)"
                if what == "optimizer state" else "")
        raise BadValue(f"checkpoint {what} {path} {why}: {move_aside_hint(checkpoint_dir, step)}{also}") from e


def read_meta(meta_path, checkpoint_dir, step):
    """The meta dict of a step; a truncated or non-JSON file is named with the way out."""
    try:
        with open(meta_path, "r", encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadValue(
            f"checkpoint meta {meta_path} is truncated, empty or not JSON ({short_error(e)}): "
            f"{move_aside_hint(checkpoint_dir, step)}"
        ) from e
    if not isinstance(meta, dict):
        raise BadValue(
            f"checkpoint meta {meta_path} holds a JSON {type(meta).__name__}, not an object: "
            f"{move_aside_hint(checkpoint_dir, step)}"
        )
    return meta


def read_step_meta(checkpoint_dir, step):
    """The meta dict of a complete step, in either format."""
    return read_meta(step_meta_path(checkpoint_dir, step), checkpoint_dir, step)


# -----------------------------------------------------------------------------
# which step to load or resume


def require_step(checkpoint_dir, step):
    """Missing unless `step` is complete in checkpoint_dir, naming the steps there: a start-up check, run before
    anything is built, compiled or downloaded."""
    if step_format(checkpoint_dir, step) is not None:
        return
    missing = next(p for p in step_paths(checkpoint_dir, step)[:2] if not os.path.exists(p))
    steps = complete_steps(checkpoint_dir)
    where = (f"complete steps in {checkpoint_dir}: {', '.join(map(str, steps))}" if steps
             else f"{checkpoint_dir} holds no complete step" if os.path.isdir(checkpoint_dir)
             else f"{checkpoint_dir} does not exist")
    raise Missing(f"checkpoint step {step} is incomplete or missing: {missing} does not exist ({where})")


def step_problem(checkpoint_dir, step, with_optimizer=True):
    """
    What stops `step` from being resumed from, as a sentence, or None when it is complete. The one completeness check
    of automatic resume. Reads only the meta and the ends of the torch files (their zip directory), not the tensors.
    """
    if step_format(checkpoint_dir, step) == SHARDED:
        # a sharded step is renamed into place only once every rank's shard, DCP's index and the meta are written
        # (sharded.py): complete means resumable, model and optimizer state alike
        return None
    model_path, meta_file, _ = step_paths(checkpoint_dir, step)
    for path in (model_path, meta_file):
        if not os.path.exists(path):
            return f"{os.path.basename(path)} is missing (the save did not finish)"
    try:
        with open(meta_file, "r", encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return f"{os.path.basename(meta_file)} cannot be read ({short_error(e)})"
    if not isinstance(meta, dict):
        return f"{os.path.basename(meta_file)} is not a JSON object"
    paths = [model_path]
    if with_optimizer:
        world = meta.get("world_size", 1)
        paths += [step_paths(checkpoint_dir, step, r)[2] for r in range(world if isinstance(world, int) and world > 0 else 1)]
    for path in paths:
        if not os.path.exists(path):
            return f"{os.path.basename(path)} is missing"
        problem = torch_file_problem(path)
        if problem:
            return f"{os.path.basename(path)} {problem}"
    return None


def latest_resumable_step(checkpoint_dir, with_optimizer=True, log=None):
    """
    The latest step of checkpoint_dir that step_problem passes, or None when there is none (or no directory). Each
    later step it passes over is reported through `log` (default: a logger warning) with its problem.
    """
    log = log or logger.warning
    if not os.path.isdir(checkpoint_dir):
        return None
    steps = model_steps(checkpoint_dir) | set(sharded_steps(checkpoint_dir)) | steps_named(checkpoint_dir, r"meta_(\d+)\.json")
    for step in sorted(steps, reverse=True):
        problem = step_problem(checkpoint_dir, step, with_optimizer)
        if problem is None:
            return step
        log(f"skipping checkpoint step {step} in {checkpoint_dir}: {problem}; trying the step before it")
    return None
