"""
Evaluate the trained tokenizer's compression: bytes per token (higher = fewer tokens for the same text) on
built-in sample texts and on the train/val shards, next to GPT-2's and GPT-4's (cl100k) tokenizers.

    python -m scripts.tok_eval

GPT-2 and cl100k come from tiktoken, which downloads them on first use (then caches them). Offline, and
without a cache, they are reported as unavailable and only ours is shown.
"""

import threading

from nanochat.common import print0
from nanochat.configurator import Flag, Flags, parse_flags_or_exit
from nanochat.dataset import DEFAULT_SOURCE, SOURCES
from nanochat.tokenizer import get_tokenizer
from nanochat.usage import RunFailure, run_main

FLAGS = Flags(
    Flag("reference_timeout", 15.0, "seconds to wait for tiktoken to load (download) a reference vocabulary", min=0.0),
    Flag("max_shard_chars", 2_000_000, "characters of train/val shard text to measure", min=0),
    Flag("data", DEFAULT_SOURCE, "which shards to measure: fineweb_edu (base_data/) or climbmix (base_data_climbmix/, "
         "the record recipe's)", choices=list(SOURCES)),
)

# Short texts of different kinds, written for this script.
SAMPLES = {
    "news": (
        "GENEVA, March 3 - Delegates from forty-two countries agreed on Tuesday to a framework for sharing "
        "flood-forecasting data across river basins, after three days of talks that organisers described as "
        "\"difficult but productive.\" The agreement, which still needs national ratification, commits members to "
        "publish gauge readings within six hours and to fund a $120 million training programme over 2026-2030. "
        "Critics said the deadline was too loose; supporters replied that 14 of the signatories had no shared "
        "data at all until now."
    ),
    "korean": (
        "오늘 아침 서울에는 비가 내렸습니다. 시민들은 우산을 들고 출근길에 나섰고, 지하철은 평소보다 붐볐습니다. "
        "기상청은 오후부터 날씨가 맑아질 것이라고 예보했습니다. 주말에는 기온이 다시 올라 나들이하기 좋은 날씨가 "
        "될 전망입니다."
    ),
    "code": (
        "def merge_sorted(a, b):\n"
        "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
        "    out, i, j = [], 0, 0\n"
        "    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n"
        "            out.append(a[i]); i += 1\n"
        "        else:\n"
        "            out.append(b[j]); j += 1\n"
        "    out.extend(a[i:]); out.extend(b[j:])\n"
        "    return out\n\n\n"
        "if __name__ == \"__main__\":\n"
        "    assert merge_sorted([1, 4, 9], [2, 3, 10]) == [1, 2, 3, 4, 9, 10]\n"
    ),
    "math": (
        "\\begin{proof}\nLet $f(x) = \\sum_{k=0}^{n} \\binom{n}{k} x^k$. By the binomial theorem $f(x) = (1+x)^n$, "
        "so $f(1) = 2^n$ and $f(-1) = 0$ for $n \\geq 1$. Adding the two,\n\\[\n"
        "\\sum_{k \\text{ even}} \\binom{n}{k} = 2^{n-1}, \\qquad \\int_0^1 (1+x)^n \\, dx = \\frac{2^{n+1}-1}{n+1}.\n"
        "\\]\nFor $n = 10$ this gives $512$ and $2047/11 \\approx 186.09$.\n\\end{proof}\n"
    ),
    "science": (
        "Mitochondria generate most of the cell's ATP through oxidative phosphorylation. Electrons from NADH and "
        "FADH2 pass along complexes I-IV of the inner membrane, and the energy released pumps protons into the "
        "intermembrane space. The resulting electrochemical gradient (about 150-200 mV) drives ATP synthase, a "
        "rotary enzyme that makes roughly three ATP molecules per full turn. Oxygen is the final electron "
        "acceptor and is reduced to water."
    ),
}

REFERENCES = {"gpt2": "gpt2", "gpt4": "cl100k_base"}


