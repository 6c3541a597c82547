"""
The pieces of a training run that base, mid and SFT training share (RL reuses the model/optimizer/checkpoint parts);
nanochat/stage.py puts them together into the skeleton each stage's script runs in:

- `setup_run` -> `RunContext`: device, ranks and compute dtype of this process (its `autocast()` for forward).
- `resolve_dtype` / `autocast_ctx`: bf16 autocast on CUDA, plain fp32 elsewhere.
- `set_deterministic`: --deterministic, bit-for-bit reproducible runs (and resumes) under torch.compile too.
- `init_model`: a fresh GPT from a config (meta device -> real device -> init; checkpoint_manager.build_model rebuilds
  one from a checkpoint); `check_model_options`: --fp8 refused early
  where it cannot run. The run's parallel plan (nanochat/distributed/parallel.py) then prepares the model (AC, FP8,
  sharding, compile) and owns its optimizers' layout and state dict format; collectives are in
  nanochat/distributed/dist.py.
- `lr_multiplier`, `muon_momentum`, `apply_schedule`: the LR and momentum schedules.
- `train_step`: gradient accumulation over micro-batches, grad clipping, optimizer step; returns the mean loss
  all-reduced across ranks (what gets logged is the global loss, not rank 0's). `MicroBatches` fetches each next
  micro-batch after the previous backward has been queued; `round_robin_batches` reads several data ranks' loaders.
- `ProgressMeter`: debiased EMA loss, step time, tok/s, MFU and ETA for the log line.
- `every`: periodic actions, where a value <= 0 turns the action off entirely.

Checkpoints of a run (save_train_state, load_train_state, save_stage_model, --resume_from_step) are the checkpoint
package's: nanochat/checkpoint/train_state.py and resume.py. `check_sequence_length`: a start-up check of a saved
model's rotary table, before anything is built.
"""

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from nanochat.common import device_type_flag, peak_flops_for, print0
from nanochat.distributed.dist import all_reduce_mean, compute_init
from nanochat.distributed.parallel import DataParallel
from nanochat.usage import BadValue

# -----------------------------------------------------------------------------
# precision


def resolve_dtype(dtype, device_type):
    """--dtype: 'auto' = bfloat16 autocast on CUDA, float32 elsewhere (bf16 matmuls on CPU are ~10x slower)."""
    if dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if dtype not in table:
        raise BadValue(f"--dtype must be auto, bfloat16 or float32, got {dtype!r}")
    return table[dtype]


def autocast_ctx(device_type, dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=dtype)


# -----------------------------------------------------------------------------
# determinism
#
# Without --deterministic a run is reproducible except for the order of floating-point additions in a few parallel
# kernels. The one that shows on CPU: Inductor's C++ backend turns the embedding backward (embedding_dense_backward
# -> index_put_(accumulate=True), a scatter-add of every token's gradient into its row of wte.grad) into a loop run by
# all OpenMP threads with atomic_add, so tokens that share an id are summed in whatever order the threads reach them.
# wte then differs by ~1e-5 after a few steps and the rest of the model follows (~1e-6). With one thread, or eager, the
# kernel is a plain ordered loop. On CUDA, atomics in index_add/scatter and in attention backwards do the same.


def set_deterministic(enabled, device_type):
    """
    --deterministic: every kernel picks a fixed reduction order, so the same run (and N steps + resume + N steps)
    gives the same bits. torch.use_deterministic_algorithms(True) also makes Inductor keep scatter-adds and
    index_put(accumulate) out of its generated code (aten's ordered kernels run instead); inductor's `deterministic`
    turns off benchmark-based kernel choices. On CUDA, cuBLAS needs a fixed workspace (CUBLAS_WORKSPACE_CONFIG, read
    at its first call: set here, before the model exists) and cuDNN its deterministic algorithms. Costs some speed:
    off by default.
    """
    if not enabled:
        return
    import torch._inductor.config as inductor_config

    if device_type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
    inductor_config.deterministic = True


