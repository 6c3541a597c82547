"""
Sharded checkpoints of the FSDP and tensor-parallel paths (nanochat/checkpoint/sharded.py):

- 2 gloo ranks save (sync and async); 1, 2 and 4 ranks load the same model and optimizer state, tensor for tensor
  (torch.equal), and train on: on 2 ranks bit for bit like the run that never stopped, on 1 and 4 ranks within
  float32 reduction-order noise (the same global batch, summed in another order)
- consolidation writes the same files, byte for byte, as the gather-to-rank-0 path for the same step
- a rank killed mid-save (SIGKILL) leaves the previous step the latest complete one (and the next start removes its
  .partial directory); a crash before the rename too
- tensor parallelism writes the same format: a TP=2 step loads tensor for tensor on TP=2 and on FSDP over 1 and 2 ranks
- base_train --use_fsdp=1 saves sharded steps, resumes one on another number of ranks, and the model loads through
  checkpoint_manager (evaluation, chat, export_hf) and through the consolidate command
"""

import filecmp
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, subprocess_env
from ranks import RanksFailed, run_ranks
from nanochat import checkpoint_manager as cm
from nanochat.checkpoint import files, steps
from nanochat.dataloader import loader_states_for_world
from nanochat.gpt import GPT, GPTConfig

# nanochat.checkpoint.sharded (torch.distributed.checkpoint: ~1 s to import) is imported inside the functions that use
# it: every test worker collects this file, one runs it.

HERE = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("nanochat_test_launch", HERE / "dist_scripts" / "launch.py")
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process says so

TINY_CONFIG = GPTConfig(sequence_len=16, vocab_size=512, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(TINY_CONFIG, attn="sdpa")
    model.to_empty(device="cpu")
    model.init_weights("nanochat")
    return model


def save_one_process(checkpoint_dir, step, model):
    """A sharded step written by one process (no process group: DCP writes one shard)."""
    from nanochat.checkpoint import sharded as sc

    sc.save_sharded(str(checkpoint_dir), step, sc.train_state_dict(model),
                    {"model_config": vars(TINY_CONFIG), "step": step})


# ----------------------------------------------------------------------------- one process (fast)


def test_crash_before_the_rename_leaves_the_previous_step(tmp_path, monkeypatch):
    save_one_process(tmp_path, 1, tiny_model(1))

    def cut(*a):
        raise OSError("power cut")

    rename = os.rename

    def rename_cut(src, dst):  # DCP's own renames (its .metadata) go through; the step's does not
        if str(src).endswith(files.PARTIAL_SUFFIX):
            cut()
        rename(src, dst)

    # the last moment of a save: every shard, DCP's .metadata and the meta json are written, the rename is not
    monkeypatch.setattr(os, "rename", rename_cut)
    with pytest.raises(OSError, match="power cut"):
        save_one_process(tmp_path, 2, tiny_model(2))
    monkeypatch.undo()
    partial = tmp_path / "sharded_000002.partial"
    assert (partial / ".metadata").is_file() and (partial / "meta_000002.json").is_file()
    assert steps.step_format(str(tmp_path), 2) is None and steps.step_format(str(tmp_path), 1) == "sharded"
    assert steps.sharded_steps(str(tmp_path)) == steps.complete_steps(str(tmp_path)) == [1]
    assert cm.find_last_step(str(tmp_path)) == 1
    # and earlier, in the middle of DCP's writes
    from torch.distributed.checkpoint import FileSystemWriter

    monkeypatch.setattr(FileSystemWriter, "write_data", lambda *a: cut())
    with pytest.raises(BaseException, match="power cut"):  # DCP wraps it (CheckpointException, a BaseException)
        save_one_process(tmp_path, 3, tiny_model(3))
    monkeypatch.undo()
    assert cm.find_last_step(str(tmp_path)) == 1
    # saving step 2 again clears what the cut save left and completes it
    save_one_process(tmp_path, 2, tiny_model(2))
    assert not partial.exists() and steps.complete_steps(str(tmp_path)) == [1, 2]


def test_sharded_step_loads_through_checkpoint_manager(base_dir):
    """What evaluation, chat, export_hf and the next training stage call (load_model -> load_checkpoint) reads a
    sharded step directly: the same weights, in the model's key order."""
    model = tiny_model()
    d = base_dir / "base_checkpoints" / "d1"
    save_one_process(d, 5, model)
    sd, optim, meta = cm.load_checkpoint(str(d), 5, "cpu")
    assert optim is None and meta["step"] == 5
    assert list(sd) == list(model.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    loaded, _, _ = cm.load_model("base", "cpu", "eval", model_tag="d1")  # the last step, found among sharded ones
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="sharded checkpoint: its optimizer state resumes on the FSDP or tensor-parallel"):
        cm.load_checkpoint(str(d), 5, "cpu", load_optimizer=True)


@pytest.mark.slow
def test_export_hf_reads_a_sharded_step(base_dir, tmp_path):
    pytest.importorskip("transformers", minversion="5.0", reason="the hf extra is not installed")
    pytest.importorskip("safetensors", reason="the hf extra is not installed")
    from safetensors.torch import load_file

    from nanochat.hf_format import state_dict_to_hf
    from scripts.export_hf import main

    model = tiny_model()
    save_one_process(base_dir / "base_checkpoints" / "d1", 7, model)
    main(["-i", "base", "-g", "d1", "--out", str(tmp_path / "hf")])  # the last step: the sharded one
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    expected = state_dict_to_hf(model.state_dict(), TINY_CONFIG)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)


