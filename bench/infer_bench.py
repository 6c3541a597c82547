"""
Inference benchmark: the Engine's prefill and decode speed and time to first token, and the chat server's
throughput under concurrent streaming load.

    python -m bench.infer_bench                                   # CPU: d4 and d6, batch 1 and 8, then the server
    python -m bench.infer_bench --device_type=cuda --depths=20    # one GPU (bf16 autocast), d20
    python -m bench.infer_bench --skip_server                     # engine only
    python -m bench.infer_bench --depths=4 --skip_server --decode_compile=0,1 --threads=1   # eager vs compiled decode

Models are random-init (speed does not depend on the weights' values) with nanochat's shapes for each depth, held in
the dtype the chat scripts load them in (--weights_dtype=auto: bf16 on CUDA, fp32 elsewhere; the same loader code,
nanochat.checkpoint_manager.model_from_state_dict) and run under the same bf16 autocast on CUDA. The tokenizer is
trained on ../shared/data WikiText-2 at --vocab_size (or --tokenizer=base_dir uses $NANOCHAT_BASE_DIR/tokenizer).
Prints each engine row as it finishes and a markdown section ready for docs/benchmarks.md at the end; --json_out is
rewritten after every row, so a run stopped by a time limit (SIGINT) keeps every finished row.

What is measured (median of --repeats runs after one warm-up):
- TTFT: from calling Engine.generate to its first token column (batch-1 prefill of the prompt + copying the cache
  into the batch rows + sampling).
- prefill tok/s: prompt tokens / prefill forward time (one batch-1 forward with a KV cache).
- decode tok/s: tokens produced by all rows / time of the steps after the first (each step one forward of B tokens).
- the bandwidth bound: B x peak memory bandwidth / the bytes of weights a decode step reads (decode_bytes: every
  parameter in its dtype, but of an embedding table only the B rows looked up; the KV cache is not counted, so it is
  an upper bound). Also per row: the SDPA kernel torch dispatches the step's attention to, and inductor's CUDA-graph
  skips ("skipping cudagraphs": a graphed step that silently is not one).
- server: uvicorn on 127.0.0.1 in this process, one worker, --server_concurrency clients streaming
  --server_requests requests in all; requests/s, generated tokens/s, per-request latency and time to first token.
"""

import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from bench.rows import cudagraph_skips, exit_now
from nanochat.attention import masked_order, sdpa_kernel_for
from nanochat.checkpoint_manager import WEIGHTS_DTYPES, model_from_state_dict, weights_dtype_for
from nanochat.common import device_type_flag
from nanochat.configurator import Flag, Flags
from nanochat.engine import Engine, KVCache, cache_capacity
from nanochat.gpt import GPT, config_for_depth

WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "pretrain" / "wikitext-2" / "train.txt"


FLAGS = Flags(
    "engine",
    Flag("depths", "4,6", "comma-separated model depths"),
    Flag("batch_sizes", "1,8", "comma-separated num_samples"),
    Flag("prompt_len", 256, "prompt tokens"),
    Flag("gen_tokens", 128, "decode steps per run"),
    Flag("repeats", 3, "timed runs per setting (after one warm-up)"),
    Flag("vocab_size", 8192, "vocabulary of the tokenizer trained on WikiText (--tokenizer=wikitext)"),
    Flag("tokenizer", "wikitext", "wikitext: train one on ../shared/data WikiText-2 at --vocab_size; base_dir: the "
         "one in $NANOCHAT_BASE_DIR/tokenizer; repo_docs: train one on this repo's README and docs (a machine without "
         "../shared, e.g. the GPU box)", choices=["wikitext", "base_dir", "repo_docs"]),
    Flag("model_vocab", 0, "the models' vocabulary (0: the tokenizer's); e.g. 65536 for nanochat's d20 lm_head with a "
         "smaller tokenizer (speed depends on the shapes, not on the tokens)"),
    device_type_flag(),
    Flag("threads", 0, "torch CPU threads (0: torch's default)"),
    Flag("decode_compile", "auto", "the Engine's --decode_compile (auto|1|0), or a comma list such as 0,1 to compare "
         "the eager and the compiled (on CUDA: graphed) decode step"),
    Flag("paths", "engine", "engine: Engine.generate, `batch` samples of one prompt; scheduler: the serving Scheduler in "
         "this process, `batch` one-row requests in slots of their own, stepped as chat_web's thread steps it (its "
         "overhead without HTTP; steps overlapped on CUDA); scheduler_serial: the same, one step at a time; a comma "
         "list"),
    Flag("attn", "auto", "attention kernel of the models (nanochat.attention)"),
    Flag("weights_dtype", "auto", "dtype the weights are held in: auto = as the chat scripts load them "
         "(checkpoint_manager.weights_dtype_for: bf16 on CUDA, fp32 elsewhere)", choices=list(WEIGHTS_DTYPES)),
    Flag("peak_bandwidth", 0.0, "memory bandwidth in GB/s for the decode bound (0: the card's data sheet value from "
         "PEAK_BANDWIDTH; none on CPU)"),
    "server (nanochat/serving's app, as scripts.chat_web serves it, in process)",
    Flag("skip_server", False, "skip the server benchmark"),
    Flag("server_depth", 4, "model depth of the served model"),
    Flag("server_requests", 32, "requests sent"),
    Flag("server_concurrency", 8, "requests in flight at once"),
    Flag("server_max_tokens", 32, "max new tokens per request"),
    Flag("json_out", "", "also write the raw numbers to this file (empty: don't)"),
    description=__doc__,
)


