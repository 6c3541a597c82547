"""
nanochat/tokenizer.py (rustbpe training, tiktoken inference, chat rendering, token bytes) and the
tok_train / tok_eval scripts end to end.
"""

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

rustbpe = pytest.importorskip("rustbpe", reason="the rustbpe extension is not built: run `pip install -e .`")

from nanochat.tokenizer import (  # noqa: E402
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    RustBPETokenizer,
    compute_token_bytes,
    get_token_bytes,
    get_tokenizer,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_bpe  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WIKITEXT = REPO / "tests" / "assets" / "data" / "pretrain" / "wikitext-2"  # excerpt of ../shared (tests/assets)
needs_wikitext = pytest.mark.skipif(not WIKITEXT.is_dir(), reason=f"WikiText-2 not found at {WIKITEXT}")

VOCAB = 1024
MULTIBYTE = "日本語のテキストと中文文本。Ελληνικά, русский, emoji 🚀🚀🔥 — naïve café. " * 20


def wikitext_docs(max_chars):
    text = (WIKITEXT / "train.txt").read_text(encoding="utf-8")[:max_chars]
    return [d for d in text.split("\n") if d.strip()]


@pytest.fixture(scope="module")
def trained():
    """(tokenizer, the rustbpe tokenizer trained on the same texts, the texts)"""
    if not WIKITEXT.is_dir():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT}")
    docs = wikitext_docs(400_000) + [MULTIBYTE] * 3
    tok = RustBPETokenizer.train_from_iterator(iter(docs), VOCAB)
    raw = rustbpe.Tokenizer()
    raw.train_from_iterator(docs, VOCAB - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    return tok, raw, docs


# ---------------------------------------------------------------------------------------------------
# training, special tokens, encode/decode


def test_vocab_and_special_tokens(trained):
    tok, raw, _ = trained
    assert tok.get_vocab_size() == VOCAB
    assert tok.get_special_tokens() == set(SPECIAL_TOKENS)
    n = VOCAB - len(SPECIAL_TOKENS)
    # the specials come right after the merges, in SPECIAL_TOKENS order
    assert [tok.encode_special(s) for s in SPECIAL_TOKENS] == list(range(n, VOCAB))
    assert tok.get_bos_token_id() == n
    assert [tok.id_to_token(i) for i in range(n, VOCAB)] == SPECIAL_TOKENS
    assert tok.enc._pat_str == SPLIT_PATTERN == raw.get_pattern()
    with pytest.raises(ValueError, match="not a special token"):
        tok.encode_special("<|nope|>")


def test_tiktoken_inference_matches_rustbpe(trained):
    tok, raw, _ = trained
    # the same training, run directly, gives the same ranks (training is deterministic)
    assert {bytes(b): r for b, r in raw.get_mergeable_ranks()} == tok.enc._mergeable_ranks
    valid = (WIKITEXT / "valid.txt").read_text(encoding="utf-8").split("\n")
    texts = valid + [MULTIBYTE, "unseen: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u00a0\u3000 x" + " " * 30 + "y\r\n\r\n"]
    assert tok.encode(texts) == raw.batch_encode(texts)
    assert tok.encode(MULTIBYTE) == raw.encode(MULTIBYTE)


def test_encode_decode_round_trip_and_options(trained):
    tok, _, _ = trained
    text = "Hello, world! 12345 — naïve 🚀\n\n  indented\ttab"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok(text) == ids
    bos = tok.get_bos_token_id()
    end = tok.encode_special("<|assistant_end|>")
    assert tok.encode(text, prepend="<|bos|>") == [bos] + ids
    assert tok.encode(text, prepend=bos, append=end) == [bos] + ids + [end]
    assert tok.encode(text, append="<|assistant_end|>") == ids + [end]
    batch = tok.encode([text, "", "b"], prepend="<|bos|>", num_threads=2)
    assert batch == [[bos] + ids, [bos], [bos] + tok.encode("b")]
    # special-token strings inside text are ordinary text, never the special id
    inner = tok.encode("<|bos|> <|user_start|>")
    assert bos not in inner and tok.decode(inner) == "<|bos|> <|user_start|>"
    with pytest.raises(TypeError):
        tok.encode(123)
    with pytest.raises(TypeError, match="item 1"):
        tok.encode(["a", 5])
    with pytest.raises(ValueError, match="not a special token"):
        tok.encode("x", prepend="<|begin|>")


def test_train_rejects_too_small_vocab():
    with pytest.raises(ValueError, match="at least 265"):
        RustBPETokenizer.train_from_iterator(iter(["abc"]), 264)


def test_save_and_from_directory(trained, tmp_path):
    tok, _, _ = trained
    path = tok.save(str(tmp_path / "tok"))
    assert os.path.basename(path) == "tokenizer.pkl"
    assert sorted(os.listdir(tmp_path / "tok")) == ["tokenizer.pkl"]  # no temp file left behind
    with open(path, "rb") as f:
        assert isinstance(pickle.load(f), type(tok.enc))
    loaded = RustBPETokenizer.from_directory(str(tmp_path / "tok"))
    texts = [MULTIBYTE, "some text 42", ""]
    assert loaded.encode(texts) == tok.encode(texts)
    assert loaded.get_vocab_size() == VOCAB and loaded.get_bos_token_id() == tok.get_bos_token_id()
    with pytest.raises(FileNotFoundError, match="tok_train"):
        RustBPETokenizer.from_directory(str(tmp_path / "missing"))


@pytest.mark.parametrize("how, why", [
    ("truncated", r"is truncated or not a pickled tokenizer \([\d,]+ bytes\) \(UnpicklingError"),
    ("empty", r"is empty \(0 bytes\) \(EOFError"),
    ("garbage", r"is truncated or not a pickled tokenizer"),
    ("json", r"is truncated or not a pickled tokenizer"),
    ("other_object", r"does not hold a tiktoken.Encoding \(got dict\)"),
])
def test_damaged_tokenizer_pkl_is_named_with_the_fix(trained, tmp_path, how, why):
    tok, _, _ = trained
    path = tmp_path / "tokenizer.pkl"
    tok.save(str(tmp_path))
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"\xcd\x01" * 500,
                      "json": b'{"not": "a pickle"}', "other_object": pickle.dumps({"a": 1})}[how])
    with pytest.raises(ValueError, match=re.escape(str(path)) + " " + why + r".*restore it from a copy.*scripts\.tok_train"):
        RustBPETokenizer.from_directory(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# token bytes


def test_token_bytes_exact_on_multibyte_text(trained):
    tok, raw, _ = trained
    token_bytes = compute_token_bytes(tok)
    assert token_bytes.dtype == torch.int32 and token_bytes.shape == (VOCAB,)
    # independent: byte strings rebuilt from the merges by the reference code
    expected = [len(b) for b in reference_bpe.token_bytes(raw.get_merges())] + [0] * len(SPECIAL_TOKENS)
    assert token_bytes.tolist() == expected
    # multi-byte chars were merged into tokens, including pieces that cut a char (not valid UTF-8 alone)
    pieces = reference_bpe.token_bytes(raw.get_merges())[256:]
    assert any(_utf8(p) and any(ord(ch) > 0x7F for ch in p.decode("utf-8")) for p in pieces)  # whole chars
    assert any(not _utf8(p) for p in pieces)  # part of a char
    # the bytes of a text's tokens add up to its UTF-8 length, not its character count
    ids = tok.encode(MULTIBYTE, prepend="<|bos|>")
    assert int(token_bytes[ids].sum()) == len(MULTIBYTE.encode("utf-8")) > len(MULTIBYTE)


def _utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ---------------------------------------------------------------------------------------------------
# chat rendering


def _ids(tok, name):
    return tok.encode_special(name)


def test_render_conversation_masks(trained):
    tok, _, _ = trained
    conversation = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 6*7?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me compute."},
                    {"type": "python", "text": "6*7"},
                    {"type": "python_output", "text": "42"},
                    {"type": "text", "text": "It is 42."},
                ],
            },
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You're welcome."},
        ]
    }
    ids, mask = tok.render_conversation(conversation)
    S = lambda name: _ids(tok, name)  # noqa: E731
    E = tok.encode
    # (ids, mask value) segments in order: what every token must be and whether the model learns it
    segments = [
        ([S("<|bos|>")], 0),
        ([S("<|user_start|>")], 0),
        (E("Be brief.\n\nWhat is 6*7?"), 0),  # system merged into the first user message
        ([S("<|user_end|>")], 0),
        ([S("<|assistant_start|>")], 0),
        (E("Let me compute."), 1),
        ([S("<|python_start|>")], 1),
        (E("6*7"), 1),
        ([S("<|python_end|>")], 1),
        ([S("<|output_start|>")], 0),
        (E("42"), 0),
        ([S("<|output_end|>")], 0),
        (E("It is 42."), 1),
        ([S("<|assistant_end|>")], 1),
        ([S("<|user_start|>")], 0),
        (E("Thanks!"), 0),
        ([S("<|user_end|>")], 0),
        ([S("<|assistant_start|>")], 0),
        (E("You're welcome."), 1),
        ([S("<|assistant_end|>")], 1),
    ]
    assert ids == [i for seg, _ in segments for i in seg]
    assert mask == [m for seg, m in segments for _ in seg]
    assert len(ids) == len(mask)

    # truncation keeps the first max_tokens of both
    ids10, mask10 = tok.render_conversation(conversation, max_tokens=10)
    assert ids10 == ids[:10] and mask10 == mask[:10]


