"""
A training run's state in a checkpoint: the model, every optimizer's state, the data position of every data rank and
the loop's own state (in meta), so a resumed run continues exactly like an uninterrupted one.

    save_train_state(checkpoint_dir, step, model, optimizers, meta, loader_state, parallel)   every rank calls it
    meta, loader_state = load_train_state(checkpoint_dir, step, model, optimizers, device, parallel)
    save_stage_model(checkpoint_dir, step, model, meta, parallel)   the model and meta only (SFT, RL)

Which format: the run's parallel plan says what it writes (`parallel.checkpoint_format`: sharded on the FSDP and
tensor-parallel paths, nanochat's single files on the DDP path or with --checkpoint_format=single) and whether it can
resume a step (`parallel.check_resume(meta, step, fmt)`); steps.step_format says what a step holds. Single-file steps
resume on the same layout and number of ranks (the optimizer files are per rank); sharded steps resume on either
DTensor layout (FSDP or FSDP x TP) and any number of ranks, resharded exactly (sharded.py).

The data position is kept per rank in meta["loader_state"] (nanochat's dataloader_state_dict is rank 0's); the tp
ranks of a group read the same data, so `saved_loader_states` gives one state per data rank, which the dataloader
moves onto another number of data ranks (loader_states_for_world) when a sharded step resumes on another world.

Before writing, every save checks that the checkpoint directory's disk has room for it (files.check_free_space).
"""

from nanochat.checkpoint.files import check_free_space, sharded_step_dir, state_bytes, step_paths
from nanochat.checkpoint.steps import SHARDED, read_step_meta, require_step, step_format
from nanochat.checkpoint_manager import SHAPE_FIELDS, load_checkpoint, save_checkpoint
from nanochat.common import print0
from nanochat.distributed.dist import gather_objects, get_dist_info, raise_on_every_rank
from nanochat.usage import BadValue, CannotRun


def save_train_state(checkpoint_dir, step, model, optimizers, meta, loader_state, parallel):
    """
    Save model, optimizer state and meta with every rank's loader state and the layout (parallel.resume_meta), in
    the plan's format: nanochat's single files (model from rank 0, one optimizer file per rank) or one sharded step
    (every rank its shard). Every rank must call it.
    """
    _, rank, _, _ = get_dist_info()
    optim_bytes = state_bytes([opt.state for opt in optimizers])  # this rank's shard of the optimizer state
    gathered = gather_objects((loader_state, optim_bytes))
    loader_states = [g[0] for g in gathered]
    meta = dict(meta, step=step, loader_state=loader_states, world_size=len(loader_states), **parallel.resume_meta())
    if loader_states and loader_states[0] is not None:
        meta["dataloader_state_dict"] = loader_states[0]  # nanochat's key, for tools that read it
    _check_room(checkpoint_dir, step, model, sum(g[1] for g in gathered), rank, parallel)
    _save(checkpoint_dir, step, model, optimizers, meta, parallel, rank)


def save_stage_model(checkpoint_dir, step, model, meta, parallel):
    """The model and meta only (nanochat's SFT/RL checkpoints carry no optimizer state). Every rank must call it."""
    _, rank, _, _ = get_dist_info()
    _check_room(checkpoint_dir, step, model, 0, rank, parallel)
    _save(checkpoint_dir, step, model, None, dict(meta, step=step), parallel, rank)


def _save(checkpoint_dir, step, model, optimizers, meta, parallel, rank):
    """The format dispatch of a save: the plan's checkpoint_format. optimizers None: the model only."""
    if parallel.checkpoint_format == SHARDED:  # every rank writes its shard (sharded.py)
        from nanochat.checkpoint.sharded import save_sharded, train_state_dict

        save_sharded(checkpoint_dir, step, train_state_dict(model, optimizers or ()), meta, parallel.async_save)
        return
    model_sd = parallel.model_state_dict(model)
    optim_sd = None if optimizers is None else [opt.state_dict() for opt in optimizers]
    save_checkpoint(checkpoint_dir, step, model_sd if rank == 0 else None, optim_sd, meta, rank=rank)


def _check_room(checkpoint_dir, step, model, optim_bytes, rank, parallel):
    """Rank 0 checks the disk has room for the whole step (the model, every rank's optimizer state); a shortfall
    stops every rank with rank 0's message, before any file of the step is written."""
    if parallel.async_save:  # the previous step's background write is on disk first: it counts against the space
        from nanochat.checkpoint.sharded import wait_for_pending_save

        wait_for_pending_save()
    error = None
    if rank == 0:
        model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values() if hasattr(v, "numel"))
        try:
            check_free_space(checkpoint_dir, model_bytes + optim_bytes, f"step {step}")
        except (CannotRun, OSError) as e:  # raised on every rank below
            error = e
    raise_on_every_rank(error, f"the free-space check before saving step {step}")


