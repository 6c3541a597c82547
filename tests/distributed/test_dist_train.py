"""
Distributed base training on CPU with gloo, launched by torchrun exactly as users launch it:
2 ranks (DistMuon + DistAdamW) == 1 process with the same global batch; FSDP2 with Muon and with AdamW == 1 process;
resume on 2 ranks is exact; two "nodes" (two torchrun launchers, world 4) == 1 process; FSDP checkpoints load in one
process and give the same logits.
"""

import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, free_port, subprocess_env
from ranks import RanksFailed, run_ranks
from nanochat.checkpoint_manager import load_checkpoint
from nanochat.metrics import read_metrics

pytestmark = pytest.mark.dist

TINY = ["--depth=1", "--max_seq_len=64", "--device_batch_size=4", "--eval_every=-1", "--core_metric_every=-1",
        "--sample_every=-1", "--device_type=cpu"]


def records(base_dir, tag):
    return read_metrics(base_dir / "base_checkpoints" / tag / "metrics.jsonl")


def losses(base_dir, tag):
    """The run's training losses (EMA), step by step, from its metrics.jsonl."""
    return [r["train/loss"] for r in records(base_dir, tag) if "train/loss" in r]


def final_params(base_dir, tag, step):
    sd, _, meta = load_checkpoint(str(base_dir / "base_checkpoints" / tag), step, "cpu")
    return sd, meta


def single_process(base_dir, tag, steps, world, extra=()):
    cmd = [sys.executable, "-m", "scripts.base_train", *TINY, f"--total_batch_size={256 * world}",
           f"--num_iterations={steps}", f"--model_tag={tag}", f"--data_world_size={world}", *extra]
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(base_dir), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.fixture(scope="module")
def reference(module_base_dir):
    """One-process runs that several tests compare against, each trained once per module (a training process spends
    seconds importing before its first step): reference(base_dir, tag, steps, world, extra) puts the run with those
    settings into the test's base_dir as `tag`."""
    trained = {}

    def put(base_dir, tag, steps, world, extra=()):
        key = (steps, world, tuple(extra))
        if key not in trained:
            trained[key] = f"ref{len(trained)}"
            single_process(module_base_dir, trained[key], steps, world, extra)
        shutil.copytree(module_base_dir / "base_checkpoints" / trained[key], base_dir / "base_checkpoints" / tag)

    return put


def assert_same_run(base_dir, ref_tag, tag, steps, atol=1e-4):
    ref_l, l = losses(base_dir, ref_tag), losses(base_dir, tag)
    assert len(ref_l) == len(l) == steps
    assert l == pytest.approx(ref_l, abs=atol), (ref_l, l)
    a, _ = final_params(base_dir, ref_tag, steps)
    b, _ = final_params(base_dir, tag, steps)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=atol, rtol=1e-3), (k, (a[k] - b[k]).abs().max())


@pytest.mark.parametrize("use_muon", [1, 0])
def test_ddp_two_ranks_match_one_process(base_dir, reference, use_muon):
    steps = 5
    reference(base_dir, f"ref{use_muon}", steps, 2, [f"--use_muon={use_muon}"])
    run_ranks(["-m", "scripts.base_train", *TINY, "--total_batch_size=512", f"--num_iterations={steps}",
                  f"--model_tag=ddp{use_muon}", f"--use_muon={use_muon}"], env=subprocess_env(base_dir))
    assert_same_run(base_dir, f"ref{use_muon}", f"ddp{use_muon}", steps)
    # one optimizer file per rank: the optimizer state is sharded (ZeRO-2 / DistMuon ownership)
    d = base_dir / "base_checkpoints" / f"ddp{use_muon}"
    assert sorted(f.name for f in d.glob("optim_*")) == [f"optim_{steps:06d}_rank0.pt", f"optim_{steps:06d}_rank1.pt"]


@pytest.mark.parametrize("use_muon", [1, 0])
def test_fsdp_two_ranks_match_one_process(base_dir, reference, use_muon):
    steps = 5
    reference(base_dir, f"ref{use_muon}", steps, 2, [f"--use_muon={use_muon}"])
    run_ranks(["-m", "scripts.base_train", *TINY, "--total_batch_size=512", f"--num_iterations={steps}",
                  f"--model_tag=fsdp{use_muon}", f"--use_muon={use_muon}", "--use_fsdp=1"], env=subprocess_env(base_dir))
    assert_same_run(base_dir, f"ref{use_muon}", f"fsdp{use_muon}", steps)


