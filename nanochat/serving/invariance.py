"""
Batch invariance on CPU: when a request's arithmetic does not depend on the requests that share its forwards.

A decode step computes every running row in one matmul per weight, and a packed prefill computes several prompts'
tokens in one. A BLAS picks its kernel by the matrix sizes, and its kernels sum in different orders, so a row's bits
may change with the number of rows beside it. Two answers, both measured here rather than assumed:

- `strict_blas(device_type)`, called by a server process before its first matmul: torch's CPU BLAS on x86 is MKL,
  whose strict CNR mode (MKL_CBWR=<branch>,STRICT) makes its matmuls compute each row the same bits at any row
  count (docs/benchmarks.md: every size from 1 to 2,048 rows, for every weight shape of d4, one and two threads);
  on the CPU of docs/benchmarks.md it is also faster than MKL's default from ~12 rows on, slower at one row.
- `decode_sizes` / `invariant_sizes`: the row counts at which each of the model's matmuls gives a row the bits it
  gets at the most rows, measured once per process (every size under strict MKL; 16 and up under MKL's default on
  that CPU; other machines and BLAS libraries differ). A batch-invariant decode step runs only at those sizes.
- `packs_invariantly`: whether prompts may share a prefill forward without changing a bit of any prompt's logits:
  every size measured invariant up to the prefill budget, and a model that says its per-token arithmetic is exact
  wherever the token sits in the sequence (GPT: yes; RecordGPT: yes, its gates computed in whole vectors on CPU,
  gpt.gate_sigmoid).
"""

import os

import torch
import torch.nn.functional as F


def strict_blas(device_type):
    """
    Sets MKL's strict reproducibility mode for this process (MKL_CBWR, the branch this CPU supports: AVX512 or AVX2)
    where it would matter: on CPU, with torch's MKL, when the user has not set MKL_CBWR. MKL reads it at its first
    call, so this runs before any matmul of the process (a later call changes nothing; the measured sizes then say
    so). Returns the setting in force, or None.
    """
    if torch.device(device_type).type != "cpu" or not torch.backends.mkl.is_available():
        return None
    branch = strict_branch()
    if not os.environ.get("MKL_CBWR") and branch is not None:
        os.environ["MKL_CBWR"] = f"{branch},STRICT"
    return os.environ.get("MKL_CBWR") or None


def strict_branch():
    """The MKL code branch with a strict mode that this machine can run (AVX512, AVX2), or None: no such CPU, or a
    torch whose BLAS is not MKL (an ARM wheel's)."""
    if not torch.backends.mkl.is_available():
        return None
    flags = cpu_flags()
    return "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None


def cpu_flags():
    """The CPU's feature flags (Linux's /proc/cpuinfo; an empty set where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def invariant_sizes(weights, max_rows, sizes=None):
    """
    Of `sizes` (default 1..max_rows), those at which a matmul with each of `weights` (Linear weights, out x in) gives
    every row the same bits as at max_rows: measured on random rows, with the thread count and dtype the caller runs
    in (~0.1 s at d4 and 64 rows), once per process and setting. max_rows is always one of them.
    """
    sizes = sorted(set(range(1, max_rows + 1) if sizes is None else sizes) | {max_rows})
    out = set(sizes)
    for w in {(tuple(w.shape), w.dtype, str(w.device)): w for w in weights}.values():
        key = (tuple(w.shape), w.dtype, str(w.device), max_rows, tuple(sizes), torch.get_num_threads(), F.linear)
        if key not in _INVARIANT:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(max_rows, w.size(1), generator=gen).to(device=w.device, dtype=w.dtype)
            full = F.linear(x, w)
            _INVARIANT[key] = {m for m in sizes if torch.equal(F.linear(x[:m], w), full[:m])}
        out &= _INVARIANT[key]
    return sorted(out)


# invariant_sizes' findings by weight shape, dtype, device, sizes and thread count: a property of this process's BLAS,
# so measured once (generate_many builds a scheduler per call); keyed by F.linear too, which a test replaces
_INVARIANT = {}


def linear_weights(model):
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def decode_sizes(model, rows, invariant):
    """
    The batch sizes an eager decode step may run at, up to the pool's `rows` (a step takes the smallest one that
    holds its rows): every size when not batch-invariant (no filler rows), else the sizes at which every Linear of
    `model` computes a row the same bits (invariant_sizes): a request's logits then do not depend on how many
    neighbours it has. (A compiled step runs at the buckets, kv_slots.decode_buckets.)
    """
    if not invariant:
        return list(range(1, rows + 1))
    return invariant_sizes(linear_weights(model), rows)


def packs_invariantly(model, rows, budget):
    """
    True when prompt chunks may share one prefill forward (kv_slots.PackedPrefillView) and each prompt still gets
    the bits of its own prefill: the model declares its per-token arithmetic independent of the token's place in
    the sequence (`packed_prefill_invariant`), its matmuls give a row the same bits at every decode size up to
    `rows` (the logits are computed for one row per chunk) and, but for the unembedding, at every size up to the
    prefill `budget` tokens (all sizes to 64, then every 127th and the budget itself).
    """
    if not getattr(model, "packed_prefill_invariant", False):
        return False
    weights = linear_weights(model)
    if invariant_sizes(weights, rows) != list(range(1, rows + 1)):
        return False
    head = getattr(model, "lm_head", None)
    body = [w for w in weights if head is None or w is not head.weight]
    sample = sorted(set(range(1, min(budget, 64) + 1)) | set(range(64 + 127, budget + 1, 127)) | {budget})
    return invariant_sizes(body, budget, sample) == sample
