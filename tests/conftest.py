"""
Shared fixtures: a tiny but real nanochat base directory (WikiText-2 shards + a trained tokenizer), built once per
test session, and helpers to run torchrun from tests.

Test data: TEST_DATA (tests/assets/data) holds small excerpts of the real data sets in ../shared/data, in the same
layout (provenance and licences in tests/assets/README.md), so the suite runs in any clone. Only the tests about
../shared itself read SHARED_DATA, and they skip with `require_shared` when it is not beside the repo.
"""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nanochat.serving.invariance import strict_blas

REPO = Path(__file__).resolve().parents[1]
# --compile=auto compiles on CPU too; in the suite's tiny runs compile time would dominate, so tests run eager
# (tests/integration/test_compile.py compiles on purpose). Inherited by the scripts and torchrun ranks tests launch.
os.environ.setdefault("NANOCHAT_COMPILE", "0")
# Several workers share the cores (pytest-xdist, as tests/run.sh runs the suite): one torch thread each, as the
# processes the tests start have (subprocess_env). torch's default, a thread per core in every worker, spin-waits
# against the other worker's threads: the fast lane took 110 s instead of 97 on 2 cores. (A test that needs
# another count sets it in a fixture and restores it: tests/unit/test_gpt.py, tests/integration/test_hf.py.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)
# In-process tests compute as the batching chat server does on CPU: MKL in its strict mode (the server sets it before
# its first matmul, nanochat/serving/invariance.py), read by MKL at this first matmul. The variable is then dropped
# again, so the scripts and ranks tests start decide for themselves, as they do outside the tests.
_CBWR = os.environ.get("MKL_CBWR")
if strict_blas("cpu"):
    import torch

    torch.ones(64, 64) @ torch.ones(64, 64)
    if _CBWR is None:
        del os.environ["MKL_CBWR"]
TEST_DATA = REPO / "tests" / "assets" / "data"
SHARED_DATA = REPO.parent / "shared" / "data"
WIKITEXT = TEST_DATA / "pretrain" / "wikitext-2"


# Test files in order of their expected run time, longest first. tests/run.sh hands whole files to two workers
# (pytest-xdist --dist loadfile --no-loadscope-reorder: in this order); a minutes-long file of torchrun runs that came
# last would leave one worker idle while the other finishes it, so they come first and the many short files fill in
# at the end. The weights are rough costs per test on the 2-core CPU (a torchrun, a training subprocess, in-process:
# 0.1 s, or what the file's `cost` mark says, for the few in-process files that take many seconds). Only the tests
# that run count (trylast: after -m and -k have deselected theirs), so the fast lane is ordered by its own costs.
FILE_WEIGHT = {"dist": 30.0, "slow": 5.0}
IN_PROCESS_COST = 0.1


def run_cost(item):
    cost = item.get_closest_marker("cost")
    return max([w for m, w in FILE_WEIGHT.items() if item.get_closest_marker(m)],
               default=cost.args[0] if cost else IN_PROCESS_COST)


