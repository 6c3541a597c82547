"""
The bridge between generation and the event loop. Tokens are made on another thread (a replica's Scheduler thread
when batching, the default; a generation thread running Engine.generate on a worker of the one-request-per-worker
pool) and come back to the event loop as text that is complete at UTF-8 character boundaries (RowText), one row per
sampled completion. The event loop only moves text.
"""

import asyncio
import logging
import os
import threading
import time
from collections import deque

from nanochat.engine import TextStreamer
from nanochat.serving.scheduler import Request
from nanochat.serving.workers import DISCONNECT_POLL_S, BatchingPool

logger = logging.getLogger("nanochat.serving")

WAKE_EVERY_S = 0.02  # the generating thread wakes the event loop at most this often (see Bridge)
CHUNKS_PER_S = 2000  # and a scheduler's streams ask the event loop for about this many chunks a second at most (Mailbox)

class RowText:
    """One sampled row of a request: its text (streamed at UTF-8 character boundaries) and why it ended."""

    def __init__(self, tokenizer, stop_ids):
        self.streamer = TextStreamer(tokenizer)
        self.stop_ids = stop_ids
        self.num_tokens = 0
        self.finish_reason = None
        self.text = []

    def push(self, token):
        """Add one token; returns the text that became complete ('' if none yet)."""
        if self.finish_reason is not None:
            return ""  # a finished row keeps producing filler until every row is done: ignore it
        self.num_tokens += 1
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return self.flush()
        text = self.streamer.push(token)
        if text:
            self.text.append(text)
        return text

    def push_many(self, tokens):
        """push() of one delivery's tokens, decoded together (TextStreamer.push_many): the same text and count."""
        if self.finish_reason is not None:
            return ""
        stop = next((k for k, token in enumerate(tokens) if token in self.stop_ids), None)
        if stop is not None:
            tokens = tokens[:stop]
        self.num_tokens += len(tokens) + (stop is not None)
        text = self.streamer.push_many(tokens) if tokens else ""
        if text:
            self.text.append(text)
        if stop is not None:
            self.finish_reason = "stop"
            text += self.flush()
        return text

    def flush(self):
        text = self.streamer.flush()
        if text:
            self.text.append(text)
        return text

    def finish(self):
        """At the end of generation: rows that did not stop ran out of tokens. Returns the last text."""
        if self.finish_reason is None:
            self.finish_reason = "length"
        return self.flush()


class Bridge:
    """
    Items from the generating thread to the event loop for one request: the thread calls emit(), the loop reads
    `events`. The thread wakes the loop at most every WAKE_EVERY_S (and for "done"/"error" at once): a wake-up per
    token made the two threads take turns at the GIL on every decode step (a d1 model on CPU decoded at a third of the
    bare Engine's speed in the server, a d4 on an H100 at 22.7 tok/s). Consecutive token items arrive as one
    ("tokens", [...]). With a Mailbox the wake-ups are shared by every request of the same scheduler.
    """

    def __init__(self, loop, mailbox=None):
        self.loop, self.mailbox = loop, mailbox
        self.events = deque()  # delivered, not read yet (event loop only)
        self.waiter = None  # what the reader awaits while `events` is empty
        self.pending, self.lock = [], threading.Lock()
        self.scheduled, self.last_wake = False, 0.0

    def put(self, items):  # on the event loop
        tokens = []  # (row, token) pairs of consecutive "tokens" items become one event
        for kind, payload in items:
            if kind == "tokens":
                tokens.extend(payload)
                continue
            if tokens:
                self.events.append(("tokens", tokens))
                tokens = []
            self.events.append((kind, payload))
        if tokens:
            self.events.append(("tokens", tokens))
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def take(self):  # on the event loop
        """Every event delivered since the last take, in order."""
        events = list(self.events)
        self.events.clear()
        return events

    async def wait(self, timeout):  # on the event loop
        """Until an event is delivered (True) or `timeout` s pass (False)."""
        if self.events:
            return True
        self.waiter = self.loop.create_future()
        try:
            await asyncio.wait_for(self.waiter, timeout)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
            return bool(self.events)
        finally:
            self.waiter = None
        return True

    def deliver(self):  # on the event loop
        with self.lock:
            items, self.pending = self.pending, []
            self.scheduled = False
        self.put(items)

    def emit(self, kind, payload, urgent=False):  # on the generating thread
        if self.mailbox is not None:
            self.mailbox.post(self, (kind, payload), urgent)
            return
        now = time.perf_counter()
        with self.lock:
            self.pending.append((kind, payload))
            if self.scheduled or (not urgent and now - self.last_wake < WAKE_EVERY_S):
                return
            self.scheduled, self.last_wake = True, now
        try:
            self.loop.call_soon_threadsafe(self.deliver)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass


