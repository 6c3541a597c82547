"""
bench/host_bench.py: the chat server's host ceiling (the real app and scheduler serving a model that costs nothing).
Its figures are only as good as its accounting, so a small run checks it: every reply runs to its max_tokens (the
free model never stops early), the server reports exactly those tokens, and the CPU time per token comes from the
server's own threads.
"""

import json

import pytest

pytestmark = pytest.mark.cost(15)


def test_host_bench_serves_every_requested_token_and_reports_the_servers_cpu(tmp_path):
    from bench.host_bench import main
    from bench.serve_bench import lengths

    out = tmp_path / "host.json"
    main(["--concurrency=4", "--requests=8", "--prompt_tokens=8-32", "--max_tokens=4-12", "--layers=2",
          "--max_batch=8", "--max_context=256", f"--json_out={out}"])
    level = json.loads(out.read_text())["levels"][0]
    assert level["concurrency"] == 4 and level["requests"] == 8
    assert level["tokens"] == sum(lengths("4-12", 4096, seed=2)[:8])  # requests 0..7, each to its max_tokens
    assert level["chunks"] >= level["requests"] and level["tokens_per_chunk"] >= 1
    assert level["event_loop_cpu_s"] > 0 and level["event_loop_us_per_token"] > 0 and level["other_cpu_s"] >= 0
