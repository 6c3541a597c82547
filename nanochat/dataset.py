"""
The pretraining data: parquet shards with a `text` column, one document per row.

Layout (nanochat's): `$NANOCHAT_BASE_DIR/base_data/shard_{i:05d}.parquet`. The shards are read in sorted order;
the LAST one is the validation split and all the others are the train split.

Two ways to fill that directory:
    python -m nanochat.dataset -n 8 -w 4          # download FineWeb-Edu 100B shards 0..7 (nanochat's command)
    python -m nanochat.dataset import PATH ...    # import local .txt / .jsonl / .json / .parquet text (offline)

This module: the layout, the readers `list_parquet_files()` and `parquets_iter_batched(split, start, step)`
(documents one row group at a time), and that command line. The downloader is nanochat/download.py, the importer
nanochat/corpus_import.py; the tokenizing, rank-sharded, resumable loader built on the shards is
nanochat/dataloader.py.
"""

import importlib
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.atomic import short_error
from nanochat.configurator import Flag, Flags
from nanochat.usage import Missing, report, run_main

# -----------------------------------------------------------------------------
# Where the shards live

IMPORT_INFO = "import_info.json"  # written by `import` so the downloader never mixes web shards into a local corpus


def index_to_filename(index):
    return f"shard_{index:05d}.parquet"


def get_data_dir(data_dir=None):
    """`data_dir` if given, else base_dir/base_data (created)."""
    if data_dir is not None:
        return os.fspath(data_dir)
    # imported here, not at module top: nanochat.common imports torch, which download workers and the
    # import command do not need (it costs seconds per spawned worker on macOS)
    from nanochat.common import get_base_dir

    path = os.path.join(get_base_dir(), "base_data")
    os.makedirs(path, exist_ok=True)
    return path


def list_parquet_files(data_dir=None):
    """Full paths of the finished shards in the data dir, sorted by name (partial `.tmp` downloads excluded)."""
    data_dir = get_data_dir(data_dir)
    if not os.path.isdir(data_dir):
        return []
    names = sorted(f for f in os.listdir(data_dir) if f.endswith(".parquet"))
    return [os.path.join(data_dir, f) for f in names]


def _fill_hint():
    return (
        "fill it with `python -m nanochat.dataset -n 8` (downloads FineWeb-Edu shards) or, offline, "
        "`python -m nanochat.dataset import PATH` (imports local .txt/.jsonl/.json/.parquet text)"
    )


