"""
CORE: prompt rendering, the centered metric, exact accuracies from a model whose outputs are known, the partial
marking of missing task files, the bundle download (local HTTP server), the real bundle in ../shared/data, DDP, and
the base_eval script end to end.
"""

import functools
import http.server
import json
import math
import os
import textwrap
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from nanochat.core_eval import (centered_accuracy, evaluate_example, evaluate_model, load_core_config,
                                prepare_task_data, render_prompts_lm, render_prompts_mc, render_prompts_schema,
                                resolve_bundle_dir, sample_fewshot)
from nanochat.distributed.dist import DataRanks

ONE = DataRanks(0, 1, 0)  # a single process evaluates every example (ranks are required: TP splits by data rank)

REPO = Path(__file__).resolve().parents[2]
SHARED_CORE = REPO.parent / "shared" / "data" / "core_eval"

# -----------------------------------------------------------------------------
# A model whose outputs we can work out by hand: bytes as tokens, and logits that depend only on the current token.


class ByteTokenizer:
    """One token per UTF-8 byte; BOS = 256."""

    def get_bos_token_id(self):
        return 256

    def encode(self, text, prepend=None):
        if isinstance(text, list):
            return [self.encode(t, prepend) for t in text]
        return ([prepend] if prepend is not None else []) + list(text.encode("utf-8"))

    __call__ = encode


FAVOURED = {"x": "y", "y": "z", "z": "x", "w": " "}  # after the key, the value gets logit 10; every other logit is 0


class BigramModel(torch.nn.Module):
    """
    logits[b, t] = table[ids[b, t]]. Scoring a token that follows:
      - a favoured pair:          loss = log(1 + 256 e^-10) ~= 0.0116  (and it is the argmax)
      - any other char after a key of FAVOURED:  loss = 10 + log(e^10 + 256) - 10 ~= 10.0117
      - anything after a non-key char (uniform row): loss = log(257) ~= 5.549, argmax = token 0
    """

    def __init__(self, max_seq_len=None):
        super().__init__()
        table = torch.zeros(257, 257)
        for a, b in FAVOURED.items():
            table[ord(a), ord(b)] = 10.0
        self.register_buffer("table", table)
        self.max_seq_len = max_seq_len
        self.widths = []

    def forward(self, idx):
        self.widths.append(idx.shape[1])
        return self.table[idx]


def write_bundle(root, tasks, baselines, data):
    """A bundle in nanochat's layout: core.yaml, eval_meta_data.csv, eval_data/<uri>."""
    root.mkdir(parents=True, exist_ok=True)
    lines = ["icl_tasks:"]
    for t in tasks:
        lines += ["-", f"  label: {t['label']}", f"  dataset_uri: {t['uri']}", f"  num_fewshot: [{t['shots']}]",
                  f"  icl_task_type: {t['type']}"]
        if "delim" in t:
            lines.append(f"  continuation_delimiter: {json.dumps(t['delim'])}")
    (root / "core.yaml").write_text("\n".join(lines) + "\n")
    meta = ["Eval Task,Task Category,Task Type,#shots,#datapoints,Random baseline,Centered Metric?,Description"]
    meta += [f"{label},cat,type,0,0,{b},," for label, b in baselines.items()]
    (root / "eval_meta_data.csv").write_text("\n".join(meta) + "\n")
    for uri, items in data.items():
        p = root / "eval_data" / uri
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps(it) + "\n" for it in items))
    return root


