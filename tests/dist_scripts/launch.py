"""
Helpers for tests that launch the scripts in this folder: N ranks with gloo on CPU (tests/ranks.py: as torchrun starts
them, a free port, a timeout) or a plain single process. Import by path from a test:

    launch = load_launch()   # see tests/distributed/test_dist_optim.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent


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


def ranks(script, args=(), nproc=2, timeout=240):
    """Run SCRIPTS/script in `nproc` ranks on 127.0.0.1 (tests/ranks.py: as torchrun's workers, without its launcher);
    returns its stdout (raises with the logs on failure)."""
    from ranks import run_ranks  # tests/ is on the path of the tests that load this module

    return run_ranks([SCRIPTS / script, *args], nproc=nproc, env=_env(), timeout=timeout).stdout


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
