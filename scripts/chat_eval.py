"""
Evaluate a chat model on ARC-Easy, ARC-Challenge, MMLU, GSM8K, HumanEval and SpellingBee, and their summary ChatCORE.

    python -m scripts.chat_eval -i sft                          # every task
    python -m scripts.chat_eval -i mid -a "ARC-Easy|GSM8K" -x 100
    torchrun --nproc_per_node=8 -m scripts.chat_eval -i sft     # problems split over 8 GPUs

Categorical tasks (ARC, MMLU) read the model's next-token logits right after <|assistant_start|>, restricted to the
answer letters' tokens, and take the argmax: no sampling, and a small model is not penalised for formatting.
Generative tasks sample num_samples completions with the Engine (tool use included) and count a problem as solved
if any sample is right (pass@num_samples).

ChatCORE is the mean over the six tasks of the centered accuracy (acc - baseline) / (1 - baseline), baseline 0.25
for the 4-way multiple choice tasks and 0 for the generative ones. A task whose data cannot be found is skipped with
a message naming what is missing, and ChatCORE is then marked partial. Under torchrun a task is evaluated only if
every rank found its data (the ranks agree before evaluating it, so their counts are always summed for one task).
"""

import argparse
import contextlib

import torch
import torch.distributed as dist

from nanochat.common import autodetect_device_type, compute_cleanup, compute_init, get_dist_info, print0
from nanochat.configurator import add_dashed_aliases
from nanochat.conversation_data import build_on_every_rank
from tasks.data import TaskDataNotFound

TASK_NAMES = ["ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee"]
BASELINES = {"ARC-Easy": 0.25, "ARC-Challenge": 0.25, "MMLU": 0.25, "GSM8K": 0.0, "HumanEval": 0.0, "SpellingBee": 0.0}


def build_task(name, data_dir=None):
    """The evaluation split of a task (raises TaskDataNotFound if its data is nowhere to be found)."""
    from tasks.arc import ARC
    from tasks.gsm8k import GSM8K
    from tasks.humaneval import HumanEval
    from tasks.mmlu import MMLU
    from tasks.spellingbee import SpellingBee

    builders = {
        "ARC-Easy": lambda: ARC(subset="ARC-Easy", split="test", data_dir=data_dir),
        "ARC-Challenge": lambda: ARC(subset="ARC-Challenge", split="test", data_dir=data_dir),
        "MMLU": lambda: MMLU(subset="all", split="test", data_dir=data_dir),
        "GSM8K": lambda: GSM8K(subset="main", split="test", data_dir=data_dir),
        "HumanEval": lambda: HumanEval(data_dir=data_dir),
        "SpellingBee": lambda: SpellingBee(size=256, split="test", data_dir=data_dir),
    }
    if name not in builders:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)} or all")
    return builders[name]()


def build_task_on_every_rank(name, data_dir=None):
    """build_task, agreed between ranks under torchrun (collective there): every rank gets the task, or every rank
    raises TaskDataNotFound (naming the ranks that lacked the data when only some did)."""
    if name not in TASK_NAMES:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)} or all")
    return build_on_every_rank(name, lambda: build_task(name, data_dir))


