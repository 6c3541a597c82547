"""
KV memory for serving many sequences at once: a pool of fixed-size slots (one sequence each), the views through
which the model's forward reads and writes it, the prefix cache that keeps finished sequences' keys and values for
later requests, and the memory budget both come from.

    pool = SlotPool(layers=4, kv_heads=2, head_dim=128, rows=64, slot_len=1024, dtype=torch.float32, device=cpu)
    model(chunk_ids, kv_cache=pool.prefill_view(row, start))       # one sequence's prompt chunk into its slot
    model(ids, kv_cache=pool.packed_prefill_view(chunks, model.attn_choice))   # several's chunks at once
    model(ids, kv_cache=pool.decode_view(bucket))                   # one token for each of rows [0, bucket)

The model sees the same cache API as the Engine's KVCache (nanochat/engine.py): `insert_kv(layer, k, v)` returns the
keys/values to attend, `get_pos()` / `positions` give the rotary positions and `attn_mask` the positions to attend.
A decode view gives every row its own position (B, 1) and mask (B, 1, 1, S+1): rows are at different lengths. Views
that attend over their own layout have `attend(layer, q, k, v[, window])`, and prefill views `last(x)`: the positions
whose logits the forward returns (the last one; a packed prefill's, each chunk's last).

Why slots and not pages: on CPU (and with torch's SDPA kernels on GPU) attention needs each row's keys contiguous,
so paged blocks would be gathered into a contiguous batch every step, a copy of the whole cache per step. A slot is
contiguous already; the cost is that every admitted sequence reserves slot_len positions (--max_context). The
prefix cache is paged instead (blocks of BLOCK tokens, hashed by their whole prefix, as vLLM's): it is only copied
when a request starts (matched blocks into its slot) and when a sequence is registered (its new blocks out of it).
A finished sequence's slot stays parked with its keys/values until another request takes it, and a request that
continues it (a conversation's next turn, arriving first) resumes in that slot: no copy, and to the token where the
blocks stop at the last whole one (PrefixCache.resume).

Each slot has at least slot_len + 1 columns: the last one is scratch, written by the filler rows of a decode batch
(rows of the bucket that hold no decoding sequence) and never attended by a real row, so a filler cannot disturb a
slot whose prompt is still being prefilled.

A per-layer attention window (sliding-window layers) fits this layout: a windowed layer's decode mask becomes
`pos - window < column <= pos` (the `attn_mask` of that layer) and its prefill chunk mask the same band; the slot
may even shrink to window + 1 columns for such a layer as a ring (keys are cached after rotary, so their order in
storage does not matter to attention). Nothing here does that yet: the model has no windowed layers.
"""

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanochat.attention import attention
from nanochat.engine import host_tensor

BLOCK = 16  # tokens per prefix-cache block: the granularity at which prompts share cached keys/values
ATTN_BLOCK = 64  # decode attention reads keys in blocks of this many positions (slot columns are a multiple of it)


def kv_bytes_per_token(num_layers, kv_heads, head_dim, dtype):
    return num_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory_bytes(device):
    """Memory free for the KV cache on `device`: CUDA's free memory now, else the host's available memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# share of the free memory the KV cache takes by default: most of a GPU (what is left holds the activations of a
# prefill chunk and a decode step), a quarter of a host's RAM (the host runs everything else too)
DEFAULT_BUDGET_FRACTION = {"cuda": 0.85, "cpu": 0.25, "mps": 0.25}


def default_budget_bytes(device):
    device = torch.device(device)
    return int(free_memory_bytes(device) * DEFAULT_BUDGET_FRACTION.get(device.type, 0.25))


def decode_buckets(max_rows):
    """
    Batch sizes a compiled decode step runs at (one graph each, on CUDA a captured CUDA graph): 4, 8, then multiples
    of 8 growing by about 1.5x (16, 24, 40, 64, 96, ...), the last one max_rows rounded up to a multiple of 8. Few
    shapes and at most ~1.5x padding. The pool has as many rows as the largest bucket. An eager step runs at the
    sizes of invariance.decode_sizes instead.
    """
    top = max(8, -(-max_rows // 8) * 8) if max_rows > 4 else 4
    out = [4]
    while out[-1] < top:
        out.append(min(top, max(out[-1] + 8 if out[-1] >= 8 else 8, (out[-1] * 3 // 2 + 7) // 8 * 8)))
    return out


MIN_PREFIX_CACHE_BLOCKS = 64  # below this the prefix cache is off (the budget went to the slots)
PREFIX_CACHE_SHARE = 0.5  # at most this share of the KV budget holds the prefix cache; the slots take the rest first
PREFIX_CACHE_BATCHES = 4  # and at most this many full pools' worth: more would mostly hold conversations long gone


@dataclass
class KVPlan:
    """How a scheduler's KV memory is laid out (plan_kv)."""

    layers: int
    kv_heads: int
    head_dim: int
    max_context: int  # positions per slot
    rows: int  # slots (a whole decode bucket)
    max_batch: int  # sequences admitted at once (<= rows)
    buckets: list
    prefix_blocks: int  # 0: no prefix cache
    budget: int
    slot_bytes: int


