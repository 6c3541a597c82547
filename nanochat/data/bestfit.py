"""
BOS-aligned best-fit packing: the record recipe's pretraining batches, token for token those of nanochat 92d63d4's
`tokenizing_distributed_data_loader_with_state_bos_bestfit` for the same shards, tokenizer, batch shape, ranks and
buffer settings, with exact resume. nanochat/dataloader.py is the entry point (`packing="bestfit"`); this module is
the packing itself.

Every row of a (B, T) batch starts with a document's BOS, so every token sees the start of its document. A row holds
T + 1 tokens (the inputs are its first T, the targets its last T) and is filled from a buffer of tokenized documents:
the longest document that still fits whole goes in next, again and again; when none fits, the shortest document in
the buffer is cropped to fill the row exactly and the rest of it is dropped. No padding: every position trains. The
price is the cropped tokens (nanochat measured ~35% at T=2048), counted in the state (`cropped_fraction`).

Reading order, nanochat's (that is what makes the batches equal): the split's files in order; in each file, rank r of
W reads row groups r, r+W, r+2W, ...; after the last file, the next epoch from the first. Documents enter the buffer
`tokenizer_batch_size` at a time (a row group's documents 0..b-1, then b..2b-1, ...), whenever the buffer holds fewer
than `buffer_size` before a document is placed. Ties go to the document read first. A rank that no file gives a row
group (every file has r row groups or fewer) reads as rank r mod M, M the most row groups of one file, so it duplicates
that rank's data instead of waiting forever as nanochat would; the concat loader's extra ranks wrap the same way.

Exact resume: the state names the next row-group chunk to read and every document waiting in the buffer (runs of
consecutive documents of one row group). A loader started from it re-reads and re-tokenizes those documents and goes
on with exactly the batches the saved one would have yielded next. A document is never split between batches (the
tail of a cropped one is dropped), so the state never points inside one. It is the biggest loader state here: up to
`buffer_size` documents as runs, ~15 KB of JSON per rank with a full 1000-document buffer of short web documents.
"""

import bisect

import numpy as np
import torch

from nanochat.dataset import open_shard, read_texts, shard_fix
from nanochat.usage import BadValue

STATE_KEYS = ("packing", "split", "rank", "world_size", "num_row_groups", "buffer_size", "tokenizer_batch_size",
              "epoch", "file", "row_group", "doc", "buffer", "packed_tokens", "cropped_tokens")


def split_files(row_groups):
    """[(path, number of row groups)] of a split's files in order, from the loader's (path, row group) index."""
    files = []
    for path, rg in row_groups:
        if rg == 0:
            files.append((path, 0))
        files[-1] = (path, rg + 1)
    return files


def rank_order(files, rank, world_size):
    """The (file, row group) pairs this rank reads in one epoch, in reading order (nanochat's per-file striding)."""
    order = [(f, rg) for f, (_, n) in enumerate(files) for rg in range(rank, n, world_size)]
    if not order:  # no file has more than `rank` row groups: read as a rank that has some
        return rank_order(files, rank % max(n for _, n in files), world_size)
    return order


class _Reader:
    """This rank's documents in reading order, one chunk (<= tokenizer_batch_size documents of a row group) at a time."""

    def __init__(self, files, order, chunk, epoch, file, row_group, doc):
        self.files, self.order, self.chunk = files, order, chunk
        self.epoch, self.doc = epoch, doc
        # the first of this rank's row groups at or after (file, row_group): the saved one itself, or, for a state
        # loader_states_for_world made for another world size, the next one this rank reads
        self.i = bisect.bisect_left(order, (file, row_group))
        if self.i == len(order) or order[self.i] != (file, row_group):
            if doc != 0:
                raise ValueError(f"the resume state names document {doc} of row group {row_group} of file {file}, "
                                 f"which this rank does not read")
            if self.i == len(order):
                self.i, self.epoch = 0, epoch + 1
        self._cached = (None, None)  # ((file, row group), texts) last read
        self._open = (None, None)  # (path, ParquetFile): consecutive reads mostly hit the same file

    def position(self):
        """(epoch, file, row group, document) of the next chunk."""
        return (self.epoch, *self.order[self.i], self.doc)

    def texts(self, f, rg):
        if self._cached[0] != (f, rg):
            path = self.files[f][0]
            if self._open[0] != path:
                self._open = (path, open_shard(path))
            texts = read_texts(self._open[1], path, rg)
            if any(t is None for t in texts):
                raise ValueError(f"{path}: row group {rg}, row {texts.index(None)} has a null text: {shard_fix(path)}")
            self._cached = ((f, rg), texts)
        return self._cached[1]

    def next_chunk(self):
        """[(document id, text)] of the next non-empty chunk; a document id is (epoch, file, row group, index)."""
        empty = 0
        while True:
            f, rg = self.order[self.i]
            texts = self.texts(f, rg)
            if self.doc >= len(texts) > 0:
                raise ValueError(f"the resume state names document {self.doc} of row group {rg} of file {f}, which "
                                 f"has {len(texts)}")
            chunk = [((self.epoch, f, rg, d), texts[d]) for d in range(self.doc, min(self.doc + self.chunk, len(texts)))]
            self.doc += self.chunk
            if self.doc >= len(texts):
                self.doc, self.i = 0, self.i + 1
                if self.i == len(self.order):
                    self.i, self.epoch = 0, self.epoch + 1
            if chunk:
                return chunk
            empty += 1
            if empty > len(self.order):  # a whole epoch of this rank's row groups without one document
                raise ValueError(f"no documents in any row group this rank reads ({len(self.order)} row groups)")


