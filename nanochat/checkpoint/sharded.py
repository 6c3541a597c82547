"""
Sharded checkpoints for the FSDP and tensor-parallel paths (--use_fsdp=1, the d40+ presets; --tp_size): every rank
writes its own shard of the model and of the optimizer state with torch.distributed.checkpoint (DCP), in parallel,
with no gather of the whole model to rank 0. Loading reshards: a step saved by W ranks resumes on any number of ranks
(fewer nodes after a failure), and on either layout (DCP finds each tensor's rows, or its (dp, tp) rectangle, by
global offset, whatever layout wrote it).

    <checkpoint_dir>/sharded_{step:06d}/           a complete step (it only ever appears whole: see below)
                        .metadata                  DCP's index: every tensor's global shape and where its pieces are
                        __{rank}_0.distcp          what rank `rank` held: its rows of every parameter and state tensor
                        meta_{step:06d}.json       the same meta dict as nanochat's single-file checkpoints
    <checkpoint_dir>/sharded_{step:06d}.partial/   the same while it is being written

Completeness: the ranks write into `.partial`; DCP writes `.metadata` after every rank has written its file; then
rank 0 writes the meta json and renames the directory to its final name (one atomic rename). A crash at any point
before the rename leaves no `sharded_<step>` directory, so the previous step stays the latest complete one
(steps.step_format), and the next start of the run removes the leftover `.partial` (files.remove_stale_temp_files).

What is in it (one flat DCP state dict, keyed by parameter names, so no key depends on the number of ranks):

    model.<name>                      the parameters (DTensors; DCP stores each rank's rows or rectangle)
    optim.<i>.<name>.<key>            optimizer i's state for parameter <name> (AdamW's exp_avg/exp_avg_sq, Muon's
                                      momentum_buffer as a DTensor laid out like the parameter, AdamW's step scalar)
    layout                            (a pickled object) the model's key order and, per optimizer, its kind, its
                                      param_groups (hyperparameters and parameter names) and its state keys

`consolidate` turns a step into nanochat's single-file checkpoint (model_<step>.pt, meta_<step>.json,
optim_<step>_rank<r>.pt for the world size that saved it), the same files the gather-to-rank-0 path writes;
`read_model_state_dict` gives the full model in one process without writing anything (checkpoint_manager's load
path uses it, so evaluation, chat, export_hf and the next training stage read a sharded step directly).

DCP needs a filesystem that every rank sees (a shared one on multi-node): every rank writes into the same directory,
and a resharded load reads the pieces other ranks wrote. The save checks this and says so.
"""

import concurrent.futures
import io
import logging
import os
import pickle
import shutil
import threading
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from nanochat.atomic import fsync_dir
from nanochat.checkpoint.files import META_FILE, PARTIAL_SUFFIX, atomic_json_save, atomic_torch_save, sharded_step_dir, step_paths
from nanochat.checkpoint.steps import read_meta
from nanochat.usage import BadValue

logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# the state dict DCP saves and loads


def _names(model):
    """{parameter: name} for the model's sharded parameters (compile's `_orig_mod.` prefix stripped). FSDP2 leaves
    the root's parameters gathered after a forward without backward (an eval, a sample) and registers the gathered
    tensors as the parameters then; resharding first gives back the sharded ones the optimizers hold."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return {p: n.removeprefix("_orig_mod.") for n, p in model.named_parameters()}


def _as_dtensor_like(t, p):
    """A rank-local state tensor shaped like p's shard (ShardedMuon's momentum) as a DTensor laid out like p."""
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def train_state_dict(model, optimizers=()):
    """
    The flat state dict of the module docstring for the sharded model and its optimizers (no copies: DTensors that
    share storage with the parameters and the optimizer state). Every rank builds its own; DCP stores each rank's part.
    """
    names = _names(model)
    sd = {}
    model_keys = []
    for k, v in model.state_dict().items():
        k = k.removeprefix("_orig_mod.")
        sd[f"model.{k}"] = v
        model_keys.append(k)
    optim_layouts = []
    for i, opt in enumerate(optimizers):
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
                  for g in opt.param_groups]
        state_keys = {}
        for g in opt.param_groups:
            for p in g["params"]:
                st = opt.state.get(p)
                if not st:
                    continue
                keys = state_keys[names[p]] = {}
                for key, v in st.items():
                    if isinstance(v, DTensor):
                        kind = "dtensor"
                    elif torch.is_tensor(v) and isinstance(p, DTensor) and v.dim() > 0 and v.shape == p.to_local().shape:
                        kind, v = "local", _as_dtensor_like(v, p)  # a per-rank shard kept as a plain tensor
                    elif torch.is_tensor(v):
                        kind = "tensor"  # the same on every rank (AdamW's step)
                    else:
                        raise TypeError(f"{type(opt).__name__} state {key!r} of {names[p]} is a {type(v).__name__}; "
                                        f"sharded checkpoints save tensors only")
                    keys[key] = kind
                    sd[f"optim.{i}.{names[p]}.{key}"] = v
        kind = getattr(opt, "kind", type(opt).__name__)
        optim_layouts.append({"kind": kind, "param_groups": groups, "state_keys": state_keys})
    # pickled into one bytes entry (DCP would flatten a dict into a key per leaf); a checkpoint is trusted input,
    # like the pickled optimizer files of the single-file format
    sd["layout"] = io.BytesIO(pickle.dumps({"model_keys": model_keys, "optimizers": optim_layouts}))
    return sd


# -----------------------------------------------------------------------------
# saving


class _Pending:
    """The one asynchronous save in flight in this process: its future and rank 0's finishing (rename) step."""

    def __init__(self, future, step_dir, finished):
        self.future, self.step_dir, self.finished = future, step_dir, finished
        self.error = None


