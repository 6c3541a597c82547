"""
The run's parallel plan: one object, chosen once from the flags, that owns how the run spreads over the ranks: the
device mesh, which share of the data this rank reads, the order in which the model is made ready, and the few
operations the training loop needs. The loop never asks which strategy it has; it asks the plan's capabilities.

    parallel = parallel_from_config(config)                 # the flags (parallel_flags) -> a frozen ParallelConfig
    parallel.bind(rank, world, device_type)                 # the one place: the data ranks and the device mesh
    parallel.data_rank, parallel.data_world                 # this rank's shard of the data, the number of shards
    parallel.data_ranks                                     # DataRanks for the evaluations (core_eval, chat_eval)
    parallel.read_ranks                                     # the data ranks this process reads (several: --data_world_size)
    model, orig_model = parallel.prepare(model, config, device, autocast)   # AC -> FP8 -> TP -> FSDP -> compile
    optimizers = parallel.setup_optimizers(orig_model, matrix_lr=..., ...)
    parallel.set_grad_sync(model, micro_step, grad_accum)  # before each micro-step's forward (training.train_step)
    parallel.clip_grad_norm(model, max_norm)                # the global gradient norm, clipped (training.train_step)
    parallel.after_optimizer_step(model)                    # after all optimizers stepped (training.train_step)
    state = parallel.model_state_dict(model)                # every rank calls; rank 0 gets the full single-file state
    parallel.load_model_state_dict(model, state)            # a full state dict (any strategy's checkpoint)
    parallel.checkpoint_format, parallel.check_resume(...)  # what a save writes, whether a step resumes here
    parallel.collective_forward                             # True: every forward is a collective (sample on all ranks)
    with parallel.full_weights(model): ...                  # forwards inside are local (chat_rl's sampling)

Three strategies (docs/distributed.md compares them):

- `DataParallel` (name "ddp", the default): every rank holds the whole model and its local gradients; DistAdamW and
  DistMuon average the gradients and shard the optimizer state themselves (in one process: plain AdamW and Muon).
  There is no wrapper, so nothing to do per micro-step.
- `FSDP` (name "fsdp", `--use_fsdp=1`): FSDP2 shards parameters, gradients and optimizer state over a 1-D mesh of all
  ranks (nanochat/distributed/fsdp.py has the mechanics). With defer_grad_sync the gradients are reduce-scattered once
  per step instead of per micro-step.
- `TensorParallel` (name "tp", `--tp_size=N`, N > 1): the blocks' matrices split over N ranks (heads and MLP units),
  composed with FSDP2 over the world/N data ranks on a 2-D ("dp", "tp") mesh (nanochat/distributed/tensor_parallel.py).
  The N ranks of a tensor-parallel group read the same data: the data rank is rank // N, the data world world // N,
  and only tp rank 0 counts a group's evaluation results.

The capabilities (class attributes) say what a strategy can do, so callers never compare names: `shards_weights`
(FSDP's FP8 all-gather applies), `fp8_supported`, `has_full_weights` (ranks can sample alone), `collective_forward`,
`compile_per_block`, `reads_sharded_checkpoint`.

The configuration (`ParallelConfig`) is typed, frozen and checked once, in `__post_init__`; its flags are declared
beside it (`parallel_flags`, defaults taken from the dataclass), including the environment switch that changes the
layout (NANOCHAT_SHARED_FS is the default of --shared_fs), so the parsed flags the run records are what it ran with.
The model shape against the layout (tp size vs heads, MLP width and world size) is checked in one function,
`check_layout`, which scripts may call at start-up before anything is built.

Checkpoints: the DDP path writes nanochat's single files (the model from rank 0, one optimizer file per rank);
the FSDP and tensor-parallel paths write sharded steps (one directory per step, every rank its shard,
nanochat/checkpoint/sharded.py) unless --checkpoint_format=single, and every loader reads both. The model file is the
same for all, so a later stage may use any strategy on an earlier stage's model. Resuming single-file optimizer state
needs the strategy (and tp size) it was saved with (`check_resume`); a sharded step resumes on either DTensor layout
(FSDP, FSDP x TP) and any number of ranks. Another strategy (HSDP, pipeline parallelism) is one more class here plus
a line in `parallel_from_config`.
"""

