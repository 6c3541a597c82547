"""
BOS-aligned best-fit packing (nanochat/data/bestfit.py, `packing="bestfit"` of nanochat/dataloader.py): the rows
against a plain transcription of the algorithm in nanochat's reading order, exact resume after any batch for 1 and 2
ranks, resume on another number of ranks, the cropped fraction, the state checks, and, where ../shared/bench holds
nanochat 92d63d4, batches equal to its own loader's token for token for 1 and 2 ranks.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from test_dataloader import BOS, LAYOUT, VAL_LAYOUT, ByteTokenizer, write_layout

from nanochat.dataloader import (cropped_fraction, loader_states_for_world, tokenizing_distributed_data_loader,
                                 tokenizing_distributed_data_loader_bos_bestfit,
                                 tokenizing_distributed_data_loader_with_state_bos_bestfit)
from nanochat.usage import BadValue

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "tests" / "assets" / "data" / "pretrain"
ANCHOR = Path(os.environ.get("NANOCHAT_BENCH_DIR", REPO.parent / "shared" / "bench")) / "nanochat-92d63d4.tar.gz"


@pytest.fixture
def data(tmp_path):
    train, val = write_layout(tmp_path, LAYOUT, VAL_LAYOUT)
    return tmp_path, train, val


def loader(data_dir, B=2, T=24, split="train", **kw):
    kw.setdefault("tokenizer", ByteTokenizer())
    kw.setdefault("device", "cpu")
    kw.setdefault("tokenizer_batch_size", 2)
    kw.setdefault("buffer_size", 4)
    return tokenizing_distributed_data_loader(B, T, split, data_dir=data_dir, packing="bestfit", **kw)


# -----------------------------------------------------------------------------
# the algorithm, written out plainly: nanochat's reading order, a list scanned for every document


def reference_chunks(layout, rank, world, chunk):
    """Documents in nanochat's order: files in order, row groups rank, rank+W, ... of each, `chunk` at a time."""
    files = [[rg for rg in range(len(sizes))] for sizes in layout]
    while True:
        for f, rgs in enumerate(files):
            for rg in rgs[rank::world]:
                docs = [f"f{f}r{rg}d{d}:" + "xyz"[d % 3] * (5 + 7 * d + 3 * rg + f) for d in range(layout[f][rg])]
                for i in range(0, len(docs), chunk):
                    yield docs[i : i + chunk]


def reference_batches(layout, n, B, T, rank=0, world=1, chunk=2, buffer_size=4):
    """(the first n batches as (B, T+1) row lists, cropped tokens) of nanochat's best-fit algorithm."""
    chunks = reference_chunks(layout, rank, world, chunk)
    buffer, out, cropped = [], [], 0
    for _ in range(n):
        rows = []
        for _ in range(B):
            row = []
            while len(row) < T + 1:
                while len(buffer) < buffer_size:
                    buffer += [[BOS] + list(d.encode()) for d in next(chunks)]
                room = T + 1 - len(row)
                fits = [i for i, d in enumerate(buffer) if len(d) <= room]
                if fits:
                    row += buffer.pop(max(fits, key=lambda i: (len(buffer[i]), -i)))
                else:
                    doc = buffer.pop(min(range(len(buffer)), key=lambda i: (len(buffer[i]), i)))
                    row += doc[:room]
                    cropped += len(doc) - room
            rows.append(row)
        out.append(rows)
    return out, cropped


