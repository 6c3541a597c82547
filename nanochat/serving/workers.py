"""
The chat server's model replicas: a Worker is one Engine on one device, used by one request at a time; the
WorkerPool hands free workers to requests in arrival order and bounds how many may wait.
"""

import asyncio
from contextlib import nullcontext

import torch

from nanochat.serving.schema import RequestError

DISCONNECT_POLL_S = 0.1  # how often a waiting request checks whether its client is still there
RETRY_AFTER_S = 2  # the Retry-After of a 429 when the queue is full: about one short reply's time



class Worker:
    """One model replica: its Engine, the device it lives on and counters for /stats. Used by one request at a time."""

    def __init__(self, engine, gpu_id=0, device=None, dtype=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.gpu_id = gpu_id
        self.device = torch.device(device) if device is not None else engine.model.get_device()
        # bf16 autocast on CUDA (what the model was trained under); plain fp32 elsewhere
        self.dtype = dtype if dtype is not None else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.busy = False
        self.requests_served = 0
        self.tokens_generated = 0
        self.errors = 0

    def autocast(self):
        if self.device.type == "cuda" and self.dtype != torch.float32:
            return torch.amp.autocast(device_type="cuda", dtype=self.dtype)
        return nullcontext()

    def stats(self):
        return {
            "gpu_id": self.gpu_id,
            "device": str(self.device),
            "busy": self.busy,
            "status": "busy" if self.busy else "idle",
            "requests_served": self.requests_served,
            "tokens_generated": self.tokens_generated,
            "errors": self.errors,
        }


class WorkerPool:
    """
    Free workers wait in an asyncio.Queue; requests take one (first come, first served) and give it back.
    At most len(workers) + max_queue requests are admitted at once (running or waiting); the next one is refused
    with 429 rather than left to wait without end (and hold a connection and its memory) behind a long queue.
    """

    def __init__(self, workers, max_queue=None):
        if not workers:
            raise ValueError("the worker pool needs at least one worker")
        self.workers = list(workers)
        self.max_queue = max_queue  # None: no bound
        self.admitted = 0
        self.free = asyncio.Queue()
        for w in self.workers:
            self.free.put_nowait(w)

    def available(self):
        return self.free.qsize()

    def queued(self):
        """Admitted requests not (yet) on a worker."""
        return max(0, self.admitted - sum(1 for w in self.workers if w.busy))

    def admit(self):
        """A place for one request, or RequestError(429); call the returned function (once) when the request ends."""
        if self.max_queue is not None and self.admitted >= len(self.workers) + self.max_queue:
            raise RequestError(
                f"the server is busy: all {len(self.workers)} worker(s) are generating and {self.max_queue} request(s) are waiting; retry shortly",
                status=429, code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.admitted += 1
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                self.admitted -= 1

        return release

    async def acquire(self, request):
        """A free worker, or None if the client disconnected while waiting (its place in the queue is kept)."""
        getter = asyncio.ensure_future(self.free.get())
        taken = False  # whether the worker from `getter` went to the caller
        try:
            while not getter.done():
                await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if not getter.done() and await request.is_disconnected():
                    return None
            worker = getter.result()
            worker.busy = True
            taken = True
            return worker
        finally:
            if not getter.done():
                getter.cancel()
            elif not taken and not getter.cancelled() and getter.exception() is None:
                # the queue handed us a worker just as we were cancelled: give it back
                self.free.put_nowait(getter.result())

    def release(self, worker):
        worker.busy = False
        self.free.put_nowait(worker)
