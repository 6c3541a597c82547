"""
The pieces of a training run that base, mid and SFT training share (RL reuses the model/optimizer/checkpoint parts):

- `resolve_dtype` / `autocast_ctx`: bf16 autocast on CUDA, plain fp32 elsewhere.
- `build_model`: GPT from a config (meta device -> real device -> init), optional FSDP2 sharding and torch.compile.
- `setup_optimizers`: the optimizers for the DDP/single-process path or the FSDP path.
- `lr_multiplier`, `muon_momentum`, `apply_schedule`: the LR and momentum schedules.
- `train_step`: gradient accumulation over micro-batches, grad clipping, optimizer step; returns the mean loss
  all-reduced across ranks (what gets logged is the global loss, not rank 0's).
- `ProgressMeter`: debiased EMA loss, step time, tok/s, MFU and ETA for the log line.
- `every`: periodic actions, where a value <= 0 turns the action off entirely.
- `save_train_state` / `load_train_state`: model + per-rank optimizer + per-rank loader + loop state, so a resumed
  run continues exactly like an uninterrupted one.
"""

import contextlib
import math
import time

import torch
import torch.distributed as dist

from nanochat.checkpoint_manager import clean_state_dict, load_checkpoint, save_checkpoint
from nanochat.common import compute_init, get_dist_info, is_ddp_initialized, peak_flops_for, print0

# -----------------------------------------------------------------------------
# precision


def resolve_dtype(dtype, device_type):
    """--dtype: 'auto' = bfloat16 autocast on CUDA, float32 elsewhere (bf16 matmuls on CPU are ~10x slower)."""
    if dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if dtype not in table:
        raise ValueError(f"--dtype must be auto, bfloat16 or float32, got {dtype!r}")
    return table[dtype]


def autocast_ctx(device_type, dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=dtype)


def setup_run(config):
    """
    The start of every training script: torch.distributed/device setup from --device_type and --seed, and the
    autocast context for --dtype. Returns (ddp, rank, local_rank, world_size, device, autocast) where autocast()
    gives a fresh context manager.
    """
    ddp, rank, local_rank, world_size, device = compute_init(config["device_type"] or None, seed=config["seed"])
    dtype = resolve_dtype(config["dtype"], device.type)
    return ddp, rank, local_rank, world_size, device, lambda: autocast_ctx(device.type, dtype)


# -----------------------------------------------------------------------------
# model and optimizers


def build_model(config, device, init="normal", attn="auto", use_fsdp=False, fsdp_reduce_dtype="float32"):
    """A freshly initialised GPT on `device` (sharded with FSDP2 when use_fsdp). Returns the model."""
    from nanochat.gpt import GPT

    with torch.device("meta"):
        model = GPT(config, attn=attn)
    model.to_empty(device=device)
    model.init_weights(init)
    if use_fsdp:
        model = shard_model(model, device, fsdp_reduce_dtype)
    return model


