"""
The record recipe against nanochat 92d63d4 itself, step by step: both base_trains run with the same explicit flags on
the same ClimbMix-layout shards and tokenizer, fp32 on CPU, and the training loss of every step is compared (and the
validation bpb at each evaluation). Being faithful means equal per-step losses, not similar curves.

    python -m bench.record_side_by_side                                  # d4, 50 steps, SSSL, evaluations at 25, 50
    python -m bench.record_side_by_side --steps=200 --depth=6 --anchor_compile=1

- 92d63d4 comes from its tarball (../shared/bench/nanochat-92d63d4.tar.gz, or --anchor / NANOCHAT_ANCHOR_92D63D4),
  extracted under --work with empty `__init__.py` in its scripts/ and tasks/ (../shared/bench/README.md, second
  section), and runs unchanged through bench/anchor_train_92d63d4.py, which only reads each step's exact loss.
  --anchor_compile=0 (default) runs it eagerly (TORCHDYNAMO_DISABLE=1), as ours runs (--compile=0); 1 runs it
  compiled as it ships (torch.compile with inductor's CPU kernels: other rounding, see docs/benchmarks.md).
- The data: --base_dir if given (it must hold base_data_climbmix/ and tokenizer/), else one made once under --work
  from WikiText-2 in ../shared/data (train.txt: train shard, valid.txt: validation) with a 4096-token tokenizer.
- Flags: ours `--recipe=record` and the flags below (underscores), 92d63d4's the same ones dashed; its defaults are the
  record recipe's (tests/test_record_model.py), so the runs agree in every hyperparameter not named here.

Prints a markdown table of the steps (every step with --every=1) and the largest difference; --out writes the
per-step figures as JSON. Exit status 1 when a difference is above --atol (1e-4: the issue's bar).
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from nanochat.configurator import Flag, Flags, parse_flags_or_exit  # noqa: E402
from nanochat.metrics import read_metrics  # noqa: E402

DEFAULT_ANCHOR = Path(os.environ.get("NANOCHAT_ANCHOR_92D63D4",
                                     REPO.parent / "shared" / "bench" / "nanochat-92d63d4.tar.gz"))
CORPUS = REPO.parent / "shared" / "data" / "pretrain" / "wikitext-2"

FLAGS = Flags(
    "what runs",
    Flag("depth", 4, "model depth (both)"),
    Flag("head_dim", 64, "attention head width (both; width = depth x 64 rounded up to whole heads)"),
    Flag("max_seq_len", 256, "context (the short windows of SSSL are a quarter of it, rounded up to 128)"),
    Flag("window_pattern", "SSSL", "sliding-window pattern (both)"),
    Flag("device_batch_size", 8, "rows per forward"),
    Flag("total_batch_size", 2048, "tokens per step (2048 = one forward of 8 x 256: no accumulation)"),
    Flag("steps", 50, "optimisation steps"),
    Flag("warmup_steps", 5, "learning-rate warmup steps (the recipe's 40 would leave 50 steps mostly warmup)"),
    Flag("eval_every", 25, "validation bpb every this many steps (both; <= 0: none)"),
    Flag("eval_tokens", 4096, "tokens per validation"),
    "how",
    Flag("anchor", str(DEFAULT_ANCHOR), "nanochat 92d63d4's tarball"),
    Flag("anchor_compile", False, "run 92d63d4 compiled as it ships (default: eager, as ours)"),
    Flag("ours_flags", "", "more base_train flags for our run only (e.g. --compile=1)"),
    Flag("base_dir", None, "a base dir with base_data_climbmix/ and tokenizer/; auto = made under --work", type=str),
    Flag("work", "/tmp/nanochat-record-sbs", "scratch directory (the extracted anchor, the data, both runs)"),
    Flag("threads", 2, "OMP_NUM_THREADS of both runs"),
    Flag("together", False, "run both at the same time (give each --threads=1 on 2 cores): half the wall time, and "
         "the seconds printed mean nothing"),
    Flag("atol", 1e-4, "the largest per-step loss difference accepted (exit 1 above it)"),
    Flag("every", 5, "print every this many steps in the table (and every step above --atol)"),
    Flag("out", None, "write the per-step figures here as JSON", type=str),
)


def log(msg):
    print(f"[record_side_by_side] {msg}", file=sys.stderr, flush=True)


def prepare_anchor(tarball, work):
    """92d63d4 extracted (or, from an extracted copy, copied) under work/ once, its scripts/ and tasks/ made regular
    packages. `tarball`: its .tar.gz, or a directory that holds its extracted tree (read only: it is copied)."""
    tarball = Path(tarball)
    if not tarball.is_file() and not (tarball / "scripts" / "base_train.py").is_file():
        raise SystemExit(f"nanochat 92d63d4 (its tarball, or an extracted copy) is not at {tarball}: pass --anchor or "
                         f"set NANOCHAT_ANCHOR_92D63D4")
    anchor = work / "nanochat-92d63d4"
    if not (anchor / "scripts" / "base_train.py").is_file():
        tmp = work / "anchor.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if tarball.is_file():
            with tarfile.open(tarball) as tar:
                tar.extractall(tmp, filter="data")
        else:
            shutil.copytree(tarball, tmp / "nanochat-92d63d4")
        shutil.rmtree(anchor, ignore_errors=True)
        (tmp / "nanochat-92d63d4").rename(anchor)
        tmp.rmdir()
    for pkg in ("scripts", "tasks"):  # so the project's editable install does not shadow them (its README)
        (anchor / pkg / "__init__.py").touch()
    return anchor


def prepare_data(work, env):
    """A base dir with WikiText-2 imported as ClimbMix-layout shards and a 4096-token tokenizer trained on them."""
    base = work / "data"
    if (base / "tokenizer" / "tokenizer.pkl").is_file() and len(list((base / "base_data_climbmix").glob("*.parquet"))) >= 2:
        return base
    if not (CORPUS / "train.txt").is_file():
        raise SystemExit(f"no WikiText-2 at {CORPUS}: pass --base_dir with base_data_climbmix/ and tokenizer/")
    log(f"importing {CORPUS} into {base}/base_data_climbmix and training a 4096-token tokenizer")
    env = dict(env, NANOCHAT_BASE_DIR=str(base))
    py = [sys.executable, "-m"]
    subprocess.run([*py, "nanochat.dataset", "import", str(CORPUS / "train.txt"), "--val_paths", str(CORPUS / "valid.txt"),
                    "--data=climbmix", "--overwrite"], env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*py, "scripts.tok_train", "--max_chars=20000000", "--vocab_size=4096", "--data=climbmix"], env=env,
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return base


def run_base(work, who, data):
    """A base dir of its own for a run (checkpoints, report) over the shared shards and tokenizer."""
    d = work / f"{who}-base"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for name in ("base_data_climbmix", "tokenizer"):
        os.symlink(data / name, d / name)
    return d


def shared_flags(c):
    """The flags both base_trains get (underscore form)."""
    return {"device_type": "cpu", "depth": c["depth"], "head_dim": c["head_dim"], "max_seq_len": c["max_seq_len"],
            "window_pattern": c["window_pattern"], "device_batch_size": c["device_batch_size"],
            "total_batch_size": c["total_batch_size"], "num_iterations": c["steps"], "warmup_steps": c["warmup_steps"],
            "eval_every": c["eval_every"] if c["eval_every"] > 0 else -1, "eval_tokens": c["eval_tokens"],
            "core_metric_every": -1, "sample_every": -1, "save_every": -1, "model_tag": "sbs"}


def run(cmd, cwd, env, log_path):
    t0 = time.time()
    with open(log_path, "w") as f:
        p = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        tail = Path(log_path).read_text(errors="replace").splitlines()[-15:]
        raise SystemExit(f"{' '.join(map(str, cmd[:4]))} ... failed (exit {p.returncode}); see {log_path}:\n" + "\n".join(tail))
    return time.time() - t0


def run_theirs(c, anchor, data, work, env):
    base = run_base(work, "theirs", data)
    out = work / "theirs.jsonl"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shared_flags(c).items()]
    env = dict(env, NANOCHAT_BASE_DIR=str(base), PYTHONPATH=str(anchor))
    if not c["anchor_compile"]:
        env["TORCHDYNAMO_DISABLE"] = "1"
    dt = run([sys.executable, str(REPO / "bench" / "anchor_train_92d63d4.py"), str(out), *flags], anchor, env,
             work / "theirs.log")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    bpb = {r["step"]: r["val_bpb"] for r in records if "val_bpb" in r}
    return losses, bpb, dt


def run_ours(c, data, work, env):
    base = run_base(work, "ours", data)
    flags = ["--recipe=record", *(f"--{k}={v}" for k, v in shared_flags(c).items()), "--compile=0",
             *c["ours_flags"].split()]
    env = dict(env, NANOCHAT_BASE_DIR=str(base), PYTHONPATH=str(REPO))
    dt = run([sys.executable, "-m", "scripts.base_train", *flags], REPO, env, work / "ours.log")
    records = read_metrics(base / "base_checkpoints" / "sbs" / "metrics.jsonl")
    losses = {r["step"] - 1: r["train/raw_loss"] for r in records if "train/raw_loss" in r}  # logged at step + 1
    bpb = {r["step"]: r["val/bpb"] for r in records if "val/bpb" in r}
    return losses, bpb, dt


def compare(c, ours, theirs):
    (o_loss, o_bpb, o_dt), (t_loss, t_bpb, t_dt) = ours, theirs
    if sorted(o_loss) != list(range(c["steps"])) or sorted(t_loss) != list(range(c["steps"])):
        raise SystemExit(f"expected the losses of steps 0..{c['steps'] - 1}, got {len(o_loss)} (ours) and "
                         f"{len(t_loss)} (92d63d4)")
    if sorted(o_bpb) != sorted(t_bpb):
        raise SystemExit(f"the evaluations ran at other steps: ours {sorted(o_bpb)}, 92d63d4 {sorted(t_bpb)}")
    steps = [{"step": s, "ours": o_loss[s], "theirs": t_loss[s], "diff": abs(o_loss[s] - t_loss[s])}
             for s in range(c["steps"])]
    evals = [{"step": s, "ours": o_bpb[s], "theirs": t_bpb[s], "diff": abs(o_bpb[s] - t_bpb[s])} for s in sorted(o_bpb)]
    worst = max(steps, key=lambda r: r["diff"])
    return {"config": dict(shared_flags(c), anchor_compile=c["anchor_compile"], ours_flags=c["ours_flags"]),
            "steps": steps, "evals": evals, "max_diff": worst["diff"], "max_diff_step": worst["step"],
            "exact_steps": sum(r["diff"] == 0 for r in steps), "max_bpb_diff": max((r["diff"] for r in evals), default=0.0),
            "seconds": {"ours": round(o_dt, 1), "theirs": round(t_dt, 1)}}


def print_table(c, result):
    print("| step | ours (record recipe) | nanochat 92d63d4 | abs diff |\n|---|---|---|---|")
    for r in result["steps"]:
        if r["step"] % c["every"] == 0 or r["step"] == c["steps"] - 1 or r["diff"] > c["atol"]:
            print(f"| {r['step']} | {r['ours']:.9f} | {r['theirs']:.9f} | {r['diff']:.2e} |")
    for r in result["evals"]:
        print(f"| val bpb @ {r['step']} | {r['ours']:.9f} | {r['theirs']:.9f} | {r['diff']:.2e} |")
    print(f"\nlargest per-step loss difference: {result['max_diff']:.3e} (step {result['max_diff_step']}); "
          f"{result['exact_steps']}/{c['steps']} steps bit for bit equal; largest val bpb difference "
          f"{result['max_bpb_diff']:.3e}; 92d63d4 {'compiled' if c['anchor_compile'] else 'eager'}, ours eager; "
          f"{result['seconds']['ours']}s / {result['seconds']['theirs']}s; load average {result['loadavg']}")


def main(argv=None):
    c = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    work = Path(c["work"])
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(c["threads"]), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.pop("NANOCHAT_COMPILE", None)
    anchor = prepare_anchor(c["anchor"], work)
    data = Path(c["base_dir"]) if c["base_dir"] else prepare_data(work, env)
    load_before = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    log(f"92d63d4 ({'compiled' if c['anchor_compile'] else 'eager'}): {c['steps']} steps at d{c['depth']}")
    if c["together"]:
        log("ours at the same time: the same flags with --recipe=record")
        with ThreadPoolExecutor(2) as pool:
            pending = pool.submit(run_theirs, c, anchor, data, work, env), pool.submit(run_ours, c, data, work, env)
            theirs, ours = (f.result() for f in pending)
    else:
        theirs = run_theirs(c, anchor, data, work, env)
        log("ours: the same flags with --recipe=record")
        ours = run_ours(c, data, work, env)
    result = compare(c, ours, theirs)
    result["loadavg"] = " ".join(load_before)
    print_table(c, result)
    if c["out"]:
        Path(c["out"]).write_text(json.dumps(result, indent=1))
    return 1 if result["max_diff"] > c["atol"] or result["max_bpb_diff"] > c["atol"] else 0


if __name__ == "__main__":
    sys.exit(main())
