"""
rustbpe against the pure-Python reference BPE (tests/reference_bpe.py) and against tiktoken.

Needs the extension built and installed (`pip install -e .`).
"""

import logging
import random
import sys
from pathlib import Path

import pytest
import regex
import tiktoken

rustbpe = pytest.importorskip("rustbpe", reason="the rustbpe extension is not built: run `pip install -e .`")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_bpe  # noqa: E402

WIKITEXT = Path(__file__).resolve().parents[1] / "assets" / "data" / "pretrain" / "wikitext-2"  # excerpt (tests/assets)
needs_wikitext = pytest.mark.skipif(not WIKITEXT.is_dir(), reason=f"WikiText-2 not found at {WIKITEXT}")

UNICODE_TEXTS = [
    "Héllo wörld! Ça va? Ünïcödé façade naïve café résumé. " * 3,
    "Привет, мир! Как дела? Всё хорошо, спасибо. Привет привет мир.",
    "你好，世界！今天天气很好。我们去公园吧。你好你好世界。",
    "Γειά σου Κόσμε. αβγ αβγ αβγδ. ΑΒΓ.",
    "e\u0301te\u0301 cafe\u0301 na\u0308ive",  # combining marks (\p{M}, not letters)
]
EMOJI_TEXTS = [
    "I love 🍕 and 🍣! 🍕🍕🍕 party 🎉🎉 👍🏽👍🏽 👨‍👩‍👧‍👦 family 🇺🇸🇫🇷",
    "😀😃😄😁 😀😃 smile 😀 🤖🤖 robots",
]
DIGIT_TEXTS = [
    "In 2023 there were 1234567 people; 3.14159 and 2.71828, 1,000,000 and 42 42 42.",
    "phone 555-123-4567 date 2024-01-31 time 12:34:56 ٣٤٥ ²³ Ⅻ",
]
WHITESPACE_TEXTS = [
    "a    b\t\t\tc\n\n\n   d        \r\n\r\n  e" + " " * 40 + "f\n" + "\t" * 10 + "g   ",
    "def f(x):\n    if x:\n        return x\n    return 0\n\n\n",
    "x\u00a0\u00a0y\u3000\u3000z\u2003 w  \n  \u0085 v \u2028 u     ",
]
CONTRACTION_TEXTS = ["I'm you're he's we've they'll it'd I'M YOU'RE 'sup 'll' ''s don't won't ſ's 'ſ"]


def train_both(texts, vocab_size, pattern=None, buffer_size=8192):
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(iter(texts), vocab_size, buffer_size=buffer_size, pattern=pattern)
    ref = reference_bpe.train(texts, vocab_size, pattern or reference_bpe.DEFAULT_PATTERN)
    return tok, ref


@pytest.mark.parametrize(
    "texts,vocab_size",
    [
        (UNICODE_TEXTS, 400),
        (EMOJI_TEXTS, 330),
        (DIGIT_TEXTS, 320),
        (WHITESPACE_TEXTS, 300),
        (CONTRACTION_TEXTS, 290),
        (UNICODE_TEXTS + EMOJI_TEXTS + DIGIT_TEXTS + WHITESPACE_TEXTS + CONTRACTION_TEXTS, 600),
    ],
    ids=["unicode", "emoji", "digits", "whitespace", "contractions", "all"],
)
def test_merges_match_reference(texts, vocab_size):
    tok, ref = train_both(texts, vocab_size)
    assert tok.get_merges() == ref
    assert tok.vocab_size == 256 + len(ref)
    ranks = tok.get_mergeable_ranks()
    assert [r for _, r in ranks] == list(range(tok.vocab_size))
    assert [b for b, _ in ranks] == reference_bpe.token_bytes(ref)


def test_ties_and_overlapping_pairs_hand_computed():
    # "aaa" holds (a, a) twice (overlaps count), "bc" twice holds (b, c) twice: a tie at 2, and the smaller
    # pair (97, 97) wins. "aaa" then becomes [256, 97] (left to right), leaving (256, 97) once and (b, c)
    # twice: (98, 99) next, then (256, 97). Then nothing is left to merge.
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(["aaa", "bc", "bc"], 300, pattern=r"\S+")
    assert tok.get_merges() == [(97, 97), (98, 99), (256, 97)]
    assert tok.vocab_size == 259
    # order of the input does not matter
    tok2 = rustbpe.Tokenizer()
    tok2.train_from_iterator(["bc", "aaa", "bc"], 300, pattern=r"\S+")
    assert tok2.get_merges() == tok.get_merges()


