"""
Chat web server: a browser UI, a streaming endpoint for it, and an OpenAI-compatible API, served by a pool of model
replicas (one per GPU, or one on CPU/MPS).

    python -m scripts.chat_web                          # sft model, all defaults, http://127.0.0.1:8000 (this machine only)
    python -m scripts.chat_web -n 4 -i sft -g d20       # four replicas on four GPUs
    NANOCHAT_API_KEY=secret python -m scripts.chat_web  # or --api_key_file=PATH: a key on every generation endpoint

Endpoints
    GET  /                      the chat page (single file, no CDN)
    POST /chat/completions      {"messages":[{"role","content"}], "temperature"?, "top_k"?, "max_tokens"?}
                                -> text/event-stream: data: {"token": "...", "gpu": i} ... data: {"done": true}
    POST /v1/chat/completions   OpenAI Chat Completions (stream or not, n, system messages, top_p, seed)
    GET  /v1/models             the served model
    GET  /health                {"status", "ready", "num_gpus", "available_workers", ...}
    GET  /stats                 per-worker busy/idle and counters

Requests wait in a queue for a free worker; at most --max_queue wait, the next gets 429 with Retry-After. Generation runs in a thread (the event loop only moves text); the text
of each row is sent only at UTF-8 character boundaries. When a client goes away its generation stops and the worker
is free again after at most one more forward pass.
"""

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import threading
import time
import uuid
from contextlib import aclosing, asynccontextmanager, nullcontext
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from nanochat.chat_schema import (
    MAX_MAX_TOKENS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_MAX_TOKENS,
    MIN_TEMPERATURE,
    MIN_TOP_K,
    RequestError,
    read_json_body,
    shown,
    validate_openai_request,
    validate_ui_request,
)
from nanochat.common import setup_default_logging
from nanochat.engine import Engine, TextStreamer, decode_compile_flag

setup_default_logging()
logger = logging.getLogger("nanochat.chat_web")

DISCONNECT_POLL_S = 0.1  # how often a waiting request checks whether its client is still there
WAKE_EVERY_S = 0.02  # the generation thread wakes the event loop at most this often (see generation_events)
RETRY_AFTER_S = 2  # the Retry-After of a 429 when the queue is full: about one short reply's time

UI_PATH = Path(__file__).resolve().parents[1] / "nanochat" / "ui.html"


# -----------------------------------------------------------------------------
# Workers


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


# -----------------------------------------------------------------------------
# Prompt rendering and text streaming


def render_prompt(tokenizer, messages):
    """
    Token ids of the conversation in nanochat's chat format, ending with <|assistant_start|> so the model answers:
    <|bos|> <|user_start|> ... <|user_end|> <|assistant_start|> ... <|assistant_end|> ... <|assistant_start|>
    A leading system message is folded into the first user message (as nanochat's SFT data does).
    """
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        system = messages.pop(0)["content"]
        if messages and messages[0]["role"] == "user":
            messages[0]["content"] = system + "\n\n" + messages[0]["content"]
        else:
            messages.insert(0, {"role": "user", "content": system})
    special = tokenizer.encode_special
    ids = [tokenizer.get_bos_token_id()]
    for m in messages:
        start, end = ("<|user_start|>", "<|user_end|>") if m["role"] == "user" else ("<|assistant_start|>", "<|assistant_end|>")
        ids.append(special(start))
        ids.extend(tokenizer.encode(m["content"]))
        ids.append(special(end))
    ids.append(special("<|assistant_start|>"))
    return ids


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


