"""
Fast inference: a KV cache, batched sampling and the calculator tool.

    engine = Engine(model, tokenizer)
    for token_column, token_masks in engine.generate(prompt_ids, num_samples=4, max_tokens=64, temperature=0.8):
        ...  # one token per row per step; mask 1 = sampled by the model, 0 = forced (tool output)
    sequences, masks = engine.generate_batch(prompt_ids, num_samples=4, max_tokens=64)

The prompt is prefilled once with batch size 1, then the cache is copied into num_samples rows that each sample
independently from there on. A row stops at <|assistant_end|> or <|bos|>. When a row writes
<|python_start|> expr <|python_end|>, `expr` goes to a small safe calculator (nanochat/calculator.py) and its result is
forced into that row as <|output_start|> result <|output_end|>.

Decode speed (docs/gpu.md#decode): the reply's cache is allocated once at prefill, sized for prompt + max_tokens (a
reply longer than sequence_len without max_tokens grows it), so nothing is reallocated while decoding. Where the
step is compiled (`decode_compile`: auto = on CUDA, where it is captured as a CUDA graph, torch.compile
mode="reduce-overhead"; eager on CPU, where bench/infer_bench.py measured it no faster) it runs on fixed shapes: the
cache at full size with a mask of the filled positions, and the position as a device tensor, so one compiled graph
serves every step. On CUDA the host reads each step's tokens one step behind: the next step is queued before the
host waits for the tokens it needs for stop and tool checks, so the GPU never waits for Python.
"""

import threading
from collections import defaultdict, deque

import torch
import torch.nn.functional as F

from nanochat.calculator import use_calculator
from nanochat.usage import BadValue

# -----------------------------------------------------------------------------
# KV cache


