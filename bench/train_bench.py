"""
Training throughput of one model config: tokens/s and MFU of full optimisation steps (forward + backward +
grad clip + optimizer step), timed after warmup, on synthetic tokens (no data or tokenizer needed).

    python -m bench.train_bench --depth=4 --max_seq_len=256 --device_batch_size=8 --device_type=cpu
    python -m bench.train_bench --depth=20 --max_seq_len=2048 --device_batch_size=32 --attn=sdpa,fa3   # one H100
    python -m bench.train_bench --depth=20 --max_seq_len=2048 --device_batch_size=32 --fp8=1 --activation_checkpointing=full

It builds the model and optimizers exactly as scripts.base_train does (nanochat.training), so the figures are the
training loop's. MFU = estimate_flops() per token x tokens/s / peak bf16 FLOPS of the GPU (nanochat.common's
table, matched by device name); there is no MFU on CPU. `--attn` takes a comma list to compare backends in one run;
each result is printed as soon as it is measured, as a markdown table row plus one JSON line, so a run stopped by a
time limit (SIGINT: `timeout --signal=INT`) keeps every finished row; a backend that fails or cannot run gives a JSON
line with its error and the next one runs. Each row also records the SDPA kernel torch dispatches its training call
to and torch's own kernel order (nanochat.attention.sdpa_kernel_for, torch_sdpa_order), the CUDA graphs inductor
skipped, and losses that were not finite. --profile_steps=N traces N more steps of the first backend with
torch.profiler and prints where their time went (bench/profile_step.py). --activation_checkpointing/--ac_every and
--fp8/--fp8_recipe are base_train's (the parallel plan's prepare, nanochat/distributed/parallel.py): the MFU counts the
model's FLOPs only, so AC's recompute shows as lower MFU, and FP8 is divided by the bf16 peak as well (speedup = the
ratio of the rows).
"""

import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from nanochat.training import autocast_ctx, check_model_options, dtype_flag, init_model, resolve_dtype, train_step  # noqa: E402
from nanochat.attention import ATTN_CHOICES, sdpa_kernel_for, torch_sdpa_order  # noqa: E402
from bench.profile_step import describe as describe_profile, profile_steps  # noqa: E402
from bench.rows import cudagraph_skips, emit, exit_now, suspect_notes  # noqa: E402
from nanochat.common import autodetect_device_type, device_type_flag, peak_flops_for  # noqa: E402
from nanochat.distributed.dist import compute_cleanup, compute_init, dist_world_size, is_ddp_initialized  # noqa: E402
from nanochat.distributed.parallel import parallel_from_config  # noqa: E402
from nanochat.compile import compile_flag, resolve_compile  # noqa: E402
from nanochat.configurator import Flag, Flags, parse_flags_or_exit  # noqa: E402
from nanochat.fp8 import FP8_FILTER_HELP, FP8_IMPL_HELP, FP8_IMPLS  # noqa: E402
from nanochat.gpt import config_for_depth  # noqa: E402

