"""
The chat server's host ceiling: how many tokens a second chat_web's streaming path can deliver when the model costs
nothing. On a GPU the model's step is the device's work, while everything around it is Python on the host: the
scheduler's bookkeeping per row and per step (on its thread), and per delivery the event loop's (the bridge, the
detokenizer, the JSON event, the socket write). Those two threads share one GIL, so their CPU time per token bounds
the server's tok/s whatever the GPU does; issue 30's d20 goal (>= 10,000 tok/s at 256 streams) needs it under
~100 us a token. This measures it on any machine, without a GPU.

    python -m bench.host_bench                                    # 16, 64, 256 streams
    python -m bench.host_bench --concurrency=256 --json_out=host.json

The server is the real app (nanochat.serving.app.create_app over a BatchingPool: Scheduler, prefix cache, bridge,
SSE) in a subprocess, serving a FreeModel: nanochat's forward API with fixed logits (one text token every step, so
every reply runs to its max_tokens) and no arithmetic, at d20's layer count so that the per-layer bookkeeping of
the prefix cache is d20's. The clients are serve_bench's (closed loops over kept-alive connections, user messages
of --prompt_tokens, replies of --max_tokens: gpu_suite serve's mix). Per level: aggregate tok/s (on a machine with
few cores the clients take CPU from the server: the throughput is then a floor), and the server's CPU time per
generated token, by thread from /proc: the event loop (the process's main thread) and the rest (the scheduler's
thread; torch runs at one thread here). Their sum is the GIL's budget per token.
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.serve_bench import (REPO, free_port, get_tokenizer, lengths, load_level, message_pool, quiet_http_logs,
                               wait_ready)
from nanochat.configurator import Flag, Flags

FLAGS = Flags(
    "load",
    Flag("concurrency", "16,64,256", "closed-loop clients, a comma list of levels"),
    Flag("requests", 512, "requests per level (each client sends its share, at least 2)"),
    Flag("prompt_tokens", "32-1024", "user message lengths in tokens, lo-hi or a comma list (seeded)"),
    Flag("max_tokens", "64-256", "tokens per reply, lo-hi or a comma list (seeded; every reply runs to it)"),
    "server",
    Flag("layers", 20, "layers of the free model (the prefix cache copies each layer's blocks: d20 has 20)"),
    Flag("vocab_size", 8192, "vocabulary of the WikiText tokenizer (the sampling's argmax runs over it)"),
    Flag("max_batch", 256, "the server's --max_batch"),
    Flag("max_context", 1536, "positions per slot"),
    Flag("prefix_cache", True, "the server's prefix cache"),
    "output",
    Flag("json_out", "", "also write the raw numbers here"),
    Flag("serve", "", "internal: serve the free model on this port, with the tokenizer in --tokenizer_dir"),
    Flag("tokenizer_dir", "", "internal: the tokenizer of --serve"),
    description=__doc__,
)


class FreeModel(torch.nn.Module):
    """nanochat's GPT forward API at no cost: keys/values are never written (the slots keep zeros), and every
    position's next token is `token`, from logits built once per shape."""

    def __init__(self, vocab_size, layers, sequence_len, token):
        super().__init__()
        from nanochat.gpt import GPTConfig

        # one KV head of width 2: the pool and the prefix cache have d20's layers but hardly any bytes
        self.config = GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=layers, n_head=1,
                                n_kv_head=1, n_embd=2)
        self.rotary_seq_len = sequence_len
        self.attn_choice = None
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the dtype the scheduler reads from the parameters
        self.token = token
        self.logits = {}

    def get_device(self):
        return torch.device("cpu")

    def forward(self, idx, kv_cache=None):
        # a prefill view reads one position per chunk (`last`); a decode view one per row
        shape = (1, len(getattr(kv_cache, "chunks", [None])), self.config.vocab_size) if hasattr(kv_cache, "last") \
            else (idx.size(0), 1, self.config.vocab_size)
        if shape not in self.logits:
            x = torch.zeros(shape)
            x[..., self.token] = 1.0
            self.logits[shape] = x
        return self.logits[shape]


def serve(args):
    """The server process: chat_web's app over a BatchingPool of one FreeModel worker (as on one GPU: one scheduler
    thread, the event loop on the main thread)."""
    import uvicorn

    from nanochat.engine import Engine
    from nanochat.serving.app import create_app, server_options
    from nanochat.serving.workers import Worker
    from nanochat.tokenizer import RustBPETokenizer

    torch.set_num_threads(1)
    tokenizer = RustBPETokenizer.from_directory(args.tokenizer_dir)
    token = tokenizer.encode(" the")[0]
    model = FreeModel(tokenizer.get_vocab_size(), args.layers, args.max_context, token)
    app = create_app([Worker(Engine(model, tokenizer), threads=1)], max_queue=1024, temperature=0.0,
                     max_batch=args.max_batch, max_context=args.max_context, kv_cache_gb=0.5,
                     prefix_cache=args.prefix_cache, batch_invariant=False)
    uvicorn.run(app, host="127.0.0.1", port=int(args.serve), log_level="warning",
                **server_options(admitted=args.max_batch + 1024))