# MC: "xyz" after " " scores (5.549 + 0.0116 + 0.0116)/3 ~= 1.86, "abc" scores 5.549: the model always picks "xyz".
MC_ITEMS = [
    {"query": "Q1:", "choices": ["xyz", "abc"], "gold": 0},  # right
    {"query": "Q2:", "choices": ["abc", "xyz"], "gold": 1},  # right
    {"query": "Q3:", "choices": ["xyz", "abc"], "gold": 1},  # wrong
]  # accuracy 2/3
# Schema: the scored span is " yz". After "...x" the space costs 10.01, after "...w" it costs 0.0116: "w" wins.
SCHEMA_ITEMS = [
    {"context_options": ["ab x", "ab w"], "continuation": "yz", "gold": 1},  # right
    {"context_options": ["ab x", "ab w"], "continuation": "yz", "gold": 0},  # wrong
]  # accuracy 1/2
# LM (no delimiter): correct iff every continuation token is the argmax after its predecessor.
LM_ITEMS = [
    {"context": "abx", "continuation": "yzx"},  # x->y, y->z, z->x: right
    {"context": "abx", "continuation": "yzq"},  # z predicts x, not q: wrong
    {"context": "abc", "continuation": "x"},  # c is uniform: predicts token 0: wrong
]  # accuracy 1/3
TASKS = [
    {"label": "mc_task", "uri": "cat/mc.jsonl", "shots": 1, "type": "multiple_choice"},
    {"label": "schema_task", "uri": "cat/schema.jsonl", "shots": 1, "type": "schema"},
    {"label": "lm_task", "uri": "cat/lm.jsonl", "shots": 1, "type": "language_modeling", "delim": ""},
]
BASELINES = {"mc_task": 25, "schema_task": 50, "lm_task": 0, "gone_task": 25}
DATA = {"cat/mc.jsonl": MC_ITEMS, "cat/schema.jsonl": SCHEMA_ITEMS, "cat/lm.jsonl": LM_ITEMS}
# centered: mc (2/3 - .25)/.75 = 5/9, schema (1/2 - 1/2)/(1/2) = 0, lm 1/3; CORE = (5/9 + 0 + 1/3)/3 = 8/27
EXPECTED_ACC = {"mc_task": 2 / 3, "schema_task": 1 / 2, "lm_task": 1 / 3}
EXPECTED_CENTERED = {"mc_task": 5 / 9, "schema_task": 0.0, "lm_task": 1 / 3}
EXPECTED_CORE = 8 / 27


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(tmp_path / "bundle", TASKS, BASELINES, DATA)


# -----------------------------------------------------------------------------


def test_centered_accuracy_arithmetic():
    assert centered_accuracy(0.25, 25) == 0.0
    assert centered_accuracy(1.0, 25) == 1.0
    assert math.isclose(centered_accuracy(0.5, 25), 1 / 3)
    assert math.isclose(centered_accuracy(0.75, 50), 0.5)
    assert math.isclose(centered_accuracy(0.3, 0), 0.3)
    assert math.isclose(centered_accuracy(0.1, 25), -0.2)  # worse than chance is negative


def test_prompt_rendering():
    mc = {"query": "Question: 2+2?", "choices": ["4", "5"], "gold": 0}
    shot = {"query": "Question: 1+1?", "choices": ["3", "2"], "gold": 1}
    assert render_prompts_mc(mc, "\nAnswer: ", [shot]) == [
        "Question: 1+1?\nAnswer: 2\n\nQuestion: 2+2?\nAnswer: 4",
        "Question: 1+1?\nAnswer: 2\n\nQuestion: 2+2?\nAnswer: 5",
    ]
    sc = {"context_options": ["Tom fed the cat because Tom", "Tom fed the cat because the cat"],
          "continuation": "was hungry.", "gold": 1}
    sc_shot = {"context_options": ["A", "B"], "continuation": "c.", "gold": 0}
    assert render_prompts_schema(sc, " ", [sc_shot]) == [
        "A c.\n\nTom fed the cat because Tom was hungry.",
        "A c.\n\nTom fed the cat because the cat was hungry.",
    ]
    lm = {"context": "The capital of France is  ", "continuation": "Paris"}
    lm_shot = {"context": " The capital of Spain is\n", "continuation": "Madrid"}
    assert render_prompts_lm(lm, " ", [lm_shot]) == [
        "The capital of Spain is Madrid\n\nThe capital of France is",
        "The capital of Spain is Madrid\n\nThe capital of France is Paris",
    ]


def test_fewshot_sampling_and_shuffle_follow_nanochat():
    import random

    data = [{"i": i} for i in range(20)]
    for idx in (0, 7, 19):
        shots = sample_fewshot(data, idx, 5)
        assert {"i": idx} not in shots and len(shots) == 5
        # nanochat: random.Random(1234 + idx).sample of the other indices
        others = [i for i in range(20) if i != idx]
        assert [s["i"] for s in shots] == random.Random(1234 + idx).sample(others, 5)
    assert sample_fewshot(data, 3, 0) == []
    shuffled = list(range(20))
    random.Random(1337).shuffle(shuffled)
    assert [d["i"] for d in prepare_task_data(data, 4)] == shuffled[:4]
    assert len(prepare_task_data(data, -1)) == 20


