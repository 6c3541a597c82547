"""
Tensor parallelism (nanochat/distributed/tensor_parallel.py, `--tp_size`) on CPU with gloo, launched by torchrun as users launch
base training, against one process with the same global batch (tolerances as tests/distributed/test_dist_train.py):

- TP=2 on 2 ranks == 1 process over 10 steps (losses and final weights), with Muon (ShardedMuon) and with AdamW only
- DP=2 x TP=2 on 4 ranks == 1 process reading the data as 2 ranks would
- activation checkpointing under TP gives the same run; evaluation (bpb) and sampling run mid-training (every forward
  is collective); the TP checkpoint (a sharded step) loads in one process with the same logits
- resuming a TP run is exact; resuming it on the DDP path is refused with the flag to use (tests/distributed/test_sharded_checkpoint.py
  resumes a TP step on FSDP over 1 and 2 ranks)
- mid_train and chat_sft under TP == 1 process; torch.compile x TP x activation checkpointing == eager 1 process
- ShardedMuon on awkward layouts (uneven rectangles, Shard(1) x Shard(0), replicated dims) == Muon on full matrices
- the head-divisibility and world-size errors name the valid sizes (no process group needed)
"""

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from conftest import subprocess_env
from ranks import run_ranks
from test_dist_train import final_params, losses, records, single_process

HERE = Path(__file__).resolve().parents[1]

# depth 3: n_embd 192 = 2 heads of 96, the smallest nanochat shape whose heads split over 2 tp ranks
TINY = ["--depth=3", "--max_seq_len=64", "--device_batch_size=4", "--eval_every=-1", "--core_metric_every=-1",
        "--sample_every=-1", "--device_type=cpu"]
STEPS = 10


def assert_same_run(base_dir, ref_tag, tag, steps, atol=1e-4, adamw_matrices=False):
    """
    test_dist_train's assert_same_run -- losses within 1e-4 at every step, weights within atol 1e-4 / rtol 1e-3 --
    for the weights Muon trains. The weights AdamW trains (wte and lm_head; every matrix with adamw_matrices) must
    instead have a mean difference under 1e-4 of their mean size. Why: a row-wise layer sums its matmul in tp partial
    sums and FSDP averages the dp gradients in another order, which rounds differently from one process (the
    gradients cannot be bitwise equal), and AdamW with eps 1e-10 turns last-bit differences of near-zero gradients
    into +-lr steps in a few elements. Measured: TP=2, Muon: 3 of 98,304 wte elements off by 2e-3 (mean 2e-7), losses
    equal to 1e-7; DP2xTP2: 44 elements; AdamW on the matrices: bitwise-equal step 0, 1e-7 relative gradient
    differences at step 1, a 2e-5 jump in one c_q element at step 2 (noise, not a wrong update). The FSDP path (same
    AdamW on DTensors) drifts the same way: 369 wte elements off by up to 2e-2 in a 10-step AdamW-only run.
    """
    ref_l, l = losses(base_dir, ref_tag), losses(base_dir, tag)
    assert len(ref_l) == len(l) == steps
    assert l == pytest.approx(ref_l, abs=atol), (ref_l, l)
    a, _ = final_params(base_dir, ref_tag, steps)
    b, _ = final_params(base_dir, tag, steps)
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].float(), b[k].float()
        if adamw_matrices or not k.startswith("transformer.h."):
            assert (x - y).abs().mean() <= 1e-4 * x.abs().mean(), (k, (x - y).abs().mean(), x.abs().mean())
        else:
            assert torch.allclose(x, y, atol=atol, rtol=1e-3), (k, (x - y).abs().max())


def _single(base_dir, tag, steps, world, extra=()):
    # test_dist_train's single_process with this file's model shape (its TINY comes first; later flags win)
    return single_process(base_dir, tag, steps, world, [*TINY, *extra])


# One process, AC_STEPS steps at the tp runs' global batch: the reference that the AC and the compiled TP runs (same
# flags, same steps) both compare against, trained once for the module (a tag's directory is copied where a test
# needs it: its own base dir holds its TP run beside it).
AC_STEPS = 4


@pytest.fixture(scope="module")
def one_process_ref(module_base_dir):
    _single(module_base_dir, "ref", AC_STEPS, 1)
    return module_base_dir / "base_checkpoints" / "ref"


def copy_ref(ref, base_dir, tag):
    shutil.copytree(ref, base_dir / "base_checkpoints" / tag)


