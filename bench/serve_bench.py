"""
Serving benchmark: real HTTP clients against `python -m scripts.chat_web`, the continuous-batching server beside the
one-request-per-worker server (--batching=0, the server before issue 30), same model, same run, alternating.

    python -m bench.serve_bench                                      # CPU: d4, concurrency 1,4,16,64, multi-turn
    python -m bench.serve_bench --device_type=cuda --depth=20 --tokenizer=base_dir --concurrency=1,16,64,256 \\
        --baseline_up_to=16 --max_tokens=128                           # one GPU (bench/gpu_suite.sh serve)

The model is random-init at --depth (nanochat's shapes; speed does not depend on the weights' values) saved as an
SFT checkpoint in a temporary base dir, or an existing checkpoint (--source). Each server is a subprocess on a free
local port; the clients are asyncio httpx streams in this process, each a closed loop: send, read the stream to the
end, send the next (--requests_per_client each), prompts of mixed lengths (--prompt_tokens), greedy (or sampled:
--temperature, --top_k, each request its own seed), --max_tokens.

Measured per server and concurrency:
- repeats (--level_repeats): a level that has the baseline runs that many times, new messages each time, the two
  servers back to back within a repeat (who goes first alternates), and its speed-up is the median of the repeats'
  ratios (with their range): a CPU shared with other machines may change speed by tens of percent from one minute to
  the next, and a ratio of two levels a minute apart moves with it; tok/s are the repeats' medians, latencies
  pooled over them;
- aggregate output tok/s: completion tokens (the usage the server reports) / wall time of the level. The level
  ends with a drain: clients whose replies were shorter finish first, and the last ones run with fewer neighbours
  (with 4 requests of 16-80 tokens per client, ~20% of the client-time); so also
- tok/s with every client busy: the tokens the server generated (its /stats counter) from the level's start until
  the first client has received its last reply, over that time: the load of `concurrency` clients, without the drain;
- TTFT: request sent -> first content chunk; ITL: gaps between content chunks (the server sends text every ~20 ms
  at most, WAKE_EVERY_S, and with many streams less often: every streams / CHUNKS_PER_S s, so one chunk may hold
  several tokens: ITL p50 is then the chunking, p99 the stalls);
- the batching server's scheduler per level (/stats): decode steps, their mean rows and time, prompt chunks per
  prefill forward, the share of its busy time outside decode (prefills, admission), its busy share of the level;
- multi-turn (--turns): conversations that resend their history each turn, the reply of turn N in the prompt of
  N+1; TTFT per turn on the batching server with and without its prefix cache (a third server, --prefix_cache=0,
  with the same --max_batch except on a GPU, where its slots are for the conversations only), the median over
  --conversation_rounds rounds of new conversations;
- on CPU (--first_round_floor), the first round of each level without HTTP: the level's first prompts submitted at
  once to a scheduler set up as the batching server's (chat_web's CPU settings, the same flags; its own process, after
  the servers have stopped), the time until the last of them has its first token, median of 3: what the first round's
  TTFT p99 cannot go below on this machine, whatever the server around the scheduler does.
- on CPU (--in_process_ceiling), each level that has the baseline and more than one client without HTTP: its first
  repeat's requests computed in process as each server computes them (the Engine one request after another under
  MKL's default mode; a scheduler set up as the batching server's, the clients' next requests submitted as their
  last ones end), in processes of their own, two of each alternating: the speed-up the arithmetic alone gives, next
  to the one measured over HTTP.
Prints markdown tables for docs/benchmarks.md and the load average; --json_out keeps the raw numbers.
"""

import asyncio
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanochat.common import device_type_flag
from nanochat.configurator import Flag, Flags

REPO = Path(__file__).resolve().parents[1]
# WikiText-2 for the tokenizer and the prompts: the shared data beside the repo (or /work/shared), else the tests' excerpt
TEXTS = [REPO.parent / "shared" / "data" / "pretrain" / "wikitext-2" / "train.txt",
         Path("/work/shared/data/pretrain/wikitext-2/train.txt"),
         REPO / "tests" / "assets" / "data" / "pretrain" / "wikitext-2" / "train.txt", REPO / "README.md"]