def rows_of(x, y):
    """The (B, T+1) rows a batch was cut from (inputs plus the last target)."""
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    return torch.cat([x, y[:, -1:]], dim=1).tolist()


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("B,T,chunk,buffer_size", [(2, 24, 2, 4), (3, 40, 1, 1), (1, 17, 3, 9), (2, 30, 2, 20)])
def test_rows_equal_the_plain_algorithm_in_nanochats_order(data, world, rank, B, T, chunk, buffer_size):
    data_dir, _, _ = data
    n = 12
    expected, cropped = reference_batches(LAYOUT, n, B, T, rank, world, chunk, buffer_size)
    it = loader(data_dir, B=B, T=T, rank=rank, world_size=world, tokenizer_batch_size=chunk, buffer_size=buffer_size)
    for k in range(n):
        x, y, state = next(it)
        assert x.shape == y.shape == (B, T) and x.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
        assert rows_of(x, y) == expected[k], f"batch {k}"
        assert all(row[0] == BOS for row in expected[k])  # every row starts at a document
    assert state["cropped_tokens"] == cropped and state["packed_tokens"] == n * B * (T + 1)
    assert cropped_fraction([state]) == cropped / (cropped + n * B * (T + 1))


def test_val_split_and_the_reading_order_per_file(data):
    """Rank 1 of 2 reads row group 1 of each file that has one (file 1 has a single row group: none of it), as
    nanochat strides each file, not the concatenation of the files."""
    data_dir, train, val = data
    it = loader(data_dir, B=1, T=400, rank=1, world_size=2, buffer_size=1, tokenizer_batch_size=1)
    first = bytes(t for t in next(it)[0][0].tolist() if t != BOS).decode()
    assert re.findall(r"f(\d)r(\d)d(\d):", first)[:3] == [("0", "1", "0"), ("2", "1", "0"), ("2", "1", "1")]
    x, _, state = next(loader(data_dir, B=1, T=8, split="val", buffer_size=1, tokenizer_batch_size=1))
    assert state["split"] == "val" and bytes(x[0, 1:].tolist()).decode() == val[0][0][:7]


