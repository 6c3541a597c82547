"""
torch.compile for the training scripts: whether to compile, what to compile, and a startup check that it worked.

- `--compile=auto|1|0` (old spellings True/False still work). auto = compile wherever torch.compile can run: CUDA
  with Triton, CPU with a C++ compiler (as nanochat, which compiles everywhere); MPS stays eager unless --compile=1. When the compiler is missing, auto
  prints one line and runs eager; --compile=1 stops with the reason. The environment variable NANOCHAT_COMPILE
  (auto|1|0) is the flag's default when set (compile_flag; the test suite sets 0: compile time would dominate tiny
  runs), so the run's recorded flags say what it did.
- What is compiled: on the single-process/DDP path the whole model (one graph per forward). Under FSDP2 a whole-model
  compile breaks at FSDP's hooks and leaves parts eager, so (as torchtitan does) each Block's forward and the head
  (final norm, lm_head, softcap, cross-entropy: gpt.head) are compiled separately and FSDP's hooks run between them.
  Blocks share one graph (same code, same shapes). Muon's Newton-Schulz is compiled too (muon.set_compile).
- `compile_model` then runs one forward+backward on random tokens of the training shape: that is the cold compile,
  timed and logged once, and any graph break it hit (e.g. an attention kernel dynamo cannot trace) is reported with
  its cause, since a break silently costs speed. The model's weights and the data position are untouched.
"""

import shutil
import time
import warnings
from collections import Counter

import torch

from nanochat.common import print0
from nanochat.usage import BadValue, CannotRun

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_compile_flag(value):
    """'auto' | True | False from --compile / NANOCHAT_COMPILE (auto, 1/0, true/false, yes/no, on/off, or a bool)."""
    if isinstance(value, bool):
        return value
    low = str(value).strip().lower()
    if low == "auto":
        return "auto"
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise BadValue(f"--compile must be auto, 1 or 0 (or true/false; NANOCHAT_COMPILE takes the same), got {value!r}")


def compiler_unavailable_reason(device_type):
    """Why torch.compile (inductor) cannot run on this device type, or None when it can."""
    if device_type == "cpu":
        import torch._inductor.config as inductor_config

        # inductor's candidates: $CXX or g++ (None = "download one with conda", which it only does when asked to)
        candidates = inductor_config.cpp.cxx if isinstance(inductor_config.cpp.cxx, (list, tuple)) else (inductor_config.cpp.cxx,)
        candidates = [c for c in candidates if c]
        if not any(shutil.which(c) for c in candidates):
            return f"no C++ compiler for inductor (looked for {', '.join(candidates)}; install g++ or set CXX)"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (pip install triton)"
    return None  # e.g. mps: not checked here (auto does not compile there, see resolve_compile)


def resolve_compile(flag, device_type, log=print0):
    """True when the run should compile (see the module docstring). --compile=1 where it cannot run is an error."""
    choice = parse_compile_flag(flag)
    if choice is False:
        return False
    if choice == "auto" and device_type not in ("cpu", "cuda"):
        log(f"Note: --compile=auto runs eager on {device_type} (inductor's support there is young); --compile=1 to try")
        return False
    reason = compiler_unavailable_reason(device_type)
    if reason is None:
        return True
    if choice is True:
        raise CannotRun(f"--compile=1 but torch.compile cannot run here: {reason}. Use --compile=0 (eager)")
    log(f"Note: --compile=auto runs eager: {reason}")
    return False


def compile_model(model, per_block=False, backend="inductor"):
    """
    Compile `model` (a GPT, already wrapped by its parallel strategy) for training and Muon's Newton-Schulz with it. Returns the
    model to call: a compiled wrapper on the DDP path (keep the original for saving/eval); with per_block (the FSDP
    strategy's `compile_per_block`: FSDP's hooks would break a whole-model graph) the model itself, its blocks and head
    compiled in place (state dict names are unchanged).
    """
    from nanochat import muon
    from nanochat.gpt import head

    muon.set_compile(True, backend=backend)
    if not per_block:
        return torch.compile(model, dynamic=False, backend=backend)
    for block in model.transformer.h:
        # compile forward, not the module call: FSDP's pre/post-forward hooks stay outside the graph
        block.forward = _when_training(torch.compile(block.forward, dynamic=False, backend=backend), block.forward)
    model.head = _when_training(torch.compile(head, dynamic=False, backend=backend), head)
    return model


def _when_training(compiled, eager):
    """compiled while gradients are on (training), eager under no_grad/inference_mode: evaluation and sampling call
    this same model with ever-changing shapes, which would recompile every time (the DDP path evaluates on the
    uncompiled original for the same reason)."""

    def forward(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)

    return forward


def graph_breaks_during(fn):
    """Run fn(); return (its result, Counter of the graph-break reasons dynamo recorded meanwhile)."""
    from torch._dynamo.utils import counters

    before = Counter(counters["graph_break"])
    out = fn()
    return out, Counter(counters["graph_break"]) - before


def warm_up(model, batch_size, seq_len, vocab_size, device, autocast=None, log=print0):
    """
    The cold compile: one forward+backward of `model` on random tokens of the training shape (B, T), timed. Warns
    with the causes when dynamo hit graph breaks. Gradients are dropped afterwards; weights, the global RNG and the
    data loader are untouched, so the run is the same as without it. Returns (seconds, Counter of break reasons).
    """
    import contextlib

    autocast = autocast or contextlib.nullcontext
    g = torch.Generator().manual_seed(0)
    # inputs and targets must be distinct tensors, as in training: dynamo guards on aliasing (`idx is targets`)
    x, y = torch.randint(0, vocab_size, (2, batch_size, seq_len), generator=g).to(device).unbind(0)

    def step():
        with autocast():
            loss = model(x, y)
        loss.backward()

    t0 = time.time()
    _, breaks = graph_breaks_during(step)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - t0
    model.zero_grad(set_to_none=True)
    log(f"torch.compile: cold compile of the model's forward+backward took {seconds:.1f}s (once; Newton-Schulz "
        f"compiles at the first optimizer step)")
    if breaks:
        causes = "; ".join(f"{n}x {reason}" for reason, n in breaks.most_common(5))
        warnings.warn(f"torch.compile hit {sum(breaks.values())} graph break(s), so part of the model runs eager "
                      f"(slower): {causes}", stacklevel=2)
    return seconds, breaks


def maybe_compile(model, flag, device, batch_size, seq_len, per_block=False, autocast=None, backend="inductor", log=print0):
    """The scripts' one call: resolve --compile, compile and warm up when on. Returns the model to train with."""
    device = torch.device(device)
    if not resolve_compile(flag, device.type, log):
        return model
    compiled = compile_model(model, per_block, backend)
    warm_up(compiled, batch_size, seq_len, model.config.vocab_size, device, autocast, log)
    return compiled


def compile_flag():
    """--compile, as every training script and bench/train_bench.py declare it."""
    from nanochat.configurator import Flag

    return Flag("compile", "auto", "torch.compile: auto = wherever it works (CUDA with Triton, CPU with a C++ compiler), "
                "1 = always (stops with the reason when it cannot), 0 = eager", check=parse_compile_flag,
                env="NANOCHAT_COMPILE")
