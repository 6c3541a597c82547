"""nanochat/distributed/dist.py alone: the process-group timeout reaches init_process_group; the helpers in one process."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from conftest import free_port
from nanochat.distributed import dist as ndist


def test_timeout_default_and_env(monkeypatch):
    monkeypatch.delenv("NANOCHAT_DIST_TIMEOUT_MIN", raising=False)
    # longer than NCCL's 10-minute default: rank 0 writing a large checkpoint while the others wait must not trip it
    assert ndist.dist_timeout() == datetime.timedelta(minutes=ndist.DEFAULT_DIST_TIMEOUT_MIN)
    assert ndist.dist_timeout() > datetime.timedelta(minutes=10)
    monkeypatch.setenv("NANOCHAT_DIST_TIMEOUT_MIN", "90.5")
    assert ndist.dist_timeout() == datetime.timedelta(minutes=90.5)
    for bad in ("0", "-3", "ten"):
        monkeypatch.setenv("NANOCHAT_DIST_TIMEOUT_MIN", bad)
        with pytest.raises(ValueError, match="NANOCHAT_DIST_TIMEOUT_MIN must be a positive number"):
            ndist.dist_timeout()


def test_compute_init_passes_the_timeout_to_init_process_group(monkeypatch):
    """A real 1-rank gloo group set up the way torchrun's environment asks for it; the timeout is the env's."""
    assert not dist.is_initialized()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port()), "NANOCHAT_DIST_TIMEOUT_MIN": "7"}.items():
        monkeypatch.setenv(k, v)
    calls = []
    real = dist.init_process_group

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", recording)
    try:
        ddp, rank, local_rank, world, device = ndist.compute_init("cpu")
        assert (ddp, rank, local_rank, world, device.type) == (True, 0, 0, 1, "cpu")
        assert dist.is_initialized() and ndist.dist_world_size() == 1
    finally:
        ndist.compute_cleanup()
    assert len(calls) == 1 and calls[0]["backend"] == "gloo"
    assert calls[0]["timeout"] == datetime.timedelta(minutes=7)
    assert not dist.is_initialized()


def test_helpers_in_one_process():
    assert not dist.is_initialized()
    assert ndist.dist_world_size() == 1
    assert ndist.all_reduce_mean(2.5, "cpu") == 2.5
    assert ndist.all_reduce_sum([1, 2.5], "cpu") == [1.0, 2.5]
    assert ndist.any_rank(1, "cpu") is True and ndist.any_rank(0, "cpu") is False
    assert ndist.gather_objects({"a": 1}) == [{"a": 1}]
    ndist.raise_on_every_rank(None, "nothing")
    with pytest.raises(KeyError):
        ndist.raise_on_every_rank(KeyError("k"), "something")


def test_nanochat_compat_imports():
    """nanochat's scripts import these from nanochat.common."""
    from nanochat.common import compute_cleanup, compute_init, get_dist_info, print0  # noqa: F401

    assert compute_init is ndist.compute_init and get_dist_info() == (False, 0, 0, 1)
    assert torch.device(ndist.autodetect_device_type()).type in ("cuda", "mps", "cpu")


def test_compute_init_on_cuda_sets_expandable_segments_unless_the_user_chose(monkeypatch):
    """On an H100, d20 ran out of memory at its first eager evaluation with 46 GiB reserved but unallocated: CUDA runs
    get expandable segments (before the first allocation); a user's PYTORCH_CUDA_ALLOC_CONF is left alone; CPU runs and
    refused CUDA runs do not touch it."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    ndist.compute_init("cpu")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
            ndist.compute_init("cuda")
        assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
        # as on a GPU machine: compute_init touches no CUDA memory in one process (seeding is queued lazily)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _, _, _, _, device = ndist.compute_init("cuda")
    assert device.type == "cuda"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    ndist.compute_init("cuda")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