def shard_model(model, device, fsdp_reduce_dtype="float32"):
    from nanochat.fsdp import apply_fsdp

    if not is_ddp_initialized():
        raise RuntimeError("--use_fsdp=1 needs torch.distributed: launch with torchrun (even --nproc_per_node=1)")
    reduce_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(fsdp_reduce_dtype)
    if reduce_dtype is None:
        raise ValueError(f"--fsdp_reduce_dtype must be float32 or bfloat16, got {fsdp_reduce_dtype!r}")
    param_dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None
    apply_fsdp(model, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return model


def setup_optimizers(model, use_fsdp=False, **kwargs):
    """kwargs: unembedding_lr, embedding_lr, matrix_lr, weight_decay, use_muon."""
    if use_fsdp:
        from nanochat.fsdp import setup_fsdp_optimizers

        return setup_fsdp_optimizers(model, **kwargs)
    return model.setup_optimizers(**kwargs)


def model_state_for_saving(model, use_fsdp=False):
    """The full, single-file model state dict (every rank must call this under FSDP; only rank 0's result is used)."""
    if use_fsdp:
        from nanochat.fsdp import full_model_state_dict

        return full_model_state_dict(model)
    return clean_state_dict(model.state_dict())


def load_model_state(model, state_dict, use_fsdp=False):
    state_dict = clean_state_dict(state_dict)
    if use_fsdp:
        from nanochat.fsdp import load_full_model_state_dict

        load_full_model_state_dict(model, state_dict)
    else:
        model.load_state_dict(state_dict, strict=True)


# -----------------------------------------------------------------------------
# schedules


def lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=0.2, final_lr_frac=0.0):
    """Linear warmup, constant, then linear warmdown to final_lr_frac over the last warmdown_ratio of the run."""
    warmup_iters = round(warmup_ratio * num_iterations)
    warmdown_iters = round(warmdown_ratio * num_iterations)
    if warmup_iters > 0 and step < warmup_iters:
        return (step + 1) / warmup_iters
    if warmdown_iters > 0 and step > num_iterations - warmdown_iters:
        progress = (num_iterations - step) / warmdown_iters
        return progress + (1 - progress) * final_lr_frac
    return 1.0


def muon_momentum(step, start=0.85, end=0.95, ramp_steps=300):
    """Muon momentum ramps from 0.85 to 0.95 over the first 300 steps (a low momentum early is more stable)."""
    frac = min(step / ramp_steps, 1.0)
    return (1 - frac) * start + frac * end


def apply_schedule(optimizers, lrm, momentum=None):
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if momentum is not None and "momentum" in group and not isinstance(opt, torch.optim.AdamW):
                group["momentum"] = momentum


def every(step, period, last_step=False, at_last=True):
    """True when a periodic action is due: period <= 0 turns it off entirely (also at the last step)."""
    if period <= 0:
        return False
    return step % period == 0 or (at_last and last_step)


# -----------------------------------------------------------------------------
# one optimisation step


def all_reduce_mean(value, device):
    """Mean of a python float across ranks (identity in a single process)."""
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    if is_ddp_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t.item()


def train_step(model, optimizers, next_batch, grad_accum_steps, grad_clip=1.0, autocast=None, loss_fn=None,
               defer_grad_sync=False):
    """
    Accumulate gradients over `grad_accum_steps` micro-batches from `next_batch()` (returns (x, y) or (x, y, ...)),
    clip, step every optimizer, zero grads. Returns (global mean loss as float, grad norm or None, last batch extras).
    The distributed optimizers (DistAdamW/DistMuon/FSDP) average gradients across ranks themselves.
    defer_grad_sync (FSDP only): reduce-scatter gradients once, after the last micro-batch, instead of after every one
    (less traffic with many micro-steps; costs one unsharded gradient per rank).
    """
    autocast = autocast or contextlib.nullcontext
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    extras = None
    fsdp_module = getattr(model, "_orig_mod", model)  # torch.compile wraps the FSDP module
    if defer_grad_sync and not hasattr(fsdp_module, "set_requires_gradient_sync"):
        raise ValueError("--fsdp_defer_grad_sync=1 needs --use_fsdp=1")
    for i in range(grad_accum_steps):
        if defer_grad_sync:
            fsdp_module.set_requires_gradient_sync(i == grad_accum_steps - 1)
        batch = next_batch()
        x, y = batch[0], batch[1]
        extras = batch[2:] if len(batch) > 2 else None
        with autocast():
            loss = model(x, y) if loss_fn is None else loss_fn(model, batch)
        loss_sum += loss.detach().float()
        (loss / grad_accum_steps).backward()
    grad_norm = None
    if grad_clip > 0:
        grad_norm = clip_grad_norm(model, grad_clip)
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    mean_loss = all_reduce_mean(loss_sum.item() / grad_accum_steps, device)
    return mean_loss, grad_norm, extras


