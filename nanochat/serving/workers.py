"""
The chat server's model replicas and how requests reach them. A Worker is one Engine on one device.
- BatchingPool (the default): each worker runs a Scheduler (nanochat/serving/scheduler.py) on its own thread, and
  every request joins the decode batch of one of them (the replica whose prefix cache holds most of its prompt, else
  the least loaded). At most max_batch sequences per replica generate together; admitted requests beyond that wait
  in the scheduler's queue, and beyond --max_queue of those the next request gets 429.
- WorkerPool (chat_web --batching=0, and the serving benchmark's baseline): one request per worker at a time;
  requests wait for a free worker in arrival order.
"""

import asyncio
import logging
import queue
import threading
from contextlib import nullcontext

import torch

from nanochat.serving.invariance import strict_blas
from nanochat.serving.schema import RequestError

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1  # how often a waiting request checks whether its client is still there
RETRY_AFTER_S = 2  # the Retry-After of a 429 when the queue is full: about one short reply's time



class Worker:
    """One model replica: its Engine, the device it lives on and counters for /stats. Used by one request at a time.
    threads: the torch CPU threads of the thread that generates (its Scheduler's, or run_in_thread's), set on that
    thread when it starts (None: as the process has them; see chat_web, which keeps its main thread at one)."""

    def __init__(self, engine, gpu_id=0, device=None, dtype=None, threads=None):
        self.engine = engine
        self.threads = threads
        self.tokenizer = engine.tokenizer
        self.gpu_id = gpu_id
        self.device = torch.device(device) if device is not None else engine.model.get_device()
        # bf16 autocast on CUDA (what the model was trained under); plain fp32 elsewhere
        self.dtype = dtype if dtype is not None else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.busy = False
        self.requests_served = 0
        self.tokens_generated = 0
        self.errors = 0
        self.scheduler = None  # set by a BatchingPool
        self.mailbox = None  # the wake-ups of its requests' streams (nanochat/serving/generation.py), per event loop
        self._jobs = None  # the queue of its generation thread (run_in_thread), started on first use

    def run_in_thread(self, fn):
        """Run fn() on this worker's generation thread: one long-lived thread per worker, not one per request, since
        a compiled CUDA step records its CUDA graphs per thread (prepare_thread_for_cuda_graphs in engine.py): a
        thread per reply would record them again for every reply. A WorkerPool gives a worker one request at a
        time, so the jobs never wait behind each other."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve_jobs, name=f"nanochat-gen-{self.gpu_id}", daemon=True).start()
        self._jobs.put(fn)

    def _serve_jobs(self):
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        while True:
            fn = self._jobs.get()
            try:
                fn()
            except BaseException:  # fn reports its own failures; this thread must outlive any of them
                logger.exception(f"worker {self.gpu_id}: a generation job failed")

    def autocast(self):
        if self.device.type == "cuda" and self.dtype != torch.float32:
            return torch.amp.autocast(device_type="cuda", dtype=self.dtype)
        return nullcontext()

    def kv_dtype(self):
        """The dtype the forward's keys come out in, so the KV cache holds them as they are: autocast's on CUDA."""
        from nanochat.serving.scheduler import kv_dtype

        with self.autocast():
            return kv_dtype(self.engine.model)

    def is_busy(self):
        return self.scheduler.pending() > 0 if self.scheduler is not None else self.busy

    def stats(self):
        busy = self.is_busy()
        out = {
            "gpu_id": self.gpu_id,
            "device": str(self.device),
            "busy": busy,
            "status": "busy" if busy else "idle",
            "requests_served": self.requests_served,
            "tokens_generated": self.tokens_generated,
            "errors": self.errors,
        }
        if self.scheduler is not None:
            s = self.scheduler
            out.update(requests_served=s.requests_served, tokens_generated=s.tokens_generated, errors=s.errors,
                       batching=s.stats())
        return out


def prepare_cpu(device_type, batch_invariant):
    """chat_web's settings of its process before the model loads: MKL's strict mode where the batching server is to
    be batch-invariant (invariance.strict_blas: every batch size then gives a row the same bits, so a step computes
    only the rows running and prompts share prefill forwards), and the CPU threads (hand_cpu_threads_to_workers)."""
    if batch_invariant:
        strict_blas(device_type)
    return hand_cpu_threads_to_workers(device_type)


def hand_cpu_threads_to_workers(device_type):
    """
    On CPU, the server's main thread (the one that loads the model, then serves HTTP) computes on one torch thread
    from here on, and returns the thread count the generating threads are to set on themselves (Worker.threads);
    None elsewhere. Why: OpenMP (torch's CPU parallel backend, GNU libgomp in the Linux wheels) keeps a pool of
    worker threads for every thread that ever ran a parallel region, and once those outnumber the cores it stops
    spinning between regions, so each region of a decode step waits for its workers to wake. The main thread's pool
    (from loading the model) beside the scheduler's made the scheduler's steps ~15% slower on a 2-core CPU (measured
    in process: a scheduler thread stepping 16 closed-loop clients, docs/benchmarks.md). Only with the OpenMP
    backend: torch's native one fixes its thread count for the whole process at the first parallel work.
    """
    if torch.device(device_type).type != "cpu" or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def check_kv_plans(workers, max_batch, max_context=None, kv_cache_gb=None, prefix_cache=True):
    """chat_web's start-up check: the KV slots and prefix cache each replica's scheduler will allocate fit, else a
    usage error saying which setting to change (before the server listens)."""
    from nanochat.serving.kv_slots import plan_kv
    from nanochat.usage import BadValue

    budget = None if kv_cache_gb is None else int(kv_cache_gb * 2**30)
    for w in workers:
        try:
            plan_kv(w.engine.model.config, w.engine.max_positions(), max_batch, max_context, w.kv_dtype(), w.device,
                    budget, prefix_cache)
        except ValueError as e:
            raise BadValue(str(e)) from None


class Admission:
    """Counts the requests a pool has admitted (running or waiting) and refuses one beyond `running_limit` +
    max_queue with 429 + Retry-After, rather than let it wait without end (holding a connection and its memory)."""

    running_limit = 0
    max_queue = None
    admitted = 0

    def admit(self):
        """A place for one request, or RequestError(429); call the returned function (once) when the request ends."""
        if self.max_queue is not None and self.admitted >= self.running_limit + self.max_queue:
            raise RequestError(self.busy_message(), status=429, code="rate_limit_exceeded",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        self.admitted += 1
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                self.admitted -= 1

        return release


class WorkerPool(Admission):
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
        self.running_limit = len(self.workers)
        self.free = asyncio.Queue()
        for w in self.workers:
            self.free.put_nowait(w)

    def available(self):
        return self.free.qsize()

    def queued(self):
        """Admitted requests not (yet) on a worker."""
        return max(0, self.admitted - sum(1 for w in self.workers if w.busy))

    def busy_message(self):
        return f"the server is busy: all {len(self.workers)} worker(s) are generating and {self.max_queue} request(s) are waiting; retry shortly"

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


class BatchingPool(Admission):
    """
    One Scheduler per worker, each stepping on its own thread; a request goes to one of them and shares its decode
    batch. At most sum(max_batch) + max_queue requests are admitted at once (generating or waiting in a scheduler's
    queue); the next one is refused with 429. scheduler_options go to every Scheduler (max_batch, max_context,
    kv_budget_bytes, prefix_cache, prefill_chunk).
    """

    def __init__(self, workers, max_queue=None, **scheduler_options):
        from nanochat.serving.scheduler import Scheduler

        if not workers:
            raise ValueError("the worker pool needs at least one worker")
        self.workers = list(workers)
        self.max_queue = max_queue
        for w in self.workers:
            w.scheduler = Scheduler(w.engine, autocast=w.autocast, dtype=w.kv_dtype(), name=str(w.gpu_id),
                                    log_requests=True, threads=w.threads, **scheduler_options)
            w.scheduler.start()
        self.running_limit = sum(w.scheduler.max_batch for w in self.workers)

    def wait_warm(self):
        """Block until every scheduler's warm-up (a compiled decode step's compiles and CUDA graphs) is over."""
        for w in self.workers:
            w.scheduler.warmed.wait()

    def close(self):
        for w in self.workers:
            w.scheduler.stop()

    def available(self):
        """Workers that would start a new request at once."""
        return sum(1 for w in self.workers if w.scheduler.load() < w.scheduler.max_batch)

    def queued(self):
        return sum(len(w.scheduler.inbox) + len(w.scheduler.waiting) for w in self.workers)

    def max_context(self):
        return min(w.scheduler.max_context for w in self.workers)

    def busy_message(self):
        return (f"the server is busy: {self.running_limit} sequence(s) are generating on {len(self.workers)} worker(s) "
                f"and {self.max_queue} request(s) are waiting; retry shortly")

    def pick(self, prompt):
        """The worker for `prompt`: the one whose prefix cache holds the most of it (a conversation's next turn goes
        where its earlier turns are), else the least loaded."""
        if len(self.workers) == 1:
            return self.workers[0]

        def score(w):
            s = w.scheduler
            cached = s.prefix.cached_tokens(prompt) if s.prefix is not None else 0
            return (-cached, s.load() / s.max_batch)

        return min(self.workers, key=score)
