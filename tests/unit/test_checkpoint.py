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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process says so
def test_the_step_format_is_decided_in_one_place(tmp_path):
    """steps.step_format answers "is this step sharded" (and "is it there"); every reader goes by it: discovery,
    require_step, step_problem, load_checkpoint. A consolidated step (both formats) is the sharded one."""
    from nanochat.checkpoint import sharded, steps
    from nanochat.checkpoint.files import sharded_step_dir

    d = str(tmp_path)
    cm.save_checkpoint(d, 1, _tiny_state(1), [{}], {"step": 1})
    torch.manual_seed(2)
    layer = torch.nn.Linear(3, 4)
    sharded.save_sharded(d, 2, sharded.train_state_dict(layer), {"step": 2})  # one process writes the one shard
    cm.save_checkpoint(d, 3, _tiny_state(3), None, {"step": 3})
    os.remove(os.path.join(d, "meta_000003.json"))  # step 3: a save cut short
    assert [steps.step_format(d, s) for s in (1, 2, 3, 4)] == ["single", "sharded", None, None]
    assert steps.complete_steps(d) == [1, 2] and cm.find_last_step(d) == 2
    assert [steps.step_problem(d, s) is None for s in (1, 2, 3)] == [True, True, False]
    assert steps.latest_resumable_step(d, log=lambda *a: None) == 2
    with pytest.raises(FileNotFoundError, match=r"step 3 is incomplete .*complete steps in .*: 1, 2"):
        steps.require_step(d, 3)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in cm.load_checkpoint(d, 2, "cpu")[0].items())
    assert steps.step_meta_path(d, 2) == os.path.join(sharded_step_dir(d, 2), "meta_000002.json")
    # consolidated: the single files beside it are a copy; the step stays sharded (what resumes on any layout)
    sharded.consolidate(sharded_step_dir(d, 2), d, 2)
    assert steps.is_step_complete(d, 2) and steps.step_format(d, 2) == "sharded"
    with pytest.raises(ValueError, match="step 2 .* is a sharded checkpoint"):
        cm.load_checkpoint(d, 2, "cpu", load_optimizer=True)


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


# -----------------------------------------------------------------------------
# loading memory and dtype


def test_no_to_empty_before_load(base_dir, monkeypatch):
    """load_model builds on meta and assigns the checkpoint tensors: no device copy is materialised first."""
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import get_tokenizer

    cfg = dict(sequence_len=32, vocab_size=get_tokenizer().get_vocab_size(), n_layer=1, n_head=2, n_kv_head=1, n_embd=64)
    torch.manual_seed(1)
    ref = GPT(GPTConfig(**cfg))
    ref.init_weights("nanochat")
    cm.save_checkpoint(str(base_dir / "base_checkpoints" / "d1"), 5, ref.state_dict(), None, {"model_config": cfg})
    events = []
    real_load_state_dict = torch.nn.Module.load_state_dict
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda self, **kw: events.append("to_empty") or self)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict",
                        lambda self, *a, **kw: events.append("load") or real_load_state_dict(self, *a, **kw))
    model, _, _ = cm.load_model("base", "cpu", phase="eval")
    assert events == ["load"]
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    torch.testing.assert_close(model.cos, ref.cos)  # the non-persistent rotary tables were recomputed
    idx = torch.randint(0, cfg["vocab_size"], (2, 8))
    with torch.no_grad():
        assert torch.equal(model(idx), ref(idx))


