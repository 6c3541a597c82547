"""
Tokenizer benchmark: rustbpe training time against Hugging Face `tokenizers` (BpeTrainer with the same split
pattern) on the same real text, and encode throughput of rustbpe against tiktoken (the encoder nanochat uses
for inference, built from rustbpe's merges).

    python -m bench.tokenizer_bench                       # >= 10 MB from ../shared/data, vocab 8192 and 32768
    python -m bench.tokenizer_bench --vocab_sizes=4096 --max_mb=2 --repeats=1   # quick look

Prints a markdown section ready for docs/benchmarks.md. Both trainers use every core rayon sees (set
RAYON_NUM_THREADS to change that, for both).
"""

import json
import os
import platform
import time
from pathlib import Path

import rustbpe
import tiktoken

from nanochat.configurator import Flag, Flags
from nanochat.tokenizer import SPLIT_PATTERN

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "pretrain"


def load_corpus(max_mb):
    """Documents from the real corpora in ../shared/data/pretrain (WikiText-2 first), up to max_mb megabytes."""
    if not SHARED_DATA.is_dir():
        raise SystemExit(f"benchmark corpus not found: {SHARED_DATA} (the shared data folder beside the repo)")
    docs = []

    def add_lines_as_docs(path, sep):
        docs.extend(d for d in path.read_text(encoding="utf-8").split(sep) if d.strip())

    add_lines_as_docs(SHARED_DATA / "wikitext-2" / "train.txt", "\n \n")  # WikiText paragraphs
    add_lines_as_docs(SHARED_DATA / "tinystories" / "tinystories_sample.txt", "<|endoftext|>")
    add_lines_as_docs(SHARED_DATA / "tinyshakespeare" / "input.txt", "\n\n")
    add_lines_as_docs(SHARED_DATA / "wiki_demo" / "wiki_demo.txt", "\n\n")
    with open(SHARED_DATA / "c4_demo" / "c4_demo.jsonl", encoding="utf-8") as f:
        docs.extend(json.loads(line)["text"] for line in f if line.strip())
    with open(SHARED_DATA / "fineweb" / "fineweb_subset.json", encoding="utf-8") as f:
        docs.extend(d["text"] for d in json.load(f))
    out, total = [], 0
    for d in docs:
        if total >= max_mb * 1e6:
            break
        out.append(d)
        total += len(d.encode("utf-8"))
    return out, total


def train_rustbpe(docs, vocab_size):
    tok = rustbpe.Tokenizer()
    t0 = time.perf_counter()
    tok.train_from_iterator(iter(docs), vocab_size, pattern=SPLIT_PATTERN)
    return time.perf_counter() - t0, tok


def train_hf(docs, vocab_size):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # same chunks as rustbpe (the split pattern), then bytes mapped to printable chars (byte-level BPE)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    t0 = time.perf_counter()
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return time.perf_counter() - t0, tok


def best_of(repeats, fn):
    times, result = [], None
    for _ in range(repeats):
        t, result = fn()
        times.append(t)
    return min(times), result


def encode_bench(tok, docs, repeats):
    """MB/s of rustbpe and tiktoken (same vocabulary) on the docs, one thread and all threads."""
    ranks = {bytes(b): r for b, r in tok.get_mergeable_ranks()}
    enc = tiktoken.Encoding(name="bench", pat_str=tok.get_pattern(), mergeable_ranks=ranks, special_tokens={})
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    threads = os.cpu_count() or 1
    runs = {
        "rustbpe `encode` (1 thread)": lambda: [tok.encode(d) for d in docs],
        "tiktoken `encode_ordinary` (1 thread)": lambda: [enc.encode_ordinary(d) for d in docs],
        f"rustbpe `batch_encode` ({threads} threads)": lambda: tok.batch_encode(docs),
        f"tiktoken `encode_ordinary_batch` ({threads} threads)": lambda: enc.encode_ordinary_batch(docs, num_threads=threads),
    }
    results, outputs = {}, {}
    for name, fn in runs.items():
        t, out = best_of(repeats, lambda: _timed(fn))
        results[name] = nbytes / t / 1e6
        outputs[name] = out
    first = list(outputs.values())
    same = all(o == first[0] for o in first[1:])
    return results, same, sum(len(x) for x in first[0]), nbytes


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


FLAGS = Flags(
    Flag("vocab_sizes", "8192,32768", "comma-separated vocab sizes to train"),
    Flag("max_mb", 16.0, "megabytes of text to train on (>= 10 for the report)"),
    Flag("repeats", 2, "best of N runs for each timing"),
    Flag("skip_hf", False, "do not run Hugging Face tokenizers"),
    description=__doc__,
)


def main(argv=None):
    args = FLAGS.parse_args(argv)
    vocab_sizes = [int(v) for v in args.vocab_sizes.split(",")]

    docs, nbytes = load_corpus(args.max_mb)
    print(f"corpus: {len(docs):,} documents, {nbytes / 1e6:.1f} MB from {SHARED_DATA}")
    rows, last_tok = [], None
    for vocab_size in vocab_sizes:
        t_rust, tok = best_of(args.repeats, lambda: train_rustbpe(docs, vocab_size))
        last_tok = tok
        print(f"vocab {vocab_size}: rustbpe {t_rust:.2f}s", flush=True)
        if args.skip_hf:
            rows.append((vocab_size, t_rust, None))
            continue
        t_hf, hf = best_of(args.repeats, lambda: train_hf(docs, vocab_size))
        print(f"vocab {vocab_size}: tokenizers {t_hf:.2f}s (vocab {hf.get_vocab_size()})", flush=True)
        rows.append((vocab_size, t_rust, t_hf))

    encode_rates, same, ntokens, enc_bytes = encode_bench(last_tok, docs, args.repeats)

    import tokenizers

    lines = [
        "## Tokenizer (rustbpe)",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}, tokenizers {tokenizers.__version__}, tiktoken {tiktoken.__version__}. "
        f"Text: {nbytes / 1e6:.1f} MB, {len(docs):,} documents (WikiText-2 train, TinyStories, Tiny Shakespeare, "
        f"Wikipedia, C4, FineWeb samples from shared/data), split pattern: nanochat's. Best of {args.repeats}.",
        "",
        "Training time (`python -m bench.tokenizer_bench`):",
        "",
        "| vocab size | rustbpe | HF tokenizers (BpeTrainer) | speedup |",
        "|---:|---:|---:|---:|",
    ]
    for vocab_size, t_rust, t_hf in rows:
        hf_cell = "-" if t_hf is None else f"{t_hf:.2f} s"
        speed = "-" if t_hf is None else f"{t_hf / t_rust:.1f}x"
        lines.append(f"| {vocab_size:,} | {t_rust:.2f} s | {hf_cell} | {speed} |")
    lines += [
        "",
        f"Encode throughput, vocab {last_tok.vocab_size:,}, {enc_bytes / 1e6:.1f} MB -> {ntokens:,} tokens "
        f"({enc_bytes / ntokens:.2f} bytes/token); identical ids from all four: {'yes' if same else 'NO'}:",
        "",
        "| encoder | MB/s |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {rate:.1f} |" for name, rate in encode_rates.items()]
    print()
    print("\n".join(lines))
    if not same:
        raise SystemExit("rustbpe and tiktoken disagree on the ids: that is a bug")


if __name__ == "__main__":
    main()