def test_consolidate_command(base_dir, capsys):
    from scripts.consolidate_checkpoint import main

    d = base_dir / "base_checkpoints" / "d1"
    d.mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        main(["-i", "base", "-g", "d1"])
    assert e.value.code == 2 and "no complete sharded checkpoint in" in capsys.readouterr().err
    model = tiny_model()
    save_one_process(d, 3, model)
    with pytest.raises(SystemExit):
        main(["-i", "base", "-g", "d1", "-s", "4"])
    assert "complete sharded steps: 3" in capsys.readouterr().err
    main(["-i", "base", "-g", "d1"])
    assert "model_000003.pt" in capsys.readouterr().out
    # a model-only step (what SFT and RL save) gets the model and meta only, as the single-file path writes it
    assert sorted(p.name for p in d.iterdir() if p.is_file()) == ["meta_000003.json", "model_000003.pt"]
    single = torch.load(d / "model_000003.pt", weights_only=True)
    assert list(single) == list(model.state_dict())
    assert all(torch.equal(single[k], v) for k, v in model.state_dict().items())
    assert json.loads((d / "meta_000003.json").read_text()) == json.loads((d / "sharded_000003" / "meta_000003.json").read_text())
    with pytest.raises(SystemExit):
        main(["-i", "base", "-g", "d1"])
    assert "already holds model_000003.pt" in capsys.readouterr().err


def test_loader_states_for_another_world_size():
    def state(rank, world, pos, n=10, doc=3, token=7):
        return {"split": "train", "rank": rank, "world_size": world, "num_row_groups": n, "epoch": pos // n,
                "row_group": pos % n, "doc": doc, "token": token}

    saved = [state(0, 2, 8), state(1, 2, 9)]
    assert loader_states_for_world(saved, 2) == saved  # same world: exactly where each rank was
    # 2 -> 3 ranks: row groups 0..9 were started; the new ranks start at 12, 13, 14 (the next multiple of 3)
    assert [(s["epoch"] * 10 + s["row_group"], s["rank"], s["world_size"], s["doc"], s["token"])
            for s in loader_states_for_world(saved, 3)] == [(12, 0, 3, 0, 0), (13, 1, 3, 0, 0), (14, 2, 3, 0, 0)]
    assert [s["row_group"] for s in loader_states_for_world(saved, 1)] == [0] and \
        loader_states_for_world(saved, 1)[0]["epoch"] == 1
    assert loader_states_for_world([None], 4) == [None] * 4  # a run that saved no position


