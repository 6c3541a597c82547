"""
One markdown table from the logs of `bash bench/gpu_suite.sh speed` (or its --cpu mode), ready to paste into
docs/benchmarks.md: the training step per attention backend, FP8 (shape filter) against bf16, and Engine decode at
batch 1 and 8, eager against compiled (a CUDA graph on GPU), with the fraction of the memory-bandwidth bound.

    python -m bench.speed_table /tmp/gpu_suite     # reads speed_*.log / speed_decode.json there

Every row names the card. A step that did not finish gives a row that says so and why (its log's last error line, or
the time limit), so a missing figure is never a silent gap.
"""

import json
from pathlib import Path

from nanochat.configurator import Flag, Flags


def json_lines(path):
    """The JSON records train_bench prints (one per line), and the lines saying why a backend was skipped."""
    records, notes = [], []
    if not path.exists():
        return records, [f"not run ({path.name} missing)"]
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        elif "skipped (" in line or line.startswith("error:") or "Error" in line:
            notes.append(line.strip())
    return records, notes


def status(out, name):
    """Why a step gave nothing: its recorded exit code (124 = the time limit) and its last error line."""
    rc_file = out / f"{name}.rc"
    rc = rc_file.read_text().strip() if rc_file.exists() else "?"
    why = "hit its time limit" if rc in ("124", "130", "137") else f"exit code {rc}"
    _, notes = json_lines(out / f"{name}.log")
    return f"not measured: {why}" + (f" ({notes[-1][:160]})" if notes else "")


def fmt(x, spec=",.0f"):
    return "n/a" if x is None else format(x, spec)


FLAGS = Flags(
    Flag("out", "/tmp/gpu_suite", "the suite's $OUT: speed_*.log, speed_*.rc and speed_decode.json", positional=True),
    Flag("baseline_attn", "sdpa_flash", "the training row the others are compared to (sdpa_flash: FA2 first, the "
         "previous default)"),
    description=__doc__,
)


def main(argv=None):
    args = FLAGS.parse_args(argv)
    out = Path(args.out)
    rows = []
    card = None

    train, notes = json_lines(out / "speed_attn.log")
    base = next((r for r in train if r["attn"] == args.baseline_attn), None)
    for r in train:
        card = card or r["device"]
        ratio = f"{r['tok_per_s'] / base['tok_per_s']:.2f}x" if base else "n/a"
        rows.append((r["device"], f"train d{r['depth']} {r['batch']}x{r['seq_len']}, attn {r['attn_kernels']}", fmt(r["tok_per_s"]),
                     f"{r['mfu_pct']:.1f}%" if r["mfu_pct"] is not None else "n/a", fmt(r["peak_mem_gib"], ".1f"),
                     f"{ratio} of {args.baseline_attn}"))
    shape = f"d{train[0]['depth']} {train[0]['batch']}x{train[0]['seq_len']}" if train else "d20"
    for note in notes:
        if "skipped" in note:
            rows.append((card or "?", f"train {shape}, {note.split(':')[0]}", note.split("skipped", 1)[1].strip(" ()")[:200], "", "", ""))
    if not train:
        rows.append(("?", "train d20, attention backends", status(out, "speed_attn"), "", "", ""))

    fp8, _ = json_lines(out / "speed_fp8.log")
    bf16 = next((r for r in train if r["attn"] == "sdpa"), None)  # the auto backend, bf16
    for r in fp8:
        ratio = f"{r['tok_per_s'] / bf16['tok_per_s']:.2f}x of bf16" if bf16 else "n/a"
        rows.append((r["device"], f"train d{r['depth']} {r['batch']}x{r['seq_len']}, FP8 {r['fp8']}, attn {r['attn_kernels']}",
                     fmt(r["tok_per_s"]), f"{r['mfu_pct']:.1f}% (bf16 peak)" if r["mfu_pct"] is not None else "n/a",
                     fmt(r["peak_mem_gib"], ".1f"), ratio))
    if not fp8:
        rows.append((card or "?", f"train {shape}, FP8 tensorwise (filter auto)", status(out, "speed_fp8"), "", "", ""))

    decode_file = out / "speed_decode.json"
    if decode_file.exists():
        data = json.loads(decode_file.read_text())
        eager = {r["batch"]: r for r in data["engine"] if r["decode"] == "eager"}
        for r in data["engine"]:
            bound = f"{100 * r['decode_tps'] / r['bound_tps']:.0f}% of {r['bound_tps']:,.0f}" if r.get("bound_tps") else "n/a"
            e = eager.get(r["batch"])
            ratio = f"{r['decode_tps'] / e['decode_tps']:.2f}x of eager" if e and r is not e else ""
            rows.append((data["hardware"], f"decode d{r['depth']} batch {r['batch']}, {r['decode']} "
                         f"(prompt {r['prompt']}, first run {r['warmup_s']:.0f} s)", fmt(r["decode_tps"]),
                         f"bandwidth bound: {bound}", "", ratio))
    else:
        rows.append((card or "?", "decode d20 batch 1 and 8, eager vs compiled", status(out, "speed_decode"), "", "", ""))

    print("| card | run | tok/s | MFU / bound | peak GiB | ratio |")
    print("|---|---|---:|---|---:|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
