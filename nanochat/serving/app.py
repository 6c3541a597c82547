"""
The chat server's FastAPI app: the chat page, its streaming endpoint, the OpenAI-compatible API and the monitoring
endpoints, over a pool of replicas (nanochat/serving/workers.py: continuous batching by default, one request per
worker with batching=False) and the generation bridge (nanochat/serving/generation.py).
Request bodies are checked by nanochat/serving/schema.py; prompts are rendered by the tokenizer, the same
render_for_completion that chat_eval and chat_rl use. scripts/chat_web.py loads the workers and runs it under uvicorn.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from nanochat.serving.generation import generation_events
from nanochat.serving.schema import RequestError, read_json_body, shown, validate_openai_request, validate_ui_request
from nanochat.serving.workers import BatchingPool, WorkerPool

logger = logging.getLogger("nanochat.serving")

BODY_READ_TIMEOUT_S = 10.0  # a request body (at most 1 MB) must arrive within this: a stalled client gets a 408
MAX_CONNECTIONS = 256  # open connections (and requests in flight) beyond this get a 503 (uvicorn's limit_concurrency)
CONNECTION_HEADROOM = 64  # connections beyond the requests a server admits: /health, /stats, the page, a 429's retry

UI_PATH = Path(__file__).resolve().parent / "ui.html"


def server_options(max_connections=MAX_CONNECTIONS, admitted=0):
    """uvicorn's settings for this server (chat_web passes them to uvicorn.run; the tests serve with them too). The
    connection cap is at least the requests the pool admits (`admitted`: generating plus queued) and some headroom:
    a request the pool would take must not get a 503 at the socket first (at --max_batch=256 a fixed cap of 256
    refused clients of a 256-client load)."""
    return {"limit_concurrency": max(max_connections, admitted + CONNECTION_HEADROOM) if admitted else max_connections}


def sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def text_delta_event(envelope):
    """f(index, text) -> sse({**envelope, "choices": [{"index": index, "delta": {"content": text}, "finish_reason":
    None}]}), the same string, with only the text dumped each time: a stream's events are mostly text deltas, and
    dumping the whole envelope for each was ~5% of the event loop's time at 256 streams (bench/host_bench.py)."""
    head, _, tail = sse({**envelope, "choices": ["\0"]}).rpartition('"\\u0000"')  # choices comes last

    def event(index, text):
        return f'{head}{{"index": {index}, "delta": {{"content": {json.dumps(text, ensure_ascii=False)}}}, "finish_reason": null}}{tail}'

    return event


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
    body_timeout_s=BODY_READ_TIMEOUT_S,
    batching=True,
    max_batch=64,
    max_context=None,
    kv_cache_gb=None,
    prefix_cache=True,
    batch_invariant=None,
    decode_overlap=None,
):
    """
    The FastAPI app. `workers_or_factory` is a list of Workers, or a callable returning one (called at startup, in a
    thread, e.g. to load checkpoints). api_key: when set, every generation endpoint (/chat/completions, /v1/*) needs
    `Authorization: Bearer <key>`; the page itself, /health and /stats stay open (the page asks for the key), and
    /openapi.json needs the key too. body_timeout_s: how long a request body may take to arrive (then a 408).
    batching: one continuous-batching Scheduler per worker (max_batch sequences together, slots of max_context
    positions, kv_cache_gb of KV memory or a share of the free memory, the prefix cache, batch_invariant: None = on
    CPU, decode_overlap: None = on CUDA, see Scheduler); False: one request per worker at a time (the server before
    continuous batching, kept as the benchmark's baseline).
    """
    defaults = {"temperature": temperature, "top_k": top_k, "max_tokens": max_tokens}
    state = {"pool": None, "started": int(time.time())}
    ui_html = UI_PATH.read_text(encoding="utf-8").replace("__NANOCHAT_DEFAULTS__", json.dumps(defaults))

    @asynccontextmanager
    async def lifespan(app):
        workers = workers_or_factory
        if callable(workers):
            workers = await asyncio.to_thread(workers)
        if batching:
            budget = None if kv_cache_gb is None else int(kv_cache_gb * 2**30)
            pool = await asyncio.to_thread(BatchingPool, workers, max_queue=max_queue, max_batch=max_batch,
                                           max_context=max_context, kv_budget_bytes=budget, prefix_cache=prefix_cache,
                                           batch_invariant=batch_invariant, overlap=decode_overlap)
            await asyncio.to_thread(pool.wait_warm)  # not ready (nor listening) before the decode step is compiled
            for w in workers:  # (after the warm-up: the sizes its thread measured)
                logger.info(f"worker {w.gpu_id}: continuous batching, {w.scheduler.describe()}")
            for w in workers:
                if w.scheduler.compiled:
                    logger.info(f"worker {w.gpu_id}: decode step compiled at every bucket in {w.scheduler.warm_s:.1f} s")
        else:
            pool = WorkerPool(workers, max_queue=max_queue)
        state["pool"] = pool
        logger.info(f"serving {model_name!r} with {len(workers)} worker(s): {', '.join(str(w.device) for w in workers)}")
        yield
        state["pool"] = None
        if batching:
            pool.close()

    # no /docs or /redoc: their pages load Swagger UI from a CDN, and the server must work offline; /openapi.json is
    # served below, behind the key like the endpoints it describes
    app = FastAPI(title="nanochat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
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

    async def read_body(request):
        try:
            return await asyncio.wait_for(read_json_body(request), body_timeout_s)
        except asyncio.TimeoutError:  # (TimeoutError from 3.11 on) e.g. a Content-Length larger than what is sent: do not hold the connection for it
            raise RequestError(f"the request body did not arrive within {body_timeout_s:g} s", status=408, code="request_timeout",
                               headers={"Connection": "close"}) from None

    def checked_prompt(pool, messages):
        # All replicas share the tokenizer: the prompt is rendered (and checked) once, before waiting for a worker.
        engine = pool.workers[0].engine
        # strict=False: clients send user/assistant turns in any order (several user messages in a row, too)
        try:
            prompt = engine.tokenizer.render_for_completion({"messages": messages}, strict=False)
        except (ValueError, TypeError) as e:  # the schema lets through only what renders; this is a last guard
            raise RequestError(f"messages: {e}", "messages") from None
        limit = pool.max_context() if isinstance(pool, BatchingPool) else engine.max_positions()
        if len(prompt) >= limit:
            raise RequestError(f"the conversation is {len(prompt)} tokens; this server handles at most {limit - 1} of prompt. Start a new conversation or shorten it")
        return prompt

    # --- UI

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        check_api_key(request)
        return JSONResponse(app.openapi())

    @app.get("/")
    async def root():
        return HTMLResponse(ui_html)

    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        check_api_key(request)  # before the body is read: a client without the key cannot make us buffer a megabyte
        pool = pool_or_503()
        params = validate_ui_request(await read_body(request), defaults)
        prompt = checked_prompt(pool, params["messages"])
        release = pool.admit()

        async def stream():
            gpu = None
            try:
                async with aclosing(generation_events(pool, request, prompt, params, streaming=True)) as events:
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
        params = validate_openai_request(await read_body(request), defaults, model_name)
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

        text_delta = text_delta_event({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_name})

        async def stream():
            try:
                async with aclosing(generation_events(pool, request, prompt, params, streaming=True)) as events:
                    async for event in events:
                        kind = event[0]
                        if kind == "worker":
                            # the first chunk of every choice carries the role, as OpenAI's does
                            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(n)])
                        elif kind == "delta":
                            yield text_delta(event[1], event[2])
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
        per_worker = [w.stats() for w in workers]
        out = {
            "total_workers": len(workers),
            "available_workers": pool.available() if pool else 0,
            "busy_workers": sum(1 for w in per_worker if w["busy"]),
            "queued_requests": pool.queued() if pool else 0,
            "batching": isinstance(pool, BatchingPool),
            "workers": per_worker,
        }
        caches = [w["batching"]["prefix_cache"] for w in per_worker if (w.get("batching") or {}).get("prefix_cache")]
        if caches:  # over all replicas: the share of prompt tokens served from the prefix cache
            looked, hit = sum(c["prompt_tokens"] for c in caches), sum(c["hit_tokens"] for c in caches)
            out["prefix_cache"] = {"hit_rate": hit / looked if looked else 0.0, "hit_tokens": hit, "prompt_tokens": looked,
                                   "hit_requests": sum(c["hits"] for c in caches), "lookups": sum(c["lookups"] for c in caches),
                                   "resumed": sum(c["resumed"] for c in caches)}
        return out

    return app

