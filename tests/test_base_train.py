"""base_train end to end on CPU: flags, exact resume, learning, schedules and batch arithmetic."""

import re

import pytest
import torch

from nanochat import training as T
from nanochat.checkpoint_manager import load_checkpoint
from nanochat.configurator import FlagError, parse_flags

TINY = ["--depth=1", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=512", "--eval_every=4",
        "--eval_tokens=1024", "--core_metric_every=-1", "--sample_every=-1", "--device_type=cpu"]


def run_base_train(argv, capsys):
    from scripts import base_train

    out = base_train.main(argv)
    text = capsys.readouterr().out
    return out, text


def step_losses(text):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+)/\d+ .*?\| loss: ([0-9.]+)", text)}


def test_flags_forms_and_errors():
    d = {"depth": 20, "device_batch_size": 32, "use_muon": True, "matrix_lr": 0.02, "run": "dummy"}
    c = parse_flags(d, ["--depth=4", "--device-batch-size", "8", "--use_muon=0", "--matrix-lr=1e-3", "--run", "x"])
    assert c == {"depth": 4, "device_batch_size": 8, "use_muon": False, "matrix_lr": 1e-3, "run": "x"}
    with pytest.raises(FlagError, match="Did you mean: --depth"):
        parse_flags(d, ["--dept=4"])
    with pytest.raises(FlagError, match="expects an integer"):
        parse_flags(d, ["--depth=four"])


def test_batch_arithmetic_suggests_valid_values():
    assert T.batch_arithmetic(4096, 4, 64, 2) == (8, 512)
    with pytest.raises(ValueError, match=r"--total_batch_size=4096 or 4608"):
        T.batch_arithmetic(4100, 4, 64, 2)


def test_schedules():
    assert T.lr_multiplier(0, 100, warmup_ratio=0.1) == pytest.approx(0.1)
    assert T.lr_multiplier(50, 100) == 1.0
    assert T.lr_multiplier(100, 100, warmdown_ratio=0.2, final_lr_frac=0.0) == 0.0
    assert T.lr_multiplier(90, 100, warmdown_ratio=0.2, final_lr_frac=0.1) == pytest.approx(0.5 + 0.5 * 0.1)
    assert T.muon_momentum(0) == pytest.approx(0.85) and T.muon_momentum(300) == pytest.approx(0.95)
    assert T.muon_momentum(150) == pytest.approx(0.90)
    # a period <= 0 turns an action off entirely, also at the last step (nanochat's `step % -1 == 0` bug)
    assert not T.every(5, -1, last_step=True) and not T.every(0, 0)
    assert T.every(0, 3) and T.every(6, 3) and not T.every(7, 3) and T.every(7, 3, last_step=True)


def test_bad_total_batch_stops_with_message(base_dir, capsys):
    from scripts import base_train

    with pytest.raises(ValueError, match="not divisible"):
        base_train.main(TINY[:3] + ["--total_batch_size=1000", "--num_iterations=1", "--device_type=cpu"])


def test_resume_is_exact(base_dir, capsys):
    """2N steps uninterrupted == N steps, resume, N steps: identical losses and parameters (Muon + AdamW)."""
    n = 4
    full, full_text = run_base_train(TINY + [f"--num_iterations={2 * n}", "--model_tag=full", f"--save_every={n}"], capsys)
    # the interruption: a fresh tag holding only the step-N checkpoint files, resumed by a new run
    import shutil

    src = base_dir / "base_checkpoints" / "full"
    dst = base_dir / "base_checkpoints" / "resumed"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f"{n:06d}" in f.name:
            shutil.copy(f, dst / f.name)
    resumed, resumed_text = run_base_train(TINY + [f"--num_iterations={2 * n}", "--model_tag=resumed", f"--resume_from_step={n}"], capsys)

    full_losses, resumed_losses = step_losses(full_text), step_losses(resumed_text)
    assert sorted(resumed_losses) == list(range(n + 1, 2 * n + 1))
    for s in range(n + 1, 2 * n + 1):
        assert resumed_losses[s] == full_losses[s], f"step {s}: {resumed_losses[s]} != {full_losses[s]}"
    assert resumed["val_bpb"] == full["val_bpb"]
    a, _, _ = load_checkpoint(str(src), 2 * n, "cpu", load_optimizer=True)
    b, _, _ = load_checkpoint(str(dst), 2 * n, "cpu", load_optimizer=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_refuses_other_parallelism_path(tmp_path):
    """Optimizer state differs between the DDP and FSDP paths: resuming across them is a clear error, not a crash."""
    from nanochat.gpt import GPTConfig

    model = T.build_model(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=64), "cpu")
    optimizers = model.setup_optimizers()
    T.save_train_state(str(tmp_path), 3, model, optimizers, {"user_config": {"use_fsdp": True}})
    with pytest.raises(ValueError, match="resume with --use_fsdp=1"):
        T.load_train_state(str(tmp_path), 3, model, optimizers, "cpu", use_fsdp=False)