_pending = None
_async_group = None


def _checkpoint_group():
    """A gloo group of all ranks for async saves: the background thread's collectives must not share a group (or a
    stream) with the training loop's, which run at the same time. Made once (collective: every rank, same point)."""
    global _async_group
    if _async_group is None:
        _async_group = dist.new_group(backend="gloo")
    return _async_group


def wait_for_pending_save():
    """Block until this process's asynchronous save (if any) is on disk and renamed into place; raise its error.
    Every rank calls it at the same points (the next save, the end of training)."""
    global _pending
    if _pending is None:
        return
    pending, _pending = _pending, None
    pending.future.result()  # a write error on this rank raises here
    pending.finished.wait()
    if pending.error is not None:
        raise RuntimeError(f"finishing the sharded checkpoint {pending.step_dir} failed: {pending.error}") from pending.error


def _finish(partial, final, meta, step):
    """Rank 0, after every rank's shard and DCP's .metadata are on disk: the meta json, then the rename that makes
    the step complete."""
    atomic_json_save(meta, os.path.join(partial, META_FILE.format(step=step)))
    fsync_dir(partial)
    if os.path.isdir(final):  # saving a step again (a rerun): the new one replaces it
        shutil.rmtree(final)
    os.rename(partial, final)
    fsync_dir(os.path.dirname(final))
    logger.info(f"Saved sharded checkpoint step {step} to {final}")


def save_sharded(checkpoint_dir, step, state_dict, meta, async_save=False):
    """
    Write a sharded checkpoint of `state_dict` (train_state_dict's) and `meta` as step `step`. Every rank must call it.
    async_save: return once the state is copied to CPU memory; a background thread writes the files and rank 0
    renames the step into place when all ranks are done (training continues meanwhile). A save first waits for the
    previous asynchronous one, and the end of the run (nanochat.distributed.dist.compute_cleanup) waits for the last.
    """
    global _pending
    wait_for_pending_save()
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = sharded_step_dir(checkpoint_dir, step)
    partial = final + PARTIAL_SUFFIX
    if rank == 0:
        if os.path.isdir(partial):  # left by a save that was cut short
            shutil.rmtree(partial)
        os.makedirs(partial)
    if dist.is_initialized():
        dist.barrier()
    if not os.path.isdir(partial):
        raise RuntimeError(
            f"rank {rank} does not see {partial}, which rank 0 just created: sharded checkpoints need a checkpoint "
            f"directory every node sees (a shared filesystem; set NANOCHAT_BASE_DIR to one), or pass "
            f"--checkpoint_format=single to gather the model to rank 0 as nanochat does"
        )
    writer = dcp.FileSystemWriter(partial)
    if not async_save:
        dcp.save(state_dict, storage_writer=writer)
        if rank == 0:
            _finish(partial, final, meta, step)
        if dist.is_initialized():
            dist.barrier()  # nobody goes on (or loads it) before the step is complete
        return
    group = _checkpoint_group() if dist.is_initialized() else None
    future = dcp.async_save(state_dict, storage_writer=writer, process_group=group)
    if not isinstance(future, concurrent.futures.Future):
        future = future.upload_completion  # AsyncSaveResponse (with a custom stager)
    pending = _Pending(future, final, threading.Event())

    def done(fut):
        # on rank 0 DCP's future completes after .metadata is written, i.e. after every rank's shard is on disk
        try:
            if rank == 0 and fut.exception() is None:
                _finish(partial, final, meta, step)
        except BaseException as e:  # reported by wait_for_pending_save
            pending.error = e
        finally:
            pending.finished.set()

    future.add_done_callback(done)
    _pending = pending


