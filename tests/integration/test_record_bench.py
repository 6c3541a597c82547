"""
The record recipe's benches:
- against nanochat 92d63d4's own base_train, side by side (bench/record_side_by_side.py, at test size): the same shards, tokenizer and flags, fp32 on CPU, eager, sliding windows cutting (rows of 256, short window
128); every step's training loss equals 92d63d4's bit for bit. The validation bpb (at the first and last step)
agrees to float32 rounding: 92d63d4 sums the nats in float32, nanochat/loss_eval.py in float64.
The 50-step d4 figures are in docs/benchmarks.md. Skips without 92d63d4's tarball (tests/anchors.py).
- `bash bench/gpu_suite.sh record` (issue 29's GPU figures, prepared without a GPU): its dry run lists d24 record
  steps within the 9-minute slot, and bench/train_bench.py --recipe=record times the record model with its optimizer.
"""

import json
import os
import re
import subprocess

import pytest

from anchors import ANCHOR_92D63D4
from conftest import REPO

STEPS = 18  # long enough to tell AdamW arithmetics apart: with torch's, 3 of 20 steps (15-17) differ by up to 1e-6


@pytest.mark.slow
def test_record_recipe_losses_equal_nanochat_92d63d4_step_for_step(tiny_base_dir, tmp_path):
    if not ANCHOR_92D63D4.is_file():
        pytest.skip(f"nanochat 92d63d4's tarball is not at {ANCHOR_92D63D4}")
    from bench.record_side_by_side import main

    data = tmp_path / "data"  # 92d63d4 reads base_data_climbmix/: the tiny WikiText-2 shards under that name
    data.mkdir()
    os.symlink(tiny_base_dir / "base_data", data / "base_data_climbmix")
    os.symlink(tiny_base_dir / "tokenizer", data / "tokenizer")
    out = tmp_path / "sbs.json"
    rc = main([f"--anchor={ANCHOR_92D63D4}", f"--work={tmp_path / 'work'}", f"--base_dir={data}", "--depth=2",
               "--max_seq_len=256", "--device_batch_size=4", "--total_batch_size=1024", f"--steps={STEPS}",
               "--warmup_steps=2", f"--eval_every={STEPS}", "--eval_tokens=1024", f"--out={out}",
               "--together=1", "--threads=1"])
    result = json.loads(out.read_text())
    assert [r["step"] for r in result["steps"]] == list(range(STEPS)) and [r["step"] for r in result["evals"]] == [0, STEPS]
    assert result["steps"][-1]["ours"] < result["steps"][0]["ours"] - 0.1  # it trains: the weights move
    assert result["max_diff"] == 0.0 and result["exact_steps"] == STEPS, result
    assert result["max_bpb_diff"] < 1e-6 and rc == 0, result


# recorded on an H100 (2026-11-27): the record d24 bf16 forward+backward cold compile took 114.5 s, a step 0.53 s;
# the FP8 model's compile is estimated from d20's FP8/bf16 ratio in the same torch (2.11): 109.0 s (2026-11-27) / 58.8 s
COLD_COMPILE_D24_RECORD = 114.5
COLD_COMPILE_D24_RECORD_FP8 = COLD_COMPILE_D24_RECORD * 109.0 / 58.8
START_UP, NEWTON_SCHULZ, D24_STEPS_S = 15, 10, 7 * 0.6  # seconds: start-up, Muon's compile, 2 + 5 steps


def suite_steps(part, tmp_path):
    r = subprocess.run(["bash", "bench/gpu_suite.sh", part, "--dry-run"], cwd=REPO, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PY": "python3"}, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "dry run: nothing ran" in r.stdout and list(tmp_path.iterdir()) == []
    return re.findall(r"^=== (record_\w+) \(limit (\d+) s\): (.*)$", r.stdout, flags=re.M)


def test_gpu_suite_record_parts_fit_nine_minutes_each(tmp_path):
    attn, fp8 = suite_steps("record", tmp_path), suite_steps("recordfp8", tmp_path)
    assert [s[0] for s in attn] == ["record_attn"] and [s[0] for s in fp8] == ["record_fp8_torchao", "record_fp8_native"]
    for steps in (attn, fp8):
        assert sum(int(s[1]) for s in steps) <= 540
        assert all("--recipe=record --depth=24 --max_seq_len=2048" in s[2] and "--device_batch_size=16" in s[2]
                   for s in steps)
    assert "--attn=fa3,flex,sdpa" in attn[0][2] and "--fp8_impl=torchao" in fp8[0][2] and "--fp8_impl=native" in fp8[1][2]
    # each limit covers what its step needs at the recorded (and estimated) compile times, with 10 s to spare
    three_compiles = START_UP + 3 * (COLD_COMPILE_D24_RECORD + D24_STEPS_S) + NEWTON_SCHULZ
    assert int(attn[0][1]) >= three_compiles + 10, three_compiles
    for _, limit, _ in fp8:
        assert int(limit) >= START_UP + COLD_COMPILE_D24_RECORD_FP8 + NEWTON_SCHULZ + D24_STEPS_S + 10


@pytest.mark.slow
def test_train_bench_times_the_record_model(capsys):
    from bench.train_bench import main
    import torch

    from nanochat.gpt import RecordGPT, make_model, record_config_for_depth

    main(["--recipe=record", "--depth=2", "--max_seq_len=256", "--device_batch_size=2", "--vocab_size=512",
          "--steps=1", "--warmup=1", "--device_type=cpu", "--attn=sdpa"])
    out = capsys.readouterr().out.strip().splitlines()
    assert "| d2 record (" in out[2]
    r = json.loads(out[-1])
    with torch.device("meta"):  # 128 wide (one head of 128), SSSL over 2 layers: windows of 128 and 256
        model = make_model(record_config_for_depth(2, 512, 256))
    assert type(model) is RecordGPT
    assert r["recipe"] == "record" and r["params"] == model.num_params()
    assert r["flops_per_token"] == model.estimate_flops() and r["nonfinite_losses"] == 0