# Peak memory bandwidth (bytes/s) by device-name substring, first match wins: the vendors' data sheets.
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
                  ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12)]


def peak_bandwidth_for(name):
    return next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)


def build_arg_parser():
    return FLAGS


def get_tokenizer(args):
    if args.tokenizer == "base_dir":
        from nanochat.tokenizer import get_tokenizer as load

        return load()
    from nanochat.tokenizer import RustBPETokenizer

    if args.tokenizer == "repo_docs":
        repo = Path(__file__).resolve().parents[1]
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))])
        return RustBPETokenizer.train_from_iterator(iter(text.split("\n\n")), min(args.vocab_size, 4096))

    if not WIKITEXT.exists():
        raise SystemExit(f"WikiText-2 not found at {WIKITEXT}; use --tokenizer=base_dir with a trained tokenizer")
    text = WIKITEXT.read_text(encoding="utf-8")[:3_000_000]
    return RustBPETokenizer.train_from_iterator(iter(text.split("\n \n")), args.vocab_size)


def build_model(depth, vocab_size, device, attn="auto", dtype=torch.float32):
    """A random-init model as the chat scripts hold a loaded one: weights cast to `dtype` by the loader's code."""
    config = config_for_depth(depth, vocab_size, sequence_len=2048)
    with torch.device("meta"):
        model = GPT(config, attn=attn)
    model.to_empty(device=device)
    model.init_weights(scheme="nanochat")  # lm_head not zero: sampled tokens vary like a real model's
    if dtype != torch.float32:
        model = model_from_state_dict(model.state_dict(), config, device, dtype)
        model.set_attn(attn)
    model.eval()
    return model


def decode_bytes(model, batch):
    """Bytes of weights one decode step of `batch` rows reads: every parameter once in its own dtype, except the
    embedding tables (wte), of which the step reads the B rows it looks up."""
    total, seen = 0, set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = min(batch, p.size(0)) * p[0].numel() if isinstance(module, nn.Embedding) else p.numel()
            total += n * p.element_size()
    return total


def decode_kernel(model, batch, filled, fixed, dtype, device):
    """The SDPA kernel the decode step's attention dispatches to (torch asked, nothing run): the compiled step attends
    over its whole static cache with the filled slots masked, the eager one over the filled cache, unmasked."""
    c = model.config
    D, slots = c.n_embd // c.n_head, cache_capacity(filled, 1 << 30)
    q = torch.zeros(batch, 1, c.n_head, D, device=device, dtype=dtype).transpose(1, 2)  # as the model makes it
    kv = torch.zeros(batch, c.n_kv_head, slots, D, device=device, dtype=dtype)  # a layer of the cache
    choice = model.attn_choice
    if fixed:
        mask = (torch.arange(slots, device=device) < filled).view(1, 1, 1, -1)
        return sdpa_kernel_for(masked_order(choice.order, device.type), q, kv, kv, attn_mask=mask)
    if choice.name == "flex":
        return "flex"
    return sdpa_kernel_for(choice.order, q, kv[:, :, :filled], kv[:, :, :filled])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def prompt_tokens(tokenizer, n):
    text = WIKITEXT.read_text(encoding="utf-8")[:20_000] if WIKITEXT.exists() else (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8") * 4
    ids = tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())
    if len(ids) < n:
        raise SystemExit(f"benchmark prompt text has only {len(ids)} tokens, --prompt_len={n}")
    return ids[:n]