# -----------------------------------------------------------------------------
# loading


def _reader(step_dir):
    return dcp.FileSystemReader(step_dir)


def _read_here(state_dict, step_dir):
    """dcp.load in this process alone (no collectives, whether or not a process group exists), without DCP's warning
    that it assumes so (evaluation and chat load sharded steps this way, and the warning would read as a problem)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state_dict, storage_reader=_reader(step_dir), no_dist=True)


def read_layout(step_dir):
    """The `layout` object of a step (model key order, optimizer layouts): no process group needed."""
    out = {"layout": io.BytesIO()}
    _read_here(out, step_dir)
    return pickle.loads(out["layout"].getvalue())


def read_model_state_dict(step_dir, dtype=None):
    """The full model of a sharded step in this process ({name: CPU tensor}, the keys in the model's order, as
    model_<step>.pt holds them), assembled from every rank's pieces. No process group needed; collective-free."""
    md = _reader(step_dir).read_metadata().state_dict_metadata
    layout = read_layout(step_dir)
    sd = {}
    for k in layout["model_keys"]:
        tmd = md[f"model.{k}"]
        sd[f"model.{k}"] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
    _read_here(sd, step_dir)
    return {k: (v if dtype is None else v.to(dtype)) for k, v in ((k, sd[f"model.{k}"]) for k in layout["model_keys"])}


def _template(tmd, p, kind):
    """An empty tensor to load a saved state tensor into: laid out like parameter p on this run's mesh when the saved
    one was sharded like it, else a plain (replicated) tensor."""
    if kind in ("dtensor", "local"):
        local = torch.empty(p.to_local().shape, dtype=tmd.properties.dtype, device=p.to_local().device)
        return _as_dtensor_like(local, p)
    return torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)


@torch.no_grad()
def load_sharded(step_dir, model, optimizers=(), fix=""):
    """
    Load a sharded step into this run's sharded model and optimizers, whatever the number of ranks that saved it
    (DCP reads each rank's rows from whichever files hold them). Every rank must call it. `fix`: what to tell the
    user when the optimizers do not match the saved ones (other optimizer flags).
    """
    md = _reader(step_dir).read_metadata().state_dict_metadata
    layout = read_layout(step_dir)
    names = _names(model)
    params = {n: p for p, n in names.items()}
    if len(layout["optimizers"]) != len(optimizers) and optimizers:
        raise BadValue(f"{step_dir} holds {len(layout['optimizers'])} optimizer states but this run built "
                         f"{len(optimizers)}: {fix}")
    model_sd = {f"model.{k.removeprefix('_orig_mod.')}": v for k, v in model.state_dict().items()}
    missing = sorted(k for k in model_sd if k not in md)
    if missing:
        raise BadValue(f"{step_dir} has no {missing[0].removeprefix('model.')} ({len(missing)} model tensor(s) "
                         f"missing): it holds another model; resume with the model flags of the run that saved it")
    for k, v in model_sd.items():
        if tuple(md[k].size) != tuple(v.shape):
            raise BadValue(f"{k.removeprefix('model.')}: {step_dir} holds shape {tuple(md[k].size)}, this model "
                             f"{tuple(v.shape)}: resume with the model flags of the run that saved it")
    sd = dict(model_sd)
    plan = []  # (optimizer, parameter, key, kind, state-dict key)
    for i, (opt, saved) in enumerate(zip(optimizers, layout["optimizers"])):
        mine = [[names[p] for p in g["params"]] for g in opt.param_groups]
        if mine != [g["params"] for g in saved["param_groups"]]:
            raise BadValue(f"{step_dir}: optimizer {i} ({saved['kind']}) grouped the parameters differently from "
                             f"this run's {type(opt).__name__}: {fix}")
        for name, keys in saved["state_keys"].items():
            for key, kind in keys.items():
                sk = f"optim.{i}.{name}.{key}"
                sd[sk] = _template(md[sk], params[name], kind)
                plan.append((opt, params[name], key, kind, sk))
    dcp.load(sd, storage_reader=_reader(step_dir))
    # the model's own tensors were loaded in place (model_sd shares their storage); the optimizers get theirs now
    for opt, saved in zip(optimizers, layout["optimizers"]):
        opt.state.clear()
        for g, sg in zip(opt.param_groups, saved["param_groups"]):
            g.update({k: v for k, v in sg.items() if k != "params"})
    for opt, p, key, kind, sk in plan:
        v = sd[sk]
        opt.state.setdefault(p, {})[key] = v.to_local() if kind == "local" else v
    return layout


