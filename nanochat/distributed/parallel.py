"""
The run's parallel plan: one object, chosen once from the flags, that owns how the run spreads over the ranks: the
device mesh, which share of the data this rank reads, the order in which the model is made ready, and the few
operations the training loop needs. The loop never asks which strategy it has; it asks the plan's capabilities.

    parallel = parallel_from_config(config, rank, world)   # --use_fsdp, --tp_size, --fsdp_*, --checkpoint_format, ...
    parallel.data_rank, parallel.data_world                 # this rank's shard of the data, the number of shards
    parallel.data_ranks                                     # DataRanks for the evaluations (core_eval, chat_eval)
    parallel.read_ranks                                     # the data ranks this process reads (several: --data_world_size)
    model, orig_model = parallel.prepare(model, config, device, autocast)   # AC -> FP8 -> TP -> FSDP -> compile
    optimizers = parallel.setup_optimizers(orig_model, matrix_lr=..., ...)
    parallel.set_grad_sync(model, micro_step, grad_accum)  # before each micro-step's forward (training.train_step)
    parallel.after_optimizer_step(model)                    # after all optimizers stepped (training.train_step)
    state = parallel.model_state_dict(model)                # every rank calls; rank 0 gets the full single-file state
    parallel.load_model_state_dict(model, state)            # a full state dict (any strategy's checkpoint)
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
`compile_per_block`, `sharded_checkpoint`/`async_save`/`reads_sharded_checkpoint`.

The model file is the same single-file format for all (only the per-rank optimizer files differ), so a later stage
may use either strategy on an earlier stage's model; FSDP writes sharded checkpoints instead (one directory per step,
every rank its shard, nanochat/sharded_checkpoint.py) unless --checkpoint_format=single, and every loader reads them.
Resuming a run's optimizer state needs the strategy (and tp size) it was saved with (`check_resume`); a sharded step
also resumes on another number of ranks. Another strategy (HSDP, pipeline parallelism) is one more class here plus a
line in `parallel_from_config`.
"""

import contextlib
import os

import torch

