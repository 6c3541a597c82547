"""
Runs that survive, on CPU: which resumes are exact (--deterministic: bit for bit, compiled; without it: the losses
within RESUME_LOSS_TOL), --resume_from_step=auto (the latest complete step, skipping a damaged one with a message),
and SIGTERM/SIGUSR1 (finish the step, save, exit 0, resume from there). The multi-rank versions of these, and the
chaos test (kill -9 at random moments under torchrun --max-restarts), are in tests/distributed/test_resume_dist.py.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, subprocess_env
from nanochat.checkpoint import resume
from nanochat.checkpoint.steps import latest_resumable_step, step_problem
from nanochat.checkpoint_manager import load_checkpoint, save_checkpoint
from nanochat.metrics import read_metrics
from nanochat.preemption import StopSignal
from nanochat.usage import Interrupted

# depth 2 (one attention + MLP pair is not enough to show the embedding's backward feeding the blocks), short rows
TINY = ["--depth=2", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=512", "--eval_every=-1",
        "--core_metric_every=-1", "--sample_every=-1", "--device_type=cpu"]
# What a resume without --deterministic keeps, as measured: the same training losses to this absolute tolerance
# (the order of the embedding gradient's atomic adds differs run to run: ~1e-5 in wte after a step)
RESUME_LOSS_TOL = 1e-4


def ckpt_dir(base_dir, tag):
    return base_dir / "base_checkpoints" / tag


def losses(base_dir, tag):
    """{step: raw training loss} from the run's metrics.jsonl (the last record of a step wins)."""
    return {r["step"]: r["train/raw_loss"] for r in read_metrics(ckpt_dir(base_dir, tag) / "metrics.jsonl")
            if "train/raw_loss" in r}


def base_train(base_dir, *args, threads=2, check=True):
    """base_train in a subprocess (so torch's deterministic mode and dynamo's caches stay out of pytest), with
    `threads` OpenMP threads: the CPU nondeterminism needs more than one."""
    cmd = [sys.executable, "-m", "scripts.base_train", *TINY, *args]
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(base_dir, OMP_NUM_THREADS=threads), capture_output=True,
                       text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def copy_step(base_dir, src_tag, dst_tag, step):
    """A fresh tag holding only one step's files: the interrupted run, as a new start finds it."""
    src, dst = ckpt_dir(base_dir, src_tag), ckpt_dir(base_dir, dst_tag)
    dst.mkdir(parents=True)
    for f in src.glob(f"*_{step:06d}*"):  # nanochat's files, or an FSDP run's sharded_<step> directory
        (shutil.copytree if f.is_dir() else shutil.copy)(f, dst / f.name)


def final_weights(base_dir, tag, step):
    return load_checkpoint(str(ckpt_dir(base_dir, tag)), step, "cpu")[0]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    differ = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not differ, f"{len(differ)} of {len(a)} tensors differ: {differ}"


# ------------------------------------------------------------------ point 1: what is exact


@pytest.mark.slow  # three compiled runs
def test_compiled_resume_is_bit_exact_with_deterministic(base_dir):
    """--compile=1 --deterministic=1: N steps + resume + N steps == 2N steps, every loss and every weight bit for bit
    (without the flag even two fresh runs differ: the next test)."""
    n = 3
    base_train(base_dir, "--compile=1", "--deterministic=1", f"--num_iterations={2 * n}", f"--save_every={n}",
               "--model_tag=full")
    copy_step(base_dir, "full", "resumed", n)
    base_train(base_dir, "--compile=1", "--deterministic=1", f"--num_iterations={2 * n}", "--model_tag=resumed",
               "--resume_from_step=auto")
    full, resumed = losses(base_dir, "full"), losses(base_dir, "resumed")
    assert [resumed[s] for s in range(n + 1, 2 * n + 1)] == [full[s] for s in range(n + 1, 2 * n + 1)]
    assert_same_weights(final_weights(base_dir, "full", 2 * n), final_weights(base_dir, "resumed", 2 * n))


