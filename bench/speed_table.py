"""
One markdown table from the logs of `bash bench/gpu_suite.sh speed` (or its --cpu mode), ready to paste into
docs/benchmarks.md: the training step per attention backend, where a step's time goes (a profiler trace), FP8 (shape
filter) against bf16, and Engine decode at batch 1 and 8, eager against compiled (a CUDA graph on GPU), with the
fraction of the memory-bandwidth bound.

    python -m bench.speed_table /tmp/gpu_suite     # reads speed_*.log / speed_decode.json there

Every row names the card. A training row is labelled by the SDPA kernel torch dispatched its attention to and
whether that is the kernel torch's own order picks (bench/train_bench.py records both; the suite's env.log has
torch's order), never by what a backend is assumed to run; ratios are to the row that ran torch's own pick. A step
or backend that did not finish gives a row that says so and why (its error, the time limit, its log's last error
line), so a missing figure is never a silent gap; losses that were not finite and CUDA graphs inductor skipped are
in the notes.
"""

import json
from pathlib import Path

from bench.profile_step import describe as describe_profile
from bench.rows import suspect_notes
from nanochat.configurator import Flag, Flags


def read_log(path):
    """(rows, error records, profile records, other notes) from a train_bench log: its JSON lines by status, and the
    lines that say why something stopped."""
    rows, errors, profiles, notes = [], [], [], []
    if not path.exists():
        return rows, errors, profiles, [f"not run ({path.name} missing)"]
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            status = rec.get("status", "ok")
            (rows if status == "ok" else profiles if status == "profile" else errors).append(rec)
        elif line.startswith(("error:", "interrupted")) or "Error" in line:
            notes.append(line.strip())
    return rows, errors, profiles, notes


def status(out, name):
    """Why a step gave nothing (more): its recorded exit code (124 = the time limit) and its last error line."""
    rc_file = out / f"{name}.rc"
    rc = rc_file.read_text().strip() if rc_file.exists() else "?"
    why = "hit its time limit" if rc in ("124", "130", "137") else f"exit code {rc}"
    *_, notes = read_log(out / f"{name}.log")
    return f"not measured: {why}" + (f" ({notes[-1][:160]})" if notes else "")


def fmt(x, spec=",.0f"):
    return "n/a" if x is None else format(x, spec)


def kernel_label(r):
    """'ran cudnn (torch's own pick)' / 'ran flash (torch's own order: cudnn)' / 'flex' for non-SDPA backends."""
    ran, pick = r.get("sdpa_kernel"), r.get("sdpa_torch_kernel")
    if ran is None:
        return "kernel not recorded"
    if not r["attn"].startswith("sdpa"):
        return f"{ran} (torch's own SDPA pick: {pick})"
    return f"ran {ran}" + (" (torch's own pick)" if ran == pick else f" (torch's own order: {pick})")


def is_torch_pick(r):
    return r["attn"].startswith("sdpa") and r.get("sdpa_kernel") and r.get("sdpa_kernel") == r.get("sdpa_torch_kernel")


FLAGS = Flags(
    Flag("out", "/tmp/gpu_suite", "the suite's $OUT: speed_*.log, speed_*.rc and speed_decode.json", positional=True),
    Flag("baseline_attn", "torch_pick", "the training row the others are compared to: torch_pick = the first row that "
         "ran the kernel torch's own SDPA order picks, or a backend name (sdpa_flash, ...)"),
    description=__doc__,
)