# -----------------------------------------------------------------------------
# consolidation into nanochat's single-file layout


def _rows(full, rank, world):
    """Rank `rank`'s dim-0 rows of `full` in FSDP's layout (torch.chunk: ceil(rows/world) each, the last ones short
    or empty), as nanochat/distributed/fsdp.py shards parameters."""
    chunk = -(-full.shape[0] // world)
    start = min(rank * chunk, full.shape[0])
    return full[start : start + chunk].clone()


def consolidate(step_dir, out_dir, step, optimizer=True):
    """
    Write step `step` of a sharded checkpoint as nanochat's single-file checkpoint in out_dir: model_<step>.pt (the
    full model, rank 0's file on the gather path), meta_<step>.json (unchanged) and, with optimizer=True, one
    optim_<step>_rank<r>.pt per rank of the world size that saved it, each what that rank's FSDPAdamW/FSDPMuon
    state_dict() held (the single-file format resumes on that world size only); a step saved without optimizer state
    (save_stage_model) gets none, and a tensor-parallel step's optimizer state is refused (BadValue: it resumes from
    the sharded step). Files are written atomically, meta last. Returns the paths written.
    """
    meta = read_meta(os.path.join(step_dir, META_FILE.format(step=step)), os.path.dirname(step_dir), step)
    world = meta.get("world_size", 1)
    layout = read_layout(step_dir)
    if optimizer and layout["optimizers"] and meta.get("parallel") == "tp":
        # per-rank files hold each rank's rectangle of the (dp, tp) mesh, which only that layout's world reproduces;
        # the sharded step itself resumes on any layout and number of ranks
        raise BadValue(f"step {step} was saved by the --tp_size={meta.get('tp_size', '?')} path: its optimizer state "
                       f"stays in {step_dir} (it resumes from there with --use_fsdp=1 or --tp_size, any number of "
                       f"ranks); consolidate the model and meta only (--optimizer=0)")
    model_path, meta_path, _ = step_paths(out_dir, step)
    os.makedirs(out_dir, exist_ok=True)
    model = read_model_state_dict(step_dir)
    atomic_torch_save(model, model_path)
    written = [model_path]
    if optimizer and layout["optimizers"]:  # a stage's model-only step (SFT, RL) has no optimizer files, as today
        md = _reader(step_dir).read_metadata().state_dict_metadata
        full = {}
        for i, saved in enumerate(layout["optimizers"]):
            for name, keys in saved["state_keys"].items():
                for key in keys:
                    sk = f"optim.{i}.{name}.{key}"
                    full[sk] = torch.empty(tuple(md[sk].size), dtype=md[sk].properties.dtype)
        _read_here(full, step_dir)
        for r in range(world):
            per_rank = []
            for i, saved in enumerate(layout["optimizers"]):
                index = {name: j for j, name in enumerate(n for g in saved["param_groups"] for n in g["params"])}
                state = {}
                for name, keys in sorted(saved["state_keys"].items(), key=lambda kv: index[kv[0]]):
                    state[index[name]] = {key: (_rows(full[f"optim.{i}.{name}.{key}"], r, world) if kind != "tensor"
                                                else full[f"optim.{i}.{name}.{key}"].clone())
                                          for key, kind in keys.items()}
                groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
                          for g in saved["param_groups"]]
                per_rank.append({"state": state, "param_groups": groups,
                                 "dist": {"world_size": world, "rank": r, "kind": saved["kind"]}})
            path = step_paths(out_dir, step, r)[2]
            atomic_torch_save(per_rank, path)
            written.append(path)
    atomic_json_save(meta, meta_path)  # last: the step is complete once meta is there
    return written + [meta_path]