FLAGS = Flags(
    "model",
    Flag("depth", 4, "depth of the random-init model"),
    Flag("sequence_len", 1024, "its sequence_len (the servers' --max_context default)"),
    Flag("vocab_size", 8192, "vocabulary of the tokenizer trained on WikiText (--tokenizer=wikitext)"),
    Flag("tokenizer", "wikitext", "wikitext: trained on WikiText-2 at --vocab_size; base_dir: $NANOCHAT_BASE_DIR's; "
         "repo_docs: trained on this repo's docs", choices=["wikitext", "base_dir", "repo_docs"]),
    Flag("train_steps", 200, "train the random-init model this many steps on WikiText-2 first (batch 8 x 128 tokens, "
         "AdamW), so its replies are text whose tokens re-encode the same: a conversation's next turn can then reuse "
         "the reply's cached keys/values, as with a real model (0: keep the random weights)"),
    Flag("source", "", "serve this checkpoint (chat_web's -i, with --model_tag) instead of random weights"),
    Flag("model_tag", "", "its model tag"),
    device_type_flag(),
    "load",
    Flag("concurrency", "1,4,16,64", "closed-loop clients, a comma list of levels"),
    Flag("requests_per_client", 4, "requests each client sends at each level (more at low concurrency: --min_requests)"),
    Flag("min_requests", 12, "requests per level at least (a lone client sends this many)"),
    Flag("prompt_tokens", "8-128", "user message lengths in tokens: lo-hi (uniform) or a comma list (seeded)"),
    Flag("max_tokens", "16-80", "tokens per reply, lo-hi or a comma list (seeded; greedy, a reply may stop earlier "
         "at <|assistant_end|>): varied lengths keep closed-loop clients from arriving in lockstep"),
    Flag("temperature", 0.0, "sampling temperature of the load's requests (0: greedy; chat_web's default is 0.8, "
         "top_k 50): sampled rows cost the server more per step than greedy ones"),
    Flag("top_k", 50, "their top_k when sampling (0: off)"),
    Flag("baseline", True, "also measure the one-request-per-worker server (--batching=0)"),
    Flag("baseline_up_to", 0, "measure the baseline only up to this concurrency (0: every level)"),
    Flag("level_repeats", 3, "repeats of each level that has the baseline (new messages each time, the two servers "
         "back to back within a repeat): its speed-up is the median of the repeats' ratios (1: run it once)"),
    Flag("max_batch", 64, "the batching server's --max_batch"),
    Flag("max_context", None, "the batching servers' --max_context (auto: the model's sequence_len)", type=int),
    Flag("kv_cache_gb", None, "the batching servers' --kv_cache_gb (auto: their default share of the free memory; "
         "set it on a GPU, where the servers share the device)", type=float),
    Flag("decode_compile", "auto", "both servers' --decode_compile"),
    Flag("batch_invariant", "auto", "the batching servers' --batch_invariant (0: decode at exactly the rows running)",
         choices=["auto", "1", "0"]),
    Flag("decode_overlap", "auto", "the batching servers' --decode_overlap", choices=["auto", "1", "0"]),
    Flag("threads", 0, "torch threads of both servers (OMP_NUM_THREADS; 0: torch's default)"),
    Flag("first_round_floor", True, "on CPU, also time each level's first round without HTTP: its prompts submitted at "
         "once to a scheduler set up as the batching server's, in a process of its own (the compute floor of that "
         "round's time to first token)"),
    Flag("in_process_ceiling", True, "on CPU, also compute each level that has the baseline and more than one client "
         "in process, without HTTP, as each server computes it (two processes of each, alternating): the speed-up the "
         "arithmetic alone gives on this machine"),
    "multi-turn",
    Flag("turns", 5, "turns per conversation (0: skip)"),
    Flag("conversations", "1,8", "conversations at once, a comma list"),
    Flag("conversation_rounds", 7, "rounds of each level, new conversations each round and the servers alternating: "
         "TTFT per turn is the median over the conversations of every round (one conversation is one sample a round, "
         "a lone sample on a shared CPU may be off by 2x, and three rounds were still swayed by one slow sample)"),
    Flag("turn_tokens", 100, "tokens per user message"),
    Flag("turn_max_tokens", 64, "tokens per reply"),
    "output",
    Flag("startup_timeout", 300.0, "seconds to wait for a server's /health"),
    Flag("json_out", "", "also write the raw numbers here"),
    Flag("floor", False, "internal: time the first rounds in this process (the model of $NANOCHAT_BASE_DIR) and print "
         "them as JSON"),
    Flag("ceiling", "", "internal: compute the levels in this process as `engine` or `scheduler` does (the model of "
         "$NANOCHAT_BASE_DIR) and print their tok/s as JSON", choices=["", "engine", "scheduler"]),
    Flag("work_dir", "", "keep the random-init model (and the server logs) here, and reuse a model found there "
         "(empty: a new temporary directory)"),
    description=__doc__,
)


# -----------------------------------------------------------------------------
# model, servers