def load_reference(encoding_name, timeout):
    """tiktoken.get_encoding in a daemon thread: (encoding, None) or (None, why it is unavailable).
    tiktoken's download has no timeout of its own, so a network that drops packets must not hang us."""
    import tiktoken

    result = {}

    def load():
        try:
            result["enc"] = tiktoken.get_encoding(encoding_name)
        except Exception as e:  # any failure just means "not available here"
            msg = str(e).splitlines()[0] if str(e) else ""
            result["error"] = f"{type(e).__name__}: {msg[:100] + '...' if len(msg) > 100 else msg}"

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return None, f"timed out after {timeout:.0f}s (no network?)"
    if "enc" in result:
        return result["enc"], None
    return None, result.get("error", "unknown error")


def shard_texts(max_chars, source=DEFAULT_SOURCE):
    """{'fwe-train': ..., 'fwe-val': ...} from the first row groups of the shards (ClimbMix's: 'climbmix-train', ...),
    or {} with a note."""
    from nanochat.dataset import base_data_dir, data_flag, list_parquet_files, parquets_iter_batched

    data_dir = base_data_dir(source=source)
    if len(list_parquet_files(data_dir)) < 2:
        print0(f"note: no train/val shards in {data_dir}, skipping shard texts (python -m nanochat.dataset -n 8"
               f"{data_flag(data_dir)})")
        return {}
    out = {}
    prefix = "fwe" if source == DEFAULT_SOURCE else source
    for name, split in ((f"{prefix}-train", "train"), (f"{prefix}-val", "val")):
        parts, n = [], 0
        for batch in parquets_iter_batched(split, data_dir=data_dir):
            for doc in batch:
                parts.append(doc)
                n += len(doc) + 1
                if n >= max_chars:
                    break
            if n >= max_chars:
                break
        out[name] = "\n".join(parts)[:max_chars]
    return out


def main(argv=None):
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    ours = get_tokenizer()
    encoders = {"ours": lambda t: ours.encode(t)}
    vocab_sizes = {"ours": ours.get_vocab_size()}
    unavailable = {}
    for name, encoding_name in REFERENCES.items():
        enc, why = load_reference(encoding_name, config["reference_timeout"])
        if enc is None:
            unavailable[name] = why
            print0(f"{name} ({encoding_name}) is not available: {why}. Reporting without it.")
            continue
        encoders[name] = lambda t, enc=enc: enc.encode_ordinary(t)
        vocab_sizes[name] = enc.n_vocab

    texts = dict(SAMPLES)
    texts.update(shard_texts(config["max_shard_chars"], config["data"]))

    names = list(encoders)
    results = {}  # text name -> {tokenizer name: (tokens, bytes/token)}
    for text_name, text in texts.items():
        nbytes = len(text.encode("utf-8"))
        row = {}
        for name, encode in encoders.items():
            ids = encode(text)
            if name == "ours" and ours.decode(ids) != text:
                raise RunFailure(f"our tokenizer does not round-trip the {text_name!r} text")
            row[name] = (len(ids), nbytes / max(len(ids), 1))
        results[text_name] = (nbytes, row)

    header = "| text | bytes | " + " | ".join(f"{n} tokens | {n} bytes/token" for n in names) + " |"
    sep = "|---|---:|" + "---:|---:|" * len(names)
    lines = [
        "Vocab sizes: " + ", ".join(f"{n} {v:,}" for n, v in vocab_sizes.items()),
        "",
        header,
        sep,
    ]
    for text_name, (nbytes, row) in results.items():
        cells = " | ".join(f"{row[n][0]:,} | {row[n][1]:.2f}" for n in names)
        lines.append(f"| {text_name} | {nbytes:,} | {cells} |")
    for name in names[1:]:
        diffs = [(row["ours"][1] - row[name][1]) / row[name][1] * 100 for _, row in results.values()]
        lines.append("")
        lines.append(
            f"ours vs {name}: bytes/token " + ", ".join(f"{t} {d:+.1f}%" for t, d in zip(results, diffs))
            + " (positive: ours compresses better)"
        )
    for name, why in unavailable.items():
        lines.append("")
        lines.append(f"{name} ({REFERENCES[name]}) not compared: {why}")
    table = "\n".join(lines)
    print0(table)

    from nanochat.report import get_report

    get_report().log(section="Tokenizer evaluation", data=[table])


if __name__ == "__main__":
    run_main(main)
