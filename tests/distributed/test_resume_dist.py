"""
Runs that survive on 2 ranks (gloo on CPU; the signal and chaos tests under torchrun, as users launch, since its
agent passes the signals on and restarts the ranks; the others start the ranks directly, tests/ranks.py):
- --deterministic with --compile=1: N steps + resume + N steps == 2N steps bit for bit, on the DDP path and FSDP2;
- a stop signal that reaches one rank only: both ranks stop at the same step, save it and exit 0; Ctrl-C to torchrun:
  the ranks save one step and exit 130;
- the chaos test: kill -9 of a random rank at 3 random moments (one during a save) under torchrun --max-restarts with
  --resume_from_step=auto, and the final weights equal an uninterrupted run's;
- two nodes on one shared filesystem: a node that starts late does not tidy away a running node's temp file.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, free_port, run_torchrun, subprocess_env
from ranks import run_ranks
from nanochat.checkpoint.steps import latest_resumable_step
from test_resume import assert_same_weights, ckpt_dir, copy_step, final_weights, losses

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = ["--depth=2", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=512", "--eval_every=-1",
        "--core_metric_every=-1", "--sample_every=-1", "--device_type=cpu"]


def train_two_ranks(base_dir, *args, launcher=None, script=("-m", "scripts.base_train"), env=None, timeout=300):
    """base_train on two ranks (tests/ranks.py); under real torchrun with its `launcher` options when given (the chaos
    test's --max-restarts: torchrun's agent restarts the killed ranks)."""
    if "--compile=1" in args:  # a cold compile on each rank: minutes on a busy 2-core machine (a CI runner beside jobs)
        timeout = max(timeout, 600)
    cmd, env = [*script, *TINY, *args], env or subprocess_env(base_dir)
    if launcher is not None:
        return run_torchrun(cmd, env=env, extra_launcher_args=launcher, timeout=timeout)
    return run_ranks(cmd, env=env, timeout=timeout)


# The uninterrupted runs several tests compare against are run once per module (each is a 2-rank run, a compiled
# one costs a minute of the 2-core CPU): CALM_ARGS is the chaos test's command, whose uninterrupted run is also the
# one the DDP path's compiled resume repeats; EAGER_ARGS is the run both stop-signal tests stop and resume.
CHAOS_STEPS = 10
CALM_ARGS = ["--compile=1", "--deterministic=1", f"--num_iterations={CHAOS_STEPS}", "--save_every=2",
             "--resume_from_step=auto"]
STOP_STEPS = 12
EAGER_ARGS = [f"--num_iterations={STOP_STEPS}", "--save_every=100"]


@pytest.fixture(scope="module")
def calm(module_base_dir):
    """The compiled --deterministic 2-rank DDP run of CHAOS_STEPS steps, never interrupted (saves every 2 steps)."""
    train_two_ranks(module_base_dir, *CALM_ARGS, "--model_tag=calm")
    return module_base_dir


@pytest.fixture(scope="module")
def eager(module_base_dir):
    """The default (eager) 2-rank run of STOP_STEPS steps, never interrupted."""
    train_two_ranks(module_base_dir, *EAGER_ARGS, "--model_tag=eager")
    return module_base_dir


@pytest.mark.parametrize("path", ["ddp", "fsdp"])
def test_deterministic_compiled_resume_is_bit_exact_on_two_ranks(request, path):
    """--compile=1 --deterministic=1: the run resumed from step n (copied from an uninterrupted run, as a new start
    finds it) repeats every later loss and ends with the same weights, bit for bit. The DDP path's uninterrupted run
    is the chaos test's (`calm`, 10 steps); FSDP2 runs its own 2n steps."""
    if path == "ddp":
        base_dir, n, total, args, ref = request.getfixturevalue("calm"), 4, CHAOS_STEPS, CALM_ARGS, "calm"
    else:
        base_dir, n, ref = request.getfixturevalue("base_dir"), 2, "full"
        total, args = 2 * n, ["--compile=1", "--deterministic=1", f"--num_iterations={2 * n}", "--use_fsdp=1"]
        train_two_ranks(base_dir, *args, f"--save_every={n}", f"--model_tag={ref}")
        args = [*args, "--resume_from_step=auto"]
    copy_step(base_dir, ref, "resumed", n)
    p = train_two_ranks(base_dir, *args, "--model_tag=resumed")
    assert f"resuming from step {n}" in p.stdout
    full, resumed = losses(base_dir, ref), losses(base_dir, "resumed")
    after = range(n + 1, total + 1)
    assert [resumed[s] for s in after] == [full[s] for s in after]
    assert_same_weights(final_weights(base_dir, ref, total), final_weights(base_dir, "resumed", total))


