"""
Importing local text as pretraining shards, offline: `python -m nanochat.dataset import PATH ...` (nanochat/data/cli.py).

.txt / .jsonl / .json / .parquet files (optionally .gz) become documents (a .txt file is split by a separator, a
regex, blank lines, lines, or WikiText article headings), shuffled deterministically and written as train shards
plus one validation shard, the last file, in the layout of nanochat/dataset.py. An `import_info.json` beside the
shards records the sources, so the downloader never mixes web shards into an imported corpus.
"""

import gzip
import json
import os
import random
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.atomic import fsync_dir
from nanochat.dataset import IMPORT_INFO, base_data_dir, index_to_filename

SUPPORTED_FORMATS = ("txt", "jsonl", "json", "parquet")
TXT_SPLITS = ("auto", "blank", "line", "whole", "wikitext")
ENDOFTEXT = "<|endoftext|>"
# a WikiText article starts with a ' = Title = ' line between two blank lines (section headings are ' = = X = = ')
_WIKITEXT_ARTICLE = re.compile(r"(?<=\n)(?=[ \t]*\n = [^=\n][^\n]* = [ \t]*\n[ \t]*\n)")
_WIKITEXT_AT_START = re.compile(r"\A(?:[ \t]*\n)* = [^=\n][^\n]* = [ \t]*\n[ \t]*\n")
_BLANK_LINES = re.compile(r"\n[ \t]*\n")


def detect_format(path):
    name = os.path.basename(path).lower()
    if name.endswith(".gz"):
        name = name[:-3]
    ext = name.rsplit(".", 1)[-1] if "." in name else ""
    return ext if ext in SUPPORTED_FORMATS else None


def _open_text(path):
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")  # universal newlines: CRLF files become \n


def _clean(doc):
    """Drop leading blank lines and trailing whitespace (splitting leaves them), keep the first line's indentation."""
    return re.sub(r"\A(?:[ \t]*\n)+", "", doc).rstrip()


def split_text(text, mode="auto", separator=None, split_on=None):
    """
    Split one text file into documents. Returns (docs, how) where `how` says which rule was used.
    Precedence: `separator` (literal string) > `split_on` (regex; use a lookahead to keep the matched text) > mode.
    mode 'auto' picks: '<|endoftext|>' separators if present, WikiText articles if the file starts like WikiText,
    blank-line paragraphs if there are blank lines, else one document per line.
    """
    if separator is not None:
        if separator == "":
            raise ValueError("--separator must not be empty")
        parts, how = text.split(separator), f"separator {separator!r}"
    elif split_on is not None:
        try:
            pattern = re.compile(split_on, re.MULTILINE)
        except re.error as e:
            raise ValueError(f"--split_on {split_on!r} is not a valid regular expression: {e}") from None
        parts, how = pattern.split(text), f"regex {split_on!r}"
    else:
        if mode not in TXT_SPLITS:
            raise ValueError(f"txt split mode must be one of {', '.join(TXT_SPLITS)}, got {mode!r}")
        how = mode
        if mode == "auto":
            if ENDOFTEXT in text:
                return split_text(text, separator=ENDOFTEXT)[0], f"separator {ENDOFTEXT!r} (auto)"
            if _WIKITEXT_AT_START.match(text):
                mode = "wikitext"
            elif _BLANK_LINES.search(text):
                mode = "blank"
            else:
                mode = "line"
            how = f"{mode} (auto)"
        if mode == "whole":
            parts = [text]
        elif mode == "line":
            parts = text.split("\n")
        elif mode == "blank":
            parts = _BLANK_LINES.split(text)
        else:  # wikitext
            parts = _WIKITEXT_ARTICLE.split(text)
    docs = [d for d in map(_clean, parts) if d.strip()]
    return docs, how


