"""
Activation checkpointing (--activation_checkpointing, GPT.set_activation_checkpointing):

- full and selective give the same loss and gradients as none (one process), and only the chosen blocks checkpoint
- the peak memory of a forward+backward on CPU is lower with it (allocations recorded by torch.profiler)
- a compiled model (torch.compile, backend aot_eager) with it matches eager
- under FSDP2 and on the DDP path, 2 gloo ranks each (eager and with nanochat.compile's compile, per block under
  FSDP, whole model on DDP): same losses as without
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from nanochat.gpt import GPT, GPTConfig

HERE = Path(__file__).resolve().parents[1]
CONFIG = GPTConfig(sequence_len=32, vocab_size=128, n_layer=4, n_head=2, n_kv_head=1, n_embd=64)


def model_with(mode, every=2, config=CONFIG):
    torch.manual_seed(0)
    model = GPT(config, attn="sdpa")
    model.init_weights("nanochat")
    with torch.no_grad():  # the nanochat init zeroes c_proj: perturb every weight so every gradient is non-trivial
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    chosen = model.set_activation_checkpointing(mode, every)
    return model, chosen


def batch(config=CONFIG, rows=2):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab_size, (rows, config.sequence_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_and_grads(model, call=None):
    """call: what runs the forward (a compiled wrapper of model), default the model itself."""
    x, y = batch()
    loss = (model if call is None else call)(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,every,chosen", [("full", 2, [0, 1, 2, 3]), ("selective", 2, [0, 2]), ("selective", 3, [0, 3])])
def test_same_loss_and_gradients(mode, every, chosen):
    ref_loss, ref_grads = loss_and_grads(model_with("none")[0])
    model, got = model_with(mode, every)
    assert got == chosen
    assert [b.checkpointed for b in model.transformer.h] == [i in chosen for i in range(CONFIG.n_layer)]
    loss, grads = loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, f"{name}: zero gradient, the comparison would be vacuous"
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_mode_is_refused():
    model, _ = model_with("none")
    with pytest.raises(ValueError, match="none|full|selective"):
        model.set_activation_checkpointing("some")
    with pytest.raises(ValueError, match="--ac_every"):
        model.set_activation_checkpointing("selective", 0)
    assert model.set_activation_checkpointing("none") == []


def peak_bytes(mode):
    """Peak of the bytes allocated during one forward+backward, from the profiler's allocation records."""
    from torch.profiler import ProfilerActivity, profile

    config = GPTConfig(sequence_len=128, vocab_size=256, n_layer=8, n_head=2, n_kv_head=2, n_embd=128)
    model, _ = model_with(mode, 2, config)
    x, y = batch(config, rows=4)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x, y).backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    assert events, "the profiler recorded no allocations"
    current = peak = 0
    for _, nbytes in events:  # frees are negative
        current += nbytes
        peak = max(peak, current)
    return peak


@pytest.mark.slow  # profiles a model big enough to show the saving
def test_peak_memory_is_lower():
    none, full, selective = peak_bytes("none"), peak_bytes("full"), peak_bytes("selective")
    assert full < 0.5 * none, (none, full)
    assert full < selective < 0.8 * none, (none, full, selective)


@pytest.mark.slow  # compiles forward and backward
def test_compiled_matches_eager():
    torch._dynamo.reset()
    ref_loss, ref_grads = loss_and_grads(model_with("none")[0])
    model, _ = model_with("selective", 2)
    loss, grads = loss_and_grads(model, torch.compile(model, backend="aot_eager", dynamic=False))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_no_checkpointing_without_grad():
    # evaluation and sampling (no_grad / inference_mode) skip the checkpoint: same logits, nothing to recompute
    model, _ = model_with("full")
    ref, _ = model_with("none")
    x, _ = batch()
    with torch.inference_mode():
        torch.testing.assert_close(model(x), ref(x))
        assert list(model.generate([1, 2, 3], max_tokens=4, temperature=0)) == list(ref.generate([1, 2, 3], max_tokens=4, temperature=0))


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_fsdp_and_ddp_same_losses():
    spec = importlib.util.spec_from_file_location("nanochat_test_launch", HERE / "dist_scripts" / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    out = launch.json_lines(launch.ranks("ac_check.py", timeout=500))[-1]
    for strategy in ("fsdp", "ddp"):
        res = out[strategy]
        assert res["calls"] == {"none": 12, "full": 24, "selective": 18}, strategy  # 4 blocks x 3 steps + recomputed
        for mode in ("full", "selective", "full+compile"):
            assert len(res[mode]) == 3
            for a, b in zip(res[mode], res["none"]):
                assert abs(a - b) < 1e-5, (strategy, mode, out)
    # and the two paths train alike (tests/distributed/test_dist_train.py compares them to one process in detail)
    for a, b in zip(out["ddp"]["none"], out["fsdp"]["none"]):
        assert abs(a - b) < 1e-4, out


def test_train_bench_takes_the_flag(capsys):
    """bench/train_bench.py's --activation_checkpointing (the docs/benchmarks.md GPU commands use it)."""
    import json

    from bench.train_bench import main

    main(["--depth=2", "--max_seq_len=32", "--device_batch_size=2", "--vocab_size=256", "--steps=1", "--warmup=0",
          "--device_type=cpu", "--attn=sdpa", "--compile=0", "--activation_checkpointing=selective", "--ac_every=2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "Activation checkpointing (selective): 1 of 2 blocks recompute their activations in the backward"
    assert "| AC | FP8 |" in out[1]
    r = json.loads(out[-1])
    assert r["activation_checkpointing"] == "selective (every 2)" and r["fp8"] == "off" and r["tok_per_s"] > 0
