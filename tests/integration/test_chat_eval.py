"""
nanochat/chat_eval (and the scripts/chat_eval command): ChatCORE arithmetic, the categorical path (letter logits at the answer position) with a model whose
choice we control, the generative path through the real Engine with a scripted model, a tiny random GPT, and the
whole script on a tiny checkpoint with one task's data missing (ChatCORE partial, named in the report).
"""

import json
import math
import socket
from pathlib import Path

import pytest
import torch

from chat_fixtures import ScriptedModel, tiny_model, tiny_tokenizer
from nanochat.chat_eval import BASELINES, TASK_NAMES, chatcore, evaluate_task, run_categorical_eval, run_generative_eval
from nanochat.distributed.dist import DataRanks
from tasks.suites import build_eval_task_on_every_rank

ONE = DataRanks(0, 1, 0)  # a single process evaluates every example (ranks are required: TP splits by data rank)

# excerpts of the real data sets in ../shared/data, same layout (tests/assets/README.md): every clone has them
SHARED = Path(__file__).resolve().parents[1] / "assets" / "data"


def shared(*parts):
    path = SHARED.joinpath(*parts)
    assert path.exists(), f"{path} is missing from tests/assets (rebuild it: python tests/assets/make_assets.py)"
    return path


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_chatcore_arithmetic():
    score, centered = chatcore({"ARC-Easy": 0.5, "MMLU": 0.25, "GSM8K": 0.1})
    assert math.isclose(centered["ARC-Easy"], (0.5 - 0.25) / 0.75)
    assert centered["MMLU"] == 0.0 and math.isclose(centered["GSM8K"], 0.1)
    assert math.isclose(score, (1 / 3 + 0.0 + 0.1) / 3)
    assert BASELINES == {"ARC-Easy": 0.25, "ARC-Challenge": 0.25, "MMLU": 0.25, "GSM8K": 0.0, "HumanEval": 0.0,
                         "SpellingBee": 0.0}
    perfect, _ = chatcore({name: 1.0 for name in TASK_NAMES})
    assert perfect == 1.0


class LetterModel(torch.nn.Module):
    """
    At a position holding <|assistant_start|> it prefers `answer`; everywhere else `decoy`. It also puts a huge
    logit on a token that is not a letter (`distractor`) everywhere, which letter restriction must ignore.
    """

    def __init__(self, tokenizer, answer, decoy, distractor):
        super().__init__()
        self.vocab = tokenizer.get_vocab_size()
        self.assistant_start = tokenizer.encode_special("<|assistant_start|>")
        self.answer, self.decoy, self.distractor = answer, decoy, distractor
        self.batch_shapes = []

    def get_device(self):
        return torch.device("cpu")

    def forward(self, idx):
        self.batch_shapes.append(tuple(idx.shape))
        logits = torch.zeros(idx.shape[0], idx.shape[1], self.vocab)
        logits[:, :, self.distractor] = 100.0
        at_answer = idx == self.assistant_start
        logits[..., self.answer] = torch.where(at_answer, 5.0, 0.0)
        logits[..., self.decoy] = torch.where(at_answer, 0.0, 5.0)
        return logits


def test_categorical_counts_with_a_controlled_model(monkeypatch):
    from tasks.arc import ARC

    path = shared("arc", "ARC-Easy-test.jsonl")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    tok = tiny_tokenizer()
    a, b = tok.encode("A"), tok.encode("B")
    assert len(a) == len(b) == 1
    model = LetterModel(tok, answer=a[0], decoy=b[0], distractor=tok.encode("the")[0])
    n = 10
    with open(path) as f:
        keys = [json.loads(next(f))["answerKey"] for _ in range(n)]
    expected = sum(k == "A" for k in keys) / n  # the model always answers A, read at the right position
    assert 0 < expected < 1
    acc = run_categorical_eval(ARC("ARC-Easy", "test"), tok, model, batch_size=3, max_problems=n, ranks=ONE)
    assert acc == expected
    assert [s[0] for s in model.batch_shapes] == [3, 3, 3, 1]  # batches of 3 (right-padded), then the rest
    # through the dispatcher and the ChatCORE task table, as chat_sft uses them
    task = build_eval_task_on_every_rank("ARC-Easy")
    assert evaluate_task(task, model, tok, engine=None, batch_size=4, max_problems=n, ranks=ONE) == expected
    # a model that sees only 24 positions gets the prompts' ends: the answer position is still the last one
    model.rotary_seq_len = 24
    model.batch_shapes.clear()
    assert run_categorical_eval(ARC("ARC-Easy", "test"), tok, model, batch_size=5, max_problems=n, ranks=ONE) == expected
    assert model.batch_shapes == [(5, 24), (5, 24)]