def worker_pids(launcher_pid):
    """{rank: pid} of the worker processes torchrun started (its children), from /proc."""
    pids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == launcher_pid:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
                pids[int(env[b"RANK"])] = int(entry)
    return pids


def start_torchrun_until(base_dir, args, needle):
    """A 2-rank torchrun base_train in the background, read up to the line holding `needle`: (process, lines read)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "scripts.base_train", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(base_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            break
    return proc, seen


def test_stop_signal_to_one_rank_stops_both_at_the_same_step(eager):
    """SIGUSR1 to rank 1's process only: the ranks agree (an all-reduce of the flag each step), both save the same
    step and exit 0, so torchrun exits 0; auto resume then finishes with an uninterrupted run's weights."""
    base_dir, steps, tag = eager, STOP_STEPS, "stopped_usr1"
    proc, seen = start_torchrun_until(base_dir, [*TINY, *EAGER_ARGS, f"--model_tag={tag}", "--resume_from_step=auto"],
                                      f"step 00003/{steps:05d}")
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, ("".join(seen), workers)
    os.kill(workers[1], signal.SIGUSR1)
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=300) == 0, out[-4000:]
    assert out.count("SIGUSR1 received") == 1, out[-4000:]
    stopped_at = latest_resumable_step(str(ckpt_dir(base_dir, tag)))
    assert stopped_at is not None and 3 <= stopped_at < steps and f"Stopped at step {stopped_at}" in out
    train_two_ranks(base_dir, *EAGER_ARGS, f"--model_tag={tag}", "--resume_from_step=auto")
    assert_same_weights(final_weights(base_dir, "eager", steps), final_weights(base_dir, tag, steps))


def test_ctrl_c_to_torchrun_stops_every_rank_at_one_saved_step(eager):
    """Ctrl-C reaches torchrun, which passes SIGINT on to its ranks: they agree on the step (the stop flag's
    all-reduce), save it and exit 130 with one line from rank 0 saying where; auto resume then finishes with an
    uninterrupted run's weights."""
    base_dir, steps, tag = eager, STOP_STEPS, "stopped_int"
    proc, seen = start_torchrun_until(base_dir, [*TINY, *EAGER_ARGS, f"--model_tag={tag}"], f"step 00003/{steps:05d}")
    proc.send_signal(signal.SIGINT)  # to torchrun only, as a terminal's Ctrl-C: the ranks run in their own sessions
    out = "".join(seen) + proc.stdout.read()
    proc.wait(timeout=300)  # torchrun's own status (and traceback) after it was interrupted are torchrun's
    assert "Unable to shutdown process" not in out, out[-4000:]  # the ranks ended by themselves, torchrun killed none
    d = ckpt_dir(base_dir, tag)
    stopped_at = latest_resumable_step(str(d))
    assert stopped_at is not None and 3 <= stopped_at < steps, out[-4000:]
    assert out.count("SIGINT received: finishing this step") == 2, out[-4000:]
    line = (f"Stopped at step {stopped_at} on a stop signal (Ctrl-C (SIGINT)): checkpoint saved in {d}; start the "
            f"same command with --resume_from_step=auto (or --resume_from_step={stopped_at}) to continue")
    assert [x for x in out.splitlines() if x.startswith("Stopped at step")] == [line], out[-4000:]
    train_two_ranks(base_dir, *EAGER_ARGS, f"--model_tag={tag}", "--resume_from_step=auto")
    assert_same_weights(final_weights(base_dir, "eager", steps), final_weights(base_dir, tag, steps))


