"""
torch.distributed in one place: process-group setup and the few collectives the training and evaluation loops use.

- `get_dist_info`, `compute_init`, `compute_cleanup`, `barrier`: who am I under torchrun, the device, the process
  group (nccl on CUDA, gloo on CPU) with a timeout long enough for rank 0 to write a large checkpoint; at exit the
  groups are really torn down (`release_process_groups`), not left to interpreter shutdown.
- `dist_world_size`, `collective_device`: the initialised world (1 without a process group) and where a small tensor for a
  collective must live.
- `all_reduce_mean`, `all_reduce_sum`, `any_rank`, `max_over_ranks`, `gather_objects`: python values across ranks.
- `raise_on_every_rank`: an error one rank hits before a collective becomes an error on every rank (not a hang).
- `DataRanks`, `process_data_ranks`: how loaders and evaluations split work: (data rank, data world, tp rank). The run's
  parallel plan (nanochat/distributed/parallel.py) owns the answer under tensor parallelism (the tp ranks of a group
  see the same data: data rank = rank // tp_size) and passes it down; without a plan it is this process's rank and
  world, tp rank 0.

Every function works in a single process (without torch.distributed initialised) and then does what the plain code
would: a mean of one value is the value, and so on. nanochat's names (`get_dist_info`, `compute_init`, ...) are also
importable from `nanochat.common`, as in nanochat.
"""

import atexit
import datetime
import logging
import os
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanochat.usage import BadValue, BrokenSetup, CannotRun

# Before any process group exists: torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when
# it is imported, and torch._dynamo imports it (a script's first torch.compile or optimizer). Imported after
# init_process_group it would hold the world group for the life of the process (see release_process_groups); imported
# here it binds None.
if dist.is_available():
    import torch.distributed.nn  # noqa: F401

logger = logging.getLogger(__name__)

# NCCL's watchdog kills a collective that waits longer than the process group's timeout (10 minutes by default). At
# every checkpoint rank 0 writes the model file while the other ranks wait in the next collective: for d64 that is
# ~50 GB, which takes longer than 10 minutes on ordinary disks. One hour covers that with room; a real hang is then
# reported after an hour instead of ten minutes. Override with NANOCHAT_DIST_TIMEOUT_MIN.
DEFAULT_DIST_TIMEOUT_MIN = 60


def get_dist_info():
    """(is_distributed, rank, local_rank, world_size) from torchrun's environment variables."""
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


class DataRanks(NamedTuple):
    """Which share of the data and of an evaluation's problems this process takes."""

    rank: int  # this process's data rank
    world: int  # the number of data ranks
    tp_rank: int = 0  # its place in a tensor-parallel group: only tp rank 0 counts the group's results


def process_data_ranks():
    """DataRanks of a run without tensor parallelism: the process group's rank and world (torchrun's before init)."""
    _, rank, _, world = get_dist_info()
    if is_ddp_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DataRanks(rank, world, 0)


def is_ddp_initialized():
    return dist.is_available() and dist.is_initialized()


def dist_world_size():
    """Ranks in the initialised process group; 1 without one."""
    return dist.get_world_size() if is_ddp_initialized() else 1


def collective_device():
    """Where a small tensor for a collective lives: the current CUDA device under nccl, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def autodetect_device_type():
    """
    cuda > mps > cpu. A machine whose nvidia-smi lists GPUs that this torch cannot use (a CPU-only wheel, one built for
    a newer CUDA than the driver) is refused with nanochat.setup_check's message, what the launchers check: a script
    started directly never trains on the CPU of a GPU node by accident. Hiding the GPUs on purpose
    (CUDA_VISIBLE_DEVICES="" or -1) or passing --device_type=cpu runs on the CPU.
    """
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    from nanochat.setup_check import gpu_problem, nvidia_smi_gpus

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")
    if not hidden and nvidia_smi_gpus():
        raise BrokenSetup(f"{gpu_problem()} Or pass --device_type=cpu to run on the CPU on purpose.")
    return "cpu"


def dist_timeout():
    """The process group's collective timeout: $NANOCHAT_DIST_TIMEOUT_MIN minutes, default DEFAULT_DIST_TIMEOUT_MIN."""
    raw = os.environ.get("NANOCHAT_DIST_TIMEOUT_MIN", "")
    try:
        minutes = float(raw) if raw.strip() else DEFAULT_DIST_TIMEOUT_MIN
    except ValueError:
        minutes = -1
    if not minutes > 0:
        raise BadValue(f"NANOCHAT_DIST_TIMEOUT_MIN must be a positive number of minutes, got {raw!r}")
    return datetime.timedelta(minutes=minutes)


