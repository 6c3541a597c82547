"""
nanochat/dataloader.py: rank sharding over one global sequence of row groups (world sizes 1-16, more ranks than row
groups), exact resume from the state dict, multi-epoch determinism, tensors and errors.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat.dataloader import tokenizing_distributed_data_loader

REPO = Path(__file__).resolve().parents[2]
BOS = 256


class ByteTokenizer:
    """Stand-in tokenizer: one token per UTF-8 byte, BOS = 256; the loader's interface of RustBPETokenizer."""

    def get_bos_token_id(self):
        return BOS

    def encode(self, text, prepend=None, append=None, num_threads=8):
        assert isinstance(text, list) and prepend == BOS
        return [[prepend] + list(t.encode("utf-8")) for t in text]


# train files with 2, 1 and 3 row groups of 1-3 documents each, then the validation file with 2 row groups
LAYOUT = [[3, 1], [2], [1, 3, 2]]
VAL_LAYOUT = [2, 1]


def doc_text(f, rg, d):
    return f"f{f}r{rg}d{d}:" + "xyz"[d % 3] * (5 + 7 * d + 3 * rg + f)  # distinct lengths, so boundaries move


def write_layout(data_dir, layout, val_layout):
    """Writes the shards; returns (train row groups as lists of docs in global order, val row groups)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    groups = []
    files = layout + [val_layout]
    for f, sizes in enumerate(files):
        writer = None
        file_groups = []
        for rg, n in enumerate(sizes):
            docs = [doc_text(f, rg, d) for d in range(n)]
            table = pa.table({"text": pa.array(docs, type=pa.string())})
            writer = writer or pq.ParquetWriter(data_dir / f"shard_{f:05d}.parquet", table.schema)
            writer.write_table(table)  # one call = one row group
            file_groups.append(docs)
        writer.close()
        groups.append(file_groups)
    train = [g for fg in groups[:-1] for g in fg]
    return train, groups[-1]


@pytest.fixture
def data(tmp_path):
    train, val = write_layout(tmp_path, LAYOUT, VAL_LAYOUT)
    for f, sizes in enumerate(LAYOUT + [VAL_LAYOUT]):
        assert pq.ParquetFile(tmp_path / f"shard_{f:05d}.parquet").num_row_groups == len(sizes)
    return tmp_path, train, val


def loader(data_dir, B=2, T=8, split="train", **kw):
    kw.setdefault("tokenizer", ByteTokenizer())
    kw.setdefault("device", "cpu")
    kw.setdefault("tokenizer_batch_size", 3)
    return tokenizing_distributed_data_loader(B, T, split, data_dir=data_dir, **kw)


def take_stream(it, n_tokens):
    """The token stream of consecutive batches (inputs flattened), at least n_tokens long."""
    out, last_target = [], None
    while len(out) < n_tokens:
        x, y, _ = next(it)
        flat_x, flat_y = x.flatten().tolist(), y.flatten().tolist()
        assert flat_x[1:] == flat_y[:-1]  # targets are the inputs shifted by one
        assert last_target in (None, flat_x[0])  # consecutive batches are consecutive windows of the stream
        last_target = flat_y[-1]
        out += flat_x
    return out


def docs_of(stream):
    """Complete documents in a token stream (BOS-separated), decoded; the last, maybe cut, one is dropped."""
    docs, cur = [], None
    for t in stream:
        if t == BOS:
            if cur is not None:
                docs.append(bytes(cur).decode("utf-8"))
            cur = []
        elif cur is not None:
            cur.append(t)
    return docs


def expected_stream(groups):
    return [t for docs in groups for d in docs for t in [BOS] + list(d.encode("utf-8"))]


def test_batches_shapes_dtype_and_stream_content(data):
    data_dir, train, _ = data
    it = loader(data_dir, B=3, T=5)
    x, y, state = next(it)
    assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
    assert json.loads(json.dumps(state)) == state and len(json.dumps(state)) < 300
    # single rank: the stream is every train document in file / row-group order, each prefixed with BOS
    full = expected_stream(train)
    assert take_stream(loader(data_dir, B=3, T=5), len(full))[: len(full)] == full


def test_val_split_reads_only_the_last_shard(data):
    data_dir, _, val = data
    full = expected_stream(val)
    assert take_stream(loader(data_dir, split="val"), len(full))[: len(full)] == full


def row_group_reads(stream, train):
    """Which global row groups a rank read, in order: a read starts at document 0 of a row group."""
    first_doc = {docs[0]: g for g, docs in enumerate(train)}
    return [first_doc[d] for d in docs_of(stream) if d in first_doc]


@pytest.mark.parametrize("world_size", range(1, 17))
def test_rank_coverage_every_row_group_once_per_epoch(data, world_size):
    data_dir, train, _ = data
    n = len(train)  # 6 row groups in 3 files; files have fewer row groups than most world sizes
    epochs = 3
    reads = {}
    for rank in range(world_size):
        positions = list(range(rank, epochs * n, world_size))  # the rank's stream positions in the first 3 epochs
        need = len(positions) + 1
        it = loader(data_dir, B=1, T=16, rank=rank, world_size=world_size)
        stream = []
        while len(row_group_reads(stream, train)) < need:
            stream += take_stream(it, 1)
        reads[rank] = row_group_reads(stream, train)[:need]
        # rank r reads global row groups r, r+W, r+2W, ... wrapping into the next epoch
        assert reads[rank] == [(rank + k * world_size) % n for k in range(need)]
    for e in range(epochs):
        # in every epoch each row group is read by exactly one rank
        in_epoch = [g for r in range(world_size) for k, g in enumerate(reads[r][:-1]) if (r + k * world_size) // n == e]
        assert sorted(in_epoch) == list(range(n))


@pytest.mark.timeout(60)
def test_more_ranks_than_row_groups_yields_data_on_every_rank(data):
    data_dir, train, _ = data
    world_size = 40  # 6 row groups: ranks 6.. start in later epochs, none hangs or gets nothing
    for rank in range(world_size):
        x, _, state = next(loader(data_dir, B=2, T=4, rank=rank, world_size=world_size))
        assert x[0, 0].item() == BOS
        assert bytes(x[0, 1:].tolist()).decode() == train[rank % len(train)][0][:3]
        assert state["epoch"] * len(train) + state["row_group"] >= rank


def test_single_row_group_in_total_and_many_ranks(tmp_path):
    train, _ = write_layout(tmp_path, [[2]], [1])
    for rank in range(5):
        stream = take_stream(loader(tmp_path, B=1, T=8, rank=rank, world_size=5), 100)
        assert docs_of(stream)[:4] == train[0] + train[0]  # every rank cycles the one row group


@pytest.mark.parametrize("world_size,rank", [(1, 0), (3, 1), (4, 3), (9, 7)])
def test_resume_from_state_gives_the_same_batches(data, world_size, rank):
    data_dir, _, _ = data
    B, T, K, M = 2, 7, 24, 6
    ref = loader(data_dir, B=B, T=T, rank=rank, world_size=world_size)
    batches = [next(ref) for _ in range(K + M)]
    positions = set()
    for k in range(K):
        state = json.loads(json.dumps(batches[k][2]))  # as stored in a checkpoint's meta json
        positions.add((state["epoch"], state["row_group"], state["doc"], state["token"]))
        # a different tokenizer batch size must not matter: documents are tokenized one by one
        resumed = loader(data_dir, B=B, T=T, rank=rank, world_size=world_size, resume_state_dict=state,
                         tokenizer_batch_size=1 + k % 4)
        for j in range(k + 1, min(k + 1 + M, K + M)):
            x, y, s = next(resumed)
            assert torch.equal(x, batches[j][0]) and torch.equal(y, batches[j][1]) and s == batches[j][2]
    # the states covered mid-document positions and several epochs, not just row-group starts
    assert any(t > 0 for _, _, _, t in positions) and len({e for e, _, _, _ in positions}) >= 2


def test_resume_at_document_boundary_and_across_epochs(data):
    data_dir, train, _ = data
    full = expected_stream(train)
    # T chosen so that a batch ends exactly where the second document starts
    first_doc_tokens = 1 + len(train[0][0].encode())
    ref = loader(data_dir, B=1, T=first_doc_tokens)
    x, _, state = next(ref)
    assert (state["row_group"], state["doc"], state["token"]) == (0, 1, 0)
    assert x.flatten().tolist() == full[:first_doc_tokens]
    cont = [next(ref)[0] for _ in range(30)]
    resumed = loader(data_dir, B=1, T=first_doc_tokens, resume_state_dict=state)
    assert all(torch.equal(next(resumed)[0], c) for c in cont)


def test_multi_epoch_determinism(data):
    data_dir, train, _ = data
    full = expected_stream(train)
    P = len(full)
    stream = take_stream(loader(data_dir, B=2, T=9), 3 * P + 1)
    assert stream[:P] == full and stream[P : 2 * P] == full and stream[2 * P : 3 * P] == full
    again = take_stream(loader(data_dir, B=2, T=9, tokenizer_batch_size=100), 3 * P + 1)
    assert again[: 3 * P] == stream[: 3 * P]


def test_state_checks(data, tmp_path):
    data_dir, _, _ = data
    _, _, state = next(loader(data_dir, rank=1, world_size=2))
    with pytest.raises(ValueError, match="saved by rank 1 of 2.*rank 0 of 2"):
        loader(data_dir, rank=0, world_size=2, resume_state_dict=state)
    with pytest.raises(ValueError, match="same world size"):
        loader(data_dir, rank=1, world_size=3, resume_state_dict=state)
    with pytest.raises(ValueError, match="'train' split"):
        loader(data_dir, split="val", rank=1, world_size=2, resume_state_dict=state)
    with pytest.raises(ValueError, match="missing"):
        loader(data_dir, resume_state_dict={"pq_idx": 0, "rg_idx": 3})
    bad = dict(state, doc=99)
    with pytest.raises(ValueError, match="does not exist"):
        next(loader(data_dir, rank=1, world_size=2, resume_state_dict=bad))
    # shards added after the state was saved: exact resume is impossible, say so
    other = tmp_path / "other"
    write_layout(other, LAYOUT + [[1]], VAL_LAYOUT)
    with pytest.raises(ValueError, match="row groups.*same shards"):
        loader(other, rank=1, world_size=2, resume_state_dict=state)


def test_argument_errors(data, tmp_path):
    data_dir, _, _ = data
    with pytest.raises(ValueError, match="B and T"):
        loader(data_dir, B=0)
    with pytest.raises(ValueError, match="rank"):
        loader(data_dir, rank=2, world_size=2)
    with pytest.raises(ValueError, match="split"):
        loader(data_dir, split="test")
    with pytest.raises(FileNotFoundError, match="python -m nanochat.dataset"):
        loader(tmp_path / "empty")


def test_rank_and_world_size_from_torchrun_env(data, monkeypatch):
    data_dir, _, _ = data
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    _, _, state = next(loader(data_dir))
    assert (state["rank"], state["world_size"]) == (2, 4)
    x, _, _ = next(loader(data_dir, B=1, T=4, rank=2, world_size=4))
    assert torch.equal(next(loader(data_dir, B=1, T=4))[0], x)


def test_empty_row_groups_are_skipped_and_all_empty_errors(tmp_path):
    data_dir = tmp_path / "d"
    write_layout(data_dir, [[0, 2, 0, 1]], [1])
    docs = docs_of(take_stream(loader(data_dir, B=1, T=4), 300))
    assert docs[:6] == [doc_text(0, 1, 0), doc_text(0, 1, 1), doc_text(0, 3, 0)] * 2
    # rank 0 of 2 only ever reads row groups 0 and 2 (4 row groups), both empty: an error, not an endless loop
    with pytest.raises(ValueError, match="no documents"):
        next(loader(data_dir, B=1, T=4, rank=0, world_size=2))


def test_damaged_shards_and_a_split_without_documents_are_named(data):
    """The loader reads through nanochat.dataset's checks: a bad shard is named with its fix (tests/unit/test_dataset.py
    covers every kind of damage), and so is a split whose shards hold no rows."""
    data_dir, _, _ = data
    val = data_dir / "shard_00003.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), val)
    with pytest.raises(ValueError, match=r"the val split holds no documents: .*shard_00003\.parquet has 0 rows \(the "
                                         r"last shard is the validation split\): move shard_00003\.parquet out"):
        loader(data_dir, split="val")
    val.write_bytes(b"")
    with pytest.raises(ValueError, match=r"shard .*shard_00003\.parquet is empty \(0 bytes\)"):
        loader(data_dir, split="val")
    train = data_dir / "shard_00002.parquet"
    train.write_bytes(train.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"shard .*shard_00002\.parquet is truncated or not a parquet file"):
        loader(data_dir)


def test_loader_on_imported_corpus(tmp_path):
    from nanochat.data.corpus_import import import_corpus

    src = REPO / "tests" / "assets" / "data" / "pretrain" / "tinystories" / "tinystories_sample.txt"  # 30 stories
    import_corpus([src], out_dir=tmp_path, val_docs=2, rows_per_group=2, docs_per_shard=1000, log=lambda *a: None)
    train = [pq.read_table(p).column("text").to_pylist() for p in sorted(tmp_path.glob("shard_*.parquet"))[:-1]]
    rows = [g for t in train for g in [t[i : i + 2] for i in range(0, len(t), 2)]]
    it = loader(tmp_path, B=4, T=256, rank=1, world_size=2)
    docs = docs_of(take_stream(it, 6_000))  # within the first epoch of this rank's 14 stories
    expected = [d for g in rows[1::2] for d in g]
    assert len(docs) > 5 and docs == expected[: len(docs)]


def rustbpe_available():
    try:
        import rustbpe  # noqa: F401
        from nanochat.tokenizer import RustBPETokenizer  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not rustbpe_available(), reason="rustbpe extension / nanochat.tokenizer not built yet")
def test_with_real_rustbpe_tokenizer(data, tmp_path, monkeypatch):
    from nanochat.tokenizer import RustBPETokenizer

    data_dir, train, _ = data
    text = [d for g in train for d in g] * 20
    tok = RustBPETokenizer.train_from_iterator(iter(text), 300)
    expected = [t for g in train for d in g for t in tok.encode(d, prepend=tok.get_bos_token_id())]
    it = loader(data_dir, B=2, T=16, tokenizer=tok)
    stream = take_stream(it, len(expected))
    assert stream[: len(expected)] == expected
    # tokenizer=None loads base_dir/tokenizer, as training does
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tok.save(str(tmp_path / "tokenizer"))
    x, _, _ = next(loader(data_dir, B=2, T=16, tokenizer=None))
    assert x.flatten().tolist() == expected[:32]
    _, _, state = next(it)
    resumed = loader(data_dir, B=2, T=16, tokenizer=tok, resume_state_dict=state)
    assert all(torch.equal(next(resumed)[0], next(it)[0]) for _ in range(5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, non-blocking copies)")
def test_cuda_batches_match_cpu(data):
    data_dir, _, _ = data
    cpu = loader(data_dir, B=4, T=32, device="cpu")
    gpu = loader(data_dir, B=4, T=32, device="cuda")
    for _ in range(5):
        (xc, yc, sc), (xg, yg, sg) = next(cpu), next(gpu)
        assert xg.is_cuda and yg.is_cuda and sc == sg
        assert torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)