class KVCache:
    """
    Keys and values of every layer for a batch of sequences that all have the same length.

    Storage is one tensor of shape (num_layers, 2, batch_size, num_heads, capacity, head_dim), allocated on the first
    insert (so it takes the dtype and device of the keys the model actually produces, e.g. bf16 under autocast) and
    grown when a sequence outgrows it. `pos` counts the tokens already cached; the model reads it for the rotary
    offset, and it advances after the last layer's insert of a forward pass. The record model (nanochat/gpt.py
    RecordGPT) also keeps its previous token's embedding here (exchange_prev_embedding: smear), and its windowed
    layers attend only the last window + 1 positions (attention's window; attn_mask_for in the fixed-shape step).
    """

    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers):
        if min(batch_size, num_heads, head_dim, num_layers) < 1 or seq_len < 0:
            raise ValueError(
                f"KVCache needs positive sizes, got batch_size={batch_size} num_heads={num_heads} "
                f"seq_len={seq_len} head_dim={head_dim} num_layers={num_layers}"
            )
        self.batch_size = batch_size
        self.num_heads = num_heads
        self.seq_len = max(1, seq_len)  # current capacity in tokens
        self.head_dim = head_dim
        self.num_layers = num_layers
        self.kv_cache = None
        self.pos = 0
        self.fixed = False  # fixed-shape decode (start_fixed_shape): positions and mask come from device tensors
        self.pos_t = None
        self.prev_embedding = None  # (B, 1, C): the last token's embedding, for a model that smears (RecordGPT)

    def fixed_shape_storage(self):
        """New storage for start_fixed_shape: one (2, B, H, S, D) tensor per layer, the position, the slot indices,
        and a buffer for the previous token's embedding (None when the model keeps none)."""
        device, dtype = self.kv_cache.device, self.kv_cache.dtype
        # zeros, not empty: the slots not filled yet are masked, but a masked NaN still poisons the output (0 * NaN)
        layers = [torch.zeros(self.kv_shape[1:], dtype=dtype, device=device) for _ in range(self.num_layers)]
        prev = None if self.prev_embedding is None else torch.zeros_like(self.prev_embedding)
        return layers, torch.zeros(1, dtype=torch.long, device=device), torch.arange(self.seq_len, device=device), prev

    def start_fixed_shape(self, storage=None):
        """
        From here on insert_kv writes one token at the device position `pos_t` and returns the whole cache, and the
        model reads `positions` (rotary) and `attn_mask` (the filled slots): nothing depends on a Python int, so a
        compiled or graphed step is the same graph at every position. Call advance() after each step.
        The cached tokens move into `storage` (fixed_shape_storage(), or one kept from an earlier reply of the same
        shape, so a CUDA graph finds its inputs at the same addresses and is replayed, not re-recorded).
        One tensor per layer instead of views of one: a compiled step writes a graph input in place, but a write
        through a view of one made inductor copy the whole cache back every step (5x slower decode on CPU).
        """
        if self.kv_cache is None:
            raise ValueError("start_fixed_shape() needs an allocated cache (prefill it first)")
        self.layers, self.pos_t, self.slots, prev = storage or self.fixed_shape_storage()
        for i, layer in enumerate(self.layers):  # the filled slots only (the rest of kv_cache is uninitialised)
            layer[..., : self.pos, :].copy_(self.kv_cache[i, ..., : self.pos, :])
        self.pos_t.fill_(self.pos)
        if self.prev_embedding is not None:  # from here on updated in place (exchange_prev_embedding)
            self.prev_embedding = prev.copy_(self.prev_embedding)
        self.kv_cache = None
        self.fixed = True

    def end_fixed_shape(self):
        """Back to one growable tensor (a reply that outgrows the fixed cache goes on eagerly)."""
        self.kv_cache = torch.stack(self.layers)
        self.layers, self.fixed = None, False
        if self.prev_embedding is not None:
            self.prev_embedding = self.prev_embedding.clone()  # the fixed storage may serve the next reply

    @property
    def positions(self):
        return self.pos_t if self.fixed else None

    @property
    def attn_mask(self):
        return self.attn_mask_for(None)

    def attn_mask_for(self, window=None):
        """The fixed-shape step's attention mask (1, 1, 1, S): the filled slots, and with a sliding window only the
        last window + 1 of them (None outside the fixed-shape step)."""
        if not self.fixed:
            return None
        mask = self.slots <= self.pos_t
        if window is not None:
            mask = mask & (self.slots >= self.pos_t - window)
        return mask.view(1, 1, 1, -1)

    def exchange_prev_embedding(self, x_last):
        """The previous forward's last token embedding (B, 1, C), or None at the start; x_last is kept for the next
        forward (a model that smears calls this once per forward). In the fixed-shape step the buffer is updated in
        place, so a compiled or graphed step reads and writes the same tensor every time."""
        prev = self.prev_embedding
        if self.fixed:
            prev = prev.clone()
            self.prev_embedding.copy_(x_last)
        else:
            self.prev_embedding = x_last
        return prev

    def advance(self, n=1):
        """After a fixed-shape step: the host count and the device position move on (no host-device sync)."""
        self.pos += n
        self.pos_t += n

    @property
    def kv_shape(self):
        return (self.num_layers, 2, self.batch_size, self.num_heads, self.seq_len, self.head_dim)

    def reset(self):
        """Forget the cached tokens (the storage is kept for reuse)."""
        self.pos = 0
        self.prev_embedding = None

    def get_pos(self):
        return self.pos

    def _allocate(self, dtype, device):
        self.kv_cache = torch.empty(self.kv_shape, dtype=dtype, device=device)

    def _grow(self, needed):
        # Double (at least), rounded up to a multiple of 256, so a long generation reallocates O(log n) times.
        new_len = max(needed, 2 * self.seq_len)
        new_len = (new_len + 255) // 256 * 256
        old = self.kv_cache
        self.seq_len = new_len
        self._allocate(old.dtype, old.device)
        self.kv_cache[:, :, :, :, : self.pos] = old[:, :, :, :, : self.pos]

    def insert_kv(self, layer_idx, k, v):
        """Append k, v of shape (B, H, T_new, D) to layer `layer_idx`; return all keys/values so far (B, H, pos+T_new, D)."""
        B, H, T_add, D = k.shape
        if (B, H, D) != (self.batch_size, self.num_heads, self.head_dim) or v.shape != k.shape:
            raise ValueError(
                f"KVCache holds (batch={self.batch_size}, heads={self.num_heads}, head_dim={self.head_dim}) but got "
                f"k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx {layer_idx} out of range for a cache of {self.num_layers} layers")
        if self.fixed:  # one token at the device position; attention masks the slots not filled yet
            if T_add != 1:
                raise ValueError(f"a fixed-shape cache takes one token per step, got {T_add}")
            kv = self.layers[layer_idx]  # (2, B, H, S, D): written in place by one index_put on the tensor itself
            kv[:, :, :, self.pos_t] = torch.stack((k, v))
            return kv[0], kv[1]
        if self.kv_cache is None:
            self._allocate(k.dtype, k.device)
        t0, t1 = self.pos, self.pos + T_add
        if t1 > self.seq_len:
            self._grow(t1)
        self.kv_cache[layer_idx, 0, :, :, t0:t1] = k
        self.kv_cache[layer_idx, 1, :, :, t0:t1] = v
        key_view = self.kv_cache[layer_idx, 0, :, :, :t1]
        value_view = self.kv_cache[layer_idx, 1, :, :, :t1]
        if layer_idx == self.num_layers - 1:
            self.pos = t1
        return key_view, value_view

    def prefill(self, other):
        """Copy another (usually batch-1 prefill) cache into this empty one, broadcasting its rows to our batch."""
        if self.pos != 0:
            raise ValueError("prefill() needs an empty cache (call reset() first)")
        if other.kv_cache is None or other.pos == 0:
            raise ValueError("prefill() source cache holds no tokens")
        if (other.num_layers, other.num_heads, other.head_dim) != (self.num_layers, self.num_heads, self.head_dim):
            raise ValueError(
                f"cache shapes differ: source (layers={other.num_layers}, heads={other.num_heads}, "
                f"head_dim={other.head_dim}) vs (layers={self.num_layers}, heads={self.num_heads}, head_dim={self.head_dim})"
            )
        if other.batch_size not in (1, self.batch_size):
            raise ValueError(f"cannot copy a batch of {other.batch_size} into a batch of {self.batch_size}")
        if self.kv_cache is None or self.kv_cache.dtype != other.kv_cache.dtype or self.kv_cache.device != other.kv_cache.device:
            self.seq_len = max(self.seq_len, other.pos)
            self._allocate(other.kv_cache.dtype, other.kv_cache.device)
        elif self.seq_len < other.pos:
            self._grow(other.pos)
        self.kv_cache[:, :, :, :, : other.pos] = other.kv_cache[:, :, :, :, : other.pos]
        self.pos = other.pos
        if other.prev_embedding is not None:
            self.prev_embedding = other.prev_embedding.expand(self.batch_size, -1, -1).clone()