def write_random_checkpoint(args, base_dir):
    """A random-init GPT at --depth and its tokenizer, saved as base_dir's SFT checkpoint (tag serve_bench)."""
    from nanochat.checkpoint_manager import save_checkpoint
    from nanochat.gpt import GPT, config_for_depth

    tokenizer = get_tokenizer(args)
    if args.tokenizer != "base_dir":
        tokenizer.save(str(base_dir / "tokenizer"))
    config = config_for_depth(args.depth, tokenizer.get_vocab_size(), args.sequence_len)
    torch.manual_seed(0)
    device = torch.device(args.device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
    with torch.device(device):
        model = GPT(config, attn="sdpa")
    model.init_weights(scheme="nanochat")  # lm_head not zero, so replies vary like a real model's
    if args.train_steps:
        quick_train(model, tokenizer, args.train_steps, device)
    save_checkpoint(str(base_dir / "chatsft_checkpoints" / "serve_bench"), 1, model.state_dict(), None,
                    {"model_config": vars(config), "step": 1})
    return tokenizer


def get_tokenizer(args):
    from nanochat.tokenizer import RustBPETokenizer

    if args.tokenizer == "base_dir":
        from nanochat.tokenizer import get_tokenizer as load

        return load()
    if args.tokenizer == "repo_docs":
        from bench.infer_bench import get_tokenizer as from_docs

        return from_docs(args)
    path = next(p for p in TEXTS if p.exists())
    text = path.read_text(encoding="utf-8")[:3_000_000]
    return RustBPETokenizer.train_from_iterator(iter(text.split("\n \n")), args.vocab_size)


def quick_train(model, tokenizer, steps, device):
    """A few hundred steps of next-token training on WikiText-2: replies become word-like (and re-encode to the same
    tokens), which is all the benchmark needs of them."""
    path = next(p for p in TEXTS if p.exists())
    ids = torch.tensor(tokenizer.encode(path.read_text(encoding="utf-8")[:2_000_000]), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, T = 8, 128
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - T - 1, (B,), generator=gen).tolist()
        x = torch.stack([ids[i:i + T] for i in starts])
        y = torch.stack([ids[i + 1:i + T + 1] for i in starts])
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"trained {steps} steps in {time.perf_counter() - t0:.0f} s, last loss {loss.item():.2f}", flush=True)
    model.eval()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, timeout, name, log):
    """Until the chat server of subprocess `proc` at `url` says ready on /health; SystemExit (naming `log`) if it
    exits or is not ready within `timeout` s."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).json().get("ready"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} not ready after {timeout:.0f} s; see {log}")


class Server:
    """scripts.chat_web in a subprocess on a free port; its log goes to a file."""

    def __init__(self, name, args, env, extra):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(env["SERVE_BENCH_LOGS"]) / f"{name}.log", "w")
        device = ["--device_type", args.device_type] if args.device_type else []
        cmd = [sys.executable, "-m", "scripts.chat_web", "--port", str(self.port), "-i", args.source or "sft",
               "-g", args.model_tag or "serve_bench", "--max_queue", "1024", "--temperature", "0",
               "--decode_compile", args.decode_compile, *device, *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)

    def wait_ready(self, timeout):
        wait_ready(self.url, self.proc, timeout, f"server {self.name}", self.log.name)

    def stats(self):
        import httpx

        return httpx.get(self.url + "/stats", timeout=10).json()

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# -----------------------------------------------------------------------------
# clients


def lengths(spec, n, seed):
    """n lengths from "lo-hi" (uniform) or "a,b,c" (one of them), seeded."""
    rng = random.Random(seed)
    spec = str(spec)
    if "-" in spec:
        lo, hi = (int(x) for x in spec.split("-"))
        return [rng.randint(lo, hi) for _ in range(n)]
    choices = [int(x) for x in spec.split(",")]
    return [rng.choice(choices) for _ in range(n)]


def extremes(spec):
    """The smallest, middle and largest of a lengths spec ("lo-hi" or "a,b,c")."""
    xs = [int(x) for x in str(spec).replace("-", ",").split(",")]
    return min(xs), (min(xs) + max(xs)) // 2, max(xs)


def message_pool(tokenizer, sizes, seed):
    """A user message of each size in tokens: WikiText excerpts from seeded positions."""
    path = next(p for p in TEXTS if p.exists())
    text = path.read_text(encoding="utf-8")[:400_000]
    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    out = []
    for k in sizes:
        start = rng.randrange(0, len(ids) - k)
        out.append(tokenizer.decode(ids[start:start + k]).strip() or "hello")
    return out


KEEPALIVE_S = 1.0  # a client reuses a connection idle at most this long: well under uvicorn's 5 s keep-alive timeout


def client_limits(connections):
    """httpx limits of the benchmark's clients: connections kept alive between a client's requests, as chat clients
    and SDKs keep them (a new TCP connection per request added ~0.5-1 ms to every time to first token on this CPU).
    A reused connection must not be one the server is closing: it closes one idle for 5 s (uvicorn's
    timeout_keep_alive), and a POST sent on it just then fails (httpx.ReadError, not retried), so the clients drop
    an idle connection after KEEPALIVE_S."""
    import httpx

    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=KEEPALIVE_S)


async def chat(client, messages, max_tokens, sampling=None):
    """One streamed /v1/chat/completions, greedy unless `sampling` (temperature, top_k, seed) says otherwise:
    (ttft_s, [chunk gap s], completion tokens, text, latency_s)."""
    body = {"model": "nanochat", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **(sampling or {})}
    t0 = time.perf_counter()
    arrivals, tokens, text = [], 0, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for choice in obj.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    arrivals.append(time.perf_counter())
                    text.append(piece)
    end = time.perf_counter()
    ttft = arrivals[0] - t0 if arrivals else end - t0
    return ttft, [b - a for a, b in zip(arrivals, arrivals[1:])], tokens, "".join(text), end - t0


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def load_level(url, concurrency, messages, requests_per_client, max_tokens, first=0, sampling=None):
    """`concurrency` closed-loop clients; request r of client c sends message and max_tokens number first + c*R + r
    (each level its own messages: a prompt seen before would be a prefix-cache hit only the batching server gets),
    with `sampling` (chat's) and the request's number as its seed."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=client_limits(concurrency + 8)) as client:
        busy = {}  # the server's token counter and the time when the first client runs out of requests

        async def one_client(c):
            out = []
            for r in range(requests_per_client):
                i = first + c * requests_per_client + r
                seeded = dict(sampling, seed=i) if sampling else None
                out.append((r, *await chat(client, [{"role": "user", "content": messages[i % len(messages)]}],
                                           max_tokens[i % len(max_tokens)], seeded)))
            if not busy:
                busy["at"] = time.perf_counter()
                busy["tokens"] = generated_tokens((await client.get("/stats")).json())
            return out

        tokens0 = generated_tokens((await client.get("/stats")).json())
        t0 = time.perf_counter()
        results = [x for xs in await asyncio.gather(*[one_client(c) for c in range(concurrency)]) for x in xs]
        wall = time.perf_counter() - t0
    tokens = sum(r[3] for r in results)
    chunks = sum(len(r[2]) + 1 for r in results if r[3])  # content chunks: one more than their gaps
    ttfts = [r[1] for r in results]
    later = [r[1] for r in results if r[0] > 0]  # past each client's first request: no longer the start-up burst
    itls, latencies = [g for r in results for g in r[2]], [r[5] for r in results]
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "chunks": chunks, "wall_s": wall,
            "tok_s": tokens / wall, "busy_tok_s": (busy["tokens"] - tokens0) / (busy["at"] - t0),
            "busy_s": busy["at"] - t0, **latency_percentiles(ttfts, later, itls, latencies),
            "ttfts": ttfts, "later_ttfts": later, "itls": itls, "latencies": latencies}