# The record recipe with its defaults (92d63d4's groups, AdamW arithmetic, Polar Express/NorMuon/cautious decay, best-fit
# rows) on rows of 256 so that the first layer's short window (128) cuts; a 1-step warmup so the 5 steps move the
# weights; the imported corpus of the tiny base dir (base_data/) instead of ClimbMix.
RECORD = ["--recipe=record", "--depth=2", "--head_dim=64", "--max_seq_len=256", "--device_batch_size=2",
          "--warmup_steps=1", "--data=fineweb_edu"]


@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_record_recipe_two_ranks_match_one_process(base_dir, reference, layout):
    """DistAdamW/DistMuon (ddp) and FSDPRecordAdamW/FSDPMuon (fsdp) with the record recipe == one process reading the
    same global batches: the same losses step for step and the same weights (float summation order apart)."""
    steps = 5
    reference(base_dir, "recref", steps, 2, [*RECORD, "--total_batch_size=1024"])
    run_ranks(["-m", "scripts.base_train", *TINY, *RECORD, "--total_batch_size=1024", f"--num_iterations={steps}",
                  f"--model_tag=rec{layout}", *(["--use_fsdp=1"] if layout == "fsdp" else [])],
                 env=subprocess_env(base_dir))
    assert_same_run(base_dir, "recref", f"rec{layout}", steps)
    _, meta = final_params(base_dir, f"rec{layout}", steps)
    assert meta["recipe"] == "record" and meta["model_config"]["window_pattern"] == "SSSL"
    assert [r["train/cropped_fraction"] for r in records(base_dir, f"rec{layout}") if "train/cropped_fraction" in r]


def test_fsdp_deferred_grad_sync_matches_one_process(base_dir):
    """With 2 micro-steps per rank, reduce-scattering once per step gives the same run as syncing every micro-step."""
    steps = 3
    single_process(base_dir, "refacc", steps, 2, ["--total_batch_size=1024"])
    p = run_ranks(["-m", "scripts.base_train", *TINY, "--total_batch_size=1024", f"--num_iterations={steps}",
                      "--model_tag=fsdpacc", "--use_fsdp=1", "--fsdp_defer_grad_sync=1"], env=subprocess_env(base_dir))
    assert "2 accumulation" in p.stdout
    assert_same_run(base_dir, "refacc", "fsdpacc", steps)


RESUME_AT = 3  # the 2-rank run below saves this step and 2 * RESUME_AT
TWO_RANKS = ["-m", "scripts.base_train", *TINY, "--total_batch_size=512", f"--num_iterations={2 * RESUME_AT}",
             f"--save_every={RESUME_AT}"]


@pytest.fixture(scope="module")
def two_rank_run(module_base_dir):
    """A 2-rank DDP run of 2 * RESUME_AT steps, saving step RESUME_AT: resumed on 2 ranks, refused on 1."""
    run_ranks([*TWO_RANKS, "--model_tag=full"], env=subprocess_env(module_base_dir))
    return module_base_dir / "base_checkpoints" / "full"


def test_resume_on_two_ranks_is_exact(base_dir, two_rank_run):
    n = RESUME_AT
    src, dst = base_dir / "base_checkpoints" / "full", base_dir / "base_checkpoints" / "resumed"
    shutil.copytree(two_rank_run, src)
    dst.mkdir()
    for f in src.glob(f"*{n:06d}*"):
        shutil.copy(f, dst / f.name)
    run_ranks([*TWO_RANKS, "--model_tag=resumed", f"--resume_from_step={n}"], env=subprocess_env(base_dir))
    assert losses(base_dir, "resumed") == losses(base_dir, "full")[n:]
    a, _ = final_params(base_dir, "full", 2 * n)
    b, _ = final_params(base_dir, "resumed", 2 * n)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_with_other_world_size_is_refused(base_dir, two_rank_run):
    shutil.copytree(two_rank_run, base_dir / "base_checkpoints" / "w2")
    cmd = [sys.executable, "-m", "scripts.base_train", *TINY, "--total_batch_size=512", f"--num_iterations={4 * RESUME_AT}",
           "--model_tag=w2", f"--resume_from_step={RESUME_AT}"]
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(base_dir), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "saved by 2 rank(s)" in p.stderr