def test_checkpoint_format_flags(monkeypatch):
    """The plan decides the format (ParallelConfig.saves): sharded on the FSDP and TP paths, single on DDP or when asked,
    or when several nodes have their own base dirs (--shared_fs=0, whose default is NANOCHAT_SHARED_FS)."""
    from nanochat.configurator import Flags
    from nanochat.distributed.parallel import parallel_flags, parallel_from_config

    def fmt(**flags):
        return parallel_from_config(flags).checkpoint_format

    assert fmt(use_fsdp=True) == fmt(tp_size=2) == fmt(tp_size=2, use_fsdp=True) == "sharded"
    assert fmt(use_fsdp=True, checkpoint_format="single") == fmt(tp_size=2, checkpoint_format="single") == "single"
    assert fmt() == "single"
    assert parallel_from_config({"use_fsdp": True, "async_save": True}).async_save
    assert parallel_from_config({"tp_size": 2, "async_save": True}).async_save
    with pytest.raises(ValueError, match="--checkpoint_format=sharded needs --use_fsdp=1 or --tp_size > 1"):
        parallel_from_config({"checkpoint_format": "sharded"})
    with pytest.raises(ValueError, match="--async_save=1 .* use --async_save=0"):
        parallel_from_config({"use_fsdp": True, "checkpoint_format": "single", "async_save": True})
    # 2 nodes x 2 ranks with node-local base dirs (the launchers' NANOCHAT_SHARED_FS=0): single files, as multinode.md says
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert fmt(use_fsdp=True) == "sharded"
    assert fmt(use_fsdp=True, shared_fs=False) == fmt(tp_size=2, shared_fs=False) == "single"
    with pytest.raises(ValueError, match="NANOCHAT_SHARED_FS=0 .* says the nodes have their own base dirs"):
        parallel_from_config({"use_fsdp": True, "checkpoint_format": "sharded", "shared_fs": False})
    # the environment switch is the flag's default: parsed, it is in the config the run records
    monkeypatch.setenv("NANOCHAT_SHARED_FS", "0")
    parsed = Flags(parallel_flags()).parse(["--use_fsdp=1"])
    assert parsed["shared_fs"] is False and parallel_from_config(parsed).checkpoint_format == "single"
    assert Flags(parallel_flags()).parse(["--use_fsdp=1", "--shared_fs=1"])["shared_fs"] is True  # the flag wins
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one node: its ranks share its disk
    assert parallel_from_config(parsed).checkpoint_format == "sharded"


# ----------------------------------------------------------------------------- 2 ranks save, 1/2/4 load (torchrun)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded")
    launch.ranks("sharded_ckpt_check.py", ["--mode=save", f"--dir={d}"], nproc=2, timeout=300)
    for n in (1, 2, 4):
        launch.ranks("sharded_ckpt_check.py", ["--mode=load", f"--dir={d}"], nproc=n, timeout=300)
    return d


def _load(path):
    return torch.load(path, weights_only=False)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_two_ranks_save_any_world_loads_the_same_state(runs, world):
    saved, loaded = _load(runs / "saved.pt"), _load(runs / f"loaded_w{world}.pt")
    assert list(loaded["tensors"]) == list(saved["tensors"])
    assert any(k.endswith("momentum_buffer") for k in saved["tensors"])  # Muon's state is in it, and AdamW's
    assert any(k.endswith("exp_avg_sq") for k in saved["tensors"]) and any(k.endswith(".step") for k in saved["tensors"])
    for k, v in saved["tensors"].items():
        assert torch.equal(loaded["tensors"][k], v), k
    assert loaded["groups"] == saved["groups"]  # learning rates, betas, momentum, ... of every param group


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_training_continues_after_a_resharded_load(runs, world):
    """Continued from the loaded step on `world` ranks vs the 2-rank run that never stopped (same global batches).
    On 2 ranks: identical bit for bit. On 1 and 4 ranks the gradients of the same batch are summed in another order
    (float32), so the weights after 2 more steps agree to a few 1e-6, not bit for bit."""
    ref, got = _load(runs / "continued_w2.pt"), _load(runs / f"continued_w{world}.pt")
    for k, v in ref["state"]["tensors"].items():
        if world == 2:
            assert torch.equal(got["state"]["tensors"][k], v), k
        else:
            assert torch.allclose(got["state"]["tensors"][k], v, atol=2e-5, rtol=1e-4), k
    assert got["losses"] == (ref["losses"] if world == 2 else pytest.approx(ref["losses"], abs=1e-5))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_consolidation_writes_the_single_file_paths_bytes(runs, tmp_path):
    from nanochat.checkpoint import sharded as sc

    written = sc.consolidate(files.sharded_step_dir(str(runs / "sharded"), 2), str(tmp_path), 2)
    names = sorted(os.path.basename(p) for p in written)
    assert names == sorted(os.listdir(runs / "single")) == [
        "meta_000002.json", "model_000002.pt", "optim_000002_rank0.pt", "optim_000002_rank1.pt"]
    for name in names:
        assert filecmp.cmp(runs / "single" / name, tmp_path / name, shallow=False), name


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_save_holds_the_state_of_its_step(runs, tmp_path):
    """The async save was still being written while training went on: it holds step 2, the same as the sync save."""
    from nanochat.checkpoint import sharded as sc

    a, b = tmp_path / "a", tmp_path / "b"
    sc.consolidate(files.sharded_step_dir(str(runs / "async"), 2), str(a), 2)
    sc.consolidate(files.sharded_step_dir(str(runs / "sharded"), 2), str(b), 2)
    for name in os.listdir(b):
        assert filecmp.cmp(a / name, b / name, shallow=False), name


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_rank_killed_mid_save_leaves_the_previous_step(tmp_path, capsys):
    with pytest.raises(RanksFailed, match="failed"):  # rank 1 died (SIGKILL) while writing its shard of step 4
        launch.ranks("sharded_ckpt_check.py", ["--mode=save", f"--dir={tmp_path}", "--crash=1"], timeout=300)
    d = str(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "sharded_000004.partial").is_dir()
    assert steps.step_format(d, 4) is None
    assert steps.complete_steps(d) == [2] and cm.find_last_step(d) == 2
    # the next start of the run removes what the killed save left, says so in one line, and resumes from step 2
    from nanochat.checkpoint.resume import resolve_resume_step

    assert resolve_resume_step("auto", d) == 2
    out = capsys.readouterr().out
    assert f"Removed 1 temp file(s) of an interrupted save from {d}" in out and "sharded_000004.partial" in out
    assert not (tmp_path / "sharded" / "sharded_000004.partial").exists()