async def generation_events(pool, request, prompt, params):
    """
    Runs one generation and yields ("worker", w), then ("delta", row, text) as text becomes ready, ("finish", row,
    reason) per row, and finally ("done", rows) or ("error", message). Stops early (and frees the worker) when the
    client disconnects; the caller's `finally` runs when the response is torn down.
    """
    worker = await pool.acquire(request)
    if worker is None:
        return
    try:
        gone = await request.is_disconnected()  # the client left just as its turn came: skip the work
    except BaseException:
        pool.release(worker)
        raise
    if gone:
        pool.release(worker)
        return
    engine = worker.engine
    n = params["n"]
    loop = asyncio.get_running_loop()
    events = asyncio.Queue()
    stop = threading.Event()
    seed = params["seed"] if params["seed"] is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    gen_kwargs = dict(
        num_samples=n,
        max_tokens=params["max_tokens"],
        temperature=params["temperature"],
        top_k=params["top_k"] or None,
        top_p=params["top_p"],
        seed=seed,
    )

    # The generation thread hands items to the event loop through `pending` and wakes the loop at most every
    # WAKE_EVERY_S (and for "done"/"error" at once). A wake-up per token made the two threads take turns at the GIL
    # on every decode step: a d1 model on CPU decoded at a third of the bare Engine's speed in the server, a d4 on an
    # H100 at 22.7 tok/s. Tokens reach the client in chunks of at most WAKE_EVERY_S of generation.
    pending, pending_lock, state = [], threading.Lock(), {"scheduled": False, "last_wake": 0.0}

    def deliver():  # on the event loop
        with pending_lock:
            items = pending[:]
            pending.clear()
            state["scheduled"] = False
        columns = []  # consecutive token columns become one ("tokens", [column, ...]) event
        for kind, payload in items:
            if kind == "tokens":
                columns.append(payload)
                continue
            if columns:
                events.put_nowait(("tokens", columns))
                columns = []
            events.put_nowait((kind, payload))
        if columns:
            events.put_nowait(("tokens", columns))

    def emit(item, urgent=False):
        now = time.perf_counter()
        with pending_lock:
            pending.append(item)
            if state["scheduled"] or (not urgent and now - state["last_wake"] < WAKE_EVERY_S):
                return
            state["scheduled"], state["last_wake"] = True, now
        try:
            loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def work():
        # Runs in its own thread so the event loop keeps serving other clients during forward passes.
        t0, steps = time.perf_counter(), 0
        try:
            with worker.autocast():
                for token_column, _ in engine.generate(prompt, **gen_kwargs):
                    steps += 1
                    worker.tokens_generated += len(token_column)
                    if stop.is_set():
                        break
                    emit(("tokens", token_column))
            emit(("done", None), urgent=True)
            dt = time.perf_counter() - t0
            how = "stopped: client left" if stop.is_set() else "done"
            logger.info(f"worker {worker.gpu_id}: prompt {len(prompt)} tokens, {steps} steps x {n} rows in {dt:.2f}s ({steps * n / max(dt, 1e-9):.1f} tok/s), {how}")
        except Exception as e:  # the request fails; the worker stays in service
            worker.errors += 1
            logger.exception(f"generation failed on worker {worker.gpu_id}")
            emit(("error", f"generation failed: {type(e).__name__}: {e}"), urgent=True)
        finally:
            worker.requests_served += 1
            try:
                loop.call_soon_threadsafe(pool.release, worker)
            except RuntimeError:
                pass

    thread = threading.Thread(target=work, name=f"nanochat-gen-{worker.gpu_id}", daemon=True)
    thread.start()
    stop_ids = {engine.assistant_end, engine.bos}
    rows = [RowText(engine.tokenizer, stop_ids) for _ in range(n)]
    getter = None
    try:
        yield ("worker", worker)
        while True:
            if getter is None:
                getter = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if not done:
                if await request.is_disconnected():
                    return
                continue
            kind, payload = getter.result()
            getter = None
            if kind == "tokens":
                if await request.is_disconnected():  # one check per delivery, not per token
                    return
                for column in payload:
                    for i, token in enumerate(column):
                        was_running = rows[i].finish_reason is None
                        delta = rows[i].push(token)
                        if delta:
                            yield ("delta", i, delta)
                        if was_running and rows[i].finish_reason is not None:
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
        stop.set()  # the thread sees it before its next forward pass and hands the worker back
        if getter is not None:
            getter.cancel()


def sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class AdmittedStream(StreamingResponse):
    """A streaming response that gives its pool place back when it ends, however it ends (done, error, client gone,
    or never started because the client left before the headers went out)."""

    def __init__(self, content, release, **kwargs):
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


# -----------------------------------------------------------------------------
# The app