def plan_kv(config, max_positions, max_batch, max_context, dtype, device, budget=None, prefix_cache=True):
    """
    Slots and prefix-cache blocks for a model of GPTConfig `config` within `budget` bytes (default: a share of the
    device's free memory, DEFAULT_BUDGET_FRACTION). The slots come first: as many decode rows as max_batch asks for
    and the budget holds (at least one bucket of 4); the prefix cache takes what is left, within PREFIX_CACHE_SHARE
    of the budget. Raises ValueError, saying which setting to change, when nothing fits.
    """
    limit = int(max_positions)
    max_context = int(max_context or min(config.sequence_len, limit))
    if not 2 <= max_context <= limit:
        raise ValueError(f"--max_context={max_context} must be in [2, {limit}] (the positions this model addresses)")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"--max_batch must be a positive int, got {max_batch!r}")
    head_dim = config.n_embd // config.n_head
    per_token = kv_bytes_per_token(config.n_layer, config.n_kv_head, head_dim, dtype)
    slot_bytes = per_token * (-(-(max_context + 1) // ATTN_BLOCK) * ATTN_BLOCK)  # SlotPool.columns
    budget = int(budget) if budget is not None else default_budget_bytes(device)
    buckets = decode_buckets(max_batch)
    fit = [b for b in buckets if b * slot_bytes <= budget]
    if not fit:
        raise ValueError(
            f"the KV cache budget ({budget / 2**30:.2f} GiB) holds fewer than {buckets[0]} sequences of "
            f"--max_context={max_context} tokens ({slot_bytes / 2**20:.1f} MiB each): lower --max_context or raise "
            f"--kv_cache_gb")
    rows = fit[-1]
    blocks = 0
    if prefix_cache:
        cache_bytes = min(budget - rows * slot_bytes, int(budget * PREFIX_CACHE_SHARE))
        blocks = min(cache_bytes // (per_token * BLOCK), PREFIX_CACHE_BATCHES * rows * max_context // BLOCK)
        blocks = blocks if blocks >= MIN_PREFIX_CACHE_BLOCKS else 0
    return KVPlan(config.n_layer, config.n_kv_head, head_dim, max_context, rows, min(max_batch, rows),
                  [b for b in buckets if b <= rows], blocks, budget, slot_bytes)


class PrefillView:
    """One sequence's slot seen as a batch-1 cache at `start` tokens: the model appends a chunk of its prompt."""

    positions = None
    attn_mask = None

    def __init__(self, pool, row, start, prev_id=None):
        self.pool, self.row, self.start = pool, row, start
        # a model that mixes in the previous token (RecordGPT's smear) reads it here: the token before the chunk
        self.prev_ids = None if prev_id is None else host_tensor([[prev_id]], pool.device, torch.long)

    def get_pos(self):
        return self.start

    @staticmethod
    def last(x):
        """The hidden states the logits are computed for (the model asks, `last`): a prefill needs its last
        position's only."""
        return x[:, -1:]

    def insert_kv(self, layer_idx, k, v):
        T = k.size(2)
        end = self.start + T
        if end > self.pool.slot_len:
            raise ValueError(f"a prefill to {end} tokens overflows the slot of {self.pool.slot_len}")
        keys, values = self.pool.layers[layer_idx]
        keys[self.row, :, self.start:end] = k[0]
        values[self.row, :, self.start:end] = v[0]
        r = self.row
        return keys[r:r + 1, :, :end], values[r:r + 1, :, :end]


class PackedPrefillView:
    """
    Chunks of several sequences' prompts packed into one batch-1 forward: `chunks` are (slot, start, length, previous
    token id or None), and the input is their tokens one after the other. Every matmul then runs once over all the
    chunks' tokens (on a GPU a prefill of one short prompt is kernel launches more than arithmetic), while each
    chunk's attention is computed on its own, as the model computes a PrefillView's (nanochat.attention.attention on
    the same keys: positions `start + i` over its slot's columns up to them). `last` gives the logits of each chunk's
    last token, in chunk order. Not batch-invariant: a token's matmul rows depend on how many tokens share the
    forward, so the scheduler packs only where it does not promise that (not on CPU by default).
    """

    attn_mask = None

    def __init__(self, pool, chunks, backend):
        self.pool, self.chunks, self.backend = pool, chunks, backend  # backend: the model's attn_choice
        bounds, positions, a = [], [], 0
        for _, start, n, _ in chunks:
            bounds.append((a, a + n))
            positions.extend(range(start, start + n))
            a += n
        self.bounds = bounds
        device = pool.device
        self.positions = host_tensor([positions], device, torch.long)  # (1, T): each token's rotary position
        self.ends = host_tensor([b - 1 for _, b in bounds], device, torch.long)
        # RecordGPT's smear: where each chunk starts in the packed sequence, and the token before it (-1: none)
        self.starts = host_tensor([a for a, _ in bounds], device, torch.long)
        self.prev_ids = host_tensor([[-1 if p is None else p for *_, p in chunks]], device, torch.long)

    def get_pos(self):  # the model reads `positions`
        raise TypeError("a packed prefill has one position per token: read .positions")

    def last(self, x):
        return x[:, self.ends]

    def insert_kv(self, layer_idx, k, v):
        keys, values = self.pool.layers[layer_idx]
        for (slot, start, n, _), (a, b) in zip(self.chunks, self.bounds):
            if start + n > self.pool.slot_len:
                raise ValueError(f"a prefill to {start + n} tokens overflows the slot of {self.pool.slot_len}")
            keys[slot, :, start:start + n] = k[0, :, a:b]
            values[slot, :, start:start + n] = v[0, :, a:b]
        return k, v

    def attend(self, layer_idx, q, k, v, window=None):
        keys, values = self.pool.layers[layer_idx]
        out = []
        for (slot, start, n, _), (a, b) in zip(self.chunks, self.bounds):
            end = start + n
            out.append(attention(q[:, :, a:b], keys[slot:slot + 1, :, :end], values[slot:slot + 1, :, :end],
                                 self.backend, None, window))
        return torch.cat(out, dim=2)


# devices whose cumsum adds in order: torch's CPU kernel is a sequential scan (accumulating in double, each output
# rounded once), so appended zeros leave its last output's bits alone; a GPU's parallel scan may group by the length
SEQUENTIAL_SCAN_DEVICES = ("cpu",)


def blockwise_attention(q, k, v, mask, span):
    """
    One decode token per row, q (B, Hq, 1, D), over the first `span` columns of k, v (B, Hkv, C, D) where `mask`
    (B, 1, 1, C) allows; span a multiple of ATTN_BLOCK. A row's result is the same bits whatever the batch (its
    size, the other rows, their lengths, so the span): the scores are one matmul per (row, head) whose columns do
    not depend on how many there are, the max is exact in any order, and the sums over positions run block by block
    in a fixed order, the blocks past the row's length adding exact zeros: the weighted values accumulate block
    after block (one in-place batched matmul each, baddbmm), and the blocks' weights are summed in order (where
    SEQUENTIAL_SCAN_DEVICES says cumsum scans in order, by one cumsum, else one add a block). (torch's CPU flash
    kernel does not: with several threads it splits the keys differently by batch size, and even with one its
    blocks follow the span, and a matmul over more columns, zeros or not, may sum in another order, under MKL's
    strict mode too; the math kernel scales the whole cache every step.) Grouped-query attention: the query heads of
    one key head are the rows of one matmul.
    """
    B, Hq, _, D = q.shape
    Hkv = k.size(1)
    G = Hq // Hkv
    scores = torch.matmul((q * D ** -0.5).view(B, Hkv, G, D), k[:, :, :span].transpose(-1, -2))  # (B, Hkv, G, span)
    scores = scores.masked_fill(~mask[:, :, :, :span], float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True)).view(B * Hkv, G, span)
    v = v.flatten(0, 1)  # (B * Hkv, C, D): a view of the slots (its blocks below are matmul operands as they are)
    out = torch.bmm(p[..., :ATTN_BLOCK], v[:, :ATTN_BLOCK])
    for j in range(ATTN_BLOCK, span, ATTN_BLOCK):
        out.baddbmm_(p[..., j:j + ATTN_BLOCK], v[:, j:j + ATTN_BLOCK])
    sums = p.view(B * Hkv, G, span // ATTN_BLOCK, ATTN_BLOCK).sum(-1)  # each block's weight
    if p.device.type in SEQUENTIAL_SCAN_DEVICES:
        weight = sums.cumsum(-1)[..., -1:]
    else:
        weight = sums[..., :1]
        for j in range(1, sums.size(-1)):
            weight = weight + sums[..., j:j + 1]
    return (out / weight).reshape(B, Hq, 1, D).to(q.dtype)


def _take(t, rows):
    """Rows of t along dim 0: a slice of consecutive rows is a view, anything else an index_select copy (the same
    values, and the same bits out of the attention kernel, measured in tests/unit/test_scheduler.py)."""
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def shared_prompt_attention(q, keys, values, first, prompt_len, rows):
    """
    Decode attention for the rows of one request that sample n completions of one prompt (CPU): q (n, Hq, 1, D),
    `rows` their n slots in the pool's keys/values (R, Hkv, C, D) (a slice or an index, _take), all at the same
    position, their first prompt_len columns the same prompt (copied from slot `first` when it was prefilled). Every
    row reading its own copy of the prompt makes a step read the prompt n times over; here the prompt is read once,
    as one sequence of the n rows' queries against slot `first`'s prompt, then each row's own columns after it, and
    the two softmaxes are merged by their log-sum-exps ("cascade" attention). Equal to attending the whole row up to
    float rounding; a row's result depends only on its request's rows (their count, values and position), never on
    the rest of the batch.
    """
    n, Hq, _, D = q.shape
    Hkv = keys.size(1)
    G = Hq // Hkv
    P = prompt_len
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns the log-sum-exp too
    grouped = q.view(n, Hkv, G, D)  # grouped-query attention: a key head's G query heads are G queries
    o1, l1 = flash(grouped.transpose(0, 1).reshape(1, Hkv, n * G, D), keys[first:first + 1, :, :P],
                   values[first:first + 1, :, :P])[:2]
    o1, l1 = o1.reshape(Hkv, n, G, D).transpose(0, 1), l1.reshape(Hkv, n, G).transpose(0, 1)
    L = keys.size(2)  # the caller hands each row's columns up to its position: after the prompt, its own
    o2, l2 = flash(grouped, _take(keys[:, :, P:L], rows), _take(values[:, :, P:L], rows))[:2]
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp().unsqueeze(-1), (l2 - m).exp().unsqueeze(-1)
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).reshape(n, Hq, 1, D).to(q.dtype)


class DecodeView:
    """
    Rows [0, B) of the pool as one batch for a decode step: row i feeds one token at its own position pos[i] and
    attends columns <= pos[i] of its slot. The positions, their mask and the input ids live in tensors of fixed
    address (set before each step), so a compiled or graph-captured step finds its inputs where it left them.
    Attention reads the first `span` columns only (the longest row's, rounded up to ATTN_BLOCK; every column with
    trim=False, as a compiled step needs one shape), with `invariant` through blockwise_attention (a row's result
    the same bits in any batch), else torch's SDPA. Inside the forward only tensors' sizes say the batch size, so a
    compiled step can take it as a symbolic size. Filler rows (set_step's None) sit at position 0, attend column 0
    and write the scratch column; with trim, the fillers after the last live row skip attention (their output is
    zero: nothing reads a filler's logits, and a row's attention is computed on its own, so skipping others changes
    no bit of it). On CPU, eager, the rows of a request sampling n completions can attend their common prompt once
    (set_step's `shared`, shared_prompt_attention) and the other rows run as runs of consecutive rows.
    """

    def __init__(self, pool, batch, invariant, trim=True, windows=()):
        device = pool.device
        self.pool, self.batch, self.invariant, self.trim = pool, batch, invariant, trim
        self.rows = torch.arange(batch, device=device)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.prev_ids = torch.full((batch, 1), -1, dtype=torch.long, device=device)  # each row's previous token
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.column = torch.zeros(batch, dtype=torch.long, device=device)  # where each row writes: pos, or scratch
        self.mask = torch.zeros(batch, 1, 1, pool.columns, dtype=torch.bool, device=device)
        # sliding-window layers (RecordGPT): per window, the columns pos - window .. pos
        self.window_masks = {w: torch.zeros_like(self.mask) for w in sorted(set(windows))}
        self.columns = torch.arange(pool.columns, device=device)
        self.span = pool.columns
        self.live = batch  # rows up to the last live one (set_step): attention runs on these
        self.shared, self.runs = [], []  # set_step's shared-prompt groups, and the runs of the other rows

    def tensors(self):
        """The step's input tensors (a compiled step marks their addresses static)."""
        return [self.ids, self.prev_ids, self.pos, self.column, self.mask, self.rows, self.columns,
                *self.window_masks.values()]

    @property
    def positions(self):
        return self.pos

    def get_pos(self):  # the model reads `positions` instead; an int makes no sense for rows at different lengths
        raise TypeError("a decode view has one position per row: read .positions")

    def set_step(self, ids, positions, prev_ids=None, shared=()):
        """Host lists of B ids and positions (None: a filler row), and the tokens before them (-1: none) -> the
        device tensors (one copy each), the masks. shared: (rows, prompt length) per request whose rows (>= 2, at
        one position, same prompt in their slots) attend their prompt once (shared_prompt_attention; eager on CPU)."""
        pos = [0 if p is None else p for p in positions]
        column = [self.pool.scratch if p is None else p for p in positions]
        self.ids.copy_(torch.tensor(ids, dtype=torch.long).view(-1, 1), non_blocking=True)
        if prev_ids is not None:
            self.prev_ids.copy_(torch.tensor(prev_ids, dtype=torch.long).view(-1, 1), non_blocking=True)
        self.pos.copy_(torch.tensor(pos, dtype=torch.long).view(-1, 1), non_blocking=True)
        self.column.copy_(torch.tensor(column, dtype=torch.long), non_blocking=True)
        torch.le(self.columns.view(1, -1), self.pos, out=self.mask.view(self.batch, -1))
        for window, mask in self.window_masks.items():
            torch.ge(self.columns.view(1, -1), self.pos - window, out=mask.view(self.batch, -1))
            mask &= self.mask
        if self.trim:
            self.span = -(-(max(pos) + 1) // ATTN_BLOCK) * ATTN_BLOCK
            self.live = max((i + 1 for i, p in enumerate(positions) if p is not None), default=1)
        self.shared, self.runs = [], []
        if shared and self.trim and self.pool.device.type == "cpu":
            grouped = set()
            for rows, prompt_len in shared:
                consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
                take = slice(rows[0], rows[-1] + 1) if consecutive else host_tensor(rows, self.pool.device)
                self.shared.append((take, rows[0], prompt_len, positions[rows[0]] + 1))
                grouped.update(rows)
            start = None  # the other rows up to the last live one, in runs of consecutive slots
            for i in range(self.live + 1):
                if i < self.live and i not in grouped:
                    start = i if start is None else start
                elif start is not None:
                    span = -(-(max(pos[start:i]) + 1) // ATTN_BLOCK) * ATTN_BLOCK
                    self.runs.append((start, i, span))
                    start = None

    def insert_kv(self, layer_idx, k, v):
        keys, values = self.pool.layers[layer_idx]
        keys[self.rows, :, self.column] = k[:, :, 0]
        values[self.rows, :, self.column] = v[:, :, 0]
        B = self.rows.size(0)
        return keys[:B], values[:B]

    def attend(self, layer_idx, q, k, v, window=None):
        mask = self.mask if window is None else self.window_masks[window]  # window: the layer's sliding window
        n = self.live
        if self.shared and window is None:  # (a windowed layer attends as usual: its band may not hold the prompt)
            out = q.new_zeros(q.shape)
            for a, b, span in self.runs:
                out[a:b] = self._attend(q[a:b], k[a:b], v[a:b], mask[a:b], span)
            for rows, first, prompt_len, end in self.shared:
                part = shared_prompt_attention(_take(q, rows), k[:, :, :end], v[:, :, :end], first, prompt_len, rows)
                if isinstance(rows, slice):
                    out[rows] = part
                else:
                    out.index_copy_(0, rows, part)
            return out
        if self.trim and n < q.size(0):  # trailing filler rows: zeros, not attention (eager only: fixed shapes)
            out = q.new_zeros(q.shape)
            out[:n] = self._attend(q[:n], k[:n], v[:n], mask[:n])
            return out
        return self._attend(q, k, v, mask)

    def _attend(self, q, k, v, mask, span=None):
        span = span or self.span
        if self.invariant:
            return blockwise_attention(q, k, v, mask, span)
        return F.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], attn_mask=mask[..., :span],
                                              enable_gqa=q.size(1) != k.size(1))


class SlotPool:
    """
    `rows` slots of slot_len positions for every layer, plus a scratch column, rounded up to whole ATTN_BLOCKs: per
    layer a pair of tensors (keys, values), each (rows, heads, columns, dim), zeroed (a masked position still enters
    attention's sums as 0 * value, and uninitialised memory may hold NaN). Two tensors per layer, not views of one: a
    compiled step writes graph inputs in place only when it writes the input itself; a write through a view (keys and
    values as kv[0] and kv[1] of one (2, ...) tensor, or layers as slices of one tensor) made inductor copy the whole
    tensor into a new buffer and back every step: on an H100 at d20 and 256 rows, 1000 MiB a layer, out of memory
    (see also KVCache.start_fixed_shape; tests/unit/test_scheduler.py reads the compiled code).
    """

    def __init__(self, num_layers, kv_heads, head_dim, rows, slot_len, dtype, device):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.rows, self.slot_len, self.dtype, self.device = rows, slot_len, dtype, torch.device(device)
        self.columns = -(-(slot_len + 1) // ATTN_BLOCK) * ATTN_BLOCK
        shape = (rows, kv_heads, self.columns, head_dim)
        self.layers = [tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)) for _ in range(num_layers)]

    @property
    def scratch(self):
        return self.columns - 1

    def tensors(self):
        return [t for pair in self.layers for t in pair]

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def prefill_view(self, row, start, prev_id=None):
        return PrefillView(self, row, start, prev_id)

    def packed_prefill_view(self, chunks, backend):
        return PackedPrefillView(self, chunks, backend)

    def copy_prefix(self, src, dst, n):
        """The first n positions of slot src into slot dst (a request's extra samples start from its prompt)."""
        for t in self.tensors():
            t[dst, :, :n] = t[src, :, :n]


class _Key:
    """
    A prefix-cache key: one block's tokens after its parent block's key. Keys in the index are canonical (a walk
    continues from the key it found, and a child holds its parent), so a parent compares by identity and a key
    hashes and compares in O(BLOCK) however deep it is. (Keys as nested tuples hashed and compared the whole prefix
    at every block: O(blocks^2) a lookup, ~2 ms for a 2,000-token conversation; a hash of the prefix alone could be
    made to collide, and serve one user's cached keys/values to another.)
    """

    __slots__ = ("parent", "tokens", "hash")

    def __init__(self, parent, tokens):
        self.parent, self.tokens = parent, tokens
        self.hash = hash((id(parent), tokens))

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return self.parent is other.parent and self.tokens == other.tokens


MAX_RUN_COPIES = 4  # a prefix-cache load or save copies up to this many runs of consecutive blocks one by one (load;
# measured, d4 shapes, 42 blocks: one run 0.34 ms against 0.64 gathered, five runs the same, 42 runs 2.9 against 0.64)


def _runs(blocks, positions=None):
    """Runs of consecutive ids in `blocks` at consecutive positions (`positions`, default each id's index in
    `blocks`): (the run's first position, first id, length)."""
    positions = range(len(blocks)) if positions is None else positions
    runs, start = [], 0
    for j in range(1, len(blocks) + 1):
        if j == len(blocks) or blocks[j] != blocks[j - 1] + 1 or positions[j] != positions[j - 1] + 1:
            runs.append((positions[start], blocks[start], j - start))
            start = j
    return runs


def _matching(a, b, start, limit):
    """The end of the run of equal tokens of the lists a and b from index `start` on, at most `limit`."""
    i, n = start, min(len(a), len(b), limit)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """
    Keys/values of token prefixes, in blocks of BLOCK tokens keyed by the whole prefix up to the block's end (a
    chain: each key holds its parent's key, _Key), so a block is shared by every sequence that starts with the same
    tokens and a lookup walks from the first block. Least recently used blocks are evicted first; a lookup touches
    the deepest block first and the first block last, so a chain loses its tail before its head.
    Storage per layer: (2, num_blocks, heads, BLOCK, dim), allocated empty (a block is read only once written).
    """

    def __init__(self, pool, num_blocks):
        self.pool, self.num_blocks = pool, num_blocks
        shape = (2, num_blocks, pool.kv_heads, BLOCK, pool.head_dim)
        self.layers = [torch.empty(shape, dtype=pool.dtype, device=pool.device) for _ in range(pool.num_layers)]
        # the same memory as pairs of views made once (a save or load makes none per tensor): each pool tensor's
        # slots in blocks (rows, heads, blocks, BLOCK, dim), and the store it is saved to (num_blocks, heads, BLOCK,
        # dim), keys then values of each layer
        self._slot_blocks = [t.view(pool.rows, pool.kv_heads, pool.columns // BLOCK, BLOCK, pool.head_dim)
                             for t in pool.tensors()]
        self._stores = [store[i] for store in self.layers for i in range(2)]
        # key -> (block id, the key itself: a walk goes on from it), least recently used first
        self.index = OrderedDict()
        self.free = list(range(num_blocks - 1, -1, -1))
        # free slots that still hold a finished sequence's keys/values (park): a conversation's next turn usually
        # arrives before its slot is taken, and then resumes in it (resume): no copy, and to the token (the blocks
        # stop at the last whole one, up to BLOCK - 1 tokens short)
        self.parked = {}  # slot -> (the tokens whose keys/values its first columns hold, their deepest cached key)
        # counters for /stats: prompt tokens looked up, and how many of them came from the cache
        self.lookups = self.hits = self.lookup_tokens = self.hit_tokens = self.evictions = self.resumed = 0

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.layers)

    def _walk(self, tokens):
        """(key, block id) of each cached leading whole block of `tokens`, touching nothing: one dict read per block,
        so safe to call from another thread while the scheduler's thread works."""
        found, parent = [], None
        for b in range(len(tokens) // BLOCK):
            hit = self.index.get(_Key(parent, tuple(tokens[b * BLOCK:(b + 1) * BLOCK])))
            if hit is None:
                break
            block, parent = hit
            found.append((parent, block))
        return found

    def match(self, tokens):
        """Block ids of the longest cached prefix of `tokens` (whole blocks), touched as used."""
        found = self._walk(tokens)
        self._touch(found)
        return [block for _, block in found]

    def _touch(self, found):
        for key, _ in reversed(found):  # deepest first: the first block ends up most recently used
            self.index.move_to_end(key)

    def cached_tokens(self, tokens):
        """How many leading tokens of `tokens` are cached (whole blocks), without touching anything."""
        return len(self._walk(tokens)) * BLOCK

    def load(self, tokens, row, limit):
        """Copy the longest cached prefix of `tokens`, at most `limit` tokens, into slot `row`. Returns its length."""
        self.lookups += 1
        self.lookup_tokens += len(tokens)
        blocks = self.match(tokens[:limit + BLOCK - 1])
        n = min(len(blocks) * BLOCK, limit)
        if n == 0:
            return 0
        # whole blocks (the columns from n to the last block's end, n = limit, are the prompt's next ones, which the
        # prefill that follows writes anyway). A chain's blocks mostly have consecutive ids (a sequence's new blocks
        # are taken from the free list together): a run of them is copied into the slot as it is, one pass; many
        # runs (a cache fragmented by evictions) are gathered first, then copied, two passes but few calls
        runs = _runs(blocks)
        index = host_tensor(blocks, self.pool.device) if len(runs) > MAX_RUN_COPIES else None
        for store, slot in zip(self._stores, self._slot_blocks):
            if index is not None:
                slot[row, :, :len(blocks)].copy_(store.index_select(0, index).transpose(0, 1))
                continue
            for at, first, count in runs:
                slot[row, :, at:at + count].copy_(store[first:first + count].transpose(0, 1))
        self.hits += 1
        self.hit_tokens += n
        return n

    def park(self, row, tokens):
        """A sequence leaves slot `row`, its first len(tokens) columns holding `tokens`' keys/values: register their
        whole blocks (save) and park the slot until it is written again (unpark)."""
        self.parked[row] = (tokens, self.save(tokens, row))

    def unpark(self, row):
        """Slot `row` is about to be written: what it held is gone (its whole blocks stay cached)."""
        self.parked.pop(row, None)

    def resume(self, tokens, limit):
        """
        (slot, n): a parked slot that holds a prefix of `tokens` as long as the cached blocks' and longer by the
        tokens after its last whole block, n of them (at most `limit`, at least a block); the slot is unparked and
        its keys/values stay where they are (the caller takes it instead of a free slot and prefills from n). None:
        there is none (then `load`). Counted as a lookup and a hit, the blocks touched as used, as `load` does. A
        candidate is a slot whose last whole block is the prompt's deepest cached one (keys are canonical: one
        identity check a slot, however long the shared prefix, e.g. a system prompt many conversations share).
        """
        if not self.parked:
            return None
        found = self._walk(tokens[:limit + BLOCK - 1])
        if not found:
            return None
        deepest, m = found[-1][0], min(len(found) * BLOCK, limit)
        best, held = None, 0
        for slot, (parked, key) in self.parked.items():
            if key is deepest:  # parked[:m] == tokens[:m]: the same chain of blocks
                n = _matching(parked, tokens, m, limit)  # the tokens after the last whole block, in place
                if n > held:
                    best, held = slot, n
        if best is None or held < BLOCK:
            return None
        del self.parked[best]
        self._touch(found)
        self.lookups += 1
        self.lookup_tokens += len(tokens)
        self.hits += 1
        self.hit_tokens += held
        self.resumed += 1
        return best, held

    def save(self, tokens, row):
        """Register the whole blocks of `tokens`, whose keys/values are in slot `row`, evicting old blocks as needed.
        Returns the key of the deepest block of `tokens` cached now (None: none)."""
        n_blocks = len(tokens) // BLOCK
        new = []  # (block position in the sequence, block id)
        parent = None
        for b in range(n_blocks):
            key = _Key(parent, tuple(tokens[b * BLOCK:(b + 1) * BLOCK]))
            hit = self.index.get(key)
            if hit is not None:
                parent = hit[1]
                self.index.move_to_end(parent)
                continue
            if not self.free:
                if not self.index:
                    break
                _, (victim, _) = self.index.popitem(last=False)
                self.free.append(victim)
                self.evictions += 1
            block = self.free.pop()
            self.index[key] = (block, key)
            parent = key
            new.append((b, block))
        if not new:
            return parent
        # the new blocks are the sequence's last ones, and their ids mostly consecutive (taken from the free list
        # together): each run is one copy straight out of the slot; many runs (ids freed by evictions) one gather
        # and one scatter per tensor
        runs = _runs([block for _, block in new], [b for b, _ in new])
        if len(runs) > MAX_RUN_COPIES:
            src = host_tensor([b for b, _ in new], self.pool.device)
            dst = host_tensor([block for _, block in new], self.pool.device)
            for store, slot in zip(self._stores, self._slot_blocks):
                store.index_copy_(0, dst, slot[row].index_select(1, src).transpose(0, 1))
            return parent
        for store, slot in zip(self._stores, self._slot_blocks):
            for at, first, count in runs:
                store[first:first + count].copy_(slot[row, :, at:at + count].transpose(0, 1))
        return parent

    def stats(self):
        return {
            "blocks": self.num_blocks,
            "blocks_used": len(self.index),
            "block_tokens": BLOCK,
            "lookups": self.lookups,
            "hits": self.hits,
            "prompt_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            "evictions": self.evictions,
            "resumed": self.resumed,
        }