def test_a_rank_that_no_file_gives_a_row_group_reads_as_rank_r_mod_m(data):
    data_dir, _, _ = data  # files have at most 3 row groups: rank 4 of 5 reads as rank 4 % 3 = 1 (of 5)
    a, b = loader(data_dir, rank=4, world_size=5), loader(data_dir, rank=1, world_size=5)
    for _ in range(6):
        (xa, ya, sa), (xb, yb, sb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and sa["buffer"] == sb["buffer"]


# -----------------------------------------------------------------------------
# exact resume


@pytest.mark.parametrize("world", [1, 2])
def test_resume_after_any_batch_gives_the_same_batches(data, world):
    data_dir, _, _ = data
    K, M = 30, 4
    for rank in range(world):
        ref = loader(data_dir, rank=rank, world_size=world)
        batches = [next(ref) for _ in range(K + M)]
        for k in range(K):
            state = json.loads(json.dumps(batches[k][2]))  # as a checkpoint's meta json stores it
            resumed = loader(data_dir, rank=rank, world_size=world, resume_state_dict=state)
            for j in range(k + 1, k + 1 + M):
                x, y, s = next(resumed)
                assert torch.equal(x, batches[j][0]) and torch.equal(y, batches[j][1]) and s == batches[j][2], (k, j)
        states = [b[2] for b in batches[:K]]
        # the saved points include the middle of a row group, a full buffer, documents of earlier epochs waiting
        assert any(s["doc"] > 0 for s in states) and all(s["buffer"] for s in states)
        assert any(s["epoch"] >= 2 and s["buffer"][0][0] < s["epoch"] for s in states)


def test_resume_with_the_real_tokenizer_on_an_imported_corpus(tiny_base_dir, tmp_path):
    from nanochat.data.corpus_import import import_corpus
    from nanochat.tokenizer import RustBPETokenizer

    import_corpus([PRETRAIN / "tinystories" / "tinystories_sample.txt"], out_dir=tmp_path, val_docs=2,
                  rows_per_group=3, docs_per_shard=10, log=lambda *a: None)
    tok = RustBPETokenizer.from_directory(str(tiny_base_dir / "tokenizer"))
    kw = dict(tokenizer=tok, tokenizer_batch_size=2, buffer_size=8, rank=1, world_size=2)
    ref = loader(tmp_path, B=2, T=64, **kw)
    batches = [next(ref) for _ in range(12)]
    for k in (0, 3, 7):
        resumed = loader(tmp_path, B=2, T=64, resume_state_dict=batches[k][2], **kw)
        for j in range(k + 1, 12):
            x, _, s = next(resumed)
            assert torch.equal(x, batches[j][0]) and s == batches[j][2]


def doc_ids(x):
    """(file, row group) of every document whose id prefix a batch holds whole, in order."""
    text = bytes(t for t in x.flatten().tolist() if t != BOS).decode()
    return [(int(f), int(rg)) for f, rg in re.findall(r"f(\d+)r(\d+)d\d+:", text)]


@pytest.mark.parametrize("old,new", [(2, 3), (2, 1), (3, 2)])
def test_resume_on_another_number_of_ranks_reads_nothing_twice(tmp_path, old, new, capsys):
    layout = [[3] * 9] * 4  # 4 files of 9 row groups of 3 documents: the runs below stay in the first epoch
    write_layout(tmp_path, layout, [2])
    k = 3
    saved, read_before = [], set()
    for r in range(old):
        it = loader(tmp_path, T=30, rank=r, world_size=old, buffer_size=3, tokenizer_batch_size=2)
        for _ in range(k):
            x, _, state = next(it)
            read_before |= set(doc_ids(x))
        saved.append(json.loads(json.dumps(state)))
    assert loader_states_for_world(saved, old) == saved  # the same world size: exactly where each rank was
    states = loader_states_for_world(saved, new, log=print)
    assert "read by %d now" % new in capsys.readouterr().out
    assert all(s["epoch"] == 0 for s in saved)
    start = max((s["file"], s["row_group"] + (s["doc"] > 0)) for s in saved)
    assert [(s["rank"], s["world_size"], s["epoch"], s["file"], s["row_group"], s["doc"], s["buffer"])
            for s in states] == [(r, new, 0, *start, 0, []) for r in range(new)]
    assert sum(s["cropped_tokens"] for s in states) == sum(s["cropped_tokens"] for s in saved)
    for r, state in enumerate(states):
        x, _, _ = next(loader(tmp_path, T=30, rank=r, world_size=new, buffer_size=3, tokenizer_batch_size=2,
                              resume_state_dict=state))
        ids = doc_ids(x)
        assert ids and all(i >= start for i in ids) and not set(ids) & read_before
        # the new rank's own row groups of the file it starts in: per-file striding with the new world size
        assert all(rg % new == r for f, rg in ids if f == ids[0][0])


def test_state_checks(data, tmp_path):
    data_dir, _, _ = data
    _, _, state = next(loader(data_dir, rank=1, world_size=2))
    assert len(json.dumps(state)) < 1000
    _, _, concat_state = next(tokenizing_distributed_data_loader(2, 8, "train", tokenizer=ByteTokenizer(),
                                                                 device="cpu", data_dir=data_dir))
    with pytest.raises(BadValue, match="saved by the concat loader.*resume with --packing=concat"):
        loader(data_dir, resume_state_dict=concat_state)
    with pytest.raises(BadValue, match="saved by the bestfit loader.*resume with --packing=bestfit"):
        tokenizing_distributed_data_loader(2, 8, "train", tokenizer=ByteTokenizer(), device="cpu", data_dir=data_dir,
                                           rank=1, world_size=2, resume_state_dict=state)
    with pytest.raises(BadValue, match="mix the concat and bestfit"):
        loader_states_for_world([concat_state, state], 3)
    with pytest.raises(ValueError, match="saved by rank 1 of 2, this is rank 0 of 2"):
        loader(data_dir, rank=0, world_size=2, resume_state_dict=state)
    with pytest.raises(ValueError, match="buffer_size=4, this loader has buffer_size=5"):
        loader(data_dir, rank=1, world_size=2, resume_state_dict=state, buffer_size=5)
    with pytest.raises(ValueError, match="tokenizer_batch_size=2, this loader has tokenizer_batch_size=3"):
        loader(data_dir, rank=1, world_size=2, resume_state_dict=state, tokenizer_batch_size=3)
    with pytest.raises(ValueError, match="'train' split"):
        loader(data_dir, split="val", rank=1, world_size=2, resume_state_dict=state)
    with pytest.raises(ValueError, match="missing"):
        loader(data_dir, rank=1, world_size=2, resume_state_dict={"packing": "bestfit", "split": "train"})
    run = state["buffer"][0]
    with pytest.raises(ValueError, match="buffer names documents that do not exist"):
        loader(data_dir, rank=1, world_size=2, resume_state_dict=dict(state, buffer=[run[:3] + [0, 99]]))
    with pytest.raises(ValueError, match="names document 1 of row group 0 of file 0, which this rank does not read"):
        loader(data_dir, rank=1, world_size=2, resume_state_dict=dict(state, file=0, row_group=0, doc=1))
    other = tmp_path / "other"
    write_layout(other, LAYOUT + [[1]], VAL_LAYOUT)
    with pytest.raises(ValueError, match="row groups.*same shards"):
        loader(other, rank=1, world_size=2, resume_state_dict=state)
    with pytest.raises(ValueError, match="packing must be one of concat, bestfit"):
        tokenizing_distributed_data_loader(2, 8, "train", tokenizer=ByteTokenizer(), data_dir=data_dir, packing="x")
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        loader(data_dir, buffer_size=0)


def test_nanochats_names_and_argument_order(data):
    data_dir, _, _ = data
    tok, kw = ByteTokenizer(), dict(device="cpu", data_dir=data_dir, tokenizer_batch_size=2)
    ours = loader(data_dir, B=2, T=24, buffer_size=4)
    theirs = tokenizing_distributed_data_loader_with_state_bos_bestfit(tok, 2, 24, "train", buffer_size=4, **kw)
    pairs = tokenizing_distributed_data_loader_bos_bestfit(tok, 2, 24, "train", buffer_size=4, **kw)
    for _ in range(5):
        (x, y, s), (x2, y2, s2), (x3, y3) = next(ours), next(theirs), next(pairs)
        assert torch.equal(x, x2) and torch.equal(x, x3) and torch.equal(y, y2) and torch.equal(y, y3) and s == s2


def test_cropped_fraction_of_several_ranks_and_of_concat_states(data):
    data_dir, _, _ = data
    states = [next(loader(data_dir, rank=r, world_size=2))[2] for r in range(2)]
    cropped = sum(s["cropped_tokens"] for s in states)
    assert cropped > 0 and cropped_fraction(states) == cropped / (cropped + 2 * 2 * 25)
    assert cropped_fraction([None]) is None
    assert cropped_fraction([{"split": "train", "epoch": 0, "token": 3}]) is None  # a concat state crops nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory, non-blocking copies)")
def test_cuda_batches_match_cpu(data):
    data_dir, _, _ = data
    cpu, gpu = loader(data_dir, device="cpu"), loader(data_dir, device="cuda")
    for _ in range(5):
        (xc, yc, sc), (xg, yg, sg) = next(cpu), next(gpu)
        assert xg.is_cuda and torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc) and sc == sg