def create_app(
    workers_or_factory,
    *,
    model_name="nanochat",
    api_key=None,
    cors_origins=(),
    max_queue=64,
    temperature=0.8,
    top_k=50,
    max_tokens=512,
):
    """
    The FastAPI app. `workers_or_factory` is a list of Workers, or a callable returning one (called at startup, in a
    thread, e.g. to load checkpoints). api_key: when set, every generation endpoint (/chat/completions, /v1/*) needs
    `Authorization: Bearer <key>`; the page itself, /health and /stats stay open (the page asks for the key).
    """
    defaults = {"temperature": temperature, "top_k": top_k, "max_tokens": max_tokens}
    state = {"pool": None, "started": int(time.time())}
    ui_html = UI_PATH.read_text(encoding="utf-8").replace("__NANOCHAT_DEFAULTS__", json.dumps(defaults))

    @asynccontextmanager
    async def lifespan(app):
        workers = workers_or_factory
        if callable(workers):
            workers = await asyncio.to_thread(workers)
        state["pool"] = WorkerPool(workers, max_queue=max_queue)
        logger.info(f"serving {model_name!r} with {len(workers)} worker(s): {', '.join(str(w.device) for w in workers)}")
        yield
        state["pool"] = None

    # no /docs or /redoc: their pages load Swagger UI from a CDN, and the server must work offline
    app = FastAPI(title="nanochat", lifespan=lifespan, docs_url=None, redoc_url=None)
    if cors_origins:  # off by default: only the page this server serves (same origin) may call it from a browser
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            allow_credentials=False,
        )

    def error_response(err, openai_style):
        err.message = shown(err.message)  # a last guard: the response must encode whatever went into the message
        if openai_style:
            kind = "invalid_request_error" if err.status < 500 else "server_error"
            body = {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}
        else:
            body = {"detail": err.message}
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestError)
    async def on_request_error(request, err):
        return error_response(err, request.url.path.startswith("/v1/"))

    def pool_or_503():
        if state["pool"] is None:
            raise RequestError("the server is not ready (models are loading or it is shutting down)", status=503)
        return state["pool"]

    def check_api_key(request):
        if not api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Starlette decodes header bytes as latin-1: encoding back gives the exact bytes sent, so a non-ASCII key sent
        # as UTF-8 matches, and bytes that are not UTF-8 at all simply do not match (401, never a 500)
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), api_key.encode()):
            what = "Missing API key" if not header else "Incorrect API key provided"
            raise RequestError(
                f"{what}: send the server's key as `Authorization: Bearer <key>`", status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )

    def checked_prompt(pool, messages):
        # All replicas share the tokenizer: the prompt is rendered (and checked) once, before waiting for a worker.
        engine = pool.workers[0].engine
        prompt = render_prompt(engine.tokenizer, messages)
        limit = engine.max_positions()
        if len(prompt) >= limit:
            raise RequestError(f"the conversation is {len(prompt)} tokens; this model handles at most {limit - 1} of prompt. Start a new conversation or shorten it")
        return prompt

    # --- UI

    @app.get("/")
    async def root():
        return HTMLResponse(ui_html)

    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        check_api_key(request)  # before the body is read: a client without the key cannot make us buffer a megabyte
        pool = pool_or_503()
        params = validate_ui_request(await read_json_body(request), defaults)
        prompt = checked_prompt(pool, params["messages"])
        release = pool.admit()

        async def stream():
            gpu = None
            try:
                async with aclosing(generation_events(pool, request, prompt, params)) as events:
                    async for event in events:
                        if event[0] == "worker":
                            gpu = event[1].gpu_id
                        elif event[0] == "delta":
                            yield sse({"token": event[2], "gpu": gpu})
                        elif event[0] == "error":
                            yield sse({"error": event[1]})
                        elif event[0] == "done":
                            yield sse({"done": True})
            except Exception as e:  # never tear a stream down without telling the client
                logger.exception("chat stream failed")
                yield sse({"error": f"{type(e).__name__}: {e}"})

        return AdmittedStream(stream(), release, media_type="text/event-stream", headers=SSE_HEADERS)

    # --- OpenAI-compatible API

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_api_key(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str, request: Request):
        check_api_key(request)
        if model_id != model_name:
            raise RequestError(f"The model {json.dumps(model_id)} does not exist; this server serves {json.dumps(model_name)}", "model", status=404, code="model_not_found")
        return model_card()

    def model_card():
        return {"id": model_name, "object": "model", "created": state["started"], "owned_by": "nanochat"}

    @app.post("/v1/chat/completions")
    async def openai_chat_completions(request: Request):
        check_api_key(request)
        pool = pool_or_503()
        params = validate_openai_request(await read_json_body(request), defaults, model_name)
        prompt = checked_prompt(pool, params["messages"])
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n = params["n"]

        def usage(rows):
            completion_tokens = sum(r.num_tokens for r in rows)
            return {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens, "total_tokens": len(prompt) + completion_tokens}

        release = pool.admit()
        if not params["stream"]:
            rows = None
            try:
                async with aclosing(generation_events(pool, request, prompt, params)) as events:
                    async for event in events:
                        if event[0] == "error":
                            raise RequestError(event[1], status=500, code="generation_failed")
                        if event[0] == "done":
                            rows = event[1]
            finally:
                release()
            if rows is None:  # the client left before we finished; nobody reads this
                return JSONResponse({"error": {"message": "client disconnected", "type": "server_error", "param": None, "code": None}}, status_code=499)
            choices = [
                {"index": i, "message": {"role": "assistant", "content": "".join(r.text)}, "finish_reason": r.finish_reason, "logprobs": None}
                for i, r in enumerate(rows)
            ]
            return {"id": completion_id, "object": "chat.completion", "created": created, "model": model_name, "choices": choices, "usage": usage(rows)}

        def chunk(choices, **extra):
            return sse({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_name, "choices": choices, **extra})

        async def stream():
            try:
                async with aclosing(generation_events(pool, request, prompt, params)) as events:
                    async for event in events:
                        kind = event[0]
                        if kind == "worker":
                            # the first chunk of every choice carries the role, as OpenAI's does
                            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(n)])
                        elif kind == "delta":
                            yield chunk([{"index": event[1], "delta": {"content": event[2]}, "finish_reason": None}])
                        elif kind == "finish":
                            yield chunk([{"index": event[1], "delta": {}, "finish_reason": event[2]}])
                        elif kind == "error":
                            yield sse({"error": {"message": event[1], "type": "server_error", "param": None, "code": "generation_failed"}})
                        elif kind == "done" and params["include_usage"]:
                            yield chunk([], usage=usage(event[1]))
                yield "data: [DONE]\n\n"
            except Exception as e:
                logger.exception("OpenAI stream failed")
                yield sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error", "param": None, "code": None}})

        return AdmittedStream(stream(), release, media_type="text/event-stream", headers=SSE_HEADERS)

    # --- Monitoring

    @app.get("/health")
    async def health():
        pool = state["pool"]
        workers = pool.workers if pool else []
        return {
            "status": "ok" if pool else "starting",
            "ready": pool is not None,
            "num_gpus": sum(1 for w in workers if w.device.type == "cuda"),
            "num_workers": len(workers),
            "available_workers": pool.available() if pool else 0,
        }

    @app.get("/stats")
    async def stats():
        pool = state["pool"]
        workers = pool.workers if pool else []
        busy = sum(1 for w in workers if w.busy)
        return {
            "total_workers": len(workers),
            "available_workers": pool.available() if pool else 0,
            "busy_workers": busy,
            "queued_requests": pool.queued() if pool else 0,
            "workers": [w.stats() for w in workers],
        }

    return app


