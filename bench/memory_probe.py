"""
How large a device batch fits: peak GPU memory of full training steps (forward + backward + grad clip + optimizer
step, as base_train) at doubling device batches, per depth, until the GPU runs out of memory.

    python -m bench.memory_probe --depths=26,32,40 --max_seq_len=2048            # one GPU
    python -m bench.memory_probe --depths=20 --compile=1 --batches=16,32          # compiled (less activation memory)

For each depth it prints the peak at each batch that fit, the first one that did not, and splits the peak into a
fixed part (weights, gradients, optimizer state: the peak at batch 0 extrapolated) and a per-sequence part (the slope
between the two largest batches that fit). That split is what the presets need: under FSDP on N GPUs the fixed part
shrinks by ~N (weights, gradients and state are sharded; one block's weights are gathered at a time), the
per-sequence part does not, so `(0.95 x GPU memory - fixed / N) / per-sequence` estimates the device batch there
(printed for N = 8; the measurement itself is one GPU, one process).
"""

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanochat.compile import maybe_compile, parse_compile_flag  # noqa: E402
from nanochat.configurator import Flag, Flags, parse_flags_or_exit  # noqa: E402
from nanochat.distributed.dist import compute_init  # noqa: E402
from nanochat.gpt import config_for_depth  # noqa: E402
from nanochat.training import autocast_ctx, dtype_flag, init_model, resolve_dtype, train_step  # noqa: E402

FLAGS = Flags(
    "probe",
    Flag("depths", "26,32,40", "comma-separated model depths"),
    Flag("batches", "1,2,4,8,16,32,64", "device batches to try, ascending; a depth stops at its first OOM"),
    Flag("max_seq_len", 2048, "tokens per row"),
    Flag("vocab_size", 65536, "vocabulary size (nanochat's tokenizer: 2**16)"),
    Flag("steps", 2, "steps per batch size (the second one has the optimizer state in place)"),
    Flag("activation_checkpointing", "none", "as base_train", choices=["none", "full", "selective"]),
    Flag("compile", "0", "torch.compile the model (0 = eager, the default here: quicker to probe; compiled steps hold less activation memory)", check=parse_compile_flag),
    dtype_flag(),
    Flag("json_out", "", "also write the raw numbers to this file"),
)


def probe_depth(cfg, depth, device):
    dtype = resolve_dtype(cfg["dtype"], device.type)
    autocast = lambda: autocast_ctx(device.type, dtype)  # noqa: E731
    L = cfg["max_seq_len"]
    model = init_model(config_for_depth(depth, cfg["vocab_size"], L), device, "normal", "sdpa")
    model.set_activation_checkpointing(cfg["activation_checkpointing"], 2)
    optimizers = model.setup_optimizers()
    n_params = model.num_params()
    fits, oom_at = [], None
    for B in [int(b) for b in cfg["batches"].split(",")]:
        step_model = maybe_compile(model, cfg["compile"], device, B, L, autocast=autocast, log=lambda *a: None)
        batch = torch.randint(0, cfg["vocab_size"], (B, L + 1), device=device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            for _ in range(cfg["steps"]):
                train_step(step_model, optimizers, lambda: (batch[:, :-1], batch[:, 1:]), 1, 1.0, autocast)
            torch.cuda.synchronize(device)
        except torch.OutOfMemoryError:
            oom_at = B
            break
        finally:
            batch = None  # free it before the next batch size (the step closure above reads it only in the loop)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        fits.append((B, peak))
        print(f"d{depth} ({n_params / 1e9:.2f}B) batch {B} x {L}: peak {peak:.1f} GiB", flush=True)
    del model, optimizers, step_model
    gc.collect()
    torch.cuda.empty_cache()
    row = {"depth": depth, "params": n_params, "seq_len": L, "fits": fits, "oom_at": oom_at}
    if len(fits) >= 2:
        (b1, p1), (b2, p2) = fits[-2], fits[-1]
        per_seq = (p2 - p1) / (b2 - b1)
        fixed = p2 - per_seq * b2
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        row.update(per_seq_gib=per_seq, fixed_gib=fixed,
                   est_max_batch_8gpu=int((total * 0.95 - fixed / 8) // per_seq) if per_seq > 0 else None)
    return row


def main(argv=None):
    cfg = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    try:
        _, _, _, _, device = compute_init("cuda")
    except RuntimeError as e:
        raise SystemExit(f"error: bench.memory_probe measures GPU memory and needs CUDA: {e}")
    rows = []
    for depth in [int(d) for d in cfg["depths"].split(",")]:
        rows.append(probe_depth(cfg, depth, device))
    name = torch.cuda.get_device_name(device)
    print(f"\n{name}, torch {torch.__version__}, {cfg['dtype']} autocast, compile={cfg['compile']}, "
          f"AC={cfg['activation_checkpointing']}, T={cfg['max_seq_len']}, one process (whole optimizer state on this GPU)\n")
    print("| depth | params | largest batch that fit (peak GiB) | first OOM | fixed GiB | GiB per sequence | est. max batch, FSDP on 8 GPUs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        big = f"{r['fits'][-1][0]} ({r['fits'][-1][1]:.1f})" if r["fits"] else "none"
        fixed = f"{r['fixed_gib']:.1f}" if "fixed_gib" in r else "n/a"
        per = f"{r['per_seq_gib']:.2f}" if "per_seq_gib" in r else "n/a"
        est = r.get("est_max_batch_8gpu")
        print(f"| d{r['depth']} | {r['params'] / 1e9:.2f}B | {big} | {r['oom_at'] or '-'} | {fixed} | {per} | {est if est is not None else 'n/a'} |")
    if cfg["json_out"]:
        Path(cfg["json_out"]).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
