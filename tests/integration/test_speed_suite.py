"""
`bash bench/gpu_suite.sh speed` (issue 20's GPU figures) must not waste a lent GPU's minutes (issue 28), so what can
be checked on a CPU is checked here: the dry run lists the commands within the 9-minute slot and every step's limit
covers what the H100 recorded; a step stopped by its time limit keeps every row that finished (each bench is
interrupted mid-way like `timeout --signal=INT` does); a backend that crashes is its own row; no attention backend
recompiles the model on its second call; the decode bound counts the bytes a step reads in their dtype; pinned
kernels that take no mask fall back for masked calls; rows record the SDPA kernel torch dispatches to, its own order,
CUDA-graph skips and non-finite losses; the profile's time shares; bench/speed_table.py's table that names every
missing figure and why. The GPU run itself needs a GPU; `--cpu` (the same steps at d4) is run by hand
(docs/benchmarks.md): it takes minutes.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from nanochat import attention as A
from nanochat.gpt import GPT, GPTConfig
from test_attention import ref_bwd, ref_fwd

REPO = Path(__file__).resolve().parents[2]


def dry_run(tmp_path, part="speed", *extra):
    """`bash bench/gpu_suite.sh PART --dry-run [extra]`: (the result, [(step name, limit, command)])."""
    r = subprocess.run(["bash", "bench/gpu_suite.sh", part, "--dry-run", *extra], cwd=REPO, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PY": "python3"}, timeout=30)
    assert r.returncode == 0, r.stderr
    return r, re.findall(r"^=== (\w+) \(limit (\d+) s\): (.*)$", r.stdout, flags=re.M)


def test_dry_run_prints_the_commands_within_nine_minutes(tmp_path):
    r, steps = dry_run(tmp_path)
    assert [s[0] for s in steps] == ["speed_attn", "speed_fp8", "speed_decode"]
    assert sum(int(s[1]) for s in steps) <= 540  # the slot is 9 minutes
    assert "--attn=sdpa,sdpa_flash,flex,fa3,fa4 --profile_steps=2" in steps[0][2] and "--depth=20" in steps[0][2]
    assert "--fp8=1" in steps[1][2] and "--fp8_filter=auto" in steps[1][2]
    assert "--batch_sizes=1,8 --decode_compile=0,1" in steps[2][2]
    assert "dry run: nothing ran" in r.stdout and list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_serve_part_fits_nine_minutes_and_serve_bench_takes_its_flags(tmp_path):
    """`bash bench/gpu_suite.sh serve` (issue 30's rows): one serve_bench step at d20 with 1/16/64/256 clients that
    fits the 9-minute slot with a minute to spare (nvidia-smi, the bench's own start), and --cpu the same at d4 on
    this CPU; every flag either passes is one serve_bench accepts (a renamed flag fails here, not on a lent GPU)."""
    from bench.serve_bench import FLAGS

    for extra, depth in (([], "--depth=20"), (["--cpu"], "--depth=4")):
        r, (step,) = dry_run(tmp_path, "serve", *extra)
        name, limit, command = step[0], int(step[1]), step[2].split()
        assert name == "serve_batching" and command[:3] == ["python3", "-m", "bench.serve_bench"] and depth in command
        assert limit <= 480 if not extra else limit <= 960  # --cpu doubles the limits
        args = FLAGS.parse_args(command[3:])
        assert args.concurrency == ("1,16,64,256" if not extra else "1,4,16")
        assert args.level_repeats == 1  # each level once: the slot has no room for repeats
        assert "dry run: nothing ran" in r.stdout and list(tmp_path.iterdir()) == []

def test_decode_part_fits_nine_minutes_and_its_benches_take_their_flags(tmp_path):
    """`bash bench/gpu_suite.sh decode`: the Engine's and the serving Scheduler's decode step in one infer_bench run
    at d20 (--cpu: d2), then the server's host ceiling (host_bench: 16/64/256 streams of a model that costs nothing),
    every flag one the bench accepts, within the slot."""
    from bench.host_bench import FLAGS as HOST_FLAGS
    from bench.infer_bench import FLAGS

    for extra, depths in (([], "20"), (["--cpu"], "2")):
        r, (decode, host) = dry_run(tmp_path, "decode", *extra)
        assert [decode[0], host[0]] == ["decode_paths", "serve_host"]
        assert int(decode[1]) + int(host[1]) <= (540 if not extra else 1080)
        command = decode[2].split()
        assert command[:3] == ["python3", "-m", "bench.infer_bench"]
        args = FLAGS.parse_args(command[3:])
        assert args.depths == depths and args.paths == "engine,scheduler,scheduler_serial" and args.skip_server
        command = host[2].split()
        assert command[:3] == ["python3", "-m", "bench.host_bench"]
        assert HOST_FLAGS.parse_args(command[3:]).concurrency == ("16,64,256" if not extra else "16,64")
        assert "dry run: nothing ran" in r.stdout and list(tmp_path.iterdir()) == []


# What each step must fit on one H100, from what the 2026-11-25 session recorded (docs/benchmarks.md) and, where
# nothing was recorded, an estimate said as such.
COLD_COMPILE_D20_BF16 = 58.8  # recorded: base_train's cold compile of the d20 forward+backward
COLD_COMPILE_D20_FP8 = 131  # recorded: 115-131 s for the FP8 model's
START_UP = 15  # estimate: imports, CUDA start, building d20 (and a tokenizer for decode)
NEWTON_SCHULZ = 10  # estimate: Muon's compiled Newton-Schulz, cold; ~3 s again from inductor's cache
STEPS = 7 * 0.5  # recorded ~0.48 s per d20 step: 2 warm-up + 5 timed
GRAPH_COMPILE = 40  # estimate: one CUDA-graph decode compile of d20 (one per batch size)
FLOORS = {
    "speed_attn": START_UP + (COLD_COMPILE_D20_BF16 + NEWTON_SCHULZ + STEPS) + 2 * (COLD_COMPILE_D20_BF16 + 3 + STEPS)
    + 2 * 0.5,  # three backends, then two profiled steps
    "speed_fp8": START_UP + COLD_COMPILE_D20_FP8 + NEWTON_SCHULZ + STEPS,
    "speed_decode": START_UP + 2 * GRAPH_COMPILE + 10,  # the eager runs: ~2 x 264 tokens at ~12 ms
}


def test_every_step_limit_covers_its_recorded_floor(tmp_path):
    _, steps = dry_run(tmp_path)
    limits = {name: int(limit) for name, limit, _ in steps}
    assert sum(limits.values()) <= 540
    for name, floor in FLOORS.items():
        assert limits[name] >= floor + 10, (name, limits[name], floor)  # and 10 s to spare at least


def test_a_step_survives_a_reader_that_stops_early(tmp_path):
    # a stand-in for python that prints what the step's filter keeps, a lot of it: `| head -40` after the filter
    # ended tee, then the benchmark, with a broken pipe (exit 141) and a cut log
    fake = tmp_path / "fakepy"
    fake.write_text("#!/bin/bash\nfor i in $(seq 1 20000); do echo \"| row $i | tok/s |\"; done\necho \"end of $*\"\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    r = subprocess.run(["bash", "bench/gpu_suite.sh", "speed", "--cpu"], cwd=REPO, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(out), "PY": str(fake)}, timeout=120)
    assert (out / "speed_attn.rc").read_text().strip() == "0", r.stdout[-2000:]
    log = (out / "speed_attn.log").read_text().splitlines()
    assert len(log) == 20001 and log[-1].startswith("end of -m bench.train_bench")
    assert r.returncode == 0 and "all steps passed" in r.stdout


# -----------------------------------------------------------------------------
# a time limit keeps every finished row: each bench interrupted after its first row, as `timeout --signal=INT` does


def start(args, stderr):
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # as the suite runs them
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr,
                            text=True)


def interrupt_after(proc, first_row, timeout=300):
    """Read stdout until first_row(line); then SIGINT the still-running process. Returns (stdout lines, rc)."""
    lines, t0 = [], time.monotonic()
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if first_row(line):
            break
        assert time.monotonic() - t0 < timeout, "no row came"
    assert proc.poll() is None, "the run ended before its first row was printed: rows must come as they finish"
    proc.send_signal(signal.SIGINT)
    rest = proc.stdout.read()  # the same reader: it may hold lines already
    return lines + rest.splitlines(), proc.wait(timeout=120)


@pytest.mark.slow
def test_train_bench_keeps_the_rows_that_finished_before_a_time_limit(tmp_path):
    with open(tmp_path / "err", "w+") as stderr:
        proc = start(["bench.train_bench", "--depth=2", "--max_seq_len=64", "--vocab_size=256", "--device_batch_size=2",
                      "--device_type=cpu", "--compile=0", "--steps=400", "--warmup=0", "--threads=1",
                      "--attn=sdpa_math,sdpa,sdpa_flash"], stderr)  # seconds per backend: the SIGINT lands mid-run
        lines, rc = interrupt_after(proc, lambda line: line.startswith("{"))
    err = (tmp_path / "err").read_text()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["attn"] for r in rows] == ["sdpa_math"] and rows[0]["tok_per_s"] > 0
    assert any(line.startswith("| cpu") and "sdpa_math (math)" in line for line in lines)  # its markdown row too
    assert rc == 130 and "interrupted: 1 of 3 backend(s) finished (sdpa_math)" in err
    # what the row records beside the speed (issue 28): the kernel torch dispatches to and its own order, CUDA-graph
    # skips, non-finite losses
    assert rows[0]["sdpa_kernel"] == "math" and rows[0]["sdpa_torch_kernel"] == "flash"
    assert rows[0]["sdpa_torch_order"].startswith("flash > efficient > math > cudnn")
    assert rows[0]["cudagraph_skips"] == 0 and rows[0]["nonfinite_losses"] == 0 and rows[0]["steps_run"] == 400


@pytest.mark.slow
def test_infer_bench_keeps_the_rows_that_finished_before_a_time_limit(tmp_path):
    out = tmp_path / "decode.json"
    with open(tmp_path / "err", "w+") as stderr:
        proc = start(["bench.infer_bench", "--depths=2", "--device_type=cpu", "--threads=1", "--prompt_len=32",
                      "--gen_tokens=96", "--repeats=20", "--batch_sizes=1,2,4,8", "--decode_compile=0", "--skip_server",
                      "--tokenizer=repo_docs", f"--json_out={out}"], stderr)
        lines, rc = interrupt_after(proc, lambda line: line.startswith("d2 batch 1 eager:"))
    err = (tmp_path / "err").read_text()
    printed = [line for line in lines if re.match(r"d2 batch \d+ eager:", line)]
    data = json.loads(out.read_text())
    assert rc == 130 and data["interrupted"] is True and "engine row(s) finished" in err
    # every row it printed (a row is written before it is printed), none it did not finish
    assert 1 <= len(printed) <= len(data["engine"]) < 4
    assert [line.split(":")[0] for line in printed] == [f"d2 batch {r['batch']} eager" for r in data["engine"]][:len(printed)]
    assert data["engine"][0]["batch"] == 1 and data["engine"][0]["decode_tps"] > 0
    assert not (tmp_path / "decode.json.tmp").exists()  # written whole (a temp file, then a rename)


@pytest.mark.slow
def test_a_backend_that_crashes_is_its_row_and_the_next_still_runs(monkeypatch, capsys):
    from bench import train_bench

    real_bench, real_step = train_bench.bench_one, train_bench.train_step
    calls = []

    def bench_one(cfg, attn, *args, **kwargs):
        if attn == "sdpa_flash":  # FA4's missing lse surfaced as this, and killed every backend after it
            raise AttributeError("'NoneType' object has no attribute 'contiguous'")
        return real_bench(cfg, attn, *args, **kwargs)

    def train_step(*args, **kwargs):  # the first backend's second step gives a NaN loss
        loss, norm, extras = real_step(*args, **kwargs)
        calls.append(loss)
        return (math.nan if len(calls) == 2 else loss), norm, extras

    monkeypatch.setattr(train_bench, "bench_one", bench_one)
    monkeypatch.setattr(train_bench, "train_step", train_step)
    train_bench.main(["--depth=1", "--max_seq_len=32", "--device_batch_size=2", "--vocab_size=256", "--steps=1",
                      "--warmup=1", "--device_type=cpu", "--compile=0", "--attn=sdpa_math,sdpa_flash,fa3,sdpa"])
    out = capsys.readouterr()
    records = [json.loads(line) for line in out.out.splitlines() if line.startswith("{")]
    assert [(r["attn"], r["status"]) for r in records] == [
        ("sdpa_math", "ok"), ("sdpa_flash", "failed"), ("fa3", "skipped"), ("sdpa", "ok")]
    assert records[1]["error"] == "AttributeError: 'NoneType' object has no attribute 'contiguous'"
    assert "Traceback" in out.err and "attn=sdpa_flash: failed (AttributeError" in out.err  # the crash's traceback
    assert "needs a Hopper (9.x) GPU" in records[2]["error"]  # a refusal: no traceback needed
    assert records[0]["nonfinite_losses"] == 1 and records[3]["nonfinite_losses"] == 0
    assert "| loss not finite in 1 of 2 steps |" in out.out


# -----------------------------------------------------------------------------
# attention: no recompile on a second call, masked calls of pinned kernels, FA4's lse, the kernel torch dispatches to


def fa4_like_fwd(q, k, v, causal=True, return_lse=False):
    """FA4's _flash_attn_fwd convention on (B, T, H, D) and its rule: the lse only when asked or when an input needs
    grad (none does inside a torch custom op)."""
    out, lse = ref_fwd(q, k, v)
    return out, (lse if return_lse or any(t.requires_grad for t in (q, k, v)) else None)


def test_fa4_wrapper_asks_fa4_for_the_lse():
    fn = A.register_fa4_ops(fa4_like_fwd, ref_bwd)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    ref = fa4_like_fwd(q, k, v)[0]
    dy = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), dy)
    with torch.no_grad():  # evaluation: no input needs grad, so FA4 makes no lse unless asked
        torch.testing.assert_close(fn(q.detach(), k.detach(), v.detach()), ref)
    # compiled training: inside the compiled forward graph the attention's inputs (made by the model's layers before
    # it, here a scaling) need no grad either
    compiled = torch.compile(lambda q, k, v: fn(q * 1.0, k * 1.0, v * 1.0), backend="aot_eager", fullgraph=True)
    y = compiled(q, k, v)
    torch.testing.assert_close(y, ref)
    for a, b in zip(torch.autograd.grad(y, (q, k, v), dy), want):
        torch.testing.assert_close(a, b)


RECOMPILE_BACKENDS = ["sdpa", "sdpa_flash", "sdpa_math", "flex", "fa4 (reference kernels)"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", RECOMPILE_BACKENDS)
def test_no_backend_recompiles_the_model_on_its_second_call(backend, monkeypatch):
    torch._dynamo.reset()
    cfg = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    torch.manual_seed(0)
    model = GPT(cfg, attn="sdpa" if backend.startswith("fa4") else backend)
    model.init_weights()
    if backend.startswith("fa4"):  # FA4 needs a GPU: its custom ops with a reference pair, as in test_attention.py
        monkeypatch.setitem(A._FLASH, "fa4", A.register_fa4_ops(fa4_like_fwd, ref_bwd))
        model.attn_choice = A.Attn("fa4", A.CPU_ORDER, "test")
    compiled = torch.compile(model, backend="eager")
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for seed in (1, 2):  # a second call with new tokens of the same shape: the same graph
                idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(seed))
                if backend == "flex":  # torch has no FlexAttention backward on CPU
                    with torch.no_grad():
                        compiled(idx)
                else:
                    compiled(idx, idx).backward()
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)], ids=str)
def test_masked_calls_of_a_pinned_kernel_that_takes_no_mask_fall_back(cap):
    flash = A.choose("sdpa_flash", cap)
    # CUDA's flash kernel refuses attn_mask (torch: "No available kernel"): masked calls run efficient > math, said once
    assert A.masked_order(flash.order, "cuda") == ("efficient", "math")
    note = A.masked_note(flash, "cuda")
    assert note == ("attn sdpa_flash: CUDA's flash kernel takes no attention mask, so masked calls (the engine's "
                    "fixed-shape decode step) run efficient > math")
    # the kernels that take a mask keep it pinned; `sdpa`'s order only loses flash (SDPA skipped it anyway)
    for kernel in ("cudnn", "efficient", "math"):
        assert A.masked_order((kernel,), "cuda") == (kernel,) and A.masked_note(A.choose(f"sdpa_{kernel}", cap), "cuda") is None
    sdpa = A.choose("sdpa", cap)
    assert A.masked_order(sdpa.order, "cuda") == tuple(k for k in sdpa.order if k != "flash")
    assert A.masked_note(sdpa, "cuda") is None
    # torch's CPU flash kernel takes masks: nothing changes there
    assert A.masked_order(("flash",), "cpu") == ("flash",) and A.masked_note(A.choose("sdpa_flash", None), "cpu") is None


def test_the_kernel_torch_dispatches_to_is_asked_not_assumed():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 4, 16, generator=g).transpose(1, 2)  # (B, H, T, D) as the model makes it
    kv = torch.randn(1, 32, 2, 16, generator=g).transpose(1, 2)
    assert A.sdpa_kernel_for(("flash", "math"), q, kv, kv, is_causal=True) == "flash"
    assert A.sdpa_kernel_for(("math",), q, kv, kv, is_causal=True) == "math"
    assert A.sdpa_kernel_for(None, q, kv, kv, is_causal=True) == "flash"  # torch's own order on CPU
    assert A.sdpa_kernel_for(("efficient",), q, kv, kv).startswith("none: ")  # no such kernel on CPU: torch's error
    assert A.torch_sdpa_order("cpu")[:4] == ("flash", "efficient", "math", "cudnn")


def test_sdpa_env_prints_torch_order(capsys):
    from bench.sdpa_env import main

    main(["cpu"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    assert "TORCH_CUDNN_SDPA_DEPRIORITIZED=" in out[0]
    assert out[1].startswith("torch's own SDPA kernel order after a call: flash > efficient > math > cudnn")


# -----------------------------------------------------------------------------
# decode: the weights users run, the bound from the bytes a step reads


def test_decode_bound_counts_the_bytes_a_step_reads():
    from bench.infer_bench import decode_bytes

    m = nn.Module()
    m.wte, m.mid, m.head = nn.Embedding(1000, 16), nn.Linear(16, 32), nn.Linear(32, 1000, bias=False)
    m.to(torch.bfloat16)
    # every weight once, but of the embedding table only the rows the batch looks up
    assert decode_bytes(m, 1) == 2 * (1 * 16 + 16 * 32 + 32 + 32 * 1000)
    assert decode_bytes(m, 8) == 2 * (8 * 16 + 16 * 32 + 32 + 32 * 1000)
    m.mid.float()  # each in its own dtype
    assert decode_bytes(m, 1) == 2 * 16 + 4 * (16 * 32 + 32) + 2 * 32 * 1000


@pytest.mark.slow
def test_decode_bench_runs_the_weights_users_run(tmp_path):
    from bench.infer_bench import build_model, decode_bytes, main
    from nanochat.checkpoint_manager import weights_dtype_for

    assert weights_dtype_for("cuda", "eval") is torch.bfloat16  # what the bench's default (auto) holds on CUDA
    out = tmp_path / "d.json"
    main(["--depths=2", "--device_type=cpu", "--threads=1", "--prompt_len=16", "--gen_tokens=8", "--repeats=1",
          "--batch_sizes=1,4", "--decode_compile=0", "--skip_server", "--tokenizer=repo_docs", "--weights_dtype=bfloat16",
          "--peak_bandwidth=100", f"--json_out={out}"])
    rows = json.loads(out.read_text())["engine"]
    model = build_model(2, 4096, torch.device("cpu"), "auto", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for r in rows:
        assert r["weights_dtype"] == "bfloat16" and r["bound_bytes"] == decode_bytes(model, r["batch"])
        assert r["bound_bytes"] < 2 * model.num_params()  # not all of wte
        assert r["bound_tps"] == pytest.approx(r["batch"] * 100e9 / r["bound_bytes"])
        assert r["sdpa_kernel"] == "flash" and r["cudagraph_skips"] == 0


def test_decode_bench_measures_the_scheduler_beside_the_engine(tmp_path):
    """--paths=engine,scheduler,scheduler_serial: the Scheduler's rows decode every row of every request to the end
    (no stop tokens), as many decode steps as the Engine's, and are labelled as such (on CPU the default does not
    overlap: both Scheduler paths step one at a time)."""
    from bench.infer_bench import main

    out = tmp_path / "d.json"
    main(["--depths=1", "--device_type=cpu", "--threads=1", "--prompt_len=16", "--gen_tokens=6", "--repeats=1",
          "--batch_sizes=1,3", "--decode_compile=0", "--paths=engine,scheduler,scheduler_serial", "--skip_server",
          "--tokenizer=repo_docs", f"--json_out={out}"])
    rows = json.loads(out.read_text())["engine"]
    assert [(r["decode"], r["batch"]) for r in rows] == [("eager", 1), ("eager", 3), ("scheduler, eager", 1),
                                                         ("scheduler, eager", 3), ("scheduler serial, eager", 1),
                                                         ("scheduler serial, eager", 3)]
    engine_steps = {r["batch"]: r["steps"] for r in rows if r["decode"] == "eager"}
    for r in rows:
        assert r["decode_tps"] > 0 and "error" not in r
        if r["decode"].startswith("scheduler"):  # the prefill's step gives the first token and decodes the second:
            assert r["steps"] == 4 and engine_steps[r["batch"]] == 6  # the 4 steps after it are timed


def test_a_decode_row_that_fails_is_its_row(tmp_path, monkeypatch, capsys):
    from bench import infer_bench

    real = infer_bench.bench_engine

    def bench_engine(engine, tokens, batch, *args):
        if batch == 2:  # as a corrupt inductor cache or a CUDA graph capture error surfaces
            raise ImportError("main.so: file too short")
        return real(engine, tokens, batch, *args)

    monkeypatch.setattr(infer_bench, "bench_engine", bench_engine)
    out = tmp_path / "d.json"
    infer_bench.main(["--depths=1", "--device_type=cpu", "--threads=1", "--prompt_len=16", "--gen_tokens=4",
                      "--repeats=1", "--batch_sizes=1,2,4", "--decode_compile=0", "--skip_server", "--tokenizer=repo_docs",
                      f"--json_out={out}"])
    rows = json.loads(out.read_text())["engine"]
    assert [(r["batch"], r.get("error")) for r in rows] == [(1, None), (2, "ImportError: main.so: file too short"), (4, None)]
    assert "d1 batch 2 eager: failed (ImportError: main.so: file too short)" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# the profile: where a step's time goes


def test_profile_buckets_by_kernel_name():
    from bench.profile_step import bucket

    cases = {
        # CUDA kernels as torch, cuDNN, cuBLAS, FlashAttention and inductor name them
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >": "attention forward",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>": "attention backward",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0": "attention forward",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_1_64x128x128_4x1x1_kernel0_0": "attention backward",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention forward",
        "fmha_cutlassB_bf16_aligned_128x64_k128_sm80": "attention backward",
        "triton_tem_fused_flex_attention_0": "attention forward",
        "triton_tem_fused_flex_attention_backward_1": "attention backward",
        "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT": "matmuls",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_kernel": "matmuls",
        "triton_tem_fused_mm_4": "matmuls",
        "triton_red_fused__log_softmax__to_copy_div_tanh_0": "cross-entropy",
        "triton_poi_fused_nll_loss_backward_nll_loss_forward_2": "cross-entropy",
        "triton_poi_fused_add_mul_rsqrt_3": "the rest",
        "Memcpy DtoD (Device -> Device)": "the rest",
        # CPU operators (eager)
        "aten::mm": "matmuls",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention forward",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention backward",
        "aten::_log_softmax": "cross-entropy",
        "aten::nll_loss_forward": "cross-entropy",
        "aten::mul": "the rest",
        "aten::ones_like": "the rest",
    }
    assert {name: bucket(name) for name in cases} == cases


@pytest.mark.slow
def test_profile_of_two_d4_steps_on_cpu(capsys):
    from bench.profile_step import SHARES
    from bench.train_bench import main

    main(["--depth=4", "--max_seq_len=64", "--device_batch_size=2", "--vocab_size=512", "--steps=1", "--warmup=1",
          "--device_type=cpu", "--compile=0", "--threads=1", "--attn=sdpa", "--profile_steps=2"])
    out = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in out if line.startswith("{")]
    assert [r["status"] for r in records] == ["ok", "profile"]  # the row first (a time limit keeps it), then the trace
    p = records[1]["profile"]
    assert p["steps"] == 2 and p["busy_is"] == "CPU operator self time" and 0 < p["busy_pct_of_wall"] <= 100
    assert list(p["shares"]) == list(SHARES) and sum(p["shares"].values()) == pytest.approx(100)
    for share in ("attention forward", "attention backward", "matmuls", "optimizer", "cross-entropy"):
        assert p["shares"][share] > 0, (share, p)
    # Muon's Newton-Schulz matmuls count as optimizer (the range), the model's as matmuls (the name)
    top = {(name, share) for name, share, _ in p["top"]}
    assert ("aten::mm", "optimizer") in top and ("aten::mm", "matmuls") in top
    line = next(line for line in out if line.startswith("profile attn=sdpa, 2 steps: attention forward "))
    assert "CPU operator self time per step" in line and "largest: aten::mm" in line


# -----------------------------------------------------------------------------
# the table


def rec(attn, tok_s, ran, torch_pick, fp8="off", **extra):
    r = dict(status="ok", device="NVIDIA H100 80GB HBM3", depth=20, batch=32, seq_len=2048, attn=attn.split(" ")[0],
             attn_kernels=attn, fp8=fp8, tok_per_s=tok_s, mfu_pct=50.0, peak_mem_gib=70.0, sdpa_kernel=ran,
             sdpa_torch_kernel=torch_pick, sdpa_torch_order="cudnn > flash > efficient > math > overrideable",
             nonfinite_losses=0, steps_run=7, cudagraph_skips=0)
    return json.dumps({**r, **extra})


def test_speed_table_from_logs(tmp_path, capsys):
    from bench import speed_table

    (tmp_path / "speed_attn.log").write_text("\n".join([
        "| device | ... |",
        rec("sdpa (cudnn > flash > efficient > math)", 150000.0, "cudnn", "cudnn"),
        rec("sdpa_flash (flash)", 136800.0, "flash", "cudnn"),
        json.dumps({"attn": "sdpa", "status": "profile", "device": "NVIDIA H100 80GB HBM3", "depth": 20, "profile": {
            "steps": 2, "wall_ms_per_step": 480.0, "busy_ms_per_step": 470.0, "busy_pct_of_wall": 97.9,
            "busy_is": "CUDA kernel time", "shares": {"attention forward": 10.0, "attention backward": 20.0,
                                                      "matmuls": 50.0, "optimizer": 8.0, "cross-entropy": 5.0,
                                                      "the rest": 7.0},
            "top": [["nvjet_hsh_256x128", "matmuls", 30.0]]}}),
        "attn=flex: failed (AttributeError: boom)",
        json.dumps({"attn": "flex", "status": "failed", "error": "AttributeError: boom"}),
        json.dumps({"attn": "fa3", "status": "skipped", "error": "RuntimeError: --attn=fa3: FlashAttention-3 could not be loaded; or use --attn=sdpa"}),
        "interrupted: 2 of 5 backend(s) finished (sdpa, sdpa_flash), their rows are above"]))
    (tmp_path / "speed_attn.rc").write_text("124\n")
    (tmp_path / "speed_fp8.log").write_text(rec("sdpa (cudnn > flash > efficient > math)", 160000.0, "cudnn", "cudnn",
                                                fp8="tensorwise (auto)", nonfinite_losses=7))
    (tmp_path / "speed_decode.json").write_text(json.dumps({"hardware": "NVIDIA H100 80GB HBM3", "interrupted": True, "engine": [
        dict(depth=20, batch=1, decode="eager", prompt=256, warmup_s=1.0, decode_tps=84.0, bound_tps=3000.0,
             bound_bytes=1.1e9, weights_dtype="bfloat16", sdpa_kernel="flash", cudagraph_skips=0),
        dict(depth=20, batch=1, decode="compiled (CUDA graph)", prompt=256, warmup_s=40.0, decode_tps=1500.0,
             bound_tps=3000.0, bound_bytes=1.1e9, weights_dtype="bfloat16", sdpa_kernel="efficient", cudagraph_skips=2),
        dict(depth=20, batch=8, decode="compiled (CUDA graph)", error="RuntimeError: CUDA graph capture failed")]}))
    (tmp_path / "speed_decode.rc").write_text("124\n")
    (tmp_path / "speed_decode.log").write_text("interrupted: 2 engine row(s) finished, kept in speed_decode.json\n")
    speed_table.main([str(tmp_path)])
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0] == "torch's own SDPA kernel order on this card, after a call: cudnn > flash > efficient > math > overrideable"
    assert lines[2] == "| card | run | tok/s | MFU / bound | peak GiB | ratio | notes |"
    # labels from the kernel each row ran; ratios to the row that ran torch's own pick
    assert ("| train d20 32x2048, attn sdpa (cudnn > flash > efficient > math): ran cudnn (torch's own pick) | 150,000 "
            "| 50.0% | 70.0 | 1.00x of sdpa (cudnn) |  |") in table
    assert "| train d20 32x2048, attn sdpa_flash (flash): ran flash (torch's own order: cudnn) | 136,800 | 50.0% | 70.0 | 0.91x of sdpa (cudnn) |" in table
    assert "previous default" not in table
    assert "| train d20 32x2048, attn=flex | not measured: failed (AttributeError: boom) |" in table
    assert "attn=fa3 | not measured: skipped (RuntimeError: --attn=fa3: FlashAttention-3 could not be loaded" in table
    assert "| train d20 32x2048, attention backends | not measured: hit its time limit (interrupted: 2 of 5 backend(s) finished" in table
    assert ("| where a train d20 step's time goes (attn sdpa, 2 steps under torch.profiler) |  |  |  |  | attention forward "
            "10.0%, attention backward 20.0%, matmuls 50.0%, optimizer 8.0%, cross-entropy 5.0%, the rest 7.0% of 470.0 "
            "ms CUDA kernel time per step (98% of the wall time); largest: nvjet_hsh_256x128 (matmuls) 30.0% |") in table
    assert "FP8 tensorwise (auto), attn sdpa (cudnn > flash > efficient > math): ran cudnn (torch's own pick) | 160,000 | 50.0% (bf16 peak) | 70.0 | 1.07x of bf16 | loss not finite in 7 of 7 steps |" in table
    assert ("| decode d20 batch 1, compiled (CUDA graph), bfloat16 weights, attention efficient (prompt 256, first run "
            "40 s) | 1,500 | bandwidth bound: 50% of 3,000 (1.10 GB a step) |  | 17.86x of eager | 2 cudagraph skip(s) |") in table
    assert "| decode d20 batch 8, compiled (CUDA graph) | not measured: failed (RuntimeError: CUDA graph capture failed) |" in table
    assert ("| decode, the rows after these | not measured: hit its time limit (interrupted: 2 engine row(s) finished, "
            "kept in speed_decode.json) |") in table
    assert all(line.startswith("| NVIDIA H100") for line in lines[4:])  # the card on every row


def test_speed_table_names_what_did_not_run(tmp_path, capsys):
    from bench import speed_table

    (tmp_path / "speed_fp8.log").write_text("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n")
    (tmp_path / "speed_fp8.rc").write_text("124\n")
    speed_table.main([str(tmp_path)])
    table = capsys.readouterr().out
    assert "| ? | train d20, attention backends | not measured: exit code ? (not run (speed_attn.log missing)) |" in table
    assert "FP8 tensorwise (filter auto) | not measured: hit its time limit (torch.OutOfMemoryError: CUDA out of memory)" in table
    assert "| decode d20 batch 1 and 8, eager vs compiled | not measured: exit code ? (not run (speed_decode.log missing)) |" in table
