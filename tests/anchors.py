"""
nanochat 92d63d4 (the record recipe's code, ../shared/bench/nanochat-92d63d4.tar.gz) for tests that compare against it:
one of its modules imported from a copy extracted to a temporary directory. Tests skip, saying where they looked,
when the tarball is not beside the repo (NANOCHAT_ANCHOR_92D63D4 points elsewhere).
"""

import importlib.util
import os
import tarfile
from pathlib import Path

import pytest
import torch

from conftest import REPO

ANCHOR_92D63D4 = Path(os.environ.get("NANOCHAT_ANCHOR_92D63D4", REPO.parent / "shared" / "bench" / "nanochat-92d63d4.tar.gz"))


def load_92d63d4_module(relpath, tmp_path, monkeypatch):
    """92d63d4's `relpath` (e.g. "nanochat/optim.py") as a module. Its torch.compile decorators become the identity
    while it imports (eager: compile changes what is fused, not the formula), and its nanochat.common.COMPUTE_DTYPE
    reads float32, as 92d63d4 sets it on CPU."""
    if not ANCHOR_92D63D4.is_file():
        pytest.skip(f"nanochat 92d63d4's tarball is not at {ANCHOR_92D63D4} (../shared/bench beside the repo, or set "
                    f"NANOCHAT_ANCHOR_92D63D4)")
    member = f"nanochat-92d63d4/{relpath}"
    with tarfile.open(ANCHOR_92D63D4) as tar:
        tar.extract(member, tmp_path, filter="data")
    from nanochat import common

    with monkeypatch.context() as m:
        m.setattr(common, "COMPUTE_DTYPE", torch.float32, raising=False)
        m.setattr(torch, "compile", lambda *a, **k: (lambda fn: fn))
        spec = importlib.util.spec_from_file_location(f"anchor_92d63d4_{Path(relpath).stem}", tmp_path / member)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module
