"""
How a training run spreads the model over ranks: one strategy object, chosen once from the flags, with the few
operations the training loop needs. The loop never asks which strategy it has.

    parallel = parallel_from_config(config)                 # --use_fsdp, --fsdp_reduce_dtype, --fsdp_defer_grad_sync
    model = parallel.wrap(model, device)                    # after init_weights / loading the weights
    optimizers = parallel.setup_optimizers(model, matrix_lr=..., ...)
    parallel.set_grad_sync(model, micro_step, grad_accum)  # before each micro-step's forward (training.train_step)
    state = parallel.model_state_dict(model)                # every rank calls; rank 0 gets the full single-file state
    parallel.load_model_state_dict(model, state)            # a full state dict (any strategy's checkpoint)
    parallel.collective_forward                             # True: every forward is a collective (sample on all ranks)

Two strategies (docs/distributed.md compares them):

- `DataParallel` (name "ddp", the default): every rank holds the whole model and its local gradients; DistAdamW and
  DistMuon average the gradients and shard the optimizer state themselves (in one process: plain AdamW and Muon).
  There is no wrapper, so nothing to do per micro-step.
- `FSDP` (name "fsdp", `--use_fsdp=1`): FSDP2 shards parameters, gradients and optimizer state (nanochat/fsdp.py has
  the mechanics). With defer_grad_sync the gradients are reduce-scattered once per step instead of per micro-step.

The model file is the same single-file format for both (only the per-rank optimizer files differ), so a later stage
may use either strategy on an earlier stage's model; resuming a run's optimizer state needs the strategy it was saved
with (`check_resume`). Another strategy (HSDP, tensor parallelism) is one more class here plus a line in
`parallel_from_config`.
"""

import torch

from nanochat.checkpoint_manager import clean_state_dict
from nanochat.dist import is_ddp_initialized

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class DataParallel:
    """The DDP path: the whole model on every rank; the optimizers do the communication (see module docstring)."""

    name = "ddp"
    flag = "--use_fsdp=0"
    collective_forward = False  # ranks may run different forwards (rank 0 samples alone, ranks split eval problems)
    compile_per_block = False  # torch.compile the whole model (nanochat/compile.py)

    def wrap(self, model, device):
        return model

    def setup_optimizers(self, model, **kwargs):
        """kwargs: unembedding_lr, embedding_lr, matrix_lr, weight_decay, use_muon (GPT.setup_optimizers)."""
        return model.setup_optimizers(**kwargs)

    def set_grad_sync(self, model, micro_step, grad_accum_steps):
        pass  # gradients stay local until the optimizer step averages them

    def model_state_dict(self, model):
        """The full model state, nanochat's single-file format (every rank has it; rank 0 saves it)."""
        return clean_state_dict(model.state_dict())

    def load_model_state_dict(self, model, state_dict):
        model.load_state_dict(clean_state_dict(state_dict), strict=True)

    def check_resume(self, meta, step):
        """Refuse optimizer state saved by another strategy (its per-rank files hold other shapes)."""
        saved = saved_strategy_name(meta)
        if saved != self.name:
            raise ValueError(
                f"step {step} was saved by the {FLAGS[saved]} path, whose optimizer state this {self.flag} run cannot "
                f"resume: resume with {FLAGS[saved]}. (The model file itself is the same on both paths: later stages "
                f"such as mid_train load it either way.)"
            )


class FSDP(DataParallel):
    """FSDP2 on a 1-D mesh over all ranks (nanochat/fsdp.py): parameters, gradients and optimizer state sharded."""

    name = "fsdp"
    flag = "--use_fsdp=1"
    collective_forward = True  # each forward all-gathers weights: every rank must run the same forwards
    compile_per_block = True  # FSDP's hooks break a whole-model graph: compile each block and the head

    def __init__(self, reduce_dtype="float32", defer_grad_sync=False):
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"--fsdp_reduce_dtype must be float32 or bfloat16, got {reduce_dtype!r}")
        self.reduce_dtype = REDUCE_DTYPES[reduce_dtype]
        self.defer_grad_sync = defer_grad_sync

    def wrap(self, model, device):
        from nanochat.fsdp import apply_fsdp

        if not is_ddp_initialized():
            raise RuntimeError("--use_fsdp=1 needs torch.distributed: launch with torchrun (even --nproc_per_node=1)")
        # bf16 all-gathered weights for compute on CUDA (the sharded masters stay fp32), fp32 on CPU
        param_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None
        return apply_fsdp(model, param_dtype=param_dtype, reduce_dtype=self.reduce_dtype)

    def setup_optimizers(self, model, **kwargs):
        from nanochat.fsdp import setup_fsdp_optimizers

        return setup_fsdp_optimizers(model, **kwargs)

    def set_grad_sync(self, model, micro_step, grad_accum_steps):
        # defer_grad_sync: reduce-scatter once, after the last micro-step (less traffic with many micro-steps, costs
        # one unsharded gradient per rank). torch.compile wraps the FSDP module: the setter is on the original.
        if self.defer_grad_sync:
            getattr(model, "_orig_mod", model).set_requires_gradient_sync(micro_step == grad_accum_steps - 1)

    def model_state_dict(self, model):
        """Gathered one tensor at a time; rank 0 gets the full state on the CPU, the other ranks {}."""
        from nanochat.fsdp import full_model_state_dict

        return full_model_state_dict(model)

    def load_model_state_dict(self, model, state_dict):
        from nanochat.fsdp import load_full_model_state_dict

        load_full_model_state_dict(model, clean_state_dict(state_dict))


FLAGS = {cls.name: cls.flag for cls in (DataParallel, FSDP)}


def saved_strategy_name(meta):
    """The strategy a training checkpoint was saved with: meta["parallel"], or --use_fsdp in older checkpoints."""
    if "parallel" in meta:
        return meta["parallel"]
    return FSDP.name if meta.get("user_config", {}).get("use_fsdp", False) else DataParallel.name


def parallel_from_config(config):
    """The strategy for a script's flags (a script without FSDP flags gets the DDP path)."""
    use_fsdp = bool(config.get("use_fsdp", False))
    defer = bool(config.get("fsdp_defer_grad_sync", False))
    if not use_fsdp:
        if defer:
            raise ValueError("--fsdp_defer_grad_sync=1 needs --use_fsdp=1")
        return DataParallel()
    return FSDP(config.get("fsdp_reduce_dtype", "float32"), defer)