def test_exact_accuracy_with_a_known_model(bundle):
    model, tok = BigramModel(), ByteTokenizer()
    out = evaluate_model(model, tok, "cpu", bundle_dir=str(bundle), ranks=ONE)
    assert out["results"] == pytest.approx(EXPECTED_ACC, abs=1e-9)
    assert out["centered_results"] == pytest.approx(EXPECTED_CENTERED, abs=1e-9)
    assert out["core_metric"] == pytest.approx(EXPECTED_CORE, abs=1e-9)
    assert out["partial"] is False and out["missing"] == [] and out["num_tasks"] == 3


def test_each_example_scores_as_worked_out(bundle):
    model, tok = BigramModel(), ByteTokenizer()
    cfg = {t["label"]: t for t in load_core_config(bundle)}
    assert cfg["lm_task"]["continuation_delimiter"] == "" and cfg["mc_task"]["continuation_delimiter"] == " "
    got = {label: [evaluate_example(i, model, tok, DATA[uri], "cpu", cfg[label]) for i in range(len(DATA[uri]))]
           for label, uri in [("mc_task", "cat/mc.jsonl"), ("schema_task", "cat/schema.jsonl"), ("lm_task", "cat/lm.jsonl")]}
    assert got == {"mc_task": [True, True, False], "schema_task": [True, False], "lm_task": [True, False, False]}
    # all choices of an example go through the model as one batch: one forward per example
    model.widths.clear()
    evaluate_example(0, model, tok, MC_ITEMS, "cpu", cfg["mc_task"])
    assert len(model.widths) == 1


def test_long_sequences_are_cropped_from_the_left(bundle):
    # with a 6-token window the few-shot prefix is cut off; a bigram model's scores do not change
    model, tok = BigramModel(max_seq_len=6), ByteTokenizer()
    out = evaluate_model(model, tok, "cpu", bundle_dir=str(bundle), ranks=ONE)
    assert max(model.widths) <= 6
    assert out["results"] == pytest.approx(EXPECTED_ACC, abs=1e-9)


def test_missing_task_file_makes_core_partial(tmp_path):
    tasks = TASKS + [{"label": "gone_task", "uri": "cat/gone.jsonl", "shots": 0, "type": "multiple_choice"}]
    bundle = write_bundle(tmp_path / "b", tasks, BASELINES, DATA)
    lines = []
    out = evaluate_model(BigramModel(), ByteTokenizer(), "cpu", bundle_dir=str(bundle), log=lines.append, ranks=ONE)
    assert out["partial"] is True and out["missing"] == ["gone_task"]
    assert "gone_task" not in out["results"] and out["num_tasks"] == 3 and out["num_tasks_total"] == 4
    assert out["core_metric"] == pytest.approx(EXPECTED_CORE, abs=1e-9)  # over the tasks that ran, flagged partial
    assert any("gone_task" in l and "missing" in l for l in lines)
    assert any("PARTIAL" in l for l in lines)


def test_fewshot_is_clamped_to_the_data_available(tmp_path):
    tasks = [dict(TASKS[0], shots=10)]
    bundle = write_bundle(tmp_path / "b", tasks, BASELINES, {"cat/mc.jsonl": MC_ITEMS})
    lines = []
    out = evaluate_model(BigramModel(), ByteTokenizer(), "cpu", bundle_dir=str(bundle), log=lines.append, ranks=ONE)
    assert out["results"]["mc_task"] == pytest.approx(2 / 3)
    assert any("using 2-shot instead of 10-shot" in l for l in lines)


def test_max_per_task(bundle):
    model = BigramModel()
    out = evaluate_model(model, ByteTokenizer(), "cpu", max_per_task=1, bundle_dir=str(bundle), ranks=ONE)
    # one example per task, the first after nanochat's Random(1337) shuffle; accuracy is 0 or 1
    assert set(out["results"].values()) <= {0.0, 1.0}
    assert len(model.widths) == 3


def test_bad_bundle_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no core.yaml"):
        resolve_bundle_dir(str(tmp_path))