# -----------------------------------------------------------------------------
# base_train with --packing=bestfit --data=climbmix


def import_mixed_corpus(out):
    """63 train documents (paragraphs, stories, web pages: 5 to ~2,000 tokens) in files of 5, 5 and 3 row groups,
    and 20 validation documents in 4."""
    from nanochat.data.corpus_import import import_corpus

    import_corpus([PRETRAIN / "wikitext-2" / "train.txt", PRETRAIN / "tinystories" / "tinystories_sample.txt",
                   PRETRAIN / "fineweb" / "fineweb_subset.json", PRETRAIN / "c4_demo" / "c4_demo.jsonl"],
                  out_dir=out, val_docs=20, rows_per_group=5, docs_per_shard=25, txt_split="blank", log=lambda *a: None)


def copy_step(base_dir, src, dst, step):
    """A fresh checkpoint tag holding only the files of one step (the interruption)."""
    src, dst = base_dir / "base_checkpoints" / src, base_dir / "base_checkpoints" / dst
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f"{step:06d}" in f.name:
            shutil.copy(f, dst / f.name)


@pytest.mark.slow  # three short training runs
def test_base_train_packs_best_fit_resumes_exactly_and_logs_the_cropped_fraction(base_dir, capsys):
    from test_base_train import TINY, run_base_train

    from nanochat.metrics import read_metrics

    # the shards only under base_data_climbmix/ (a run that read base_data/ would stop): 63 documents of 5 to ~2,000
    # tokens, so that which ones wait in the buffer changes the batches
    os.unlink(base_dir / "base_data")
    import_mixed_corpus(base_dir / "base_data_climbmix")
    flags = TINY + ["--packing=bestfit", "--data=climbmix", "--num_iterations=6", "--data_world_size=2"]
    run_base_train(flags + ["--model_tag=full", "--save_every=3", "--eval_every=6"], capsys)  # val: bestfit too
    copy_step(base_dir, "full", "resumed", 3)
    copy_step(base_dir, "full", "one_rank", 3)
    flags.append("--eval_every=-1")  # below: each loader's first batch fills a 1000-document buffer (~2 s here)
    run_base_train(flags + ["--model_tag=resumed", "--resume_from_step=3"], capsys)

    def logged(tag, key):
        records = read_metrics(base_dir / "base_checkpoints" / tag / "metrics.jsonl")
        return {r["step"]: r[key] for r in records if key in r}

    full, resumed = logged("full", "train/loss"), logged("resumed", "train/loss")
    assert sorted(full) == list(range(1, 7)) and all(resumed[s] == full[s] for s in range(4, 7)), (full, resumed)
    crop = logged("full", "train/cropped_fraction")
    assert sorted(crop) == list(range(1, 7)) and all(0 <= c < 1 for c in crop.values()) and crop[6] > 0, crop
    assert all(logged("resumed", "train/cropped_fraction")[s] == crop[s] for s in range(4, 7))
    report = (base_dir / "report" / "base-model-training.md").read_text()
    assert f"- Cropped fraction (best-fit packing): {crop[6]:.4f}" in report and "climbmix, bestfit packing" in report
    # the same step resumed by one process reading as 1 data rank: a fresh row group for it, a note that says so
    _, text = run_base_train([f for f in flags if "data_world_size" not in f]
                             + ["--data_world_size=1", "--model_tag=one_rank", "--resume_from_step=3"], capsys)
    assert "saved by 2 rank(s) and is read by 1 now" in text and sorted(logged("one_rank", "train/loss")) == [4, 5, 6]