# -----------------------------------------------------------------------------
# Sampling


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (see sample_next_token)


def sample_next_token(logits, rng, temperature=1.0, top_k=None, top_p=None):
    """
    One token per row from logits (B, V) -> (B, 1) long. Rows are sampled independently (one multinomial draw each).
    temperature 0 is greedy; top_k keeps the k most likely tokens; top_p keeps the smallest set whose mass reaches p.
    A temperature below GREEDY_BELOW is greedy too: logits / 1e-40 overflow to inf and softmax(inf - inf) is NaN, and
    long before that the distribution is already one-hot in float32.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature < GREEDY_BELOW:
        return torch.argmax(logits, dim=-1, keepdim=True)
    # Sample among the candidates only: top_k's k logits (topk returns them sorted), or all of them sorted for top_p.
    # Softmax and the draw then run over k values instead of the whole vocab, with nothing masked in place.
    idx = None
    if top_k is not None and 0 < top_k < logits.size(-1):
        logits, idx = torch.topk(logits, top_k, dim=-1)
    elif top_p is not None and top_p < 1.0:
        logits, idx = torch.sort(logits, dim=-1, descending=True)
    logits = logits.float() / temperature  # a new tensor: the caller's logits are never modified
    if top_p is not None and top_p < 1.0:
        probs = logits.softmax(dim=-1)
        # drop a token when the (more likely) tokens before it already reach top_p: the most likely one always stays
        logits = logits.masked_fill((probs.cumsum(dim=-1) - probs) >= top_p, float("-inf"))
    choice = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=rng)
    return choice if idx is None else idx.gather(-1, choice)


def host_tensor(values, device, dtype=None):
    """A tensor of host values on `device` without waiting for the GPU: torch.tensor(..., device=cuda) and .to(cuda)
    copy and then synchronize the stream, i.e. wait for every kernel queued before them, so a step that builds its
    small index tensors that way stalls behind the previous step (and an overlapped step behind itself). A copy from
    pageable memory with non_blocking returns once the driver has staged the bytes."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def sample_rows(logits, uniforms, temperature, top_k, top_p):
    """
    One token per row of logits (R, V) -> (R,) long, each row with its own temperature (> 0), top_k (None: all) and
    top_p (None or 1.0: all), drawn by inverse transform from uniforms (R,) in [0, 1): the candidates in a canonical
    order, the first whose cumulative probability passes u. A row's token is a function of its logits, settings and
    u alone (never of the other rows, nor of how a kernel orders equal logits), so the rows of many requests, each
    with its own u (the scheduler's row_uniform), are sampled in one batch and one host sync, and a seeded request gets the same
    tokens whatever its neighbours (the continuous-batching scheduler; sample_next_token draws one request's rows
    with torch.multinomial). The filters are sample_next_token's: top_k keeps the k most likely tokens (equal logits
    at the k-th place: the lowest token ids), top_p the most likely ones until their mass reaches p. The rows fall in
    up to three groups, each one batch: top_k (work on its candidates only), top_p alone (the vocabulary sorted), and
    neither (the vocabulary in its own order).
    """
    R, V = logits.shape
    device = logits.device
    ks = [k if k is not None and 0 < k < V else V for k in top_k]
    ps = [1.0 if p is None else float(p) for p in top_p]
    groups = {}
    for i in range(R):
        groups.setdefault("top_k" if ks[i] < V else "top_p" if ps[i] < 1.0 else "all", []).append(i)
    out = torch.empty(R, dtype=torch.long, device=device)
    uniforms = uniforms.to(device, non_blocking=True)
    for kind, rows in groups.items():
        index = host_tensor(rows, device) if len(rows) < R else None
        x = logits if index is None else logits[index]
        u = uniforms if index is None else uniforms[index]
        ts, pp = [temperature[i] for i in rows], [ps[i] for i in rows]
        if kind == "top_k":
            values, ids = _top_k_candidates(x, [ks[i] for i in rows])
        elif kind == "top_p":  # a stable sort: equal logits stay in token id order
            values, ids = x.sort(dim=-1, descending=True, stable=True)
        else:
            values, ids = x, None
        token = _draw(values, ids, u, ts, pp)
        if index is None:
            return token
        out[index] = token
    return out


