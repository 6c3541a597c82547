"""
nanochat/serving/invariance.py: the BLAS mode a batch-invariant server sets (MKL's strict reproducibility) and what
it buys, a row's bits the same at every row count.
"""

import subprocess
import sys

import pytest
import torch

from conftest import REPO, subprocess_env
from nanochat.serving import invariance

pytestmark = pytest.mark.cost(3.0)


def test_strict_blas_picks_the_cpus_branch_and_keeps_a_users_setting(monkeypatch):
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    for flags, expected in (({"avx2", "avx512f"}, "AVX512,STRICT"), ({"avx2"}, "AVX2,STRICT"), (set(), None)):
        monkeypatch.setattr(invariance, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.delenv("MKL_CBWR", raising=False)
        assert invariance.strict_blas("cpu") == expected
        assert invariance.os.environ.get("MKL_CBWR") == expected
    monkeypatch.delenv("MKL_CBWR", raising=False)
    assert invariance.strict_blas("cuda") is None and "MKL_CBWR" not in invariance.os.environ
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")  # the user's choice stands
    assert invariance.strict_blas("cpu") == "COMPATIBLE"
    monkeypatch.delenv("MKL_CBWR")
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)  # another BLAS (an ARM wheel's): nothing
    assert invariance.strict_blas("cpu") is None and "MKL_CBWR" not in invariance.os.environ


PROBE = """
import os, sys
from nanochat.serving.workers import prepare_cpu
prepare_cpu("cpu", sys.argv[1] == "1")  # as chat_web does, before any matmul
import torch
from nanochat.serving.invariance import invariant_sizes
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
weights = [torch.randn(n, k, generator=g) for n, k in ((256, 1024), (1024, 256), (8192, 256))]
print(os.environ.get("MKL_CBWR"), invariant_sizes(weights, 64) == list(range(1, 65)))
"""


def test_a_batch_invariant_servers_blas_gives_a_row_the_same_bits_at_every_row_count():
    """chat_web's process before its model loads (workers.prepare_cpu): for a batch-invariant server it sets MKL's
    strict mode, after which every row count from 1 to 64 gives each row of d4's weight shapes the bits it gets at
    64 rows (two threads); a server that is not batch-invariant leaves MKL as it is."""
    if not invariance.strict_branch():
        pytest.skip("no MKL with AVX2/AVX-512 here: the server decodes at the sizes it measures instead")
    env = subprocess_env()
    env.pop("MKL_CBWR", None)
    out = {}
    for invariant in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", PROBE, invariant], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out[invariant] = r.stdout.split()
    assert out["1"][0].endswith(",STRICT") and out["1"][1] == "True"
    assert out["0"][0] == "None"
