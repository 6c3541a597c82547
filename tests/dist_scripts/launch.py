"""
Helpers for tests that launch the scripts in this folder: torchrun with gloo on CPU (`sys.executable -m
torch.distributed.run`, a free port, a timeout) or a plain single process. Import by path from a test:

    launch = load_launch()   # see tests/distributed/test_dist_optim.py
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"  # 2 ranks on a small CPU: no oversubscription
    env["PYTHONFAULTHANDLER"] = "1"  # a rank killed by a signal prints where each thread was
    env.pop("RANK", None)  # a test run from inside a torchrun job must not inherit its rank variables
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    return env


def _run(cmd, timeout):
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout}s (hung collective?)\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}") from None
    if proc.returncode != 0:
        from conftest import worker_errors  # this module is loaded by tests, which have tests/ on the path

        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}\nwhy (worker lines):\n"
                             f"{worker_errors(proc.stderr, proc.stdout)}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}")
    return proc.stdout


def torchrun(script, args=(), nproc=2, timeout=240):
    """Run SCRIPTS/script under torchrun on 127.0.0.1; returns its stdout (raises with the logs on failure)."""
    for attempt in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(SCRIPTS / script), *map(str, args)]
        try:
            return _run(cmd, timeout)
        except AssertionError as e:
            # another process may grab the free port between our probe and torchrun's bind: retry once on that only
            if attempt == 0 and ("EADDRINUSE" in str(e) or "address already in use" in str(e).lower()):
                continue
            raise


def single(script, args=(), timeout=240):
    """Run SCRIPTS/script in one plain process; returns its stdout."""
    return _run([sys.executable, str(SCRIPTS / script), *map(str, args)], timeout)


def json_lines(stdout):
    """The JSON objects printed one per line (other lines ignored)."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out