def _top_k_candidates(x, ks):
    """Each row's k most likely tokens (R, max k): values most likely first, equal values in token id order, the
    places past a row's own k at -inf. From one topk of max k + 1, whose k+1-th value says whether the k-th place
    is tied with tokens beyond it; those rows (rare in float32, frequent with bf16 logits) take the lowest ids among
    the tied from a pass over their whole row."""
    R, V = x.shape
    kmax = max(ks)
    n = min(kmax + 1, V)
    values, ids = torch.topk(x, n, dim=-1)
    k = host_tensor(ks, x.device).view(R, 1)
    kth = values.gather(-1, k - 1)
    tied = (values.gather(-1, k) == kth).view(R)  # k < V here, so n > k
    # the k members: every logit above the k-th, then the lowest ids equal to it; on the CPU only when a row needs
    # it, on a GPU always (reading `tied` on the host would wait for the step to finish)
    if x.device.type != "cpu" or bool(tied.any()):
        above = x > kth
        equal = x == kth
        member = above | (equal & (equal.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
        v2, i2 = torch.topk(x.masked_fill(~member, float("-inf")), n, dim=-1)
        values, ids = torch.where(tied.view(R, 1), v2, values), torch.where(tied.view(R, 1), i2, ids)
    place = torch.arange(n, device=x.device)
    values = values.masked_fill(place >= k, float("-inf"))[:, :kmax]
    ids = torch.where(place >= k, V + place, ids)[:, :kmax]  # past k: sorted last by id too
    by_id = ids.argsort(dim=-1)  # token id order, then a stable sort by value: ties in id order
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, order)


def _draw(values, ids, u, temperature, top_p):
    """Inverse transform over candidates (R, n) in their canonical order (ids None: the token ids are the places)."""
    R = values.size(0)
    x = values.float() / host_tensor(temperature, values.device, torch.float32).view(R, 1)
    probs = x.softmax(dim=-1)
    if min(top_p) < 1.0:  # most likely first here: drop a candidate once the ones before it reach p
        p = host_tensor(top_p, values.device, torch.float32).view(R, 1)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= p, 0.0)
    cdf = probs.cumsum(dim=-1)
    choice = (cdf <= u.to(values.device, torch.float32).view(R, 1) * cdf[:, -1:]).sum(dim=-1)
    # u * total rounding up to the total would step past the last candidate: take the most likely one instead
    choice = torch.where(choice < cdf.size(-1), choice, probs.argmax(dim=-1))
    return choice if ids is None else ids.gather(-1, choice.view(R, 1)).view(R)