def test_tie_break_is_smallest_pair():
    # every pair occurs once: merges go in increasing (left, right) order
    texts = ["zy", "ab", "ba", "cd"]
    tok, ref = train_both(texts, 260, pattern=r"\S+")
    assert tok.get_merges() == ref == [(97, 98), (98, 97), (99, 100), (122, 121)]


def test_long_runs_and_determinism():
    texts = ["a" * 1000, "ab" * 300, " " * 200 + "x", "\n" * 50, "0" * 77]
    tok, ref = train_both(texts, 300)
    assert tok.get_merges() == ref
    again = rustbpe.Tokenizer()
    again.train_from_iterator(list(reversed(texts)), 300)
    assert again.get_merges() == ref


def test_custom_pattern_runs_on_fancy_regex():
    pattern = r"\w+|\s+|[^\w\s]+"
    texts = UNICODE_TEXTS + DIGIT_TEXTS + ["foo-bar foo_bar baz!!"]
    tok, ref = train_both(texts, 400, pattern=pattern)
    assert tok.get_merges() == ref
    assert tok.get_pattern() == pattern
    assert tok.encode(texts[0]) == reference_bpe.encode(texts[0], ref, pattern)


def test_buffering_does_not_change_the_result():
    texts = UNICODE_TEXTS + EMOJI_TEXTS + DIGIT_TEXTS + WHITESPACE_TEXTS
    a = rustbpe.Tokenizer()
    a.train_from_iterator(iter(texts), 500, buffer_size=1)
    b = rustbpe.Tokenizer()
    b.train_from_iterator((t for t in texts), 500, buffer_size=3)
    c = rustbpe.Tokenizer()
    c.train_from_iterator(texts, 500)
    assert a.get_merges() == b.get_merges() == c.get_merges()


@pytest.mark.parametrize("seed", range(6))
def test_random_texts_match_reference(seed):
    # a small alphabet makes many ties, repeated runs ("aaaa") and overlapping pairs
    rng = random.Random(seed)
    alphabet = ["a", "a", "b", "c", " ", "é", "😀", "1", "\n"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(40)]
    pattern = None if seed % 2 == 0 else r"\S+|\s+"
    tok, ref = train_both(texts, 256 + 120, pattern=pattern, buffer_size=7)
    assert tok.get_merges() == ref


@pytest.mark.slow  # the pure-Python reference BPE
@needs_wikitext
def test_merges_match_reference_on_wikitext():
    text = (WIKITEXT / "train.txt").read_text(encoding="utf-8")[:60_000]
    docs = text.split("\n")
    tok, ref = train_both(docs, 256 + 200)
    assert tok.get_merges() == ref


# ---------------------------------------------------------------------------------------------------
# splitting


def _random_texts(seed, n):
    alphabet = (
        list("abcXYZsStTdDmMlLvVrReE") + ["'"] * 4 + list("0123") + [" "] * 6
        + ["\t", "\r", "\n", "\n", "\u00a0", "\u3000", "\u2003", "\u0085", "\u2028", "\x0b", "\x0c"]
        + list('.,!?-_()"') + ["é", "ж", "中", "ſ", "K", "\u0301", "٣", "²", "Ⅻ", "😀", "👍🏽", "\u200d", "𝔘", "𐍈", "🇺🇸", "\u00ad"]
    )
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(n)]


@pytest.mark.parametrize("pattern_name", ["DEFAULT_PATTERN", "GPT4_PATTERN"])
def test_split_matches_regex_engines(pattern_name):
    # the default patterns run on a hand-written matcher; it must split exactly like the regex module and like
    # fancy-regex (the engine tiktoken uses; wrapping the pattern in a group sends it there)
    pattern = getattr(rustbpe, pattern_name)
    texts = _random_texts(0, 20000) + WHITESPACE_TEXTS + UNICODE_TEXTS + EMOJI_TEXTS + DIGIT_TEXTS + CONTRACTION_TEXTS
    fast = rustbpe.split_text(texts, pattern)
    fancy = rustbpe.split_text(texts, "(?:" + pattern + ")")
    for text, fast_chunks, fancy_chunks in zip(texts, fast, fancy, strict=True):
        expected = regex.findall(pattern, text)
        assert fast_chunks == expected, repr(text)
        assert fancy_chunks == expected, repr(text)
        assert rustbpe.split_text(text, pattern) == expected


def test_default_pattern_is_nanochats():
    assert rustbpe.Tokenizer().get_pattern() == rustbpe.DEFAULT_PATTERN == reference_bpe.DEFAULT_PATTERN
    assert rustbpe.split_text("12345 abc") == ["12", "34", "5", " abc"]  # numbers in groups of at most 2 digits