def iter_file_documents(path, fmt=None, text_field="text", txt_split="auto", separator=None, split_on=None, log=print):
    """Yield the documents of one input file (empty / whitespace-only documents are left out)."""
    path = os.fspath(path)  # a str or a pathlib.Path
    fmt = fmt or detect_format(path)
    if fmt is None:
        raise ValueError(f"{path}: unknown file type; name it .txt/.jsonl/.json/.parquet (optionally .gz) or pass --format")
    if fmt == "txt":
        with _open_text(path) as f:
            try:
                text = f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} is not UTF-8 text ({e}); convert it first (e.g. iconv -t UTF-8)") from None
        docs, how = split_text(text, txt_split, separator, split_on)
        log(f"  {path}: {len(docs):,} documents (split: {how})")
        yield from docs
    elif fmt in ("json", "jsonl"):
        yield from _iter_json_documents(path, fmt, text_field, log)
    elif fmt == "parquet":
        try:
            pf = pq.ParquetFile(path)
        except (PermissionError, FileNotFoundError, IsADirectoryError):
            raise
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path} is empty, truncated or not a parquet file ({e})") from e
        if text_field not in pf.schema_arrow.names:
            raise ValueError(f"{path} has no {text_field!r} column (columns: {pf.schema_arrow.names}); pass --text_field NAME")
        n = skipped = 0
        for rg in range(pf.num_row_groups):
            try:
                values = pf.read_row_group(rg, columns=[text_field]).column(text_field).to_pylist()
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"{path}: row group {rg} cannot be read, the file is damaged ({e})") from e
            for value in values:
                if not isinstance(value, str):
                    if value is None:
                        skipped += 1
                        continue
                    raise ValueError(f"{path}: column {text_field!r} holds {type(value).__name__} values, need strings")
                if value.strip():
                    n += 1
                    yield value
                else:
                    skipped += 1
        log(f"  {path}: {n:,} documents" + (f" ({skipped} empty skipped)" if skipped else ""))
    else:
        raise ValueError(f"--format must be one of {', '.join(SUPPORTED_FORMATS)}, got {fmt!r}")


def _iter_json_documents(path, fmt, text_field, log):
    def text_of(record, where):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with a {text_field!r} field, got {type(record).__name__}")
        if text_field not in record:
            raise ValueError(f"{where}: no {text_field!r} field (keys: {sorted(record)[:10]}); pass --text_field NAME")
        value = record[text_field]
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {text_field!r} is {type(value).__name__}, need a string")
        return value

    with _open_text(path) as f:
        head = f.read(4096)
        # a .json file may hold one array or (a common mislabel) JSON lines: the first character tells which
        is_array = head.lstrip().startswith("[")
        f.seek(0)
        if fmt == "json" and is_array:
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: invalid JSON ({e})") from None
            items = ((rec, f"{path}: item {i}") for i, rec in enumerate(records))
        else:
            items = _json_lines(f, path)
        n = skipped = 0
        for record, where in items:
            text = text_of(record, where)
            if text.strip():
                n += 1
                yield text
            else:
                skipped += 1
    log(f"  {path}: {n:,} documents" + (f" ({skipped} empty skipped)" if skipped else ""))


def _json_lines(f, path):
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line), f"{path}:{lineno}"
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON line ({e})") from None


def expand_inputs(paths, fmt=None):
    """Files to import: each path as given, directories searched recursively for supported files (sorted)."""
    files = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = []
            for root, dirs, names in os.walk(p):
                dirs.sort()
                found += [os.path.join(root, n) for n in sorted(names) if detect_format(n)]
            if not found:
                raise ValueError(f"{p}: no .txt/.jsonl/.json/.parquet files in this directory")
            files += found
        elif os.path.isfile(p):
            if fmt is None and detect_format(p) is None:
                raise ValueError(f"{p}: unknown file type; name it .txt/.jsonl/.json/.parquet (optionally .gz) or pass --format")
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    seen, unique = set(), []  # a file named twice (or inside a named directory too) is imported once
    for f in files:
        if os.path.realpath(f) not in seen:
            seen.add(os.path.realpath(f))
            unique.append(f)
    return unique