def test_two_nodes_match_one_process(base_dir):
    """Two torchrun launchers (--nnodes=2, node_rank 0/1) on 127.0.0.1, 2 processes each: world 4."""
    steps = 3
    single_process(base_dir, "ref4", steps, 4)
    port = free_port()
    procs = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
               "-m", "scripts.base_train", *TINY, "--total_batch_size=1024", f"--num_iterations={steps}", "--model_tag=nodes"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(base_dir), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rc, out, err in outs:
        assert rc == 0, out[-3000:] + err[-3000:]
    assert "world size: 4" in (outs[0][1] + outs[0][2]).lower()
    assert_same_run(base_dir, "ref4", "nodes", steps)


def test_fsdp_checkpoint_loads_in_one_process(base_dir):
    from nanochat.checkpoint_manager import load_model

    steps = 2
    single_process(base_dir, "refl", steps, 2)
    # evaluation and sampling run during FSDP training too (the weights are sharded DTensors there); step 1 samples
    # right after a training step with no evaluation before it (the root module's weights are still sharded then)
    p = run_ranks(["-m", "scripts.base_train", *TINY, "--total_batch_size=512", f"--num_iterations={steps}",
                      "--model_tag=fsdpl", "--use_fsdp=1", "--eval_every=2", "--eval_tokens=1024", "--sample_every=1"],
                     env=subprocess_env(base_dir))
    assert [r["step"] for r in records(base_dir, "fsdpl") if "val/bpb" in r] == [0, 2]
    assert p.stdout.count("'The capital of France is' ->") == 2  # steps 1 and 2
    m_fsdp, tok, _ = load_model("base", "cpu", "eval", model_tag="fsdpl")
    m_ref, _, _ = load_model("base", "cpu", "eval", model_tag="refl")
    idx = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog", prepend="<|bos|>")])
    with torch.no_grad():
        assert torch.allclose(m_fsdp(idx), m_ref(idx), atol=1e-4)
    # and an FSDP run can start from the single-file (DDP-format) checkpoint: resume refl's step under FSDP
    # is covered by the optimizer-state tests in test_fsdp.py; here the model file format is the contract.
    sd, _ = final_params(base_dir, "fsdpl", steps)
    assert all(isinstance(v, torch.Tensor) and type(v) is torch.Tensor for v in sd.values())


def test_torchrun_failure_summary_names_the_error(base_dir):
    """A rank that stops with an error: torchrun's closing "Root Cause" block (the last thing a cluster log shows)
    carries the error and its traceback (scripts run main under torch's `record`), not "error_file: <N/A>"."""
    for _ in range(2):  # the free port can be taken before torchrun binds it: once more on that only
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "-m", "scripts.base_train", *TINY, "--total_batch_size=300"]
        p = subprocess.run(cmd, env=subprocess_env(base_dir), cwd=REPO, capture_output=True, text=True, timeout=300)
        if "address already in use" not in p.stderr.lower():
            break
    assert p.returncode != 0
    summary = p.stderr[p.stderr.index("Root Cause (first observed failure)"):]
    assert "error_file: <N/A>" not in summary.split("[0]:")[1]  # rank 0 wrote its error file
    assert "error: --total_batch_size=300 is not divisible by" in summary  # a usage error: its one line, no traceback
    assert "Use --total_batch_size=512." in summary and "Traceback" not in summary