import contextlib
import os
from dataclasses import dataclass, fields

import torch

from nanochat.checkpoint_manager import clean_state_dict
from nanochat.common import print0
from nanochat.distributed.dist import DataRanks, is_ddp_initialized
from nanochat.fp8 import precompute_fp8_scales, uses_fp8_all_gather
from nanochat.usage import BadValue, CannotRun

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHECKPOINT_FORMATS = ("auto", "sharded", "single")


@dataclass(frozen=True)
class ParallelConfig:
    """
    How the run spreads over the ranks, as the flags of parallel_flags() set it (their defaults are these), checked
    once here. `multi_node` is not a flag: it is a fact of the launch (torchrun's WORLD_SIZE > LOCAL_WORLD_SIZE),
    read by from_flags.
    """

    activation_checkpointing: str = "none"  # none | full | selective (nanochat/gpt.py AC_MODES)
    ac_every: int = 2
    use_fsdp: bool = False
    fsdp_reduce_dtype: str = "float32"
    fsdp_defer_grad_sync: bool = False
    tp_size: int = 1
    checkpoint_format: str = "auto"  # as asked; `saves` is what the run writes
    async_save: bool = False
    shared_fs: bool = True  # every node sees the base dir (NANOCHAT_SHARED_FS)
    data_world_size: int = 1  # base_train's replay of W data ranks in one process
    multi_node: bool = False

    @classmethod
    def from_flags(cls, config):
        """The config of a script's parsed flags (a dict); a flag the script does not declare keeps its default."""
        names = {f.name for f in fields(cls)} - {"multi_node"}
        return cls(**{k: config[k] for k in names if k in config}, multi_node=launched_on_several_nodes())

    def __post_init__(self):
        from nanochat.gpt import AC_MODES

        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise BadValue(f"--tp_size must be a whole number >= 1 (1 = no tensor parallelism), got {tp!r}")
        if self.activation_checkpointing not in AC_MODES:
            raise BadValue(f"--activation_checkpointing must be one of {'|'.join(AC_MODES)}, "
                           f"got {self.activation_checkpointing!r}")
        if self.fsdp_reduce_dtype not in REDUCE_DTYPES:
            raise BadValue(f"--fsdp_reduce_dtype must be float32 or bfloat16, got {self.fsdp_reduce_dtype!r}")
        fmt = self.checkpoint_format
        if fmt not in CHECKPOINT_FORMATS:
            raise BadValue(f"--checkpoint_format must be auto, sharded or single, got {fmt!r}")
        if fmt == "sharded" and not self.sharded_layout:
            raise BadValue("--checkpoint_format=sharded needs --use_fsdp=1 or --tp_size > 1: the DDP path writes "
                           "nanochat's single files; use --checkpoint_format=auto")
        if fmt == "sharded" and self.node_local_dirs:
            # every rank writes into one sharded directory: nodes with their own base dirs cannot share it
            raise BadValue("--checkpoint_format=sharded needs a checkpoint directory every node sees, and "
                           "NANOCHAT_SHARED_FS=0 (--shared_fs=0) says the nodes have their own base dirs: use "
                           "--checkpoint_format=auto (single files, docs/multinode.md) or put NANOCHAT_BASE_DIR on a "
                           "shared filesystem")
        if self.async_save and self.saves != "sharded":
            raise BadValue("--async_save=1 writes sharded checkpoints in the background: it needs --use_fsdp=1 or "
                           "--tp_size > 1 with --checkpoint_format=auto or sharded, and a checkpoint directory every "
                           "node sees (not NANOCHAT_SHARED_FS=0 on several nodes); use --async_save=0 here")
        if self.fsdp_defer_grad_sync and not self.sharded_layout:
            raise BadValue("--fsdp_defer_grad_sync=1 needs --use_fsdp=1 (or --tp_size > 1)")

    @property
    def sharded_layout(self):
        """The weights are DTensors (FSDP, or TP, which always runs FSDP over the data ranks)."""
        return self.use_fsdp or self.tp_size > 1

    @property
    def node_local_dirs(self):
        """A multi-node run whose nodes each have their own base dir (the launchers' NANOCHAT_SHARED_FS=0)."""
        return self.multi_node and not self.shared_fs

    @property
    def saves(self):
        """The checkpoint format the run writes: sharded (FSDP, TP) unless asked for single or the nodes' base dirs
        are their own; single on the DDP path."""
        if not self.sharded_layout or self.checkpoint_format == "single":
            return "single"
        return "single" if self.checkpoint_format == "auto" and self.node_local_dirs else "sharded"


