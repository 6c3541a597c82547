"""
A slow, obviously-correct byte-level BPE in pure Python, used by the tests as the oracle for rustbpe.

Same rules as rustbpe, written the simplest way: split with the `regex` module, recount every pair from
scratch before each merge, merge the most frequent pair (ties: smallest (left_id, right_id)) everywhere, left
to right. Only for small texts.
"""

from collections import Counter

import regex

# nanochat's split pattern (GPT-4's with numbers in groups of at most 2 digits)
DEFAULT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""


def split(text, pattern=DEFAULT_PATTERN):
    return [m for m in regex.findall(pattern, text) if m]


def merge_word(ids, pair, new_id):
    """Replace the occurrences of `pair` in `ids`, scanning left to right (non-overlapping)."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i], ids[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def train(texts, vocab_size, pattern=DEFAULT_PATTERN):
    """Merges [(left_id, right_id), ...] for tokens 256, 257, ... up to vocab_size (or until no pair is left)."""
    chunk_counts = Counter()
    for text in texts:
        chunk_counts.update(split(text, pattern))
    words = [list(chunk.encode("utf-8")) for chunk in chunk_counts]
    counts = list(chunk_counts.values())
    merges = []
    while 256 + len(merges) < vocab_size:
        pair_counts = Counter()
        for word, count in zip(words, counts):
            for pair in zip(word, word[1:]):  # every adjacent occurrence, overlaps included
                pair_counts[pair] += count
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda p: (-pair_counts[p], p))
        new_id = 256 + len(merges)
        merges.append(best)
        words = [merge_word(word, best, new_id) for word in words]
    return merges


def encode(text, merges, pattern=DEFAULT_PATTERN):
    """Apply the merges in rank order to each chunk (what training did to the chunks)."""
    ranks = {pair: 256 + i for i, pair in enumerate(merges)}
    out = []
    for chunk in split(text, pattern):
        ids = list(chunk.encode("utf-8"))
        while len(ids) >= 2:
            candidates = [ranks[p] for p in zip(ids, ids[1:]) if p in ranks]
            if not candidates:
                break
            new_id = min(candidates)
            ids = merge_word(ids, merges[new_id - 256], new_id)
        out.extend(ids)
    return out


def token_bytes(merges):
    """Bytes of every token id."""
    vocab = [bytes([b]) for b in range(256)]
    for a, b in merges:
        vocab.append(vocab[a] + vocab[b])
    return vocab
