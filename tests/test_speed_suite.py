"""
`bash bench/gpu_suite.sh speed` (issue 20's GPU figures): its dry run lists the commands within the 9-minute slot,
and bench/speed_table.py turns the logs into one table that names every missing figure and why. The GPU run itself
needs a GPU; `--cpu` (the same steps at d4) is run by hand (docs/benchmarks.md) since it takes about a minute.
"""

import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_dry_run_prints_the_commands_within_nine_minutes(tmp_path):
    r = subprocess.run(["bash", "bench/gpu_suite.sh", "speed", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PY": "python3"}, timeout=30)
    assert r.returncode == 0, r.stderr
    steps = re.findall(r"^=== (speed_\w+) \(limit (\d+) s\): (.*)$", r.stdout, flags=re.M)
    assert [s[0] for s in steps] == ["speed_attn", "speed_fp8", "speed_decode"]
    assert sum(int(s[1]) for s in steps) <= 540  # the slot is 9 minutes
    assert "--attn=sdpa,sdpa_flash,flex,fa3,fa4" in steps[0][2] and "--depth=20" in steps[0][2]
    assert "--fp8=1" in steps[1][2] and "--fp8_filter=auto" in steps[1][2]
    assert "--batch_sizes=1,8 --decode_compile=0,1" in steps[2][2]
    assert "dry run: nothing ran" in r.stdout and list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_speed_table_from_logs(tmp_path, capsys):
    from bench import speed_table

    def rec(attn, tok_s, fp8="off"):
        return json.dumps(dict(device="NVIDIA H100 80GB HBM3", depth=20, batch=32, seq_len=2048, attn=attn.split(" ")[0],
                               attn_kernels=attn, fp8=fp8,
                               tok_per_s=tok_s, mfu_pct=50.0, peak_mem_gib=70.0))

    (tmp_path / "speed_attn.log").write_text("\n".join([
        "| device | ... |", rec("sdpa (cudnn > flash > efficient > math)", 150000.0), rec("sdpa_flash (flash)", 136800.0),
        "attn=fa3: skipped (RuntimeError: --attn=fa3: FlashAttention-3 could not be loaded; or use --attn=sdpa)"]))
    (tmp_path / "speed_fp8.log").write_text("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n")
    (tmp_path / "speed_fp8.rc").write_text("124\n")
    (tmp_path / "speed_decode.json").write_text(json.dumps({"hardware": "NVIDIA H100 80GB HBM3", "engine": [
        dict(depth=20, batch=1, decode="eager", prompt=256, warmup_s=1.0, decode_tps=84.0, bound_tps=2990.0),
        dict(depth=20, batch=1, decode="compiled (CUDA graph)", prompt=256, warmup_s=40.0, decode_tps=1500.0, bound_tps=2990.0)]}))
    speed_table.main([str(tmp_path)])
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0] == "| card | run | tok/s | MFU / bound | peak GiB | ratio |"
    assert "| train d20 32x2048, attn sdpa (cudnn > flash > efficient > math) | 150,000 | 50.0% | 70.0 | 1.10x of sdpa_flash |" in table
    assert "attn=fa3 | RuntimeError: --attn=fa3: FlashAttention-3 could not be loaded" in table
    assert "FP8 tensorwise (filter auto) | not measured: hit its time limit (torch.OutOfMemoryError: CUDA out of memory)" in table
    assert "| decode d20 batch 1, compiled (CUDA graph) (prompt 256, first run 40 s) | 1,500 | bandwidth bound: 50% of 2,990 |  | 17.86x of eager |" in table
    assert all(line.startswith("| NVIDIA H100") for line in lines[2:])  # the card on every row