from nanochat.checkpoint_manager import clean_state_dict
from nanochat.common import print0
from nanochat.distributed.dist import DataRanks, is_ddp_initialized, process_data_ranks
from nanochat.fp8 import precompute_fp8_scales, uses_fp8_all_gather
from nanochat.usage import BadValue, CannotRun

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class DataParallel:
    """The DDP path: the whole model on every rank; the optimizers do the communication (see module docstring)."""

    name = "ddp"
    flag = "--use_fsdp=0"
    sharded_checkpoint = False  # True: checkpoints are written by every rank (nanochat/sharded_checkpoint.py)
    reads_sharded_checkpoint = False  # True: resumes from a sharded step (FSDP's 1-D layout, any number of ranks)
    async_save = False  # and in a background thread
    collective_forward = False  # ranks may run different forwards (rank 0 samples alone, ranks split eval problems)
    compile_per_block = False  # torch.compile the whole model (nanochat/compile.py)
    shards_weights = False  # weights are all-gathered for each forward (FP8 may then all-gather in FP8)
    fp8_supported = True  # --fp8=1 works on this layout
    has_full_weights = True  # full_weights() gives every rank the whole model (ranks can sample alone)
    mesh = None  # the device mesh the weights are laid out on (set by wrap where there is one)
    _ranks = None  # DataRanks, set by bind
    _read_world = None  # --data_world_size: one process reads as this many data ranks

    # ---------------------------------------------------------------- who reads which data

    def data_rank_and_world(self, rank, world):
        """(this rank's data shard, number of data shards): every rank reads its own data on this path."""
        return rank, world

    def bind(self, rank, world, data_world_size=1):
        """
        Fix this process's data ranks: its rank and the world give (data rank, data world, tp rank). data_world_size
        > 1 (base_train --data_world_size, one process only) replays a run of that many data ranks: this process
        reads all their data (read_ranks) in the order the ranks would have, so a test can compare runs exactly.
        """
        data_rank, data_world = self.data_rank_and_world(rank, world)
        self._ranks = DataRanks(data_rank, data_world, rank - data_rank * (world // data_world))
        if data_world_size > 1 and world > 1:
            raise BadValue("--data_world_size is for single-process runs that reproduce a multi-rank run; unset it")
        self._read_world = max(data_world, data_world_size)
        return self

    @property
    def data_ranks(self):
        """DataRanks(rank, world, tp_rank) for loaders and evaluations; the process group's until bind."""
        return self._ranks if self._ranks is not None else process_data_ranks()

    @property
    def data_rank(self):
        return self.data_ranks.rank

    @property
    def data_world(self):
        return self.data_ranks.world

    @property
    def read_world(self):
        """The data ranks the batch arithmetic counts: data_world, or --data_world_size in a replaying process."""
        return self._read_world or self.data_world

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
        chosen = model.set_activation_checkpointing(config.get("activation_checkpointing", "none"),
                                                    config.get("ac_every", 2))
        if chosen:
            print0(f"Activation checkpointing ({config['activation_checkpointing']}): {len(chosen)} of "
                   f"{len(model.transformer.h)} blocks recompute their activations in the backward")
        if config.get("fp8"):
            from nanochat.fp8 import apply_fp8

            if not self.fp8_supported:
                # torchao's float8 linears need their own TP styles (Float8ColwiseParallel...), not wired up here
                raise BadValue(f"--fp8=1 does not work with {self.flag} yet: use --fp8=0, or --tp_size=1 (--use_fsdp=1)")
            apply_fp8(model, config.get("fp8_recipe", "tensorwise"), device, fsdp=self.shards_weights, log=print0,
                      filter=config.get("fp8_filter", "auto"))
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

    def resume_meta(self):
        """What a training checkpoint records about the layout (check_resume compares it)."""
        return {"parallel": self.name}

    def setup_optimizers(self, model, **kwargs):
        """kwargs: unembedding_lr, embedding_lr, matrix_lr, weight_decay, use_muon (GPT.setup_optimizers)."""
        return model.setup_optimizers(**kwargs)

    def set_grad_sync(self, model, micro_step, grad_accum_steps):
        pass  # gradients stay local until the optimizer step averages them

    def after_optimizer_step(self, model):
        pass  # the weights are plain tensors: nothing is derived from them between steps

    def full_weights(self, model):
        """A context in which every rank holds the whole model and its forwards are local: here, always."""
        return contextlib.nullcontext(model)

    def model_state_dict(self, model):
        """The full model state, nanochat's single-file format (every rank has it; rank 0 saves it)."""
        return clean_state_dict(model.state_dict())

    def load_model_state_dict(self, model, state_dict):
        model.load_state_dict(clean_state_dict(state_dict), strict=True)

    def check_resume(self, meta, step):
        """Refuse optimizer state saved by another strategy or tp size (its per-rank files hold other shapes)."""
        saved = saved_flag(meta)
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

    def __init__(self, reduce_dtype="float32", defer_grad_sync=False, sharded_checkpoint=True, async_save=False):
        if reduce_dtype not in REDUCE_DTYPES:
            raise BadValue(f"--fsdp_reduce_dtype must be float32 or bfloat16, got {reduce_dtype!r}")
        self.reduce_dtype = REDUCE_DTYPES[reduce_dtype]
        self.defer_grad_sync = defer_grad_sync
        self.sharded_checkpoint, self.async_save = sharded_checkpoint, async_save
        self.fp8_all_gather = False  # set by wrap: weights all-gathered in FP8 (--fp8=1, tensorwise)

    def wrap(self, model, device):
        from torch.distributed.device_mesh import init_device_mesh

        from nanochat.distributed.fsdp import apply_fsdp

        if not is_ddp_initialized():
            raise CannotRun("--use_fsdp=1 needs torch.distributed: launch with torchrun (even --nproc_per_node=1)")
        device_type = torch.device(device).type
        self.mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))  # 1-D over all ranks
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
    every forward is collective, the tp ranks of a group read the same data, the model file is the full single file.
    """

    name = "tp"
    collective_forward = True  # two all-reduces per block in every forward
    compile_per_block = True
    fp8_supported = False  # torchao's float8 linears need their own TP styles
    reads_sharded_checkpoint = False  # sharded steps hold FSDP's 1-D layout
    has_full_weights = False  # the blocks' matrices stay split over the tp ranks

    def __init__(self, tp_size, reduce_dtype="float32", defer_grad_sync=False):
        super().__init__(reduce_dtype, defer_grad_sync, sharded_checkpoint=False)  # sharded: FSDP's 1-D layout only
        self.tp_size = tp_size

    @property
    def flag(self):
        return f"--tp_size={self.tp_size}"

    def data_rank_and_world(self, rank, world):
        if world % self.tp_size != 0:
            raise BadValue(f"--tp_size={self.tp_size} does not divide the world size {world}; use one of: "
                             f"{', '.join(str(t) for t in range(1, world + 1) if world % t == 0)}")
        return rank // self.tp_size, world // self.tp_size

    def resume_meta(self):
        return {"parallel": self.name, "tp_size": self.tp_size}

    def check_launch(self, model_config, world, distributed):
        super().check_launch(model_config, world, distributed)
        if model_config is not None:
            from nanochat.distributed.tensor_parallel import check_tp_size

            check_tp_size(model_config, self.tp_size, world)

    def wrap(self, model, device):
        from nanochat.distributed.tensor_parallel import apply_tp, check_tp_size, tp_mesh

        if not is_ddp_initialized():
            raise CannotRun(f"--tp_size={self.tp_size} needs torch.distributed: launch with torchrun --nproc_per_node={self.tp_size} (or a multiple)")
        device_type = torch.device(device).type
        check_tp_size(model.config, self.tp_size, torch.distributed.get_world_size())  # before the mesh: a clear error
        self.mesh = tp_mesh(device_type, self.tp_size)  # ("dp", "tp"): rank r at (r // tp_size, r % tp_size)
        param_dtype = torch.bfloat16 if device_type == "cuda" else None
        return apply_tp(model, self.tp_size, param_dtype=param_dtype, reduce_dtype=self.reduce_dtype, mesh=self.mesh)

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


def node_local_base_dirs():
    """True on a multi-node run whose nodes each have their own base dir (the launchers' NANOCHAT_SHARED_FS=0)."""
    multi_node = int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return multi_node and os.environ.get("NANOCHAT_SHARED_FS", "1").strip().lower() in ("0", "false", "no")


def parallel_from_config(config, rank=None, world=None, samples_alone=None):
    """
    The plan for a script's flags (a script without FSDP/TP flags gets the DDP path). With rank and world (the
    process's, after setup_run) its data ranks are fixed now (`bind`; --data_world_size replays that many data ranks in
    one process); without, they are the process group's when first asked. samples_alone: the script's name when its
    ranks sample on their own (chat_rl): a plan that cannot give them full weights is refused here, before any work.
    """
    plan = _strategy_from_config(config)
    if samples_alone and not plan.has_full_weights:
        raise BadValue(refuse_full_weights(plan, samples_alone))
    if rank is not None:
        plan.bind(rank, world, config.get("data_world_size", 1))
    return plan


def _strategy_from_config(config):
    use_fsdp = bool(config.get("use_fsdp", False))
    defer = bool(config.get("fsdp_defer_grad_sync", False))
    tp_size = config.get("tp_size", 1)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise BadValue(f"--tp_size must be a whole number >= 1 (1 = no tensor parallelism), got {tp_size!r}")
    fmt = config.get("checkpoint_format", "auto")
    if fmt not in ("auto", "sharded", "single"):
        raise BadValue(f"--checkpoint_format must be auto, sharded or single, got {fmt!r}")
    if fmt == "sharded" and (tp_size > 1 or not use_fsdp):
        raise BadValue("--checkpoint_format=sharded needs --use_fsdp=1 (and --tp_size=1): the DDP and tensor-parallel "
                         "paths write nanochat's single files; use --checkpoint_format=auto")
    if node_local_base_dirs():
        # every rank writes into one sharded directory: nodes with their own base dirs cannot share it
        if fmt == "sharded":
            raise BadValue("--checkpoint_format=sharded needs a checkpoint directory every node sees, and "
                             "NANOCHAT_SHARED_FS=0 says the nodes have their own base dirs: use --checkpoint_format=auto "
                             "(single files, docs/multinode.md) or put NANOCHAT_BASE_DIR on a shared filesystem")
        if fmt == "auto":
            fmt = "single"
    if config.get("async_save") and (fmt == "single" or tp_size > 1 or not use_fsdp):
        raise BadValue("--async_save=1 writes sharded checkpoints in the background: it needs --use_fsdp=1 with "
                         "--checkpoint_format=auto or sharded, and a checkpoint directory every node sees (not "
                         "NANOCHAT_SHARED_FS=0 on several nodes); use --async_save=0 here")
    if tp_size > 1:
        # TP always runs with FSDP2 over the data ranks (--use_fsdp is implied; its dtype/defer flags apply)
        return TensorParallel(tp_size, config.get("fsdp_reduce_dtype", "float32"), defer)
    if not use_fsdp:
        if defer:
            raise BadValue("--fsdp_defer_grad_sync=1 needs --use_fsdp=1 (or --tp_size > 1)")
        return DataParallel()
    return FSDP(config.get("fsdp_reduce_dtype", "float32"), defer, sharded_checkpoint=fmt != "single",
                async_save=bool(config.get("async_save", False)))
