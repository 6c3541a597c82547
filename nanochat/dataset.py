"""
The pretraining data: parquet shards with a `text` column, one document per row.

Layout (nanochat's): `$NANOCHAT_BASE_DIR/base_data/shard_{i:05d}.parquet`. The shards are read in sorted order;
the LAST one is the validation split and all the others are the train split.

Two ways to fill that directory:
    python -m nanochat.dataset -n 8 -w 4          # download FineWeb-Edu 100B shards 0..7 (nanochat's command)
    python -m nanochat.dataset import PATH ...    # import local .txt / .jsonl / .json / .parquet text (offline)

Readers: `list_parquet_files()` and `parquets_iter_batched(split, start, step)` (documents one row group at a time).
The tokenizing, rank-sharded, resumable loader built on these shards is in nanochat/dataloader.py.
"""

import argparse
import functools
import gzip
import http.client
import json
import os
import random
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from multiprocessing import Pool

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.atomic import fsync_dir
from nanochat.configurator import add_dashed_aliases

# -----------------------------------------------------------------------------
# Where the shards live

BASE_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
MAX_SHARD = 1822  # the last shard index of FineWeb-Edu 100B shuffled (1823 shards, ~100 MB each)
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
        raise FileNotFoundError(f"no parquet shards in {where}: {_fill_hint()}")
    if len(paths) == 1:
        raise FileNotFoundError(
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
        pf = pq.ParquetFile(path)
        _check_text_column(pf, path)
        for rg_idx in range(start, pf.num_row_groups, step):
            yield pf.read_row_group(rg_idx, columns=["text"]).column("text").to_pylist()


def _check_text_column(pf, path):
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f"{path} has no 'text' column (columns: {pf.schema_arrow.names}); shards need one")


# -----------------------------------------------------------------------------
# Download (FineWeb-Edu 100B shuffled, the shards nanochat trains on)


class DownloadError(RuntimeError):
    pass


class _NotRetryable(DownloadError):
    pass