FLAGS = Flags(
    "model",
    Flag("depth", 4, "transformer blocks (as base_train)"),
    Flag("max_seq_len", 256, "tokens per row"),
    Flag("device_batch_size", 8, "rows per step"),
    Flag("vocab_size", 65536, "vocabulary size (nanochat's tokenizer: 2**16)"),
    Flag("init", "normal", "weight init (as base_train)", choices=["normal", "nanochat"]),
    Flag("attn", "auto", "attention kernel (nanochat.attention: auto, sdpa, sdpa_cudnn, sdpa_flash, flex, fa3, fa4, ...), "
         "or a comma list such as sdpa_cudnn,sdpa_flash,flex to compare them (one that cannot run is skipped with why)"),
    "timing",
    Flag("steps", 10, "timed steps"),
    Flag("warmup", 3, "untimed steps first (compilation, allocator, optimizer state)"),
    Flag("profile_steps", 0, "after the first backend's timed steps, trace this many more with torch.profiler and "
         "print the shares of attention, matmuls, optimizer, cross-entropy and the rest (0: no trace)"),
    "training",
    compile_flag(),
    dtype_flag(),
    Flag("use_muon", True, "Muon for the matrices (0: AdamW for everything)"),
    Flag("grad_clip", 1.0, "clip the gradient norm to this (<= 0: no clipping)"),
    Flag("use_fsdp", False, "the FSDP2 path instead of the DDP path (launch under torchrun, as base_train: "
         "`torchrun --nproc_per_node=1 -m bench.train_bench --use_fsdp=1 ...`); under torchrun without it: the DDP path"),
    Flag("activation_checkpointing", "none", "recompute block activations in the backward (as base_train)",
         choices=["none", "full", "selective"]),
    Flag("ac_every", 2, "selective activation checkpointing: every ac_every-th block"),
    Flag("fp8", False, "FP8 block matmuls (CUDA with compute capability >= 8.9), as base_train"),
    Flag("fp8_recipe", "tensorwise", "FP8 scaling granularity", choices=["tensorwise", "rowwise"]),
    Flag("fp8_impl", "torchao", FP8_IMPL_HELP, choices=list(FP8_IMPLS)),
    Flag("fp8_filter", "auto", FP8_FILTER_HELP),
    "systems",
    device_type_flag(),
    Flag("threads", 0, "CPU threads for torch (0 = torch's default)"),
    Flag("seed", 42, "seed of the weights and the synthetic tokens"),
)
DEFAULTS = FLAGS.defaults()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def synthetic_batches(cfg, device, n=4):
    """n (inputs, targets) pairs made up front, so host-side data work is not part of the timing. Contiguous (B, L)
    tensors, as the data loader yields and the compile warm-up traces: strided views of one (B, L + 1) tensor fail
    dynamo's stride guard and recompile the whole model at the first step (on an H100 that second compile of the FP8
    model pushed the run past its time limit)."""
    g = torch.Generator().manual_seed(cfg["seed"])
    batches = []
    for _ in range(n):
        b = torch.randint(0, cfg["vocab_size"], (cfg["device_batch_size"], cfg["max_seq_len"] + 1), generator=g)
        batches.append((b[:, :-1].contiguous().to(device), b[:, 1:].contiguous().to(device)))
    return batches