def chaos_plan(rng):
    """Three deaths, one per life of the job: a random rank, during a random step with a random delay into it (so the
    kill lands anywhere: forward, all-reduce, optimizer, between steps), then during a save, then again mid-step."""
    def mid_step():
        return {"rank": rng.randrange(2), "at": "step", "n": rng.randint(2, 3), "delay": round(rng.uniform(0, 0.1), 3)}

    return {"0": mid_step(), "1": {"rank": rng.randrange(2), "at": "save", "n": 1}, "2": mid_step()}


def test_chaos_kill_9_and_restart_ends_with_the_uninterrupted_weights(calm):
    """torchrun --max-restarts=3, --resume_from_step=auto, --deterministic (compile on): every kill -9 takes the whole
    job down (torchrun stops the other rank), torchrun restarts it, it resumes from the latest complete step (a step
    cut mid-save is skipped), and the last life finishes with exactly the weights of a run that was never killed."""
    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 100_000))
    plan = chaos_plan(random.Random(seed))
    why = f"CHAOS_SEED={seed} plan={plan}"
    base_dir, steps = calm, CHAOS_STEPS
    p = train_two_ranks(base_dir, *CALM_ARGS, "--model_tag=chaos", timeout=400, launcher=["--max-restarts=3"],
                            script=["tests/dist_scripts/chaos_train.py"],
                            env=subprocess_env(base_dir, CHAOS_PLAN=json.dumps(plan)))
    out = p.stdout + p.stderr
    assert out.count("chaos: life") == 3, why + out[-4000:]
    assert "chaos: rank" in out and "killed while writing" in out, why + out[-4000:]
    assert out.count("--resume_from_step=auto:") == 4, why + out[-4000:]  # four lives, each looked for a step
    assert_same_weights(final_weights(base_dir, "calm", steps), final_weights(base_dir, "chaos", steps))


# Two nodes on one shared filesystem, as test_dist_train's two launchers are: each node's first rank tidies the
# checkpoint dir at start. Node 1 starts late (LATE seconds); node 0's first write after the tidy-up must survive it.
LATE_NODE_WORKER = """
import os, sys, time
import torch.distributed as dist
from nanochat.checkpoint.resume import resolve_resume_step
dist.init_process_group("gloo")
rank = dist.get_rank()
os.environ["LOCAL_RANK"] = "0"  # each rank plays the first rank of its own node
checkpoint_dir, late = sys.argv[1], float(sys.argv[2])
if rank == 1:
    time.sleep(late)
assert resolve_resume_step("-1", checkpoint_dir) is None
if rank == 0:  # what metrics.jsonl's atomic write has in flight right after start-up
    open(os.path.join(checkpoint_dir, "metrics.jsonl.inflight.tmp"), "w").close()
dist.barrier()
dist.destroy_process_group()
"""


def test_a_late_node_does_not_take_a_running_nodes_temp_file(tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    checkpoint_dir.mkdir()
    (checkpoint_dir / "model_000002.pt.old.tmp").write_bytes(b"x" * 10)  # a killed save's: both nodes tidy it
    worker = tmp_path / "worker.py"
    worker.write_text(LATE_NODE_WORKER)
    p = run_ranks([str(worker), str(checkpoint_dir), "2"], env=subprocess_env(tmp_path))
    assert sorted(os.listdir(checkpoint_dir)) == ["metrics.jsonl.inflight.tmp"], p.stdout
    assert "Removed 1 temp file(s)" in p.stdout