def test_categorical_runs_on_a_tiny_random_gpt(monkeypatch):
    from tasks.mmlu import MMLU

    shared("mmlu", "dev")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    tok = tiny_tokenizer()
    model = tiny_model(tok.get_vocab_size(), depth=1, sequence_len=128)
    n = 8
    acc = run_categorical_eval(MMLU("all", "dev"), tok, model, batch_size=4, max_problems=n, ranks=ONE)
    assert 0.0 <= acc <= 1.0 and (acc * n) == int(acc * n)


def test_generative_counts_through_the_engine(monkeypatch):
    """A scripted model always writes '#### 1': exactly the SpellingBee problems whose count is 1 are solved."""
    from nanochat.engine import Engine
    from tasks.spellingbee import SpellingBee

    shared("words", "words_alpha.txt")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    tok = tiny_tokenizer()
    script = tok.encode("#### 1") + [tok.encode_special("<|assistant_end|>")]
    model = ScriptedModel(tok.get_vocab_size(), script, filler=tok.encode_special("<|assistant_end|>"))
    task = SpellingBee(size=30, split="test")
    expected = sum(task[i]["word"].count(task[i]["letter"]) == 1 for i in range(30)) / 30
    assert 0 < expected < 1
    acc = run_generative_eval(task, tok, model, Engine(model, tok), num_samples=1, max_new_tokens=16,
                              temperature=0.0, top_k=50, ranks=ONE)
    assert acc == expected
    # a completion is graded on the generated text only: the prompt (which holds the word) is cut off
    assert acc == evaluate_task(task, model, tok, Engine(model, tok), max_new_tokens=16, ranks=ONE)
    # prompts with no room left to answer count as failures, without calling the model
    small = ScriptedModel(tok.get_vocab_size(), script, filler=script[-1], max_positions=8)
    assert run_generative_eval(task, tok, small, Engine(small, tok), 1, 16, 0.0, 50, max_problems=5, ranks=ONE) == 0.0
    assert small.fed == []


def test_generative_runs_on_a_tiny_random_gpt(monkeypatch):
    from nanochat.engine import Engine
    from tasks.gsm8k import GSM8K

    shared("gsm8k", "test.jsonl")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    tok = tiny_tokenizer()
    model = tiny_model(tok.get_vocab_size(), depth=1, sequence_len=128)
    acc = run_generative_eval(GSM8K("main", "test"), tok, model, Engine(model, tok), num_samples=2,
                              max_new_tokens=4, temperature=1.0, top_k=20, max_problems=2, ranks=ONE)
    assert acc in (0.0, 0.5, 1.0)


@pytest.mark.slow  # the whole script on a checkpoint
def test_chat_eval_script_with_a_missing_task(tmp_path, monkeypatch):
    """-a all on a tiny SFT checkpoint; the word list is nowhere: SpellingBee is skipped by name, ChatCORE partial."""
    import tasks.spellingbee
    from nanochat.checkpoint_manager import save_checkpoint
    from scripts.chat_eval import main

    for sub in ("arc", "mmlu", "gsm8k", "humaneval"):
        shared(sub)
    data = tmp_path / "data"
    data.mkdir()
    for sub in ("arc", "mmlu", "gsm8k", "humaneval"):
        (data / sub).symlink_to(SHARED / sub)
    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(data))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    dead_url = f"http://127.0.0.1:{closed_port()}/words_alpha.txt"
    monkeypatch.setattr(tasks.spellingbee, "WORDS_URL", dead_url)

    tok = tiny_tokenizer()
    tok.save(str(base / "tokenizer"))
    model = tiny_model(tok.get_vocab_size(), depth=1, sequence_len=128)
    cfg = {"sequence_len": 128, "vocab_size": tok.get_vocab_size(), "n_layer": 1, "n_head": 1, "n_kv_head": 1,
           "n_embd": 64}
    save_checkpoint(str(base / "chatsft_checkpoints" / "d1"), 3, model.state_dict(), None,
                    {"model_config": cfg, "step": 3})

    out = main(["-i", "sft", "-a", "all", "-x", "2", "-m", "4", "-b", "2", "--device_type", "cpu"])
    assert sorted(out["results"]) == sorted(set(TASK_NAMES) - {"SpellingBee"})
    for acc in out["results"].values():
        assert acc in (0.0, 0.5, 1.0)
    assert list(out["missing"]) == ["SpellingBee"] and dead_url in out["missing"]["SpellingBee"]
    score, _ = chatcore(out["results"])
    assert out["ChatCORE metric"] == f"{score:.4f} (partial: 5/6 tasks)"
    report = (base / "report" / "chat-evaluation-sft.md").read_text()
    assert f"- ChatCORE metric: {score:.4f} (partial: 5/6 tasks)" in report
    assert "SpellingBee" in report and dead_url in report
    for name, acc in out["results"].items():
        assert f"- {name}: {acc:.4f}" in report

    # asking for a subset reports no ChatCORE at all
    out = main(["-i", "sft", "-a", "ARC-Easy", "-x", "2", "--device_type", "cpu"])
    assert list(out["results"]) == ["ARC-Easy"] and "ChatCORE metric" not in out


