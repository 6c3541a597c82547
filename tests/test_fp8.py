"""
FP8 training (nanochat/fp8.py), on CPU: the conversion is inspected without running the model, and the refusal is
checked through base_train's own entry point.
"""

import pytest
import torch
import torch.nn as nn

from nanochat.gpt import GPT, GPTConfig

float8 = pytest.importorskip("torchao.float8", reason="torchao is the optional extra `fp8`")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from nanochat.fp8 import check_fp8_supported, convert_to_fp8  # noqa: E402

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
    converted, skipped = convert_to_fp8(model, recipe)
    expected = [f"transformer.h.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS]
    assert sorted(converted) == sorted(expected) and skipped == []
    types = linear_types(model)
    for name in expected:
        assert types[name] is Float8Linear, name
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
    converted, skipped = convert_to_fp8(model, "tensorwise")
    assert skipped == ["transformer.h.0.attn.c_k", "transformer.h.0.attn.c_v"]
    types = linear_types(model)
    assert types["transformer.h.0.attn.c_k"] is nn.Linear and types["transformer.h.0.attn.c_v"] is nn.Linear
    for name in ["attn.c_q", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]:
        assert types[f"transformer.h.0.{name}"] is Float8Linear, name
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


def test_base_train_refuses_fp8_on_cpu(tmp_path, monkeypatch):
    # the public entry stops before the tokenizer or any data is needed (NANOCHAT_BASE_DIR is empty)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    from scripts import base_train

    with pytest.raises(RuntimeError, match="use --fp8=0") as e:
        base_train.main(["--fp8=1", "--device_type=cpu", "--depth=2", "--num_iterations=1"])
    assert "cpu" in str(e.value)
