"""
Engine decode speed of whichever nanochat tree is the current directory (this project or a nanochat checkout), so
bench/side_by_side.sh can time both Engines on the same checkpoint with the same code.

    cd <tree> && NANOCHAT_BASE_DIR=... python /path/to/bench/decode_driver.py --model_tag=d4 --batch_sizes=1,8

It only uses the API both trees share: `nanochat.checkpoint_manager.load_model("base", device, phase="eval",
model_tag=...)` and `nanochat.engine.Engine(model, tokenizer).generate(tokens, num_samples, max_tokens, temperature,
top_k, seed)`. Prints one JSON line per (batch, temperature): decode tok/s = tokens yielded over all rows / time of
the steps after the first (the first step includes the prefill), median of --repeats runs after one warm-up.
Standard library argparse on purpose: this file must run unchanged against another project's tree.
"""

import argparse
import json
import os
import statistics
import sys
import time

# The tree under test is the working directory; put it before any installed/editable nanochat.
sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from nanochat.checkpoint_manager import load_model  # noqa: E402
from nanochat.engine import Engine  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model_tag", default="d4", help="base checkpoint tag under $NANOCHAT_BASE_DIR/base_checkpoints")
    p.add_argument("--batch_sizes", default="1,8", help="comma list of num_samples")
    p.add_argument("--temperatures", default="0,1", help="comma list of sampling temperatures")
    p.add_argument("--prompt_len", type=int, default=32, help="prompt tokens (taken from a fixed text)")
    p.add_argument("--max_tokens", type=int, default=128, help="decode steps per run")
    p.add_argument("--top_k", type=int, default=50, help="top-k for temperature > 0")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting (after one warm-up)")
    args = p.parse_args()

    device = torch.device("cpu")
    model, tokenizer, _ = load_model("base", device, phase="eval", model_tag=args.model_tag)
    engine = Engine(model, tokenizer)
    text = "The history of the city begins with a small settlement on the river, where traders " * 8
    prompt = ([tokenizer.get_bos_token_id()] + tokenizer.encode(text))[: args.prompt_len]

    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for temp in [float(x) for x in args.temperatures.split(",")]:
            rates = []
            for rep in range(args.repeats + 1):
                n_tokens, t_first = 0, None
                for column, _ in engine.generate(prompt, num_samples=b, max_tokens=args.max_tokens,
                                                 temperature=temp, top_k=args.top_k if temp > 0 else None, seed=rep):
                    if t_first is None:
                        t_first = time.perf_counter()
                    else:
                        n_tokens += len(column)
                dt = time.perf_counter() - t_first
                if rep > 0 and n_tokens > 0:
                    rates.append(n_tokens / dt)
            print(json.dumps({"batch": b, "temperature": temp,
                              "decode_tok_s": round(statistics.median(rates), 1) if rates else None,
                              "runs": len(rates)}), flush=True)


if __name__ == "__main__":
    main()
