"""
nanochat/dataset.py: shard listing and streaming, the downloader (against a real HTTP server on 127.0.0.1) and the
importer of local text (on excerpts of the real corpora in tests/assets, and on the full corpora of
../shared/data/pretrain when it is beside the repo, with the counts docs/data.md gives).
"""

import gzip
import http.server
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset
from nanochat.data import cli
from nanochat.data.corpus_import import import_corpus, iter_file_documents, split_text
from nanochat.data.download import download_shards, download_single_file, shard_indices
from nanochat.dataset import list_parquet_files, parquets_iter_batched

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "tests" / "assets" / "data" / "pretrain"  # excerpts of ../shared/data/pretrain (tests/assets)
SHARED_PRETRAIN = REPO.parent / "shared" / "data" / "pretrain"


def write_shard(path, docs, rows_per_group):
    table = pa.table({"text": docs})
    pq.write_table(table, path, row_group_size=rows_per_group)


def shard_bytes(docs, rows_per_group=2):
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, row_group_size=rows_per_group)
    return buf.getvalue()


def read_docs(path):
    return pq.read_table(path).column("text").to_pylist()


def row_group_sizes(path):
    md = pq.ParquetFile(path).metadata
    return [md.row_group(i).num_rows for i in range(md.num_row_groups)]


# -----------------------------------------------------------------------------
# listing and streaming


def test_list_and_iter_batched_start_step(tmp_path):
    # 3 train shards with 3, 1 and 4 row groups of 2 docs, and a validation shard with 2 row groups
    layout = {0: 3, 1: 1, 2: 4, 3: 2}
    for s, n_rg in layout.items():
        write_shard(tmp_path / f"shard_{s:05d}.parquet", [f"s{s}r{r}d{d}" for r in range(n_rg) for d in range(2)], 2)
    (tmp_path / "shard_00004.parquet.tmp").write_bytes(b"partial download")  # must be ignored
    assert [os.path.basename(p) for p in list_parquet_files(tmp_path)] == [f"shard_{s:05d}.parquet" for s in range(4)]

    def groups(split, start=0, step=1):
        out = []
        for docs in parquets_iter_batched(split, start=start, step=step, data_dir=tmp_path):
            assert len(docs) == 2 and docs[0][:-2] == docs[1][:-2]
            out.append(docs[0][:-2])
        return out

    assert groups("train") == ["s0r0", "s0r1", "s0r2", "s1r0", "s2r0", "s2r1", "s2r2", "s2r3"]
    assert groups("val") == ["s3r0", "s3r1"]
    # start/step stride within each file (nanochat's semantics: the loader does the global sharding)
    assert groups("train", start=1, step=2) == ["s0r1", "s2r1", "s2r3"]
    assert groups("train", start=0, step=3) == ["s0r0", "s1r0", "s2r0", "s2r3"]
    assert groups("val", start=1, step=2) == ["s3r1"]
    with pytest.raises(ValueError, match="split must be"):
        next(parquets_iter_batched("test", data_dir=tmp_path))


def test_missing_shards_errors_name_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m nanochat\.dataset -n 8.*import PATH"):
        next(parquets_iter_batched("train", data_dir=tmp_path))
    write_shard(tmp_path / "shard_00000.parquet", ["only"], 1)
    with pytest.raises(FileNotFoundError, match=r"only one shard.*at least 2.*python -m nanochat\.dataset"):
        next(parquets_iter_batched("val", data_dir=tmp_path))


def _damage_row_group(path, rg):
    """Overwrite bytes in the middle of row group `rg`'s compressed text column: the footer stays valid."""
    col = pq.ParquetFile(path).metadata.row_group(rg).column(0)
    start = col.dictionary_page_offset or col.data_page_offset
    data = bytearray(Path(path).read_bytes())
    mid = start + col.total_compressed_size // 2
    data[mid : mid + 16] = b"\xff" * 16
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("how, says", [
    ("truncated", r"is truncated or not a parquet file \([\d,]+ bytes\) \(ArrowInvalid"),
    ("empty", r"is empty \(0 bytes\)"),
    ("garbage", r"is truncated or not a parquet file"),
    ("no_text", r"has no 'text' column \(columns: \['content'\]\)"),
    ("int_text", r"the 'text' column holds int64, not strings"),
    ("damaged_row_group", r": row group 1 cannot be read, the file is damaged \(OSError: ZSTD"),
])
@pytest.mark.parametrize("imported", [False, True])
def test_damaged_shard_is_named_with_the_fix(tmp_path, how, says, imported):
    """A bad shard stops the reader with its path and how to replace it (re-download, or re-import)."""
    docs = [f"document {i} " + "word " * (i % 50) for i in range(400)]
    bad = tmp_path / "shard_00000.parquet"
    pq.write_table(pa.table({"text": docs}), bad, row_group_size=100, compression="zstd")
    write_shard(tmp_path / "shard_00001.parquet", ["val"], 1)
    if imported:
        (tmp_path / dataset.IMPORT_INFO).write_text("{}")
    data = bad.read_bytes()
    if how == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        bad.write_bytes(b"")
    elif how == "garbage":
        bad.write_bytes(b"not a parquet file at all" * 100)
    elif how == "no_text":
        pq.write_table(pa.table({"content": docs}), bad)
    elif how == "int_text":
        pq.write_table(pa.table({"text": list(range(10))}), bad)
    else:
        _damage_row_group(bad, 1)
    fix = r"import it again with `python -m nanochat.dataset import" if imported else (
        r"move shard_00000.parquet out of .* and run `python -m nanochat.dataset -n N` again")
    with pytest.raises(ValueError, match=re.escape(str(bad)) + ".*" + says + ".*" + fix):
        list(parquets_iter_batched("train", data_dir=tmp_path))


