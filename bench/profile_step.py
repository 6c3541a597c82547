"""
Where a training step's time goes: a torch.profiler trace of a few steps (bench/train_bench.py --profile_steps=2),
summarised as shares of the busy time: attention forward, attention backward, matmuls, optimizer, cross-entropy and
the rest, with the largest kernels by name, so a GPU run names the next MFU lever.

    summary = profile_steps(lambda optimizers: train_step(model, optimizers, ...), optimizers, 2, device, sync)

Busy time: on CUDA the kernels' (and copies') device time, on CPU the operators' own (self) time. Every optimizer
step runs inside one profiler range, synchronised at both ends, so on CUDA exactly its kernels start inside that
range's window: they count as optimizer whatever they are (Muon's Newton-Schulz matmuls included). The other kernels
are sorted by name (bucket()): the names are the kernels' as torch, cuDNN, cuBLAS, FlashAttention and inductor
(fused kernels carry their ops' names, e.g. triton_red_fused__log_softmax_...) call them. What no rule matches is
"the rest", and the top list shows the largest of it by name.
"""

import re
import time

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

SHARES = ("attention forward", "attention backward", "matmuls", "optimizer", "cross-entropy", "the rest")
OPTIMIZER_RANGE = "nanochat.optimizer_step"

_ATTENTION = ("flash", "fmha", "sdpa", "scaled_dot_product", "flex_attention", "attention")
_BACKWARD = ("bwd", "backward", "bprop", "cutlassb")
_CROSS_ENTROPY = ("log_softmax", "logsoftmax", "nll_loss", "nllloss", "cross_entropy")
_MATMUL = re.compile(r"gemm|nvjet|xmma|cublas|(^|[^a-z])(mm|addmm|bmm|baddbmm|_scaled_mm|matmul)([^a-z]|$)")


def bucket(name):
    """The share a kernel or operator counts in, by its name (the optimizer's come from the range, not the name)."""
    n = name.lower()
    if any(a in n for a in _ATTENTION):
        return "attention backward" if any(b in n for b in _BACKWARD) else "attention forward"
    if any(c in n for c in _CROSS_ENTROPY):
        return "cross-entropy"
    if _MATMUL.search(n):
        return "matmuls"
    return "the rest"


class _MarkedOptimizer:
    """An optimizer whose step() is one profiler range, with the device synchronised at both ends."""

    def __init__(self, optimizer, sync):
        self.optimizer, self.sync = optimizer, sync

    def step(self):
        self.sync()
        with record_function(OPTIMIZER_RANGE):
            self.optimizer.step()
            self.sync()

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


def profile_steps(run_step, optimizers, steps, device, sync):
    """Trace `steps` calls of run_step(optimizers) and summarise them (summarize())."""
    marked = [_MarkedOptimizer(opt, sync) for opt in optimizers]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run_step(marked)
        sync()
    wall_s = time.perf_counter() - t0
    return summarize(prof.events(), device.type, wall_s, steps)


def summarize(events, device_type, wall_s, steps, top=6):
    """{'shares': {share: percent of busy time}, 'top': [(name, share, percent)], busy and wall ms per step}."""
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name == OPTIMIZER_RANGE]
    per_name, totals = {}, dict.fromkeys(SHARES, 0.0)
    for e in events:
        if e.is_user_annotation or e.name == OPTIMIZER_RANGE:
            continue
        if device_type == "cuda":
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:
            if e.device_type != DeviceType.CPU:
                continue
            us = e.self_cpu_time_total
        share = "optimizer" if any(a <= e.time_range.start < b for a, b in windows) else bucket(e.name)
        totals[share] += us
        key = (e.name, share)
        per_name[key] = per_name.get(key, 0.0) + us
    busy = sum(totals.values())
    if busy <= 0:
        raise RuntimeError("the profiler recorded no kernel or operator time")
    largest = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "steps": steps,
        "wall_ms_per_step": 1000 * wall_s / steps,
        "busy_ms_per_step": busy / 1000 / steps,
        "busy_pct_of_wall": 100 * busy / 1e6 / wall_s,
        "busy_is": "CUDA kernel time" if device_type == "cuda" else "CPU operator self time",
        "shares": {k: 100 * v / busy for k, v in totals.items()},
        "top": [(name[:120], share, 100 * us / busy) for (name, share), us in largest],
    }


def describe(summary):
    """One line: the shares in SHARES order, then the largest kernels."""
    shares = ", ".join(f"{k} {summary['shares'][k]:.1f}%" for k in SHARES)
    top = "; ".join(f"{name} ({share}) {pct:.1f}%" for name, share, pct in summary["top"][:3])
    return (f"{shares} of {summary['busy_ms_per_step']:.1f} ms {summary['busy_is']} per step "
            f"({summary['busy_pct_of_wall']:.0f}% of the wall time); largest: {top}")