def sdpa_kernels(model, cfg, dtype, device):
    """(kernel the model's choice runs for the training call, kernel torch's own order picks for it): torch is asked
    about q/k/v of the training shape, dtype and layout ((B, T, H, D) transposed, as the model makes them), causal,
    needing grad; one row of the batch (the batch size does not change the pick). fa3/fa4/flex do not go
    through SDPA: their name."""
    c = model.config
    D, T = c.n_embd // c.n_head, cfg["max_seq_len"]
    q, k, v = (torch.zeros(1, T, H, D, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
               for H in (c.n_head, c.n_kv_head, c.n_kv_head))
    choice = model.attn_choice
    ran = sdpa_kernel_for(choice.order, q, k, v, is_causal=True) if choice.name.startswith("sdpa") else choice.name
    return ran, sdpa_kernel_for(None, q, k, v, is_causal=True)


def bench_one(cfg, attn, device, parallel, torch_order=(), profile=0, on_row=None):
    """Time one backend; on_row(row) as soon as its row is measured, then the --profile_steps trace (row['profile'])."""
    device_type = device.type
    torch.manual_seed(cfg["seed"])
    dtype = resolve_dtype(cfg["dtype"], device_type)
    model_config = config_for_depth(cfg["depth"], cfg["vocab_size"], cfg["max_seq_len"])
    model = init_model(model_config, device, cfg["init"], attn)
    autocast = lambda: autocast_ctx(device_type, dtype)  # noqa: E731
    # --activation_checkpointing, --fp8, the layout and compile: the plan's one call, as in base_train
    model, orig_model = parallel.prepare(model, cfg, device, autocast)
    optimizers = parallel.setup_optimizers(orig_model, use_muon=cfg["use_muon"])
    compiled = resolve_compile(cfg["compile"], device_type, log=lambda *a: None)  # the FSDP path compiles in place

    B, L = cfg["device_batch_size"], cfg["max_seq_len"]
    batches = synthetic_batches(cfg, device)
    it = iter(range(10**9))

    def next_batch():
        return batches[next(it) % len(batches)]

    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    skips_before = cudagraph_skips()
    times, losses = [], []
    for step in range(cfg["warmup"] + cfg["steps"]):
        sync(device)
        t0 = time.perf_counter()
        loss, _, _ = train_step(model, optimizers, next_batch, 1, cfg["grad_clip"], autocast)  # .item() syncs too
        sync(device)
        dt = time.perf_counter() - t0
        losses.append(loss)
        if step >= cfg["warmup"]:
            times.append(dt)
    ran, torch_pick = sdpa_kernels(orig_model, cfg, dtype, device)  # dtype: what autocast gives attention

    flops_per_token = orig_model.estimate_flops()
    tokens = B * L
    dt_med = statistics.median(times)
    tok_s = tokens / dt_med
    peak = peak_flops_for(device)
    mfu = 100 * flops_per_token * tok_s / peak if peak else None
    row = {
        "status": "ok",
        "device": torch.cuda.get_device_name(device) if device_type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "depth": cfg["depth"],
        "params": orig_model.num_params(),
        "seq_len": L,
        "batch": B,
        "dtype": str(dtype).removeprefix("torch."),
        "compile": compiled,
        "attn": orig_model.attn_backend,
        "attn_kernels": orig_model.attn_choice.describe(),  # e.g. sdpa (cudnn > flash > efficient > math)
        "optimizer": "AdamW+Muon" if cfg["use_muon"] else "AdamW",
        "parallel": f"{parallel.name} x{dist_world_size()}" if is_ddp_initialized() else "one process",
        "activation_checkpointing": cfg["activation_checkpointing"] + (f" (every {cfg['ac_every']})" if cfg["activation_checkpointing"] == "selective" else ""),
        "fp8": f"{cfg['fp8_recipe']} {cfg['fp8_impl']} ({cfg['fp8_filter']})" if cfg["fp8"] else "off",
        "step_ms_median": 1000 * dt_med,
        "step_ms_mean": 1000 * statistics.mean(times),
        "step_ms_min": 1000 * min(times),
        "tok_per_s": tok_s,
        "flops_per_token": flops_per_token,
        "achieved_tflops": flops_per_token * tok_s / 1e12,
        "mfu_pct": mfu,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device_type == "cuda" else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "nonfinite_losses": sum(not math.isfinite(x) for x in losses),
        "steps_run": len(losses),
        "cudagraph_skips": cudagraph_skips() - skips_before,
        "sdpa_kernel": ran,  # what the row's attention runs for the training call
        "sdpa_torch_kernel": torch_pick,  # what torch's own order would run for it
        "sdpa_torch_order": " > ".join(torch_order),
    }
    if on_row:
        on_row(row)
    if profile:  # a trace that fails is said in its record; the row stands
        try:
            row["profile"] = profile_steps(lambda opts: train_step(model, opts, next_batch, 1, cfg["grad_clip"], autocast),
                                           optimizers, profile, device, lambda: sync(device))
        except Exception as e:
            row["profile"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return row


HEADER = (
    "| device | model | B x T | dtype | compile | attn | SDPA kernel | optimizer | parallel | AC | FP8 | step (ms, median) "
    "| tok/s | TFLOP/s | MFU | peak GiB | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def markdown_row(r):
    mfu = f"{r['mfu_pct']:.1f}%" if r["mfu_pct"] is not None else "n/a"
    peak = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a"
    return (
        f"| {r['device']} | d{r['depth']} ({r['params'] / 1e6:.1f}M) | {r['batch']} x {r['seq_len']} | {r['dtype']} | "
        f"{'yes' if r['compile'] else 'no'} | {r['attn_kernels']} | {r['sdpa_kernel']} (torch's order: "
        f"{r['sdpa_torch_kernel']}) | {r['optimizer']} | {r['parallel']} | {r['activation_checkpointing']} | "
        f"{r['fp8']} | {r['step_ms_median']:.1f} | {r['tok_per_s']:,.0f} | {r['achieved_tflops']:.3g} | {mfu} | {peak} "
        f"| {suspect_notes(r)} |"
    )


def main(argv=None):
    cfg = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    if cfg["steps"] < 1 or cfg["warmup"] < 0:
        print("error: --steps must be >= 1 and --warmup >= 0", file=sys.stderr)
        sys.exit(2)
    if cfg["threads"] > 0:
        torch.set_num_threads(cfg["threads"])
    device_type = cfg["device_type"] or autodetect_device_type()
    try:
        # seeds, TF32 matmuls on CUDA and, under torchrun, the process group: as the training scripts
        _, rank, _, _, device = compute_init(device_type, cfg["seed"])
        parallel = parallel_from_config(cfg)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if cfg["use_fsdp"] and not is_ddp_initialized():
        print("error: --use_fsdp=1 needs torchrun (torchrun --nproc_per_node=1 -m bench.train_bench ...)", file=sys.stderr)
        sys.exit(2)
    attns = [a.strip() for a in cfg["attn"].split(",") if a.strip()]
    unknown = [a for a in attns if a not in ATTN_CHOICES]
    if unknown or not attns:
        print(f"error: --attn takes a comma list of {'|'.join(ATTN_CHOICES)}, got {cfg['attn']!r}", file=sys.stderr)
        sys.exit(2)
    try:
        # --fp8=1 without FP8 hardware, a bad NANOCHAT_COMPILE: say so now. Not --attn: a kernel that cannot run
        # here is that backend's failure row, and the others still run.
        check_model_options({k: v for k, v in cfg.items() if k != "attn"}, device)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    say = emit if rank == 0 else (lambda *lines: None)
    torch_order = torch_sdpa_order(device)  # before any model runs (torch settles its default at the first call)
    if rank == 0:
        print(f"torch's own SDPA kernel order here, after a call: {' > '.join(torch_order)}", file=sys.stderr, flush=True)
    finished, profile = [], cfg["profile_steps"]

    def on_row(r):
        finished.append(r["attn"])
        say(*([HEADER] if len(finished) == 1 else []), markdown_row(r), json.dumps(r))

    try:
        for attn in attns:
            try:
                r = bench_one(cfg, attn, device, parallel, torch_order, profile, on_row)
            except Exception as e:  # any backend's failure is its row: the next backends still run
                # refusals (a kernel that cannot load or run here, flex's CPU backward) are skips; anything else is a
                # failure, with its traceback in the log
                how = "skipped" if isinstance(e, (RuntimeError, ValueError, NotImplementedError)) else "failed"
                if how == "failed":
                    traceback.print_exc()
                if len(attns) == 1:
                    print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
                    sys.exit(1)
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"attn={attn}: {how} ({why})", file=sys.stderr, flush=True)
                say(json.dumps({"attn": attn, "status": how, "error": why}))
            else:
                if "profile" in r:
                    p = r["profile"]
                    say(f"profile attn={r['attn']}, {profile} steps: " + (p["error"] if "error" in p else describe_profile(p)),
                        json.dumps({"attn": r["attn"], "status": "profile", "device": r["device"], "depth": r["depth"],
                                    "profile": p}))
                    profile = 0  # the first backend that ran only
            # the next backend's model gets the memory: drop the compiled graphs (they hold this model), cached blocks
            gc.collect()
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:  # the suite's time limit (timeout --signal=INT): the finished rows are printed already
        print(f"interrupted: {len(finished)} of {len(attns)} backend(s) finished ({', '.join(finished) or 'none'}), "
              "their rows are above", file=sys.stderr, flush=True)
        exit_now(130)
    compute_cleanup()


if __name__ == "__main__":
    main()