def test_every_torchrun_script_runs_main_under_record():
    """The test above shows base_train; every script that can run under torchrun (it ends through compute_cleanup)
    must enter the same way (nanochat.usage.run_main, which runs main under torch's `record` there), or its failures
    go back to "error_file: <N/A>". The training stages end through nanochat/stage.py's Stage.finish."""
    launched = [p for p in sorted((REPO / "scripts").glob("*.py"))
                if "compute_cleanup()" in p.read_text() or "Stage(config" in p.read_text()]
    assert len(launched) >= 7
    missing = [p.name for p in launched if 'if __name__ == "__main__":\n    run_main(main)' not in p.read_text()]
    assert not missing, f"run main as run_main(main) in: {missing}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_cleanup_tears_the_gloo_groups_down(strategy):
    """After compute_cleanup and main's return, no gloo thread is left for interpreter shutdown to tear down (where a
    rank can abort: nanochat.distributed.dist.release_process_groups). Under FSDP2/TP the model holds the groups while main runs,
    so the first line still shows the threads: the probe sees them when they are there."""
    import json

    script = REPO / "tests" / "dist_scripts" / "cleanup_check.py"
    p = run_ranks([str(script), strategy], env=subprocess_env(), timeout=240)
    lines = {d["at"]: d["gloo_threads"] for d in map(json.loads, (line for line in p.stdout.splitlines() if line.startswith("{")))}
    if strategy != "ddp":
        assert "pt_gloo_runloop" in lines["cleanup"]
    assert lines["exit"] == []


def test_failed_torchrun_reports_why_a_rank_died(tmp_path):
    """A rank killed by a signal (as gloo's abort kills one): the failure message the tests print starts with the
    worker's own lines (faulthandler's "Fatal Python error" and where the rank was), not the launcher's traceback."""
    from conftest import worker_errors

    script = tmp_path / "abort_rank1.py"
    script.write_text("import os\n\ndef finish():\n    if os.environ['RANK'] == '1':\n        os.abort()\n\nfinish()\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script)]
    p = subprocess.run(cmd, env=subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    why = worker_errors(p.stderr, p.stdout)
    assert "Fatal Python error: Aborted" in why
    assert 'line 5 in finish' in why and "ChildFailedError" not in why


def test_ranks_stop_together_and_say_why(tmp_path):
    """tests/ranks.py, the launcher of the tests above: a rank that fails takes the waiting rank down at once and the
    failure names its code and its lines; a time limit stops ranks that never finish."""
    script = tmp_path / "rank1_fails.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit('Error: rank 1 gives up')\n"
                      "time.sleep(60)\n")
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"(?s)2 ranks of .*rank1_fails.py failed \(1\).*Error: rank 1 gives up"):
        run_ranks([script], env=subprocess_env())
    assert time.monotonic() - start < 30  # not the 60 s rank 0 would have slept
    with pytest.raises(RanksFailed, match="did not finish within 1s"):
        run_ranks([script, "--unused"], nproc=1, env=subprocess_env(), timeout=1)
    # each rank sees the world as torchrun's workers do; the outputs come back rank by rank
    ok = tmp_path / "world.py"
    ok.write_text("import os\nprint(*(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE')))\n")
    assert run_ranks([ok], nproc=3, env=subprocess_env()).stdout.splitlines() == ["0 0 3 3", "1 1 3 3", "2 2 3 3"]


def test_fsdp_resume_on_a_sample_step_then_trains(base_dir):
    """A resumed FSDP run whose first forward is a sample (the resume step is a multiple of --sample_every) trains on
    as the uninterrupted run: the sampling under inference_mode must not leave FSDP2's lazily allocated unsharded
    parameters as inference tensors (the next backward failed with "Inference tensors cannot be saved for backward").
    One rank is enough to show it; the resumed losses equal the uninterrupted run's."""
    n = 2
    args = ["-m", "scripts.base_train", *TINY, "--total_batch_size=256", f"--num_iterations={2 * n}", f"--save_every={n}",
            "--use_fsdp=1"]
    run_ranks(args + ["--model_tag=full"], nproc=1, env=subprocess_env(base_dir))
    src, dst = base_dir / "base_checkpoints" / "full", base_dir / "base_checkpoints" / "resumed"
    dst.mkdir()
    for f in src.glob(f"*{n:06d}*"):
        shutil.copytree(f, dst / f.name) if f.is_dir() else shutil.copy(f, dst / f.name)
    p = run_ranks(args + ["--model_tag=resumed", f"--resume_from_step={n}", f"--sample_every={n}"], nproc=1,
                     env=subprocess_env(base_dir))
    assert p.stdout.count("'The capital of France is' ->") == 2  # the resume step, then the last step
    assert losses(base_dir, "resumed") == losses(base_dir, "full")[n:]