class Mailbox:
    """
    The Bridges of every request a scheduler thread serves on one event loop, woken together: one wake-up for all of
    them instead of one per request (with 16 streams a wake-up per request and step kept the event loop busy enough
    to slow the scheduler's steps by a fifth: the two threads share the GIL). The pace: every WAKE_EVERY_S at most,
    and with many streams every `streams / CHUNKS_PER_S` s, so that the event loop writes at most ~CHUNKS_PER_S
    chunks a second however many streams there are. Each delivery is a chunk per stream (a JSON event and a socket
    write, ~0.1-0.25 ms of the loop's Python on docs/benchmarks.md's CPU); at 256 streams and a GPU's ~20 ms steps,
    a chunk per stream and step would be ~12,800 a second, more than one event loop writes, and the loop's time per
    token would bound the server's tok/s (bench/host_bench.py). A "done"/"error" or a request's first token wakes the
    loop at once, for the streams that have such an item only: the others' tokens keep their pace.
    """

    def __init__(self, loop):
        self.loop = loop
        self.pending, self.urgent, self.lock = {}, set(), threading.Lock()  # items by bridge, in arrival order
        self.scheduled, self.last_wake, self.streams = False, 0.0, 0  # streams: those of the last paced delivery

    def interval(self):
        return max(WAKE_EVERY_S, self.streams / CHUNKS_PER_S)

    def post(self, bridge, item, urgent):  # on the scheduler's thread
        now = time.perf_counter()
        with self.lock:
            self.pending.setdefault(bridge, []).append(item)
            if urgent:
                self.urgent.add(bridge)
            if self.scheduled or (not urgent and now - self.last_wake < self.interval()):
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self.deliver)
        except RuntimeError:
            pass

    def deliver(self):  # on the event loop
        now = time.perf_counter()
        with self.lock:
            self.scheduled = False
            if now - self.last_wake >= self.interval():  # the paced wake-up: every stream
                items, self.pending = self.pending, {}
                self.streams, self.last_wake = len(items), now
            else:  # an urgent one before the pace: the streams with an urgent item (all of theirs, in order)
                items = {bridge: self.pending.pop(bridge) for bridge in self.urgent}
            self.urgent = set()
        for bridge, its in items.items():
            bridge.put(its)


def _seed(params):
    return params["seed"] if params["seed"] is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


async def generation_events(pool, request, prompt, params, streaming=False):
    """
    Runs one generation and yields ("worker", w), then ("delta", row, text) as text becomes ready (a row's text of
    one delivery in one delta), ("finish", row, reason) per row, and finally ("done", rows) or ("error", message).
    Stops early (and frees the rows or the worker) when the client disconnects: it checks every DISCONNECT_POLL_S
    while it waits, and while text flows unless `streaming` (the response streams it: the server then tears the
    response down as soon as the client leaves, and this generator's finally stops the generation). The caller's
    `finally` runs when the response is torn down.
    """
    start = _start_batched if isinstance(pool, BatchingPool) else _start_on_worker
    started = await start(pool, request, prompt, params)
    if started is None:
        return
    worker, bridge, stop = started
    engine = worker.engine
    rows = [RowText(engine.tokenizer, {engine.assistant_end, engine.bos}) for _ in range(params["n"])]
    checked = time.perf_counter()  # the client's last disconnect check
    try:
        yield ("worker", worker)
        while True:
            events = bridge.take()
            if not events:
                if not await bridge.wait(DISCONNECT_POLL_S) and await request.is_disconnected():
                    return
                continue
            # while text flows into a reply that is not streamed, a disconnect check every DISCONNECT_POLL_S (not
            # one per delivery: starlette's check costs ~30 us of the event loop)
            now = time.perf_counter()
            if not streaming and now - checked >= DISCONNECT_POLL_S:
                if await request.is_disconnected():
                    return
                checked = now
            for kind, payload in events:
                if kind == "tokens":
                    # one delta per row and delivery, not per token: the text arrives at the same moment either
                    # way, and each delta is a JSON event and a socket write here and a parse at the client
                    by_row = {}
                    for i, token in payload:
                        by_row.setdefault(i, []).append(token)
                    texts, finished = {}, []
                    for i, tokens in by_row.items():
                        was_running = rows[i].finish_reason is None
                        delta = rows[i].push_many(tokens)
                        if delta:
                            texts[i] = delta
                        if was_running and rows[i].finish_reason is not None:
                            finished.append(i)
                    for i, text in texts.items():
                        yield ("delta", i, text)
                    for i in finished:
                        yield ("finish", i, rows[i].finish_reason)
                elif kind == "done":
                    for i, row in enumerate(rows):
                        if row.finish_reason is None:
                            delta = row.finish()
                            if delta:
                                yield ("delta", i, delta)
                            yield ("finish", i, row.finish_reason)
                    yield ("done", rows)
                    return
                else:
                    yield ("error", payload)
                    return
    finally:
        stop()  # the scheduler drops the rows at its next step / the thread stops before its next forward