def test_render_conversation_errors(trained):
    tok, _, _ = trained
    bad = [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], ValueError, "alternate"),
        ([{"role": "assistant", "content": "a"}], ValueError, "alternate"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], ValueError, "system"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image", "text": "x"}]}],
         ValueError, "unknown part type"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}], TypeError, "str or a list"),
        ([{"role": "user", "content": ["a"]}], TypeError, "user content"),
        ([], ValueError, "no messages"),
    ]
    for messages, exc, match in bad:
        with pytest.raises(exc, match=match):
            tok.render_conversation({"messages": messages})


def test_render_for_completion(trained):
    tok, _, _ = trained
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    ids = tok.render_for_completion({"messages": messages})
    prompt_ids, _ = tok.render_conversation({"messages": messages[:1]})
    assert ids == prompt_ids + [_ids(tok, "<|assistant_start|>")]
    # a conversation that already ends with the user message works too, and the input is not modified
    assert tok.render_for_completion({"messages": messages[:1]}) == ids
    assert len(messages) == 2
    with pytest.raises(ValueError, match="end with a user message"):
        tok.render_for_completion({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                                {"role": "assistant", "content": "c"}]})


def test_render_for_completion_not_strict(trained):
    """strict=False (the chat server): turns in any order, a lone system message becomes a user turn, a trailing
    assistant turn is kept; what strict rendering accepts renders the same; other roles are still refused."""
    tok, _, _ = trained
    user, assistant = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
    start, end = _ids(tok, "<|assistant_start|>"), _ids(tok, "<|assistant_end|>")
    for messages in ([user], [{"role": "system", "content": "s"}, user], [user, assistant, user]):
        assert tok.render_for_completion({"messages": messages}, strict=False) == tok.render_for_completion({"messages": messages})
    two_users, _ = tok.render_conversation({"messages": [user]})
    assert tok.render_for_completion({"messages": [user, user]}, strict=False) == two_users + two_users[1:] + [start]
    finished, _ = tok.render_conversation({"messages": [user, assistant]})
    assert finished[-1] == end and tok.render_for_completion({"messages": [user, assistant]}, strict=False) == finished + [start]
    alone = tok.render_for_completion({"messages": [{"role": "system", "content": "a"}]}, strict=False)
    assert alone == tok.render_for_completion({"messages": [user]})
    for role in ("tool", "function"):
        with pytest.raises(ValueError, match=f"role '{role}'"):
            tok.render_for_completion({"messages": [user, {"role": role, "content": "x"}]}, strict=False)