_PEAK_SCRIPT = r"""
import json, sys
import torch
from nanochat.checkpoint_manager import clean_state_dict, load_checkpoint, model_from_state_dict
from nanochat.gpt import GPTConfig

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
# warm up: the first model built on meta loads ~150 MB of library code (meta kernels); that is not checkpoint data
tiny = GPTConfig(sequence_len=8, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=16)
from nanochat.gpt import GPT
model_from_state_dict(GPT(tiny, attn="sdpa").state_dict(), tiny, "cpu")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM) to the current RSS
base = status("VmRSS")
sd, _, meta = load_checkpoint(sys.argv[1], 1, "cpu")
model = model_from_state_dict(clean_state_dict(sd), GPTConfig(**meta["model_config"]), "cpu")
del sd
touched = sum(float(p.detach().float().sum()) for p in model.parameters())  # read every weight: all pages resident
print(json.dumps({"peak": status("VmHWM") - base, "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


@pytest.mark.slow  # writes and loads a model of a few hundred MB
def test_loading_peaks_near_one_model_size(tmp_path):
    """Peak process memory (RSS, file-backed pages included) while loading stays <= 1.3x the model's size;
    a load that materialises the model and then copies the checkpoint in would peak at ~2x."""
    import subprocess
    import sys

    from conftest import subprocess_env
    from nanochat.gpt import GPT, GPTConfig

    cfg = GPTConfig(sequence_len=64, vocab_size=16384, n_layer=4, n_head=4, n_kv_head=4, n_embd=512)  # ~118 MB fp32
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(cfg, attn="sdpa").state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    cm.save_checkpoint(str(tmp_path), 1, state, None, {"model_config": vars(cfg)})
    del state
    p = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path)], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["model_bytes"] > 100e6
    assert out["peak"] <= 1.3 * out["model_bytes"], out


def test_weights_dtype_rule(monkeypatch):
    monkeypatch.delenv("NANOCHAT_WEIGHTS_DTYPE", raising=False)
    assert cm.weights_dtype_for("cuda", "eval") == torch.bfloat16
    assert cm.weights_dtype_for("cuda", "train") == torch.float32  # fp32 master weights for the optimizers
    assert cm.weights_dtype_for("cpu", "eval") == torch.float32
    assert cm.weights_dtype_for("mps", "eval") == torch.float32
    assert cm.weights_dtype_for("cuda", "eval", "float32") == torch.float32
    assert cm.weights_dtype_for("cpu", "eval", "bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="--weights_dtype must be one of"):
        cm.weights_dtype_for("cuda", "eval", "fp8")
    # NANOCHAT_WEIGHTS_DTYPE is the default of the scripts' --weights_dtype: what they parse (and record) is what loads
    from nanochat.configurator import FlagError, Flags

    flags = Flags(cm.checkpoint_flags("sft"))
    assert flags.parse([])["weights_dtype"] == "auto"
    monkeypatch.setenv("NANOCHAT_WEIGHTS_DTYPE", "float32")
    assert cm.weights_dtype_for("cuda", "eval") == torch.bfloat16  # the library reads no environment
    assert cm.weights_dtype_for("cuda", "eval", flags.parse([])["weights_dtype"]) == torch.float32
    assert flags.parse(["--weights_dtype=bf16"])["weights_dtype"] == "bf16"  # the flag wins
    monkeypatch.setenv("NANOCHAT_WEIGHTS_DTYPE", "fp8")
    with pytest.raises(FlagError, match="NANOCHAT_WEIGHTS_DTYPE=fp8 .*--weights_dtype must be one of"):
        flags.parse([])


def test_bf16_loaded_model_runs_forward(tmp_path):
    from nanochat.gpt import GPT, GPTConfig

    cfg = GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    torch.manual_seed(0)
    ref = GPT(cfg, attn="sdpa")
    ref.init_weights("nanochat")
    cm.save_checkpoint(str(tmp_path), 3, ref.state_dict(), None, {"model_config": vars(cfg)})
    sd, _, _ = cm.load_checkpoint(str(tmp_path), 3, "cpu")
    model = cm.model_from_state_dict(sd, cfg, "cpu", torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    idx = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        got, want = model(idx), ref(idx)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.05 * want.abs().max() + 0.05


# -----------------------------------------------------------------------------
# hostile files: a truncated, empty or foreign file is named, with the way out


def _damage(path, how):
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": os.urandom(3000)}[how])


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
def test_damaged_model_file_is_named_with_the_previous_step(tmp_path, how):
    d = tmp_path / "d4"
    for step in (10, 20):
        cm.save_checkpoint(str(d), step, _tiny_state(step), [{}], {"step": step})
    _damage(d / "model_000020.pt", how)
    assert cm.find_last_step(str(d)) == 20  # discovery goes by names; the load says what is wrong
    with pytest.raises(ValueError) as e:
        cm.load_checkpoint(str(d), 20, "cpu")
    msg = str(e.value)
    assert str(d / "model_000020.pt") in msg
    assert ("empty (0 bytes)" if how == "empty" else "truncated or not a torch file") in msg
    assert "previous complete step 10" in msg and "model_000020.pt, meta_000020.json, optim_000020_rank*.pt" in msg
    assert "--resume_from_step=10" in msg
    # following the advice works: step 20's files moved aside, the last step is 10 and it loads
    aside = tmp_path / "aside"
    aside.mkdir()
    for f in d.glob("*_000020*"):
        f.rename(aside / f.name)
    assert cm.find_last_step(str(d)) == 10
    cm.load_checkpoint(str(d), 10, "cpu", load_optimizer=True)


def test_damaged_only_step_says_there_is_nothing_to_fall_back_to(tmp_path):
    cm.save_checkpoint(str(tmp_path), 5, _tiny_state(0), None, {"step": 5})
    _damage(tmp_path / "model_000005.pt", "truncated")
    with pytest.raises(ValueError, match="no earlier complete step"):
        cm.load_checkpoint(str(tmp_path), 5, "cpu")


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
def test_damaged_optimizer_shard_is_named(tmp_path, how):
    cm.save_checkpoint(str(tmp_path), 5, _tiny_state(0), [{"state": {0: {"m": torch.ones(100)}}}], {"step": 5})
    optim = tmp_path / "optim_000005_rank0.pt"
    _damage(optim, how)
    with pytest.raises(ValueError) as e:
        cm.load_checkpoint(str(tmp_path), 5, "cpu", load_optimizer=True)
    assert f"checkpoint optimizer state {optim}" in str(e.value) and "later stages still load it" in str(e.value)
    cm.load_checkpoint(str(tmp_path), 5, "cpu")  # the model alone still loads


@pytest.mark.parametrize("content, why", [
    (b'{"step": 5, "model_con', "truncated, empty or not JSON"),
    (b"", "truncated, empty or not JSON"),
    (b"\xfb\x00\x17binary", "truncated, empty or not JSON"),
    (b"[1, 2]", "holds a JSON list, not an object"),
])
def test_damaged_meta_is_named(tmp_path, content, why):
    cm.save_checkpoint(str(tmp_path), 5, _tiny_state(0), None, {"step": 5})
    meta = tmp_path / "meta_000005.json"
    meta.write_bytes(content)
    with pytest.raises(ValueError) as e:
        cm.load_checkpoint(str(tmp_path), 5, "cpu")
    assert f"checkpoint meta {meta} " in str(e.value) and why in str(e.value)


def test_missing_step_lists_the_complete_ones(tmp_path):
    for step in (10, 20):
        cm.save_checkpoint(str(tmp_path), step, _tiny_state(step), None, {"step": step})
    with pytest.raises(FileNotFoundError, match=r"model_000015.pt does not exist \(complete steps in .*: 10, 20\)"):
        cm.load_checkpoint(str(tmp_path), 15, "cpu")


def _tiny_gpt_checkpoint(d, meta_config_changes=None, drop_config=False):
    from nanochat.gpt import GPT, GPTConfig

    cfg = dict(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(GPTConfig(**cfg)).state_dict().items()}
    state = {k: torch.zeros(s) for k, s in shapes.items()}
    meta = {"step": 1} if drop_config else {"step": 1, "model_config": dict(cfg, **(meta_config_changes or {}))}
    cm.save_checkpoint(str(d), 1, state, None, meta)


@pytest.mark.parametrize("changes, says", [
    ({"n_layer": 1}, "n_layer=1, n_head=2, n_kv_head=2, n_embd=64) does not match the weights in"),
    ({"n_layer": 1}, "6 unexpected tensor(s) in the weights, e.g. transformer.h.1."),
    ({"n_layer": 3}, "6 tensor(s) missing from the weights, e.g. transformer.h.2."),
    ({"n_embd": 32}, "of other shape, e.g. transformer.wte.weight is [64, 64] in the weights, [64, 32] for the config"),
    ({"vocab_size": 128}, "vocab_size=128"),
])
def test_meta_config_that_does_not_match_the_weights_names_both(tmp_path, changes, says):
    _tiny_gpt_checkpoint(tmp_path, changes)
    with pytest.raises(ValueError) as e:
        cm.build_model(str(tmp_path), 1, "cpu", "eval")
    msg = str(e.value)
    assert str(tmp_path / "meta_000001.json") in msg and str(tmp_path / "model_000001.pt") in msg
    assert "(n_layer=2, vocab_size=64, n_embd=64)" in msg  # what the weights are
    assert says in msg, msg


def test_meta_without_usable_model_config_is_named(tmp_path):
    _tiny_gpt_checkpoint(tmp_path / "a", drop_config=True)
    with pytest.raises(ValueError, match=r"meta_000001.json has no model_config object \(its keys: \['step'\]\)"):
        cm.build_model(str(tmp_path / "a"), 1, "cpu", "eval")
    _tiny_gpt_checkpoint(tmp_path / "b", {"n_layers": 2})
    with pytest.raises(ValueError, match=r"model_config in .*meta_000001.json is not a GPTConfig .*n_layers"):
        cm.build_model(str(tmp_path / "b"), 1, "cpu", "eval")