def _torchrun(base_dir, tag, steps, nproc, extra=(), timeout=400):
    return run_ranks(["-m", "scripts.base_train", *TINY, f"--total_batch_size={256 * nproc // 2}",
                         f"--num_iterations={steps}", f"--model_tag={tag}", "--tp_size=2", *extra],
                        nproc=nproc, env=subprocess_env(base_dir), timeout=timeout)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("use_muon", [1, 0])
def test_tp2_on_two_ranks_matches_one_process(base_dir, use_muon):
    # AdamW on the matrices gets a smaller LR (as tests/dist_scripts/gpt_train_check.py): at the default 0.02 (x2 width
    # scaling) this tiny run is chaotic -- a 1e-7 rounding difference grows to 1e-4 by step 4 and 2e-2 by step 6 --
    # and TP cannot round like one matmul (module docstring of assert_same_run)
    flags = [f"--use_muon={use_muon}"] + ([] if use_muon else ["--matrix_lr=0.003"])
    _single(base_dir, f"ref{use_muon}", STEPS, 1, flags)
    p = _torchrun(base_dir, f"tp{use_muon}", STEPS, 2, flags)
    assert "x 1 rank(s)" in p.stdout  # 2 ranks, one data rank: both tp ranks read the same batches
    assert_same_run(base_dir, f"ref{use_muon}", f"tp{use_muon}", STEPS, adamw_matrices=not use_muon)
    # the clipped gradient norm (two meshes, replicated wte/lm_head) equals the unsharded model's
    norms = [[r["train/grad_norm"] for r in records(base_dir, t) if "train/grad_norm" in r] for t in (f"ref{use_muon}", f"tp{use_muon}")]
    assert len(norms[0]) == STEPS and norms[1] == pytest.approx(norms[0], rel=1e-4), norms
    meta = final_params(base_dir, f"tp{use_muon}", STEPS)[1]
    assert meta["parallel"] == "tp" and meta["tp_size"] == 2


@pytest.mark.dist
@pytest.mark.slow
def test_dp2_x_tp2_on_four_ranks_matches_one_process(base_dir):
    _single(base_dir, "ref4", STEPS, 2, ["--total_batch_size=512"])
    p = _torchrun(base_dir, "dp2tp2", STEPS, 4)
    assert "x 2 rank(s)" in p.stdout  # 4 ranks = 2 data ranks x 2 tp ranks
    assert_same_run(base_dir, "ref4", "dp2tp2", STEPS)


@pytest.mark.dist
@pytest.mark.slow
def test_tp_with_ac_eval_sampling_and_checkpoint(base_dir, one_process_ref):
    """AC=full under TP, bpb evaluation and sampling mid-run; the TP checkpoint (sharded) loads in one process (same
    logits)."""
    from nanochat.checkpoint_manager import load_model

    steps = AC_STEPS
    copy_ref(one_process_ref, base_dir, "refac")
    p = _torchrun(base_dir, "tpac", steps, 2, ["--activation_checkpointing=full", "--eval_every=2", "--eval_tokens=512",
                                               "--sample_every=2"])
    assert "Activation checkpointing (full)" in p.stdout
    assert_same_run(base_dir, "refac", "tpac", steps)
    assert [r["step"] for r in records(base_dir, "tpac") if "val/bpb" in r] == [0, 2, 4]
    assert p.stdout.count("'The capital of France is' ->") == 2  # steps 2 and 4, printed by rank 0 only
    sd, _ = final_params(base_dir, "tpac", steps)
    assert all(type(v) is torch.Tensor for v in sd.values())  # plain full tensors, assembled from the sharded step
    assert (base_dir / "base_checkpoints" / "tpac" / f"sharded_{steps:06d}").is_dir()
    m_tp, tok, _ = load_model("base", "cpu", "eval", model_tag="tpac")
    m_ref, _, _ = load_model("base", "cpu", "eval", model_tag="refac")
    idx = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog", prepend="<|bos|>")])
    with torch.no_grad():
        assert torch.allclose(m_tp(idx), m_ref(idx), atol=1e-4)


