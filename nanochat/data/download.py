"""
Fetching files over HTTP.

- `download_file(url, dest)`: one small file (task data, the CORE eval bundle), written atomically.
- `download_single_file(index)` / `download_shards(indices)`: the pretraining shards of a web source of
  nanochat/dataset.py's SOURCES (FineWeb-Edu 100B, nanochat's December data, by default; ClimbMix 400B, the record
  recipe's, with source="climbmix"), into that source's shard directory. A shard's body goes to `<name>.tmp`, is
  resumed with an HTTP Range request after an interrupted attempt, is checked to be a whole readable parquet file,
  then renamed into place; failed attempts are retried with exponential backoff.

The command line is nanochat's `python -m nanochat.dataset -n 8 -w 4` (nanochat/data/cli.py).
"""

import functools
import http.client
import os
import re
import shutil
import signal
import time
import urllib.error
import urllib.request
from multiprocessing import Pool
from pathlib import Path

import pyarrow.parquet as pq

from nanochat.atomic import atomic_write, fsync_dir
from nanochat.dataset import DEFAULT_SOURCE, IMPORT_INFO, SOURCES, base_data_dir, check_text_column, index_to_filename


def download_file(url, dest, timeout=15.0):
    """
    Download url to dest atomically (nanochat.atomic: unique tmp file + fsync + rename), so concurrent ranks that race to
    fetch the same file each write their own tmp and the last rename wins with a complete file.
    Raises OSError (urllib.error.URLError) on any network failure; a partial file is never left at dest.
    """
    dest = Path(dest)
    # the response is opened first, so a network failure leaves nothing behind; each writer has its own temp file
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        atomic_write(str(dest), lambda f: shutil.copyfileobj(resp, f, 1 << 20))
    return dest


# -----------------------------------------------------------------------------
# pretraining shards


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
        check_text_column(pf, path)
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


def download_single_file(index, data_dir=None, base_url=None, max_attempts=5, backoff=2.0, timeout=60,
                         source=DEFAULT_SOURCE):
    """
    Download shard `index` of `source` into the data dir (default: the source's). Returns True when the shard is
    present afterwards. Complete shards are skipped without a request; the body goes to `<name>.tmp` (resumed with an
    HTTP Range request when a previous attempt left one), is checked to be a readable parquet file, then renamed into
    place. Failed attempts are retried after backoff * 2**(attempt-1) seconds. base_url: a mirror; default the
    source's environment variable (NANOCHAT_DATA_URL, NANOCHAT_CLIMBMIX_URL), else its Hugging Face address.
    """
    data_dir = base_data_dir(data_dir, source)
    src = SOURCES[source]
    base_url = (base_url or os.environ.get(src.url_env) or src.base_url).rstrip("/")
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
            print(f"Failed to download {filename}: {e} (not retrying; check the base URL, --base_url or ${src.url_env})")
            return False
        except (DownloadError, ValueError, OSError, http.client.HTTPException) as e:  # URLError, timeouts: OSError
            if attempt == max_attempts:
                print(f"Failed to download {filename} after {max_attempts} attempts: {e}")
                return False
            wait = backoff * 2 ** (attempt - 1)
            print(f"Attempt {attempt}/{max_attempts} for {filename} failed: {e}; retrying in {wait:g}s")
            time.sleep(wait)
    return False


def refuse_imported_corpus(data_dir, source=DEFAULT_SOURCE):
    if os.path.exists(os.path.join(data_dir, IMPORT_INFO)):
        raise FileExistsError(
            f"{data_dir} holds an imported corpus ({IMPORT_INFO}); downloading {SOURCES[source].title} shards next to "
            f"it would mix the two and shift the validation shard. Move that directory away or set NANOCHAT_BASE_DIR "
            f"elsewhere."
        )


def shard_indices(source, num_files):
    """The shards `python -m nanochat.dataset -n N` fetches: FineWeb-Edu 0..N-1 (the last of them is the validation
    split); ClimbMix, as nanochat 92d63d4, N train shards 0..N-1 and its validation shard, the last one (-1: all)."""
    src = SOURCES[source]
    if src.val_shard is None:
        return list(range(src.max_shard + 1 if num_files == -1 else min(num_files, src.max_shard + 1)))
    train = src.max_shard if num_files == -1 else min(num_files, src.max_shard)
    return list(range(train)) + [src.val_shard]  # the validation shard is the last index


def _default_stop_signals():
    """A download worker's signals as a fresh process has them: a worker forked from a process that handles SIGTERM
    itself (a training stage's StopSignal, a test's handler) would inherit the handler, survive Pool.terminate's
    SIGTERM, and the pool's exit could wait for it forever."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def worker_pool(num_workers):
    """The download processes, each started with the default stop signals (_default_stop_signals)."""
    return Pool(processes=num_workers, initializer=_default_stop_signals)


def download_shards(indices, data_dir=None, base_url=None, num_workers=4, max_attempts=5, backoff=2.0, timeout=60,
                    source=DEFAULT_SOURCE):
    """Download the given shard indices of `source` with a pool of `num_workers` processes. Returns the indices that
    failed."""
    data_dir = base_data_dir(data_dir, source)
    refuse_imported_corpus(data_dir, source)
    indices = list(indices)
    fetch = functools.partial(
        download_single_file, data_dir=data_dir, base_url=base_url, max_attempts=max_attempts, backoff=backoff,
        timeout=timeout, source=source
    )
    if num_workers <= 1:
        results = [fetch(i) for i in indices]
    else:
        with worker_pool(num_workers) as pool:
            results = pool.map(fetch, indices, chunksize=1)
    return [i for i, ok in zip(indices, results) if not ok]