# -----------------------------------------------------------------------------
# Streaming text


class TextStreamer:
    """
    Turns a stream of token ids into text pieces that are always whole characters. A byte-level BPE token can end in
    the middle of a multi-byte UTF-8 character (its decoding then ends in U+FFFD); such tokens are held back until the
    character is complete, so a streamed reply never shows a broken character that the full decode would not.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pending = []

    def push(self, token):
        """Add one token id; returns the text that is now complete ('' while a character is unfinished)."""
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []
        return text

    def push_many(self, tokens):
        """push() of several token ids: the same text, in one decode where they end on a whole character (at such a
        point the bytes before it decode on their own, so one decode equals push's pieces joined), else token by
        token."""
        text = self.tokenizer.decode(self.pending + list(tokens))
        if not text.endswith("\ufffd"):
            self.pending = []
            return text
        return "".join([self.push(t) for t in tokens])

    def flush(self):
        """Whatever is held back (at the end of the stream, an unfinished character decodes as U+FFFD)."""
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.pending = []
        return text


# -----------------------------------------------------------------------------
# Engine


class RowState:
    """Per-sample bookkeeping during generation: tool-use state and tokens waiting to be forced."""

    def __init__(self):
        self.forced_tokens = deque()
        self.in_python_block = False
        self.python_expr_tokens = []
        self.completed = False


DECODE_COMPILE_CHOICES = ("auto", "1", "0")


def resolve_decode_compile(value, model):
    """
    --decode_compile: True when the engine's decode step should be compiled for `model`. auto = on CUDA (captured as
    a CUDA graph), off elsewhere: on CPU bench/infer_bench.py measured the compiled step no faster than eager at d4
    (docs/benchmarks.md#decode-step-compiled-vs-eager-cpu), and its compile costs seconds per new shape. 1 = wherever
    the model supports it (a nanochat GPT), 0 = eager. Models that are not a GPT (test stand-ins) and sharded models
    (FSDP/TP, whose forward runs collectives in hooks) run eager.
    """
    value = str(value).strip().lower()
    if value not in DECODE_COMPILE_CHOICES:
        raise BadValue(f"--decode_compile must be auto, 1 or 0, got {value!r}")
    from nanochat.gpt import GPT

    if value == "0" or not isinstance(model, GPT):
        return False
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):  # FSDP/TP: the forward runs collectives in hooks
        if value == "1":
            raise BadValue("--decode_compile=1 needs an unsharded model, but this one is sharded (FSDP/TP); use --decode_compile=0")
        return False
    return value == "1" or model.get_device().type == "cuda"


def decode_compile_flag():
    """--decode_compile, as every script that samples through the Engine declares it."""
    from nanochat.configurator import Flag

    return Flag("decode_compile", "auto", "compiled decode step on a static KV cache: auto = on CUDA (a CUDA graph), "
                "eager on CPU (measured no faster there); 1 = also on CPU; 0 = eager", choices=list(DECODE_COMPILE_CHOICES))


def prepare_thread_for_cuda_graphs():
    """
    Call on a thread before it runs a compiled CUDA step ("reduce-overhead": CUDA graph trees). torch 2.11 keeps the
    graph trees' per-thread state in a thread-local that only the thread importing them (and autograd's threads)
    gets: a compiled step run on any other thread fails an assert in cudagraph_trees.get_obj (seen on an H100 in
    chat_web --batching=0, whose replies ran one thread each). Later torch sets the state up on first use; this
    does the same, once per thread. The state is per thread, so a thread records its own CUDA graphs: keep the
    compiled steps of a replica on one long-lived thread (the scheduler's, a worker's generation thread).
    """
    from torch._inductor import cudagraph_trees as trees

    if hasattr(trees.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", trees.local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", trees.local.tree_manager_locks)


STATIC_CACHES_KEPT = 4  # fixed-shape caches (batch x capacity) an Engine keeps for later replies of the same shape


def cache_capacity(needed, limit):
    """Slots for a reply's cache: a power of two >= 256 (so a compiled step sees few shapes), at most `limit`."""
    return min(limit, max(256, 1 << (max(1, needed) - 1).bit_length()))