def test_import_names_a_damaged_input_parquet(tmp_path):
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.parquet is empty, truncated or not a parquet file"):
        list(iter_file_documents(str(tmp_path / "empty.parquet"), log=lambda *a: None))
    docs = [f"document {i} " + "word " * (i % 50) for i in range(400)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "in.parquet", row_group_size=100, compression="zstd")
    _damage_row_group(tmp_path / "in.parquet", 1)
    with pytest.raises(ValueError, match=r"in\.parquet: row group 1 cannot be read, the file is damaged"):
        list(iter_file_documents(str(tmp_path / "in.parquet"), log=lambda *a: None))


def test_default_data_dir_is_base_dir_base_data(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    assert dataset.base_data_dir() == str(tmp_path / "base_data")
    write_shard(tmp_path / "base_data" / "shard_00000.parquet", ["a"], 1)
    write_shard(tmp_path / "base_data" / "shard_00001.parquet", ["b"], 1)
    assert list(parquets_iter_batched("train")) == [["a"]]
    assert list(parquets_iter_batched("val")) == [["b"]]


# -----------------------------------------------------------------------------
# downloader against a local HTTP server


class ShardServer:
    """http.server in a thread serving in-memory files, with Range support and scripted failures."""

    def __init__(self):
        self.files = {}  # name -> bytes
        self.fail_first = {}  # name -> number of leading requests answered with 503
        self.cut_first = {}  # name -> number of leading requests whose body stops half way
        self.ignore_range = False
        self.misreport_range = 0  # leading Range requests answered 206 with the whole file (a wrong Content-Range)
        self.requests = []  # (name, Range header or None)
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                rng = self.headers.get("Range")
                with server.lock:
                    server.requests.append((name, rng))
                    n_seen = sum(1 for r in server.requests if r[0] == name)
                if name not in server.files:
                    self.send_error(404)
                    return
                if n_seen <= server.fail_first.get(name, 0):
                    self.send_error(503, "try later")
                    return
                body = server.files[name]
                start = 0
                if rng and server.misreport_range > 0:
                    with server.lock:
                        server.misreport_range -= 1
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes 0-{len(body) - 1}/{len(body)}")
                elif rng and not server.ignore_range:
                    start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
                    if start >= len(body):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(body)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                part = body[start:]
                self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                if n_seen <= server.fail_first.get(name, 0) + server.cut_first.get(name, 0):
                    self.wfile.write(part[: len(part) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(part)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/resolve/main"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def names_requested(self):
        return [n for n, _ in self.requests]


@pytest.fixture
def server():
    s = ShardServer()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def add_shards(server, n):
    for i in range(n):
        server.files[f"shard_{i:05d}.parquet"] = shard_bytes([f"document {i}.{j} " * (j + 3) for j in range(50)])


def fast(**kw):
    return dict(dict(max_attempts=4, backoff=0.01, timeout=10), **kw)


def test_download_then_skip_complete_without_requests(server, tmp_path):
    add_shards(server, 3)
    assert download_shards(range(3), tmp_path, server.url, num_workers=1, **fast()) == []
    for name, body in server.files.items():
        assert (tmp_path / name).read_bytes() == body
    assert sorted(server.names_requested()) == sorted(server.files)
    assert all(r is None for _, r in server.requests)
    assert not list(tmp_path.glob("*.tmp"))
    server.requests.clear()
    assert download_shards(range(3), tmp_path, server.url, num_workers=1, **fast()) == []
    assert server.requests == []  # complete files: not a single request


def test_download_restarts_when_server_resumes_at_wrong_offset(server, tmp_path):
    """A partial .tmp resumed at the wrong byte is thrown away, so the next attempt fetches the whole file."""
    add_shards(server, 1)
    name = "shard_00000.parquet"
    body = server.files[name]
    (tmp_path / (name + ".tmp")).write_bytes(body[:100])
    server.misreport_range = 99  # every Range request gets the wrong answer: only a restart from zero can succeed
    assert download_shards(range(1), tmp_path, server.url, num_workers=1, **fast()) == []
    assert (tmp_path / name).read_bytes() == body
    assert [r for _, r in server.requests] == ["bytes=100-", None]


def test_download_retries_server_errors(server, tmp_path):
    add_shards(server, 1)
    server.fail_first["shard_00000.parquet"] = 2
    assert download_single_file(0, tmp_path, server.url, **fast())
    assert server.names_requested() == ["shard_00000.parquet"] * 3
    assert (tmp_path / "shard_00000.parquet").read_bytes() == server.files["shard_00000.parquet"]


def test_nanochat_names_stay_in_nanochat_dataset(server, tmp_path):
    """nanochat's `from nanochat.dataset import download_single_file, MAX_SHARD, ...` keeps working, though the
    downloader lives in nanochat/data/download.py."""
    add_shards(server, 1)
    assert dataset.download_single_file(0, tmp_path, server.url, **fast())
    assert (tmp_path / "shard_00000.parquet").read_bytes() == server.files["shard_00000.parquet"]
    assert dataset.index_to_filename(dataset.MAX_SHARD) == "shard_01822.parquet"
    assert dataset.BASE_URL.endswith("/karpathy/fineweb-edu-100b-shuffle/resolve/main")


def test_reading_shards_loads_no_upper_layer():
    """nanochat.dataset is the bottom layer: importing it loads neither the downloader, the importer nor torch."""
    code = "import sys, nanochat.dataset; print(*sorted(m for m in sys.modules if m.startswith(('nanochat', 'torch'))))"
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    loaded = p.stdout.split()
    assert "nanochat.dataset" in loaded
    assert [m for m in loaded if m.startswith("nanochat.data.") or m.split(".")[0] == "torch"] == [], loaded


def test_download_gives_up_after_max_attempts(server, tmp_path):
    add_shards(server, 1)
    server.fail_first["shard_00000.parquet"] = 10
    assert not download_single_file(0, tmp_path, server.url, **fast(max_attempts=3))
    assert len(server.requests) == 3
    assert not (tmp_path / "shard_00000.parquet").exists()


def test_cut_body_leaves_partial_tmp_then_resumes_with_range(server, tmp_path):
    add_shards(server, 1)
    name = "shard_00000.parquet"
    body = server.files[name]
    server.cut_first[name] = 1
    # one attempt only: the body stops half way, so the .tmp holds a prefix and nothing is renamed
    assert not download_single_file(0, tmp_path, server.url, **fast(max_attempts=1))
    assert not (tmp_path / name).exists()
    partial = (tmp_path / (name + ".tmp")).read_bytes()
    assert 0 < len(partial) < len(body) and body.startswith(partial)
    # the next run resumes from the partial file with a Range request
    assert download_single_file(0, tmp_path, server.url, **fast())
    assert server.requests == [(name, None), (name, f"bytes={len(partial)}-")]
    assert (tmp_path / name).read_bytes() == body
    assert not (tmp_path / (name + ".tmp")).exists()


def test_cut_body_retried_within_one_call(server, tmp_path):
    add_shards(server, 1)
    name = "shard_00000.parquet"
    server.cut_first[name] = 2  # the first request and the first resume are both cut
    assert download_single_file(0, tmp_path, server.url, **fast())
    assert len(server.requests) == 3
    assert server.requests[0][1] is None and server.requests[1][1] is not None and server.requests[2][1] is not None
    assert (tmp_path / name).read_bytes() == server.files[name]


def test_partial_tmp_replaced_when_server_ignores_range(server, tmp_path):
    add_shards(server, 1)
    name = "shard_00000.parquet"
    server.ignore_range = True
    (tmp_path / (name + ".tmp")).write_bytes(b"stale bytes from an older attempt")
    assert download_single_file(0, tmp_path, server.url, **fast())
    assert server.requests == [(name, "bytes=33-")]
    assert (tmp_path / name).read_bytes() == server.files[name]


@pytest.mark.parametrize("damage", ["header", "pages"])
def test_corrupt_partial_tmp_is_discarded_and_fetched_fresh(server, tmp_path, damage):
    add_shards(server, 1)
    name = "shard_00000.parquet"
    body = server.files[name]
    # a .tmp that is not a prefix of the real file: garbage from the start, or a right magic with garbage pages
    # (the resumed file then has a valid footer: only decoding the row groups finds the damage)
    stale = b"X" * 100 if damage == "header" else b"PAR1" + b"X" * (len(body) // 2)
    (tmp_path / (name + ".tmp")).write_bytes(stale)
    assert download_single_file(0, tmp_path, server.url, **fast())
    # resumed first (the bytes looked like a prefix), validation failed, so the second request starts at zero
    assert server.requests == [(name, f"bytes={len(stale)}-"), (name, None)]
    assert (tmp_path / name).read_bytes() == body


def test_complete_tmp_left_from_crash_before_rename(server, tmp_path):
    add_shards(server, 1)
    name = "shard_00000.parquet"
    (tmp_path / (name + ".tmp")).write_bytes(server.files[name])
    assert download_single_file(0, tmp_path, server.url, **fast())
    assert server.requests == [(name, f"bytes={len(server.files[name])}-")]  # answered 416: nothing left to fetch
    assert (tmp_path / name).read_bytes() == server.files[name]


def test_non_parquet_body_is_never_renamed(server, tmp_path):
    server.files["shard_00000.parquet"] = b"<html>rate limited</html>"
    assert not download_single_file(0, tmp_path, server.url, **fast(max_attempts=2))
    assert len(server.requests) == 2
    assert list(tmp_path.iterdir()) == []


def test_404_is_not_retried(server, tmp_path):
    assert not download_single_file(7, tmp_path, server.url, **fast())
    assert server.names_requested() == ["shard_00007.parquet"]


def test_download_with_worker_pool(server, tmp_path):
    add_shards(server, 5)
    server.fail_first["shard_00003.parquet"] = 1
    assert download_shards(range(5), tmp_path, server.url, num_workers=2, **fast()) == []
    for name, body in server.files.items():
        assert (tmp_path / name).read_bytes() == body
    assert len(server.requests) == 6


def test_download_workers_die_of_sigterm_whatever_this_process_does_with_it(server, tmp_path):
    """A training stage records SIGTERM (StopSignal) rather than die of it; download workers forked from such a
    process inherited that handler, outlived Pool.terminate's SIGTERM and hung the pool's exit (seen in CI: a worker
    waiting for the task queue's lock forever, after a test left its handler installed). Each worker now starts
    with the default stop signals; and a download from such a process ends. In a child, with a time limit."""
    add_shards(server, 4)
    code = (
        "import signal\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"
        "signal.signal(signal.SIGUSR1, lambda *a: None)\n"
        "from nanochat.data.download import download_shards, worker_pool\n"
        "with worker_pool(2) as pool:\n"
        "    print([pool.apply(signal.getsignal, (s,)) == signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGUSR1)])\n"
        f"print(download_shards(range(4), {str(tmp_path)!r}, {server.url!r}, num_workers=3))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "[True, True]" and lines[-1] == "[]", r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"shard_{i:05d}.parquet" for i in range(4)]


def test_download_refuses_to_mix_with_an_imported_corpus(server, tmp_path):
    (tmp_path / dataset.IMPORT_INFO).write_text("{}")
    with pytest.raises(FileExistsError, match="imported corpus"):
        download_shards(range(1), tmp_path, server.url, num_workers=1)
    assert server.requests == []


def run_cli(args, base_dir, env_extra=None):
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base_dir), PYTHONPATH=str(REPO))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "nanochat.dataset", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # interpreter start-ups
def test_cli_download_nanochat_flags(server, tmp_path, monkeypatch, capsys):
    add_shards(server, 3)
    # nanochat's command line, the mirror from the environment
    res = run_cli(["-n", "2", "-w", "2"], tmp_path, {"NANOCHAT_DATA_URL": server.url})
    assert res.returncode == 0, res.stderr
    assert "Downloaded: 2/2" in res.stdout
    assert sorted(p.name for p in (tmp_path / "base_data").iterdir()) == ["shard_00000.parquet", "shard_00001.parquet"]
    # the flag form (dashed alias) wins over the environment; present shards are skipped; shard 3 is missing on
    # the server, so the command fails after fetching shard 2
    # (in-process from here on: a second interpreter start, with torch, costs seconds on a busy 2-core machine)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("NANOCHAT_DATA_URL", "http://127.0.0.1:9/nothing-here")
    assert cli.main(["--num-files", "4", "--base_url", server.url, "--max-attempts", "2"]) == 1
    out, err = capsys.readouterr()
    assert "shard_00003.parquet" in err and "Downloaded: 3/4" in out
    assert (tmp_path / "base_data" / "shard_00002.parquet").read_bytes() == server.files["shard_00002.parquet"]
    assert server.names_requested().count("shard_00000.parquet") == 1


# -----------------------------------------------------------------------------
# ClimbMix, the record recipe's data: its own directory, URL and validation shard, through the same downloader


def test_climbmix_source_is_nanochat_92d63d4s():
    climbmix = dataset.SOURCES["climbmix"]
    assert climbmix.base_url == "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
    assert (climbmix.dir_name, climbmix.max_shard, climbmix.val_shard) == ("base_data_climbmix", 6542, 6542)
    assert dataset.index_to_filename(climbmix.val_shard) == "shard_06542.parquet"
    assert shard_indices("fineweb_edu", 3) == [0, 1, 2] and len(shard_indices("fineweb_edu", -1)) == 1823
    assert shard_indices("climbmix", 3) == [0, 1, 2, 6542]  # -n counts train shards; validation is always fetched
    assert shard_indices("climbmix", -1) == list(range(6543)) == shard_indices("climbmix", 10**6)


def test_climbmix_download_into_its_directory_with_retries_and_resume(server, tmp_path, monkeypatch, capsys):
    """`python -m nanochat.dataset --data=climbmix -n 2`: shards 0, 1 and the validation shard 6542 from the mirror in
    $NANOCHAT_CLIMBMIX_URL into base_data_climbmix/, a 503 retried, a body cut short resumed with Range, the last shard
    the validation split."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("NANOCHAT_CLIMBMIX_URL", server.url)
    monkeypatch.setenv("NANOCHAT_DATA_URL", "http://127.0.0.1:9/not-this-one")
    monkeypatch.setattr("nanochat.data.download.time.sleep", lambda s: None)  # the 2 s backoff
    for i in (0, 1, 2, 6542):
        server.files[dataset.index_to_filename(i)] = shard_bytes([f"climbmix {i}.{j} " * (j + 3) for j in range(50)])
    server.fail_first["shard_00001.parquet"] = 1
    server.cut_first["shard_06542.parquet"] = 1
    assert cli.main(["--data=climbmix", "-n", "2", "-w", "1"]) == 0
    out = capsys.readouterr().out
    assert "Downloaded: 3/3" in out and "ClimbMix 400B" in out
    climbmix = tmp_path / "base_data_climbmix"
    assert sorted(p.name for p in climbmix.iterdir()) == ["shard_00000.parquet", "shard_00001.parquet",
                                                          "shard_06542.parquet"]
    for p in climbmix.iterdir():
        assert p.read_bytes() == server.files[p.name]
    assert server.requests.count(("shard_06542.parquet", None)) == 1  # the cut body was resumed, not fetched again
    assert any(n == "shard_06542.parquet" and r and r.startswith("bytes=") for n, r in server.requests)
    assert not (tmp_path / "base_data").exists() or not list((tmp_path / "base_data").iterdir())
    assert read_docs(dataset.split_parquet_files("val", climbmix)[0]) == read_docs(climbmix / "shard_06542.parquet")
    # more train shards later: only the new one is fetched, the validation shard stays the last
    server.requests.clear()
    assert cli.main(["--data", "climbmix", "-n", "3", "-w", "1"]) == 0
    assert server.names_requested() == ["shard_00002.parquet"]
    assert [os.path.basename(p) for p in dataset.split_parquet_files("val", climbmix)] == ["shard_06542.parquet"]


def test_climbmix_messages_name_the_data_flag(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    climbmix = dataset.base_data_dir(source="climbmix")
    assert climbmix == str(tmp_path / "base_data_climbmix")
    with pytest.raises(FileNotFoundError, match=r"python -m nanochat\.dataset --data=climbmix -n 8` \(downloads "
                                                 r"ClimbMix 400B.*import PATH --data=climbmix"):
        dataset.split_parquet_files("train", climbmix)
    (tmp_path / "base_data_climbmix" / dataset.IMPORT_INFO).write_text("{}")
    assert cli.main(["--data=climbmix", "-n", "1", "--base_url", server.url]) == 1
    assert "downloading ClimbMix 400B shards next to it would mix" in capsys.readouterr().err
    assert server.requests == []
    # a 404 names the ClimbMix mirror variable
    (tmp_path / "base_data_climbmix" / dataset.IMPORT_INFO).unlink()
    assert not download_single_file(0, None, server.url, source="climbmix", **fast())
    assert "$NANOCHAT_CLIMBMIX_URL" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--data must be one of fineweb_edu, climbmix"):
        dataset.resolve_source("fineweb")
    assert dataset.resolve_source(None, "climbmix") == "climbmix" and dataset.resolve_source("fineweb_edu") == "fineweb_edu"


def test_import_into_the_climbmix_layout(tmp_path, monkeypatch, capsys):
    """Offline, a local corpus can stand in for ClimbMix: `import --data=climbmix` writes base_data_climbmix/."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    src = str(PRETRAIN / "c4_demo" / "c4_demo.jsonl")
    assert cli.main(["import", src, "--data=climbmix", "--val_docs", "2"]) == 0
    train, val = shard_summary(tmp_path / "base_data_climbmix")
    assert sum(map(len, train)) > 0 and len(val) == 2 and not (tmp_path / "base_data").exists()
    with pytest.raises(SystemExit):
        cli.main(["import", src, "--data=climbmix", "--out", str(tmp_path / "x")])
    assert "either --out DIR or --data" in capsys.readouterr().err
    bad = tmp_path / "base_data_climbmix" / "shard_00000.parquet"
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match=r"import \.\.\. --data=climbmix --overwrite"):
        list(parquets_iter_batched("train", data_dir=tmp_path / "base_data_climbmix"))


def test_tok_train_reads_the_climbmix_directory(tmp_path, monkeypatch):
    """The record pipeline trains its tokenizer on ClimbMix, as nanochat 92d63d4 does: tok_train --data=climbmix."""
    from scripts import tok_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"base_data_climbmix, which has 0 shard.*python -m nanochat\.dataset "
                                                 r"--data=climbmix -n 8` downloads ClimbMix 400B"):
        tok_train.main(["--data=climbmix", "--vocab_size=300"])
    climbmix = tmp_path / "base_data_climbmix"
    write_shard(climbmix / "shard_00000.parquet", ["zqzqzq zqzqzq zqzqzq"] * 20, 10)
    write_shard(climbmix / "shard_06542.parquet", ["val"], 1)
    tok_train.main(["--data=climbmix", "--vocab_size=300"])
    from nanochat.tokenizer import RustBPETokenizer

    tok = RustBPETokenizer.from_directory(str(tmp_path / "tokenizer"))
    assert len(tok.encode(" zqzqzq")) == 1  # learned from the ClimbMix directory's text


def test_cli_rejects_bad_counts(capsys):
    for argv in (["-n", "0"], ["-n", "-5"], ["-n", "3", "-w", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
    assert "-n must be" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# importer: excerpts of the real corpora (tests/assets/data/pretrain)


def shard_summary(out):
    paths = list_parquet_files(out)
    return [read_docs(p) for p in paths[:-1]], read_docs(paths[-1])


def all_train_docs(out):
    return [d for docs in shard_summary(out)[0] for d in docs]


def paragraphs(text):
    """Blank-line separated paragraphs, counted line by line (independent of the importer's regex)."""
    out, cur = [], []
    for line in text.split("\n"):
        if line.strip():
            cur.append(line)
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


def test_import_wikitext2_one_document_per_article(tmp_path):
    train, valid = PRETRAIN / "wikitext-2" / "train.txt", PRETRAIN / "wikitext-2" / "valid.txt"
    summary = import_corpus([train], out_dir=tmp_path, val_paths=[valid], log=lambda *a: None)
    train_docs, val_docs = shard_summary(tmp_path)
    # the excerpt holds the first 3 train and 4 validation articles
    assert summary["num_train_docs"] == 3 and sum(map(len, train_docs)) == 3
    assert len(val_docs) == 4 and summary["num_val_docs"] == 4
    titles = [d.split("\n", 1)[0] for d in all_train_docs(tmp_path)]
    assert all(re.fullmatch(r" = [^=].* = ", t) for t in titles)
    assert " = Valkyria Chronicles III = " in titles
    # no text lost: every non-blank line of the file is in exactly one article
    lines = [l.rstrip() for l in train.read_text(encoding="utf-8").split("\n") if l.strip()]
    got = [l.rstrip() for d in all_train_docs(tmp_path) for l in d.split("\n") if l.strip()]
    assert sorted(got) == sorted(lines)


def test_import_tinystories_row_groups_and_val_shard(tmp_path):
    src = PRETRAIN / "tinystories" / "tinystories_sample.txt"
    text = src.read_text(encoding="utf-8")
    stories = [s.strip() for s in text.split("<|endoftext|>") if s.strip()]
    assert len(stories) == text.count("<|endoftext|>") == 30
    import_corpus([src], out_dir=tmp_path, val_docs=2, rows_per_group=4, docs_per_shard=10, log=lambda *a: None)
    paths = list_parquet_files(tmp_path)
    # 28 train docs in shards of 10 -> 2 full shards + one of 8, then the validation shard
    assert [os.path.basename(p) for p in paths] == [f"shard_{i:05d}.parquet" for i in range(4)]
    assert [row_group_sizes(p) for p in paths[:2]] == [[4, 4, 2]] * 2
    assert row_group_sizes(paths[2]) == [4, 4]
    assert row_group_sizes(paths[3]) == [2]
    got = all_train_docs(tmp_path) + read_docs(paths[-1])
    # separators and the newlines around them are dropped; a story's own leading indentation is kept
    assert sorted(d.strip() for d in got) == sorted(stories)
    assert all(d == d.rstrip() and not d.startswith("\n") for d in got)
    assert got != stories  # shuffled by default
    assert json.loads((tmp_path / "import_info.json").read_text())["num_val_docs"] == 2


def test_import_json_array_and_jsonl_keep_exact_text(tmp_path):
    fineweb = PRETRAIN / "fineweb" / "fineweb_subset.json"
    c4 = PRETRAIN / "c4_demo" / "c4_demo.jsonl"
    expected = [r["text"] for r in json.loads(fineweb.read_text(encoding="utf-8"))]
    expected += [json.loads(l)["text"] for l in c4.read_text(encoding="utf-8").splitlines() if l.strip()]
    assert len(expected) == 20
    summary = import_corpus([fineweb, c4], out_dir=tmp_path, val_fraction=0.1, log=lambda *a: None)
    assert (summary["num_train_docs"], summary["num_val_docs"]) == (18, 2)
    train, val = shard_summary(tmp_path)
    assert sorted(train[0] + val) == sorted(expected)


def test_import_shakespeare_paragraphs_and_wiki_demo_lines(tmp_path):
    shakespeare = PRETRAIN / "tinyshakespeare" / "input.txt"
    wiki = PRETRAIN / "wiki_demo" / "wiki_demo.txt"
    expected = paragraphs(shakespeare.read_text(encoding="utf-8"))
    wiki_lines = [l for l in wiki.read_text(encoding="utf-8").split("\n") if l.strip()]
    assert len(wiki_lines) == 6
    summary = import_corpus([shakespeare, wiki], out_dir=tmp_path, val_docs=3, shuffle=False, log=lambda *a: None)
    assert summary["num_train_docs"] + summary["num_val_docs"] == len(expected) + 6
    train, val = shard_summary(tmp_path)
    # no shuffle: input order kept, the validation shard is the last 3 documents
    assert train[0] + val == expected + [l.rstrip() for l in wiki_lines]


def test_import_is_deterministic_and_seeded(tmp_path):
    src = PRETRAIN / "c4_demo" / "c4_demo.jsonl"
    import_corpus([src], out_dir=tmp_path / "a", val_docs=1, rows_per_group=4, log=lambda *a: None)
    import_corpus([src], out_dir=tmp_path / "b", val_docs=1, rows_per_group=4, log=lambda *a: None)
    import_corpus([src], out_dir=tmp_path / "c", val_docs=1, rows_per_group=4, seed=7, log=lambda *a: None)
    a, b, c = (list(parquets_iter_batched("train", data_dir=tmp_path / x)) for x in "abc")
    assert a == b and a != c
    assert [len(g) for g in a] == [4, 4, 1]


@pytest.mark.slow  # an interpreter start-up and three imports
def test_import_directory_and_cli(tmp_path, capsys):
    # c4_demo.jsonl is named twice (directory and file): imported once
    res = run_cli(["import", str(PRETRAIN / "fineweb"), str(PRETRAIN / "c4_demo"), str(PRETRAIN / "c4_demo" / "c4_demo.jsonl"), "--val_docs", "2",
                   "--rows-per-group", "4"], tmp_path)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "base_data"
    train, val = shard_summary(out)
    assert sum(map(len, train)) == 18 and len(val) == 2
    assert row_group_sizes(list_parquet_files(out)[0]) == [4, 4, 4, 4, 2]
    # a second import must not mix with the first (in-process from here on, as above)
    wiki = str(PRETRAIN / "wiki_demo" / "wiki_demo.txt")
    assert cli.main(["import", wiki, "--val_docs", "2", "--out", str(out)]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert sum(map(len, shard_summary(out)[0])) == 18
    assert cli.main(["import", wiki, "--val-docs", "2", "--overwrite", "--out", str(out)]) == 0
    assert [os.path.basename(p) for p in list_parquet_files(out)] == ["shard_00000.parquet", "shard_00001.parquet"]
    train, val = shard_summary(out)
    assert (len(train[0]), len(val)) == (4, 2)
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no staging dir left behind


@pytest.mark.skipif(not SHARED_PRETRAIN.is_dir(), reason=f"checks the full corpora in {SHARED_PRETRAIN}, which is not beside this clone")
def test_full_corpora_give_the_documented_document_counts():
    """docs/data.md's import examples on ../shared/data/pretrain: the documents each corpus becomes."""
    counts = {
        "wikitext-2/train.txt": 600, "wikitext-2/valid.txt": 60,  # articles
        "tinystories/tinystories_sample.txt": 2316,  # stories
        "fineweb/fineweb_subset.json": 300, "c4_demo/c4_demo.jsonl": 300,  # web documents
        "tinyshakespeare/input.txt": 7222,  # paragraphs
        "wiki_demo/wiki_demo.txt": 30,  # an article a line
    }
    got = {rel: sum(1 for _ in iter_file_documents(SHARED_PRETRAIN / rel, log=lambda *a: None)) for rel in counts}
    assert got == counts


# -----------------------------------------------------------------------------
# importer: formats, split rules and errors on small files


def test_txt_split_rules():
    text = "a1\na2\n\n  \nb1\n   indented\n\n\n\nc1\n"
    assert split_text(text, "blank") == (["a1\na2", "b1\n   indented", "c1"], "blank")
    assert split_text(text, "line")[0] == ["a1", "a2", "b1", "   indented", "c1"]
    assert split_text(text, "whole")[0] == ["a1\na2\n\n  \nb1\n   indented\n\n\n\nc1"]
    assert split_text("x<|endoftext|>\ny\n<|endoftext|>\n")[0] == ["x", "y"]
    assert split_text("one\ntwo\nthree")[0] == ["one", "two", "three"]  # auto: no blank lines -> lines
    assert split_text("p1\n\np2")[0] == ["p1", "p2"]  # auto: blank lines -> paragraphs
    assert split_text("A@@B@@@@C", separator="@@")[0] == ["A", "B", "C"]
    md = "# One\nbody\n# Two\nmore\n"
    assert split_text(md, split_on=r"(?=^# )")[0] == ["# One\nbody", "# Two\nmore"]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        split_text(md, split_on="(")
    with pytest.raises(ValueError, match="txt split mode"):
        split_text(md, "paragraph")


def test_wikitext_split_ignores_sections_and_table_lines():
    text = (" \n = Alpha = \n \n Intro .\n \n = = Section = = \n \n Body .\n = Not ; a title = \n more\n"
            " \n = Beta = \n \n Second .\n")
    docs, how = split_text(text)
    assert how == "wikitext (auto)"
    assert docs == [" = Alpha = \n \n Intro .\n \n = = Section = = \n \n Body .\n = Not ; a title = \n more",
                    " = Beta = \n \n Second ."]


def test_json_jsonl_gz_parquet_inputs_and_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "x": 1}\n{"text": "  "}\n')
    assert list(iter_file_documents(str(tmp_path / "a.jsonl"), log=lambda *a: None)) == ["one", "two"]
    (tmp_path / "lines.json").write_text('{"text": "mislabelled"}\n{"text": "jsonl"}\n')
    assert list(iter_file_documents(str(tmp_path / "lines.json"), log=lambda *a: None)) == ["mislabelled", "jsonl"]
    with gzip.open(tmp_path / "b.json.gz", "wt", encoding="utf-8") as f:
        json.dump([{"body": "g1"}, {"body": "g2"}], f)
    assert list(iter_file_documents(str(tmp_path / "b.json.gz"), text_field="body", log=lambda *a: None)) == ["g1", "g2"]
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["p1", None, "p3"]}), tmp_path / "c.parquet", row_group_size=2)
    assert list(iter_file_documents(str(tmp_path / "c.parquet"), log=lambda *a: None)) == ["p1", "p3"]

    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no 'text' field.*--text_field"):
        list(iter_file_documents(str(tmp_path / "bad.jsonl"), log=lambda *a: None))
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: invalid JSON"):
        list(iter_file_documents(str(tmp_path / "broken.jsonl"), log=lambda *a: None))
    with pytest.raises(ValueError, match="no 'text2' column.*--text_field"):
        list(iter_file_documents(str(tmp_path / "c.parquet"), text_field="text2", log=lambda *a: None))
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match="unknown file type.*--format"):
        import_corpus([tmp_path / "notes.md"], out_dir=tmp_path / "out", log=lambda *a: None)
    assert list(iter_file_documents(str(tmp_path / "notes.md"), fmt="txt", log=lambda *a: None)) == ["x"]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        list(iter_file_documents(str(tmp_path / "latin1.txt"), log=lambda *a: None))


def test_import_needs_a_train_and_a_val_document(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(ValueError, match="at least one for training"):
        import_corpus([tmp_path / "one.txt"], out_dir=tmp_path / "out", log=lambda *a: None)
    assert list_parquet_files(tmp_path / "out") == []
    (tmp_path / "two.txt").write_text("first\n\nsecond")
    s = import_corpus([tmp_path / "two.txt"], out_dir=tmp_path / "out", val_fraction=0.5, shuffle=False, log=lambda *a: None)
    assert (s["num_train_docs"], s["num_val_docs"]) == (1, 1)
    assert shard_summary(tmp_path / "out") == ([["first"]], ["second"])
    with pytest.raises(FileExistsError, match="--overwrite"):
        import_corpus([tmp_path / "two.txt"], out_dir=tmp_path / "out", val_fraction=0.5, log=lambda *a: None)