# ---------------------------------------------------------------------------------------------------
# encode / decode


@pytest.fixture(scope="module")
def small_tok():
    texts = UNICODE_TEXTS + EMOJI_TEXTS + DIGIT_TEXTS + WHITESPACE_TEXTS + CONTRACTION_TEXTS
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(texts, 700)
    return tok


def test_encode_matches_reference_and_round_trips(small_tok):
    merges = small_tok.get_merges()
    for text in UNICODE_TEXTS + EMOJI_TEXTS + DIGIT_TEXTS + WHITESPACE_TEXTS + ["", "unseen wörds 🦄 99999"]:
        ids = small_tok.encode(text)
        assert ids == reference_bpe.encode(text, merges)
        assert small_tok.decode(ids) == text


def test_batch_encode_equals_encode(small_tok):
    texts = _random_texts(1, 300) + UNICODE_TEXTS + EMOJI_TEXTS
    assert small_tok.batch_encode(texts) == [small_tok.encode(t) for t in texts]
    assert small_tok.batch_encode([]) == []


def test_decode_is_lossy_on_cut_utf8(small_tok):
    # "中" is 3 bytes; its first byte alone is not valid UTF-8 and decodes to U+FFFD
    first_byte = "中".encode("utf-8")[0]
    assert small_tok.decode([first_byte]) == "\ufffd"
    assert small_tok.decode([104, first_byte, 105]) == "h\ufffdi"


def test_untrained_tokenizer_is_bytes():
    tok = rustbpe.Tokenizer()
    assert tok.vocab_size == 256
    assert tok.encode("hé") == [104, 0xC3, 0xA9]
    assert tok.decode([104, 0xC3, 0xA9]) == "hé"


@needs_wikitext
def test_tiktoken_export_matches_rustbpe_on_wikitext():
    train = (WIKITEXT / "train.txt").read_text(encoding="utf-8")[:1_500_000]
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(train.split("\n"), 2048)
    ranks = {bytes(b): r for b, r in tok.get_mergeable_ranks()}
    assert len(ranks) == 2048
    enc = tiktoken.Encoding(name="test", pat_str=tok.get_pattern(), mergeable_ranks=ranks, special_tokens={})
    valid = (WIKITEXT / "valid.txt").read_text(encoding="utf-8")
    lines = valid.split("\n")
    ours = tok.batch_encode(lines)
    assert ours == enc.encode_ordinary_batch(lines)
    assert tok.encode(valid) == enc.encode_ordinary(valid)
    assert tok.decode(tok.encode(valid)) == valid
    # and the reference applies the same merges on a slice
    assert ours[:300] == [reference_bpe.encode(line, tok.get_merges()) for line in lines[:300]]


# ---------------------------------------------------------------------------------------------------
# errors and logging


def test_errors_are_python_exceptions():
    tok = rustbpe.Tokenizer()
    with pytest.raises(ValueError, match="at least 256"):
        tok.train_from_iterator(["abc"], 255)
    with pytest.raises(ValueError, match="invalid split pattern"):
        tok.train_from_iterator(["abc"], 300, pattern="(unclosed")
    with pytest.raises(TypeError, match=r"item 1 is int, expected str"):
        tok.train_from_iterator(["abc", 5], 300)
    with pytest.raises(TypeError, match="iterable of str"):
        tok.train_from_iterator(42, 300)
    with pytest.raises(ValueError, match="buffer_size"):
        tok.train_from_iterator(["abc"], 300, buffer_size=0)
    with pytest.raises(ValueError, match="unknown token id 256"):
        tok.decode([1, 256])
    with pytest.raises(ValueError, match="unknown token id -1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="invalid split pattern"):
        rustbpe.split_text("x", "[")
    # a failed training left the tokenizer as it was
    assert tok.vocab_size == 256


def test_iterator_exception_propagates():
    def gen():
        yield "hello world"
        raise RuntimeError("boom from the data")

    with pytest.raises(RuntimeError, match="boom from the data"):
        rustbpe.Tokenizer().train_from_iterator(gen(), 300)


def test_logs_progress_and_early_stop(caplog):
    caplog.set_level(logging.INFO, logger="rustbpe")
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(["hello hello world"], 5000)
    messages = [r.getMessage() for r in caplog.records if r.name == "rustbpe"]
    assert any("unique chunks" in m for m in messages)
    assert any(r.levelno == logging.WARNING and "ran out of pairs" in r.getMessage() for r in caplog.records)
    assert tok.vocab_size == 256 + len(tok.get_merges()) < 5000
