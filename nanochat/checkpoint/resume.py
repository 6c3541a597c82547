"""
--resume_from_step in every training stage: which step to go on from, and the run restored to it.

    resume_flag()                                   the flag, as every training script declares it (N | auto | -1)
    require_resume_step(config, checkpoint_dir)     start-up check of --resume_from_step=N, before anything is built
    step = resolve_resume_step(value, checkpoint_dir)   None = fresh; auto = the latest step automatic resume may take
    start, loop = resume_run(config, checkpoint_dir, model, optimizers, device, parallel, keys)   mid, SFT, RL
    already_finished(config, checkpoint_dir, last_step)  a restarted job whose last step is saved trains no more
    resume_loop_state(meta, checkpoint_dir, step, keys)  the loop state a stage saved, checked

At the start of every stage (resolve_resume_step, before anything of this run is saved) the temp files that killed
saves of earlier attempts left in the checkpoint directory are removed, with one line naming them (files.py).
"""

import os

from nanochat.checkpoint.files import remove_stale_temp_files
from nanochat.checkpoint.steps import latest_resumable_step, require_step, step_problem
from nanochat.checkpoint.train_state import load_train_state
from nanochat.common import print0
from nanochat.distributed.dist import barrier, gather_objects, get_dist_info
from nanochat.usage import BadValue


def resume_loop_state(meta, checkpoint_dir, step, keys):
    """meta["loop_state"], checked to hold `keys`: a step saved by another script or by nanochat cannot resume here."""
    loop = meta.get("loop_state")
    missing = sorted(set(keys) - set(loop)) if isinstance(loop, dict) else sorted(keys)
    if missing:
        raise BadValue(
            f"{os.path.join(checkpoint_dir, f'meta_{step:06d}.json')} has no loop state to resume from (missing "
            f"loop_state {', '.join(missing)}): step {step} was not saved by this repo's training script for that stage "
            f"(a nanochat checkpoint, or a hand-edited meta), so the run cannot continue from it"
            + (". Its model still loads for the later stages (mid_train, chat_cli, base_loss)"
               if isinstance(meta.get("model_config"), dict) else "")
        )
    return loop


def parse_resume_step(value):
    """--resume_from_step: 'auto', or a step number (-1 = start fresh)."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        step = int(text)
    except ValueError:
        step = None
    if step is None or step < -1:
        raise BadValue(f"--resume_from_step must be a saved step number, auto (the latest complete step) or -1 "
                       f"(start fresh), got {value!r}")
    return step


def resume_flag():
    """--resume_from_step, as every training script declares it."""
    from nanochat.configurator import Flag

    return Flag("resume_from_step", -1, "resume from this saved step of the run's checkpoint directory; auto = the "
                "latest complete step (fresh when there is none; a damaged latest step is skipped, with a message, "
                "for the one before), -1 = start fresh", words=["auto"], check=parse_resume_step)


def require_resume_step(config, checkpoint_dir):
    """The start-up check of --resume_from_step=N (N >= 0), before anything is built: step N is complete in
    checkpoint_dir, else a usage error naming the steps there. auto and -1 need nothing yet."""
    step = config["resume_from_step"]
    if isinstance(step, int) and step >= 0:
        require_step(checkpoint_dir, step)


def resolve_resume_step(value, checkpoint_dir, with_optimizer=True):
    """
    The step to resume from, or None for a fresh start. auto: rank 0 looks for the latest complete step
    (steps.latest_resumable_step; resuming reads the checkpoint on every rank, so it sits on a filesystem
    all nodes share) and every rank gets its answer, so all ranks load the same step. First, on each node, the stale
    temp files of killed saves go (files.remove_stale_temp_files), and all ranks wait until every node has tidied.
    """
    choice = parse_resume_step(value)
    _, rank, local_rank, _ = get_dist_info()
    if local_rank == 0:  # every node's first rank: node-local base dirs (NANOCHAT_SHARED_FS=0) are tidied too
        remove_stale_temp_files(checkpoint_dir, log=print)
    # No rank writes into checkpoint_dir (metrics.jsonl, a save) before every node's tidy-up is over: on a filesystem
    # the nodes share, a node that starts late would otherwise take this run's own temp file in flight for a stale one.
    barrier()
    if choice != "auto":
        return None if choice < 0 else choice
    found = latest_resumable_step(checkpoint_dir, with_optimizer, log=print) if rank == 0 else None
    step = gather_objects(found)[0]
    print0(f"--resume_from_step=auto: resuming from step {step} in {checkpoint_dir}" if step is not None
           else f"--resume_from_step=auto: no complete checkpoint in {checkpoint_dir}, starting fresh")
    return step


def resume_run(config, checkpoint_dir, model, optimizers, device, parallel, keys=()):
    """
    --resume_from_step of mid_train, chat_sft and chat_rl: (start step, meta["loop_state"]) after restoring the model
    and optimizers in place, or (0, None) for a fresh start. The scripts put their data source back where the saved
    run had it by replaying it (re-rendering the batches before that step, training on none of them).
    """
    step = resolve_resume_step(config["resume_from_step"], checkpoint_dir)
    if step is None:
        return 0, None
    meta, _ = load_train_state(checkpoint_dir, step, model, optimizers, device, parallel)
    loop = resume_loop_state(meta, checkpoint_dir, step, keys)
    print0(f"Resumed from step {step} in {checkpoint_dir}")
    return step, loop


def already_finished(config, checkpoint_dir, last_step):
    """--resume_from_step=auto after the run's last step was saved (as the model alone, as SFT and RL save it): True,
    with a message, so a restarted job does not train that stage again."""
    if parse_resume_step(config["resume_from_step"]) != "auto":
        return False
    if step_problem(checkpoint_dir, last_step, with_optimizer=False) is not None:
        return False
    print0(f"Step {last_step} is the last and is already saved in {checkpoint_dir}: this stage is complete")
    return True
