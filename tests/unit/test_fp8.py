"""
FP8 training (nanochat/fp8.py), on CPU: the conversion is inspected without running the model, the refusal is
checked through base_train's own entry point, and the converted model trains with torchao's emulated FP8 (the same
e4m3/e5m2 casts and scales, the matmul in fp32 instead of on FP8 tensor cores), eager and under torch.compile.
"""

import importlib.util

import pytest
import torch
import torch.nn as nn

import test_fp8_native as native_tests  # the tiny training run, shared with the native FP8's tests
from nanochat.fp8 import check_fp8_supported, convert_to_fp8
from nanochat.gpt import GPT, GPTConfig
from test_fp8_native import train, train_batch

# torchao is imported by the tests (through nanochat.fp8 or torchao_linear), not here: its import takes ~2 s and every
# test worker collects this file
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is the optional extra `fp8`")


def torchao_linear():
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear

BLOCK_LINEARS = ["attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]


def meta_model(config):
    with torch.device("meta"):
        return GPT(config, attn="sdpa")


def linear_types(model):
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converts_exactly_the_block_linears(recipe):
    config = GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    model = meta_model(config)
    converted, skipped, _ = convert_to_fp8(model, recipe, filter="all")  # tiny dims: the size rule would skip them
    expected = [f"transformer.h.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS]
    assert sorted(converted) == sorted(expected) and skipped == []
    types = linear_types(model)
    for name in expected:
        assert types[name] is torchao_linear(), name
    assert types["lm_head"] is nn.Linear  # the logits stay in bf16
    assert type(model.transformer.wte) is nn.Embedding
    assert model.transformer.h[0].attn.c_q.weight.device.type == "meta"  # nothing was materialised or run
    # the state dict keeps its names and shapes: checkpoints of an FP8 run load into a plain model
    plain = meta_model(config)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}


def test_dims_not_divisible_by_16_are_skipped():
    # head dim 24 with one KV head: c_k and c_v map 96 -> 24, which torch._scaled_mm cannot take
    config = GPTConfig(sequence_len=32, vocab_size=100, n_layer=1, n_head=4, n_kv_head=1, n_embd=96)
    model = meta_model(config)
    converted, skipped, _ = convert_to_fp8(model, "tensorwise", filter="all")
    assert skipped == ["transformer.h.0.attn.c_k", "transformer.h.0.attn.c_v"]
    types = linear_types(model)
    assert types["transformer.h.0.attn.c_k"] is nn.Linear and types["transformer.h.0.attn.c_v"] is nn.Linear
    for name in ["attn.c_q", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]:
        assert types[f"transformer.h.0.{name}"] is torchao_linear(), name
    assert len(converted) == 4


def test_fsdp_float8_all_gather_only_for_tensorwise():
    from nanochat.fp8 import fp8_config

    assert fp8_config("tensorwise", fsdp=True).enable_fsdp_float8_all_gather
    assert not fp8_config("tensorwise", fsdp=False).enable_fsdp_float8_all_gather
    assert not fp8_config("rowwise", fsdp=True).enable_fsdp_float8_all_gather
    with pytest.raises(ValueError, match="tensorwise|rowwise"):
        fp8_config("blockwise")


def test_refused_on_cpu():
    with pytest.raises(RuntimeError, match=r"compute capability >= 8.9.*cpu: use --fp8=0"):
        check_fp8_supported("cpu")


def test_base_train_refuses_fp8_on_cpu(base_dir):
    # the public entry stops before the tokenizer or the model is loaded (after the start-up check of the shards)
    from scripts import base_train

    with pytest.raises(RuntimeError, match="use --fp8=0") as e:
        base_train.main(["--fp8=1", "--device_type=cpu", "--depth=2", "--num_iterations=1"])
    assert "cpu" in str(e.value)


# -----------------------------------------------------------------------------
# training with emulated FP8 (torchao's emulate=True runs the casts and scales on any device)

def cpu_model(recipe=None):
    """The same weights every call; recipe: convert with torchao's emulated FP8 (None: plain)."""
    return native_tests.cpu_model(recipe, impl="torchao")


# Tolerances. FP8 rounds each cast element by up to 2^-4 (e4m3: weights and activations, forward) or 2^-3 (e5m2:
# output gradients, backward), relative. Over a dot product of independent roundings the errors average out, so the
# loss (a mean over 256 tokens) moves far less: measured |loss_fp8 - loss_bf16| <= 6.4e-4 at the first step and
# <= 2.6e-3 after 4 Muon steps for both recipes (torch 2.15, torchao 0.18), against a loss that falls from 5.56 to
# 3.29. 1e-2 leaves room for other library versions and is still 1/40 of one step's decrease (~0.7): a wrong scale
# or a layer that stops learning is an error of order 1. Gradients: each block weight's gradient goes through one
# e5m2 cast of its output gradient (<= 12.5% per element); measured relative error 7-12%, bound 2 x 12.5%.
LOSS_ATOL = 1e-2
GRAD_RTOL = 0.25


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_trains_like_the_unconverted_model(recipe):
    ref_losses, ref_grads = train(cpu_model(), 4)
    model = cpu_model(recipe)
    assert type(model.transformer.h[0].mlp.c_fc) is torchao_linear() and type(model.lm_head) is nn.Linear
    losses, grads = train(model, 4)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0, losses  # it trains
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) < LOSS_ATOL, (recipe, losses, ref_losses)
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name
        rel = ((grads[name] - g).norm() / g.norm()).item()
        assert rel < GRAD_RTOL, (name, rel)
        if not name.startswith("transformer.h."):  # not FP8 layers: their gradients are only perturbed downstream
            assert rel < GRAD_RTOL / 2, (name, rel)