def launched_on_several_nodes():
    """torchrun's environment says the world spans more than this node."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


def parallel_flags():
    """The plan's flags, for the scripts that train the whole model in place (base, mid, SFT, RL); their defaults are
    ParallelConfig's. --shared_fs takes its default from NANOCHAT_SHARED_FS, as the launchers set it."""
    from nanochat.configurator import Flag
    from nanochat.gpt import AC_MODES

    d = ParallelConfig()
    return [
        Flag("activation_checkpointing", d.activation_checkpointing, "recompute block activations in the backward "
             "instead of keeping them (less memory, ~1/3 more compute): none, full (every block) or selective (every "
             "--ac_every-th block)", choices=list(AC_MODES)),
        Flag("ac_every", d.ac_every, "selective activation checkpointing: checkpoint blocks 0, k, 2k, ... for k = "
             "ac_every", min=1),
        Flag("use_fsdp", d.use_fsdp, "shard parameters, gradients and optimizer state over the ranks (FSDP2; "
             "nanochat/distributed/parallel.py) instead of replicating the model on every rank"),
        Flag("fsdp_reduce_dtype", d.fsdp_reduce_dtype, "FSDP: dtype of the gradient reduce-scatter",
             choices=list(REDUCE_DTYPES)),
        Flag("fsdp_defer_grad_sync", d.fsdp_defer_grad_sync, "FSDP: reduce-scatter gradients once per step, not per "
             "micro-step (more memory, less traffic)"),
        Flag("tp_size", d.tp_size, "tensor parallelism over this many ranks (attention heads and the MLP split across "
             "them; nanochat/distributed/tensor_parallel.py), FSDP over the rest; must divide the world size and the "
             "heads", min=1),
        Flag("checkpoint_format", d.checkpoint_format, "auto = sharded with --use_fsdp=1 or --tp_size > 1 (single "
             "with --shared_fs=0 on several nodes), single otherwise; sharded = every rank writes its shard "
             "(torch.distributed.checkpoint; resumes on any number of ranks, FSDP or TP); single = nanochat's files, "
             "the model gathered to rank 0", choices=list(CHECKPOINT_FORMATS)),
        Flag("async_save", d.async_save, "sharded checkpoints: write them in a background thread while training goes "
             "on"),
        Flag("shared_fs", d.shared_fs, "every node sees the base dir (0: each node has its own; the launchers' "
             "NANOCHAT_SHARED_FS): on several nodes, sharded checkpoints need it", env="NANOCHAT_SHARED_FS"),
    ]


def valid_tp_sizes(model_config, world):
    """tp sizes that divide the world size and, with a model config, the heads and the MLP width."""
    return [t for t in range(1, world + 1) if world % t == 0 and
            (model_config is None or (model_config.n_head % t == 0 and model_config.n_kv_head % t == 0
                                      and (4 * model_config.n_embd) % t == 0))]


