"""
The pretraining data loader: documents from the parquet shards, each prefixed with BOS, tokenized and concatenated
into one token stream, cut into (B, T) batches of inputs and next-token targets.

Rank sharding: the row groups of all files of a split form ONE global sequence g = 0..N-1, and the data is an
endless stream of positions p = epoch*N + g. Rank r of W reads positions r, r+W, r+2W, ... So every row group is read
by exactly one rank per epoch, and any world size works: more ranks than row groups in a file, or than row groups
in total, just wraps into the next epoch (rank r >= N starts in epoch r // N).

Exact resume: each yielded state dict names the next token this rank will use (position of its row group, document
index inside it, token offset inside that document's tokens). Tokenization is per document, so the stream does not
depend on how documents were batched for the tokenizer, and a loader started from a state dict continues exactly
where the saved one would have. The state is per rank (training saves one per rank).

That is the December recipe's packing, `packing="concat"`. The record recipe packs with `packing="bestfit"`
(nanochat/data/bestfit.py, nanochat 92d63d4's BOS-aligned best-fit packing, equal batches): every row starts at a
document start, and documents are packed whole where they fit, cropped where none does. Both go through the one
entry point below and keep their own state dict (a best-fit state has `"packing": "bestfit"`; the concat state
keeps the keys it always had, so checkpoints stay as they were).
"""

from collections import deque

import numpy as np
import torch

from nanochat.data.bestfit import (bestfit_batches, check_loader_state, cropped_fraction,  # noqa: F401 (base_train)
                                   states_for_world)
from nanochat.distributed.dist import process_data_ranks
from nanochat.dataset import shard_fix, open_shard, read_texts, split_parquet_files
from nanochat.usage import BadValue

PACKINGS = ("concat", "bestfit")  # the December recipe's, the record recipe's
STATE_KEYS = ("split", "rank", "world_size", "num_row_groups", "epoch", "row_group", "doc", "token")  # concat's


def resolve_packing(packing, recipe_packing="concat"):
    """base_train's --packing: None (auto) takes the recipe's (the December recipe: concat, the record recipe:
    bestfit), an explicit value wins."""
    chosen = recipe_packing if packing is None else packing
    if chosen not in PACKINGS:
        raise BadValue(f"--packing must be one of {', '.join(PACKINGS)} (or auto), got {chosen!r}")
    return chosen


def _row_group_index(split, data_dir):
    """The global sequence of (path, row group index) over all files of the split, in order."""
    index, rows = [], 0
    paths = split_parquet_files(split, data_dir)
    for path in paths:
        pf = open_shard(path)
        index += [(path, rg) for rg in range(pf.num_row_groups)]
        rows += pf.metadata.num_rows
    if not index or rows == 0:
        raise ValueError(
            f"the {split} split holds no documents: {', '.join(paths)} "
            f"{'has' if len(paths) == 1 else 'have'} {'no row groups' if not index else '0 rows'}"
            f"{' (the last shard is the validation split)' if split == 'val' else ''}: {shard_fix(paths[-1])}"
        )
    return index


def _iter_documents(row_groups, world_size, pos, doc):
    """
    Yield (pos, doc_index, text) for this rank's documents, from document `doc` of the row group at stream
    position `pos` onwards, forever (the rank's next row group is pos + world_size).
    """
    n = len(row_groups)
    open_path, open_file = None, None  # consecutive reads mostly hit the same file: keep the last one open
    empty_in_a_row = 0
    while True:
        path, rg = row_groups[pos % n]
        if path != open_path:
            open_path, open_file = path, open_shard(path)
        texts = read_texts(open_file, path, rg)
        if texts:
            empty_in_a_row = 0
        else:
            empty_in_a_row += 1
            if empty_in_a_row > n:  # a full cycle of this rank's row groups without one document
                raise ValueError(f"no documents in any row group this rank reads (world size {world_size}, {n} row groups)")
        for i in range(doc, len(texts)):
            if texts[i] is None:
                raise ValueError(f"{path}: row group {rg}, row {i} has a null text")
            yield pos, i, texts[i]
        pos += world_size
        doc = 0