DIST_SCRIPT = """
import json, sys
sys.path[:0] = [{tests!r}, {tests!r} + "/integration"]  # chat_fixtures, and this file for LetterModel
from nanochat.common import compute_init, compute_cleanup
from nanochat.distributed.dist import process_data_ranks
from nanochat.engine import Engine
from nanochat.tokenizer import RustBPETokenizer
from chat_fixtures import ScriptedModel
from test_chat_eval import LetterModel
from nanochat.chat_eval import run_categorical_eval, run_generative_eval
from tasks.arc import ARC
from tasks.spellingbee import SpellingBee
ddp, rank, _, world, device = compute_init("cpu")
tok = RustBPETokenizer.from_directory({tokdir!r})
model = LetterModel(tok, answer=tok.encode("A")[0], decoy=tok.encode("B")[0], distractor=tok.encode("the")[0])
cat = run_categorical_eval(ARC("ARC-Easy", "test", data_dir={data!r}), tok, model, batch_size=2, max_problems=11, ranks=process_data_ranks())
script = tok.encode("#### 1") + [tok.encode_special("<|assistant_end|>")]
scripted = ScriptedModel(tok.get_vocab_size(), script, filler=script[-1])
task = SpellingBee(size=30, split="test", data_dir={data!r})
gen = run_generative_eval(task, tok, scripted, Engine(scripted, tok), 1, 16, 0.0, 50, max_problems=13, ranks=process_data_ranks())
with open({out!r} + f".{{rank}}", "w") as f:
    json.dump({{"world": world, "cat": cat, "gen": gen, "seen": sum(s[0] for s in model.batch_shapes)}}, f)
compute_cleanup()
"""


@pytest.mark.dist
def test_ddp_splits_problems_and_all_reduces(tmp_path):
    """Two ranks: each sees its share of the problems, and both report the single-process accuracy."""
    from conftest import subprocess_env
    from ranks import run_ranks
    from tasks.spellingbee import SpellingBee

    arc = shared("arc", "ARC-Easy-test.jsonl")
    shared("words", "words_alpha.txt")
    tok = tiny_tokenizer()
    tok.save(str(tmp_path / "tok"))
    with open(arc) as f:
        keys = [json.loads(next(f))["answerKey"] for _ in range(11)]
    task = SpellingBee(size=30, split="test", data_dir=str(SHARED))
    expected_gen = sum(task[i]["word"].count(task[i]["letter"]) == 1 for i in range(13)) / 13
    script = tmp_path / "dist_chat_eval.py"
    out = tmp_path / "out.json"
    script.write_text(DIST_SCRIPT.format(tests=str(Path(__file__).parent.parent), tokdir=str(tmp_path / "tok"),
                                         data=str(SHARED), out=str(out)))
    run_ranks([str(script)], nproc=2, env=subprocess_env(), timeout=180)
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert r0["cat"] == r1["cat"] == sum(k == "A" for k in keys) / 11
    assert r0["gen"] == r1["gen"] == expected_gen
    assert (r0["seen"], r1["seen"]) == (6, 5)  # 11 problems strided over 2 ranks


MISSING_ON_ONE_RANK_SCRIPT = """
import json, os, sys
os.environ["NANOCHAT_DATA_DIR"] = {dirs!r}[int(os.environ["RANK"])]  # rank 1's data dir lacks ARC-Easy
sys.path.insert(0, {tests!r})
from nanochat.common import compute_init
from nanochat.data.conversations import sft_batches
from nanochat.tokenizer import RustBPETokenizer
from scripts.chat_eval import main
from tasks.arc import ARC
from tasks.suites import build_mixture
ddp, rank, _, world, device = compute_init("cpu")
out = {{"world": world}}
mixture, out["used"] = build_mixture([("ARC-Easy", lambda: ARC("ARC-Easy", "test")),
                                      ("ARC-Challenge", lambda: ARC("ARC-Challenge", "test"))], "dist test")
out["mixture"] = len(mixture)
# rank 1's only conversation is cut before its assistant turn: nothing to train there, an error on every rank
tok = RustBPETokenizer.from_directory({tokdir!r})
short = {{"messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": "hello"}}]}}
long = {{"messages": [{{"role": "user", "content": "word " * 200}}, {{"role": "assistant", "content": "ok"}}]}}
try:
    next(sft_batches([short, long], tok, B=1, rank=rank, world_size=world, max_tokens=32))
    out["sft"] = "no error"
except Exception as e:
    out["sft"] = f"{{type(e).__name__}}: {{e}}"
res = main(["-i", "sft", "-a", "ARC-Easy|ARC-Challenge", "-x", "6", "-b", "2", "--device_type", "cpu"])
out["results"], out["missing"] = res["results"], res["missing"]
with open({out!r} + f".{{rank}}", "w") as f:
    json.dump(out, f)
"""