@pytest.mark.dist
def test_two_ranks_pack_as_one_process_reading_as_two_and_resume_exactly(base_dir):
    """torchrun, 2 ranks, best-fit packing: the same losses and weights as one process that reads the data as 2 ranks
    (--data_world_size=2), and a 2-rank resume from each rank's saved buffer is exact."""
    from test_dist_train import TINY as DIST_TINY
    from test_dist_train import assert_same_run, final_params, losses, single_process

    from conftest import subprocess_env
    from ranks import run_ranks

    import_mixed_corpus(base_dir / "base_data_climbmix")
    # no clipping: on the DDP path each rank clips its own gradient, as nanochat does (README, docs/distributed.md)
    extra = ["--packing=bestfit", "--data=climbmix", "--grad_clip=0"]
    n = 3
    args = ["-m", "scripts.base_train", *DIST_TINY, *extra, "--total_batch_size=512", f"--num_iterations={2 * n}"]
    single_process(base_dir, "ref", 2 * n, 2, extra)
    run_ranks(args + ["--model_tag=full", f"--save_every={n}"], env=subprocess_env(base_dir))
    assert_same_run(base_dir, "ref", "full", 2 * n)
    copy_step(base_dir, "full", "resumed", n)
    run_ranks(args + ["--model_tag=resumed", f"--resume_from_step={n}"], env=subprocess_env(base_dir))
    assert losses(base_dir, "resumed") == losses(base_dir, "full")[n:]
    (a, _), (b, meta) = final_params(base_dir, "full", 2 * n), final_params(base_dir, "resumed", 2 * n)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [(s["packing"], s["rank"]) for s in meta["loader_state"]] == [("bestfit", 0), ("bestfit", 1)]


