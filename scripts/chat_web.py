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
    GET  /stats                 per-worker busy/idle and counters, the batch, the prefix cache's hit rate

Continuous batching (the default): each replica runs one scheduler (nanochat/serving/scheduler.py) that decodes up
to --max_batch sequences together, whatever request they belong to; a new request joins at the next step, a finished
one leaves at once. Each sequence holds a KV slot of --max_context positions (default the model's sequence_len: the
longest prompt + reply; a reply that reaches it ends with finish_reason "length"); --kv_cache_gb (default a share of
the device's free memory) bounds the slots and the prefix cache, which keeps finished conversations' keys/values so
the next turn of a chat (or a shared system prompt) is not computed again (its hit rate is in /stats). Requests
beyond the batch wait in the scheduler's queue; beyond --max_queue of those the next gets 429 with Retry-After.
--batching=0 serves one request per replica at a time instead (the server before continuous batching: a prompt may
then use every position of the model's rotary table). Generation runs off the event loop (which only moves text); the
text of each row is sent only at UTF-8 character boundaries. When a client goes away its sequences leave the batch at
the next step (or its worker is free again after at most one more forward pass).

This script is the entry point (flags, API key, loading the replicas, uvicorn); the server itself is the library's
nanochat/serving/: app.py (the routes), workers.py (the pool), generation.py (thread -> event loop), schema.py
(what requests may hold) and ui.html (the page).
"""

import errno
import ipaddress
import logging
import os
import socket
from pathlib import Path

import torch

from nanochat.common import autodetect_device_type, setup_default_logging
from nanochat.engine import Engine, decode_compile_flag
from nanochat.serving.app import create_app, server_options
from nanochat.serving.schema import MAX_MAX_TOKENS, MAX_TEMPERATURE, MAX_TOP_K, MIN_MAX_TOKENS, MIN_TEMPERATURE, MIN_TOP_K
from nanochat.serving.workers import Worker, check_kv_plans, prepare_cpu
from nanochat.usage import run_main

setup_default_logging()
logger = logging.getLogger("nanochat.chat_web")


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
        "continuous batching",
        Flag("batching", True, "one scheduler per replica decodes many requests together; 0 = one request per replica"),
        Flag("max_batch", 64, "most sequences a replica decodes together (a request with n samples counts n)"),
        Flag("max_context", None, "KV slot size: the longest prompt + reply; auto = the model's sequence_len", type=int),
        Flag("kv_cache_gb", None, "memory for the KV slots and the prefix cache, per replica; auto = 85% of the GPU's "
             "free memory after loading (25% of available RAM on CPU)", type=float),
        Flag("prefix_cache", True, "keep finished sequences' keys/values for later requests that start the same way"),
        Flag("batch_invariant", "auto", "a request's logits the same bits whatever its neighbours: decode and pack "
             "prompts only at sizes measured to give a row the same bits (on CPU every size, in MKL's strict mode, "
             "which the server then sets), with the invariant attention; auto = on CPU (eager decode); 0 = no such "
             "limits (tokens may then differ in rare near-ties)", choices=["auto", "1", "0"]),
        Flag("decode_overlap", "auto", "launch each decode step before reading the previous one's tokens, so the GPU "
             "does not wait for the host between steps (the same tokens); auto = on CUDA", choices=["auto", "1", "0"]),
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
    if args.max_batch < 1:
        errors.append("--max_batch must be >= 1")
    if args.max_context is not None and args.max_context < 2:
        errors.append("--max_context must be >= 2 (auto: the model's sequence_len)")
    if args.kv_cache_gb is not None and args.kv_cache_gb <= 0:
        errors.append("--kv_cache_gb must be > 0 (auto: a share of the free memory)")
    if args.num_gpus < 1:
        errors.append("--num_gpus must be >= 1")
    if not 0 < args.port < 65536:
        errors.append("--port must be in 1..65535")
    return errors


def port_problems(host, port):
    """The start-up check of --host/--port, before any model loads: the address can be bound now (uvicorn binds it the
    same way, SO_REUSEADDR, once the replicas are loaded). [] or the sentence saying why not."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # IPv4 or IPv6, as --host is
        with socket.create_server((host, port), family=family):
            return []
    except OSError as e:
        why = "another process listens there" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        return [f"cannot listen on {host}:{port} ({why}): stop what uses it or pass another --port (or --host)"]


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


def load_workers(args, device_type, threads=None):
    """One replica per GPU (loaded one after another), or a single one on CPU/MPS (threads: Worker.threads)."""
    from nanochat.checkpoint_manager import load_model

    if device_type == "cuda":
        devices = [torch.device("cuda", i) for i in range(args.num_gpus)]
    else:
        devices = [torch.device(device_type)]
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    workers = []
    for gpu_id, device in enumerate(devices):
        logger.info(f"loading {args.source} model on {device}")
        model, tokenizer, _ = load_model(args.source, device, phase="eval", model_tag=args.model_tag, step=args.step,
                                      weights_dtype=args.weights_dtype)
        logger.info(f"attention: {model.set_attn(args.attn).describe()}")
        engine = Engine(model, tokenizer, args.decode_compile)
        logger.info(f"decode step: {'compiled' if engine.decode_compiled else 'eager'}")
        workers.append(Worker(engine, gpu_id=gpu_id, device=device, dtype=dtype, threads=threads))
    return workers


def main(argv=None):
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
    if not errors:
        errors += port_problems(args.host, args.port)
    if errors:
        parser.error("; ".join(errors))
    origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()]

    # before any matmul: MKL's strict mode for batch invariance; this thread serves HTTP, the workers' threads compute
    threads = prepare_cpu(device_type, args.batching and args.batch_invariant != "0")
    workers = load_workers(args, device_type, threads)  # before serving: a missing checkpoint stops here, saying so
    if args.batching:  # and a KV cache that cannot fit, with the setting to change
        check_kv_plans(workers, args.max_batch, args.max_context, args.kv_cache_gb, args.prefix_cache)
    app = create_app(
        workers,
        model_name=args.model_name,
        api_key=api_key,
        cors_origins=origins,
        max_queue=args.max_queue,
        temperature=args.temperature,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        batching=args.batching,
        max_batch=args.max_batch,
        max_context=args.max_context,
        kv_cache_gb=args.kv_cache_gb,
        prefix_cache=args.prefix_cache,
        batch_invariant={"auto": None, "1": True, "0": False}[str(args.batch_invariant)],
        decode_overlap={"auto": None, "1": True, "0": False}[str(args.decode_overlap)],
    )
    import uvicorn

    warning = exposure_warning(args.host, api_key)
    if warning:
        logger.warning(warning)
    logger.info(f"chat UI at http://{args.host}:{args.port}/  OpenAI API at http://{args.host}:{args.port}/v1" + (" (API key required)" if api_key else ""))
    admitted = len(workers) * (args.max_batch if args.batching else 1) + args.max_queue  # generating + waiting
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", **server_options(admitted=admitted))


if __name__ == "__main__":
    run_main(main)  # a usage error (a missing checkpoint...): one line, exit 2 (nanochat/usage.py)