def _validate_parquet(path):
    """
    Raise unless `path` is a whole, readable parquet file with a text column. The footer alone is not enough: a
    resumed download whose first part came from another version of the file has a valid footer and broken pages,
    so every row group is decoded (about a second for a 100 MB shard, less than fetching it).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, size - 4))
        tail = f.read(4)
    if size < 12 or head != b"PAR1" or tail != b"PAR1":
        raise DownloadError(f"downloaded file is not a parquet file ({size} bytes, no PAR1 magic at both ends)")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError / ... depending on how the file is broken
        raise DownloadError(f"downloaded file has an unreadable parquet footer ({e})") from None
    with pf:
        _check_text_column(pf, path)
        if pf.metadata.num_rows == 0:
            raise DownloadError("downloaded parquet file has no rows")
        for rg in range(pf.num_row_groups):
            try:
                pf.read_row_group(rg, columns=["text"])
            except Exception as e:
                raise DownloadError(f"row group {rg} of the downloaded file cannot be decoded ({e})") from None


def _parse_content_range(value):
    """'bytes 100-199/200' -> (100, 200); total is None when the server writes '*'."""
    m = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value or "")
    if not m:
        return None, None
    return int(m.group(1)), (None if m.group(3) == "*" else int(m.group(3)))


def _fetch_to_tmp(url, tmp_path, timeout):
    """
    One HTTP attempt. Appends to an existing partial `tmp_path` when the server honours a Range request,
    otherwise rewrites it. Raises when the body ends before its announced length.
    """
    have = os.path.getsize(tmp_path) if os.path.exists(tmp_path) else 0
    headers = {"User-Agent": "nanochat-dataset/1.0"}
    if have > 0:
        headers["Range"] = f"bytes={have}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have > 0:
            return  # nothing past what we already hold: the .tmp may be whole (a crash before the rename); the check decides
        if 400 <= e.code < 500 and e.code not in (408, 429):
            raise _NotRetryable(f"HTTP {e.code} {e.reason} for {url}") from None
        raise DownloadError(f"HTTP {e.code} {e.reason}") from None
    with response:
        if have > 0 and response.status == 206:
            start, total = _parse_content_range(response.headers.get("Content-Range"))
            if start != have:
                os.remove(tmp_path)  # the next attempt then asks for the whole file instead of the same bad range
                raise DownloadError(f"server resumed at byte {start}, expected {have}; restarting from zero")
            mode = "ab"
        else:
            # 200: the server sends the whole file (no Range support): start over
            have, mode = 0, "wb"
            length = response.headers.get("Content-Length")
            total = int(length) if length is not None else None
        written = have
        with open(tmp_path, mode) as f:
            while True:
                chunk = response.read(1 << 20)
                if not chunk:
                    break
                f.write(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
    if total is not None and written != total:
        raise DownloadError(f"connection ended at {written} of {total} bytes")


def download_single_file(index, data_dir=None, base_url=None, max_attempts=5, backoff=2.0, timeout=60):
    """
    Download shard `index` into the data dir. Returns True when the shard is present afterwards.
    Complete shards are skipped without a request; the body goes to `<name>.tmp` (resumed with an HTTP Range
    request when a previous attempt left one), is checked to be a readable parquet file, then renamed into place.
    Failed attempts are retried after backoff * 2**(attempt-1) seconds.
    """
    data_dir = get_data_dir(data_dir)
    base_url = (base_url or os.environ.get("NANOCHAT_DATA_URL") or BASE_URL).rstrip("/")
    filename = index_to_filename(index)
    path = os.path.join(data_dir, filename)
    if os.path.exists(path):
        print(f"Skipping {filename} (already downloaded)")
        return True
    url = f"{base_url}/{filename}"
    tmp_path = path + ".tmp"
    print(f"Downloading {filename}...")
    for attempt in range(1, max_attempts + 1):
        try:
            _fetch_to_tmp(url, tmp_path, timeout)
            try:
                _validate_parquet(tmp_path)
            except (DownloadError, ValueError):
                # bad bytes on disk: resuming from them would only extend the damage, so start from zero
                os.remove(tmp_path)
                raise
            os.replace(tmp_path, path)
            fsync_dir(data_dir)
            print(f"Successfully downloaded {filename}")
            return True
        except _NotRetryable as e:
            print(f"Failed to download {filename}: {e} (not retrying; check the base URL, --base_url or $NANOCHAT_DATA_URL)")
            return False
        except (DownloadError, ValueError, OSError, http.client.HTTPException) as e:  # URLError, timeouts: OSError
            if attempt == max_attempts:
                print(f"Failed to download {filename} after {max_attempts} attempts: {e}")
                return False
            wait = backoff * 2 ** (attempt - 1)
            print(f"Attempt {attempt}/{max_attempts} for {filename} failed: {e}; retrying in {wait:g}s")
            time.sleep(wait)
    return False


def _refuse_imported_corpus(data_dir):
    if os.path.exists(os.path.join(data_dir, IMPORT_INFO)):
        raise FileExistsError(
            f"{data_dir} holds an imported corpus ({IMPORT_INFO}); downloading FineWeb-Edu shards next to it would "
            f"mix the two and shift the validation shard. Move that directory away or set NANOCHAT_BASE_DIR elsewhere."
        )


def download_shards(indices, data_dir=None, base_url=None, num_workers=4, max_attempts=5, backoff=2.0, timeout=60):
    """Download the given shard indices with a pool of `num_workers` processes. Returns the indices that failed."""
    data_dir = get_data_dir(data_dir)
    _refuse_imported_corpus(data_dir)
    indices = list(indices)
    fetch = functools.partial(
        download_single_file, data_dir=data_dir, base_url=base_url, max_attempts=max_attempts, backoff=backoff, timeout=timeout
    )
    if num_workers <= 1:
        results = [fetch(i) for i in indices]
    else:
        with Pool(processes=num_workers) as pool:
            results = pool.map(fetch, indices, chunksize=1)
    return [i for i, ok in zip(indices, results) if not ok]


def download_main(argv):
    parser = argparse.ArgumentParser(
        prog="python -m nanochat.dataset",
        description="Download FineWeb-Edu 100B shuffled pretraining shards (or: `python -m nanochat.dataset import --help`).",
    )
    parser.add_argument("-n", "--num_files", type=int, default=-1, help=f"number of shards to download, shards 0..N-1 (default: -1 = all {MAX_SHARD + 1})")
    parser.add_argument("-w", "--num_workers", type=int, default=4, help="parallel download processes (default: 4)")
    parser.add_argument("--base_url", default=None, help=f"mirror to fetch from (default: $NANOCHAT_DATA_URL or {BASE_URL})")
    parser.add_argument("--max_attempts", type=int, default=5, help="attempts per shard (default: 5)")
    add_dashed_aliases(parser)
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
        _refuse_imported_corpus(data_dir)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    workers = min(args.num_workers, num)
    print(f"Downloading {num} shards using {workers} workers...")
    print(f"Target directory: {data_dir}")
    failed = download_shards(range(num), data_dir, args.base_url, workers, args.max_attempts)
    print(f"Done! Downloaded: {num - len(failed)}/{num} shards to {data_dir}")
    if failed:
        print(f"error: {len(failed)} shard(s) failed: {', '.join(index_to_filename(i) for i in failed[:10])}"
              f"{' ...' if len(failed) > 10 else ''}; run the same command again to resume (partial files are kept). "
              f"Offline? Import local text instead: python -m nanochat.dataset import PATH", file=sys.stderr)
        return 1
    return 0


# -----------------------------------------------------------------------------
# Import local text into the same shard format


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
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise ValueError(f"{path} has no {text_field!r} column (columns: {pf.schema_arrow.names}); pass --text_field NAME")
        n = skipped = 0
        for rg in range(pf.num_row_groups):
            for value in pf.read_row_group(rg, columns=[text_field]).column(text_field).to_pylist():
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
    out_dir = get_data_dir(out_dir)
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


def import_main(argv):
    parser = argparse.ArgumentParser(
        prog="python -m nanochat.dataset import",
        description="Import local text into pretraining shards (train shards + the last shard as validation).",
    )
    parser.add_argument("paths", nargs="+", help="files or directories: .txt, .jsonl, .json, .parquet (optionally .gz)")
    parser.add_argument("--out", default=None, help="output directory (default: $NANOCHAT_BASE_DIR/base_data)")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards already in the output directory")
    parser.add_argument("--format", choices=SUPPORTED_FORMATS, default=None, help="force the input format (default: by extension)")
    parser.add_argument("--text_field", default="text", help="JSON field / parquet column holding the text (default: text)")
    parser.add_argument("--txt_split", choices=TXT_SPLITS, default="auto",
                        help="how .txt files become documents: blank-line paragraphs, one per line, whole file, "
                             "WikiText articles; auto = <|endoftext|> if present, else wikitext/blank/line (default: auto)")
    parser.add_argument("--separator", default=None, help="literal document separator for .txt, e.g. '<|endoftext|>'")
    parser.add_argument("--split_on", default=None,
                        help="regex (multiline) splitting .txt into documents; a lookahead such as '(?=^# )' keeps the match")
    parser.add_argument("--val_paths", nargs="+", default=None, help="files whose documents form the validation shard")
    parser.add_argument("--val_docs", type=int, default=None, help="number of documents held out for validation")
    parser.add_argument("--val_fraction", type=float, default=0.01, help="fraction held out when --val_docs is not given (default: 0.01)")
    parser.add_argument("--rows_per_group", type=int, default=1024, help="documents per parquet row group (default: 1024)")
    parser.add_argument("--docs_per_shard", type=int, default=65536, help="documents per train shard (default: 65536)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the document shuffle (default: 42)")
    parser.add_argument("--no_shuffle", action="store_true", help="keep input order and stream (low memory); validation = the last documents")
    add_dashed_aliases(parser)
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
        print(f"error: {e}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