@pytest.mark.slow  # three compiled runs
def test_compiled_runs_without_deterministic_differ_in_reduction_order_only(base_dir):
    """The default (compiled, 2 threads): two fresh runs differ in the weights (the embedding backward's atomic
    adds), a resume keeps the losses within RESUME_LOSS_TOL of the uninterrupted run's."""
    n = 3
    base_train(base_dir, "--compile=1", f"--num_iterations={2 * n}", f"--save_every={n}", "--model_tag=full")
    base_train(base_dir, "--compile=1", f"--num_iterations={2 * n}", "--model_tag=again")
    a, b = final_weights(base_dir, "full", 2 * n), final_weights(base_dir, "again", 2 * n)
    assert not torch.equal(a["transformer.wte.weight"], b["transformer.wte.weight"]), \
        "two compiled runs gave the same wte: the nondeterminism this test documents is gone (update docs/README)"
    copy_step(base_dir, "full", "resumed", n)
    base_train(base_dir, "--compile=1", f"--num_iterations={2 * n}", "--model_tag=resumed", f"--resume_from_step={n}")
    full, resumed = losses(base_dir, "full"), losses(base_dir, "resumed")
    for s in range(n + 1, 2 * n + 1):
        assert resumed[s] == pytest.approx(full[s], abs=RESUME_LOSS_TOL), (s, resumed[s], full[s])


# ------------------------------------------------------------------ point 2: automatic resume


def test_resume_flag_values():
    from scripts import base_train as script
    from nanochat.configurator import FlagError, parse_flags

    assert resume.parse_resume_step("auto") == "auto" and resume.parse_resume_step("-1") == -1
    assert resume.parse_resume_step(" 40 ") == 40
    for bad in ("latest", "-2", "1.5"):
        with pytest.raises(ValueError, match=r"--resume_from_step must be a saved step number, auto .* or -1"):
            resume.parse_resume_step(bad)
    flags = script.FLAGS
    assert parse_flags(flags, ["--resume_from_step=auto"])["resume_from_step"] == "auto"
    with pytest.raises((FlagError, ValueError), match="auto"):
        parse_flags(flags, ["--resume_from_step=newest"])


def write_step(d, step, world=1):
    """A real complete step as save_checkpoint writes it (world optimizer files, meta with its world size)."""
    for r in range(world):
        save_checkpoint(str(d), step, {"w": torch.full((4,), float(step))} if r == 0 else None, [{"r": r}],
                        {"step": step, "world_size": world}, rank=r)