@pytest.mark.dist
@pytest.mark.slow
def test_tp_resume_is_exact_and_other_layouts_are_refused(base_dir):
    n = 3
    _torchrun(base_dir, "full", 2 * n, 2, [f"--save_every={n}"])
    src, dst = base_dir / "base_checkpoints" / "full", base_dir / "base_checkpoints" / "resumed"
    dst.mkdir()
    for f in src.glob(f"*{n:06d}*"):  # TP writes a sharded step: one directory
        (shutil.copytree if f.is_dir() else shutil.copy)(f, dst / f.name)
    _torchrun(base_dir, "resumed", 2 * n, 2, [f"--resume_from_step={n}"])
    assert losses(base_dir, "resumed") == losses(base_dir, "full")[n:]
    a, _ = final_params(base_dir, "full", 2 * n)
    b, _ = final_params(base_dir, "resumed", 2 * n)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the same 2 ranks on the DDP path cannot take the TP (sharded) optimizer state: the error names the flag to use
    import subprocess
    import sys

    from conftest import REPO, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "scripts.base_train", *TINY, "--total_batch_size=512",
           f"--num_iterations={2 * n}", "--model_tag=resumed", f"--resume_from_step={n}"]
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(base_dir), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "resume with --tp_size=2" in p.stderr + p.stdout


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_muon_matches_muon_on_awkward_layouts():
    spec = importlib.util.spec_from_file_location("nanochat_test_launch", HERE / "dist_scripts" / "launch.py")
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    out = launch.json_lines(launch.ranks("tp_muon_check.py", nproc=4, timeout=300))
    assert sorted({r["options"] for r in out}) == ["december", "record"]  # the record recipe's options too
    assert all(r["ok"] for r in out), out


def test_tp_size_errors_name_the_valid_values():
    """One check (parallel.check_layout), one usage error type, before any process group or model exists."""
    from nanochat.gpt import GPTConfig, config_for_depth
    from nanochat.distributed.parallel import DataParallel, check_layout, parallel_from_config
    from nanochat.usage import UsageError

    c = GPTConfig(sequence_len=8, vocab_size=64, n_layer=1, n_head=6, n_kv_head=3, n_embd=96)
    check_layout(c, 3, 6)
    with pytest.raises(UsageError, match=r"does not divide n_kv_head=3.*use one of: 1, 3"):
        check_layout(c, 2, 4 * 3)
    with pytest.raises(UsageError, match=r"does not divide the world size 4.*use one of: 1"):
        check_layout(c, 3, 4)
    with pytest.raises(UsageError, match=r"--tp_size=4 does not divide n_head=10 .*use one of: 1, 2"):
        check_layout(config_for_depth(20, 65536, 2048), 4, 8)  # d20 has 10 heads: what a start-up check asks
    with pytest.raises(UsageError, match="use one of: 1, 2, 4"):
        parallel_from_config({"tp_size": 3}).data_rank_and_world(0, 4)  # the plan asks the same function
    assert parallel_from_config({"tp_size": 2}).data_rank_and_world(3, 8) == (1, 4)
    assert isinstance(parallel_from_config({"tp_size": 1}), DataParallel)
    tp = parallel_from_config({"tp_size": 2})
    assert tp.name == "tp" and tp.flag == "--tp_size=2" and tp.collective_forward
    with pytest.raises(UsageError, match="--tp_size must be a whole number >= 1"):
        parallel_from_config({"tp_size": 0})
    # single-file optimizer state of another layout: the message names the flag to resume with
    with pytest.raises(ValueError, match="resume with --tp_size=4"):
        tp.check_resume({"parallel": "tp", "tp_size": 4}, 10)
    with pytest.raises(ValueError, match="resume with --use_fsdp=1"):
        tp.check_resume({"parallel": "fsdp"}, 10)
    with pytest.raises(ValueError, match="resume with --tp_size=2"):
        DataParallel().check_resume({"parallel": "tp", "tp_size": 2}, 10)
    tp.check_resume({"parallel": "tp", "tp_size": 2}, 10)
    # a sharded step resumes on either DTensor layout, whatever saved it; not on the DDP path
    tp.check_resume({"parallel": "fsdp"}, 10, "sharded")
    parallel_from_config({"use_fsdp": True}).check_resume({"parallel": "tp", "tp_size": 2}, 10, "sharded")
    with pytest.raises(ValueError, match="step 10 is a sharded checkpoint .*resume with --tp_size=2"):
        DataParallel().check_resume({"parallel": "tp", "tp_size": 2}, 10, "sharded")