def clip_grad_norm(model, max_norm):
    """
    Clip by the global gradient norm. Under DistAdamW/DistMuon each rank still holds its own local gradient here
    (the optimizers reduce later), so the norm is of the local gradient, as nanochat does; under FSDP the gradients are
    sharded DTensors and torch computes the true global norm.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.item()


# -----------------------------------------------------------------------------
# logging


class ProgressMeter:
    """Debiased EMA of the loss, step time, tokens/s, MFU (CUDA only) and ETA."""

    def __init__(self, tokens_per_step, flops_per_token, device, world_size, num_iterations, beta=0.9):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        peak = peak_flops_for(device)
        self.peak_total = peak * world_size if peak else None
        self.num_iterations = num_iterations
        self.beta = beta
        self.smooth_loss = 0.0
        self.total_time = 0.0  # wall time of training steps, excluding the first few (compile/warmup)
        self.timed_steps = 0

    def state_dict(self):
        return {"smooth_loss": self.smooth_loss, "total_time": self.total_time, "timed_steps": self.timed_steps}

    def load_state_dict(self, state):
        self.smooth_loss = state["smooth_loss"]
        self.total_time = state["total_time"]
        self.timed_steps = state["timed_steps"]

    def update(self, step, loss, dt):
        """Record step `step` (0-based) with its loss and duration; returns the log fields."""
        self.smooth_loss = self.beta * self.smooth_loss + (1 - self.beta) * loss
        debiased = self.smooth_loss / (1 - self.beta ** (step + 1))
        if step > 10:  # the first steps include compilation and allocator warmup
            self.total_time += dt
            self.timed_steps += 1
        tok_per_sec = self.tokens_per_step / dt if dt > 0 else float("inf")
        mfu = None
        if self.peak_total:
            mfu = 100 * self.flops_per_token * tok_per_sec / self.peak_total
        avg_dt = self.total_time / self.timed_steps if self.timed_steps else dt
        eta = avg_dt * max(self.num_iterations - step - 1, 0)
        return {"loss": debiased, "dt": dt, "tok_per_sec": tok_per_sec, "mfu": mfu, "eta": eta}

    def format(self, step, fields, lrm, extra=""):
        pct = 100 * (step + 1) / max(self.num_iterations, 1)
        mfu = f" | mfu: {fields['mfu']:.2f}%" if fields["mfu"] is not None else ""
        return (
            f"step {step + 1:05d}/{self.num_iterations:05d} ({pct:.2f}%) | loss: {fields['loss']:.6f} | "
            f"lrm: {lrm:.2f} | dt: {fields['dt'] * 1000:.2f}ms | tok/sec: {fields['tok_per_sec']:,.0f}{mfu} | "
            f"eta: {format_duration(fields['eta'])}{extra}"
        )


def format_duration(seconds):
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


# -----------------------------------------------------------------------------
# checkpoints of a training run


def gather_objects(obj):
    """List of `obj` from every rank (rank order); [obj] in a single process."""
    if not (is_ddp_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def save_train_state(checkpoint_dir, step, model, optimizers, meta, loader_state=None, use_fsdp=False):
    """
    Save model (single file, rank 0), optimizer state (one file per rank) and meta with every rank's loader state.
    Every rank must call it.
    """
    _, rank, _, _ = get_dist_info()
    model_sd = model_state_for_saving(model, use_fsdp)
    loader_states = gather_objects(loader_state)
    meta = dict(meta, step=step, loader_state=loader_states, world_size=len(loader_states))
    if loader_states and loader_states[0] is not None:
        meta["dataloader_state_dict"] = loader_states[0]  # nanochat's key, for tools that read it
    optim_sd = [opt.state_dict() for opt in optimizers]
    save_checkpoint(checkpoint_dir, step, model_sd if rank == 0 else None, optim_sd, meta, rank=rank)


def load_train_state(checkpoint_dir, step, model, optimizers, device, use_fsdp=False):
    """Restore model and optimizers in place; returns (meta, this rank's loader state or None)."""
    _, rank, _, world_size = get_dist_info()
    model_sd, optim_sd, meta = load_checkpoint(checkpoint_dir, step, device, load_optimizer=True, rank=rank)
    saved_world = meta.get("world_size", 1)
    if saved_world != world_size:
        raise ValueError(
            f"step {step} was saved by {saved_world} rank(s) but this run has {world_size}: the optimizer state and "
            f"data position are per rank, so resume with --nproc_per_node/--nnodes giving {saved_world} ranks"
        )
    saved_fsdp = bool(meta.get("user_config", {}).get("use_fsdp", False))
    if saved_fsdp != bool(use_fsdp):
        paths = {True: "FSDP (--use_fsdp=1)", False: "DDP (--use_fsdp=0)"}
        raise ValueError(
            f"step {step} was saved by the {paths[saved_fsdp]} path, whose optimizer state this {paths[bool(use_fsdp)]} "
            f"run cannot resume: resume with --use_fsdp={int(saved_fsdp)}. (The model file itself is the same on both "
            f"paths: later stages such as mid_train load it either way.)"
        )
    load_model_state(model, model_sd, use_fsdp)
    if len(optim_sd) != len(optimizers):
        raise ValueError(f"checkpoint has {len(optim_sd)} optimizer states but the run built {len(optimizers)}")
    for opt, sd in zip(optimizers, optim_sd):
        opt.load_state_dict(sd)
    loader_states = meta.get("loader_state") or [meta.get("dataloader_state_dict")]
    return meta, loader_states[rank] if rank < len(loader_states) else None


def ceil_div(a, b):
    return -(-a // b)


def batch_arithmetic(total_batch_size, device_batch_size, max_seq_len, world_size):
    """grad_accum_steps for a target total batch (in tokens), or a clear error suggesting valid values."""
    tokens_per_fwdbwd = device_batch_size * max_seq_len * world_size
    if total_batch_size <= 0:
        return 1, tokens_per_fwdbwd
    if total_batch_size % tokens_per_fwdbwd != 0:
        lower = max(tokens_per_fwdbwd, (total_batch_size // tokens_per_fwdbwd) * tokens_per_fwdbwd)
        upper = ceil_div(total_batch_size, tokens_per_fwdbwd) * tokens_per_fwdbwd
        divisors = [b for b in range(1, device_batch_size * 2 + 1) if total_batch_size % (b * max_seq_len * world_size) == 0]
        hint = f" or --device_batch_size in {divisors[:8]}" if divisors else ""
        raise ValueError(
            f"--total_batch_size={total_batch_size} is not divisible by device_batch_size*max_seq_len*world_size = "
            f"{device_batch_size}*{max_seq_len}*{world_size} = {tokens_per_fwdbwd}. Use --total_batch_size={lower} or "
            f"{upper}{hint}."
        )
    return total_batch_size // tokens_per_fwdbwd, tokens_per_fwdbwd


# On CPU the default eval sizes mean hours of evaluation before the first training step.
CPU_EVAL_STEPS = 4


def eval_steps_for(eval_tokens, default_eval_tokens, tokens_per_fwdbwd, device_type, enabled=True, flag="eval_tokens"):
    """Batches per bpb evaluation; on CPU a default that would take long is cut to CPU_EVAL_STEPS with a note."""
    if not enabled:
        return 0
    steps = max(1, eval_tokens // tokens_per_fwdbwd)
    if device_type == "cpu" and eval_tokens == default_eval_tokens and steps > CPU_EVAL_STEPS:
        print0(f"Note: on CPU the default --{flag}={default_eval_tokens} would take {steps} eval batches; "
               f"using {CPU_EVAL_STEPS}. Set --{flag} explicitly to override.")
        steps = CPU_EVAL_STEPS
    return steps


def assert_finite(loss, step):
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss became {loss} at step {step}: lower the learning rates or check the data")


def print_config(config):
    for k, v in config.items():
        print0(f"  {k} = {v}")


def timed(fn):
    """Run fn() and return (result, seconds), synchronising CUDA so the time is real."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.time()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.time() - t0