# -----------------------------------------------------------------------------
# nanochat 92d63d4's own loader, side by side

# runs inside the extracted 92d63d4 tree (its `nanochat` package first on sys.path): its loader, its tokenizer loaded
# from $NANOCHAT_BASE_DIR/tokenizer, its shards from $NANOCHAT_BASE_DIR/base_data_climbmix; ranks from torchrun's env
DUMP_92D63D4 = """
import json, os, sys, torch
from nanochat.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit as bestfit
from nanochat.tokenizer import get_tokenizer
tokenizer, out = get_tokenizer(), {}
for case in json.loads(sys.argv[1]):
    world, rank = case["world"], case["rank"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    it = bestfit(tokenizer, case["B"], case["T"], case["split"], tokenizer_batch_size=case["chunk"], device="cpu",
                 buffer_size=case["buffer_size"])
    out[json.dumps(case)] = [torch.stack([x.clone(), y.clone()]) for x, y, _ in (next(it) for _ in range(case["n"]))]
torch.save(out, sys.argv[2])
"""


@pytest.mark.slow  # extracts nanochat 92d63d4 and starts an interpreter with torch
def test_batches_equal_nanochat_92d63d4(tiny_base_dir, tmp_path):
    if not ANCHOR.exists():
        pytest.skip(f"compares with nanochat 92d63d4's loader, whose archive is not at {ANCHOR} (../shared/bench beside "
                    f"the repo, or $NANOCHAT_BENCH_DIR)")
    from nanochat.tokenizer import RustBPETokenizer

    with tarfile.open(ANCHOR) as tar:
        tar.extractall(tmp_path, filter="data")
    anchor = tmp_path / "nanochat-92d63d4"
    (anchor / "dump.py").write_text(DUMP_92D63D4)
    base = tmp_path / "base"
    base.mkdir()
    os.symlink(tiny_base_dir / "tokenizer", base / "tokenizer")
    # files of 5, 5 and 3 row groups: rank 1 of 2 reads differently from a stride over the concatenated files
    shards = base / "base_data_climbmix"
    import_mixed_corpus(shards)
    assert [pq.ParquetFile(p).num_row_groups for p in sorted(shards.glob("*.parquet"))] == [5, 5, 3, 4]
    cases = [dict(world=w, rank=r, split=split, B=B, T=T, chunk=chunk, buffer_size=buf, n=n)
             for w in (1, 2) for r in range(w)
             for split, B, T, chunk, buf, n in [("train", 4, 64, 3, 12, 25), ("train", 3, 256, 128, 1000, 4),
                                                ("val", 2, 32, 2, 5, 10)]]
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), PYTHONPATH="", OMP_NUM_THREADS="1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "dump.py", json.dumps(cases), str(tmp_path / "theirs.pt")], cwd=anchor, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    theirs = torch.load(tmp_path / "theirs.pt")
    tok = RustBPETokenizer.from_directory(str(base / "tokenizer"))
    for case in cases:
        it = tokenizing_distributed_data_loader(case["B"], case["T"], case["split"], tokenizer=tok, device="cpu",
                                                tokenizer_batch_size=case["chunk"], buffer_size=case["buffer_size"],
                                                data_dir=shards, rank=case["rank"], world_size=case["world"],
                                                packing="bestfit")
        for k, expected in enumerate(theirs[json.dumps(case)]):
            x, y, _ = next(it)
            assert torch.equal(torch.stack([x, y]), expected), f"{case}: batch {k} differs"