def test_latest_resumable_step_skips_incomplete_and_damaged_steps(tmp_path):
    d = tmp_path / "d20"
    assert latest_resumable_step(str(d)) is None  # no directory: a fresh start
    for s in (2, 4, 6, 8):
        write_step(d, s, world=2)
    assert latest_resumable_step(str(d)) == 8 and step_problem(str(d), 8) is None
    # step 8: killed mid-save (no meta); step 6: model cut short on disk; step 4: a rank's optimizer file lost
    (d / "meta_000008.json").unlink()
    data = (d / "model_000006.pt").read_bytes()
    (d / "model_000006.pt").write_bytes(data[: len(data) // 2])
    (d / "optim_000004_rank1.pt").unlink()
    said = []
    assert latest_resumable_step(str(d), log=said.append) == 2
    assert len(said) == 3, said
    assert "step 8" in said[0] and "meta_000008.json is missing" in said[0]
    assert "step 6" in said[1] and "model_000006.pt is truncated" in said[1]
    assert "step 4" in said[2] and "optim_000004_rank1.pt is missing" in said[2]
    assert all("trying the step before it" in s for s in said)
    # the model alone is enough where no optimizer state is resumed; a meta that is not JSON is named
    assert latest_resumable_step(str(d), with_optimizer=False, log=said.append) == 4
    (d / "meta_000002.json").write_text('{"step": 2, "world')
    assert "meta_000002.json cannot be read" in step_problem(str(d), 2)


def test_resolve_resume_step(tmp_path, capsys):
    d = tmp_path / "d4"
    assert resume.resolve_resume_step("-1", str(d)) is None
    assert resume.resolve_resume_step("auto", str(d)) is None
    assert "no complete checkpoint" in capsys.readouterr().out
    write_step(d, 3)
    write_step(d, 5)
    (d / "optim_000005_rank0.pt").write_bytes(b"")
    assert resume.resolve_resume_step("auto", str(d)) == 3
    out = capsys.readouterr().out
    assert "skipping checkpoint step 5" in out and "optim_000005_rank0.pt is empty" in out
    assert "resuming from step 3" in out
    assert resume.resolve_resume_step("5", str(d)) == 5  # a step asked for by number is loaded as asked


def test_stop_signal_is_recorded_not_fatal():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopSignal().install()
    stop.training_started()
    try:
        assert not stop.requested(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second notice while the first is honoured: still alive
        assert stop.received == "SIGUSR1" and stop.requested(torch.device("cpu")) and stop.agreed == "SIGUSR1"
    finally:
        stop.uninstall()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_ctrl_c_is_a_stop_request_and_a_second_one_stops_at_once(capsys):
    """In the loop the first Ctrl-C is recorded (the step finishes and is saved), the second ends the run at once:
    Interrupted, status 130, whatever was running."""
    stop = StopSignal().install()
    stop.training_started()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested(torch.device("cpu")) and stop.agreed == "SIGINT"
        assert "SIGINT received: finishing this step, then saving a checkpoint and exiting (Ctrl-C again stops at " \
               "once, without saving)" in capsys.readouterr().out
        with pytest.raises(Interrupted, match="Stopped at once by a second Ctrl-C") as e:
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0)  # a point where Python runs the handler, as the training loop has many
        assert e.value.status == 130
    finally:
        stop.uninstall()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_stop_signal_during_start_up_ends_the_run_with_the_requeue_status(sig):
    """Before the loop (loading, compiling) there is no step to finish: the signal ends the run at once with one line
    and 128 + the signal, what a launcher's requeue reads."""
    stop = StopSignal().install()
    try:
        with pytest.raises(Interrupted, match=r"during start-up, before the first training step: nothing was "
                                              r"trained or saved") as e:
            os.kill(os.getpid(), sig)
            signal.sigtimedwait([], 0)
        assert e.value.status == 128 + sig
    finally:
        stop.uninstall()


def start_base_train(base_dir, *args):
    cmd = [sys.executable, "-m", "scripts.base_train", *TINY, *args]
    return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(base_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for_line(proc, needle, seen):
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return
    pytest.fail(f"the run ended before printing {needle!r}:\n{''.join(seen[-40:])}")


STOP_STEPS = 12
STOP_ARGS = [f"--num_iterations={STOP_STEPS}", "--save_every=100"]


@pytest.fixture(scope="module")
def never_stopped(module_base_dir):
    """The run the stop-signal tests stop and resume, never stopped (tag "full"): shared by the signals."""
    base_train(module_base_dir, *STOP_ARGS, "--model_tag=full", threads=1)
    return module_base_dir


@pytest.mark.slow  # two short runs, and the shared uninterrupted one
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signal_saves_exits_0_and_auto_resume_finishes_the_same_run(never_stopped, sig):
    """A stop signal mid-run: the step finishes, a checkpoint of it is written, exit code 0; the same command with
    --resume_from_step=auto then ends with the weights of a run that was never stopped."""
    base_dir, steps, args, tag = never_stopped, STOP_STEPS, STOP_ARGS, f"stopped_{sig.name}"
    proc, seen = start_base_train(base_dir, *args, f"--model_tag={tag}", "--resume_from_step=auto"), []
    wait_for_line(proc, f"step 00003/{steps:05d}", seen)
    proc.send_signal(sig)
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=120) == 0, out[-3000:]
    assert f"{sig.name} received: finishing this step" in out
    stopped_at = latest_resumable_step(str(ckpt_dir(base_dir, tag)))
    assert stopped_at is not None and 3 <= stopped_at < steps, out[-3000:]
    assert f"Stopped at step {stopped_at} on a stop signal" in out
    p = base_train(base_dir, *args, f"--model_tag={tag}", "--resume_from_step=auto", threads=1)
    assert f"resuming from step {stopped_at}" in p.stdout
    assert_same_weights(final_weights(base_dir, "full", steps), final_weights(base_dir, tag, steps))
    full, resumed = losses(base_dir, "full"), losses(base_dir, tag)
    assert [resumed[s] for s in range(1, steps + 1)] == [full[s] for s in range(1, steps + 1)]


# ------------------------------------------------------------------ saves that cannot strand disk (issue 31)


@pytest.mark.slow  # a training subprocess: seconds
def test_a_save_killed_mid_write_leaves_temp_files_that_the_next_start_removes(base_dir):
    """kill -9 while rank 0 writes step 4's model file (half of it on disk as the atomic write's temp file): the next
    start names and removes it in one line, and resumes from step 2."""
    plan = json.dumps({"0": {"rank": 0, "at": "save", "n": 3}})  # saves of step 2: model, optimizer; then step 4's model
    cmd = [sys.executable, "tests/dist_scripts/chaos_train.py", *TINY, "--num_iterations=6", "--save_every=2",
           "--model_tag=killed"]
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(base_dir, CHAOS_PLAN=plan), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stdout[-3000:] + p.stderr[-3000:]
    d = ckpt_dir(base_dir, "killed")
    [tmp] = [f.name for f in d.iterdir() if f.name.endswith(".tmp")]
    assert tmp.startswith("model_000004.pt.") and (d / tmp).stat().st_size > 0
    p = base_train(base_dir, "--num_iterations=6", "--save_every=2", "--model_tag=killed", "--resume_from_step=auto")
    assert f"Removed 1 temp file(s) of an interrupted save from {d}" in p.stdout and tmp in p.stdout
    assert "resuming from step 2" in p.stdout
    assert not [f for f in d.iterdir() if f.name.endswith(".tmp")]
    assert sorted(f.name for f in d.glob("model_*.pt")) == ["model_000002.pt", "model_000004.pt", "model_000006.pt"]
    # environment switches are flag defaults, so the run records what it ran with (conftest sets NANOCHAT_COMPILE=0)
    user_config = load_checkpoint(str(d), 6, "cpu")[2]["user_config"]
    assert user_config["compile"] == "0" and user_config["shared_fs"] is True


def test_stale_temp_files_are_what_killed_saves_leave_and_nothing_else(tmp_path):
    from nanochat.checkpoint.files import remove_stale_temp_files, stale_temp_files

    write_step(tmp_path, 2)
    (tmp_path / "model_000004.pt.k2j3_x9a.tmp").write_bytes(b"x" * 1000)  # atomic_write's name for its temp file
    (tmp_path / "sharded_000004.partial").mkdir()  # a sharded save cut short
    (tmp_path / "sharded_000004.partial" / "__0_0.distcp").write_bytes(b"y" * 500)
    (tmp_path / "notes.tmp").write_text("a user's file")  # not an atomic write's name
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    keep = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("model_000004.pt.k2j3_x9a.tmp",
                                                                         "sharded_000004.partial"))
    said = []
    removed = remove_stale_temp_files(str(tmp_path), log=said.append)
    assert [os.path.basename(p) for p in removed] == ["model_000004.pt.k2j3_x9a.tmp", "sharded_000004.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == keep
    assert len(said) == 1 and "Removed 2 temp file(s) of an interrupted save" in said[0] and "1.5 KB" in said[0]
    assert stale_temp_files(str(tmp_path)) == [] and remove_stale_temp_files(str(tmp_path), log=said.append) == []
    assert len(said) == 1  # nothing to remove: nothing said
    assert stale_temp_files(str(tmp_path / "absent")) == []


def test_a_save_that_does_not_fit_stops_before_writing_and_names_the_need(tmp_path, monkeypatch):
    """The free-space check before each save: the need (parameters + optimizer state), what is free, the way out;
    nothing of the step is written, the previous step stays the latest."""
    import collections

    from nanochat.checkpoint import files, train_state
    from nanochat.distributed.parallel import parallel_from_config
    from nanochat.gpt import GPTConfig
    from nanochat.training import init_model
    from nanochat.usage import CannotRun

    model = init_model(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=64), "cpu")
    optimizers = model.setup_optimizers()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    for opt in optimizers:
        opt.step()  # the optimizer state exists: it counts towards the need
    ddp = parallel_from_config({}, rank=0, world=1)
    train_state.save_train_state(str(tmp_path), 1, model, optimizers, {}, None, ddp)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - params, params))
    with pytest.raises(CannotRun, match=r"not enough disk space to save step 2 in .*: it needs about .* KB \(parameters "
                                        r"and optimizer state\) and .* KB is free; free space there .*--resume_from_step=auto"):
        train_state.save_train_state(str(tmp_path), 2, model, optimizers, {}, None, ddp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta_000001.json", "model_000001.pt", "optim_000001_rank0.pt"]
    # the need is the model and the optimizer state (Muon's momentum, AdamW's two moments): more than the parameters
    need = params + files.state_bytes([opt.state for opt in optimizers])
    assert need > 2 * params
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: usage(10**9, 0, int(need * files.FREE_SPACE_MARGIN) + 1))
    train_state.save_train_state(str(tmp_path), 2, model, optimizers, {}, None, ddp)  # just enough: saved
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: usage(10**9, 0, 0))
    with pytest.raises(CannotRun, match="not enough disk space to save step 3"):  # the model-only save (SFT, RL) too
        train_state.save_stage_model(str(tmp_path), 3, model, {}, ddp)