@dataclass(frozen=True)
class RunContext:
    """Where this process runs: setup_run's result."""

    ddp: bool  # launched by torchrun (a process group exists)
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype  # the autocast compute dtype (float32 = no autocast)

    @property
    def master(self):
        return self.rank == 0

    def autocast(self):
        """A fresh autocast context for self.dtype."""
        return autocast_ctx(self.device.type, self.dtype)


def setup_run(config):
    """
    The start of every training script: torch.distributed/device setup from --device_type and --seed, and the
    compute dtype for --dtype. Returns a RunContext.
    """
    ddp, rank, local_rank, world_size, device = compute_init(config["device_type"] or None, seed=config["seed"])
    set_deterministic(config.get("deterministic"), device.type)
    return RunContext(ddp, rank, local_rank, world_size, device, resolve_dtype(config["dtype"], device.type))


# -----------------------------------------------------------------------------
# model and optimizers


def init_model(config, device, init="normal", attn="auto"):
    """A freshly initialised GPT (RecordGPT for a record config: nanochat/gpt.py make_model) on `device` (meta device
    -> to_empty -> init_weights). Returns the model; the parallel plan prepares it afterwards
    (`parallel.prepare(model, config, device, autocast)`)."""
    from nanochat.gpt import make_model

    with torch.device("meta"):
        model = make_model(config, attn=attn)
    model.to_empty(device=device)
    model.init_weights(init)
    return model


def check_model_options(config, device):
    """Early (before the tokenizer and the model): refuse --fp8=1, --compile=1 and an --attn kernel where they cannot
    run, and a NANOCHAT_COMPILE that is not auto/1/0. (Values with a fixed set, such as --activation_checkpointing,
    were checked by the flag parser: memory_flags' choices.)"""
    if "attn" in config:
        from nanochat.attention import resolve_attn

        resolve_attn(config["attn"], device)
    if "compile" in config:
        from nanochat.compile import resolve_compile

        resolve_compile(config["compile"], device.type, log=lambda *a: None)  # the notes come when it compiles
    if config.get("fp8"):
        from nanochat.fp8 import check_fp8_supported

        check_fp8_supported(device, config.get("fp8_recipe", "tensorwise"), config.get("fp8_impl", "torchao"))


# -----------------------------------------------------------------------------
# schedules


def lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=0.2, final_lr_frac=0.0, warmup_steps=0):
    """Linear warmup (over warmup_steps, else warmup_ratio of the run), constant, then linear warmdown to final_lr_frac
    over the last warmdown_ratio of the run."""
    warmup_iters = warmup_steps or round(warmup_ratio * num_iterations)
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


