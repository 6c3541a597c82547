"""
Start N ranks of a script on this machine the way torchrun's workers see the world (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT), without torchrun's launcher.

Why: most multi-process tests check that N ranks compute what one process computes; how the ranks were started is
not what they test. torchrun's launcher is one more process that imports torch and runs the elastic agent: about
4 s of wall time a start on the 2-core VM, and the suite starts ranks about a hundred times (tests/distributed/
test_dist_train.py, 16 starts, back to back: 471 CPU-s and 335 s under torchrun, 380 CPU-s and 250 s this way).
The tests about launching itself (signals to the launcher, --max-restarts, the failure summary, two nodes meeting in
the rendezvous) keep running real torchrun (conftest.run_torchrun).

What it keeps from torchrun: ranks are started together and stopped together (the first rank that fails takes the
others down at once, as a collective would otherwise wait for it until the timeout), a time limit, and the rank
outputs in one stdout/stderr (rank 0's first, then rank 1's, ...: no interleaving, unlike torchrun's shared pipe).
"""

import os
import subprocess
import sys
import tempfile
import time

from conftest import REPO, free_port, worker_errors

class RanksFailed(AssertionError):
    pass


def _command(args):
    """torchrun's trailing arguments (`-m module ...` or `script.py ...`) as a Python command line."""
    args = [str(a) for a in args]
    if args[0] in ("-m", "--module"):
        return [sys.executable, "-m", *args[1:]]
    return [sys.executable, *args]


def _start_and_wait(cmd, nproc, env, timeout, port):
    outs = []
    procs = []
    with tempfile.TemporaryDirectory(prefix="ranks-") as d:
        for rank in range(nproc):
            rank_env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                            GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            rank_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too
            out = open(os.path.join(d, f"{rank}.out"), "w+")
            err = open(os.path.join(d, f"{rank}.err"), "w+")
            outs.append((out, err))
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=rank_env, stdout=out, stderr=err, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            while True:
                codes = [p.poll() for p in procs]  # every rank's, each time (not any()'s first running one)
                if all(c is not None for c in codes):
                    break
                if any(c not in (None, 0) for c in codes):
                    break  # one rank failed: the others would wait in a collective for it
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        texts = []
        for out, err in outs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    first_failure = min(failed, key=lambda f: f[1] == -9)[1] if failed else 0  # a rank we killed is not the cause
    return timed_out, first_failure, "".join(t[0] for t in texts), "".join(t[1] for t in texts)


def run_ranks(args, nproc=2, env=None, timeout=300):
    """Run `args` (as torchrun takes them after its options: `-m scripts.base_train --depth=2 ...` or a script path)
    in `nproc` ranks with gloo on CPU. Returns a CompletedProcess with the ranks' outputs; raises with the worker lines
    and the outputs when a rank fails or the time limit passes."""
    cmd = _command(args)
    env = dict(os.environ if env is None else env)
    for attempt in range(2):
        timed_out, rc, stdout, stderr = _start_and_wait(cmd, nproc, env, timeout, free_port())
        # the free port can be taken by another process between our probe and rank 0's bind: try once more on that only
        port_taken = "address already in use" in (stdout + stderr).lower() or "EADDRINUSE" in stderr
        if timed_out or rc == 0 or not (port_taken and attempt == 0):
            break
    what = f"{nproc} ranks of {' '.join(cmd[1:])}"
    if timed_out:
        raise RanksFailed(f"{what} did not finish within {timeout}s (hung collective?)\n"
                          f"STDOUT:\n{stdout[-6000:]}\nSTDERR:\n{stderr[-8000:]}")
    if rc != 0:
        raise RanksFailed(f"{what} failed ({rc})\nWHY (worker lines):\n{worker_errors(stderr, stdout)}\n"
                          f"STDOUT:\n{stdout[-6000:]}\nSTDERR:\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(cmd, 0, stdout, stderr)