def test_emulated_fp8_checkpoint_is_the_plain_models():
    """The state dict of a converted (and trained) model has the plain model's keys, shapes and dtypes, and loads
    into either model strictly: checkpoints of an FP8 run load anywhere and resume FP8 training."""
    fp8, plain = cpu_model("tensorwise"), cpu_model()
    train(fp8, 1)
    sd, plain_sd = fp8.state_dict(), plain.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in sd.items()} == {k: (v.shape, v.dtype) for k, v in plain_sd.items()}
    assert all(type(v) is torch.Tensor for v in sd.values())  # no torchao tensor subclass in a checkpoint
    plain.load_state_dict(sd, strict=True)
    again = cpu_model("tensorwise")
    again.load_state_dict(plain.state_dict(), strict=True)
    x, _ = train_batch()
    with torch.no_grad():
        torch.testing.assert_close(again(x), fp8(x), rtol=0, atol=0)


@pytest.mark.slow  # one aot_eager compile of the converted model: ~10 s on 2 cores
def test_emulated_fp8_under_compile_matches_eager():
    torch._dynamo.reset()
    eager, _ = train(cpu_model("tensorwise"), 2)
    model = cpu_model("tensorwise")
    compiled, _ = train(model, 2, call=torch.compile(model, backend="aot_eager", dynamic=False))
    for a, b in zip(compiled, eager):
        assert abs(a - b) < 1e-5, (compiled, eager)


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_emulated_fp8_under_fsdp_trains_like_the_unconverted_model():
    """FSDP2 on 2 gloo ranks (tests/dist_scripts/fp8_fsdp_check.py: the weights are gathered in fp32 and cast after
    the gather; the FP8 all-gather itself needs NCCL's float8 dtypes, gloo has none, but its scale precomputation
    runs)."""
    import importlib.util
    from pathlib import Path

    here = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("nanochat_test_launch", here / "dist_scripts" / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    out = launch.json_lines(launch.ranks("fp8_fsdp_check.py", timeout=500))[-1]
    single, _ = train(cpu_model(), 3)
    for a, b in zip(out["none"], single):  # FSDP over 2 ranks = one process on the whole batch
        assert abs(a - b) < 1e-4, (out, single)
    for recipe in ("tensorwise", "rowwise", "native"):  # native: nanochat's own Float8Linear (--fp8_impl=native)
        assert len(out[recipe]) == 3
        for a, b in zip(out[recipe], out["none"]):
            assert abs(a - b) < LOSS_ATOL, (recipe, out)
    # the FP8 all-gather's scales, one all-reduce after each optimizer step (parallel.FSDP.after_optimizer_step)
    scales = out["scales"]
    assert scales["detected"] == {"none": False, "tensorwise": True, "rowwise": False, "native": False}
    assert scales["linears"] == 2 * len(BLOCK_LINEARS) and scales["unset_before"]
    assert scales["max_rel_error"] < 1e-6, scales


def test_train_bench_refuses_fp8_on_cpu(capsys):
    from bench.train_bench import main

    with pytest.raises(SystemExit) as e:
        main(["--depth=1", "--device_type=cpu", "--fp8=1"])
    assert e.value.code == 2
    assert "use --fp8=0" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# the shape filter (--fp8_filter)


def kinds(plan, convert):
    return sorted({name.split(".", 3)[-1] for name, c, _ in plan if c == convert})


def test_auto_filter_by_recipe_at_nanochat_depths():
    from nanochat.fp8 import fp8_plan
    from nanochat.gpt import config_for_depth

    def plan(depth, recipe):
        return fp8_plan(meta_model(config_for_depth(depth, 65536, 2048)), recipe)

    # d12 (768 wide): every GEMM is below tensorwise's break-even except the MLP's up-projection (N = 3072)
    assert kinds(plan(12, "tensorwise"), True) == ["mlp.c_fc"]
    # d20 (1280 wide): N > 1024 everywhere, so tensorwise converts all six; rowwise only the up-projection
    assert kinds(plan(20, "tensorwise"), True) == sorted(BLOCK_LINEARS)
    assert kinds(plan(20, "rowwise"), True) == ["mlp.c_fc"]
    # d32 (2048 wide): rowwise still only the up-projection (the others have N = 2048, not > 2048)...
    assert kinds(plan(32, "rowwise"), True) == ["mlp.c_fc"]
    # ...and d40 (2560 wide) passes rowwise's rule for every layer
    assert kinds(plan(40, "rowwise"), True) == sorted(BLOCK_LINEARS)
    # every layer of a depth has its reason, naming the GEMM shape
    for name, convert, why in plan(12, "tensorwise"):
        assert f"K={768 if 'mlp.c_proj' not in name else 3072}" in why, (name, why)


def test_filter_all_and_by_name():
    from nanochat.fp8 import fp8_plan
    from nanochat.gpt import config_for_depth

    model = meta_model(config_for_depth(12, 65536, 2048))
    assert kinds(fp8_plan(model, "tensorwise", "all"), False) == []
    chosen = fp8_plan(model, "rowwise", "mlp.c_fc, attn.c_proj")
    assert kinds(chosen, True) == ["attn.c_proj", "mlp.c_fc"]
    assert all("not named by --fp8_filter" in why for _, c, why in chosen if not c)
    with pytest.raises(ValueError, match="--fp8_filter=mlp.c_up matches no block Linear"):
        fp8_plan(model, "tensorwise", "mlp.c_up")
    with pytest.raises(ValueError, match="--fp8_filter must be auto, all or a comma list"):
        fp8_plan(model, "tensorwise", " , ")


def test_apply_fp8_logs_each_layer_kind_and_why(monkeypatch):
    from nanochat import fp8
    from nanochat.gpt import config_for_depth

    monkeypatch.setattr(fp8, "check_fp8_supported", lambda device, recipe, impl: None)  # the hardware check is tested above
    model = meta_model(config_for_depth(12, 65536, 2048))
    lines = []
    fp8.apply_fp8(model, "tensorwise", "meta", log=lines.append)
    assert lines[0].startswith("FP8 (tensorwise, --fp8_impl=torchao, --fp8_filter=auto): 12 of 72 block Linear layers converted")
    assert "  mlp.c_fc: FP8 x12 (K=768, N=3072: past tensorwise's break-even (K > 4096 or N > 1024))" in lines
    assert "  attn.c_q: bf16 x12 (K=768 <= 4096 and N=768 <= 1024: too small to gain (tensorwise))" in lines
    assert type(model.transformer.h[0].mlp.c_fc) is torchao_linear() and type(model.transformer.h[0].attn.c_q) is nn.Linear
    # nothing gains at a tiny width: said, and the run is plainly bf16
    lines.clear()
    tiny = meta_model(GPTConfig(sequence_len=32, vocab_size=100, n_layer=1, n_head=2, n_kv_head=2, n_embd=64))
    fp8.apply_fp8(tiny, "tensorwise", "meta", log=lines.append)
    assert "0 of 6" in lines[0] and "--fp8_filter=all converts them anyway" in lines[-1]