def apply_schedule(optimizers, lrm, momentum=None, weight_decay=None):
    """Every group's lr = initial_lr * lrm; the Muon groups' momentum and (the record recipe's) weight decay."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            muon = "momentum" in group and not isinstance(opt, torch.optim.AdamW)
            if momentum is not None and muon:
                group["momentum"] = momentum
            if weight_decay is not None and muon:
                group["weight_decay"] = weight_decay


def every(step, period, last_step=False, at_last=True):
    """True when a periodic action is due: period <= 0 turns it off entirely (also at the last step)."""
    if period <= 0:
        return False
    return step % period == 0 or (at_last and last_step)


# -----------------------------------------------------------------------------
# one optimisation step


class MicroBatches:
    """
    The training loop's source of micro-batches: `fetch()` returns (x, y) or (x, y, ...). train_step takes a batch,
    queues its forward and backward, and only then fetches the next one (`prefetch`), so reading, tokenising and
    copying the next batch overlap the accelerator's work instead of waiting behind it. Kept across steps, it also
    fetches the next step's first micro-batch right after the last backward, before the optimizer step and the host
    syncs of the loss and grad norm (nanochat's loop does the same).

    on_take(batch) runs when a batch is trained on (not when it is fetched): bookkeeping that must describe what was
    trained, such as a loader position saved for an exact resume, belongs there. A source that runs out is only an
    error if its missing batch is taken.
    """

    def __init__(self, fetch, on_take=None):
        self.fetch = fetch
        self.on_take = on_take
        self._next = None
        self._exhausted = False

    def prefetch(self):
        if self._next is None and not self._exhausted:
            try:
                self._next = self.fetch()
            except StopIteration:
                self._exhausted = True

    def take(self):
        self.prefetch()
        if self._next is None:
            raise StopIteration("the micro-batch source is exhausted")
        batch, self._next = self._next, None
        if self.on_take is not None:
            self.on_take(batch)
        return batch


def round_robin_batches(loaders, grad_accum, loader_states):
    """
    MicroBatches over one loader per data rank this process reads: with several (base_train --data_world_size, one
    process replaying W ranks) the micro-batches go round the loaders grad_accum at a time, as each real rank would
    take grad_accum in a row. loader_states[k] gets loader k's position after the last batch trained on (not the
    prefetched one), what a checkpoint saves.
    """
    taken = {"i": 0}

    def fetch():
        k = (taken["i"] // grad_accum) % len(loaders)
        taken["i"] += 1
        x, y, state = next(loaders[k])
        return x, y, k, state

    def on_take(batch):
        loader_states[batch[2]] = batch[3]

    return MicroBatches(fetch, on_take)


def train_step(model, optimizers, batches, grad_accum_steps, grad_clip=1.0, autocast=None, loss_fn=None,
               parallel=None):
    """
    Accumulate gradients over `grad_accum_steps` micro-batches, clip, step every optimizer, zero grads. Returns
    (global mean loss as float, grad norm or None, last batch extras). `batches`: a MicroBatches kept across steps
    (prefetches the next step's first batch too), or a plain `next_batch()` callable (prefetches within this step
    only, so nothing is fetched that this step does not use). The distributed optimizers (DistAdamW/DistMuon/FSDP)
    average gradients across ranks themselves; `parallel` (the run's plan, nanochat/distributed/parallel.py; default the
    DDP path) decides when gradients are synchronised and how their global norm is taken.
    """
    autocast = autocast or contextlib.nullcontext
    parallel = parallel or DataParallel()
    across_steps = isinstance(batches, MicroBatches)
    if not across_steps:
        batches = MicroBatches(batches)
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    extras = None
    for i in range(grad_accum_steps):
        parallel.set_grad_sync(model, i, grad_accum_steps)
        batch = batches.take()
        x, y = batch[0], batch[1]
        extras = batch[2:] if len(batch) > 2 else None
        with autocast():
            loss = model(x, y) if loss_fn is None else loss_fn(model, batch)
        loss_sum += loss.detach().float()
        (loss / grad_accum_steps).backward()
        if i < grad_accum_steps - 1 or across_steps:
            batches.prefetch()  # while the backward just queued runs on the accelerator
    grad_norm = None
    if grad_clip > 0:
        grad_norm = parallel.clip_grad_norm(model, grad_clip)
    for opt in optimizers:
        opt.step()
    parallel.after_optimizer_step(model)
    model.zero_grad(set_to_none=True)
    mean_loss = all_reduce_mean(loss_sum.item() / grad_accum_steps, device)
    return mean_loss, grad_norm, extras


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


def check_sequence_length(flag, length, model_config, what):
    """The start-up check of a sequence length a script runs `what` (a saved model) at, read from its checkpoint's
    meta before loading it: rows longer than its rotary table (nanochat.gpt.rotary_positions) cannot be run."""
    from nanochat.gpt import rotary_positions

    limit = rotary_positions(model_config)
    if length is not None and length > limit:
        raise BadValue(f"{flag}={length} is longer than {what} can take: its rotary table covers {limit} positions "
                       f"(10 x its sequence_len {model_config.sequence_len}); use {flag} <= {limit}")


# On CPU the default eval sizes mean hours of evaluation before the first training step.
CPU_EVAL_STEPS = 4
DEFAULT_EVAL_TOKENS = 20 * 524288  # nanochat's --eval_tokens: 20 batches of 524288 tokens


def eval_steps_for(eval_tokens, tokens_per_fwdbwd, device_type, enabled=True, flag="eval_tokens",
                   default_tokens=DEFAULT_EVAL_TOKENS):
    """
    Batches per bpb evaluation. eval_tokens=None (auto): default_tokens, cut to CPU_EVAL_STEPS batches on CPU (with a
    note). A number the user passed is always honoured, on any device, even when it equals the default.
    """
    if not enabled:
        return 0
    if eval_tokens is not None:
        return max(1, eval_tokens // tokens_per_fwdbwd)
    steps = max(1, default_tokens // tokens_per_fwdbwd)
    if device_type == "cpu" and steps > CPU_EVAL_STEPS:
        print0(f"Note: on CPU --{flag}=auto evaluates {CPU_EVAL_STEPS} batches, not the {steps} of "
               f"{default_tokens:,} tokens; pass --{flag}=N to choose.")
        steps = CPU_EVAL_STEPS
    return steps


def assert_finite(loss, step):
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss became {loss} at step {step}: lower the learning rates or check the data")


# -----------------------------------------------------------------------------
# flags that several training scripts share, declared once (nanochat/configurator.py)


def dtype_flag():
    """--dtype of the training scripts and benchmarks (resolve_dtype)."""
    from nanochat.configurator import Flag

    return Flag("dtype", "auto", "compute dtype: auto = bfloat16 autocast on CUDA, float32 elsewhere (bf16 matmuls on "
                "CPU are ~10x slower)", choices=["auto", "bfloat16", "float32", "bf16", "fp32"])


def run_flags():
    """Every training script's: wandb run, device, compute dtype, seed, determinism, resume."""
    from nanochat.configurator import Flag

    return [
        Flag("run", "dummy", "wandb run name; dummy = no wandb logging. A name needs a wandb login (`wandb login` or "
             "WANDB_API_KEY), or WANDB_MODE=offline to log into ./wandb and `wandb sync` later: without either the run "
             "stops at start-up with one line, before anything is built"),
        device_type_flag(),
        dtype_flag(),
        Flag("seed", 42, "random seed (model init, data order, sampling)"),
        Flag("deterministic", False, "deterministic kernels (torch and Inductor): a run and its resumes repeat bit for "
             "bit, compiled too; somewhat slower (nanochat/training.py set_deterministic)"),
    ]


