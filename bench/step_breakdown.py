"""
Where a CPU training step goes, against the machine's matmul ceiling: compiled forward+backward, grad clip, each
optimizer's step, and the FLOPs each part must do, for this tree and (optionally) a nanochat checkout, alternating.

    python -m bench.step_breakdown --depth=6 --max_seq_len=512 --device_batch_size=4 --vocab_size=4096
    python -m bench.step_breakdown ... --ref=/tmp/nanochat-bench/ref --rounds=3     # side by side (bench/side_by_side.sh
                                                                                     # prepares that scratch copy)

Each tree runs in its own subprocess (both packages are called `nanochat`) on the same random weights' shapes and
tokens, compiled as its training does (the whole model with torch.compile; Newton-Schulz compiled: ours through
nanochat.compile, nanochat's by its decorator). The ceiling is the median rate of a 1536^3 fp32 matmul in the same
thread count (MKL's sgemm). FLOPs: forward+backward = GPT.estimate_flops() x tokens; Newton-Schulz = 5 iterations of
(X X^T, A A, B X) per matrix parameter, 2mnk each. When both parts run near the ceiling, the step cannot get much
faster without doing fewer FLOPs. Use OMP_NUM_THREADS=1 on a shared 2-core machine: it is far steadier than 2 threads.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ns_flops(shapes, steps=5):
    """FLOPs of Newton-Schulz on matrices of these shapes: per iteration A = X X^T (m x m from m x n, m <= n),
    A A, then (bA + cA^2) X."""
    total = 0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)
    return total


def worker(tree, cfg):
    """Runs in a subprocess with `tree` first on sys.path; prints one JSON line."""
    sys.path.insert(0, tree)
    import torch

    from nanochat.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    d, T, B, V = cfg["depth"], cfg["max_seq_len"], cfg["device_batch_size"], cfg["vocab_size"]
    heads = max(1, (d * 64 + 127) // 128)  # nanochat's rule: head dim 128
    config = GPTConfig(sequence_len=T, vocab_size=V, n_layer=d, n_head=heads, n_kv_head=heads, n_embd=d * 64)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizers = model.setup_optimizers()
    try:  # this project: Newton-Schulz compiles through nanochat.compile (nanochat's is decorated)
        from nanochat import muon

        if hasattr(muon, "set_compile"):
            muon.set_compile(True)
    except ImportError:
        pass
    compiled = torch.compile(model, dynamic=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (2, B, T), generator=g).unbind(0)
    times = {"fwd+bwd": [], "clip": [], **{type(o).__name__: [] for o in optimizers}}
    for step in range(cfg["warmup"] + cfg["steps"]):
        t0 = time.perf_counter()
        compiled(x, y).backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t2 = time.perf_counter()
        opt_times = []
        for opt in optimizers:
            t = time.perf_counter()
            opt.step()
            opt_times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
        if step >= cfg["warmup"]:
            times["fwd+bwd"].append(t1 - t0)
            times["clip"].append(t2 - t1)
            for opt, t in zip(optimizers, opt_times):
                times[type(opt).__name__].append(t)
    a, b = torch.randn(1536, 1536), torch.randn(1536, 1536)
    for _ in range(3):
        a @ b
    mm = []
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        mm.append(time.perf_counter() - t)
    matrices = [tuple(p.shape) for n, p in model.named_parameters() if p.ndim == 2 and ".h." in n]
    print(json.dumps({
        "ms": {k: 1000 * statistics.median(v) for k, v in times.items()},
        "fwd_bwd_flops": model.estimate_flops() * B * T,
        "ns_flops": ns_flops(matrices),
        "sgemm_gflops": 2 * 1536**3 / statistics.median(mm) / 1e9,
        "threads": torch.get_num_threads(),
    }))


def worker_main(argv):
    """The subprocess side. It must not import nanochat before worker() puts the tree first on sys.path (both trees'
    packages are called nanochat), so it reads its few integer flags (passed on by main, already validated) by hand."""
    tree = next(a.split("=", 1)[1] for a in argv if a.startswith("--_worker="))
    kv = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a and not a.startswith("--_worker"))
    return worker(tree, {k: int(kv[k]) for k in ("depth", "max_seq_len", "device_batch_size", "vocab_size", "steps", "warmup")})


def run_tree(tree, cfg):
    p = subprocess.run([sys.executable, "-m", "bench.step_breakdown", f"--_worker={tree}", *cfg["_argv"]],
                       cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{tree}: failed\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--_worker=") for a in argv):
        return worker_main(argv)
    from nanochat.configurator import Flag, Flags, parse_flags_or_exit

    flags = Flags(
        "step",
        Flag("depth", 6, "transformer blocks"),
        Flag("max_seq_len", 512, "tokens per row"),
        Flag("device_batch_size", 4, "rows per step"),
        Flag("vocab_size", 4096, "vocabulary size"),
        Flag("steps", 8, "timed steps (median)"),
        Flag("warmup", 3, "untimed steps first (compilation)"),
        Flag("rounds", 1, "alternating rounds of the trees"),
        Flag("ref", "", "a nanochat checkout to measure beside this tree (empty: this tree only)"),
        description=__doc__,
    )
    cfg = parse_flags_or_exit(flags, argv, description=__doc__)
    cfg["_argv"] = [f"--{k}={cfg[k]}" for k in ("depth", "max_seq_len", "device_batch_size", "vocab_size", "steps", "warmup")]
    trees = [("ours", str(REPO))] + ([("nanochat", cfg["ref"])] if cfg["ref"] else [])
    results = {name: [] for name, _ in trees}
    for r in range(cfg["rounds"]):
        for name, tree in (trees if r % 2 == 0 else trees[::-1]):
            results[name].append(run_tree(tree, cfg))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in results[name][-1]["ms"].items()),
                  flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f}; config d{cfg['depth']}, {cfg['device_batch_size']} x "
          f"{cfg['max_seq_len']}, vocab {cfg['vocab_size']}; median over rounds of each tree's median step parts\n")
    print("| tree | threads | fwd+bwd ms (GFLOP/s, % of sgemm) | clip ms | AdamW ms | Muon ms (NS GFLOP/s, %) | step ms | sgemm GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        med = lambda key: statistics.median(r["ms"][key] for r in runs)  # noqa: E731
        sgemm = statistics.median(r["sgemm_gflops"] for r in runs)
        fb, ns = med("fwd+bwd"), med("Muon")
        fb_rate, ns_rate = runs[0]["fwd_bwd_flops"] / fb / 1e6, runs[0]["ns_flops"] / ns / 1e6
        step = sum(med(k) for k in runs[0]["ms"])
        print(f"| {name} | {runs[0]['threads']} | {fb:.0f} ({fb_rate:.0f}, {100 * fb_rate / sgemm:.0f}%) | {med('clip'):.1f} | "
              f"{med('AdamW'):.1f} | {ns:.0f} ({ns_rate:.0f}, {100 * ns_rate / sgemm:.0f}%) | {step:.0f} | {sgemm:.0f} |")


if __name__ == "__main__":
    main()
