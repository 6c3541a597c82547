"""
bench/serve_bench.py's repeats (--level_repeats): a level with the baseline runs several times, each time on new
messages, and its speed-up is the median of the per-repeat ratios (the two servers of one repeat ran back to back,
so a slow minute of the machine slows both), not the ratio of two medians taken minutes apart.
"""

import json

import pytest

from bench import serve_bench

pytestmark = pytest.mark.cost(0.5)


def level_row(server, concurrency, repeat, tok_s, ttfts, itls):
    later = ttfts[concurrency:]
    return {"concurrency": concurrency, "server": server, "repeat": repeat, "requests": len(ttfts), "tokens": 100,
            "chunks": len(itls) + 1, "wall_s": 100 / tok_s, "tok_s": tok_s, "busy_tok_s": tok_s * 1.1, "busy_s": 1.0,
            **serve_bench.latency_percentiles(ttfts, later, itls, ttfts), "ttfts": ttfts, "later_ttfts": later,
            "itls": itls, "latencies": ttfts,
            **({"scheduler": {"decode_steps": 10 + repeat, "decode_s": 0.5, "busy_s": 0.8, "decoded_rows": 40,
                              "prefill_forwards": 3, "prefill_chunks": 6, "steps": 12, "prefill_tokens": 90}}
               if server == "batching" else {})}


def three_repeats():
    # the batching server's tok/s per repeat, and the baseline's in the same repeats: ratios 2, 4, 2
    rows = []
    for k, (fast, slow) in enumerate([(300.0, 150.0), (400.0, 100.0), (500.0, 250.0)]):
        rows.append(level_row("batching", 2, k, fast, [0.01 * (k + 1), 0.02, 0.03 + k, 0.04], [0.001 * k, 0.002]))
        rows.append(level_row("one per worker", 2, k, slow, [0.05, 0.06, 0.07, 0.08], [0.003, 0.004]))
    return rows


def test_level_plan_gives_each_repeat_its_own_messages_and_levels_without_the_baseline_one_run():
    args = serve_bench.FLAGS.parse_args(["--concurrency=1,4,16", "--baseline_up_to=4", "--level_repeats=2"])
    plan = serve_bench.level_plan(args, [1, 4, 16])
    assert plan == [(1, 12, [0, 12]), (4, 4, [24, 40]), (16, 4, [56])]
    used = [range(first, first + c * per_client) for c, per_client, firsts in plan for first in firsts]
    numbers = [i for r in used for i in r]
    assert len(numbers) == len(set(numbers)) == 24 + 32 + 64  # no message twice: no prefix-cache hit across repeats
    once = serve_bench.FLAGS.parse_args(["--level_repeats=1"])
    assert serve_bench.level_plan(once, [1, 4]) == [(1, 12, [0]), (4, 4, [12])]


def test_speedup_is_the_median_of_the_repeats_ratios_not_the_ratio_of_medians():
    rows = three_repeats()
    ratios = serve_bench.speedups(rows, "tok_s")[2]
    assert ratios == [2.0, 4.0, 2.0]
    assert serve_bench.describe_speedup(ratios) == "2.00x (2.00-4.00x)"
    medians = {s: serve_bench.merge_repeats([r for r in rows if r["server"] == s])["tok_s"]
               for s in ("batching", "one per worker")}
    assert medians == {"batching": 400.0, "one per worker": 150.0}  # whose ratio, 2.67x, no repeat measured
    assert serve_bench.describe_speedup([3.5]) == "3.50x" and serve_bench.describe_speedup(None) == ""


def test_merged_row_pools_latencies_and_sums_counts():
    repeats = [r for r in three_repeats() if r["server"] == "batching"]
    row = serve_bench.merge_repeats(repeats)
    ttfts = sorted(t for r in repeats for t in r["ttfts"])
    assert row["ttft_p99_s"] == serve_bench.pct(ttfts, 99) == max(ttfts) == 2.03  # the slowest of all 12 requests
    assert row["ttft_p50_s"] == serve_bench.pct(ttfts, 50)
    assert row["itl_p99_s"] == serve_bench.pct([g for r in repeats for g in r["itls"]], 99)
    assert row["requests"] == 12 and row["tokens"] == 300 and row["repeats"] == 3
    assert row["tok_s_repeats"] == [300.0, 400.0, 500.0]
    assert row["scheduler"]["decode_steps"] == 10 + 11 + 12
    assert serve_bench.merge_repeats(repeats[:1]) is repeats[0]


def test_report_prints_the_median_speedup_with_its_range(tmp_path, capsys):
    args = serve_bench.FLAGS.parse_args(["--turns=0", f"--json_out={tmp_path / 'out.json'}"])
    rows = three_repeats()
    serve_bench.report(args, "a test model", rows, [], None, (0.0,) * 3, (0.0,) * 3, tmp_path)
    out = capsys.readouterr().out
    assert "ran 3 times" in out
    line = next(x for x in out.splitlines() if x.startswith("| 2 | batching |"))
    assert "| 400.0 | 2.00x (2.00-4.00x) |" in line
    saved = json.loads((tmp_path / "out.json").read_text())
    assert len(saved["levels"]) == 6 and saved["speedups"]["tok_s"] == {"2": [2.0, 4.0, 2.0]}


def test_report_puts_the_in_process_ratio_beside_the_one_over_http(tmp_path, capsys):
    args = serve_bench.FLAGS.parse_args(["--turns=0"])
    ceilings = {2: {"engine": [100.0, 200.0], "scheduler": [400.0, 500.0], "engine_tokens": [9, 9],
                    "scheduler_tokens": [9, 9]}}
    serve_bench.report(args, "a test model", three_repeats(), [], None, (0.0,) * 3, (0.0,) * 3, tmp_path,
                       ceilings=ceilings)
    line = next(x for x in capsys.readouterr().out.splitlines() if "in process" in x)
    # pass by pass: 400/100 and 500/200, their median 3.25x; over HTTP the repeats' median, 2.00x
    assert "3.25x (2.50-4.00x) (pass by pass), against 2.00x (2.00-4.00x) over HTTP" in line