# -----------------------------------------------------------------------------
# Download


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_dir(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


def test_bundle_download_from_http(http_dir, bundle, tmp_path, monkeypatch):
    root, url, server = http_dir
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    # nanochat's zip layout: a top-level eval_bundle/ folder
    with zipfile.ZipFile(root / "eval_bundle.zip", "w") as zf:
        for f in sorted(bundle.rglob("*")):
            if f.is_file():
                zf.write(f, "eval_bundle/" + str(f.relative_to(bundle)))
    base = tmp_path / "base"
    base.mkdir()
    got = resolve_bundle_dir(base_dir=str(base), url=f"{url}/eval_bundle.zip")
    assert got == base / "eval_bundle"
    for f in bundle.rglob("*"):
        if f.is_file():
            assert (got / f.relative_to(bundle)).read_bytes() == f.read_bytes()
    assert not (base / "eval_bundle.zip").exists() and sorted(os.listdir(base)) == ["eval_bundle"]
    # the second time it is found on disk: no request is made (the server is gone)
    server.shutdown()
    assert resolve_bundle_dir(base_dir=str(base), url=f"{url}/eval_bundle.zip") == got
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    out = evaluate_model(BigramModel(), ByteTokenizer(), "cpu", ranks=ONE)
    assert out["core_metric"] == pytest.approx(EXPECTED_CORE, abs=1e-9)


def test_bundle_download_failures(http_dir, tmp_path, monkeypatch):
    root, url, _ = http_dir
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    base = tmp_path / "base"
    base.mkdir()
    with pytest.raises(FileNotFoundError) as e:
        resolve_bundle_dir(base_dir=str(base), url=f"{url}/absent.zip")
    assert "404" in str(e.value) and str(base / "eval_bundle") in str(e.value)
    with zipfile.ZipFile(root / "wrong.zip", "w") as zf:
        zf.writestr("readme.txt", "not a bundle")
    with pytest.raises(FileNotFoundError, match="does not contain an eval bundle"):
        resolve_bundle_dir(base_dir=str(base), url=f"{url}/wrong.zip")
    (root / "garbage.zip").write_bytes(b"this is no zip")
    with pytest.raises(FileNotFoundError, match="BadZipFile"):
        resolve_bundle_dir(base_dir=str(base), url=f"{url}/garbage.zip")
    assert list(base.iterdir()) == []  # no half bundle, no zip, no staging dir left behind


# -----------------------------------------------------------------------------
# The real bundle in ../shared/data


def test_real_bundle_runs_and_is_partial(monkeypatch):
    if not (SHARED_CORE / "core.yaml").is_file():
        pytest.skip(f"checks the full CORE bundle in {SHARED_CORE}, which is not beside this clone")
    tasks = load_core_config(SHARED_CORE)
    assert len(tasks) == 22
    present = [t for t in tasks if (SHARED_CORE / "eval_data" / t["dataset_uri"]).is_file()]
    expected_missing = [t["label"] for t in tasks if t not in present]
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED_CORE.parent))
    out = evaluate_model(BigramModel(), ByteTokenizer(), "cpu", max_per_task=2, log=None, ranks=ONE)
    assert out["bundle_dir"] == str(SHARED_CORE)
    assert out["missing"] == expected_missing and out["partial"] is bool(expected_missing)
    assert sorted(out["results"]) == sorted(t["label"] for t in present)
    # every accuracy over 2 examples is 0, 1/2 or 1, and centered follows the csv baselines
    for label, acc in out["results"].items():
        assert acc in (0.0, 0.5, 1.0)
    assert math.isclose(out["centered_results"]["arc_easy"], (out["results"]["arc_easy"] - 0.25) / 0.75)
    assert math.isclose(out["centered_results"]["copa"], (out["results"]["copa"] - 0.5) / 0.5)


# -----------------------------------------------------------------------------
# DDP: two ranks split the examples and all-reduce; the result equals one process's.

DIST_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path[:0] = [{tests!r}, {tests!r} + "/unit"]  # conftest, and this file for its models
    from nanochat.common import compute_init, compute_cleanup
    from nanochat.distributed.dist import process_data_ranks
    from nanochat.core_eval import evaluate_model, get_bundle_dir
    from test_core_eval import BigramModel, ByteTokenizer
    ddp, rank, _, world, device = compute_init("cpu")
    model = BigramModel()
    out = evaluate_model(model, ByteTokenizer(), device, bundle_dir={bundle!r}, log=None, ranks=process_data_ranks())
    # no bundle anywhere and a dead download URL: every rank must get the error (nobody hangs at a barrier)
    try:
        get_bundle_dir(url={dead_url!r})
        error = None
    except FileNotFoundError as e:
        error = str(e)
    with open({out!r} + f".{{rank}}", "w") as f:
        json.dump({{"out": out, "forwards": len(model.widths), "world": world, "error": error}}, f)
    compute_cleanup()
