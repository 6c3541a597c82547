"""
Continuous batching: one model decodes a batch of sequences from many requests at once, and requests join and leave
that batch between steps.

    scheduler = Scheduler(engine, max_batch=64)
    request = scheduler.submit(prompt_ids, max_tokens=64, temperature=0.0, on_event=callback)
    while scheduler.step(): pass              # or scheduler.start(): a thread steps while there is work
    request.sequences(), request.finish_reasons

    outputs = generate_many(engine, [Job(prompt, num_samples=4, seed=1), ...], max_batch=32)   # evals and RL

Every step, in order:
1. Requests that were cancelled (the client left) leave, and their slots are free for this very step.
2. Waiting requests are admitted, first come first served, while the batch has room: at most `max_batch` sequences
   (a request sampling n completions counts n) and only as many as the KV slots allow (nanochat/serving/kv_slots.py:
   the budget comes from the device's free memory, or --kv_cache_gb). The rest wait; the server refuses requests
   beyond its queue with 429 before they get here. An admitted prompt first looks in the prefix cache: the longest
   cached prefix (a shared system prompt, the same conversation's earlier turn) is copied into its slot.
3. Prompts are prefilled in chunks of at most `prefill_chunk` tokens, up to `prefill_budget` tokens a step (at
   least one chunk), so a long prompt or a crowd of new ones delays the sequences already streaming by a bounded
   amount, while new requests get their first token soon. The chunks of several requests are packed into one
   forward (one chunk each: every matmul runs once over all their tokens, each chunk attends its own slot), unless
   batch invariance forbids it (below): then each chunk is a forward of its own. A prompt's last chunk gives its
   first token(s); a request sampling n completions copies its prompt's keys/values into its other n - 1 slots.
4. One decode step for every sequence that is generating, whatever request it belongs to. Each request keeps its own
   temperature, top_k, top_p, seed (a sampled token's uniform is a hash of the seed, the row and the position,
   row_uniform: its samples never depend on its neighbours, while every row of the step is sampled in one batch,
   engine.sample_rows), max_tokens, stop tokens and calculator state (the Engine's RowState). On CUDA the steps
   overlap (`overlap`): step N+1 is launched, fed step N's tokens on the device, before the host reads step N's,
   so the GPU does not wait while the host streams tokens and checks stops; a row that ended at N, or whose token
   the calculator replaced, has its N+1 discarded. The tokens are the same either way. A sequence that stops
   leaves at once; its keys/values go to the prefix cache and its slot is free for the next step.

Same answers alone or in a crowd: a request's tokens do not depend on which requests share its steps. With batch
invariance (on CPU, the default) the decode step runs only at batch sizes at which every matmul computes a row the
same bits (invariance.decode_sizes, measured before the first step: a BLAS picks its kernel by the sizes; under
MKL's strict mode, which chat_web sets, every size qualifies; under MKL's default on the CPU of docs/benchmarks.md
rows come out one way below 16 rows and another from 16 on, so a step there computes at least 16 rows), attention
runs under a per-row mask, on CPU through kv_slots.blockwise_attention (torch's CPU flash kernel splits the keys
differently by batch size and span), and only for the rows up to the last live one. A prompt's prefill runs in
chunks fixed by its own prompt and prefix hit, packed with other prompts' chunks only where that changes none of its
bits (invariance.packs_invariantly: the BLAS's rows at every size, and the model's say-so).
tests/unit/test_scheduler.py checks it token for token and logit for logit, for 32+ prompts arriving at different
steps. The rows of a request sampling n completions attend their common prompt once a step (eager on CPU:
kv_slots.shared_prompt_attention), which reads the prompt's keys once instead of n times; their arithmetic then
depends on their own request's rows, still never on the neighbours nor on the slots they got. Without batch
invariance (the default on CUDA) an eager step runs at exactly its rows, and prompts are always packed. A prefix-cache
hit is the one thing that changes a request's arithmetic: its cached keys/values were computed in another chunking (or
by decode steps), equal to recomputing them up to float rounding; --prefix_cache=0 turns it off where bit-for-bit
reproducibility matters more than the time to first token.

Decode is compiled where the Engine would compile (`decode_compile`, auto = on CUDA, captured as a CUDA graph), one
step per bucket of kv_slots.decode_buckets (fixed shapes), and eager elsewhere. The model is called through the same
forward API as the Engine's (`model(ids, kv_cache=view)`, the views of nanochat/serving/kv_slots.py). The record
model (RecordGPT) batches too: the views give its sliding-window layers per-window masks (`attend(..., window)`) and
its smear each row's previous token id (`prev_ids`), so a row carries no model state beyond its keys/values.
"""

import itertools
import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from nanochat.engine import (GREEDY_BELOW, RowState, check_generation_args, host_tensor, prepare_thread_for_cuda_graphs,
                             sample_rows)
from nanochat.serving.invariance import decode_sizes, packs_invariantly
from nanochat.serving.kv_slots import (ATTN_BLOCK, BLOCK, DecodeView, PrefixCache, SlotPool, decode_buckets,
                                       kv_bytes_per_token, plan_kv)