def _write_shard(path, docs, rows_per_group):
    """Write docs as one parquet file, `rows_per_group` documents per row group, atomically."""
    tmp = path + ".tmp"
    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
        for i in range(0, len(docs), rows_per_group):
            writer.write_table(pa.table({"text": docs[i : i + rows_per_group]}, schema=schema))
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def import_corpus(
    paths,
    out_dir=None,
    val_paths=None,
    val_docs=None,
    val_fraction=0.01,
    rows_per_group=1024,
    docs_per_shard=65536,
    shuffle=True,
    seed=42,
    overwrite=False,
    fmt=None,
    text_field="text",
    txt_split="auto",
    separator=None,
    split_on=None,
    log=print,
):
    """
    Turn local text files into train shards plus one validation shard (the last file), nanochat's layout.
    Validation documents come from `val_paths` when given, else the last `val_docs` (or `val_fraction`) of the
    documents after the deterministic shuffle (random.Random(seed)). Returns a summary dict (also written to
    out_dir/import_info.json). With shuffle=False the documents stream in input order (two passes, low memory).
    """
    if rows_per_group < 1 or docs_per_shard < 1:
        raise ValueError(f"--rows_per_group and --docs_per_shard must be >= 1, got {rows_per_group}, {docs_per_shard}")
    if val_docs is not None and val_docs < 1:
        raise ValueError(f"--val_docs must be >= 1, got {val_docs}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    out_dir = base_data_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    existing = [f for f in os.listdir(out_dir) if f.endswith(".parquet") or f.endswith(".parquet.tmp") or f == IMPORT_INFO]
    if existing and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds {len([f for f in existing if f.endswith('.parquet')])} shard(s) "
            f"({', '.join(sorted(existing)[:3])}{', ...' if len(existing) > 3 else ''}); an import must not mix with "
            f"them. Pass --overwrite to replace them, or --out DIR for another directory."
        )
    files = expand_inputs(paths, fmt)
    val_files = expand_inputs(val_paths, fmt) if val_paths else []
    kw = dict(fmt=fmt, text_field=text_field, txt_split=txt_split, separator=separator, split_on=split_on, log=log)

    def stream(file_list, quiet=False):
        for path in file_list:
            yield from iter_file_documents(path, **dict(kw, log=(lambda *a: None) if quiet else log))

    log(f"Reading {len(files)} file(s)" + (f" (+ {len(val_files)} validation file(s))" if val_files else ""))
    if shuffle:
        docs = list(stream(files))
        random.Random(seed).shuffle(docs)
        total = len(docs)
    else:
        docs = None
        total = sum(1 for _ in stream(files))
    if val_files:
        val = list(stream(val_files))
        if not val:
            raise ValueError(f"the validation files hold no documents: {val_files}")
        n_train = total
    else:
        n_val = val_docs if val_docs is not None else max(1, round(total * val_fraction))
        if total - n_val < 1:
            raise ValueError(
                f"{total} document(s) cannot give {n_val} validation document(s) and at least one for training; "
                f"check how the files were split into documents (--txt_split, --separator) or lower --val_docs"
            )
        n_train = total - n_val
        val = docs[n_train:] if shuffle else None
    if n_train < 1:
        raise ValueError(f"no training documents found in {files}")

    staging = os.path.join(out_dir, f".import-staging-{os.getpid()}")
    os.makedirs(staging, exist_ok=False)
    try:
        train_names = []
        train_iter = iter(docs[:n_train]) if shuffle else stream(files, quiet=True)
        written = 0
        while written < n_train:
            chunk = []
            for doc in train_iter:
                chunk.append(doc)
                if len(chunk) == min(docs_per_shard, n_train - written):
                    break
            if not chunk:
                raise RuntimeError("the input files changed while they were being imported; run the import again")
            name = index_to_filename(len(train_names))
            _write_shard(os.path.join(staging, name), chunk, rows_per_group)
            train_names.append(name)
            written += len(chunk)
        if val is None:  # no shuffle: the validation documents are the tail of the input stream
            val = list(train_iter)
        val_name = index_to_filename(len(train_names))
        _write_shard(os.path.join(staging, val_name), val, rows_per_group)

        summary = {
            "sources": [os.path.abspath(p) for p in files],
            "val_sources": [os.path.abspath(p) for p in val_files],
            "num_train_docs": n_train,
            "num_val_docs": len(val),
            "train_shards": train_names,
            "val_shard": val_name,
            "rows_per_group": rows_per_group,
            "docs_per_shard": docs_per_shard,
            "shuffle": shuffle,
            "seed": seed,
            "txt_split": txt_split,
            "separator": separator,
            "split_on": split_on,
            "text_field": text_field,
        }
        with open(os.path.join(staging, IMPORT_INFO), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
            f.flush()
            os.fsync(f.fileno())

        # swap in: old shards out, then the new train shards in order and the validation shard last, so that an
        # interruption never leaves a train shard sitting in the validation position behind complete data
        for f in existing:
            os.remove(os.path.join(out_dir, f))
        for name in train_names + [val_name, IMPORT_INFO]:
            os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
        fsync_dir(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(
        f"Wrote {len(train_names)} train shard(s) ({n_train:,} docs) and 1 validation shard {val_name} "
        f"({len(val):,} docs) to {out_dir}, {rows_per_group} docs per row group"
    )
    return summary