def check_generation_args(tokens, num_samples, max_tokens, temperature, top_p, name="tokens", min_max_tokens=0):
    """What Engine.generate and the serving scheduler's Request check first: a ValueError saying which is wrong."""
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, int) for t in tokens):
        raise ValueError(f"{name} must be a non-empty list of int token ids")
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < min_max_tokens):
        raise ValueError(f"max_tokens must be None or an int >= {min_max_tokens}, got {max_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class Engine:
    def __init__(self, model, tokenizer, decode_compile="auto"):
        self.model = model
        self.tokenizer = tokenizer
        special = tokenizer.encode_special
        self.bos = tokenizer.get_bos_token_id()
        self.assistant_end = special("<|assistant_end|>")
        self.python_start = special("<|python_start|>")
        self.python_end = special("<|python_end|>")
        self.output_start = special("<|output_start|>")
        self.output_end = special("<|output_end|>")
        self.decode_compiled = resolve_decode_compile(decode_compile, model)
        self._compiled_step = None
        self._storage = {}  # fixed-shape cache storage by shape, reused by later replies (see _decode_step)

    def _decode_step(self, cache):
        """fn(ids (B, 1)) -> logits (B, V) of one decode step on `cache`: compiled on fixed shapes, or the plain
        forward. Compiled, the cache's storage is marked static so a CUDA graph writes it in place, and kept for the
        next reply of the same shape (so an Engine generates one reply at a time, as its users do)."""
        if not self.decode_compiled:
            return lambda ids: self.model(ids, kv_cache=cache)[:, -1, :]
        key = (cache.kv_shape, cache.kv_cache.dtype, cache.kv_cache.device)
        storage = self._storage.pop(key, None)
        if storage is None:
            storage = cache.fixed_shape_storage()
            for t in (*storage[0], *storage[1:]):
                if t is not None:  # no smear buffer for a model that keeps none
                    torch._dynamo.mark_static_address(t)
        self._storage[key] = storage  # most recently used last; a few shapes are kept
        while len(self._storage) > STATIC_CACHES_KEPT:
            del self._storage[next(iter(self._storage))]
        cache.start_fixed_shape(storage)
        if self._compiled_step is None:
            cuda = self.model.get_device().type == "cuda"

            def step(model, ids, cache):
                return model(ids, kv_cache=cache)[:, -1, :]

            # one graph per (batch, cache size): cache_capacity rounds to powers of two, so a server or an eval sees a
            # few dozen at most; dynamo's default of 8 per function would quietly run the rest eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._compiled_step = torch.compile(step, mode="reduce-overhead" if cuda else None, dynamic=False)
        mark = torch.compiler.cudagraph_mark_step_begin if cache.pos_t.device.type == "cuda" else (lambda: None)
        if cache.pos_t.device.type == "cuda":
            prepare_thread_for_cuda_graphs()  # the thread that iterates generate() runs the steps

        checked = []

        def run(ids):
            mark()
            if checked:  # same model, cache and shapes as the first step of this reply: skip re-checking dynamo's
                # guards (~0.1-0.2 ms a step, a sizeable part of a graphed step); the first step checks them all
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    logits = self._compiled_step(self.model, ids, cache)
            else:
                logits = self._compiled_step(self.model, ids, cache)
                checked.append(True)
            cache.advance(1)
            return logits
        return run

    def max_positions(self):
        """How many positions the model can address (its rotary table), i.e. the longest prompt + reply."""
        n = getattr(self.model, "rotary_seq_len", None)
        return int(n) if n is not None else int(self.model.config.sequence_len)

    def _new_cache(self, batch_size, seq_len):
        cfg = self.model.config
        return KVCache(
            batch_size=batch_size,
            num_heads=cfg.n_kv_head,
            seq_len=seq_len,
            head_dim=cfg.n_embd // cfg.n_head,
            num_layers=cfg.n_layer,
        )

    def _run_tool(self, state):
        """Called at <|python_end|>: queue the calculator's answer (if any) to be forced into this row."""
        expr = self.tokenizer.decode(state.python_expr_tokens)
        result = use_calculator(expr)
        if result is not None:
            state.forced_tokens.append(self.output_start)
            state.forced_tokens.extend(self.tokenizer.encode(str(result)))
            state.forced_tokens.append(self.output_end)
        state.python_expr_tokens = []

    def observe(self, row, token):
        """A row's bookkeeping once `token` is its next token: completion at a stop token, and the calculator (at
        <|python_end|> its answer is queued to be forced). Shared with the serving scheduler's rows."""
        if token == self.assistant_end or token == self.bos:
            row.completed = True
        if token == self.python_start:
            row.in_python_block = True
            row.python_expr_tokens = []
        elif token == self.python_end and row.in_python_block:
            row.in_python_block = False
            self._run_tool(row)
        elif row.in_python_block:
            row.python_expr_tokens.append(token)

    @torch.inference_mode()
    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42, top_p=None):
        """
        Stream generation for `num_samples` independent continuations of the prompt `tokens` (list of int ids).
        Yields (token_column, token_masks): one token per row and 1 if it was sampled, 0 if forced by the tool.
        Stops after max_tokens steps (None: until every row has stopped or the model runs out of positions) or when
        every row has produced <|assistant_end|> or <|bos|> (a finished row keeps yielding filler tokens until then;
        generate_batch drops them). The same seed gives the same samples.
        """
        check_generation_args(tokens, num_samples, max_tokens, temperature, top_p)
        room = self.max_positions() - len(tokens)
        if room < 1:
            raise ValueError(f"prompt of {len(tokens)} tokens leaves no room to generate (the model addresses {self.max_positions()} positions)")
        steps = room if max_tokens is None else min(max_tokens, room)
        if steps == 0:
            return

        device = self.model.get_device()
        rng = torch.Generator(device=device)
        rng.manual_seed(seed)

        # 1) Prefill the prompt once, batch 1.
        prefill_cache = self._new_cache(1, len(tokens))
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
        logits = self.model(ids, kv_cache=prefill_cache)[:, -1, :]  # (1, V)

        # 2) Copy it into num_samples rows; each row then samples on its own (its first token included). The cache
        # is allocated here, once, for the whole reply when it is bounded by something reasonable; a longer one
        # (max_tokens=None on a model with a 10x-sequence_len rotary table) grows it as it goes instead of reserving
        # gigabytes up front.
        needed = len(tokens) + min(steps, self.model.config.sequence_len)
        cache = self._new_cache(num_samples, cache_capacity(needed, self.max_positions()))
        cache.prefill(prefill_cache)
        del prefill_cache
        logits = logits.expand(num_samples, -1)
        rows = [RowState() for _ in range(num_samples)]
        decode = self._decode_step(cache)
        # On CUDA the host reads step s's tokens while step s+1 runs (queued first); on CPU nothing runs ahead of
        # the host, so the tokens are read first and a streamed token shows up one step sooner.
        ahead = device.type == "cuda"

        tokens_dev = sample_next_token(logits, rng, temperature, top_k, top_p)  # (B, 1) on the device
        for step in range(steps):
            forced = [(i, row.forced_tokens.popleft()) for i, row in enumerate(rows) if row.forced_tokens]
            if forced:  # tool output replaces what was sampled for those rows (and is what the model is fed)
                index, values = zip(*forced)
                tokens_dev[list(index), 0] = torch.tensor(values, dtype=torch.long, device=device)
            last = step == steps - 1 or (cache.fixed and cache.pos + 1 > cache.seq_len)
            if ahead:
                host = tokens_dev.to("cpu", non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
                if not last:
                    next_dev = sample_next_token(decode(tokens_dev), rng, temperature, top_k, top_p)
                ready.synchronize()  # waits for this step's tokens only, not for the step just queued
                token_column = host[:, 0].tolist()
            else:
                token_column = tokens_dev[:, 0].tolist()
            token_masks = [1] * num_samples
            for i, _ in forced:
                token_masks[i] = 0
            for token, row in zip(token_column, rows):
                self.observe(row, token)
            yield token_column, token_masks
            if step == steps - 1 or all(row.completed for row in rows):
                return
            if last:  # a fixed-shape cache is full (a reply past sequence_len without max_tokens): grow, go on eager
                cache.end_fixed_shape()
                decode = lambda ids: self.model(ids, kv_cache=cache)[:, -1, :]  # noqa: E731
                next_dev = sample_next_token(decode(tokens_dev), rng, temperature, top_k, top_p)
            elif not ahead:
                next_dev = sample_next_token(decode(tokens_dev), rng, temperature, top_k, top_p)
            tokens_dev = next_dev

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """
        Non-streaming generate: returns (sequences, masks), one list per sample. Sequences start with the prompt
        (mask 0) and exclude the stop token (<|assistant_end|> / <|bos|>).
        """
        sequences = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        completed = [False] * num_samples
        for token_column, token_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(token_column, token_masks)):
                if completed[i]:
                    continue
                if token == self.assistant_end or token == self.bos:
                    completed[i] = True
                else:
                    sequences[i].append(token)
                    masks[i].append(mask)
            if all(completed):
                break
        return sequences, masks