def bench_engine(engine, tokens, batch, gen_tokens, device, autocast_ctx):
    """One run: (ttft_s, prefill_s, decode_tok_per_s, decode_steps)."""
    model = engine.model
    cfg = model.config
    # prefill alone: the batch-1 forward that generate() starts with
    cache = KVCache(1, cfg.n_kv_head, len(tokens), cfg.n_embd // cfg.n_head, cfg.n_layer)
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    with torch.inference_mode(), autocast_ctx():
        sync(device)
        t0 = time.perf_counter()
        model(ids, kv_cache=cache)
        sync(device)
        prefill_s = time.perf_counter() - t0
    del cache
    # the full generate loop; stop tokens do not end the run early unless every row stops (rare at random init)
    with autocast_ctx():
        sync(device)
        t0 = time.perf_counter()
        steps, t_first = 0, None
        for _ in engine.generate(tokens, num_samples=batch, max_tokens=gen_tokens, temperature=1.0, top_k=50, seed=0):
            steps += 1
            if t_first is None:
                sync(device)
                t_first = time.perf_counter()
        sync(device)
        t_end = time.perf_counter()
    decode_tps = (steps - 1) * batch / (t_end - t_first) if steps > 1 else float("nan")
    return t_first - t0, prefill_s, decode_tps, steps


def bench_scheduler(scheduler, tokens, batch, gen_tokens, device):
    """One run of the serving Scheduler: `batch` requests of one row each (sampled, seeded, no stop tokens), submitted
    at once and stepped to the end; (ttft_s, nan, decode_tok_per_s, decode_steps). Decode counts the steps after
    every request has its first token: all rows decoding, each step one forward plus the sampling of every row."""
    t0 = time.perf_counter()
    requests = [scheduler.submit(tokens, max_tokens=gen_tokens, temperature=1.0, top_k=50, seed=i, stop_tokens=())
                for i in range(batch)]
    while any(r.first_token_at is None for r in requests):
        scheduler.step()
    sync(device)
    t_first, steps0, rows0 = time.perf_counter(), scheduler.decode_steps, scheduler.decoded_rows
    while scheduler.step():
        pass
    sync(device)
    rows, dt = scheduler.decoded_rows - rows0, time.perf_counter() - t_first
    return (min(r.first_token_at for r in requests) - t0, float("nan"), rows / dt if dt > 0 else float("nan"),
            scheduler.decode_steps - steps0)


def measure_engine(args, engine, label, tokens, batch, device, autocast_ctx, weights_dtype, bw, act_dtype,
                   path="engine"):
    """One row: a warm-up run (it compiles), then --repeats timed runs of `batch` rows, on the Engine or (path
    "scheduler") a Scheduler over it, whose warm-up compiles every decode bucket as chat_web's does at start-up."""
    model = engine.model
    skips = cudagraph_skips()
    t0 = time.perf_counter()
    if path.startswith("scheduler"):
        from nanochat.serving.scheduler import Scheduler

        scheduler = Scheduler(engine, max_batch=batch, max_context=len(tokens) + args.gen_tokens + 1, prefix_cache=False,
                              autocast=autocast_ctx, name="bench", overlap=False if path == "scheduler_serial" else None)
        scheduler.warm_up()
        bench_scheduler(scheduler, tokens, batch, min(8, args.gen_tokens), device)  # first prefills, allocations
        run = lambda n: bench_scheduler(scheduler, tokens, batch, n, device)  # noqa: E731
        label = f"{path.replace('_', ' ')}{' (overlapped)' if scheduler.overlap else ''}, {label}"
    else:
        bench_engine(engine, tokens, batch, min(8, args.gen_tokens), device, autocast_ctx)  # warm-up (compiles)
        run = lambda n: bench_engine(engine, tokens, batch, n, device, autocast_ctx)  # noqa: E731
    warm_s = time.perf_counter() - t0
    runs = [run(args.gen_tokens) for _ in range(args.repeats)]
    ttft = statistics.median(r[0] for r in runs)
    prefill = statistics.median(r[1] for r in runs)
    decode = statistics.median(r[2] for r in runs)
    steps = min(r[3] for r in runs)
    step_bytes = decode_bytes(model, batch)  # the memory bound: each step reads these bytes at least
    # the scheduler's step attends over its slots with their columns masked, as the Engine's fixed-shape step does
    kernel = decode_kernel(model, batch, len(tokens) + args.gen_tokens // 2, engine.decode_compiled or path != "engine",
                           act_dtype, device)
    row = dict(depth=model.config.n_layer, params_m=model.num_params() / 1e6, batch=batch, prompt=len(tokens),
               steps=steps, decode=label, warmup_s=warm_s, ttft_ms=ttft * 1e3, prefill_tps=len(tokens) / prefill,
               decode_tps=decode, weights_dtype=str(weights_dtype).removeprefix("torch."), bound_bytes=step_bytes,
               bound_tps=batch * bw / step_bytes if bw else None, attn=model.attn_choice.describe(), sdpa_kernel=kernel,
               cudagraph_skips=cudagraph_skips() - skips)
    return row


def row_line(r):
    """The line printed when a row is kept."""
    if "error" in r:
        return f"d{r['depth']} batch {r['batch']} {r['decode']}: failed ({r['error']})"
    return (f"d{r['depth']} batch {r['batch']} {r['decode']}: TTFT {r['ttft_ms']:.1f} ms, prefill {r['prefill_tps']:.0f} "
            f"tok/s, decode {r['decode_tps']:.0f} tok/s ({r['steps']} steps; warm-up {r['warmup_s']:.1f} s; "
            f"{r['weights_dtype']} weights, attention {r['sdpa_kernel']}"
            + (f"; {r['cudagraph_skips']} cudagraph skip(s)" if r["cudagraph_skips"] else "") + ")")


def run_engine_benchmarks(args, tokenizer, device, autocast_ctx, rows, on_row=lambda rows: None):
    """Append one row per (depth, decode mode, batch) to `rows`, calling on_row(rows) after each."""
    tokens = prompt_tokens(tokenizer, args.prompt_len)
    modes = [m.strip() for m in str(args.decode_compile).split(",") if m.strip()]
    paths = [p.strip() for p in str(args.paths).split(",") if p.strip()]
    if not paths or set(paths) - {"engine", "scheduler", "scheduler_serial"}:
        raise SystemExit(f"--paths takes engine, scheduler and scheduler_serial, got {args.paths!r}")
    weights_dtype = weights_dtype_for(device.type, "eval", args.weights_dtype)
    bw = args.peak_bandwidth * 1e9 or (peak_bandwidth_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    act_dtype = torch.bfloat16 if device.type == "cuda" else weights_dtype  # what attention sees (autocast on CUDA)
    for depth in [int(d) for d in args.depths.split(",")]:
        model = build_model(depth, args.model_vocab or tokenizer.get_vocab_size(), device, args.attn, weights_dtype)
        for mode in modes:
            engine = Engine(model, tokenizer, decode_compile=mode)
            label = "compiled" + (" (CUDA graph)" if device.type == "cuda" else "") if engine.decode_compiled else "eager"
            for path, batch in [(p, int(b)) for p in paths for b in args.batch_sizes.split(",")]:
                try:
                    row = measure_engine(args, engine, label, tokens, batch, device, autocast_ctx, weights_dtype, bw,
                                         act_dtype, path)
                except Exception as e:  # a failing mode or batch is its row: the next ones still run
                    traceback.print_exc()
                    row = dict(depth=depth, batch=batch, decode=label if path == "engine" else f"{path}, {label}",
                               error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                rows.append(row)
                on_row(rows)  # kept (--json_out) before it is printed: a row on the screen is a row in the file
                print(row_line(row), flush=True)
            del engine
        del model
    return rows


def run_server_benchmark(args, tokenizer, device):
    import httpx
    import uvicorn

    from nanochat.serving.app import create_app
    from nanochat.serving.workers import Worker

    model = build_model(args.server_depth, tokenizer.get_vocab_size(), device)
    app = create_app([Worker(Engine(model, tokenizer), device=device)], max_tokens=args.server_max_tokens)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    questions = [f"Tell me something about topic number {i}." for i in range(args.server_requests)]

    async def one(client, sem, q):
        async with sem:
            t0 = time.perf_counter()
            ttft, n_events = None, 0
            body = {"messages": [{"role": "user", "content": q}], "temperature": 1.0, "top_k": 50}
            async with client.stream("POST", "/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith('data: {"token"'):
                        n_events += 1
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    elif line.startswith("data: ") and '"done"' not in line:
                        raise RuntimeError(f"server error: {line}")
            return time.perf_counter() - t0, ttft, n_events

    async def load():
        sem = asyncio.Semaphore(args.server_concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=args.server_concurrency + 4)) as client:
            await one(client, sem, "warm up")
            tokens_before = (await client.get("/stats")).json()["workers"][0]["tokens_generated"]
            t0 = time.perf_counter()
            results = await asyncio.gather(*[one(client, sem, q) for q in questions])
            wall = time.perf_counter() - t0
            tokens_after = (await client.get("/stats")).json()["workers"][0]["tokens_generated"]
        return results, wall, tokens_after - tokens_before

    try:
        results, wall, tokens = asyncio.run(load())
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    lat = sorted(r[0] for r in results)
    ttfts = sorted(r[1] for r in results if r[1] is not None)

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

    row = dict(depth=args.server_depth, requests=len(results), concurrency=args.server_concurrency, max_tokens=args.server_max_tokens,
               wall_s=wall, rps=len(results) / wall, tokens_per_s=tokens / wall, latency_p50_s=pct(lat, 50),
               latency_p95_s=pct(lat, 95), ttft_p50_s=pct(ttfts, 50), ttft_p95_s=pct(ttfts, 95))
    print(f"server d{row['depth']}: {row['rps']:.2f} req/s, {row['tokens_per_s']:.0f} tok/s, latency p50 {row['latency_p50_s']:.2f}s", flush=True)
    return row


def write_json(path, data):
    """Write atomically: a reader (or a time limit) never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def print_section(args, device_type, hw, vocab, engine_rows, server_row):
    print()
    print("## Inference (Engine with KV cache, chat server)")
    print()
    failed = [r for r in engine_rows if "error" in r]
    engine_rows = [r for r in engine_rows if "error" not in r]
    dtypes = sorted({r["weights_dtype"] for r in engine_rows})
    print(f"Device: {device_type} ({hw}); torch {torch.__version__}; random-init models, vocab {vocab}, "
          f"prompt {args.prompt_len} tokens, {args.gen_tokens} decode steps, temperature 1.0, top-k 50; "
          f"median of {args.repeats} runs; {'/'.join(dtypes) or '?'} weights"
          + (", bf16 autocast." if device_type == "cuda" else "."))
    print()
    print("| device | model | params | batch | decode step | attention | TTFT (ms) | prefill tok/s | decode tok/s (all rows) | "
          "of the bandwidth bound | first run (s, incl. compile) |")
    print("|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for r in engine_rows:
        frac = f"{100 * r['decode_tps'] / r['bound_tps']:.0f}% of {r['bound_tps']:,.0f}" if r["bound_tps"] else "n/a"
        print(f"| {hw} | d{r['depth']} | {r['params_m']:.1f}M | {r['batch']} | {r['decode']} | {r['sdpa_kernel']} | "
              f"{r['ttft_ms']:.1f} | {r['prefill_tps']:,.0f} | {r['decode_tps']:,.0f} | {frac} | {r['warmup_s']:.1f} |")
    for r in failed:
        print(f"| {hw} | d{r['depth']} |  | {r['batch']} | {r['decode']} |  | failed: {r['error']} |  |  |  |  |")
    if server_row:
        r = server_row
        print()
        print(f"Server: `nanochat.serving` app under uvicorn on 127.0.0.1 in the benchmark process, 1 worker (d{r['depth']}), "
              f"{r['requests']} streaming requests of up to {r['max_tokens']} tokens from {r['concurrency']} concurrent clients.")
        print()
        print("| requests/s | generated tok/s | latency p50 / p95 (s) | TTFT p50 / p95 (s) |")
        print("|---:|---:|---:|---:|")
        print(f"| {r['rps']:.2f} | {r['tokens_per_s']:.0f} | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} |")


def main(argv=None):
    args = FLAGS.parse_args(argv)
    from nanochat.common import autodetect_device_type

    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    if args.threads:
        torch.set_num_threads(args.threads)
    autocast_ctx = (lambda: torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)) if device_type == "cuda" else nullcontext
    tokenizer = get_tokenizer(args)
    if device_type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        hw = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores visible"
    vocab = args.model_vocab or tokenizer.get_vocab_size()
    engine_rows, server_row = [], None

    def save(interrupted=False):
        if args.json_out:
            write_json(args.json_out, {"engine": engine_rows, "server": server_row, "device": device_type, "hardware": hw,
                                       "prompt": args.prompt_len, "gen_tokens": args.gen_tokens, "interrupted": interrupted})

    try:
        run_engine_benchmarks(args, tokenizer, device, autocast_ctx, engine_rows, on_row=lambda rows: save())
        server_row = None if args.skip_server else run_server_benchmark(args, tokenizer, device)
    except KeyboardInterrupt:  # the suite's time limit (timeout --signal=INT): keep and show what finished
        print(f"interrupted: {len(engine_rows)} engine row(s) finished" + (f", kept in {args.json_out}" if args.json_out else ""),
              file=sys.stderr, flush=True)
        save(interrupted=True)
        print_section(args, device_type, hw, vocab, engine_rows, server_row)
        exit_now(130)
    save()
    print_section(args, device_type, hw, vocab, engine_rows, server_row)


if __name__ == "__main__":
    main()