# ---------------------------------------------------------------------------------------------------
# scripts end to end


def _write_shards(data_dir, docs_per_shard):
    data_dir.mkdir(parents=True)
    for i, docs in enumerate(docs_per_shard):
        table = pa.table({"text": pa.array(docs, type=pa.string())})
        pq.write_table(table, data_dir / f"shard_{i:05d}.parquet", row_group_size=50)


def _run(args, base_dir, timeout=120):
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base_dir), PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # two scripts in subprocesses
@needs_wikitext
def test_tok_train_and_eval_end_to_end(tmp_path, monkeypatch):
    docs = wikitext_docs(600_000)  # the ~200 lines of the WikiText-2 excerpt in tests/assets
    train_a, train_b, val = docs[:90], docs[90:180], docs[180:]
    train_a[5] = "X" * 5000  # a long doc, capped by --doc_cap
    base = tmp_path / "base"
    _write_shards(base / "base_data", [train_a, train_b, val])
    max_chars, doc_cap, vocab = 12_000, 300, 700

    p = _run(["scripts.tok_train", f"--max_chars={max_chars}", "--doc-cap", str(doc_cap), f"--vocab_size={vocab}"], base)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Training time" in p.stdout

    # what tok_train must have trained on: train shards only, docs capped, stopping once max_chars are used
    expected_docs, n = [], 0
    for d in train_a + train_b:
        expected_docs.append(d[:doc_cap])
        n += len(d[:doc_cap])
        if n >= max_chars:
            break
    assert n < sum(len(d[:doc_cap]) for d in train_a + train_b)  # the cap on total chars was hit
    expected = RustBPETokenizer.train_from_iterator(iter(expected_docs), vocab)

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    tok = get_tokenizer()
    assert tok.get_vocab_size() == vocab
    assert tok.enc._mergeable_ranks == expected.enc._mergeable_ranks
    token_bytes = get_token_bytes("cpu")
    assert torch.equal(token_bytes, compute_token_bytes(tok))
    assert (base / "tokenizer" / "tokenizer.pkl").stat().st_mode & 0o044  # readable like any other file

    p = _run(["scripts.tok_eval", "--reference_timeout=20"], base)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| fwe-val |" in p.stdout and "| news |" in p.stdout
    # --data=climbmix measures the record recipe's shards (base_data_climbmix/), not base_data/
    os.symlink(base / "base_data", base / "base_data_climbmix")
    p = _run(["scripts.tok_eval", "--reference_timeout=0", "--data=climbmix"], base)
    assert p.returncode == 0 and "| climbmix-val |" in p.stdout and "| fwe-val |" not in p.stdout, p.stdout + p.stderr
    # offline, the reference vocabularies are reported as missing; online they are compared
    for name in ("gpt2", "gpt4"):
        assert f"{name} (" in p.stdout and ("not compared" in p.stdout or f"{name} tokens" in p.stdout)


