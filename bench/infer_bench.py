"""
Inference benchmark: the Engine's prefill and decode speed and time to first token, and the chat server's
throughput under concurrent streaming load.

    python -m bench.infer_bench                                   # CPU: d4 and d6, batch 1 and 8, then the server
    python -m bench.infer_bench --device_type=cuda --depths=20    # one GPU (bf16 autocast), d20
    python -m bench.infer_bench --skip_server                     # engine only
    python -m bench.infer_bench --depths=4 --skip_server --decode_compile=0,1 --threads=1   # eager vs compiled decode

Models are random-init (speed does not depend on the weights' values) with nanochat's shapes for each depth. The
tokenizer is trained on ../shared/data WikiText-2 at --vocab_size (or --tokenizer=base_dir uses
$NANOCHAT_BASE_DIR/tokenizer). Prints a markdown section ready for docs/benchmarks.md.

What is measured (median of --repeats runs after one warm-up):
- TTFT: from calling Engine.generate to its first token column (batch-1 prefill of the prompt + copying the cache
  into the batch rows + sampling).
- prefill tok/s: prompt tokens / prefill forward time (one batch-1 forward with a KV cache).
- decode tok/s: tokens produced by all rows / time of the steps after the first (each step one forward of B tokens).
- server: uvicorn on 127.0.0.1 in this process, one worker, --server_concurrency clients streaming
  --server_requests requests in all; requests/s, generated tokens/s, per-request latency and time to first token.
"""

import asyncio
import json
import os
import platform
import socket
import statistics
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from nanochat.common import device_type_flag
from nanochat.configurator import Flag, Flags
from nanochat.engine import Engine, KVCache
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
    Flag("attn", "auto", "attention kernel of the models (nanochat.attention)"),
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


def build_model(depth, vocab_size, device, attn="auto"):
    config = config_for_depth(depth, vocab_size, sequence_len=2048)
    with torch.device("meta"):
        model = GPT(config, attn=attn)
    model.to_empty(device=device)
    model.init_weights(scheme="nanochat")  # lm_head not zero: sampled tokens vary like a real model's
    model.eval()
    return model


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


def run_engine_benchmarks(args, tokenizer, device, autocast_ctx):
    tokens = prompt_tokens(tokenizer, args.prompt_len)
    rows = []
    modes = [m.strip() for m in str(args.decode_compile).split(",") if m.strip()]
    for depth in [int(d) for d in args.depths.split(",")]:
        model = build_model(depth, args.model_vocab or tokenizer.get_vocab_size(), device, args.attn)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if device.type == "cuda":
            weight_bytes //= 2  # read as bf16 under autocast
        for mode in modes:
            engine = Engine(model, tokenizer, decode_compile=mode)
            label = "compiled" + (" (CUDA graph)" if device.type == "cuda" else "") if engine.decode_compiled else "eager"
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                t0 = time.perf_counter()
                bench_engine(engine, tokens, batch, min(8, args.gen_tokens), device, autocast_ctx)  # warm-up (compiles)
                warm_s = time.perf_counter() - t0
                runs = [bench_engine(engine, tokens, batch, args.gen_tokens, device, autocast_ctx) for _ in range(args.repeats)]
                ttft = statistics.median(r[0] for r in runs)
                prefill = statistics.median(r[1] for r in runs)
                decode = statistics.median(r[2] for r in runs)
                steps = min(r[3] for r in runs)
                # the memory bound: every decode step reads all the weights once (the cache is small next to them)
                bound = None
                if device.type == "cuda":
                    bw = peak_bandwidth_for(torch.cuda.get_device_name(device))
                    bound = batch * bw / weight_bytes if bw else None
                row = dict(depth=depth, params_m=model.num_params() / 1e6, batch=batch, prompt=len(tokens), steps=steps,
                           decode=label, warmup_s=warm_s, ttft_ms=ttft * 1e3, prefill_tps=len(tokens) / prefill,
                           decode_tps=decode, bound_tps=bound)
                rows.append(row)
                print(f"d{depth} batch {batch} {label}: TTFT {row['ttft_ms']:.1f} ms, prefill {row['prefill_tps']:.0f} tok/s, "
                      f"decode {row['decode_tps']:.0f} tok/s ({steps} steps; warm-up {warm_s:.1f} s)", flush=True)
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
    engine_rows = run_engine_benchmarks(args, tokenizer, device, autocast_ctx)
    server_row = None if args.skip_server else run_server_benchmark(args, tokenizer, device)

    print()
    print("## Inference (Engine with KV cache, chat server)")
    print()
    print(f"Device: {device_type} ({hw}); torch {torch.__version__}; random-init models, vocab {args.model_vocab or tokenizer.get_vocab_size()}, "
          f"prompt {args.prompt_len} tokens, {args.gen_tokens} decode steps, temperature 1.0, top-k 50; "
          f"median of {args.repeats} runs." + (" bf16 autocast." if device_type == "cuda" else " fp32."))
    print()
    print("| device | model | params | batch | decode step | TTFT (ms) | prefill tok/s | decode tok/s (all rows) | "
          "of the bandwidth bound | first run (s, incl. compile) |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in engine_rows:
        frac = f"{100 * r['decode_tps'] / r['bound_tps']:.0f}% of {r['bound_tps']:,.0f}" if r["bound_tps"] else "n/a"
        print(f"| {hw} | d{r['depth']} | {r['params_m']:.1f}M | {r['batch']} | {r['decode']} | {r['ttft_ms']:.1f} | "
              f"{r['prefill_tps']:,.0f} | {r['decode_tps']:,.0f} | {frac} | {r['warmup_s']:.1f} |")
    if server_row:
        r = server_row
        print()
        print(f"Server: `nanochat.serving` app under uvicorn on 127.0.0.1 in the benchmark process, 1 worker (d{r['depth']}), "
              f"{r['requests']} streaming requests of up to {r['max_tokens']} tokens from {r['concurrency']} concurrent clients.")
        print()
        print("| requests/s | generated tok/s | latency p50 / p95 (s) | TTFT p50 / p95 (s) |")
        print("|---:|---:|---:|---:|")
        print(f"| {r['rps']:.2f} | {r['tokens_per_s']:.0f} | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} |")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"engine": engine_rows, "server": server_row, "device": device_type, "hardware": hw,
                       "prompt": args.prompt_len, "gen_tokens": args.gen_tokens}, f, indent=2)


if __name__ == "__main__":
    main()
