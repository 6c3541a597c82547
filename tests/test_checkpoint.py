"""Checkpoint layout, atomicity, crash safety and nanochat compatibility."""

import json
import os

import pytest
import torch

from nanochat import checkpoint_manager as cm


def _tiny_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.weight": torch.randn(2, generator=g)}


def test_round_trip_and_layout(tmp_path):
    d = tmp_path / "d4"
    model_sd, optim_sd = _tiny_state(0), [{"state": {0: {"m": torch.ones(3)}}, "param_groups": []}]
    meta = {"model_config": {"n_layer": 1}, "step": 7}
    cm.save_checkpoint(str(d), 7, model_sd, optim_sd, meta, rank=0)
    assert sorted(os.listdir(d)) == ["meta_000007.json", "model_000007.pt", "optim_000007_rank0.pt"]
    m, o, mt = cm.load_checkpoint(str(d), 7, "cpu", load_optimizer=True)
    assert mt == meta
    for k in model_sd:
        assert torch.equal(m[k], model_sd[k])
    assert torch.equal(o[0]["state"][0]["m"], torch.ones(3))
    assert cm.find_last_step(str(d)) == 7


def test_crash_mid_save_leaves_previous_step_loadable(tmp_path, monkeypatch, caplog):
    d = tmp_path / "d4"
    cm.save_checkpoint(str(d), 10, _tiny_state(0), None, {"step": 10})

    # crash while writing the model file of step 20: the torch.save call dies half way through
    real_save = torch.save

    def dying_save(obj, f):
        f.write(b"partial bytes")
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        cm.save_checkpoint(str(d), 20, _tiny_state(1), None, {"step": 20})
    monkeypatch.setattr(torch, "save", real_save)
    # no half-written model file under the final name, no temp litter
    assert not (d / "model_000020.pt").exists()
    assert [f for f in os.listdir(d) if ".tmp" in f] == []
    assert cm.find_last_step(str(d)) == 10

    # crash after the model but before meta (e.g. killed while other ranks wrote optimizer shards)
    cm.atomic_torch_save(_tiny_state(2), str(d / "model_000030.pt"))
    with caplog.at_level("WARNING"):
        assert cm.find_last_step(str(d)) == 10
    assert "incomplete checkpoint step 30" in caplog.text
    m, _, meta = cm.load_checkpoint(str(d), 10, "cpu")
    assert meta["step"] == 10 and torch.equal(m["a.weight"], _tiny_state(0)["a.weight"])
    with pytest.raises(FileNotFoundError, match="incomplete or missing"):
        cm.load_checkpoint(str(d), 30, "cpu")


def test_find_largest_model(tmp_path):
    for tag in ["d4", "d12", "d6", "custom"]:
        (tmp_path / tag).mkdir()
    assert cm.find_largest_model(str(tmp_path)) == "d12"
    with pytest.raises(FileNotFoundError, match="train that stage first"):
        cm.find_largest_model(str(tmp_path / "nope"))


def test_missing_optimizer_shard_names_rank(tmp_path):
    d = tmp_path / "x"
    cm.save_checkpoint(str(d), 1, _tiny_state(0), [{}], {"step": 1})
    with pytest.raises(FileNotFoundError, match="same number of ranks"):
        cm.load_checkpoint(str(d), 1, "cpu", load_optimizer=True, rank=1)


def test_nanochat_format_checkpoint_loads(base_dir):
    """A checkpoint as nanochat writes it (compiled-model prefixes, meta with model_config) loads via load_model."""
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import get_tokenizer

    tok = get_tokenizer()
    cfg = dict(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=128)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**cfg))
    ref.init_weights("nanochat")
    # nanochat saves from the compiled model: keys carry `_orig_mod.`
    sd = {f"_orig_mod.{k}": v.clone() for k, v in ref.state_dict().items()}
    d = base_dir / "base_checkpoints" / "d2"
    d.mkdir(parents=True)
    torch.save(sd, d / "model_000100.pt")
    with open(d / "meta_000100.json", "w") as f:
        json.dump({"step": 100, "val_bpb": 1.0, "model_config": cfg, "user_config": {"depth": 2}}, f)
    model, tokenizer, meta = cm.load_model("base", "cpu", phase="eval")
    assert meta["step"] == 100 and not model.training
    idx = torch.randint(0, cfg["vocab_size"], (2, 16))
    with torch.no_grad():
        assert torch.equal(model(idx), ref(idx))
    assert tokenizer.get_vocab_size() == cfg["vocab_size"]