class _Buffer:
    """Tokenized documents waiting to be packed, in reading order, with a (length, arrival) index for the search."""

    def __init__(self):
        self.docs = {}  # arrival number -> (document id, tokens); a dict keeps arrival order through deletions
        self.by_length = []  # sorted (length, arrival number)
        self.arrivals = 0

    def __len__(self):
        return len(self.docs)

    def add(self, doc_id, tokens):
        self.docs[self.arrivals] = (doc_id, np.asarray(tokens, dtype=np.int64))
        bisect.insort(self.by_length, (len(tokens), self.arrivals))
        self.arrivals += 1

    def _take(self, i):
        _, arrival = self.by_length.pop(i)
        return self.docs.pop(arrival)[1]

    def take_best_fit(self, room):
        """The longest document of at most `room` tokens (the first read among equals), or None when none fits."""
        i = bisect.bisect_right(self.by_length, (room, self.arrivals)) - 1
        if i < 0:
            return None
        return self._take(bisect.bisect_left(self.by_length, (self.by_length[i][0], -1)))

    def take_shortest(self):
        return self._take(0)  # the shortest, the first read among equals

    def runs(self):
        """The waiting documents as runs [epoch, file, row group, first document, count], in reading order."""
        runs = []
        for (e, f, rg, d), _ in self.docs.values():
            last = runs[-1] if runs else None
            if last is not None and last[:3] == [e, f, rg] and last[3] + last[4] == d:
                last[4] += 1
            else:
                runs.append([e, f, rg, d, 1])
        return runs


def check_loader_state(state, packing, keys, split, rank, world_size, num_row_groups):
    """The checks of a resume state both packings share: the packing that saved it, its keys, split, rank and shards."""
    saved = state.get("packing", "concat")
    if saved != packing:
        raise BadValue(f"the data position was saved by the {saved} loader (--packing={saved}); this run packs with "
                       f"{packing}: resume with --packing={saved}, or start a fresh run")
    missing = set(keys) - set(state)
    if missing:
        raise ValueError(f"not a {packing} loader state dict from nanochat.dataloader (missing {sorted(missing)}): "
                         f"{state}")
    if state["split"] != split:
        raise ValueError(f"the state dict belongs to the {state['split']!r} split, this loader reads {split!r}")
    if (state["rank"], state["world_size"]) != (rank, world_size):
        raise ValueError(
            f"the state dict was saved by rank {state['rank']} of {state['world_size']}, this is rank {rank} of "
            f"{world_size}: give every rank its own saved state, and resume with the same world size "
            f"(loader_states_for_world moves the states of a run to another)")
    if state["num_row_groups"] != num_row_groups:
        raise ValueError(
            f"the {split} split now has {num_row_groups} row groups, the state was saved with "
            f"{state['num_row_groups']}: exact resume needs the same shards (were shards added or removed?)")


def check_state(state, split, rank, world_size, num_row_groups, buffer_size, tokenizer_batch_size):
    """Refuse a state this loader cannot resume exactly from, naming why (the fix where the user has one)."""
    check_loader_state(state, "bestfit", STATE_KEYS, split, rank, world_size, num_row_groups)
    for key, value in (("buffer_size", buffer_size), ("tokenizer_batch_size", tokenizer_batch_size)):
        if state[key] != value:
            raise ValueError(f"the state was saved with {key}={state[key]}, this loader has {key}={value}: the "
                             f"batches after an exact resume depend on it, so use the saved value")