@pytest.mark.parametrize("how, why", [
    ("missing", r"no token bytes at .*token_bytes\.pt"),
    ("empty", r"token_bytes\.pt is empty \(0 bytes\)"),
    ("truncated", r"token_bytes\.pt is truncated or not a torch file"),
    ("garbage", r"token_bytes\.pt is truncated or not a torch file \(3,000 bytes, no zip directory at its end\)"),
    ("floats", r"token_bytes\.pt holds a \(4096,\) torch\.float32 tensor, not one integer byte count per token id"),
    ("other_vocab", r"token_bytes\.pt has 100 entries but the tokenizer beside it has [\d,]+ tokens"),
])
def test_damaged_token_bytes_is_named_and_rebuilt_from_the_tokenizer(trained, tmp_path, monkeypatch, how, why):
    """A missing or damaged token_bytes.pt points at rebuild_token_bytes, which recomputes it from tokenizer.pkl."""
    from nanochat.tokenizer import rebuild_token_bytes, save_token_bytes

    tok, _, _ = trained
    tok_dir = tmp_path / "tokenizer"
    tok.save(str(tok_dir))
    want = compute_token_bytes(tok)
    path = tok_dir / "token_bytes.pt"
    save_token_bytes(want, str(tok_dir))
    data = path.read_bytes()
    if how == "missing":
        path.unlink()
    elif how == "floats":
        torch.save(torch.ones(4096), path)
    elif how == "other_vocab":
        torch.save(torch.ones(100, dtype=torch.int32), path)
    else:
        path.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "garbage": os.urandom(3000)}[how])  # any garbage
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises((ValueError, FileNotFoundError), match=why + r".*rebuild_token_bytes\(\)"):
        get_token_bytes("cpu")
    rebuild_token_bytes()  # the fix the message gives
    assert torch.equal(get_token_bytes("cpu"), want)


@pytest.mark.slow  # a script in a subprocess
def test_tok_train_without_shards_says_how_to_get_data(tmp_path):
    p = _run(["scripts.tok_train", "--vocab_size=300"], tmp_path / "empty")
    assert p.returncode != 0
    assert "python -m nanochat.dataset -n 8" in p.stderr and "python -m nanochat.dataset import" in p.stderr


@pytest.mark.slow  # a script in a subprocess
def test_tok_train_rejects_unknown_flag(tmp_path):
    p = _run(["scripts.tok_train", "--vocab=300"], tmp_path)
    assert p.returncode == 2 and "unknown flag --vocab" in p.stderr