@pytest.mark.dist
@pytest.mark.slow
def test_mid_and_sft_tp2_match_one_process(tmp_path, monkeypatch):
    """mid_train and chat_sft --tp_size=2 on 2 ranks (one data rank: both tp ranks take the same rows) == 1 process."""
    from test_posttrain import SHARED_DATA, require_chat_data

    require_chat_data()
    from nanochat.checkpoint_manager import load_checkpoint, save_checkpoint
    from nanochat.gpt import config_for_depth
    from nanochat.metrics import read_metrics
    from nanochat.tokenizer import compute_token_bytes, save_token_bytes
    from nanochat.training import init_model
    from scripts import chat_sft, mid_train
    from chat_fixtures import tiny_tokenizer

    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED_DATA))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # missing hub datasets fail at once
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tok = tiny_tokenizer()
    tok.save(str(base / "tokenizer"))
    save_token_bytes(compute_token_bytes(tok), str(base / "tokenizer"))
    torch.manual_seed(0)
    config = config_for_depth(3, tok.get_vocab_size(), 128)  # 2 heads
    model = init_model(config, "cpu")
    for tag in ("one", "tp"):
        save_checkpoint(str(base / "base_checkpoints" / tag), 0, model.state_dict(), None, {"model_config": vars(config), "step": 0})

    def series(stage, tag, key):
        return [(r["step"], r[key]) for r in read_metrics(base / f"{stage}_checkpoints" / tag / "metrics.jsonl") if key in r]

    def compare(stage, keys, step):
        for key, tol in keys:
            a, b = series(stage, "one", key), series(stage, "tp", key)
            assert len(a) >= 2 and [s for s, _ in a] == [s for s, _ in b], (stage, key, a, b)
            assert [v for _, v in b] == pytest.approx([v for _, v in a], abs=tol), (stage, key, a, b)
        a, _, _ = load_checkpoint(str(base / f"{stage}_checkpoints" / "one"), step, "cpu")
        b, _, _ = load_checkpoint(str(base / f"{stage}_checkpoints" / "tp"), step, "cpu")
        for k in a:
            assert (a[k] - b[k]).abs().mean() <= 1e-4 * a[k].abs().mean(), (stage, k)

    def mid_args(tag):
        return ["--device_type=cpu", "--max_seq_len=64", "--device_batch_size=2", "--total_batch_size=256",
                "--num_iterations=3", "--eval_every=3", "--eval_tokens=256", f"--model_tag={tag}"]

    mid_train.main(mid_args("one"))
    p = run_ranks(["-m", "scripts.mid_train", *mid_args("tp"), "--tp_size=2"], env=subprocess_env(base))
    assert "x 1 rank(s) x 2 accumulation" in p.stdout
    compare("mid", [("train/loss", 1e-5), ("val/bpb", 1e-5)], 3)

    def sft_args(tag):
        return ["--source=base", "--device_type=cpu", "--device_batch_size=1", "--target_examples_per_step=2",
                "--num_iterations=3", "--eval_every=3", "--eval_steps=2", "--eval_metrics_every=3",
                "--eval_metrics_max_problems=3", f"--model_tag={tag}"]

    chat_sft.main(sft_args("one"))
    p = run_ranks(["-m", "scripts.chat_sft", *sft_args("tp"), "--tp_size=2"], env=subprocess_env(base))
    assert "x 1 rank(s) x 2 accumulation" in p.stdout
    compare("chatsft", [("train/loss", 1e-5), ("val/loss", 1e-5), ("train/num_tokens", 0), ("eval/MMLU_acc", 0),
                        ("eval/ARC-Easy_acc", 0)], 3)  # the accuracy evals run on the TP model (lockstep)


@pytest.mark.dist
@pytest.mark.slow
def test_tp_compiled_with_ac_matches_eager_one_process(base_dir, one_process_ref):
    """torch.compile (per block, as under FSDP) x TP x activation checkpointing: no graph break, same run as eager."""
    steps = AC_STEPS
    copy_ref(one_process_ref, base_dir, "refc")
    p = run_ranks(["-m", "scripts.base_train", *TINY, "--total_batch_size=256", f"--num_iterations={steps}",
                      "--model_tag=tpc", "--tp_size=2", "--compile=1", "--activation_checkpointing=full"],
                     env=subprocess_env(base_dir, NANOCHAT_COMPILE="1"), timeout=900)
    assert "cold compile" in p.stdout and "graph break" not in p.stdout + p.stderr
    assert_same_run(base_dir, "refc", "tpc", steps)