def init_process_group(backend, **kwargs):
    """
    dist.init_process_group from torchrun's environment (env://), with dist_timeout(). After torchrun restarted the
    workers (--max-restarts; TORCHELASTIC_RESTART_COUNT > 0) the process group's keys go under a prefix of their own:
    the store can outlive a restart, and the addresses the dead ranks published there would otherwise be read by the
    new ones (gloo then fails with "connectFullMesh ... Connection refused").
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart in ("", "0"):
        return dist.init_process_group(backend=backend, timeout=dist_timeout(), **kwargs)
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=dist_timeout()))
    store = dist.PrefixStore(f"nanochat/restart_{restart}/", store)
    return dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=dist_timeout(),
                                   **kwargs)


def compute_init(device_type=None, seed=42):
    """
    Seed, pick the device and, under torchrun, init the process group (nccl on CUDA, gloo on CPU) with dist_timeout().
    Returns (ddp, rank, local_rank, world_size, device).
    """
    device_type = device_type or autodetect_device_type()
    if device_type not in ("cuda", "mps", "cpu"):
        raise BadValue(f"device_type must be one of cuda|mps|cpu, got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise CannotRun("--device_type=cuda was asked for but torch sees no CUDA device; use --device_type=cpu")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise CannotRun("--device_type=mps was asked for but MPS is not available; use --device_type=cpu")
    if device_type == "cuda":
        # Before the first CUDA allocation: growable segments instead of fixed blocks, so the memory a compiled training
        # step freed can serve an eager evaluation's differently shaped tensors (on an H100, d20 at device batch 32
        # otherwise ran out of memory at its first evaluation with 46 GiB reserved but unallocated). A user's setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")

    ddp, rank, local_rank, world = get_dist_info()
    if ddp and device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            init_process_group("nccl", device_id=device)
        dist.barrier()
    elif ddp:
        if device_type == "mps":
            raise CannotRun("distributed training on MPS is not supported; use --device_type=cpu under torchrun")
        device = torch.device("cpu")
        if not dist.is_initialized():
            init_process_group("gloo")
        dist.barrier()
    else:
        device = torch.device(device_type)
    if rank == 0:
        logger.info(f"Distributed world size: {world}" if ddp else f"Single process on {device}")
    return ddp, rank, local_rank, world, device


def compute_cleanup():
    global _release_registered
    sharded = sys.modules.get("nanochat.checkpoint.sharded")  # loaded only by runs that write sharded checkpoints
    if sharded is not None:
        sharded.wait_for_pending_save()  # an --async_save checkpoint still being written needs the group to finish
    if is_ddp_initialized():
        # every rank reaches the end before the group goes: a rank that tears gloo down while a peer is still busy
        # (rank 0 printing results, say) was seen to abort the peer ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()
        if not _release_registered:
            # at exit, not now: the caller's model and optimizers (which hold the groups under FSDP2/TP) are alive
            # until its main returns; atexit runs after that and before the interpreter starts tearing down
            atexit.register(release_process_groups)
            _release_registered = True


_release_registered = False


def release_process_groups():
    """
    Let the process groups that `destroy_process_group` left behind go while Python is whole. destroy_process_group
    drops torch's own references and shuts NCCL down explicitly, but a gloo group is torn down (its threads joined)
    only with its last reference, and every DeviceMesh holds its groups (`_pg_registry`) while DTensor's caches
    (sharding propagation, redistribute plans, mesh topology) keep the meshes for the life of the process. After FSDP2
    or TP the gloo group therefore outlived the run, its threads still running when the interpreter shut down. A gloo
    group left to process exit is the known cause of "terminate called without an active exception" (torch's own
    tests hit it and cured it with an explicit teardown), the SIGABRT CI saw now and then on 2-rank runs that had
    already finished their work. tests/distributed/test_dist_train.py checks that no gloo thread is left after this.
    """
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # models and optimizers that only cycles still hold
    for obj in gc.get_objects():
        if type(obj) is DeviceMesh:
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
    gc.collect()


def barrier():
    if is_ddp_initialized():
        dist.barrier()


# -----------------------------------------------------------------------------
# python values across ranks


def all_reduce_mean(value, device):
    """Mean of a python float across ranks (identity in a single process)."""
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    if dist_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t.item()


def all_reduce_sum(values, device):
    """Element-wise sum of a list of python numbers across ranks, as floats (float64, exact for counts)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def any_rank(flag, device):
    """True on every rank if `flag` is true on any (e.g. ranks pass an epoch end at slightly different steps)."""
    return bool(max_over_ranks(int(bool(flag)), device))


def max_over_ranks(value, device):
    """The largest of a python int across ranks (the value itself in one process)."""
    if dist_world_size() == 1:
        return int(value)
    t = torch.tensor(int(value), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather_objects(obj):
    """List of `obj` from every rank (rank order); [obj] in a single process."""
    if dist_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def raise_on_every_rank(error, what):
    """
    Every rank calls this with the exception it hit (or None) before the next collective. If any rank hit one,
    every rank raises: its own exception where it has one, else a RuntimeError naming the ranks that failed and why.
    In one process (or without torch.distributed initialised) it only re-raises `error` if there is one.
    """
    if dist_world_size() == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([int(error is not None)], dtype=torch.long, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return
    messages = gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = {r: m for r, m in enumerate(messages) if m is not None}
    raise RuntimeError(f"{what} failed on " + "; ".join(f"rank {r}: {m}" for r, m in failed.items()))