def check_layout(model_config, tp_size, world):
    """
    The one check of a layout against the model and the world: tp_size must divide the world size (ranks = data ranks
    x tp_size) and, with a model config (a GPTConfig; None = the world only), n_head, n_kv_head and the MLP width
    4*n_embd (each tp rank takes whole heads). BadValue (a usage error) naming the sizes that work. Needs no process
    group and no model: start-up checks call it with the config a depth gives and torchrun's WORLD_SIZE.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise BadValue(f"--tp_size must be a whole number >= 1 (1 = no tensor parallelism), got {tp_size!r}")
    ok = ", ".join(map(str, valid_tp_sizes(model_config, world)))
    if world % tp_size != 0:
        raise BadValue(f"--tp_size={tp_size} does not divide the world size {world}; use one of: {ok}")
    if model_config is None:
        return
    for what, n in (("n_head", model_config.n_head), ("n_kv_head", model_config.n_kv_head),
                    ("the MLP width 4*n_embd", 4 * model_config.n_embd)):
        if n % tp_size != 0:
            raise BadValue(f"--tp_size={tp_size} does not divide {what}={n} (each tp rank takes whole heads); use one "
                           f"of: {ok}")


class DataParallel:
    """The DDP path: the whole model on every rank; the optimizers do the communication (see module docstring)."""

    name = "ddp"
    flag = "--use_fsdp=0"
    reads_sharded_checkpoint = False  # True: resumes a sharded step (a DTensor layout, any number of ranks)
    collective_forward = False  # ranks may run different forwards (rank 0 samples alone, ranks split eval problems)
    compile_per_block = False  # torch.compile the whole model (nanochat/compile.py)
    shards_weights = False  # weights are all-gathered for each forward (FP8 may then all-gather in FP8)
    fp8_supported = True  # --fp8=1 works on this layout
    has_full_weights = True  # full_weights() gives every rank the whole model (ranks can sample alone)

    def __init__(self, config=None):
        self.config = config if config is not None else self.default_config()
        self.mesh = None  # the device mesh the weights are laid out on (bind builds it where there is one)
        self.rank = self.world_size = self._ranks = None  # set by bind

    @staticmethod
    def default_config():
        return ParallelConfig()

    # ---------------------------------------------------------------- ranks, mesh, and which data each rank reads

    def data_rank_and_world(self, rank, world):
        """(this rank's data shard, number of data shards): every rank reads its own data on this path."""
        return rank, world

    def bind(self, rank, world, device_type=None):
        """
        The one place where the plan meets the ranks: this process's rank and the world give (data rank, data world,
        tp rank), and, with a device type under torch.distributed, the device mesh the layout needs (wrap uses it).
        --data_world_size > 1 (one process only) replays a run of that many data ranks: this process reads all their
        data (read_ranks) in the order the ranks would have, so a test can compare runs exactly.
        """
        data_rank, data_world = self.data_rank_and_world(rank, world)
        if self.config.data_world_size > 1 and world > 1:
            raise BadValue("--data_world_size is for single-process runs that reproduce a multi-rank run; unset it")
        self.rank, self.world_size = rank, world
        self._ranks = DataRanks(data_rank, data_world, rank - data_rank * (world // data_world))
        if device_type is not None and is_ddp_initialized() and self.mesh is None:
            self.mesh = self.build_mesh(device_type, world)
        return self

    def build_mesh(self, device_type, world):
        """The device mesh of this layout (bind calls it): none on this path."""
        return None

    def _bind_to_process_group(self, device):
        """wrap() on a plan nobody bound (a tool, a test): the process group's ranks, through bind."""
        if self.mesh is None:
            self.bind(torch.distributed.get_rank(), torch.distributed.get_world_size(), torch.device(device).type)

    @property
    def data_ranks(self):
        """DataRanks(rank, world, tp_rank) for loaders and evaluations: bind's (an unbound plan has none to give)."""
        if self._ranks is None:
            raise RuntimeError("the parallel plan is not bound to this process's ranks: call parallel.bind(rank, world) "
                               "(Stage does) before asking for its data ranks")
        return self._ranks

    @property
    def data_rank(self):
        return self.data_ranks.rank

    @property
    def data_world(self):
        return self.data_ranks.world

    @property
    def read_world(self):
        """The data ranks the batch arithmetic counts: data_world, or --data_world_size in a replaying process."""
        return max(self.data_world, self.config.data_world_size)

    @property
    def read_ranks(self):
        """The data ranks this process reads: its own, or all of --data_world_size's when it replays them."""
        return list(range(self.read_world)) if self.read_world != self.data_world else [self.data_rank]

    # ---------------------------------------------------------------- the model

    needs_process_group = False  # FSDP and TP shard over a process group: torchrun, even with one process

    def check_launch(self, model_config, world, distributed):
        """Before any process group or model: a usage error when this layout cannot run here (FSDP/TP outside torchrun)
        or cannot split a model of this shape (model_config; None: not known yet) over `world` ranks (TP: the heads
        and the MLP over --tp_size)."""
        if self.needs_process_group and not distributed:
            raise CannotRun(f"{self.flag} needs torch.distributed: launch with torchrun (even --nproc_per_node=1)")

    def prepare(self, model, config, device, autocast=None):
        """
        Make a built or loaded model ready to train, in the one order that works: activation checkpointing
        (--activation_checkpointing/--ac_every) and FP8 (--fp8) on the plain modules, then the layout (TP, then FSDP:
        they wrap what AC and FP8 set), then torch.compile (--compile, where the script has it) of the wrapped model.
        Returns (model to train, uncompiled model for evaluation, sampling and saving).
        """
        chosen = model.set_activation_checkpointing(self.config.activation_checkpointing, self.config.ac_every)
        if chosen:
            print0(f"Activation checkpointing ({self.config.activation_checkpointing}): {len(chosen)} of "
                   f"{len(model.transformer.h)} blocks recompute their activations in the backward")
        if config.get("fp8"):
            from nanochat.fp8 import apply_fp8

            if not self.fp8_supported:
                # torchao's float8 linears need their own TP styles (Float8ColwiseParallel...), not wired up here
                raise BadValue(f"--fp8=1 does not work with {self.flag} yet: use --fp8=0, or --tp_size=1 (--use_fsdp=1)")
            apply_fp8(model, config.get("fp8_recipe", "tensorwise"), device, fsdp=self.shards_weights, log=print0,
                      filter=config.get("fp8_filter", "auto"), impl=config.get("fp8_impl", "torchao"))
        model = self.wrap(model, device)
        if "compile" not in config:
            return model, model
        from nanochat.compile import maybe_compile

        compiled = maybe_compile(model, config["compile"], device, config["device_batch_size"], config["max_seq_len"],
                                 self.compile_per_block, autocast)
        return compiled, model

    def wrap(self, model, device):
        """The layout alone (prepare calls it): nothing to do on this path."""
        return model

    def setup_optimizers(self, model, **kwargs):
        """kwargs: unembedding_lr, embedding_lr, matrix_lr, weight_decay, use_muon (GPT.setup_optimizers)."""
        return model.setup_optimizers(**kwargs)

    def set_grad_sync(self, model, micro_step, grad_accum_steps):
        pass  # gradients stay local until the optimizer step averages them

    def clip_grad_norm(self, model, max_norm):
        """
        Clip by the global gradient norm; returns it (a float). Under DistAdamW/DistMuon each rank still holds its own
        local gradient here (the optimizers reduce later), so the norm is of the local gradient, as nanochat does;
        under FSDP the gradients are sharded DTensors on one mesh and torch computes the true global norm.
        """
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm.item()

    def after_optimizer_step(self, model):
        pass  # the weights are plain tensors: nothing is derived from them between steps

    def full_weights(self, model):
        """A context in which every rank holds the whole model and its forwards are local: here, always."""
        return contextlib.nullcontext(model)

    # ---------------------------------------------------------------- checkpoints

    @property
    def checkpoint_format(self):
        """What a save of this run writes (nanochat/checkpoint/train_state.py dispatches on it): "single" | "sharded"."""
        return self.config.saves

    @property
    def async_save(self):
        return self.config.async_save

    def resume_meta(self):
        """What a training checkpoint records about the layout (check_resume compares it)."""
        return {"parallel": self.name}

    def model_state_dict(self, model):
        """The full model state, nanochat's single-file format (every rank has it; rank 0 saves it)."""
        return clean_state_dict(model.state_dict())

    def load_model_state_dict(self, model, state_dict):
        model.load_state_dict(clean_state_dict(state_dict), strict=True)

    def check_resume(self, meta, step, fmt="single"):
        """
        Refuse optimizer state this run cannot take: a single-file step saved by another strategy or tp size (its
        per-rank files hold other shapes), or a sharded step on a path without DTensors (this one).
        """
        saved = saved_flag(meta)
        if fmt == "sharded":
            if self.reads_sharded_checkpoint:
                return
            raise BadValue(
                f"step {step} is a sharded checkpoint (saved by the {saved} path), whose optimizer state this "
                f"{self.flag} run cannot resume: resume with {saved}, or --use_fsdp=1 / --tp_size (any layout and "
                f"number of ranks), or consolidate it into per-rank files first (python -m "
                f"scripts.consolidate_checkpoint). Its model alone loads anywhere (mid_train, chat_cli, base_loss)."
            )
        if saved != self.flag:
            raise BadValue(
                f"step {step} was saved by the {saved} path, whose optimizer state this {self.flag} run cannot "
                f"resume: resume with {saved}. (The model file itself is the same on every path: later stages "
                f"such as mid_train load it with any strategy and tp size.)"
            )


class FSDP(DataParallel):
    """FSDP2 on a 1-D mesh over all ranks (nanochat/distributed/fsdp.py): parameters, gradients and optimizer state sharded."""

    name = "fsdp"
    flag = "--use_fsdp=1"
    needs_process_group = True
    collective_forward = True  # each forward all-gathers weights: every rank must run the same forwards
    compile_per_block = True  # FSDP's hooks break a whole-model graph: compile each block and the head
    shards_weights = True
    reads_sharded_checkpoint = True

    def __init__(self, config=None):
        super().__init__(config)
        self.fp8_all_gather = False  # set by wrap: weights all-gathered in FP8 (--fp8=1, tensorwise)

    @staticmethod
    def default_config():
        return ParallelConfig(use_fsdp=True)

    @property
    def reduce_dtype(self):
        return REDUCE_DTYPES[self.config.fsdp_reduce_dtype]

    @property
    def defer_grad_sync(self):
        return self.config.fsdp_defer_grad_sync

    def build_mesh(self, device_type, world):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (world,))  # 1-D over all ranks

    def wrap(self, model, device):
        from nanochat.distributed.fsdp import apply_fsdp

        if not is_ddp_initialized():
            raise CannotRun("--use_fsdp=1 needs torch.distributed: launch with torchrun (even --nproc_per_node=1)")
        self._bind_to_process_group(device)
        device_type = torch.device(device).type
        # bf16 all-gathered weights for compute on CUDA (the sharded masters stay fp32), fp32 on CPU
        param_dtype = torch.bfloat16 if device_type == "cuda" else None
        model = apply_fsdp(model, mesh=self.mesh, param_dtype=param_dtype, reduce_dtype=self.reduce_dtype)
        self.fp8_all_gather = uses_fp8_all_gather(model)
        return model

    def setup_optimizers(self, model, **kwargs):
        from nanochat.optim.sharded import setup_fsdp_optimizers

        return setup_fsdp_optimizers(model, **kwargs)

    def set_grad_sync(self, model, micro_step, grad_accum_steps):
        # defer_grad_sync: reduce-scatter once, after the last micro-step (less traffic with many micro-steps, costs
        # one unsharded gradient per rank). torch.compile wraps the FSDP module: the setter is on the original.
        if self.defer_grad_sync:
            getattr(model, "_orig_mod", model).set_requires_gradient_sync(micro_step == grad_accum_steps - 1)

    def full_weights(self, model):
        # one all-gather of every group, then forwards without collectives; freed on exit (nanochat/distributed/fsdp.py)
        from nanochat.distributed.fsdp import full_weights

        return full_weights(model)

    def after_optimizer_step(self, model):
        # --fp8=1 (tensorwise): the weights are all-gathered in FP8; their scales for the next step in one all-reduce
        if self.fp8_all_gather:
            precompute_fp8_scales(getattr(model, "_orig_mod", model))

    def model_state_dict(self, model):
        """Gathered one tensor at a time; rank 0 gets the full state on the CPU, the other ranks {}."""
        from nanochat.distributed.fsdp import full_model_state_dict

        return full_model_state_dict(model)

    def load_model_state_dict(self, model, state_dict):
        from nanochat.distributed.fsdp import load_full_model_state_dict

        load_full_model_state_dict(model, clean_state_dict(state_dict))


class TensorParallel(FSDP):
    """
    Tensor parallelism over tp_size ranks composed with FSDP2 over the data ranks (nanochat/distributed/tensor_parallel.py):
    every forward is collective, the tp ranks of a group read the same data; checkpoints are sharded steps (FSDP's
    resharding and consolidation) or, with --checkpoint_format=single, the full single model file.
    """

    name = "tp"
    collective_forward = True  # two all-reduces per block in every forward
    compile_per_block = True
    fp8_supported = False  # torchao's float8 linears need their own TP styles
    reads_sharded_checkpoint = True  # DCP reads each tensor's rectangle wherever the saving layout put it
    has_full_weights = False  # the blocks' matrices stay split over the tp ranks

    def __init__(self, config):
        super().__init__(config)
        if config.tp_size < 2:
            raise BadValue(f"TensorParallel needs --tp_size > 1, got {config.tp_size}")

    @property
    def tp_size(self):
        return self.config.tp_size

    @property
    def flag(self):
        return f"--tp_size={self.tp_size}"

    def data_rank_and_world(self, rank, world):
        check_layout(None, self.tp_size, world)
        return rank // self.tp_size, world // self.tp_size

    def resume_meta(self):
        return {"parallel": self.name, "tp_size": self.tp_size}

    def build_mesh(self, device_type, world):
        from torch.distributed.device_mesh import init_device_mesh

        # ("dp", "tp"): rank r at (r // tp_size, r % tp_size), so the tp ranks of a group are neighbours (one node)
        return init_device_mesh(device_type, (world // self.tp_size, self.tp_size), mesh_dim_names=("dp", "tp"))

    def check_launch(self, model_config, world, distributed):
        super().check_launch(model_config, world, distributed)
        check_layout(model_config, self.tp_size, world)

    def wrap(self, model, device):
        from nanochat.distributed.tensor_parallel import apply_tp

        if not is_ddp_initialized():
            raise CannotRun(f"--tp_size={self.tp_size} needs torch.distributed: launch with torchrun --nproc_per_node={self.tp_size} (or a multiple)")
        check_layout(model.config, self.tp_size, torch.distributed.get_world_size())  # before the mesh: a clear error
        self._bind_to_process_group(device)
        param_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None
        return apply_tp(model, self.tp_size, param_dtype=param_dtype, reduce_dtype=self.reduce_dtype, mesh=self.mesh)

    def clip_grad_norm(self, model, max_norm):
        # block gradients on the 2-D (dp, tp) mesh, wte/lm_head on dp only: torch's clip cannot mix meshes, and a
        # replicated mesh dim must not count twice (nanochat/distributed/tensor_parallel.py)
        from nanochat.distributed.tensor_parallel import clip_grad_norm_

        return clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm).item()

    def full_weights(self, model):
        raise BadValue(refuse_full_weights(self, "this run"))

    def setup_optimizers(self, model, **kwargs):
        from nanochat.distributed.tensor_parallel import setup_tp_optimizers

        return setup_tp_optimizers(model, **kwargs)


FLAGS = {DataParallel.name: DataParallel.flag, FSDP.name: FSDP.flag}


def refuse_full_weights(parallel, who):
    """The error for a plan without full weights (tensor parallelism) where `who` samples on each rank alone."""
    return (f"{who} samples on each rank alone, which {parallel.flag} cannot do (the blocks' matrices stay split "
            f"over the tp ranks, so every forward is a collective): use --tp_size=1, with --use_fsdp=1 for a model "
            f"too big for DDP (it gathers the whole model for sampling)")


def saved_strategy_name(meta):
    """The strategy a training checkpoint was saved with: meta["parallel"], or --use_fsdp in older checkpoints."""
    if "parallel" in meta:
        return meta["parallel"]
    return FSDP.name if meta.get("user_config", {}).get("use_fsdp", False) else DataParallel.name


def saved_flag(meta):
    """The flag that selects the layout a training checkpoint was saved with (--use_fsdp=0|1 or --tp_size=N)."""
    name = saved_strategy_name(meta)
    if name == TensorParallel.name:
        return f"--tp_size={meta.get('tp_size', '?')}"
    return FLAGS[name]


def parallel_from_config(config, rank=None, world=None, samples_alone=None):
    """
    The plan for a script's flags (a dict of parsed flags, or a ParallelConfig; a script without FSDP/TP flags gets
    the DDP path). With rank and world its data ranks are fixed now (`bind`; Stage binds after setup_run, with the
    device type for the mesh). samples_alone: the script's name when its ranks sample on their own (chat_rl): a plan
    that cannot give them full weights is refused here, before any work.
    """
    pc = config if isinstance(config, ParallelConfig) else ParallelConfig.from_flags(config)
    plan = TensorParallel(pc) if pc.tp_size > 1 else FSDP(pc) if pc.use_fsdp else DataParallel(pc)
    if samples_alone and not plan.has_full_weights:
        raise BadValue(refuse_full_weights(plan, samples_alone))
    if rank is not None:
        plan.bind(rank, world)
    return plan
