"""
Quality per FLOP (issue 29): the record recipe (`base_train --recipe=record`) against the December one (the default)
at equal training compute, with nanochat 92d63d4's own base_train as the record recipe's anchor.

    python -m bench.record_quality                                   # d4 and d6, seeds 42 and 43, + 92d63d4
    python -m bench.record_quality --depths=4 --december_steps=100 --anchor=/path/to/nanochat-92d63d4
    python -m bench.record_quality --table_from=/tmp/nanochat-record-quality/record_quality.jsonl

- The budget: at each depth, the December model's FLOPs per token (its own estimate_flops, as base_train logs it) x
  tokens per step x --december_steps. Every run gets `--target_flops` = that budget, so base_train (and 92d63d4's)
  picks round(budget / (its FLOPs per token x tokens per step)) steps: the record model, which costs more per token,
  trains fewer steps. Training FLOPs therefore agree to within one step's worth.
- The data: the same shards and tokenizer for every run (--base_dir, else WikiText-2 from ../shared/data imported as
  ClimbMix-layout shards with a 4096-token tokenizer, as bench/record_side_by_side.py makes them), read with
  best-fit packing by all three (92d63d4's loader; December here gets --packing=bestfit instead of its concat): the
  same training rows in the same order and the same validation tokens, so the bpb figures are comparable. The
  validation bpb is base_train's own evaluation at the last step (--eval_tokens tokens of the validation shard).
- The recipes run with their own defaults otherwise (learning rates and their batch scaling, warmup, warmdown, weight
  decay, head dim, windows), fp32 on CPU, eager (--compile=0; 92d63d4 with TORCHDYNAMO_DISABLE=1). 92d63d4 runs
  unchanged through bench/anchor_train_92d63d4.py (NANOCHAT_ANCHOR_SEED for seeds other than its fixed 42), from
  --anchor (its tarball or an extracted copy, copied under --work); without one its rows are skipped with the reason.
- --recipes may add `record_lr_at_ref`: the record recipe with its learning rates multiplied by sqrt(2^19 / B), which
  cancels its sqrt(B / 2^19) batch scaling (a diagnosis of the small batch this CPU affords, not a recipe).

Each finished run is appended to --out as a JSON line (a stopped bench keeps its rows); the tables (per depth: recipe,
seed, steps, tokens, training FLOPs, val bpb, wall time; then the mean over seeds and the differences to December)
are printed at the end, or from an earlier --out with --table_from.
"""

import json
import math
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.record_side_by_side import DEFAULT_ANCHOR, prepare_anchor, prepare_data, run, run_base  # noqa: E402
from nanochat.configurator import Flag, Flags, parse_flags_or_exit  # noqa: E402
from nanochat.metrics import read_metrics  # noqa: E402

OURS = ("december", "record", "record_lr_at_ref")
ANCHOR = "92d63d4"
B_REF = 2**19  # the record recipe's reference batch (nanochat/recipe.py): its learning rates scale by sqrt(B / B_REF)
RECORD_LRS = ("embedding_lr", "unembedding_lr", "matrix_lr", "scalar_lr")

FLAGS = Flags(
    "what runs",
    Flag("depths", "4,6", "model depths, comma-separated"),
    Flag("seeds", "42,43", "seeds, comma-separated (--seed here; 92d63d4 re-seeded after its fixed 42)"),
    Flag("anchor_seeds", None, "seeds of the 92d63d4 runs; auto = --seeds (it equals the record recipe here step for "
         "step, so one seed anchors it where time is short)", type=str),
    Flag("recipes", f"december,record,{ANCHOR}", f"runs per depth and seed, in order: december, record, {ANCHOR} "
         "(its own code), record_lr_at_ref (see above)"),
    Flag("december_steps", 60, "the budget: the December model's FLOPs for this many steps at each depth", min=1),
    Flag("max_seq_len", 256, "context (the record model's short windows are a quarter of it rounded up to 128: at 256 "
         "they cut, at 128 or less they see everything)"),
    Flag("device_batch_size", 4, "rows per forward"),
    Flag("total_batch_size", 1024, "tokens per step, every run (max_seq_len x device_batch_size: no accumulation)"),
    Flag("eval_tokens", 16384, "validation tokens of the final evaluation (the same ones for every run)"),
    "how",
    Flag("anchor", str(DEFAULT_ANCHOR), "nanochat 92d63d4: its tarball or an extracted copy (copied under --work); "
         "missing: its rows are skipped"),
    Flag("base_dir", None, "a base dir with base_data_climbmix/ and tokenizer/; auto = made under --work", type=str),
    Flag("work", "/tmp/nanochat-record-quality", "scratch directory (the anchor copy, the data, every run)"),
    Flag("threads", 2, "OMP_NUM_THREADS of every run"),
    Flag("out", None, "JSON lines, one per finished run; auto = <work>/record_quality.jsonl", type=str),
    Flag("table_from", None, "print the tables of an earlier --out and exit (runs nothing)", type=str),
)