def pytest_configure(config):
    config.addinivalue_line("markers", "cost(seconds): what each test of an in-process file takes, when far above "
                            f"{IN_PROCESS_COST} s (tests/conftest.py hands out the files to the workers by their costs)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    cost = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0.0) + run_cost(item)
    items.sort(key=lambda item: -cost[item.path])  # stable: a file's tests keep their order


def require_shared(path):
    """For the tests that check the full data sets in ../shared/data (not needed by any other test)."""
    if not Path(path).exists():
        pytest.skip(f"checks the full copy in ../shared/data, which is not beside this clone ({path})")
    return Path(path)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(base_dir=None, **extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores: no oversubscription
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a rank killed by a signal (SIGABRT in gloo, say) prints where each thread was
    if base_dir is not None:
        env["NANOCHAT_BASE_DIR"] = str(base_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


WORKER_CRASH = ("terminate called", "what():", "Fatal Python error", "Error:", "Exception:")


def worker_errors(*outputs, limit=40):
    """The lines of a failed torchrun's output that say why a rank died (a C++ abort, a Python fatal error with the
    stacks faulthandler prints after it, an exception), ahead of the launcher's own long traceback: a CI log that
    keeps only part of the failure message still shows them."""
    keep = []
    for text in outputs:
        lines = (text or "").splitlines()
        for i, line in enumerate(lines):
            if "torch/distributed/elastic" in line or "ChildFailedError" in line:
                continue
            if any(k in line for k in WORKER_CRASH):
                keep.append(line)
                if "Fatal Python error" in line:  # faulthandler's stacks follow
                    keep.extend(lines[i + 1 : i + 15])
    return "\n".join(dict.fromkeys(keep[:limit]))


def run_torchrun(args, nproc=2, env=None, timeout=300, extra_launcher_args=()):
    """Run `torchrun --nproc_per_node=N ... args` with gloo on CPU; fail the test with its output on error/timeout."""
    pick_port = not any(a.startswith("--master_port") or a.startswith("--rdzv") or a == "--standalone"
                        for a in extra_launcher_args)
    for attempt in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra_launcher_args]
        if pick_port:
            cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
        cmd += list(args)
        try:
            p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"torchrun timed out after {timeout}s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")
        # the free port we picked can be taken by another process before torchrun binds it: try once more
        port_taken = "address already in use" in (p.stderr + p.stdout).lower() or "EADDRINUSE" in p.stderr
        if p.returncode == 0 or not (pick_port and port_taken and attempt == 0):
            break
    if p.returncode != 0:
        pytest.fail(f"torchrun failed ({p.returncode}): {' '.join(cmd)}\nWHY (worker lines):\n"
                    f"{worker_errors(p.stderr, p.stdout)}\nSTDOUT:\n{p.stdout[-6000:]}\nSTDERR:\n{p.stderr[-6000:]}")
    return p


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory):
    """
    A base dir with the WikiText-2 excerpt of tests/assets imported as shards (small row groups so several ranks get
    data) and a 512-token tokenizer trained on it. Tests that write checkpoints should copy it (see `base_dir`).
    """
    from nanochat.data.corpus_import import import_corpus
    from nanochat.tokenizer import RustBPETokenizer, compute_token_bytes

    root = tmp_path_factory.mktemp("nanochat_base")
    data_dir = root / "base_data"
    import_corpus([str(WIKITEXT / "valid.txt")], out_dir=str(data_dir), val_paths=[str(WIKITEXT / "test.txt")],
                  rows_per_group=64, docs_per_shard=512, log=lambda *a: None)
    from nanochat.dataset import parquets_iter_batched

    def texts():
        n = 0
        for batch in parquets_iter_batched("train", data_dir=str(data_dir)):
            for t in batch:
                yield t
                n += len(t)
                if n > 400_000:
                    return

    tok = RustBPETokenizer.train_from_iterator(texts(), 512)
    tok_dir = root / "tokenizer"
    tok.save(str(tok_dir))
    import torch

    torch.save(compute_token_bytes(tok), tok_dir / "token_bytes.pt")
    return root


def copy_base_dir(tiny_base_dir, d):
    """A private copy of the tiny base dir at `d`: data linked, tokenizer copied."""
    d.mkdir()
    os.symlink(tiny_base_dir / "base_data", d / "base_data")
    shutil.copytree(tiny_base_dir / "tokenizer", d / "tokenizer")
    return d


@pytest.fixture
def base_dir(tiny_base_dir, tmp_path, monkeypatch):
    """A private copy of the tiny base dir set as NANOCHAT_BASE_DIR."""
    d = copy_base_dir(tiny_base_dir, tmp_path / "base")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(d))
    return d


@pytest.fixture(scope="module")
def module_base_dir(tiny_base_dir, tmp_path_factory):
    """A copy of the tiny base dir for a whole test module, where its tests share expensive runs (an uninterrupted
    training run several tests compare against): each test writes under its own model tags. Scripts get it through
    subprocess_env(module_base_dir); NANOCHAT_BASE_DIR in this process is left alone."""
    return copy_base_dir(tiny_base_dir, tmp_path_factory.mktemp("module") / "base")
