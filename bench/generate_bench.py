"""
Batched generation for evaluation and RL: chat_eval's generative tasks and chat_rl's rollouts, one prompt at a time
through the Engine (the path before issue 30) against many prompts decoding together through the continuous-batching
scheduler (nanochat/serving/scheduler.py), same model, same run, alternating.

    python -m bench.generate_bench                      # CPU, d4: GSM8K eval (-b 1 vs -b 8), RL rollouts
    python -m bench.generate_bench --device_type=cuda --depth=20 --problems=256 --batch=128

The model is random-init at --depth (nanochat's shapes; speed does not depend on the weights' values; it seldom
writes <|assistant_end|>, so most answers run to --max_new_tokens) with a tokenizer trained on WikiText-2. Questions
are GSM8K's (tests/assets or $NANOCHAT_DATA_DIR). Reported: seconds, speed-up, and whether the two paths agree: at
temperature 0 the same completions (so the same accuracy), sampled rollouts compared on their rewards only.
"""

import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from nanochat.common import device_type_flag
from nanochat.configurator import Flag, Flags
from scripts.chat_eval import FLAGS as EVAL_FLAGS
from scripts.chat_rl import FLAGS as RL_FLAGS

REPO = Path(__file__).resolve().parents[1]

FLAGS = Flags(
    "model",
    Flag("depth", 4, "depth of the random-init model"),
    Flag("vocab_size", 8192, "vocabulary of the tokenizer trained on WikiText-2"),
    device_type_flag(),
    Flag("threads", 0, "torch CPU threads (0: torch's default)"),
    "work",
    Flag("problems", 48, "GSM8K test problems for the eval"),
    Flag("max_new_tokens", 64, "tokens per answer"),
    # the batched paths' sizes default to what chat_eval and chat_rl run with by default
    Flag("batch", EVAL_FLAGS["batch_size"].default, "problems decoded together on chat_eval's batched path (-b)"),
    Flag("rollout_batch", RL_FLAGS["rollout_batch"].default, "sequences decoded together on chat_rl's batched path "
         "(--rollout_batch)"),
    Flag("questions", 8, "GSM8K train questions for the rollouts"),
    Flag("num_samples", RL_FLAGS["num_samples"].default, "samples per question (chat_rl --num_samples)"),
    Flag("device_batch_size", RL_FLAGS["device_batch_size"].default, "samples per Engine call (chat_rl "
         "--device_batch_size)"),
    description=__doc__,
)


def main(argv=None):
    args = FLAGS.parse_args(argv)
    from bench.serve_bench import get_tokenizer
    from nanochat.chat_eval import run_generative_eval
    from nanochat.common import autodetect_device_type
    from nanochat.distributed.dist import DataRanks
    from nanochat.engine import Engine
    from nanochat.gpt import GPT, config_for_depth
    from scripts.chat_rl import rollouts
    from tasks.gsm8k import GSM8K

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device_type or autodetect_device_type())
    autocast = torch.amp.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    os.environ.setdefault("NANOCHAT_DATA_DIR", str(REPO / "tests" / "assets" / "data"))
    args.tokenizer = "wikitext"
    tokenizer = get_tokenizer(args)
    config = config_for_depth(args.depth, tokenizer.get_vocab_size(), 1024)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config, attn="sdpa")
    model.init_weights(scheme="nanochat")
    model.eval()
    engine = Engine(model, tokenizer)
    load_before = os.getloadavg()

    # chat_eval: GSM8K at temperature 0, every completion recorded to compare the two paths
    test = GSM8K("main", "test")
    completions = {"engine": [], "batched": []}
    path = {"now": "engine"}
    real = test.evaluate

    def recording(conv, completion):
        completions[path["now"]].append(completion)
        return real(conv, completion)

    test.evaluate = recording
    rows = []
    for key, b in (("engine", 1), ("batched", args.batch)):
        path["now"] = key
        t0 = time.perf_counter()
        with autocast:
            acc = run_generative_eval(test, tokenizer, model, engine, 1, args.max_new_tokens, 0.0, 50,
                                      max_problems=args.problems, ranks=DataRanks(0, 1), batch_size=b)
        rows.append(("chat_eval GSM8K, greedy", key, b, time.perf_counter() - t0, acc))
    same_eval = sorted(completions["engine"]) == sorted(completions["batched"])

    # chat_rl: rollouts of --questions questions, greedy (must agree) and sampled (speed)
    train = GSM8K("main", "train")
    convs = [train[i] for i in range(args.questions)]
    seeds = list(range(100, 100 + args.questions))
    outs = {}
    for temperature in (0.0, 1.0):
        sampling = dict(max_tokens=args.max_new_tokens, temperature=temperature, top_k=50)
        for key, b in (("engine", 0), ("batched", args.rollout_batch)):
            t0 = time.perf_counter()
            with autocast:
                out = rollouts(engine, tokenizer, train, convs, args.num_samples, args.device_batch_size, seeds, b,
                               **sampling)
            outs[(temperature, key)] = out
            reward = sum(sum(r) for _, _, r in out) / (args.questions * args.num_samples)
            rows.append((f"chat_rl rollouts, temperature {temperature:g}", key, b, time.perf_counter() - t0, reward))
    same_rl = outs[(0.0, "engine")] == outs[(0.0, "batched")]
    load_after = os.getloadavg()

    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()} CPU cores, {torch.get_num_threads()} torch thread(s)"
    print()
    print(f"Batched generation, random-init d{args.depth} (vocab {tokenizer.get_vocab_size()}) on {hw}; "
          f"{args.problems} GSM8K test problems and {args.questions} train questions x {args.num_samples} samples "
          f"(device batch {args.device_batch_size}), up to {args.max_new_tokens} tokens each. Load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after.")
    print()
    print("| work | path | batch | seconds | speed-up | accuracy / mean reward |")
    print("|---|---|---:|---:|---:|---:|")
    base = {}
    for work, key, b, dt, score in rows:
        if key == "engine":
            base[work] = dt
        up = f"{base[work] / dt:.2f}x" if key == "batched" else ""
        print(f"| {work} | {'Engine, one prompt at a time' if key == 'engine' else 'scheduler'} | {b} | {dt:.1f} | "
              f"{up} | {score:.3f} |")
    print()
    print(f"greedy eval completions identical on both paths: {same_eval}; greedy rollouts identical: {same_rl}")


if __name__ == "__main__":
    main()