def log(msg):
    print(f"[record_quality] {msg}", file=sys.stderr, flush=True)


def flops_per_token(recipe, depth, vocab_size, seq_len):
    """The model's own estimate (estimate_flops, what base_train's horizon divides by), from a meta-device model."""
    import torch

    from nanochat.gpt import make_model
    from nanochat.recipe import resolve_recipe

    config = {"recipe": recipe, "depth": depth, "max_seq_len": seq_len}
    model_config = resolve_recipe(config).model_config(config, vocab_size)  # the recipe's head dim, windows, ...
    with torch.device("meta"):
        return make_model(model_config).estimate_flops()


def vocab_size(data):
    from nanochat.tokenizer import RustBPETokenizer

    return RustBPETokenizer.from_directory(str(data / "tokenizer")).get_vocab_size()


def loadavg():
    p = Path("/proc/loadavg")
    return " ".join(p.read_text().split()[:3]) if p.exists() else ""


def shared_flags(c, depth, budget):
    """The flags every run gets (underscores; 92d63d4's are the same dashed). eval_every above any step count: the
    only evaluation is the one at the last step."""
    return {"device_type": "cpu", "depth": depth, "max_seq_len": c["max_seq_len"],
            "device_batch_size": c["device_batch_size"], "total_batch_size": c["total_batch_size"],
            "target_flops": repr(float(budget)), "eval_every": 10**9, "eval_tokens": c["eval_tokens"],
            "core_metric_every": -1, "sample_every": -1, "save_every": -1, "model_tag": "qpf"}


def run_ours(c, recipe, depth, seed, budget, data, work, env):
    base = run_base(work, f"d{depth}-{recipe}-s{seed}", data)
    extra = []
    if recipe == "record_lr_at_ref":
        from nanochat.recipe import RECIPES

        k = math.sqrt(B_REF / c["total_batch_size"])
        extra = [f"--{name}={RECIPES['record'][name] * k!r}" for name in RECORD_LRS]
    flags = [f"--recipe={'december' if recipe == 'december' else 'record'}", "--data=climbmix", "--packing=bestfit",
             *(f"--{k}={v}" for k, v in shared_flags(c, depth, budget).items()), "--compile=0", f"--seed={seed}", *extra]
    env = dict(env, NANOCHAT_BASE_DIR=str(base), PYTHONPATH=str(REPO))
    seconds = run([sys.executable, "-m", "scripts.base_train", *flags], REPO, env, base / "train.log")
    records = read_metrics(base / "base_checkpoints" / "qpf" / "metrics.jsonl")
    steps = sum("train/raw_loss" in r for r in records)
    bpb = [r["val/bpb"] for r in records if "val/bpb" in r]
    return steps, bpb[-1], seconds


def run_anchor(c, anchor, depth, seed, budget, data, work, env):
    base = run_base(work, f"d{depth}-{ANCHOR}-s{seed}", data)
    out = base / "anchor.jsonl"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shared_flags(c, depth, budget).items()]
    env = dict(env, NANOCHAT_BASE_DIR=str(base), PYTHONPATH=str(anchor), TORCHDYNAMO_DISABLE="1",
               NANOCHAT_ANCHOR_SEED=str(seed))
    seconds = run([sys.executable, str(REPO / "bench" / "anchor_train_92d63d4.py"), str(out), *flags], anchor, env,
                  base / "train.log")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    fpt = re.search(r"Estimated FLOPs per token: (\S+)", (base / "train.log").read_text())
    return sum("loss" in r for r in records), [r["val_bpb"] for r in records if "val_bpb" in r][-1], seconds, \
        float(fpt.group(1)) if fpt else None