@pytest.mark.slow  # three short runs
def test_ctrl_c_saves_the_step_exits_130_and_auto_resume_finishes_the_same_run(base_dir):
    """Ctrl-C (SIGINT) mid-run, --deterministic: the step finishes and is saved, exit 130 with one line saying where
    and how to resume; --resume_from_step=auto then ends bit for bit where a run that was never stopped ends."""
    steps = 12
    args = [f"--num_iterations={steps}", "--save_every=100", "--deterministic=1"]
    base_train(base_dir, *args, "--model_tag=full", threads=1)
    proc, seen = start_base_train(base_dir, *args, "--model_tag=stopped"), []
    wait_for_line(proc, f"step 00003/{steps:05d}", seen)
    proc.send_signal(signal.SIGINT)
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=120) == 130, out[-3000:]
    assert "SIGINT received: finishing this step" in out and "Traceback" not in out, out[-3000:]
    d = ckpt_dir(base_dir, "stopped")
    stopped_at = latest_resumable_step(str(d))
    assert stopped_at is not None and 3 <= stopped_at < steps, out[-3000:]
    assert out.strip().splitlines()[-1] == (
        f"Stopped at step {stopped_at} on a stop signal (Ctrl-C (SIGINT)): checkpoint saved in {d}; start the same "
        f"command with --resume_from_step=auto (or --resume_from_step={stopped_at}) to continue")
    p = base_train(base_dir, *args, "--model_tag=stopped", "--resume_from_step=auto", threads=1)
    assert f"resuming from step {stopped_at}" in p.stdout
    assert_same_weights(final_weights(base_dir, "full", steps), final_weights(base_dir, "stopped", steps))
    full, resumed = losses(base_dir, "full"), losses(base_dir, "stopped")
    assert [resumed[s] for s in range(1, steps + 1)] == [full[s] for s in range(1, steps + 1)]