# ----------------------------------------------------------------------------- tensor parallelism: the same format


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """TP=2 on 2 ranks saves (sharded, its default format); TP=2 on 2 ranks and FSDP on 1 and 2 ranks load it."""
    d = tmp_path_factory.mktemp("tp_sharded")
    launch.ranks("tp_ckpt_check.py", ["--mode=save", f"--dir={d}"], nproc=2, timeout=300)
    for layout, n in (("tp", 2), ("fsdp", 1), ("fsdp", 2)):
        launch.ranks("tp_ckpt_check.py", ["--mode=load", f"--dir={d}", f"--layout={layout}"], nproc=n, timeout=300)
    return d


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout, world", [("tp", 2), ("fsdp", 1), ("fsdp", 2)])
def test_a_tp_step_is_sharded_and_resumes_on_one_and_two_ranks(tp_runs, layout, world):
    """A TP=2 run writes a sharded step (no rank-0 gather); it loads tensor for tensor (torch.equal) into TP=2 on 2
    ranks and FSDP on 1 and 2, and training goes on: bit for bit on the same layout, within float32 reduction-order
    noise on another."""
    assert steps.sharded_steps(str(tp_runs / "tp")) == [2] and not list((tp_runs / "tp").glob("*.pt"))
    meta = json.loads((tp_runs / "tp" / "sharded_000002" / "meta_000002.json").read_text())
    assert (meta["parallel"], meta["tp_size"], meta["world_size"]) == ("tp", 2, 2)
    saved, loaded = _load(tp_runs / "saved.pt"), _load(tp_runs / f"loaded_{layout}_w{world}.pt")
    assert list(loaded["tensors"]) == list(saved["tensors"])
    assert any(k.endswith("momentum_buffer") for k in saved["tensors"]) and any(k.endswith("exp_avg") for k in saved["tensors"])
    for k, v in saved["tensors"].items():
        assert torch.equal(loaded["tensors"][k], v), k
    assert loaded["groups"] == saved["groups"]
    ref, got = _load(tp_runs / "continued_tp_w2.pt"), _load(tp_runs / f"continued_{layout}_w{world}.pt")
    for k, v in ref["state"]["tensors"].items():
        if layout == "tp":
            assert torch.equal(got["state"]["tensors"][k], v), k
        else:
            assert torch.allclose(got["state"]["tensors"][k], v, atol=2e-5, rtol=1e-4), k
    assert got["losses"] == (ref["losses"] if layout == "tp" else pytest.approx(ref["losses"], abs=1e-5))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tp_step_consolidates_its_model(tp_runs, tmp_path):
    """The model of a TP step consolidates into nanochat's single file as an FSDP step's does; its optimizer state (a
    rectangle per rank of the (dp, tp) mesh) stays in the sharded step, which resumes on any layout: said, not written."""
    from nanochat.checkpoint import sharded as sc

    step_dir = files.sharded_step_dir(str(tp_runs / "tp"), 2)
    with pytest.raises(ValueError, match=r"saved by the --tp_size=2 path: its optimizer state stays in .*--optimizer=0"):
        sc.consolidate(step_dir, str(tmp_path), 2)
    assert os.listdir(tmp_path) == []  # refused before anything was written
    written = sc.consolidate(step_dir, str(tmp_path), 2, optimizer=False)
    assert sorted(os.path.basename(p) for p in written) == ["meta_000002.json", "model_000002.pt"]
    model = torch.load(tmp_path / "model_000002.pt", weights_only=True)
    saved = _load(tp_runs / "saved.pt")["tensors"]
    assert list(model) == [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    assert all(torch.equal(v, saved[f"model.{k}"]) for k, v in model.items())


# ----------------------------------------------------------------------------- base_train end to end


TINY = ["--depth=1", "--max_seq_len=64", "--device_batch_size=4", "--eval_every=-1", "--core_metric_every=-1",
        "--sample_every=-1", "--device_type=cpu", "--total_batch_size=512"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_base_train_fsdp_resumes_a_sharded_step_on_another_world_size(base_dir):
    """base_train --use_fsdp=1 on 2 ranks writes sharded steps 2 and 4 (asynchronously); step 2 resumed by 1 rank
    reading the data as 2 ranks did (--data_world_size=2) ends where the 2-rank run ended (the same batches; reduction
    order aside), and resumed on 2 ranks ends there bit for bit; the last step loads through checkpoint_manager and
    consolidates."""
    env = subprocess_env(base_dir)
    args = ["-m", "scripts.base_train", *TINY, "--num_iterations=4", "--save_every=2", "--use_fsdp=1"]
    # sampling at step 2 leaves FSDP's root gathered right before that save (the save must reshard first)
    run_ranks(args + ["--model_tag=two", "--async_save=1", "--sample_every=2"], env=env)
    two = base_dir / "base_checkpoints" / "two"
    assert steps.sharded_steps(str(two)) == [2, 4] and not list(two.glob("model_*.pt"))
    one = base_dir / "base_checkpoints" / "one"
    one.mkdir()
    os.symlink(two / "sharded_000002", one / "sharded_000002")
    p = run_ranks(args + ["--model_tag=one", "--resume_from_step=2", "--data_world_size=2"], nproc=1, env=env)
    assert "Resumed from step 2" in p.stdout
    a, _, _ = cm.load_checkpoint(str(two), 4, "cpu")
    b, _, _ = cm.load_checkpoint(str(one), 4, "cpu")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4), (k, (a[k] - b[k]).abs().max())
    # on the same 2 ranks the resume is exact, bit for bit
    again = base_dir / "base_checkpoints" / "again"
    again.mkdir()
    os.symlink(two / "sharded_000002", again / "sharded_000002")
    run_ranks(args + ["--model_tag=again", "--resume_from_step=2"], env=env)
    c, _, _ = cm.load_checkpoint(str(again), 4, "cpu")
    assert all(torch.equal(a[k], c[k]) for k in a)
    model, _, meta = cm.load_model("base", "cpu", "eval", model_tag="two")  # what base_loss/chat/export_hf call
    assert meta["step"] == 4 and all(torch.equal(model.state_dict()[k], a[k].float()) for k in a)
    out = subprocess.run([sys.executable, "-m", "scripts.consolidate_checkpoint", "-i", "base", "-g", "two"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    single = torch.load(two / "model_000004.pt", weights_only=True)
    assert all(torch.equal(single[k], a[k]) for k in a)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_bench_runs(tmp_path):
    """bench/checkpoint_bench.py (the docs/benchmarks.md table) on a tiny model: every format saves and is measured."""
    p = run_ranks(["-m", "bench.checkpoint_bench", "--depth=1", "--vocab_size=512", "--repeat=1",
                      f"--dir={tmp_path}"], env=subprocess_env())
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["world"] == 2 and out["params"] > 0
    for fmt in ("single", "sharded", "async"):
        assert out[fmt]["save_s"] > 0 and out[fmt]["on_disk_GB_per_step"] > 0
    assert out["async"]["blocked_s"] <= out["async"]["save_s"]
    assert os.listdir(tmp_path) == []  # the checkpoints are deleted