def main(argv=None):
    args = FLAGS.parse_args(argv)
    out = Path(args.out)
    rows = []
    card = None

    train, errors, profiles, notes = read_log(out / "speed_attn.log")
    if args.baseline_attn == "torch_pick":
        base = next((r for r in train if is_torch_pick(r)), None)
    else:
        base = next((r for r in train if r["attn"] == args.baseline_attn), None)
    base_name = f"{base['attn']} ({base['sdpa_kernel']})" if base else args.baseline_attn
    orders = sorted({r["sdpa_torch_order"] for r in train if r.get("sdpa_torch_order")})
    for r in train:
        card = card or r["device"]
        ratio = f"{r['tok_per_s'] / base['tok_per_s']:.2f}x of {base_name}" if base else "n/a"
        rows.append((r["device"], f"train d{r['depth']} {r['batch']}x{r['seq_len']}, attn {r['attn_kernels']}: "
                     f"{kernel_label(r)}", fmt(r["tok_per_s"]), f"{r['mfu_pct']:.1f}%" if r["mfu_pct"] is not None else "n/a",
                     fmt(r["peak_mem_gib"], ".1f"), ratio, suspect_notes(r)))
    shape = f"d{train[0]['depth']} {train[0]['batch']}x{train[0]['seq_len']}" if train else "d20"
    for e in errors:
        rows.append((card or "?", f"train {shape}, attn={e['attn']}", f"not measured: {e['status']} ({e['error'][:200]})",
                     "", "", "", ""))
    stopped = [n for n in notes if n.startswith("interrupted")]
    if stopped or not train:
        rows.append((card or "?", f"train {shape}, attention backends", status(out, "speed_attn")
                     + (f": {stopped[0]}" if stopped and stopped[0] not in status(out, "speed_attn") else ""), "", "", "", ""))
    for p in profiles:
        prof = p["profile"]
        what = prof["error"] if "error" in prof else describe_profile(prof)
        rows.append((p["device"], f"where a train d{p['depth']} step's time goes (attn {p['attn']}, {prof.get('steps', '?')} "
                     "steps under torch.profiler)", "", "", "", "", what))

    fp8, fp8_errors, _, _ = read_log(out / "speed_fp8.log")
    bf16 = next((r for r in train if r["attn"] == "sdpa"), None)  # the auto backend, bf16
    for r in fp8:
        ratio = f"{r['tok_per_s'] / bf16['tok_per_s']:.2f}x of bf16" if bf16 else "n/a"
        rows.append((r["device"], f"train d{r['depth']} {r['batch']}x{r['seq_len']}, FP8 {r['fp8']}, attn {r['attn_kernels']}: "
                     f"{kernel_label(r)}", fmt(r["tok_per_s"]),
                     f"{r['mfu_pct']:.1f}% (bf16 peak)" if r["mfu_pct"] is not None else "n/a",
                     fmt(r["peak_mem_gib"], ".1f"), ratio, suspect_notes(r)))
    if not fp8:
        rows.append((card or "?", f"train {shape}, FP8 tensorwise (filter auto)", status(out, "speed_fp8"), "", "", "", ""))

    decode_file = out / "speed_decode.json"
    if decode_file.exists():
        data = json.loads(decode_file.read_text())
        eager = {r["batch"]: r for r in data["engine"] if r["decode"] == "eager" and "error" not in r}
        for r in data["engine"]:
            if "error" in r:
                rows.append((data["hardware"], f"decode d{r['depth']} batch {r['batch']}, {r['decode']}",
                             f"not measured: failed ({r['error'][:200]})", "", "", "", ""))
                continue
            bound = (f"bandwidth bound: {100 * r['decode_tps'] / r['bound_tps']:.0f}% of {r['bound_tps']:,.0f} "
                     f"({r['bound_bytes'] / 1e9:.2f} GB a step)") if r.get("bound_tps") else "bandwidth bound: n/a"
            e = eager.get(r["batch"])
            ratio = f"{r['decode_tps'] / e['decode_tps']:.2f}x of eager" if e and r is not e else ""
            rows.append((data["hardware"], f"decode d{r['depth']} batch {r['batch']}, {r['decode']}, "
                         f"{r.get('weights_dtype', '?')} weights, attention {r.get('sdpa_kernel', '?')} "
                         f"(prompt {r['prompt']}, first run {r['warmup_s']:.0f} s)", fmt(r["decode_tps"]), bound, "", ratio,
                         suspect_notes(r)))
        if data.get("interrupted"):
            rows.append((data["hardware"], "decode, the rows after these", status(out, "speed_decode"), "", "", "", ""))
    else:
        rows.append((card or "?", "decode d20 batch 1 and 8, eager vs compiled", status(out, "speed_decode"), "", "", "", ""))

    if orders:
        print(f"torch's own SDPA kernel order on this card, after a call: {'; '.join(orders)}")
        print()
    print("| card | run | tok/s | MFU / bound | peak GiB | ratio | notes |")
    print("|---|---|---:|---|---:|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