""")


@pytest.mark.dist
def test_ddp_matches_single_process(bundle, tmp_path):
    from conftest import free_port, subprocess_env
    from ranks import run_ranks

    script = tmp_path / "dist_core.py"
    result = tmp_path / "result.json"
    dead_url = f"http://127.0.0.1:{free_port()}/eval_bundle.zip"
    script.write_text(DIST_SCRIPT.format(tests=str(REPO / "tests"), bundle=str(bundle), out=str(result), dead_url=dead_url))
    env = subprocess_env(base_dir=tmp_path / "empty_base")
    env.pop("NANOCHAT_DATA_DIR", None)
    run_ranks([str(script)], nproc=2, env=env, timeout=120)
    r0, r1 = (json.loads(Path(f"{result}.{r}").read_text()) for r in (0, 1))
    assert r0["world"] == 2 and r0["out"] == r1["out"]
    assert r0["out"]["results"] == pytest.approx(EXPECTED_ACC, abs=1e-9)
    assert r0["out"]["core_metric"] == pytest.approx(EXPECTED_CORE, abs=1e-9)
    # 3 + 2 + 3 examples split over 2 ranks: 2 + 1 + 2 forwards each (rank 1 pads the odd tasks with a dummy one)
    assert r0["forwards"] == r1["forwards"] == 5
    assert r0["error"] == r1["error"] and dead_url in r0["error"]


# -----------------------------------------------------------------------------
# scripts.base_eval end to end on a tiny checkpoint


def test_base_eval_script(bundle, tmp_path, monkeypatch):
    from chat_fixtures import tiny_model, tiny_tokenizer
    from nanochat.checkpoint_manager import save_checkpoint

    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    tok = tiny_tokenizer()
    tok.save(str(base / "tokenizer"))
    model = tiny_model(tok.get_vocab_size(), depth=1, sequence_len=64)
    meta = {"model_config": {"sequence_len": 64, "vocab_size": tok.get_vocab_size(), "n_layer": 1, "n_head": 1,
                             "n_kv_head": 1, "n_embd": 64}, "step": 7}
    save_checkpoint(str(base / "base_checkpoints" / "d1"), 7, model.state_dict(), None, meta)
    from scripts.base_eval import main

    out = main(["--bundle_dir", str(bundle), "--device_type", "cpu", "--max-per-task", "2"])
    assert out["num_tasks"] == 3 and not out["partial"]
    rows = (base / "base_eval" / "base_model_000007.csv").read_text().splitlines()
    assert rows[0] == "Task,Accuracy,Centered,Note"
    assert [r.split(",")[0] for r in rows[1:]] == ["mc_task", "schema_task", "lm_task", "CORE"]
    assert rows[-1] == f"CORE,,{out['core_metric']:.6f},"
    report = (base / "report" / "base-model-evaluation.md").read_text()
    assert f"- CORE metric: {out['core_metric']:.4f}" in report and "- Model: base_model_000007" in report


def test_base_eval_without_a_model_or_a_bundle_stops_before_loading(tmp_path, monkeypatch):
    """No checkpoint, then no eval bundle anywhere: each is a usage error (nanochat/usage.py) at start-up, naming
    where it looked, and nothing is written (no report section claiming an evaluation)."""
    from chat_fixtures import tiny_model, tiny_tokenizer
    from nanochat.checkpoint_manager import save_checkpoint
    from nanochat.usage import Missing
    from scripts.base_eval import main

    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    import nanochat.core_eval

    dead = f"http://127.0.0.1:{closed_port()}/eval_bundle.zip"
    monkeypatch.setattr(nanochat.core_eval, "EVAL_BUNDLE_URL", dead)
    with pytest.raises(Missing, match="base_checkpoints"):
        main(["--device_type", "cpu"])
    tok = tiny_tokenizer()
    tok.save(str(base / "tokenizer"))
    meta = {"model_config": {"sequence_len": 64, "vocab_size": tok.get_vocab_size(), "n_layer": 1, "n_head": 1,
                             "n_kv_head": 1, "n_embd": 64}, "step": 7}
    save_checkpoint(str(base / "base_checkpoints" / "d1"), 7, tiny_model(tok.get_vocab_size(), depth=1,
                                                                          sequence_len=64).state_dict(), None, meta)
    with pytest.raises(Missing, match="could not find the CORE eval bundle") as e:
        main(["--device_type", "cpu"])
    assert dead in str(e.value)
    assert not (base / "report").exists() and not (base / "base_eval").exists()
    with pytest.raises(FileNotFoundError, match="no core.yaml"):
        main(["--device_type", "cpu", "--bundle_dir", str(tmp_path)])  # a named dir that is wrong is an error


def closed_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