def load_train_state(checkpoint_dir, step, model, optimizers, device, parallel):
    """Restore model and optimizers in place, whatever the step's format; returns (meta, this rank's loader state
    or None)."""
    fmt = step_format(checkpoint_dir, step)
    if fmt is None:
        require_step(checkpoint_dir, step)  # names what is missing and the complete steps
    if fmt == SHARDED:
        return _load_sharded_train_state(checkpoint_dir, step, model, optimizers, parallel)
    _, rank, _, world_size = get_dist_info()
    model_sd, optim_sd, meta = load_checkpoint(checkpoint_dir, step, device, load_optimizer=True, rank=rank)
    saved_world = meta.get("world_size", 1)
    if saved_world != world_size:
        raise BadValue(
            f"step {step} was saved by {saved_world} rank(s) but this run has {world_size}: the optimizer state and "
            f"data position are per rank, so resume with --nproc_per_node/--nnodes giving {saved_world} ranks"
        )
    parallel.check_resume(meta, step, fmt)
    check_resume_model_config(meta, model, checkpoint_dir, step)
    optim_path = step_paths(checkpoint_dir, step, rank)[2]
    fix = _resume_fix(meta, step)
    if len(optim_sd) != len(optimizers):
        raise BadValue(f"{optim_path} holds {len(optim_sd)} optimizer states but this run built {len(optimizers)}: {fix}")
    parallel.load_model_state_dict(model, model_sd)
    for opt, sd in zip(optimizers, optim_sd):
        try:
            opt.load_state_dict(sd)
        except (ValueError, KeyError) as e:  # torch: "loaded state dict contains a parameter group that doesn't match"
            raise BadValue(f"{optim_path} does not fit this run's {type(opt).__name__} ({e}): {fix}") from e
    loader_states = meta.get("loader_state") or [meta.get("dataloader_state_dict")]
    return meta, loader_states[rank] if rank < len(loader_states) else None


def _resume_fix(meta, step):
    saved_muon = (meta.get("user_config") or {}).get("use_muon")
    return (f"resume with the optimizer flags of the run that saved step {step}"
            + (f" (--use_muon={int(saved_muon)})" if isinstance(saved_muon, bool) else ""))


def _load_sharded_train_state(checkpoint_dir, step, model, optimizers, parallel):
    """load_train_state for a sharded step: resharded onto this run's layout and ranks (any number), the data
    position too."""
    from nanochat.checkpoint.sharded import load_sharded
    from nanochat.dataloader import loader_states_for_world

    meta = read_step_meta(checkpoint_dir, step)
    parallel.check_resume(meta, step, SHARDED)
    check_resume_model_config(meta, model, checkpoint_dir, step)
    load_sharded(sharded_step_dir(checkpoint_dir, step), model, optimizers, fix=_resume_fix(meta, step))
    _, _, _, world_size = get_dist_info()
    if meta.get("world_size", world_size) != world_size or meta.get("parallel") != parallel.resume_meta()["parallel"]:
        print0(f"Note: step {step} was saved by {meta.get('world_size', '?')} rank(s) on the {meta.get('parallel', '?')} "
               f"path, this run has {world_size} on the {parallel.resume_meta()['parallel']} path: the model and "
               f"optimizer state are resharded onto it, exactly")
    saved = saved_loader_states(meta)
    data_rank, data_world, _ = parallel.data_ranks
    # (one process reading as W data ranks, base_train --data_world_size, takes the states from loop_state itself)
    states = loader_states_for_world(saved, data_world, log=print0 if data_world > 1 else None)
    return meta, states[data_rank]


def saved_loader_states(meta):
    """One data position per data rank of the run that saved `meta`: a process that read the data as W ranks
    (base_train --data_world_size) keeps theirs in loop_state; else every rank's, the tp ranks of a group (which read
    the same data, ranks d*tp .. d*tp+tp-1) counted once."""
    replayed = (meta.get("loop_state") or {}).get("data_loader_states")
    if replayed:
        return replayed
    per_rank = meta.get("loader_state") or [meta.get("dataloader_state_dict")]
    return per_rank[::meta.get("tp_size", 1)]


def check_resume_model_config(meta, model, checkpoint_dir, step):
    """Refuse to resume a step saved by another model shape (e.g. another --depth), naming both configs."""
    saved, run_config = meta.get("model_config"), getattr(model, "config", None)
    if not isinstance(saved, dict) or run_config is None:
        return  # metas without a model_config (tests, old runs): the state dict load still checks the shapes
    diff = [f for f in SHAPE_FIELDS if f in saved and saved[f] != getattr(run_config, f, None)]
    if saved.get("window_pattern") != getattr(run_config, "window_pattern", None):  # a December vs a record model
        diff.append("window_pattern")
    if diff:
        flags = " ".join(f"--{k}={v}" for k, v in (meta.get("user_config") or {}).items() if k in ("depth", "recipe"))
        raise BadValue(
            f"step {step} in {checkpoint_dir} holds a model with "
            f"{', '.join(f'{f}={saved.get(f)}' for f in diff)} but this run builds "
            f"{', '.join(f'{f}={getattr(run_config, f, None)}' for f in diff)}: resume with the model flags of the run "
            f"that saved it{f' ({flags})' if flags else ''}; they are in the user_config of "
            f"meta_{step:06d}.json"
        )