def optimizer_flags():
    """The learning rates and weight decay of every training stage (nanochat's values; fine-tuning scales them by
    its --init_lr_frac)."""
    from nanochat.configurator import Flag

    return [
        Flag("embedding_lr", 0.2, "learning rate of the token embedding (AdamW)", min=0.0),
        Flag("unembedding_lr", 0.004, "learning rate of the lm_head (AdamW)", min=0.0),
        Flag("matrix_lr", 0.02, "learning rate of the transformer's matrices (Muon; AdamW with --use_muon=0)",
             min=0.0),
        Flag("weight_decay", 0.0, "weight decay of the AdamW groups", min=0.0),
    ]


def schedule_flags(warmdown_ratio=0.2):
    """The learning-rate schedule of base_train: warmup, warmdown, final fraction (fractions of the run, checked
    together: warmup and warmdown may not overlap)."""
    from nanochat.configurator import Flag, Rule

    return [
        Flag("warmup_ratio", 0.0, "fraction of the steps spent warming the learning rate up from 0", min=0.0, max=1.0),
        Flag("warmdown_ratio", warmdown_ratio, "fraction of the steps at the end spent decaying the learning rate",
             min=0.0, max=1.0),
        Flag("final_lr_frac", 0.0, "learning rate at the end of the warmdown, as a fraction of the peak", min=0.0,
             max=1.0),
        Rule(("warmup_ratio", "warmdown_ratio"), lambda up, down: up + down <= 1,
             "--warmup_ratio + --warmdown_ratio must be <= 1: the warmup and the warmdown are parts of the same run "
             "(got {warmup_ratio} + {warmdown_ratio})"),
    ]


def source_flags(source=None, choices=None):
    """The checkpoint a post-training script starts from: --source (when it has a choice), --model_tag, --model_step."""
    from nanochat.configurator import Flag

    flags = []
    if source is not None:
        flags.append(Flag("source", source, "the stage whose checkpoint to load", choices=choices))
    return flags + [
        Flag("model_tag", None, "checkpoint tag, e.g. d20; auto = the largest model", type=str),
        Flag("model_step", None, "checkpoint step; auto = the last", type=int, min=0),
    ]