logger = logging.getLogger("nanochat.serving")

DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per prefill forward: a d4 on CPU takes ~50 ms for 512
DEFAULT_PREFILL_BUDGET = 2048  # prompt tokens prefilled per step, at most (time to first token vs a decode stall)


def kv_dtype(model):
    """The dtype the model's keys come out in here and now: autocast's when it is on (as GPT.forward computes in
    it), else the weights'."""
    device = model.get_device()
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    params = list(model.parameters())
    return params[0].dtype if params else torch.float32


class Request:
    """
    One prompt and how to sample it: `num_samples` sequences ("rows") from the same prompt. Its tokens come back
    through `on_event(kind, payload)`, called on the scheduler's thread: ("tokens", [(row, token, mask), ...]) once a
    step (mask 0: forced by the calculator), then ("done", None) or ("error", message). `tokens`/`masks` keep every
    row's tokens; a row's stop token is reported and kept in `tokens` but not in sequences().
    """

    _ids = itertools.count()

    def __init__(self, prompt, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, top_p=None, seed=42,
                 stop_tokens=None, on_event=None):
        check_generation_args(prompt, num_samples, max_tokens, temperature, top_p, name="prompt", min_max_tokens=1)
        self.id = next(Request._ids)
        self.prompt = list(prompt)
        self.num_samples, self.max_tokens = num_samples, max_tokens
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k or None, top_p, seed
        self.stop_tokens = None if stop_tokens is None else frozenset(stop_tokens)
        self.on_event = on_event
        self.cancelled = False
        self.rows = []  # Row objects once admitted
        self.tokens = [[] for _ in range(num_samples)]
        self.masks = [[] for _ in range(num_samples)]
        self.finish_reasons = [None] * num_samples
        self.prefilled = 0  # prompt tokens whose keys/values are in the first row's slot
        self.prefix_hit = 0  # of which came from the prefix cache
        self.state = "waiting"  # -> prefill -> decode -> done
        self.error = None
        self.submitted = time.perf_counter()
        self.first_token_at = None
        self.finished = threading.Event()

    def cancel(self):
        """Stop generating (any thread): the rows leave at the start of the scheduler's next step."""
        self.cancelled = True

    def sequences(self):
        """Like Engine.generate_batch: per row, prompt + generated tokens without the stop token, and masks."""
        seqs, masks = [], []
        for toks, ms, reason in zip(self.tokens, self.masks, self.finish_reasons):
            keep = len(toks) - 1 if reason == "stop" else len(toks)
            seqs.append(self.prompt + toks[:keep])
            masks.append([0] * len(self.prompt) + ms[:keep])
        return seqs, masks


class Row:
    """One sequence of a request in the batch: its slot, how many positions it has cached, the token to feed next."""

    def __init__(self, request, index, slot):
        self.request, self.index, self.slot = request, index, slot
        self.length = 0
        self.next_token = None
        self.generated = 0
        self.drawn = 0  # tokens sampled for it so far, including a step in flight (overlap): the next one's number
        self.limit = 0  # most tokens this row may generate (max_tokens, and the room left in its slot)
        self.state = RowState()


class Launch:
    """A decode step on its way: its rows (in order), their tokens (R,) and the tokens fed (R,) on the device, what
    the host fed each row (None: the previous step's token, from the device), and which rows still count."""

    def __init__(self, rows, tokens, inputs, fed):
        self.rows, self.tokens, self.inputs, self.fed = rows, tokens, inputs, fed
        self.valid = [True] * len(rows)


MASK64 = (1 << 64) - 1


def row_uniform(seed, row, k):
    """The uniform in [0, 1) that samples token k of row `row` of a request seeded `seed`: splitmix64's mix of the
    three. A row's samples depend on its seed, index and positions only: not on its neighbours, nor on its sibling
    rows' lengths, nor on whether a step of it was launched ahead and discarded (overlap)."""
    x = (seed * 0x9E3779B97F4A7C15 + (row + 1) * 0xBF58476D1CE4E5B9 + (k + 1) * 0x94D049BB133111EB) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((x ^ (x >> 31)) >> 11) * 2.0 ** -53


@dataclass
class Job:
    """One prompt for generate_many (the arguments of Request)."""

    prompt: list
    num_samples: int = 1
    max_tokens: int = None
    temperature: float = 1.0
    top_k: int = None
    top_p: float = None
    seed: int = 42


