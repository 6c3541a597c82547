"""
The command line of the pretraining shards, `python -m nanochat.dataset` (nanochat's command; nanochat/dataset.py
hands its arguments here):

    python -m nanochat.dataset -n 8 -w 4                 # download FineWeb-Edu 100B shards 0..7 (the default)
    python -m nanochat.dataset --data=climbmix -n 170    # ClimbMix 400B train shards 0..169 + validation shard 6542
    python -m nanochat.dataset import PATH ...           # import local .txt / .jsonl / .json / .parquet text (offline)

It sits above the downloader (download.py) and the importer (corpus_import.py), which sit above the shard layout
(nanochat/dataset.py); the layout imports none of them.
"""

import sys

from nanochat.configurator import Flag, Flags
from nanochat.data.corpus_import import SUPPORTED_FORMATS, TXT_SPLITS, import_corpus
from nanochat.data.download import download_shards, refuse_imported_corpus, shard_indices
from nanochat.dataset import DEFAULT_SOURCE, SOURCES, base_data_dir, data_flag, index_to_filename
from nanochat.usage import report

DATA_HELP = ("which web data: fineweb_edu (FineWeb-Edu 100B into base_data/, nanochat's December data) or climbmix "
             "(ClimbMix 400B into base_data_climbmix/, the record recipe's, as nanochat 92d63d4)")


def download_main(argv):
    fineweb, climbmix = SOURCES["fineweb_edu"], SOURCES["climbmix"]
    parser = Flags(
        Flag("num_files", -1, f"FineWeb-Edu: shards 0..N-1, the last of them is validation (-1 = all "
             f"{fineweb.max_shard + 1}); ClimbMix: train shards 0..N-1 plus validation shard {climbmix.val_shard} "
             f"(-1 = all {climbmix.max_shard + 1})", short="n"),
        Flag("num_workers", 4, "parallel download processes", short="w"),
        Flag("data", DEFAULT_SOURCE, DATA_HELP, choices=list(SOURCES)),
        Flag("base_url", None, f"mirror to fetch from; auto = ${fineweb.url_env} or {fineweb.base_url} (ClimbMix: "
             f"${climbmix.url_env} or {climbmix.base_url})", type=str),
        Flag("max_attempts", 5, "attempts per shard"),
        prog="python -m nanochat.dataset",
        description="Download FineWeb-Edu 100B or ClimbMix 400B shuffled pretraining shards (or: `python -m "
                    "nanochat.dataset import --help`).",
    )
    args = parser.parse_args(argv)
    source = SOURCES[args.data]
    if args.num_files == 0 or args.num_files < -1:
        parser.error(f"-n must be a positive number of shards or -1 for all {source.max_shard + 1}, got {args.num_files}")
    if args.num_workers < 1:
        parser.error(f"-w must be at least 1, got {args.num_workers}")
    if args.max_attempts < 1:
        parser.error(f"--max_attempts must be at least 1, got {args.max_attempts}")
    indices = shard_indices(args.data, args.num_files)
    if args.num_files > len(indices) - (source.val_shard is not None):
        print(f"note: {source.title} has only {source.max_shard + 1} shards; downloading all of them")
    num = len(indices)
    data_dir = base_data_dir(source=args.data)
    try:
        refuse_imported_corpus(data_dir, args.data)
    except FileExistsError as e:
        report(e)
        return 1
    workers = min(args.num_workers, num)
    print(f"Downloading {num} {source.title} shards using {workers} workers...")
    print(f"Target directory: {data_dir}")
    failed = download_shards(indices, data_dir, args.base_url, workers, args.max_attempts, source=args.data)
    print(f"Done! Downloaded: {num - len(failed)}/{num} shards to {data_dir}")
    if failed:
        report(f"{len(failed)} shard(s) failed: {', '.join(index_to_filename(i) for i in failed[:10])}"
               f"{' ...' if len(failed) > 10 else ''}; run the same command again to resume (partial files are kept). "
               f"Offline? Import local text instead: python -m nanochat.dataset import PATH{data_flag(data_dir)}")
        return 1
    return 0


def import_main(argv):
    parser = Flags(
        Flag("paths", None, "files or directories: .txt, .jsonl, .json, .parquet (optionally .gz)", type=str,
             positional=True, required=True, many=True),
        Flag("out", None, "output directory; auto = --data's directory under $NANOCHAT_BASE_DIR", type=str),
        Flag("data", None, "which layout to write: fineweb_edu (base_data/) or climbmix (base_data_climbmix/, what "
             "the record recipe reads by default); auto = fineweb_edu", type=str, choices=list(SOURCES)),
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
    if args.out is not None and args.data is not None:
        parser.error("give either --out DIR or --data (which picks the directory under $NANOCHAT_BASE_DIR), not both")
    try:
        import_corpus(
            args.paths, out_dir=args.out if args.out is not None else base_data_dir(source=args.data or DEFAULT_SOURCE), val_paths=args.val_paths, val_docs=args.val_docs, val_fraction=args.val_fraction,
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