# -----------------------------------------------------------------------------
# Command line


def build_arg_parser():
    from nanochat.attention import attn_flag
    from nanochat.checkpoint_manager import checkpoint_flags
    from nanochat.common import device_type_flag
    from nanochat.configurator import Flag, Flags

    return Flags(
        "model",
        checkpoint_flags("sft"),
        Flag("num_gpus", 1, "model replicas, one per GPU (1 on CPU/MPS)", short="n"),
        device_type_flag(),
        Flag("dtype", "bfloat16", "autocast dtype on CUDA", choices=["bfloat16", "float32"]),
        attn_flag(),
        decode_compile_flag(),
        "generation defaults (when a request sends none)",
        Flag("temperature", 0.8, "sampling temperature", short="t"),
        Flag("top_k", 50, "sample among the k most likely tokens (0 = off)", short="k"),
        Flag("max_tokens", 512, "max new tokens", short="m"),
        "server",
        Flag("port", 8000, "TCP port", short="p"),
        Flag("host", "127.0.0.1", "127.0.0.1 listens only locally; 0.0.0.0 on every interface (then set an API key)"),
        Flag("cors_origins", "", "comma-separated browser origins allowed to call the API, e.g. https://a,https://b "
             "(empty: none; * for any)"),
        Flag("max_queue", 64, "requests that may wait while every worker is busy; more get 429 + Retry-After"),
        Flag("api_key", None, "require `Authorization: Bearer KEY` on every generation endpoint; auto = "
             "$NANOCHAT_API_KEY (a flag is visible in ps: prefer the env or --api_key_file)", type=str),
        Flag("api_key_file", None, "read the API key from this file (its first line), so it shows in neither ps nor "
             "the environment", type=str),
        Flag("model_name", "nanochat", "the model id served on /v1 (clients send it as `model`)"),
        description=__doc__,
    )