def bench(c, work, data, anchor, skip_reason, out):
    env = dict(os.environ, OMP_NUM_THREADS=str(c["threads"]), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("NANOCHAT_COMPILE", None)
    vocab = vocab_size(data)
    B = c["total_batch_size"]
    rows = []

    def emit(row):
        rows.append(row)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")

    anchor_seeds = [int(s) for s in (c["anchor_seeds"] or c["seeds"]).split(",")]
    for depth in [int(d) for d in c["depths"].split(",")]:
        fpt = {r: flops_per_token("december" if r == "december" else "record", depth, vocab, c["max_seq_len"])
               for r in ("december", "record")}
        budget = fpt["december"] * B * c["december_steps"]
        log(f"d{depth}: budget {budget:.4e} FLOPs = {c['december_steps']} December steps of {B} tokens; FLOPs/token "
            f"december {fpt['december']:.4e}, record {fpt['record']:.4e}")
        recipes = c["recipes"].split(",")
        if ANCHOR in recipes and anchor is None:
            emit({"depth": depth, "recipe": ANCHOR, "skipped": skip_reason})
            log(f"d{depth}: {ANCHOR} skipped: {skip_reason}")
        for seed in [int(s) for s in c["seeds"].split(",")]:
            for recipe in recipes:
                if recipe == ANCHOR and (anchor is None or seed not in anchor_seeds):
                    continue
                load = loadavg()
                log(f"d{depth} seed {seed}: {recipe} (load average {load})")
                if recipe == ANCHOR:
                    steps, bpb, seconds, anchor_fpt = run_anchor(c, anchor, depth, seed, budget, data, work, env)
                    per_token = anchor_fpt or fpt["record"]
                else:
                    steps, bpb, seconds = run_ours(c, recipe, depth, seed, budget, data, work, env)
                    per_token = fpt["december" if recipe == "december" else "record"]
                emit({"depth": depth, "recipe": recipe, "seed": seed, "steps": steps, "tokens": steps * B,
                      "flops_per_token": per_token, "train_flops": per_token * steps * B, "budget_flops": budget,
                      "val_bpb": bpb, "seconds": round(seconds, 1), "loadavg": load,
                      "data": "shared shards and tokenizer, best-fit packing"})
    return rows


def tables(rows):
    """Markdown: per depth the runs, then the mean val bpb over seeds per recipe and its difference to December."""
    lines = []
    for depth in sorted({r["depth"] for r in rows}):
        at = [r for r in rows if r["depth"] == depth]
        lines += [f"\nd{depth}\n", "| recipe | seed | steps | tokens | training FLOPs | val bpb | wall s |",
                  "|---|---|---|---|---|---|---|"]
        for r in at:
            if "skipped" in r:
                lines.append(f"| {r['recipe']} | - | - | - | - | skipped: {r['skipped']} | - |")
            else:
                lines.append(f"| {r['recipe']} | {r['seed']} | {r['steps']} | {r['tokens']:,} | {r['train_flops']:.4e} | "
                             f"{r['val_bpb']:.4f} | {r['seconds']:.0f} |")
        ran = [r for r in at if "skipped" not in r]
        means = {}
        for recipe in dict.fromkeys(r["recipe"] for r in ran):
            bpbs = [r["val_bpb"] for r in ran if r["recipe"] == recipe]
            means[recipe] = (sum(bpbs) / len(bpbs), len(bpbs))
        if means:
            lines += ["", "| recipe | seeds | mean val bpb | minus December |", "|---|---|---|---|"]
            dec = means.get("december", (None,))[0]
            for recipe, (mean, n) in means.items():
                diff = f"{mean - dec:+.4f}" if dec is not None and recipe != "december" else "-"
                lines.append(f"| {recipe} | {n} | {mean:.4f} | {diff} |")
    return "\n".join(lines)


def main(argv=None):
    c = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    if c["table_from"]:
        print(tables([json.loads(line) for line in Path(c["table_from"]).read_text().splitlines() if line.strip()]))
        return 0
    unknown = set(c["recipes"].split(",")) - {*OURS, ANCHOR}
    if unknown:
        raise SystemExit(f"--recipes: unknown {', '.join(sorted(unknown))}; choose from {', '.join((*OURS, ANCHOR))}")
    work = Path(c["work"])
    work.mkdir(parents=True, exist_ok=True)
    if c["total_batch_size"] != c["device_batch_size"] * c["max_seq_len"]:
        log("note: --total_batch_size is not one forward: gradient accumulation (both recipes alike)")
    anchor, skip_reason = None, None
    if ANCHOR in c["recipes"].split(","):
        try:
            anchor = prepare_anchor(c["anchor"], work)
        except SystemExit as e:
            skip_reason = str(e)
    env = dict(os.environ, OMP_NUM_THREADS=str(c["threads"]))
    data = Path(c["base_dir"]) if c["base_dir"] else prepare_data(work, env)
    out = Path(c["out"] or work / "record_quality.jsonl")
    out.write_text("")
    t0 = time.time()
    rows = bench(c, work, data, anchor, skip_reason, out)
    print(tables(rows))
    print(f"\n{len([r for r in rows if 'skipped' not in r])} runs in {time.time() - t0:.0f} s; rows in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