def split_parquet_files(split, data_dir=None):
    """The shard paths of one split: 'train' = all but the last shard, 'val' = the last shard."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    paths = list_parquet_files(data_dir)
    where = get_data_dir(data_dir)
    if not paths:
        raise Missing(f"no parquet shards in {where}: {_fill_hint()}")
    if len(paths) == 1:
        raise Missing(
            f"only one shard in {where} ({os.path.basename(paths[0])}); the last shard is the validation split, "
            f"so at least 2 are needed: {_fill_hint()}"
        )
    return paths[:-1] if split == "train" else paths[-1:]


def parquets_iter_batched(split, start=0, step=1, data_dir=None):
    """
    Yield the documents of a split one row group at a time (a list[str] per row group).
    Within each file, row groups start, start+step, ... are read (nanochat's per-file striding).
    """
    if step < 1 or start < 0:
        raise ValueError(f"need start >= 0 and step >= 1, got start={start}, step={step}")
    for path in split_parquet_files(split, data_dir):
        pf = open_shard(path)
        for rg_idx in range(start, pf.num_row_groups, step):
            yield read_texts(pf, path, rg_idx)


def check_text_column(pf, path):
    names = pf.schema_arrow.names
    if "text" not in names:
        raise ValueError(f"{path} has no 'text' column (columns: {names}); shards need one")
    kind = pf.schema_arrow.field("text").type
    is_string_view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_string_view(kind)):
        raise ValueError(f"{path}: the 'text' column holds {kind}, not strings; shards need text")


def shard_fix(path):
    """How to replace a bad shard: re-import an imported corpus, re-download a downloaded one."""
    data_dir = os.path.dirname(os.path.abspath(path))
    if os.path.exists(os.path.join(data_dir, IMPORT_INFO)):
        return (f"this corpus was imported ({IMPORT_INFO} there lists its sources): import it again with "
                f"`python -m nanochat.dataset import ... --overwrite`")
    return (f"move {os.path.basename(path)} out of {data_dir} and run `python -m nanochat.dataset -n N` again (it "
            f"downloads only the shards that are missing, so the file comes back whole)")


def open_shard(path):
    """pq.ParquetFile of a shard with a text column; an empty, truncated or foreign file is named with the fix."""
    try:
        pf = pq.ParquetFile(path)
    except (PermissionError, FileNotFoundError, IsADirectoryError):
        raise
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid for a bad footer, OSError for I/O-level damage
        size = os.path.getsize(path)
        why = "is empty (0 bytes)" if size == 0 else f"is truncated or not a parquet file ({size:,} bytes)"
        raise ValueError(f"shard {path} {why} ({short_error(e)}): {shard_fix(path)}") from e
    try:
        check_text_column(pf, path)
    except ValueError as e:
        raise ValueError(f"{e}: {shard_fix(path)}") from None
    return pf


def read_texts(pf, path, rg):
    """The documents of row group `rg` of an open shard; a damaged row group is named with the fix."""
    try:
        return pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()
    except (pa.ArrowException, OSError) as e:  # e.g. "ZSTD decompression failed: Data corruption detected"
        raise ValueError(f"shard {path}: row group {rg} cannot be read, the file is damaged ({short_error(e)}): "
                         f"{shard_fix(path)}") from e


# -----------------------------------------------------------------------------
# The command line: download (the default, nanochat's `-n 8 -w 4`) or import


def download_main(argv):
    from nanochat.download import BASE_URL, MAX_SHARD, download_shards, refuse_imported_corpus

    parser = Flags(
        Flag("num_files", -1, f"number of shards to download, shards 0..N-1; -1 = all {MAX_SHARD + 1}", short="n"),
        Flag("num_workers", 4, "parallel download processes", short="w"),
        Flag("base_url", None, f"mirror to fetch from; auto = $NANOCHAT_DATA_URL or {BASE_URL}", type=str),
        Flag("max_attempts", 5, "attempts per shard"),
        prog="python -m nanochat.dataset",
        description="Download FineWeb-Edu 100B shuffled pretraining shards (or: `python -m nanochat.dataset import "
                    "--help`).",
    )
    args = parser.parse_args(argv)
    if args.num_files == 0 or args.num_files < -1:
        parser.error(f"-n must be a positive number of shards or -1 for all {MAX_SHARD + 1}, got {args.num_files}")
    if args.num_workers < 1:
        parser.error(f"-w must be at least 1, got {args.num_workers}")
    if args.max_attempts < 1:
        parser.error(f"--max_attempts must be at least 1, got {args.max_attempts}")
    num = MAX_SHARD + 1 if args.num_files == -1 else args.num_files
    if num > MAX_SHARD + 1:
        print(f"note: there are only {MAX_SHARD + 1} shards; downloading all of them")
        num = MAX_SHARD + 1
    data_dir = get_data_dir()
    try:
        refuse_imported_corpus(data_dir)
    except FileExistsError as e:
        report(e)
        return 1
    workers = min(args.num_workers, num)
    print(f"Downloading {num} shards using {workers} workers...")
    print(f"Target directory: {data_dir}")
    failed = download_shards(range(num), data_dir, args.base_url, workers, args.max_attempts)
    print(f"Done! Downloaded: {num - len(failed)}/{num} shards to {data_dir}")
    if failed:
        report(f"{len(failed)} shard(s) failed: {', '.join(index_to_filename(i) for i in failed[:10])}"
               f"{' ...' if len(failed) > 10 else ''}; run the same command again to resume (partial files are kept). "
               f"Offline? Import local text instead: python -m nanochat.dataset import PATH")
        return 1
    return 0


def import_main(argv):
    from nanochat.corpus_import import SUPPORTED_FORMATS, TXT_SPLITS, import_corpus

    parser = Flags(
        Flag("paths", None, "files or directories: .txt, .jsonl, .json, .parquet (optionally .gz)", type=str,
             positional=True, required=True, many=True),
        Flag("out", None, "output directory; auto = $NANOCHAT_BASE_DIR/base_data", type=str),
        Flag("overwrite", False, "replace the shards already in the output directory"),
        Flag("format", None, "force the input format; auto = by extension", type=str, choices=list(SUPPORTED_FORMATS)),
        Flag("text_field", "text", "JSON field / parquet column holding the text"),
        Flag("txt_split", "auto", "how .txt files become documents: blank-line paragraphs, one per line, whole file, "
             "WikiText articles; auto = <|endoftext|> if present, else wikitext/blank/line", choices=list(TXT_SPLITS)),
        Flag("separator", None, "literal document separator for .txt, e.g. '<|endoftext|>'; auto = none (--txt_split "
             "decides)", type=str),
        Flag("split_on", None, "regex (multiline) splitting .txt into documents; a lookahead such as '(?=^# )' keeps "
             "the match; auto = none", type=str),
        Flag("val_paths", None, "files whose documents form the validation shard; auto = documents held out of PATHS",
             type=str, many=True),
        Flag("val_docs", None, "number of documents held out for validation; auto = --val_fraction of them", type=int),
        Flag("val_fraction", 0.01, "fraction held out when --val_docs is not given"),
        Flag("rows_per_group", 1024, "documents per parquet row group"),
        Flag("docs_per_shard", 65536, "documents per train shard"),
        Flag("seed", 42, "seed of the document shuffle"),
        Flag("no_shuffle", False, "keep input order and stream (low memory); validation = the last documents"),
        prog="python -m nanochat.dataset import",
        description="Import local text into pretraining shards (train shards + the last shard as validation).",
    )
    args = parser.parse_args(argv)
    if args.val_paths and args.val_docs is not None:
        parser.error("give either --val_paths or --val_docs, not both")
    try:
        import_corpus(
            args.paths, out_dir=args.out, val_paths=args.val_paths, val_docs=args.val_docs, val_fraction=args.val_fraction,
            rows_per_group=args.rows_per_group, docs_per_shard=args.docs_per_shard, shuffle=not args.no_shuffle,
            seed=args.seed, overwrite=args.overwrite, fmt=args.format, text_field=args.text_field,
            txt_split=args.txt_split, separator=args.separator, split_on=args.split_on,
        )
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        report(e)
        return 1
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    # download stays the default so nanochat's `python -m nanochat.dataset -n 8` works unchanged
    if argv and argv[0] == "import":
        return import_main(argv[1:])
    if argv and argv[0] == "download":
        argv = argv[1:]
    return download_main(argv)


# The downloader and the importer lived in this module; their names still import from here (`from nanochat.dataset
# import import_corpus`). They load on first use, so reading shards never imports them, and they can import the
# layout above without a cycle.
_MOVED = {
    "nanochat.download": ("BASE_URL", "MAX_SHARD", "DownloadError", "download_single_file", "download_shards"),
    "nanochat.corpus_import": ("SUPPORTED_FORMATS", "TXT_SPLITS", "ENDOFTEXT", "detect_format", "split_text",
                               "iter_file_documents", "expand_inputs", "import_corpus"),
}


def __getattr__(name):
    for module, names in _MOVED.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    run_main(main)