def check_args(args):
    """Flag values the server cannot honour: a message saying what to change."""
    errors = []
    if not MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE:
        errors.append(f"--temperature must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
    if not MIN_TOP_K <= args.top_k <= MAX_TOP_K:
        errors.append(f"--top_k must be in [{MIN_TOP_K}, {MAX_TOP_K}]")
    if not MIN_MAX_TOKENS <= args.max_tokens <= MAX_MAX_TOKENS:
        errors.append(f"--max_tokens must be in [{MIN_MAX_TOKENS}, {MAX_MAX_TOKENS}]")
    if args.max_queue < 0:
        errors.append("--max_queue must be >= 0 (0: refuse every request that finds all workers busy)")
    if args.num_gpus < 1:
        errors.append("--num_gpus must be >= 1")
    if not 0 < args.port < 65536:
        errors.append("--port must be in 1..65535")
    return errors


def resolve_api_key(flag_value, key_file=None):
    """--api_key, else the first line of --api_key_file, else $NANOCHAT_API_KEY; empty means no key."""
    if flag_value is not None and key_file is not None:
        raise ValueError("--api_key and --api_key_file both given: pass one")
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"--api_key_file={key_file}: cannot read it ({e.strerror})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ValueError(f"--api_key_file={key_file} is empty; put the key on its first line")
        return key
    key = flag_value if flag_value is not None else os.environ.get("NANOCHAT_API_KEY", "")
    return key or None


def exposure_warning(host, api_key):
    """A warning when the server listens beyond this machine with no API key (anyone who can reach it may use it)."""
    if api_key:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if loopback:
        return None
    return f"--host {host} listens beyond this machine, and no API key is set: anyone who can reach it can generate. Set NANOCHAT_API_KEY or --api_key_file, or use --host 127.0.0.1"


def load_workers(args, device_type):
    """One replica per GPU (loaded one after another), or a single one on CPU/MPS."""
    from nanochat.checkpoint_manager import load_model

    if device_type == "cuda":
        devices = [torch.device("cuda", i) for i in range(args.num_gpus)]
    else:
        devices = [torch.device(device_type)]
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    workers = []
    for gpu_id, device in enumerate(devices):
        logger.info(f"loading {args.source} model on {device}")
        model, tokenizer, _ = load_model(args.source, device, phase="eval", model_tag=args.model_tag, step=args.step)
        logger.info(f"attention: {model.set_attn(args.attn).describe()}")
        engine = Engine(model, tokenizer, args.decode_compile)
        logger.info(f"decode step: {'compiled' if engine.decode_compiled else 'eager'}")
        workers.append(Worker(engine, gpu_id=gpu_id, device=device, dtype=dtype))
    return workers


def main(argv=None):
    from nanochat.common import autodetect_device_type

    parser = build_arg_parser()
    args = parser.parse_args(argv)
    errors = check_args(args)
    device_type = args.device_type or autodetect_device_type()
    if device_type not in ("cuda", "cpu", "mps"):
        errors.append(f"--device_type must be cuda, cpu or mps, got {device_type!r}")
    elif device_type == "cuda":
        if not torch.cuda.is_available():
            errors.append("--device_type=cuda but torch sees no CUDA device; use --device_type=cpu")
        elif args.num_gpus > torch.cuda.device_count():
            errors.append(f"--num_gpus={args.num_gpus} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif args.num_gpus != 1:
        errors.append(f"--num_gpus={args.num_gpus} needs CUDA; on {device_type} the server runs one replica (drop -n)")
    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
    except ValueError as e:
        errors.append(str(e))
    if errors:
        parser.error("; ".join(errors))
    origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()]

    workers = load_workers(args, device_type)  # before serving: a missing checkpoint stops here with its message
    app = create_app(
        workers,
        model_name=args.model_name,
        api_key=api_key,
        cors_origins=origins,
        max_queue=args.max_queue,
        temperature=args.temperature,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
    )
    import uvicorn

    warning = exposure_warning(args.host, api_key)
    if warning:
        logger.warning(warning)
    logger.info(f"chat UI at http://{args.host}:{args.port}/  OpenAI API at http://{args.host}:{args.port}/v1" + (" (API key required)" if api_key else ""))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