def _start_position(resume_state_dict, split, rank, world_size, num_row_groups):
    """(pos, doc, token) where this rank starts: its first row group, or the token a saved state pins."""
    if resume_state_dict is None:
        return rank, 0, 0
    state = resume_state_dict
    check_loader_state(state, "concat", STATE_KEYS, split, rank, world_size, num_row_groups)
    pos = state["epoch"] * num_row_groups + state["row_group"]
    if pos % world_size != rank or state["doc"] < 0 or state["token"] < 0:
        raise ValueError(f"inconsistent loader state dict for rank {rank} of {world_size}: {state}")
    return pos, state["doc"], state["token"]


def loader_states_for_world(states, world_size, log=None):
    """
    Resume states for `world_size` ranks from the states a run with len(states) ranks saved (one per rank). The same
    world size: the saved states, so each rank goes on exactly where it was. Another world size (a sharded checkpoint
    resumed on fewer or more ranks): rank r of the new run starts at row group P + r, where P is the first stream
    position (a multiple of the new world size) after every row group a saved rank had started. The remainders of the
    row groups the saved ranks were in, and at most world_size - 1 row groups before P, are skipped; nothing is read
    twice. States of None (a run that saved no loader position) stay None. log: called with a note when the data
    position moves (print0 in the training scripts).
    """
    states = list(states)
    if len(states) == world_size or any(s is None for s in states):
        return states if len(states) == world_size else [None] * world_size
    if any(s.get("packing", "concat") != "concat" for s in states):
        return states_for_world(states, world_size, log)  # best-fit states (nanochat/data/bestfit.py)
    n = states[0]["num_row_groups"]
    furthest = max(s["epoch"] * n + s["row_group"] for s in states)
    start = -(-(furthest + 1) // world_size) * world_size
    if log is not None:
        log(f"Note: the data position was saved by {len(states)} rank(s) and is read by {world_size} now: every rank "
            f"starts a fresh row group, from stream position {start} (the saved ranks were at most at {furthest}); "
            f"the rest of the row groups they were in is skipped")
    return [{"split": states[0]["split"], "rank": r, "world_size": world_size, "num_row_groups": n,
             "epoch": (start + r) // n, "row_group": (start + r) % n, "doc": 0, "token": 0} for r in range(world_size)]


def tokenizing_distributed_data_loader(
    B,
    T,
    split,
    tokenizer_threads=4,
    tokenizer_batch_size=128,
    device="cuda",
    resume_state_dict=None,
    tokenizer=None,
    data_dir=None,
    rank=None,
    world_size=None,
    packing="concat",
    buffer_size=1000,
):
    """
    Infinite iterator of (inputs, targets, state_dict): int64 tensors of shape (B, T) on `device` (targets are the
    inputs shifted by one token) and the small JSON-able dict that resumes this rank right after this batch.
    packing="concat": consecutive batches are consecutive windows of the token stream. packing="bestfit": every row
    starts at a document's BOS, documents packed by best fit from a buffer of `buffer_size` (nanochat/data/bestfit.py).
    rank/world_size default to the process group's; under tensor parallelism pass the plan's data rank and world
    (parallel.data_rank, parallel.data_world).
    """
    if B < 1 or T < 1:
        raise ValueError(f"B and T must be >= 1, got B={B}, T={T}")
    if tokenizer_batch_size < 1 or tokenizer_threads < 1:
        raise ValueError(f"tokenizer_batch_size and tokenizer_threads must be >= 1, got {tokenizer_batch_size}, {tokenizer_threads}")
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {packing!r}")
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    if rank is None or world_size is None:
        # the process's rank and world; under tensor parallelism the caller passes the plan's data rank and world
        dist_rank, dist_world_size, _ = process_data_ranks()
        rank = dist_rank if rank is None else rank
        world_size = dist_world_size if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if tokenizer is None:
        from nanochat.tokenizer import get_tokenizer  # only when needed: tests and tools pass their own

        tokenizer = get_tokenizer()
    row_groups = _row_group_index(split, data_dir)
    device = torch.device(device)
    if packing == "bestfit":
        return bestfit_batches(B, T, split, tokenizer, tokenizer_threads, tokenizer_batch_size, buffer_size, device,
                               row_groups, rank, world_size, resume_state_dict)
    start = _start_position(resume_state_dict, split, rank, world_size, len(row_groups))
    resumed = resume_state_dict is not None
    return _batches(B, T, split, tokenizer, tokenizer_threads, tokenizer_batch_size, device, row_groups, rank, world_size,
                    start, resumed)


# nanochat has a second name for the loader that also yields the state dict; here there is only one loader
tokenizing_distributed_data_loader_with_state = tokenizing_distributed_data_loader


def tokenizing_distributed_data_loader_with_state_bos_bestfit(tokenizer, B, T, split, tokenizer_threads=4,
                                                              tokenizer_batch_size=128, device="cuda",
                                                              resume_state_dict=None, buffer_size=1000, **kwargs):
    """nanochat 92d63d4's name and argument order for the best-fit loader (kwargs: data_dir, rank, world_size)."""
    return tokenizing_distributed_data_loader(B, T, split, tokenizer_threads, tokenizer_batch_size, device,
                                              resume_state_dict, tokenizer, packing="bestfit",
                                              buffer_size=buffer_size, **kwargs)


def tokenizing_distributed_data_loader_bos_bestfit(*args, **kwargs):
    """nanochat 92d63d4's best-fit loader without the state dicts: (inputs, targets) batches."""
    for inputs, targets, _ in tokenizing_distributed_data_loader_with_state_bos_bestfit(*args, **kwargs):
        yield inputs, targets


def _batches(B, T, split, tokenizer, threads, batch_size, device, row_groups, rank, world_size, start, resumed):
    bos = tokenizer.get_bos_token_id()
    pos, doc, token = start
    documents = _iter_documents(row_groups, world_size, pos, doc)
    n = len(row_groups)
    use_cuda = device.type == "cuda"
    needed = B * T + 1  # one extra token: the target of the last input position (it starts the next batch)

    pending = deque()  # (pos, doc_index, tokens) per tokenized document not fully consumed yet
    head = token  # tokens of pending[0] already consumed (a resumed state may start inside a document)
    available = -token  # tokens in `pending` not consumed yet
    check_start = resumed
    while True:
        while available < needed:
            chunk = [next(documents) for _ in range(batch_size)]
            encoded = tokenizer.encode([text for _, _, text in chunk], prepend=bos, num_threads=threads)
            for (p, i, _), ids in zip(chunk, encoded):
                pending.append((p, i, ids))
                available += len(ids)
            if check_start:  # a hand-edited or foreign state could name a document or token that does not exist
                check_start = False
                if pending[0][:2] != (pos, doc) or head >= len(pending[0][2]):
                    raise ValueError(f"the resume state names a token that does not exist in the data: {start}")

        window = []
        offset = head
        for _, _, ids in pending:
            window.extend(ids[offset : offset + needed - len(window)])
            offset = 0
            if len(window) == needed:
                break
        # consume B*T tokens; the last token of the window stays as the first input of the next batch
        to_consume = B * T
        while to_consume:
            left = len(pending[0][2]) - head
            if left <= to_consume:
                pending.popleft()
                head, to_consume, available = 0, to_consume - left, available - left
            else:
                head, available, to_consume = head + to_consume, available - to_consume, 0

        p, i, _ = pending[0]
        state = {
            "split": split,
            "rank": rank,
            "world_size": world_size,
            "num_row_groups": n,
            "epoch": p // n,
            "row_group": p % n,
            "doc": i,
            "token": head,
        }
        # numpy first: torch.tensor() on a list of 65k Python ints is ~4x slower and this runs every step
        scratch = torch.from_numpy(np.fromiter(window, dtype=np.int64, count=needed))
        if use_cuda:
            scratch = scratch.pin_memory()
        inputs = scratch[:-1].view(B, T).to(device, non_blocking=use_cuda)
        targets = scratch[1:].view(B, T).to(device, non_blocking=use_cuda)
        yield inputs, targets, state
