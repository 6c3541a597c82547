"""
Train the tokenizer on the pretraining shards (rustbpe), in nanochat's way.

    python -m scripts.tok_train                                   # defaults: 10B chars, docs capped at 10k chars, 65536 tokens
    python -m scripts.tok_train --max_chars=2000000000 --vocab_size=65536
    python -m scripts.tok_train --max-chars 5000000 --doc-cap 2000 --vocab-size 4096   # a quick CPU run

Writes base_dir/tokenizer/tokenizer.pkl (tiktoken encoding) and base_dir/tokenizer/token_bytes.pt (bytes per
token id, used to report losses in bits per byte). A tokenizer that checkpoints in the base dir were trained with is
not replaced (they would no longer load) unless --force.
"""

import glob
import json
import os
import time

from nanochat.checkpoint_manager import PHASE_DIRS, checkpoint_root
from nanochat.common import get_base_dir, print0
from nanochat.configurator import Flag, Flags, parse_flags_or_exit
from nanochat.dataset import DEFAULT_SOURCE, SOURCES, base_data_dir, data_flag, list_parquet_files, parquets_iter_batched
from nanochat.report import get_report
from nanochat.tokenizer import TOKENIZER_FILENAME, RustBPETokenizer, compute_token_bytes, save_token_bytes
from nanochat.usage import BadValue, Missing, RunFailure, UsageError, run_main

FLAGS = Flags(
    Flag("max_chars", 10_000_000_000, "train on at most this many characters", min=1),
    Flag("doc_cap", 10_000, "characters kept from the start of each document", min=1),
    Flag("vocab_size", 65536, "tokens in the vocabulary, including the 9 special tokens", min=265),
    Flag("data", DEFAULT_SOURCE, "which shards to train on: fineweb_edu (base_data/) or climbmix (base_data_climbmix/, "
         "the record recipe's)", choices=list(SOURCES)),
    Flag("force", False, "replace the tokenizer even when checkpoints in the base dir were trained with it (they "
         "will no longer load with the new one)"),
    Flag("keep_existing", False, "keep a tokenizer already in the base dir that has this --vocab_size and train none "
         "(pipelines run a second time, or again after a crash: runcpu.sh, speedrun.sh)"),
)


def existing_vocab_size(tokenizer_dir):
    """The vocabulary size of the tokenizer in tokenizer_dir, or None when there is none (or only part of one)."""
    if not all(os.path.exists(os.path.join(tokenizer_dir, f)) for f in (TOKENIZER_FILENAME, "token_bytes.pt")):
        return None
    return RustBPETokenizer.from_directory(tokenizer_dir).get_vocab_size()


def checkpoints_using(tokenizer_dir):
    """The checkpoint directories (<stage dir>/<tag>) whose models have the vocabulary of the tokenizer in
    tokenizer_dir: they were trained with it, and a new tokenizer would make them unloadable."""
    if not os.path.exists(os.path.join(tokenizer_dir, TOKENIZER_FILENAME)):
        return []
    vocab = RustBPETokenizer.from_directory(tokenizer_dir).get_vocab_size()
    users = []
    for source in PHASE_DIRS:
        for tag_dir in sorted(glob.glob(os.path.join(checkpoint_root(source), "*"))):
            for meta_path in glob.glob(os.path.join(tag_dir, "meta_*.json")):
                try:
                    with open(meta_path, encoding="utf-8") as f:
                        model_vocab = (json.load(f).get("model_config") or {}).get("vocab_size")
                except (OSError, ValueError, AttributeError):
                    continue  # a damaged meta says nothing about the tokenizer; loading it names the problem
                if model_vocab == vocab:
                    users.append(tag_dir)
                    break
    return users


def text_iterator(max_chars, doc_cap, data_dir=None):
    """Train-split documents, each cut to doc_cap chars, until max_chars chars have been given out."""
    nchars = 0
    for batch in parquets_iter_batched(split="train", data_dir=data_dir):
        for doc in batch:
            text = doc[:doc_cap]
            nchars += len(text)
            yield text
            if nchars >= max_chars:
                return


def main(argv=None):
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    max_chars, doc_cap, vocab_size = config["max_chars"], config["doc_cap"], config["vocab_size"]
    tokenizer_dir = os.path.join(get_base_dir(), "tokenizer")
    if config["keep_existing"] and not config["force"] and existing_vocab_size(tokenizer_dir) == vocab_size:
        print0(f"tokenizer with vocab {vocab_size:,} already in {tokenizer_dir}: kept (--keep_existing; --force "
               f"retrains it)")
        return
    users = [] if config["force"] else checkpoints_using(tokenizer_dir)
    if users:
        raise UsageError(f"the tokenizer in {tokenizer_dir} is the one {len(users)} checkpoint dir(s) were trained "
                         f"with ({', '.join(users)}); a new one would stop them loading. Pass --force to replace it "
                         f"anyway, or use another NANOCHAT_BASE_DIR")
    print0(f"max_chars: {max_chars:,}\ndoc_cap: {doc_cap:,}\nvocab_size: {vocab_size:,}")

    data_dir = base_data_dir(source=config["data"])
    shards = list_parquet_files(data_dir)
    if len(shards) < 2:
        flag = data_flag(data_dir)
        raise Missing(
            f"the tokenizer trains on the train shards in {data_dir}, which has {len(shards)} shard(s) (the last "
            f"shard is validation, so at least 2 are needed). Get data first: `python -m nanochat.dataset{flag} -n 8` "
            f"downloads {SOURCES[config['data']].title} shards, `python -m nanochat.dataset import PATH{flag}` "
            f"imports local text (offline)"
        )

    t0 = time.time()
    try:
        tokenizer = RustBPETokenizer.train_from_iterator(text_iterator(max_chars, doc_cap, data_dir), vocab_size)
    except ValueError as e:
        raise BadValue(str(e)) from None
    train_time = time.time() - t0
    print0(f"Training time: {train_time:.2f}s")
    if tokenizer.get_vocab_size() != vocab_size:
        print0(
            f"warning: the training text ran out of pairs to merge: the vocabulary has {tokenizer.get_vocab_size():,} "
            f"tokens instead of {vocab_size:,} (train on more text or ask for a smaller --vocab_size)"
        )

    tokenizer.save(tokenizer_dir)

    # quick sanity check: ordinary text and special-token-looking text survive a round trip
    test_text = "Round trip check: 3.14159 and 2,048 items\n\tindented, we'll see; ÅÄÖ ñ 東京 🚀 <|bos|> ~$%&*"
    decoded = tokenizer.decode(tokenizer.encode(test_text))
    if decoded != test_text:
        raise RunFailure(f"the trained tokenizer does not round-trip text: {test_text!r} -> {decoded!r}")

    token_bytes = compute_token_bytes(tokenizer)
    path = save_token_bytes(token_bytes, tokenizer_dir)
    print0(f"Saved token_bytes to {path}")

    nonzero = token_bytes[token_bytes > 0].float()
    stats = {
        "train_time_s": round(train_time, 2),
        "vocab_size": tokenizer.get_vocab_size(),
        "num_special_tokens": int((token_bytes == 0).sum()),
        "token_bytes_min": int(nonzero.min()),
        "token_bytes_max": int(nonzero.max()),
        "token_bytes_mean": round(nonzero.mean().item(), 3),
        "token_bytes_std": round(nonzero.std().item(), 3) if nonzero.numel() > 1 else 0.0,
    }
    for k, v in stats.items():
        print0(f"{k}: {v}")
    get_report().log(section="Tokenizer training", data=[config, stats])


if __name__ == "__main__":
    run_main(main)
