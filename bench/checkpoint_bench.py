"""
Checkpoint save time and rank 0's peak memory on the FSDP path: today's gather-to-rank-0 single files
(--checkpoint_format=single) against sharded checkpoints (every rank writes its shard; nanochat/checkpoint/sharded.py),
synchronous and --async_save.

    torchrun --nproc_per_node=2 -m bench.checkpoint_bench --depth=20          # results: docs/benchmarks.md
    torchrun --nproc_per_node=8 -m bench.checkpoint_bench --depth=40 --dir=/fast/disk/tmp

The model is a real GPT of --depth (nanochat's shapes, vocab 65536) sharded with FSDP2 and its real optimizers
(FSDPAdamW + FSDPMuon), their state filled by one optimizer step on random gradients (no forward: only the state
matters here). Each format saves the same step --repeat times into --dir (deleted afterwards); reported per save:
- save: seconds from the call until every rank may go on (both formats end in a barrier), median over the repeats
- async: for --async_save, the seconds training is blocked (the copy of the shards to CPU memory) and the seconds
  until the step is complete on disk
- rank 0 peak: the largest rise of rank 0's resident memory (RSS, sampled every 2 ms) over its level before the save
"""

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from nanochat.configurator import Flag, Flags, parse_flags_or_exit  # noqa: E402
from nanochat.distributed.dist import compute_cleanup, compute_init  # noqa: E402
from nanochat.gpt import GPT, config_for_depth  # noqa: E402
from nanochat.distributed.parallel import FSDP, parallel_from_config  # noqa: E402
from nanochat.checkpoint import sharded  # noqa: E402
from nanochat.checkpoint.train_state import save_train_state  # noqa: E402

FLAGS = Flags(
    Flag("depth", 12, "model depth (nanochat's shapes)"),
    Flag("vocab_size", 65536, "vocabulary (nanochat's tokenizer: 65536)"),
    Flag("repeat", 2, "saves per format"),
    Flag("dir", None, "where to write the checkpoints (deleted afterwards); auto = a temp dir", type=str),
    Flag("formats", "single,sharded,async", "comma-separated: single, sharded, async"),
)

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The largest RSS seen while inside the block, sampled every 2 ms by a thread, minus the RSS at entry."""

    def __enter__(self):
        self.base = self.peak = rss()
        self.stop = threading.Event()

        def sample():
            while not self.stop.wait(0.002):
                self.peak = max(self.peak, rss())

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss())
        self.rise = self.peak - self.base


def build(depth, vocab_size, parallel):
    config = config_for_depth(depth, vocab_size, 64)
    with torch.device("meta"):
        model = GPT(config, attn="sdpa")
    model.to_empty(device="cpu")
    model.init_weights()
    model = parallel.wrap(model, "cpu")
    opts = parallel.setup_optimizers(model)
    g = torch.Generator().manual_seed(dist.get_rank())
    for p in model.parameters():  # one step on random gradients: the optimizer state exists and is not zero
        local = torch.randn(p.to_local().shape, generator=g) * 1e-3
        p.grad = torch.distributed.tensor.DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                             shape=p.shape, stride=p.stride())
    for opt in opts:
        opt.step()
    model.zero_grad(set_to_none=True)
    return model, opts, config


def main(argv=None):
    cfg = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    _, rank, _, world, _ = compute_init("cpu", seed=0)
    model, opts, config = build(cfg["depth"], cfg["vocab_size"], FSDP())
    n_params = sum(p.numel() for p in model.parameters())
    root = cfg["dir"] or tempfile.gettempdir()
    out = os.path.join(root, f"checkpoint_bench_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
    meta = {"model_config": vars(config), "user_config": {"depth": cfg["depth"]}}
    results = {"depth": cfg["depth"], "params": n_params, "world": world, "fp32_model_GB": n_params * 4 / 1e9}
    strategies = {fmt: parallel_from_config({"use_fsdp": True, **flags}, rank, world) for fmt, flags in
                  (("single", {"checkpoint_format": "single"}), ("sharded", {}), ("async", {"async_save": True}))}
    for fmt in cfg["formats"].split(","):
        parallel = strategies[fmt]
        times, blocked, peaks = [], [], []
        for i in range(cfg["repeat"]):
            d = os.path.join(out, fmt)
            dist.barrier()
            with PeakRSS() as mem:
                t0 = time.perf_counter()
                save_train_state(d, i, model, opts, meta, None, parallel)
                t1 = time.perf_counter()
                sharded.wait_for_pending_save()  # async: until rank 0 renamed the step into place
                dist.barrier()
                t2 = time.perf_counter()
            times.append(t2 - t0)
            blocked.append(t1 - t0)
            peaks.append(mem.rise)
        results[fmt] = {"save_s": statistics.median(times), "blocked_s": statistics.median(blocked),
                        "rank0_peak_rise_GB": max(peaks) / 1e9}
        if fmt != "async":
            results[fmt].pop("blocked_s")
        if rank == 0:
            size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(out, fmt)) for f in fs)
            results[fmt]["on_disk_GB_per_step"] = size / cfg["repeat"] / 1e9
    dist.barrier()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(results))
    compute_cleanup()


if __name__ == "__main__":
    main()
