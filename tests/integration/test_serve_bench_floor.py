"""
bench/serve_bench.py's first-round floor (CPU): each level's first round submitted at once to a scheduler set up as
the batching server's, in a process of its own, without HTTP. What it must get right is which prompts it times (the
ones load_level sends first) and that it reports a time per level of more than one client.
"""

import os

import pytest

pytestmark = pytest.mark.cost(20)


def test_first_round_floor_times_each_levels_first_prompts_submitted_at_once(tmp_path):
    from bench import serve_bench

    flags = ["--depth=2", "--train_steps=0", "--vocab_size=1024", "--sequence_len=256", "--concurrency=1,3,5",
             "--max_batch=8", "--prompt_tokens=8-32", "--max_tokens=4-8"]
    args = serve_bench.FLAGS.parse_args(flags)
    # request r of client k in a repeat of a level sends message first + k * per_client + r (load_level), each
    # repeat its own messages (--level_repeats=3 by default): the floor times r = 0 of the first repeat
    assert serve_bench.level_plan(args, [1, 3, 5]) == [(1, 12, [0, 12, 24]), (3, 4, [36, 48, 60]),
                                                       (5, 4, [72, 92, 112])]
    base = tmp_path / "base"
    base.mkdir()
    serve_bench.write_random_checkpoint(args, base)
    floors = serve_bench.first_round_floors(args, flags, dict(os.environ, NANOCHAT_BASE_DIR=str(base)))
    assert sorted(floors) == [3, 5]  # a lone client has no round to batch
    tokenizer = serve_bench.get_tokenizer(args)  # the same WikiText tokenizer (trained deterministically)
    messages = serve_bench.message_pool(tokenizer, serve_bench.lengths(args.prompt_tokens, 2048, seed=0), seed=0)
    for c, per_client, first in [(3, 4, 36), (5, 4, 72)]:
        rounds = [tokenizer.render_for_completion({"messages": [{"role": "user", "content": messages[first + k * per_client]}]})
                  for k in range(c)]
        assert floors[c]["prompt_tokens"] == sum(map(len, rounds))
        assert 0 < floors[c]["s"] < 60


def test_a_failed_floor_is_said_and_the_report_goes_on(tmp_path, capfd):
    """The floor runs after the levels: if it fails (here no model where it looks), serve_bench says so with the
    error and reports the levels without it, rather than losing them."""
    from bench import serve_bench

    flags = ["--concurrency=1,3", "--depth=2"]
    args = serve_bench.FLAGS.parse_args(flags)
    (tmp_path / "empty").mkdir()
    assert serve_bench.first_round_floors(args, flags, dict(os.environ, NANOCHAT_BASE_DIR=str(tmp_path / "empty"))) == {}
    err = capfd.readouterr().err
    assert "the first-round floor failed" in err and "Traceback" in err


def test_in_process_ceiling_computes_each_levels_first_repeat_on_both_paths(tmp_path):
    """The in-process ceiling (CPU): each level with the baseline and more than one client, its first repeat's
    requests computed without HTTP as the Engine computes them one at a time and as the batching server's scheduler
    computes them for closed-loop clients, each path in processes of its own, twice. Both paths must generate every
    request of the level: a random-init model rarely says <|assistant_end|>, so a path's tokens are the level's
    max_tokens summed (the same sum on both paths, in both passes)."""
    from bench import serve_bench

    flags = ["--depth=2", "--train_steps=0", "--vocab_size=1024", "--sequence_len=256", "--concurrency=1,3,5",
             "--baseline_up_to=3", "--max_batch=8", "--prompt_tokens=8-32", "--max_tokens=4-8"]
    args = serve_bench.FLAGS.parse_args(flags)
    base = tmp_path / "base"
    base.mkdir()
    serve_bench.write_random_checkpoint(args, base)
    ceilings = serve_bench.in_process_ceilings(args, flags, dict(os.environ, NANOCHAT_BASE_DIR=str(base)))
    assert sorted(ceilings) == [3]  # a lone client is not batched; 5 clients have no baseline here
    (c, per_client, firsts), = [p for p in serve_bench.level_plan(args, [1, 3, 5]) if p[0] == 3]
    max_tokens = serve_bench.lengths(args.max_tokens, 2048, seed=2)
    most = sum(max_tokens[(firsts[0] + k) % len(max_tokens)] for k in range(c * per_client))
    level = ceilings[3]
    assert len(level["engine"]) == len(level["scheduler"]) == 2 and min(level["engine"] + level["scheduler"]) > 0
    assert set(level["engine_tokens"]) == set(level["scheduler_tokens"]) == {most}