@pytest.mark.slow
def test_stop_signal_during_start_up_exits_with_one_line(base_dir):
    """SIGTERM while base_train is still starting (here: fetching the CORE bundle through a proxy that never answers,
    as a slow download or a long load would): exit 143 = 128 + SIGTERM with one line, no traceback, nothing saved."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes the connection, never says a word
        port = silent.getsockname()[1]
        args = [a for a in TINY if not a.startswith("--core_metric_every")] + ["--num_iterations=5"]
        cmd = [sys.executable, "-m", "scripts.base_train", *args, "--core_metric_every=100"]
        env = subprocess_env(base_dir, HTTPS_PROXY=f"http://127.0.0.1:{port}", https_proxy=f"http://127.0.0.1:{port}",
                             NO_PROXY="", no_proxy="", NANOCHAT_DATA_DIR="")
        proc, seen = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True), []
        wait_for_line(proc, "Training for", seen)  # the step count is known: the bundle comes next
        proc.send_signal(signal.SIGTERM)
        out = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, out[-3000:]
    assert "Traceback" not in out and out.strip().splitlines()[-1] == (
        "Stopped by SIGTERM during start-up, before the first training step: nothing was trained or saved; run the "
        "same command again to start"), out[-3000:]
    assert not ckpt_dir(base_dir, "d2").exists()
