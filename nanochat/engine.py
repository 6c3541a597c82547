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
"""

from collections import deque

import torch
import torch.nn.functional as F

# The calculator lives in nanochat/calculator.py; its names stay importable from here.
from nanochat.calculator import CALC_TIME_LIMIT_S, CalculatorError, safe_eval, use_calculator  # noqa: F401

# -----------------------------------------------------------------------------
# KV cache


class KVCache:
    """
    Keys and values of every layer for a batch of sequences that all have the same length.

    Storage is one tensor of shape (num_layers, 2, batch_size, num_heads, capacity, head_dim), allocated on the first
    insert (so it takes the dtype and device of the keys the model actually produces, e.g. bf16 under autocast) and
    grown when a sequence outgrows it. `pos` counts the tokens already cached; the model reads it for the rotary
    offset, and it advances after the last layer's insert of a forward pass.
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

    @property
    def kv_shape(self):
        return (self.num_layers, 2, self.batch_size, self.num_heads, self.seq_len, self.head_dim)

    def reset(self):
        """Forget the cached tokens (the storage is kept for reuse)."""
        self.pos = 0

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


class Engine:
    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        special = tokenizer.encode_special
        self.bos = tokenizer.get_bos_token_id()
        self.assistant_end = special("<|assistant_end|>")
        self.python_start = special("<|python_start|>")
        self.python_end = special("<|python_end|>")
        self.output_start = special("<|output_start|>")
        self.output_end = special("<|output_end|>")

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

    @torch.inference_mode()
    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42, top_p=None):
        """
        Stream generation for `num_samples` independent continuations of the prompt `tokens` (list of int ids).
        Yields (token_column, token_masks): one token per row and 1 if it was sampled, 0 if forced by the tool.
        Stops after max_tokens steps (None: until every row has stopped or the model runs out of positions) or when
        every row has produced <|assistant_end|> or <|bos|> (a finished row keeps yielding filler tokens until then;
        generate_batch drops them). The same seed gives the same samples.
        """
        if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, int) for t in tokens):
            raise ValueError("tokens must be a non-empty list of int token ids")
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
            raise ValueError(f"max_tokens must be None or an int >= 0, got {max_tokens!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
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

        # 2) Copy it into num_samples rows; each row then samples on its own (its first token included).
        # Room for the whole reply when it is bounded by something reasonable; a longer one grows the cache as it
        # goes, so max_tokens=None on a model with a 10x-sequence_len rotary table does not reserve gigabytes.
        cache = self._new_cache(num_samples, len(tokens) + min(steps, self.model.config.sequence_len))
        cache.prefill(prefill_cache)
        del prefill_cache
        logits = logits.expand(num_samples, -1)
        rows = [RowState() for _ in range(num_samples)]

        for step in range(steps):
            sampled = sample_next_token(logits, rng, temperature, top_k, top_p)[:, 0].tolist()
            token_column, token_masks = [], []
            for i, row in enumerate(rows):
                forced = len(row.forced_tokens) > 0
                token = row.forced_tokens.popleft() if forced else sampled[i]
                token_column.append(token)
                token_masks.append(0 if forced else 1)
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
            yield token_column, token_masks
            if step == steps - 1 or all(row.completed for row in rows):
                return
            ids = torch.tensor(token_column, dtype=torch.long, device=device).unsqueeze(1)
            logits = self.model(ids, kv_cache=cache)[:, -1, :]

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