class Scheduler:
    """
    Continuous batching over one Engine's model (one scheduler per device replica). See the module docstring.
    max_batch: most sequences decoded together. max_context: positions per slot, i.e. the longest prompt + reply
    (default the model's sequence_len, at most what its rotary table addresses). kv_budget_bytes: memory for slots
    and the prefix cache (default a share of the device's free memory, DEFAULT_BUDGET_FRACTION). batch_invariant: a
    request's logits the same bits whatever its neighbours (default on CPU; see the module docstring). overlap: launch
    each decode step before reading the previous one's tokens (default on CUDA; the same tokens). autocast: a
    callable returning the context every forward runs in (the server's bf16 autocast on CUDA). log_requests: a log
    line per finished request (the server's). threads: torch CPU threads of the thread that steps (start), set on it
    when it starts (None: as they are; chat_web keeps its main thread at one, nanochat/serving/workers.py).
    """

    def __init__(self, engine, max_batch=64, max_context=None, kv_budget_bytes=None, prefix_cache=True,
                 prefill_chunk=DEFAULT_PREFILL_CHUNK, prefill_budget=DEFAULT_PREFILL_BUDGET, autocast=None, dtype=None,
                 batch_invariant=None, overlap=None, name="0", log_requests=False, threads=None):
        model = engine.model
        self.engine, self.model, self.name, self.log_requests, self.threads = engine, model, name, log_requests, threads
        self.device = model.get_device()
        self.autocast = autocast or nullcontext
        if prefill_chunk < 1 or prefill_budget < 1:
            raise ValueError(f"prefill_chunk and prefill_budget must be >= 1, got {prefill_chunk}, {prefill_budget}")
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
        dtype = dtype or kv_dtype(model)
        plan = plan_kv(model.config, engine.max_positions(), max_batch, max_context, dtype, self.device,
                       kv_budget_bytes, prefix_cache)
        self.plan, self.max_context, self.max_batch, self.buckets = plan, plan.max_context, plan.max_batch, plan.buckets
        self.pool = SlotPool(plan.layers, plan.kv_heads, plan.head_dim, plan.rows, plan.max_context, dtype, self.device)
        self.prefix = PrefixCache(self.pool, plan.prefix_blocks) if plan.prefix_blocks else None
        rows = plan.rows
        if batch_invariant is None:
            batch_invariant = self.device.type == "cpu"
        self.compiled = engine.decode_compiled
        self.batch_invariant = batch_invariant
        self.windows = getattr(model, "windows", ())  # RecordGPT's sliding windows, one per layer
        # the decode views, by batch size: a compiled step's buckets now (their addresses are marked static when it
        # compiles), an eager step's sizes as they are first used
        self.views = {b: DecodeView(self.pool, b, batch_invariant, trim=False, windows=self.windows)
                      for b in (self.buckets if self.compiled else [])}
        self._sizes = {}  # eager decode sizes by torch thread count (decode_sizes)
        self._packing = {}  # whether prompts share prefill forwards under batch invariance, by thread count
        self._step_threads = None  # the torch thread count the steps run at (their sizes are what stats reports)
        self._step_fn = None
        self._checked = set()
        # the requests; `inbox` is the only structure other threads touch (append / popleft are atomic)
        self.inbox = deque()
        self.waiting = deque()
        self.prefilling = []
        self.slots = [None] * rows  # Row per slot
        self.free_slots = list(range(rows - 1, -1, -1))  # a stack: the lowest slot is taken first
        self.requests = {}  # admitted, by id
        # counters for /stats
        self.steps = self.tokens_generated = self.requests_done = self.requests_served = self.errors = 0
        self.busy_s = self.decode_s = 0.0  # time in steps, and in their decode part
        self.decode_steps = self.decoded_rows = 0  # their ratio is the mean decode batch: how much batching happened
        self.prefill_forwards = self.prefill_chunks = self.prefill_tokens = 0  # chunks per forward: how much packing
        self._thread = None
        self._wake = threading.Condition()
        self._stop = False
        # a decode step launched and not yet read (overlap: on CUDA by default, where the host's work between steps
        # would otherwise leave the GPU idle; on CPU a step runs as it is called, so there is nothing to overlap)
        self.overlap = self.device.type == "cuda" if overlap is None else bool(overlap)
        self._pending = None
        self.warmed = threading.Event()  # set by the serving thread once warm_up is over (start)
        self.warm_s = 0.0

    # ------------------------------------------------------------------ submitting

    def submit(self, prompt, on_event=None, **sampling):
        """Queue a Request (arguments as Request's); any thread. Returns it."""
        request = Request(prompt, on_event=on_event, **sampling)
        self.submit_request(request)
        return request

    def submit_request(self, request):
        if request.num_samples > self.max_batch:
            raise ValueError(f"num_samples={request.num_samples} is more than this scheduler's {self.max_batch} rows")
        if len(request.prompt) >= self.max_context:
            raise ValueError(f"the prompt is {len(request.prompt)} tokens; this scheduler holds at most "
                             f"{self.max_context - 1} (--max_context={self.max_context})")
        self.inbox.append(request)
        with self._wake:
            self._wake.notify()
        return request

    def running_rows(self):
        return sum(1 for s in self.slots if s is not None)

    def pending(self):
        """Requests submitted and not finished (waiting, prefilling or decoding)."""
        return len(self.inbox) + len(self.waiting) + len(self.requests)

    def load(self):
        """Rows in use or asked for: how the server picks the least loaded replica."""
        queued = sum(r.num_samples for r in itertools.chain(list(self.inbox), list(self.waiting)))
        return self.running_rows() + queued

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def step(self):
        """Run one scheduling step (admit, prefill, decode). Returns True while work remains."""
        t0 = time.perf_counter()
        self._step_threads = torch.get_num_threads()
        while self.inbox:
            self.waiting.append(self.inbox.popleft())
        self._reap_cancelled()
        self._admit()
        with self.autocast():
            self._prefill()
            t1 = time.perf_counter()
            self._decode()
        t2 = time.perf_counter()
        self.steps += 1
        self.busy_s += t2 - t0
        self.decode_s += t2 - t1
        return bool(self.inbox or self.waiting or self.requests)

    def _reap_cancelled(self):
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self._finish(request, None)
        for request in [r for r in self.requests.values() if r.cancelled]:
            self._finish(request, None)

    def _admit(self):
        while self.waiting:
            request = self.waiting[0]
            n = request.num_samples
            if self.running_rows() + n > self.max_batch or len(self.free_slots) < n:
                return
            self.waiting.popleft()
            # keep >= 1 prompt token to prefill: its logits give the first token. A free slot that still holds this
            # prompt's start (the conversation's previous turn) is taken as it is, else the lowest free slot
            limit = len(request.prompt) - 1
            resumed = self.prefix.resume(request.prompt, limit) if self.prefix is not None else None
            if resumed is not None:
                self.free_slots.remove(resumed[0])
            slots = [resumed[0]] if resumed is not None else []
            slots += [self.free_slots.pop() for _ in range(n - len(slots))]
            request.rows = [Row(request, i, slot) for i, slot in enumerate(slots)]
            for row in request.rows:
                self.slots[row.slot] = row
                if self.prefix is not None:
                    self.prefix.unpark(row.slot)
            request.state = "prefill"
            self.requests[request.id] = request
            if resumed is not None:
                request.prefix_hit = resumed[1]
            elif self.prefix is not None:
                request.prefix_hit = self.prefix.load(request.prompt, request.rows[0].slot, limit)
            request.prefilled = request.prefix_hit
            self.prefilling.append(request)

    def _prefill(self):
        """Prompt chunks, in arrival order, up to prefill_budget tokens this step (the first chunk always): the chunks
        of several requests packed into one forward (kv_slots.PackedPrefillView), a request at most one chunk per
        forward, or one forward per chunk where packing could change a request's bits (_packs)."""
        budget, packs = self.prefill_budget, self._packs()
        while self.prefilling:
            pack, tokens = [], 0
            for request in self.prefilling:
                start = request.prefilled
                end = min(start + self.prefill_chunk, len(request.prompt))
                if (pack or budget < self.prefill_budget) and tokens + end - start > budget:
                    break  # (the step's first chunk runs whatever its size)
                pack.append((request, start, end))
                tokens += end - start
                if not packs:
                    break
            if not pack:
                return
            budget -= tokens
            try:
                logits = self._prefill_forward(pack)
            except Exception as e:  # the requests of this forward fail; the others go on
                logger.exception(f"prefill failed on scheduler {self.name}")
                for request, _, _ in pack:
                    self._finish(request, f"generation failed: {type(e).__name__}: {e}")
                continue
            self.prefill_forwards += 1
            self.prefill_chunks += len(pack)
            self.prefill_tokens += tokens
            for i, (request, start, end) in enumerate(pack):
                request.prefilled = end
                if end == len(request.prompt):  # its last chunk: its first token(s) now
                    self.prefilling.remove(request)
                    self._start_decoding(request, logits[i:i + 1])
                # else its next chunk comes next (this step if the budget allows)

    def _prefill_forward(self, pack):
        """One forward over the chunks of `pack` [(request, start, end)] -> the next-token logits after each chunk,
        (len(pack), vocab). A lone chunk runs as a batch-1 prefill of its slot (as it always did)."""
        chunks = [(r.rows[0].slot, start, end - start, r.prompt[start - 1] if start else None)
                  for r, start, end in pack]
        ids = host_tensor([[t for r, start, end in pack for t in r.prompt[start:end]]], self.device, torch.long)
        if len(pack) == 1:
            slot, start, _, prev = chunks[0]
            return self.model(ids, kv_cache=self.pool.prefill_view(slot, start, prev))[:, -1, :]
        return self.model(ids, kv_cache=self.pool.packed_prefill_view(chunks, self.model.attn_choice))[0]

    def _start_decoding(self, request, logits):
        P = len(request.prompt)
        first = request.rows[0]
        for row in request.rows:
            if row is not first:
                self.pool.copy_prefix(first.slot, row.slot, P)
            row.length = P
            room = self.max_context - P
            row.limit = room if request.max_tokens is None else min(request.max_tokens, room)
        tokens = self._sample(logits.expand(request.num_samples, -1), [(request, r.index, 0) for r in request.rows])
        for row in request.rows:
            row.drawn = 1
        tokens = tokens.tolist()
        request.state = "decode"
        request.first_token_at = time.perf_counter()
        self._advance(request, list(zip(request.rows, tokens)))
        # the prompt's blocks go to the prefix cache after its first token is out (its time to first token does not
        # wait for the copy); a row that ended at that token saved them as it left (_release)
        if self.prefix is not None and self.slots[first.slot] is first:
            self.prefix.save(request.prompt, first.slot)

    @staticmethod
    def _sample(logits, draws):
        """One token per row of logits (R, V) -> (R,) on the device, no host sync: draws[i] = (request, row index,
        token number) says whose settings and which uniform (row_uniform) row i takes. The greedy rows in one argmax,
        the others in one sample_rows."""
        greedy = [i for i, (q, _, _) in enumerate(draws) if q.temperature < GREEDY_BELOW]
        drawn = [i for i, (q, _, _) in enumerate(draws) if q.temperature >= GREEDY_BELOW]
        out = torch.empty(len(draws), dtype=torch.long, device=logits.device)
        for rows, greedy_part in ((greedy, True), (drawn, False)):
            if not rows:
                continue
            index = host_tensor(rows, logits.device) if len(rows) < len(draws) else None
            x = logits if index is None else logits[index]
            if greedy_part:
                token = x.argmax(dim=-1)
            else:
                qs = [draws[i][0] for i in rows]
                u = torch.tensor([row_uniform(q.seed, i, k) for q, i, k in (draws[j] for j in rows)], dtype=torch.float64)
                token = sample_rows(x, u, [q.temperature for q in qs], [q.top_k for q in qs], [q.top_p for q in qs])
            if index is None:
                return token
            out[index] = token
        return out

    def _decode(self):
        """One decode step for every generating row. Without overlap: launch it, then read its tokens. With overlap
        (CUDA): launch step N+1 first, its inputs the tokens of step N still on the device, then read step N's; the
        GPU runs N+1 while the host reads N and streams it, instead of waiting for the host between steps. A row
        that ended at N, or whose token N the calculator replaced, has its N+1 discarded (and is fed again)."""
        pending, self._pending = self._pending, None
        rows = [r for r in self.slots if r is not None and r.request.state == "decode" and r.drawn < r.limit]
        launched = self._launch(rows, pending) if rows else None
        if pending is not None:
            self._complete(pending, launched)
        if launched is not None:
            if self.overlap:
                self._pending = launched
            else:
                self._complete(launched, None)

    def _launch(self, rows, pending):
        """Feed every row its next token (from the host, or from `pending`'s tokens on the device) and sample the
        step's tokens on the device. Returns the Launch, or None if the forward failed (its requests fail)."""
        top = max(r.slot for r in rows) + 1
        if top > 2 * len(rows) and top > self.buckets[0]:
            self._compact()
            top = max(r.slot for r in rows) + 1
        B = next(b for b in self._decode_sizes() if b >= top)
        view = self.views.get(B)
        if view is None:
            view = self.views[B] = DecodeView(self.pool, B, self.batch_invariant, trim=True, windows=self.windows)
        # rows of the step in flight: their previous token is on the device, and their next one too unless the
        # calculator has a token queued to replace it (then that one, from the host)
        inflight = {id(r): j for j, r in enumerate(pending.rows) if pending.valid[j]} if pending is not None else {}
        ids, positions, prev = [0] * B, [None] * B, [-1] * B  # filler rows: see DecodeView
        from_device, prev_on_device = [], []
        for r in rows:
            positions[r.slot] = r.length
            j = inflight.get(id(r))
            if j is None:
                ids[r.slot] = r.next_token
                P, before = len(r.request.prompt), r.length - 1  # the token before next_token (RecordGPT's smear)
                prev[r.slot] = r.request.prompt[before] if before < P else r.request.tokens[r.index][before - P]
                continue
            prev_on_device.append((r.slot, j))
            if r.state.forced_tokens:
                ids[r.slot] = r.state.forced_tokens[0]  # what step N's token will be replaced with
            else:
                from_device.append((r.slot, j))
        try:
            view.set_step(ids, positions, prev, self._shared_prompts(rows))
            for pairs, dst, src in ((from_device, view.ids, pending and pending.tokens),
                                    (prev_on_device, view.prev_ids, pending and pending.inputs)):
                if pairs:
                    slots = host_tensor([a for a, _ in pairs], self.device)
                    dst[slots, 0] = src[host_tensor([b for _, b in pairs], self.device)]
            logits = self._forward(view)
            index = host_tensor([r.slot for r in rows], self.device)
            tokens = self._sample(logits[index], [(r.request, r.index, r.drawn) for r in rows])
            inputs = view.ids[index, 0]
        except Exception as e:
            logger.exception(f"decode step failed on scheduler {self.name}")
            for request in {r.request.id: r.request for r in rows}.values():
                self._finish(request, f"generation failed: {type(e).__name__}: {e}")
            return None
        for r in rows:
            r.length += 1
            r.drawn += 1
        self.decode_steps += 1
        self.decoded_rows += len(rows)
        device_fed = {slot for slot, _ in from_device}
        return Launch(rows, tokens, inputs, [None if r.slot in device_fed else ids[r.slot] for r in rows])

    def _shared_prompts(self, rows):
        """The rows that attend their prompt once this step (DecodeView.set_step's `shared`; eager on CPU): per
        request sampling n completions, its rows at the same position, >= 2 of them, in row order. Which rows group
        together depends on the request alone (not on the slots it got), so a row's arithmetic does too."""
        if self.compiled or self.device.type != "cpu":
            return ()
        groups = {}
        for r in rows:
            if r.request.num_samples > 1:
                groups.setdefault((r.request.id, r.length), []).append(r)
        return [([r.slot for r in sorted(g, key=lambda r: r.index)], len(g[0].request.prompt))
                for g in groups.values() if len(g) > 1]

    def _complete(self, launch, following):
        """Read a launched step's tokens (the host sync) and advance its rows that are still running; then discard
        `following`'s step (launched after it) for each row that ended here, or was fed a token other than the one
        it got here (the calculator replaced it): that row is fed again at the same position."""
        tokens = launch.tokens.tolist()
        by_request, got = {}, {}
        for j, (r, token) in enumerate(zip(launch.rows, tokens)):
            if launch.valid[j] and r.request.state == "decode" and r.request.finish_reasons[r.index] is None:
                by_request.setdefault(r.request.id, []).append((r, token))
                got[id(r)] = token
        for pairs in by_request.values():
            self._advance(pairs[0][0].request, sorted(pairs, key=lambda p: p[0].index))
        if following is None:
            return
        for j, r in enumerate(following.rows):
            if r.request.state != "decode" or r.request.finish_reasons[r.index] is not None:
                following.valid[j] = False  # it ended: its slot is free, nothing reads this row of the step
            elif id(r) in got:
                fed = following.fed[j] if following.fed[j] is not None else got[id(r)]
                if fed != r.request.tokens[r.index][-1]:
                    following.valid[j] = False
                    r.length -= 1
                    r.drawn -= 1

    def _decode_sizes(self, report=False):
        """The batch sizes this step may run at: the buckets when compiled, else decode_sizes (measured once per
        thread count: with batch invariance they are the BLAS's, which may change with the threads)."""
        if self.compiled:
            return self.buckets
        return self._measured(self._sizes, lambda: decode_sizes(self.model, self.pool.rows, self.batch_invariant),
                              report)

    def _packs(self, report=False):
        """Whether prompt chunks may share a prefill forward: always without batch invariance, else where it changes
        no bit of a prompt's logits (invariance.packs_invariantly: measured once per thread count, as the sizes)."""
        if not self.batch_invariant:
            return True
        return self._measured(self._packing, lambda: packs_invariantly(self.model, self.pool.rows, self.prefill_budget),
                              report)

    def _measured(self, found, measure, report):
        """`found[threads]`, measured at this thread's torch thread count the first time. report (stats, describe:
        called on other threads, chat_web's HTTP thread computing on one): the stepping thread's finding where it has
        one, rather than a measurement of its own that would stall the event loop for ~1 s and report other sizes."""
        threads = torch.get_num_threads()
        if report and self._step_threads in found:
            return found[self._step_threads]
        if threads not in found:
            with self.autocast():
                found[threads] = measure()
        return found[threads]

    def _forward(self, view):
        if not self.compiled:
            return self.model(view.ids, kv_cache=view)[:, -1, :]
        if self._step_fn is None:
            for t in self.pool.tensors():
                torch._dynamo.mark_static_address(t)
            for v in self.views.values():
                for t in v.tensors():
                    torch._dynamo.mark_static_address(t)

            def step(model, ids, cache):
                return model(ids, kv_cache=cache)[:, -1, :]

            # dynamic=None (automatic): the first bucket compiles static, the second recompiles with the batch size
            # symbolic, and every later bucket reuses that graph (on CUDA recorded as one more CUDA graph, cheap next
            # to a compile): two compiles, not one per bucket
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            cuda = self.device.type == "cuda"
            self._step_fn = torch.compile(step, mode="reduce-overhead" if cuda else None, dynamic=None)
        if self.device.type == "cuda":
            prepare_thread_for_cuda_graphs()  # whichever thread steps (the server's scheduler thread, generate_many's)
            torch.compiler.cudagraph_mark_step_begin()
        if view.batch in self._checked:  # this bucket's guards held once: skip re-checking them every step
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                logits = self._step_fn(self.model, view.ids, view)
        else:
            logits = self._step_fn(self.model, view.ids, view)
            self._checked.add(view.batch)
        return logits  # read (sampled) before the next step replays the graph over it

    def _advance(self, request, pairs):
        """This step's token for some rows of `request`: forced tool output first, stops, limits, the callback."""
        out = []
        for row, token in pairs:
            mask = 1
            if row.state.forced_tokens:  # the calculator's answer replaces what was sampled
                token, mask = row.state.forced_tokens.popleft(), 0
            self.engine.observe(row.state, token)
            row.generated += 1
            request.tokens[row.index].append(token)
            request.masks[row.index].append(mask)
            out.append((row.index, token, mask))
            stops = request.stop_tokens
            if (row.state.completed if stops is None else token in stops):
                request.finish_reasons[row.index] = "stop"
            elif row.generated >= row.limit:
                request.finish_reasons[row.index] = "length"
            else:
                row.next_token = token
                continue
            self._release(row)
        self.tokens_generated += len(out)
        self._emit(request, "tokens", out)
        if None not in request.finish_reasons:
            self._finish(request, None)

    def _release(self, row):
        """A row is done: its keys/values go to the prefix cache, its slot back to the free list."""
        if self.slots[row.slot] is not row:
            return
        request = row.request
        if self.prefix is not None and request.state == "decode" and request.error is None and row.length:
            # the tokens whose keys/values a completed step wrote: not the last one (never fed, or fed by a step
            # launched ahead and not read, overlap), so both ways cache the same
            fed = request.prompt + request.tokens[row.index][: row.length - len(request.prompt)]
            fed = fed[: len(request.prompt) + len(request.tokens[row.index]) - 1]
            self.prefix.park(row.slot, fed)  # cached, and kept in the slot until it is taken: a next turn resumes there
        self.slots[row.slot] = None
        self.free_slots.append(row.slot)
        self.free_slots.sort(reverse=True)

    def _compact(self):
        """Move the highest rows into the lowest free slots, so the decode batch (rows 0..top) stays dense."""
        for slot in range(len(self.slots) - 1, -1, -1):
            row = self.slots[slot]
            if row is None or not self.free_slots or self.free_slots[-1] > slot:
                continue
            if row.request.state != "decode":
                continue
            dst = self.free_slots.pop()
            if self.prefix is not None:
                self.prefix.unpark(dst)
            for t in self.pool.tensors():
                t[dst, :, : row.length] = t[slot, :, : row.length]
            self.slots[dst], self.slots[slot] = row, None
            row.slot = dst
            self.free_slots.append(slot)
            self.free_slots.sort(reverse=True)

    def _finish(self, request, error):
        """The request leaves (done, cancelled or failed): its rows free their slots now, then its last event."""
        if request.state == "done":
            return
        request.error = error
        for row in request.rows:
            self._release(row)
        if request in self.prefilling:
            self.prefilling.remove(request)
        self.requests.pop(request.id, None)
        request.state = "done"
        for i, reason in enumerate(request.finish_reasons):
            if reason is None:
                request.finish_reasons[i] = "cancelled" if request.cancelled else ("error" if error else "length")
        self.requests_done += 1
        self.requests_served += bool(request.rows)  # it got rows (one cancelled while waiting never ran)
        if request.rows and self.log_requests:
            dt = time.perf_counter() - request.submitted
            made = sum(len(t) for t in request.tokens)
            how = "failed" if error else ("stopped: cancelled" if request.cancelled else "done")
            ttft = f"first after {request.first_token_at - request.submitted:.3f}s, " if request.first_token_at else ""
            logger.info(f"scheduler {self.name}: prompt {len(request.prompt)} tokens ({request.prefix_hit} cached), "
                        f"{made} tokens over {request.num_samples} row(s) in {dt:.2f}s ({ttft}{how})")
        if error is not None:
            self.errors += 1
            self._emit(request, "error", error)
        else:
            self._emit(request, "done", None)
        request.finished.set()

    def _emit(self, request, kind, payload):
        if request.on_event is None:
            return
        try:
            request.on_event(kind, payload)
        except Exception:  # a consumer's failure must not take the batch down
            logger.exception("a request's event callback failed")

    # ------------------------------------------------------------------ the serving thread

    @torch.inference_mode()
    def warm_up(self):
        """
        Compile the decode step and, on CUDA, record its CUDA graph at every bucket now, on the thread that will
        step (CUDA graphs belong to the thread that records them): otherwise the first requests wait for both
        compiles (~35-40 s each at d20 on an H100, measured) and later ones for a graph at each new bucket. Each
        bucket runs twice, all of its rows fillers (they write only the scratch column): CUDA graph trees run a new
        graph once before they record it. An eager step measures its sizes and packing instead (batch invariance),
        so the first request does not wait for that. Returns the seconds it took.
        """
        t0 = time.perf_counter()
        if not self.compiled:
            self._step_threads = torch.get_num_threads()
            self._decode_sizes()
            self._packs()
            return time.perf_counter() - t0
        with self.autocast():
            for _ in range(2):
                for b in self.buckets:
                    view = self.views[b]
                    view.set_step([0] * b, [None] * b, [-1] * b)
                    self._forward(view)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def start(self):
        """Step on a daemon thread whenever there is work (the chat server's one scheduler per replica), after
        warm_up on that thread; `warmed` is set when the warm-up is over."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"nanochat-scheduler-{self.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self):
        self._stop = True
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self):
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            self.warm_s = self.warm_up()
        except Exception:  # the step compiles on first use instead, and reports its own errors then
            logger.exception(f"scheduler {self.name}: warming up failed")
        finally:
            self.warmed.set()
        while not self._stop:
            with self._wake:
                while not self._stop and not (self.inbox or self.waiting or self.requests):
                    self._wake.wait()
            if self._stop:
                return
            try:
                self.step()
            except Exception:  # a bug in the scheduler itself: fail what is in flight, keep serving
                logger.exception(f"scheduler {self.name} step failed")
                for request in list(self.requests.values()) + list(self.waiting):
                    self._finish(request, "generation failed: scheduler error (see the server log)")
                self.waiting.clear()

    def describe(self):
        cache = (f"prefix cache {self.prefix.num_blocks} blocks of {BLOCK} tokens" if self.prefix is not None
                 else "no prefix cache")
        return (f"{self.max_batch} sequences x {self.max_context} positions ({self.pool.nbytes() / 2**20:.0f} MiB), "
                f"{cache}, decode {'compiled' if self.compiled else 'eager'} at "
                f"{describe_sizes(self._decode_sizes(report=True))} rows")

    def stats(self):
        rows = self.running_rows()
        return {
            "running_rows": rows,
            "running_requests": len(self.requests),
            "waiting_requests": len(self.inbox) + len(self.waiting),
            "max_batch": self.max_batch,
            "kv_slots": self.pool.rows,
            "max_context": self.max_context,
            "kv_cache_bytes": self.pool.nbytes() + (self.prefix.nbytes() if self.prefix else 0),
            "steps": self.steps,
            "decode_steps": self.decode_steps,
            "decoded_rows": self.decoded_rows,
            "prefill_forwards": self.prefill_forwards,
            "prefill_chunks": self.prefill_chunks,
            "prefill_tokens": self.prefill_tokens,
            "busy_s": round(self.busy_s, 3),
            "decode_s": round(self.decode_s, 3),
            "decode": "compiled" if self.compiled else "eager",
            "batch_invariant": self.batch_invariant,
            "decode_overlap": self.overlap,
            "decode_sizes": describe_sizes(self._decode_sizes(report=True)),  # the batch sizes a decode step runs at
            "packed_prefills": self._packs(report=True),  # prompts arriving together share prefill forwards
            "prefix_cache": self.prefix.stats() if self.prefix else None,
        }


def describe_sizes(sizes):
    """[4, 8, 16, 24] -> '4, 8, 16, 24'; runs of consecutive sizes as ranges: [1, 2, ..., 64] -> '1-64'."""
    runs = []
    for size in sizes:
        if runs and size == runs[-1][1] + 1:
            runs[-1][1] = size
        else:
            runs.append([size, size])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def generate_many(engine, jobs, max_batch=32, max_context=None, prefix_cache=False, on_finish=None, **kwargs):
    """
    Run every Job through one Scheduler on this thread (no server): for evaluation and RL rollouts. Returns, per job
    and in order, (sequences, masks) as Engine.generate_batch gives them: the prompt then the sampled tokens (mask
    1) and forced tool output (mask 0), without the stop token. on_finish(i, sequences, masks) is called as each
    job ends (in the order they end). max_context defaults to what the longest job needs; the KV budget (unless
    kv_budget_bytes is given) to the slots for max_batch sequences (and as much again for a prefix cache).
    No prefix cache by default: whether a job hits one depends on when it is admitted, so on the other jobs and
    max_batch, and a hit changes the last bits of its arithmetic; without it every job's result is the one it gets
    alone (bit for bit on CPU), however the jobs are grouped (an RL step on 1 rank == the same questions on 2).
    """
    jobs = list(jobs)
    if not jobs:
        return []
    if max_context is None:
        need = max(len(j.prompt) + (j.max_tokens or engine.model.config.sequence_len) for j in jobs)
        max_context = min(need, engine.max_positions())
    max_batch = max(max_batch, max(j.num_samples for j in jobs))
    if "kv_budget_bytes" not in kwargs:
        cfg = engine.model.config
        per_token = kv_bytes_per_token(cfg.n_layer, cfg.n_kv_head, cfg.n_embd // cfg.n_head,
                                       kwargs.get("dtype") or kv_dtype(engine.model))
        columns = -(-(max_context + 1) // ATTN_BLOCK) * ATTN_BLOCK
        kwargs["kv_budget_bytes"] = (2 if prefix_cache else 1) * decode_buckets(max_batch)[-1] * per_token * columns
    scheduler = Scheduler(engine, max_batch=max_batch, max_context=max_context, prefix_cache=prefix_cache, **kwargs)
    results = [None] * len(jobs)

    def finished(i):
        def on_event(kind, payload):
            if kind == "done":
                results[i] = requests[i].sequences()
                if on_finish is not None:
                    on_finish(i, *results[i])
        return on_event

    requests = []
    for i, job in enumerate(jobs):
        requests.append(scheduler.submit(job.prompt, num_samples=job.num_samples, max_tokens=job.max_tokens,
                                         temperature=job.temperature, top_k=job.top_k, top_p=job.top_p, seed=job.seed,
                                         on_event=finished(i)))
    while scheduler.step():
        pass
    for request in requests:
        if request.error:
            raise RuntimeError(request.error)
    return results