def thread_cpu(pid):
    """CPU seconds (user + system) of each thread of process `pid`, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # a thread that just ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main(argv=None):
    args = FLAGS.parse_args(argv)
    if args.serve:
        return serve(args)
    quiet_http_logs()
    levels = [int(x) for x in str(args.concurrency).split(",")]
    tokenizer = get_tokenizer(_tokenizer_args(args))
    work = Path(tempfile.mkdtemp(prefix="host_bench_"))
    tokenizer.save(str(work / "tokenizer"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "w")
    cmd = [sys.executable, "-m", "bench.host_bench", f"--serve={port}", f"--tokenizer_dir={work / 'tokenizer'}",
           f"--layers={args.layers}", f"--max_batch={args.max_batch}", f"--max_context={args.max_context}",
           f"--prefix_cache={int(args.prefix_cache)}"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    pool = message_pool(tokenizer, lengths(args.prompt_tokens, 4096, seed=0), seed=0)
    max_tokens = lengths(args.max_tokens, 4096, seed=2)
    rows = []
    try:
        wait_ready(url, proc, 120, "the host_bench server", log.name)
        asyncio.run(load_level(url, 4, pool, 2, max_tokens, first=len(pool) - 8))  # first requests, allocations
        first = 0
        for c in levels:
            per_client = max(2, -(-args.requests // c))
            cpu0, client0 = thread_cpu(proc.pid), time.process_time()
            row = asyncio.run(load_level(url, c, pool, per_client, max_tokens, first))
            cpu1, client1 = thread_cpu(proc.pid), time.process_time()
            first += c * per_client
            used = {tid: t - cpu0.get(tid, 0.0) for tid, t in cpu1.items()}  # (a thread gone since: not counted)
            loop_s = used.pop(proc.pid, 0.0)
            other_s = sum(used.values())
            tokens = row["tokens"]
            row.update(event_loop_cpu_s=loop_s, other_cpu_s=other_s, client_cpu_s=client1 - client0,
                       event_loop_us_per_token=loop_s / tokens * 1e6, other_us_per_token=other_s / tokens * 1e6,
                       tokens_per_chunk=tokens / row["chunks"])
            rows.append(row)
            print(f"c={c:<4} {row['tok_s']:8.0f} tok/s ({row['busy_tok_s']:.0f} all busy)  TTFT p50 "
                  f"{row['ttft_p50_s'] * 1e3:6.0f} p99 {row['ttft_p99_s'] * 1e3:6.0f} ms  ITL p50 "
                  f"{row['itl_p50_s'] * 1e3:5.1f} p99 {row['itl_p99_s'] * 1e3:6.1f} ms  {row['tokens_per_chunk']:.2f} "
                  f"tokens a chunk  server CPU per token: event loop {row['event_loop_us_per_token']:.0f} us, "
                  f"scheduler {row['other_us_per_token']:.0f} us (clients {row['client_cpu_s'] / tokens * 1e6:.0f} "
                  f"us)", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    report(args, rows)


def _tokenizer_args(args):
    """serve_bench's tokenizer flags: the WikiText tokenizer at --vocab_size."""
    from bench.serve_bench import FLAGS as SERVE_FLAGS

    return SERVE_FLAGS.parse_args([f"--vocab_size={args.vocab_size}", "--tokenizer=wikitext"])


def cpu_name():
    """The CPU's model name (the host of a GPU machine is what this measures), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def report(args, rows):
    print(f"\nHost ceiling of chat_web's batching server (bench/host_bench.py): a free model ({args.layers} layers, "
          f"vocab {args.vocab_size}), --max_batch={args.max_batch}, prompts of {args.prompt_tokens} tokens, replies "
          f"of {args.max_tokens}, greedy; {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n")
    print("| streams | tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | tokens a chunk | event loop us/token | "
          "scheduler thread us/token | tokens per server CPU-second |")
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        per_token = r["event_loop_us_per_token"] + r["other_us_per_token"]
        print(f"| {r['concurrency']} | {r['tok_s']:,.0f} | {r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} | "
              f"{r['itl_p50_s'] * 1e3:.1f} / {r['itl_p99_s'] * 1e3:.1f} | {r['tokens_per_chunk']:.2f} | "
              f"{r['event_loop_us_per_token']:.0f} | {r['other_us_per_token']:.0f} | {1e6 / per_token:,.0f} |")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"levels": rows, "cpu": cpu_name(), "cores": os.cpu_count()}, f, indent=2)


if __name__ == "__main__":
    main()