def latency_percentiles(ttfts, later, itls, latencies):
    return {"ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99), "ttft_p99_after_first_s": pct(later, 99),
            "itl_p50_s": pct(itls, 50), "itl_p99_s": pct(itls, 99), "latency_p50_s": pct(latencies, 50)}


SCHEDULER_COUNTERS = ("steps", "decode_steps", "decoded_rows", "busy_s", "decode_s", "prefill_forwards",
                      "prefill_chunks", "prefill_tokens")


def scheduler_counters(stats):
    """The batching server's scheduler counters (every replica's summed) from its /stats; {} for the other server."""
    out = {}
    for w in stats["workers"]:
        for k in SCHEDULER_COUNTERS:
            if k in (w.get("batching") or {}):
                out[k] = out.get(k, 0) + w["batching"][k]
    return out


def generated_tokens(stats):
    """Tokens generated so far by every replica of a chat_web server, from its /stats."""
    return sum(w["tokens_generated"] for w in stats["workers"])


async def conversations(url, n, turns, messages, max_tokens, first=0):
    """n conversations at once, `turns` turns each (messages from number `first` on); TTFT per turn, one list per
    conversation."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=client_limits(n + 8)) as client:
        async def one(c):
            history, ttfts = [], []
            for t in range(turns):
                history.append({"role": "user", "content": messages[(first + c * turns + t) % len(messages)]})
                ttft, _, _, reply, _ = await chat(client, history, max_tokens)
                history.append({"role": "assistant", "content": reply or "ok"})
                ttfts.append(ttft)
            return ttfts

        return await asyncio.gather(*[one(c) for c in range(n)])


def level_plan(args, levels):
    """(concurrency, requests per client, the number of each repeat's first message) of each level, in order: a
    level that has the baseline runs --level_repeats times, the others once; each repeat its own messages (a prompt
    seen before would be a prefix-cache hit only the batching server gets)."""
    plan, first = [], 0
    for c in levels:
        per_client = max(args.requests_per_client, -(-args.min_requests // c))
        repeats = max(1, args.level_repeats) if has_baseline(args, c) else 1
        plan.append((c, per_client, [first + k * c * per_client for k in range(repeats)]))
        first += repeats * c * per_client
    return plan


def has_baseline(args, concurrency):
    return args.baseline and (not args.baseline_up_to or concurrency <= args.baseline_up_to)


def merge_repeats(repeats):
    """One server's rows of one level, a row per repeat -> one row: tok/s the repeats' medians (and each), the latency
    percentiles over every repeat's requests, counts and times summed (the scheduler's counters too)."""
    if len(repeats) == 1:
        return repeats[0]
    row = {"concurrency": repeats[0]["concurrency"], "server": repeats[0]["server"], "repeats": len(repeats)}
    for k in ("tok_s", "busy_tok_s"):
        row[k] = statistics.median(r[k] for r in repeats)
        row[k + "_repeats"] = [r[k] for r in repeats]
    for k in ("requests", "tokens", "chunks", "wall_s", "busy_s"):
        row[k] = sum(r[k] for r in repeats)
    row.update(latency_percentiles(*(sum((r[k] for r in repeats), []) for k in ("ttfts", "later_ttfts", "itls",
                                                                               "latencies"))))
    if all(r.get("scheduler") for r in repeats):
        row["scheduler"] = {k: sum(r["scheduler"][k] for r in repeats) for k in repeats[0]["scheduler"]}
    return row


def describe_speedup(ratios):
    """A level's speed-up: its one ratio, or the median of its repeats' with their range."""
    if not ratios:
        return ""
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}x"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x)"


def speedups(rows, key):
    """{concurrency: [the batching server's `key` over the baseline's in each repeat of the level]}."""
    base = {(r["concurrency"], r.get("repeat", 0)): r[key] for r in rows if r["server"] == "one per worker"}
    out = {}
    for r in rows:
        pair = (r["concurrency"], r.get("repeat", 0))
        if r["server"] == "batching" and pair in base:
            out.setdefault(r["concurrency"], []).append(r[key] / base[pair])
    return out


def cpu_batching_pool(args, engine_of, prefix_cache):
    """In an internal subprocess (CPU): a BatchingPool set up as chat_web's batching server (MKL's strict mode unless
    --batch_invariant=0, its threads, the same --max_batch, --max_context, --kv_cache_gb, --batch_invariant), over
    the engine `engine_of(model)` of the model of $NANOCHAT_BASE_DIR; warm."""
    from nanochat.checkpoint_manager import load_model
    from nanochat.serving.workers import BatchingPool, Worker, prepare_cpu

    invariant = {"auto": None, "1": True, "0": False}[str(args.batch_invariant)]
    threads = prepare_cpu("cpu", invariant is not False)  # before the model's first matmul
    model, _, _ = load_model(args.source or "sft", torch.device("cpu"), phase="eval",
                             model_tag=args.model_tag or "serve_bench")
    budget = int(args.kv_cache_gb * 1024**3) if args.kv_cache_gb else None
    pool = BatchingPool([Worker(engine_of(model), threads=threads)], max_batch=args.max_batch,
                        max_context=args.max_context, kv_budget_bytes=budget, prefix_cache=prefix_cache,
                        batch_invariant=invariant)
    pool.wait_warm()
    return pool


def first_round_floor(args, tokenizer, plan, messages):
    """
    Internal (--floor, a process of its own, CPU): per level of more than one client, its first round (client k's
    first message, number first + k * per_client, in the level's first repeat) rendered as chat_web renders it and
    submitted at once to a scheduler thread set up as chat_web's batching server (MKL's strict mode and its threads,
    the same --max_batch, --max_context, --kv_cache_gb and --batch_invariant; beyond --max_batch the rest queue, as
    in the server); the time from the submissions to the last first token, median of 3 (the prefix cache off, so
    that a repeat is not a cache hit: the round's prompts share no whole block, so it would not hit there either).
    {concurrency: {"s": seconds, "prompt_tokens": the round's}}.
    """
    from nanochat.engine import Engine

    pool = cpu_batching_pool(args, lambda model: Engine(model, tokenizer), prefix_cache=False)
    scheduler = pool.workers[0].scheduler
    floors = {}
    try:
        for c, per_client, (first, *_) in plan:  # the level's first round
            if c < 2:  # a lone client has no round to batch
                continue
            first_messages = [messages[(first + k * per_client) % len(messages)] for k in range(c)]
            prompts = [tokenizer.render_for_completion({"messages": [{"role": "user", "content": m}]}, strict=False)
                       for m in first_messages]
            times = []
            for _ in range(3):
                firsts = {}

                def recorder(k):
                    def on_event(kind, payload):
                        if kind == "tokens" and k not in firsts:
                            firsts[k] = time.perf_counter()
                    return on_event

                t0 = time.perf_counter()
                requests = [scheduler.submit(prompt, max_tokens=1, temperature=0.0, on_event=recorder(k))
                            for k, prompt in enumerate(prompts)]
                for r in requests:
                    r.finished.wait(600)
                if len(firsts) < c:
                    raise RuntimeError(f"{c - len(firsts)} of the first round's {c} requests got no token")
                times.append(max(firsts.values()) - t0)
            floors[c] = {"s": sorted(times)[1], "prompt_tokens": sum(map(len, prompts))}
    finally:
        pool.close()
    return floors


# -----------------------------------------------------------------------------


def quiet_http_logs():
    """httpx logs every request at INFO, and nanochat's logging shows INFO: a line per request would bury the report."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv=None):
    args = FLAGS.parse_args(argv)
    quiet_http_logs()
    levels = [int(x) for x in str(args.concurrency).split(",")]
    if args.floor or args.ceiling:  # the parent's subprocess (run_internal), its NANOCHAT_BASE_DIR the model's
        from nanochat.tokenizer import get_tokenizer as saved_tokenizer

        tokenizer = saved_tokenizer()
        messages = message_pool(tokenizer, lengths(args.prompt_tokens, 2048, seed=0), seed=0)
        plan = level_plan(args, levels)
        print(json.dumps(first_round_floor(args, tokenizer, plan, messages) if args.floor else
                         in_process_load(args, tokenizer, plan, messages, lengths(args.max_tokens, 2048, seed=2),
                                         args.ceiling)))
        return
    sampling = {"temperature": args.temperature, **({"top_k": args.top_k} if args.top_k else {})} \
        if args.temperature > 0 else None
    convs = [int(x) for x in str(args.conversations).split(",")] if args.turns else []
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="serve_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", SERVE_BENCH_LOGS=str(work))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)  # this process trains the model and runs the clients
    if args.source:
        from nanochat.tokenizer import get_tokenizer

        tokenizer = get_tokenizer()
        model_desc = f"checkpoint {args.source} {args.model_tag}"
    else:
        base = Path(os.environ["NANOCHAT_BASE_DIR"]) if args.tokenizer == "base_dir" else work / "base"
        base.mkdir(parents=True, exist_ok=True)
        env["NANOCHAT_BASE_DIR"] = str(base)
        if (base / "chatsft_checkpoints" / "serve_bench").is_dir() and (base / "tokenizer").is_dir():
            from nanochat.tokenizer import RustBPETokenizer

            tokenizer = RustBPETokenizer.from_directory(str(base / "tokenizer"))
            print(f"reusing the model in {base}", flush=True)
        else:
            tokenizer = write_random_checkpoint(args, base)
        model_desc = (f"d{args.depth} (vocab {tokenizer.get_vocab_size()}, sequence_len {args.sequence_len}), random-init"
                      + (f" then {args.train_steps} quick training steps on WikiText-2" if args.train_steps else ""))
    pool = message_pool(tokenizer, lengths(args.prompt_tokens, 2048, seed=0), seed=0)
    max_tokens = lengths(args.max_tokens, 2048, seed=2)
    turn_pool = message_pool(tokenizer, [args.turn_tokens] * 256, seed=1)

    kv = (["--max_context", str(args.max_context)] if args.max_context else []) + \
        (["--kv_cache_gb", str(args.kv_cache_gb)] if args.kv_cache_gb else []) + \
        ["--batch_invariant", str(args.batch_invariant), "--decode_overlap", str(args.decode_overlap)]
    servers = {"batching": Server("batching", args, env, ["--max_batch", str(args.max_batch), *kv])}
    if args.baseline:
        servers["one per worker"] = Server("one_per_worker", args, env, ["--batching", "0"])
    if convs:
        # only the conversations decode there. On a GPU its slots are for those (slots for --max_batch sequences twice
        # over may not fit on one card); elsewhere it gets the batching server's --max_batch: with batch invariance (on
        # CPU) a step computes at the sizes measured for the pool's rows (16-64 rows on docs/benchmarks.md's CPU for 64
        # slots, 8 for 8), so a smaller pool would decode cheaper steps and understate what the prefix cache saves
        from nanochat.common import autodetect_device_type

        rows = max(convs) if (args.device_type or autodetect_device_type()) == "cuda" else args.max_batch
        servers["batching, no prefix cache"] = Server("no_prefix_cache", args, env,
                                                      ["--max_batch", str(rows), "--prefix_cache", "0", *kv])
    load_before = os.getloadavg()
    rows, turns = [], []
    try:
        for s in servers.values():
            s.wait_ready(args.startup_timeout)
        # warm-up, every server at once (compiling is CPU-bound work the host's cores do side by side): first
        # forwards and allocations, and on a GPU the one-request server's compiled step, one graph per cache size
        # (a power of two of prompt + max_tokens), which it would otherwise compile inside the levels' timings:
        # the shortest, middle and longest prompts, each with the shortest and longest reply, two at a time (the
        # batching servers compiled every bucket before they said ready)
        p_lo, p_mid, p_hi = extremes(args.prompt_tokens)
        t_lo, _, t_hi = extremes(args.max_tokens)
        warm_msgs = message_pool(tokenizer, [p_lo, p_lo, p_mid, p_mid, p_hi, p_hi], seed=3)

        async def warm_up():
            await asyncio.gather(*[load_level(s.url, 2, warm_msgs, 3, [t_lo, t_hi]) for s in servers.values()])

        asyncio.run(warm_up())
        for i, (c, per_client, firsts) in enumerate(level_plan(args, levels)):
            names = ["batching"] + (["one per worker"] if has_baseline(args, c) else [])
            for rep, first in enumerate(firsts):
                for name in (names if (i + rep) % 2 == 0 else names[::-1]):  # alternate which server goes first
                    before = scheduler_counters(servers[name].stats())
                    row = asyncio.run(load_level(servers[name].url, c, pool, per_client, max_tokens, first, sampling))
                    after = scheduler_counters(servers[name].stats())
                    row["server"], row["repeat"] = name, rep
                    if after:  # where the batching server's time went in this level
                        row["scheduler"] = {k: after[k] - before.get(k, 0) for k in after}
                    rows.append(row)
                    print(f"{name:>16} c={c:<4} {row['tok_s']:8.1f} tok/s ({row['busy_tok_s']:.1f} all busy)  "
                          f"TTFT p50 {row['ttft_p50_s'] * 1e3:7.1f} ms "
                          f"p99 {row['ttft_p99_s'] * 1e3:7.1f} ms  ITL p50 {row['itl_p50_s'] * 1e3:6.1f} ms "
                          f"p99 {row['itl_p99_s'] * 1e3:6.1f} ms  ({row['requests']} requests, {row['wall_s']:.1f} s"
                          + (f", repeat {rep + 1} of {len(firsts)})" if len(firsts) > 1 else ")"), flush=True)
        rounds = max(1, args.conversation_rounds)
        for i, n in enumerate(convs):
            names, ttfts = ["batching", "batching, no prefix cache"], {}
            for r in range(rounds):  # the same conversations on both servers in a round; who goes first alternates
                first = (sum(convs[:i]) * rounds + r * n) * args.turns
                for name in (names if (i + r) % 2 == 0 else names[::-1]):
                    ttfts.setdefault(name, []).extend(asyncio.run(conversations(
                        servers[name].url, n, args.turns, turn_pool, args.turn_max_tokens, first=first)))
            for name in names:
                per_turn = [pct([t[k] for t in ttfts[name]], 50) for k in range(args.turns)]
                turns.append({"server": name, "conversations": n, "rounds": rounds, "ttft_p50_per_turn_s": per_turn})
                print(f"{name:>26} {n} conversation(s) x {rounds} rounds: TTFT p50 per turn "
                      + " ".join(f"{t * 1e3:.1f}" for t in per_turn) + " ms", flush=True)
        cache = servers["batching"].stats().get("prefix_cache")
    finally:
        for s in servers.values():
            s.close()
    load_after = os.getloadavg()
    floors = first_round_floors(args, argv, env)
    ceilings = in_process_ceilings(args, argv, env)
    report(args, model_desc, rows, turns, cache, load_before, load_after, work, floors, ceilings)


def run_internal(argv, env, flag, what):
    """`python -m bench.serve_bench <argv> <flag>` in a subprocess (a process of its own: MKL's mode is set before a
    process's first matmul, and this one has trained the model) -> the JSON it prints last; None if it failed (said
    on stderr with its error: the report goes on without it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    proc = subprocess.run([sys.executable, "-m", "bench.serve_bench", *argv, flag], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        print(f"{what} failed (exit {proc.returncode}); the report follows without it:\n{proc.stderr[-4000:]}",
              file=sys.stderr, flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_round_floors(args, argv, env):
    """The first rounds' compute floor on CPU (first_round_floor, in a subprocess: run_internal): {concurrency:
    {"s", "prompt_tokens"}}; {} elsewhere, when off, or when it failed (said, with its error: the levels measured so
    far are still reported)."""
    from nanochat.common import autodetect_device_type

    if not args.first_round_floor or (args.device_type or autodetect_device_type()) != "cpu":
        return {}
    found = run_internal(argv, env, "--floor=1", "the first-round floor")
    if found is None:
        return {}
    floors = {int(c): f for c, f in found.items()}
    for c, f in floors.items():
        print(f"first round of {c} clients ({f['prompt_tokens']} prompt tokens) without HTTP: the last first token "
              f"after {f['s'] * 1e3:.1f} ms", flush=True)
    return floors


def in_process_load(args, tokenizer, plan, messages, max_tokens, path):
    """
    Internal (--ceiling, a process of its own, CPU): each level that has the baseline and more than one client, its
    first repeat's requests (load_level's messages and reply lengths) computed in this process without HTTP, as
    `path` computes them: `engine`, one request after another through Engine.generate (the one-request server's
    arithmetic, MKL's default mode); `scheduler`, closed-loop clients on a scheduler thread set up as chat_web's
    batching server (MKL's strict mode and its threads, the same --max_batch, --max_context, --kv_cache_gb,
    --batch_invariant, its prefix cache), each client's next request submitted when its last one ends. Greedy (or
    the load's sampling). {concurrency: {"tok_s", "tokens"}}: the tokens generated (a stop token counted, as both
    paths count it), and over the wall time.
    """
    import queue

    from nanochat.checkpoint_manager import load_model
    from nanochat.engine import Engine

    pool = engine = None
    if path == "scheduler":
        pool = cpu_batching_pool(args, lambda model: Engine(model, tokenizer), prefix_cache=True)
    else:  # MKL left in its default mode, as the one-request server leaves it
        model, _, _ = load_model(args.source or "sft", torch.device("cpu"), phase="eval",
                                 model_tag=args.model_tag or "serve_bench")
        engine = Engine(model, tokenizer)
    sampling = {"temperature": args.temperature, "top_k": args.top_k or None} if args.temperature > 0 else \
        {"temperature": 0.0}
    out = {}
    try:
        for c, per_client, (first, *_) in plan:
            if c < 2 or not has_baseline(args, c):
                continue
            numbers = [[first + k * per_client + r for r in range(per_client)] for k in range(c)]
            prompts = {i: tokenizer.render_for_completion(
                {"messages": [{"role": "user", "content": messages[i % len(messages)]}]}, strict=False)
                for i in sum(numbers, [])}
            tokens, t0 = 0, time.perf_counter()
            if pool is None:
                for i in sum(numbers, []):  # the one-request server's order does not change its arithmetic
                    tokens += sum(1 for _ in engine.generate(prompts[i], max_tokens=max_tokens[i % len(max_tokens)],
                                                             seed=i, **sampling))
            else:
                ended = queue.Queue()
                scheduler = pool.workers[0].scheduler

                def submit(k):  # client k's next request; its end puts k in `ended`
                    def on_event(kind, _):
                        if kind in ("done", "error"):
                            ended.put(k)

                    i = numbers[k].pop(0)
                    return scheduler.submit(prompts[i], max_tokens=max_tokens[i % len(max_tokens)], seed=i,
                                            on_event=on_event, **sampling)

                live = {k: submit(k) for k in range(c)}
                while live:
                    k = ended.get(timeout=600)
                    request = live.pop(k)
                    if request.error:
                        raise RuntimeError(f"a request failed in process: {request.error}")
                    tokens += sum(len(t) for t in request.tokens)
                    if numbers[k]:
                        live[k] = submit(k)
            out[c] = {"tok_s": tokens / (time.perf_counter() - t0), "tokens": tokens}
    finally:
        if pool is not None:
            pool.close()
    return out


def in_process_ceilings(args, argv, env):
    """The levels in process on CPU (in_process_load): engine, scheduler, engine, scheduler, each a subprocess (MKL's
    mode is a process's, set before its first matmul). {concurrency: {"engine": [tok/s], "scheduler": [tok/s],
    "engine_tokens": [...], "scheduler_tokens": [...]}}; {} elsewhere, when off, or when one failed (said on stderr;
    the report goes on without it)."""
    from nanochat.common import autodetect_device_type

    if not args.in_process_ceiling or (args.device_type or autodetect_device_type()) != "cpu":
        return {}
    out = {}
    for path in ("engine", "scheduler") * 2:
        found = run_internal(argv, env, f"--ceiling={path}", f"the in-process ceiling ({path})")
        if found is None:
            return {}
        for c, level in found.items():
            out.setdefault(int(c), {}).setdefault(path, []).append(level["tok_s"])
            out[int(c)].setdefault(path + "_tokens", []).append(level["tokens"])
            print(f"{c} clients in process without HTTP, as the {path} computes them: {level['tok_s']:.1f} tok/s",
                  flush=True)
    return out


def describe_sampling(args):
    if args.temperature <= 0:
        return "greedy"
    return f"temperature {args.temperature}, top_k {args.top_k or 'off'}, a seed per request"


def report(args, model_desc, rows, turns, cache, load_before, load_after, work, floors=None, ceilings=None):
    device = args.device_type or "auto"
    if torch.cuda.is_available() and device in ("cuda", "auto"):
        hw = torch.cuda.get_device_name(0)
    else:
        hw = f"{os.cpu_count()} CPU cores"
    print()
    threads = f"{args.threads} torch thread(s) per server" if args.threads else "torch's default threads"
    print(f"Serving, {model_desc} on {hw}, {threads}; {args.requests_per_client} requests per client (at least "
          f"{args.min_requests} per level), user "
          f"messages of {args.prompt_tokens} tokens, replies of up to {args.max_tokens} tokens, "
          f"{describe_sampling(args)}; batching "
          f"server --batch_invariant={args.batch_invariant} --decode_overlap={args.decode_overlap}. "
          f"Load average {load_before[0]:.1f} before, {load_after[0]:.1f} after. Server logs: {work}")
    print()
    repeats = 1 + max((r.get("repeat", 0) for r in rows), default=0)
    if repeats > 1:
        print(f"Each level with the baseline ran {repeats} times, the two servers back to back each time: its tok/s "
              f"are the medians, its speed-up the median of the {repeats} ratios (their range in brackets), its "
              f"latencies over all its requests.")
        print()
    print("| concurrency | server | aggregate tok/s | speed-up | tok/s, every client busy | speed-up | TTFT p50 / "
          "p99 (ms) | TTFT p99 after the first round (ms) | ITL p50 / p99 (ms) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    per_level = {}
    for r in rows:
        per_level.setdefault((r["concurrency"], r["server"]), []).append(r)
    merged = [merge_repeats(rs) for _, rs in sorted(per_level.items())]
    ups = {k: speedups(rows, k) for k in ("tok_s", "busy_tok_s")}
    for r in merged:
        cells = [describe_speedup(ups[k].get(r["concurrency"])) if r["server"] == "batching" else ""
                 for k in ("tok_s", "busy_tok_s")]
        print(f"| {r['concurrency']} | {r['server']} | {r['tok_s']:,.1f} | {cells[0]} | {r['busy_tok_s']:,.1f} | "
              f"{cells[1]} | {r['ttft_p50_s'] * 1e3:.0f} / "
              f"{r['ttft_p99_s'] * 1e3:.0f} | {r['ttft_p99_after_first_s'] * 1e3:.0f} | {r['itl_p50_s'] * 1e3:.1f} / "
              f"{r['itl_p99_s'] * 1e3:.1f} |")
    sched = [r for r in merged if r.get("scheduler")]
    if sched:
        print("\nThe batching server's scheduler per level (its /stats): decode steps and the mean rows they ran, "
              "their mean time, prompt chunks per prefill forward (packed where not batch-invariant), the share of "
              "its busy time outside decode steps (prefills, admission), and its busy share of the level's wall "
              "time.\n")
        print("| concurrency | decode steps | mean rows | ms / decode step | prefill forwards | chunks / forward | "
              "not decode | busy share |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sched:
            d = r["scheduler"]
            steps, forwards, busy = max(d["decode_steps"], 1), max(d["prefill_forwards"], 1), max(d["busy_s"], 1e-9)
            print(f"| {r['concurrency']} | {d['decode_steps']} | {d['decoded_rows'] / steps:.1f} | "
                  f"{d['decode_s'] / steps * 1e3:.2f} | {d['prefill_forwards']} | "
                  f"{d['prefill_chunks'] / forwards:.1f} | "
                  f"{(d['busy_s'] - d['decode_s']) / busy:.0%} | {d['busy_s'] / r['wall_s']:.0%} |")
    lone = next((r for r in merged if r["server"] == "batching" and r["concurrency"] == 1), None)
    if lone:
        for r in merged:
            if r["server"] == "batching" and r["concurrency"] > 1:
                floor = (floors or {}).get(r["concurrency"])
                print(f"\nbatching, {r['concurrency']} clients: TTFT p99 {r['ttft_p99_s'] / lone['ttft_p50_s']:.1f}x a lone "
                      f"request's ({r['ttft_p99_after_first_s'] / lone['ttft_p50_s']:.1f}x after the first round)"
                      + (f"; its first round's prompts ({floor['prompt_tokens']} tokens) submitted at once without "
                         f"HTTP: the last first token after {floor['s'] * 1e3:.0f} ms, "
                         f"{floor['s'] / lone['ttft_p50_s']:.1f}x" if floor else ""))
    for c, paths in sorted((ceilings or {}).items()):
        ratios = [b / a for a, b in zip(paths["engine"], paths["scheduler"])]
        over_http = ups["tok_s"].get(c)
        print(f"\n{c} clients in process, without HTTP: the scheduler "
              + ", ".join(f"{x:,.0f}" for x in paths["scheduler"]) + " tok/s, the Engine one request at a time "
              + ", ".join(f"{x:,.0f}" for x in paths["engine"]) + f" tok/s: {describe_speedup(ratios)} (pass by pass)"
              + (f", against {describe_speedup(over_http)} over HTTP" if over_http else ""))
    if turns:
        print()
        print(f"Multi-turn: {args.turns} turns, user messages of {args.turn_tokens} tokens, replies of up to "
              f"{args.turn_max_tokens}; TTFT p50 over the conversations of {max(1, args.conversation_rounds)} rounds.")
        print()
        print("| conversations at once | server | " + " | ".join(f"turn {k + 1} (ms)" for k in range(args.turns)) + " |")
        print("|---:|---|" + "---:|" * args.turns)
        for t in turns:
            print(f"| {t['conversations']} | {t['server']} | " + " | ".join(f"{x * 1e3:.1f}" for x in t["ttft_p50_per_turn_s"]) + " |")
        for n in sorted({t["conversations"] for t in turns}):
            on = next(t for t in turns if t["conversations"] == n and t["server"] == "batching")["ttft_p50_per_turn_s"][-1]
            off = next(t for t in turns if t["conversations"] == n and t["server"] != "batching")["ttft_p50_per_turn_s"][-1]
            print(f"\nturn {args.turns}, {n} conversation(s): {off / on:.1f}x lower TTFT with the prefix cache")
    if cache:
        print(f"\nprefix cache of the batching server at the end: hit rate {cache['hit_rate']:.1%} "
              f"({cache['hit_tokens']} of {cache['prompt_tokens']} prompt tokens)")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"model": model_desc, "hardware": hw, "levels": rows,  # a row per server, level and repeat
                       "merged": merged, "speedups": ups, "multi_turn": turns, "prefix_cache": cache,
                       "first_round_floor": floors or {}, "in_process": ceilings or {},
                       "loadavg": [load_before, load_after]}, f, indent=2)


if __name__ == "__main__":
    main()