@pytest.mark.dist
def test_ddp_ranks_agree_on_a_task_one_rank_lacks(tmp_path):
    """
    Two ranks, rank 1's data dir lacks ARC-Easy (and the hub is unreachable): build_mixture and chat_eval leave
    ARC-Easy out on both ranks, naming rank 1 and where it looked; the run completes with ARC-Challenge summed over
    both ranks. An SFT share with nothing to train on one rank raises on both instead of hanging.
    """
    from conftest import subprocess_env
    from ranks import run_ranks
    from nanochat.checkpoint_manager import save_checkpoint

    arc = shared("arc")
    dirs = [tmp_path / "data0", tmp_path / "data1"]
    dirs[0].mkdir()
    (dirs[0] / "arc").symlink_to(arc)
    (dirs[1] / "arc").mkdir(parents=True)
    (dirs[1] / "arc" / "ARC-Challenge-test.jsonl").symlink_to(arc / "ARC-Challenge-test.jsonl")
    base = tmp_path / "base"
    tok = tiny_tokenizer()
    tok.save(str(base / "tokenizer"))
    model = tiny_model(tok.get_vocab_size(), depth=1, sequence_len=128)
    cfg = {"sequence_len": 128, "vocab_size": tok.get_vocab_size(), "n_layer": 1, "n_head": 1, "n_kv_head": 1,
           "n_embd": 64}
    save_checkpoint(str(base / "chatsft_checkpoints" / "d1"), 3, model.state_dict(), None,
                    {"model_config": cfg, "step": 3})
    script = tmp_path / "dist_missing.py"
    out = tmp_path / "out.json"
    script.write_text(MISSING_ON_ONE_RANK_SCRIPT.format(dirs=[str(d) for d in dirs], tests=str(Path(__file__).parent.parent),
                                                        tokdir=str(base / "tokenizer"), out=str(out)))
    env = subprocess_env(base, HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("NANOCHAT_DATA_DIR", None)
    p = run_ranks([str(script)], nproc=2, env=env, timeout=180)
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert r0["used"] == r1["used"] == ["ARC-Challenge"] and r0["mixture"] == r1["mixture"] > 0
    assert "leaving out ARC-Easy" in p.stdout and "rank(s) 1" in p.stdout
    assert r1["sft"].startswith("ValueError: no conversation of this rank's share")
    assert r0["sft"].startswith("RuntimeError: making the SFT batches failed on rank 1: ValueError: no conversation")
    assert list(r0["results"]) == list(r1["results"]) == ["ARC-Challenge"]
    assert r0["results"] == r1["results"] and r0["results"]["ARC-Challenge"] in {k / 6 for k in range(7)}
    assert list(r0["missing"]) == list(r1["missing"]) == ["ARC-Easy"]
    for missing in (r0["missing"], r1["missing"]):
        assert "rank 1: " in missing["ARC-Easy"] and "ARC-Easy-test.jsonl" in missing["ARC-Easy"]
        assert "rank 0" not in missing["ARC-Easy"]
    report = (base / "report" / "chat-evaluation-sft.md").read_text()
    assert "ARC-Easy" in report and "rank 1: " in report


def test_batched_generative_eval_gives_the_answers_of_one_problem_at_a_time(monkeypatch):
    """-b 8 on a generative task: the problems decode together through the scheduler, and at temperature 0 every
    completion (so the accuracy) is the one the Engine gives one problem at a time."""
    from nanochat.engine import Engine
    from tasks.gsm8k import GSM8K

    shared("gsm8k", "test.jsonl")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    tok = tiny_tokenizer()
    model = tiny_model(tok.get_vocab_size(), depth=2, sequence_len=512, seed=5)
    task = GSM8K("main", "test")
    seen = {}
    real = task.evaluate

    def recording(conv, completion):
        seen.setdefault(conv["messages"][0]["content"], []).append(completion)
        return real(conv, completion) or len(completion) % 3 == 0  # a varied pass/fail pattern to compare

    monkeypatch.setattr(task, "evaluate", recording)
    one = run_generative_eval(task, tok, model, Engine(model, tok), 1, 20, 0.0, 50, max_problems=10, ranks=ONE, batch_size=1)
    by_engine, seen = seen, {}
    batched = run_generative_eval(task, tok, model, Engine(model, tok), 1, 20, 0.0, 50, max_problems=10, ranks=ONE, batch_size=8)
    assert seen == by_engine and len(seen) == 10
    assert batched == one and 0 < one < 1