def bestfit_batches(B, T, split, tokenizer, threads, tokenizer_batch_size, buffer_size, device, row_groups, rank,
                    world_size, resume_state_dict=None):
    """
    Infinite iterator of (inputs, targets, state_dict), as nanochat.dataloader.tokenizing_distributed_data_loader
    with packing="bestfit" (which checks the arguments and calls this). row_groups: the split's (path, row group) index.
    A resume state is checked, and its waiting documents read back, here, before the first batch is asked for.
    """
    files = split_files(row_groups)
    order = rank_order(files, rank, world_size)
    state = resume_state_dict
    if state is not None:
        check_state(state, split, rank, world_size, len(row_groups), buffer_size, tokenizer_batch_size)
    start = (0, *order[0], 0) if state is None else (state["epoch"], state["file"], state["row_group"], state["doc"])
    reader = _Reader(files, order, tokenizer_batch_size, *start)
    bos = tokenizer.get_bos_token_id()
    buffer = _Buffer()
    packed, cropped = (0, 0) if state is None else (state["packed_tokens"], state["cropped_tokens"])

    def add(chunk):
        texts = [text for _, text in chunk]
        for (doc_id, _), ids in zip(chunk, tokenizer.encode(texts, prepend=bos, num_threads=threads)):
            buffer.add(doc_id, ids)

    if state is not None:  # the documents that were waiting, read and tokenized again (tokenization is per document)
        waiting, readable = [], set(order)
        for e, f, rg, d, n in state["buffer"]:
            if (f, rg) not in readable or d < 0 or n < 1 or d + n > len(reader.texts(f, rg)):
                raise ValueError(f"the resume state's buffer names documents that do not exist for this rank: "
                                 f"{[e, f, rg, d, n]}")
            waiting += [((e, f, rg, d + k), reader.texts(f, rg)[d + k]) for k in range(n)]
        for i in range(0, len(waiting), tokenizer_batch_size):
            add(waiting[i : i + tokenizer_batch_size])
    state_of = {"packing": "bestfit", "split": split, "rank": rank, "world_size": world_size,
                "num_row_groups": len(row_groups), "buffer_size": buffer_size,
                "tokenizer_batch_size": tokenizer_batch_size}
    return _pack(B, T, device, reader, buffer, buffer_size, add, packed, cropped, state_of)


def _pack(B, T, device, reader, buffer, buffer_size, add, packed, cropped, state_of):
    """The batches: rows filled by best fit from the buffer, refilled from the reader (see the module docstring)."""
    use_cuda = device.type == "cuda"
    width = T + 1
    rows = np.empty((B, width), dtype=np.int64)
    while True:
        for r in range(B):
            pos = 0
            while pos < width:
                while len(buffer) < buffer_size:
                    add(reader.next_chunk())
                room = width - pos
                tokens = buffer.take_best_fit(room)
                if tokens is None:  # nothing fits whole: crop the shortest to fill the row exactly
                    tokens = buffer.take_shortest()
                    cropped += len(tokens) - room
                    tokens = tokens[:room]
                rows[r, pos : pos + len(tokens)] = tokens
                pos += len(tokens)
        packed += B * width
        e, f, rg, d = reader.position()
        state = dict(state_of, epoch=e, file=f, row_group=rg, doc=d, buffer=buffer.runs(), packed_tokens=packed,
                     cropped_tokens=cropped)
        # inputs and targets stacked: one (pinned) host buffer, one copy to the device, two contiguous views
        both = torch.from_numpy(np.stack([rows[:, :-1], rows[:, 1:]]))
        if use_cuda:
            both = both.pin_memory()
        both = both.to(device, non_blocking=use_cuda)
        yield both[0], both[1], state


def cropped_fraction(states):
    """Tokens dropped by cropping / tokens of the documents packed so far, over the given ranks' latest states
    (None when none of them is a best-fit state)."""
    states = [s for s in states if s is not None and s.get("packing") == "bestfit"]
    cropped = sum(s["cropped_tokens"] for s in states)
    total = cropped + sum(s["packed_tokens"] for s in states)
    return cropped / total if total else None


def states_for_world(states, world_size, log=None):
    """
    loader_states_for_world for best-fit states saved by another number of ranks: every new rank starts at the first
    of its row groups at or after P, the furthest point any saved rank had started reading (in (epoch, file, row
    group) order), with an empty buffer. The documents that were waiting in the saved buffers and the rest of the row
    groups the saved ranks were in are skipped; nothing is read twice. The cropping counts go to rank 0.
    """
    if any(s.get("packing") != "bestfit" for s in states):
        raise BadValue("the saved data positions mix the concat and bestfit loaders: they come from different runs")
    for s in states:
        check_state(s, states[0]["split"], s["rank"], s["world_size"], states[0]["num_row_groups"],
                    states[0]["buffer_size"], states[0]["tokenizer_batch_size"])
    # a rank's next chunk at document d > 0 means it started that row group: the next untouched one is row_group + 1
    start = max((s["epoch"], s["file"], s["row_group"] + (s["doc"] > 0)) for s in states)
    if log is not None:
        log(f"Note: the data position was saved by {len(states)} rank(s) and is read by {world_size} now: every rank "
            f"starts at its first row group at or after epoch {start[0]}, file {start[1]}, row group {start[2]}; the "
            f"documents waiting in the saved buffers and the rest of the row groups being read are skipped")
    total = {key: sum(s[key] for s in states) for key in ("packed_tokens", "cropped_tokens")}
    zero = dict.fromkeys(total, 0)
    return [dict(states[0], rank=r, world_size=world_size, epoch=start[0], file=start[1], row_group=start[2], doc=0,
                 buffer=[], **(total if r == 0 else zero)) for r in range(world_size)]