def _reduce_counts(passed, total, device):
    counts = torch.tensor([passed, total], dtype=torch.long, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts[0].item(), counts[1].item()


def _letter_token_id(tokenizer, letter, cache):
    if letter not in cache:
        ids = tokenizer.encode(letter)
        if len(ids) != 1:
            raise ValueError(f"answer letter {letter!r} encodes to {len(ids)} tokens; categorical eval needs one")
        cache[letter] = ids[0]
    return cache[letter]


def _max_positions(model):
    """How many positions the model can take (nanochat's GPT: its rotary table, 10x sequence_len), or None."""
    n = getattr(model, "rotary_seq_len", None)
    return int(n) if n is not None else None


@torch.no_grad()
def run_categorical_eval(task, tokenizer, model, batch_size, max_problems=None):
    """Accuracy by letter logits at the position after <|assistant_start|>. Problems are strided over ranks."""
    _, rank, _, world = get_dist_info()
    device = model.get_device()
    bos = tokenizer.get_bos_token_id()
    max_len = _max_positions(model)
    n = len(task) if max_problems is None else min(len(task), max_problems)
    indices = list(range(rank, n, world))
    letter_ids = {}
    passed = total = cropped = 0
    for b in range(0, len(indices), batch_size):
        convs = [task[i] for i in indices[b : b + batch_size]]
        prompts = [tokenizer.render_for_completion(c) for c in convs]
        if max_len is not None and any(len(p) > max_len for p in prompts):
            # a question longer than the model can see keeps its end (choices and <|assistant_start|>)
            cropped += sum(len(p) > max_len for p in prompts)
            prompts = [p[-max_len:] for p in prompts]
        width = max(len(p) for p in prompts)
        # right padding: each prompt's last real position only attends to its own tokens
        ids = torch.full((len(prompts), width), bos, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long, device=device)
        logits = model(ids)
        for i, (conv, p) in enumerate(zip(convs, prompts)):
            letters = conv["letters"]
            cand = torch.tensor([_letter_token_id(tokenizer, x, letter_ids) for x in letters], device=device)
            choice = letters[logits[i, len(p) - 1, cand].argmax().item()]
            passed += int(task.evaluate(conv, choice))
            total += 1
    if cropped:
        print(f"rank {rank}: {cropped} prompt(s) longer than the model's {max_len} positions were cropped from the left")
    passed, total = _reduce_counts(passed, total, device)
    return passed / total if total else float("nan")


def run_generative_eval(task, tokenizer, model, engine, num_samples, max_new_tokens, temperature, top_k,
                        max_problems=None):
    """Fraction of problems where any of num_samples sampled completions is right. Problems are strided over ranks."""
    _, rank, _, world = get_dist_info()
    device = model.get_device()
    max_len = _max_positions(model)
    n = len(task) if max_problems is None else min(len(task), max_problems)
    passed = total = too_long = 0
    for i in range(rank, n, world):
        conv = task[i]
        prompt = tokenizer.render_for_completion(conv)
        if max_len is not None and len(prompt) >= max_len:
            too_long += 1  # no room left to answer: counts as not solved
            total += 1
            continue
        sequences, _ = engine.generate_batch(prompt, num_samples=num_samples, max_tokens=max_new_tokens,
                                             temperature=temperature, top_k=top_k)
        completions = [tokenizer.decode(seq[len(prompt):]) for seq in sequences]
        passed += int(any(task.evaluate(conv, c) for c in completions))
        total += 1
        if rank == 0:
            print(f"\r\033[K{passed}/{total} ({100 * passed / total:.1f}%) on rank 0", end="", flush=True)
    if rank == 0:
        print()
    if too_long:
        print(f"rank {rank}: {too_long} prompt(s) did not fit in the model's {max_len} positions and count as failed")
    passed, total = _reduce_counts(passed, total, device)
    return passed / total if total else float("nan")


def run_chat_eval(task_name, model, tokenizer, engine, batch_size=1, num_samples=1, max_new_tokens=512,
                  temperature=0.0, top_k=50, max_problems=None, data_dir=None, task=None):
    """Accuracy of the model on one task (by name). Used by this script and by chat_sft's periodic evals. Under
    torchrun every rank must call it for the same tasks in the same order (the counts are summed across ranks)."""
    task = task if task is not None else build_task_on_every_rank(task_name, data_dir)
    if task.eval_type == "categorical":
        return run_categorical_eval(task, tokenizer, model, batch_size, max_problems)
    if task.eval_type == "generative":
        return run_generative_eval(task, tokenizer, model, engine, num_samples, max_new_tokens, temperature, top_k,
                                   max_problems)
    raise ValueError(f"task {task_name!r} has unknown eval_type {task.eval_type!r}")


def chatcore(results):
    """(mean centered accuracy over the tasks in results, {task: centered})."""
    centered = {name: (acc - BASELINES[name]) / (1.0 - BASELINES[name]) for name, acc in results.items()}
    return (sum(centered.values()) / len(centered) if centered else float("nan")), centered


def parse_task_names(spec):
    if spec is None or spec == "all":
        return list(TASK_NAMES)
    names = [s.strip() for s in spec.split("|") if s.strip()]
    unknown = [s for s in names if s not in TASK_NAMES]
    if unknown:
        raise SystemExit(f"error: unknown task(s) {unknown}; choose from {', '.join(TASK_NAMES)} or all")
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description="Evaluate a chat model (ARC, MMLU, GSM8K, HumanEval, SpellingBee)")
    parser.add_argument("-i", "--source", type=str, required=True, choices=["base", "mid", "sft", "rl"],
                        help="which checkpoints to load")
    parser.add_argument("-a", "--task_name", type=str, default=None,
                        help="a task, several joined by '|', or all (default): " + ", ".join(TASK_NAMES))
    parser.add_argument("-d", "--dtype", type=str, default="bfloat16", choices=["float32", "bfloat16"],
                        help="autocast dtype on CUDA (CPU always runs float32)")
    parser.add_argument("-t", "--temperature", type=float, default=0.0)
    parser.add_argument("-m", "--max_new_tokens", type=int, default=512)
    parser.add_argument("-n", "--num_samples", type=int, default=1, help="samples per generative problem (pass@n)")
    parser.add_argument("-k", "--top_k", type=int, default=50)
    parser.add_argument("-b", "--batch_size", type=int, default=8, help="batch size of categorical evaluation")
    parser.add_argument("-g", "--model_tag", type=str, default=None)
    parser.add_argument("-s", "--step", type=int, default=None)
    parser.add_argument("-x", "--max_problems", type=int, default=None, help="evaluate at most this many per task")
    parser.add_argument("--device_type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
    parser.add_argument("--data_dir", type=str, default=None, help="local task data dir (default: $NANOCHAT_DATA_DIR)")
    add_dashed_aliases(parser)
    args = parser.parse_args(argv)
    task_names = parse_task_names(args.task_name)

    from nanochat.checkpoint_manager import load_model
    from nanochat.engine import Engine

    device_type = args.device_type or autodetect_device_type()
    ddp, rank, local_rank, world_size, device = compute_init(device_type)
    autocast = (torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
                if device_type == "cuda" and args.dtype == "bfloat16" else contextlib.nullcontext())
    model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=args.model_tag, step=args.step)
    engine = Engine(model, tokenizer)

    results, missing = {}, {}
    for name in task_names:
        try:
            task = build_task_on_every_rank(name, args.data_dir)
        except TaskDataNotFound as e:
            missing[name] = "; ".join(e.looked)
            print0(f"Skipping {name}: {e}")
            continue
        with autocast:
            acc = run_chat_eval(name, model, tokenizer, engine, batch_size=args.batch_size,
                                num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, max_problems=args.max_problems,
                                task=task)
        results[name] = acc
        print0(f"{name} accuracy: {100 * acc:.2f}%")

    summary = {}
    if set(task_names) == set(TASK_NAMES):
        # ChatCORE is defined over all six tasks; a run that asked for fewer gets no ChatCORE at all
        score, _ = chatcore(results)
        if missing:
            summary["ChatCORE metric"] = f"{score:.4f} (partial: {len(results)}/{len(TASK_NAMES)} tasks)"
            summary["Missing tasks"] = [f"{name}: {reason}" for name, reason in missing.items()]
            print0(f"ChatCORE metric: {summary['ChatCORE metric']}; missing: {', '.join(missing)}")
        else:
            summary["ChatCORE metric"] = score
            print0(f"ChatCORE metric: {score:.4f}")
    elif missing:
        summary["Missing tasks"] = [f"{name}: {reason}" for name, reason in missing.items()]

    if rank == 0:
        from nanochat.report import get_report

        get_report().log(section=f"Chat evaluation {args.source}", data=[vars(args), results, summary])
    compute_cleanup()
    return {"results": results, "missing": missing, **summary}


if __name__ == "__main__":
    main()
