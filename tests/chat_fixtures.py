"""
Shared helpers for the engine / chat server / chat UI tests: a small real tokenizer trained on a slice of WikiText-2,
tiny random-init GPTs, and an in-process uvicorn server on 127.0.0.1.
"""

import functools
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from nanochat.gpt import GPTConfig

DATA_DIR = Path(__file__).resolve().parent / "assets" / "data"  # excerpts of ../shared/data (tests/assets/README.md)
WIKITEXT_TRAIN = DATA_DIR / "pretrain" / "wikitext-2" / "train.txt"


def wikitext_text(max_chars):
    if not WIKITEXT_TRAIN.exists():
        pytest.skip(f"WikiText-2 not found at {WIKITEXT_TRAIN} (the shared data directory beside the repo)")
    with open(WIKITEXT_TRAIN, "r", encoding="utf-8") as f:
        return f.read(max_chars)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer(vocab_size=512):
    """A real RustBPETokenizer trained on ~200 KB of WikiText-2 (cached for the whole pytest session)."""
    from nanochat.tokenizer import RustBPETokenizer

    text = wikitext_text(200_000)
    lines = [line for line in text.splitlines() if line.strip()]
    return RustBPETokenizer.train_from_iterator(iter(lines), vocab_size)


def tiny_model(vocab_size, depth=2, sequence_len=128, seed=0):
    """
    A random-init GPT. The "normal" init zeroes lm_head and the residual projections (so every logit would be equal
    and attention would not matter); re-draw those so generation depends on the whole context.
    """
    from nanochat.gpt import GPT, config_for_depth

    torch.manual_seed(seed)
    model = GPT(config_for_depth(depth, vocab_size, sequence_len), attn="sdpa")
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight") or name == "lm_head.weight":
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    model.eval()
    return model


def greedy_by_recompute(model, tokens, max_tokens, stops):
    """Reference: re-run the whole sequence for every new token, no cache."""
    seq = list(tokens)
    with torch.inference_mode():
        for _ in range(max_tokens):
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            if nxt in stops:
                break
            seq.append(nxt)
    return seq


class ScriptedModel(torch.nn.Module):
    """
    Stands in for the GPT where a test must decide exactly what the "model" writes. It talks to the KVCache like the
    GPT (inserts keys so positions advance) and puts all the mass of the next token on script[step] (a token id, or
    a tuple of ids sharing the mass equally), `filler` after the script ends; step 0 is the first generated token.
    Records every input it was fed; `delay` seconds per forward imitate a slower model.
    """

    def __init__(self, vocab_size, script, filler, delay=0.0, max_positions=640):
        super().__init__()
        # sequence_len = every position it addresses, so the serving scheduler's slots (max_context) default to it
        self.config = GPTConfig(sequence_len=max_positions, vocab_size=vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=2)
        self.rotary_seq_len = max_positions
        self.script, self.filler, self.delay = script, filler, delay
        self.prompt_len = None
        self.fed = []  # the input ids of every forward

    def get_device(self):
        return torch.device("cpu")

    def forward(self, idx, kv_cache=None):
        B, T = idx.shape
        positions = getattr(kv_cache, "positions", None)  # the serving scheduler's decode step: one per row
        starts = positions[:, 0].tolist() if positions is not None else [kv_cache.get_pos()] * B
        if positions is None and (starts[0] == 0 or hasattr(kv_cache, "last")):
            self.prompt_len = starts[0] + T  # a prefill (after a cached prefix, for the scheduler): generation follows
        self.fed.append(idx.tolist())
        if self.delay:
            time.sleep(self.delay)
        kv_cache.insert_kv(0, torch.zeros(B, 1, T, 2), torch.zeros(B, 1, T, 2))
        logits = torch.full((B, T, self.config.vocab_size), -1e9)
        for b, start in enumerate(starts):
            step = start + T - self.prompt_len
            choice = self.script[step] if 0 <= step < len(self.script) else self.filler
            for c in choice if isinstance(choice, tuple) else (choice,):
                logits[b, -1, c] = 0.0
        return logits


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a background thread (options: more uvicorn settings, e.g.
    nanochat.serving.app.server_options()); use as a context manager."""

    def __init__(self, app, **options):
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