async def _start_batched(pool, request, prompt, params):
    """Submit to a replica's scheduler: the tokens join its decode batch from the next step on."""
    worker = pool.pick(prompt)
    loop = asyncio.get_running_loop()
    if worker.mailbox is None or worker.mailbox.loop is not loop:
        worker.mailbox = Mailbox(loop)
    bridge = Bridge(loop, worker.mailbox)

    first = [True]

    def on_event(kind, payload):  # on the scheduler's thread
        if kind == "tokens":  # the first token at once (time to first token), the rest at the shared pace
            bridge.emit("tokens", [(row, token) for row, token, _ in payload], urgent=first[0])
            first[0] = False
        else:
            bridge.emit(kind, payload, urgent=True)

    job = Request(prompt, num_samples=params["n"], max_tokens=params["max_tokens"], temperature=params["temperature"],
                  top_k=params["top_k"] or None, top_p=params["top_p"], seed=_seed(params), on_event=on_event)
    worker.scheduler.submit_request(job)
    return worker, bridge, job.cancel


async def _start_on_worker(pool, request, prompt, params):
    """Wait for a free worker, then run Engine.generate on the worker's generation thread."""
    worker = await pool.acquire(request)
    if worker is None:
        return None
    try:
        gone = await request.is_disconnected()  # the client left just as its turn came: skip the work
    except BaseException:
        pool.release(worker)
        raise
    if gone:
        pool.release(worker)
        return None
    engine = worker.engine
    n = params["n"]
    loop = asyncio.get_running_loop()
    bridge = Bridge(loop)
    stop = threading.Event()
    gen_kwargs = dict(num_samples=n, max_tokens=params["max_tokens"], temperature=params["temperature"],
                      top_k=params["top_k"] or None, top_p=params["top_p"], seed=_seed(params))

    def work():
        # Runs on the worker's thread so the event loop keeps serving other clients during forward passes.
        t0, steps = time.perf_counter(), 0
        try:
            with worker.autocast():
                for token_column, _ in engine.generate(prompt, **gen_kwargs):
                    steps += 1
                    worker.tokens_generated += len(token_column)
                    if stop.is_set():
                        break
                    bridge.emit("tokens", list(enumerate(token_column)))
            bridge.emit("done", None, urgent=True)
            dt = time.perf_counter() - t0
            how = "stopped: client left" if stop.is_set() else "done"
            logger.info(f"worker {worker.gpu_id}: prompt {len(prompt)} tokens, {steps} steps x {n} rows in {dt:.2f}s ({steps * n / max(dt, 1e-9):.1f} tok/s), {how}")
        except Exception as e:  # the request fails; the worker stays in service
            worker.errors += 1
            logger.exception(f"generation failed on worker {worker.gpu_id}")
            bridge.emit("error", f"generation failed: {type(e).__name__}: {e}", urgent=True)
        finally:
            worker.requests_served += 1
            try:
                loop.call_soon_threadsafe(pool.release, worker)
            except RuntimeError:
                pass

    worker.run_in_thread(work)
    return worker, bridge, stop.set
