"""
Chat evaluation: a chat model's accuracy on a task, and ChatCORE, the summary over the six chat tasks.

Categorical tasks (ARC, MMLU) read the model's next-token logits right after <|assistant_start|>, restricted to the
answer letters' tokens, and take the argmax: no sampling, and a small model is not penalised for formatting.
Generative tasks sample num_samples completions (tool use included) and count a problem as solved if any sample is
right (pass@num_samples): one problem at a time with the Engine, or with batch_size > 1 many problems decoding
together through the continuous-batching scheduler (nanochat/serving/scheduler.py). Problems are strided over the
ranks and the counts summed.

ChatCORE is the mean over the six tasks of the centered accuracy (acc - baseline) / (1 - baseline), baseline 0.25
for the 4-way multiple choice tasks and 0 for the generative ones.

The tasks themselves (which split, which data) are built in tasks/suites.py; the command is scripts/chat_eval.py.
"""

import torch
import torch.distributed as dist

TASK_NAMES = ["ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee"]
BASELINES = {"ARC-Easy": 0.25, "ARC-Challenge": 0.25, "MMLU": 0.25, "GSM8K": 0.0, "HumanEval": 0.0, "SpellingBee": 0.0}


def _reduce_counts(passed, total, device, ranks):
    if ranks.tp_rank != 0:
        passed = total = 0  # a tensor-parallel group's tp ranks ran the same problems: count them once
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
def run_categorical_eval(task, tokenizer, model, batch_size, max_problems=None, lockstep=False, *, ranks):
    """
    Accuracy by letter logits at the position after <|assistant_start|>. Problems are strided over data ranks
    (`ranks`, DataRanks: the plan's under TP, where the tp ranks of a group run the same problems).
    lockstep: every rank runs the same number of forwards, for a model whose forward is a collective (FSDP, TP): a
    rank with fewer problems than data rank 0 runs one-token forwards whose output it ignores.
    """
    rank, world = ranks.rank, ranks.world
    device = model.get_device()
    bos = tokenizer.get_bos_token_id()
    max_len = _max_positions(model)
    n = len(task) if max_problems is None else min(len(task), max_problems)
    indices = list(range(rank, n, world))
    most = len(range(0, n, world)) if lockstep else len(indices)  # data rank 0 has the most problems
    letter_ids = {}
    passed = total = cropped = 0
    for b in range(0, most, batch_size):
        if b >= len(indices):
            model(torch.full((1, 1), bos, dtype=torch.long, device=device))  # this rank's part in the collective
            continue
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
    passed, total = _reduce_counts(passed, total, device, ranks)
    return passed / total if total else float("nan")


def run_generative_eval(task, tokenizer, model, engine, num_samples, max_new_tokens, temperature, top_k,
                        max_problems=None, *, ranks, batch_size=1):
    """
    Fraction of problems where any of num_samples sampled completions is right. Problems are strided over data
    ranks (`ranks`, DataRanks).
    batch_size > 1: this rank's problems go through the continuous-batching scheduler (nanochat/serving/scheduler.py)
    with up to batch_size sequences decoding together, whatever problem they belong to; each problem keeps the
    Engine's seed, so at temperature 0 the answers are the ones of one problem at a time (up to float rounding:
    the batched decode step rounds differently from the Engine's batch-1 step).
    """
    rank, world = ranks.rank, ranks.world
    device = model.get_device()
    max_len = _max_positions(model)
    n = len(task) if max_problems is None else min(len(task), max_problems)
    passed = total = too_long = 0
    problems = []  # (conversation, prompt) of the problems that leave room to answer
    for i in range(rank, n, world):
        conv = task[i]
        prompt = tokenizer.render_for_completion(conv)
        if max_len is not None and len(prompt) >= max_len:
            too_long += 1  # no room left to answer: counts as not solved
            total += 1
            continue
        problems.append((conv, prompt))

    def grade(conv, prompt, sequences):
        nonlocal passed, total
        completions = [tokenizer.decode(seq[len(prompt):]) for seq in sequences]
        passed += int(any(task.evaluate(conv, c) for c in completions))
        total += 1
        if rank == 0:
            print(f"\r\033[K{passed}/{total} ({100 * passed / total:.1f}%) on rank 0", end="", flush=True)

    sampling = dict(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k)
    if batch_size > 1 and problems:
        from nanochat.serving.scheduler import Job, generate_many

        jobs = [Job(prompt, num_samples=num_samples, **sampling) for _, prompt in problems]
        generate_many(engine, jobs, max_batch=batch_size, prefix_cache=False,
                      on_finish=lambda i, sequences, _: grade(*problems[i], sequences))
    else:
        for conv, prompt in problems:
            sequences, _ = engine.generate_batch(prompt, num_samples=num_samples, **sampling)
            grade(conv, prompt, sequences)
    if rank == 0:
        print()
    if too_long:
        print(f"rank {rank}: {too_long} prompt(s) did not fit in the model's {max_len} positions and count as failed")
    passed, total = _reduce_counts(passed, total, device, ranks)
    return passed / total if total else float("nan")


def evaluate_task(task, model, tokenizer, engine, batch_size=1, num_samples=1, max_new_tokens=512,
                  temperature=0.0, top_k=50, max_problems=None, lockstep=False, *, ranks):
    """Accuracy of the model on one task, by the task's eval_type. Used by scripts.chat_eval and by chat_sft's periodic
    evals. Under torchrun every rank must call it for the same tasks in the same order (the counts are summed across
    ranks). lockstep: the model's forward is a collective (FSDP, TP; see run_categorical_eval). ranks: how problems are
    split (DataRanks: the parallel plan's `data_ranks` in training, dist.process_data_ranks() in a script without
    tensor parallelism); required, as the process's rank is the wrong split under TP."""
    if task.eval_type == "categorical":
        return run_categorical_eval(task, tokenizer, model, batch_size, max_problems, lockstep, ranks=ranks)
    if lockstep:
        raise ValueError(f"{type(task).__name__} is generative: its samples stop at different lengths on each rank, so "
                         f"it cannot run on a model whose forward is a collective (FSDP, TP); evaluate the saved "
                         f"model with scripts.chat_eval")
    if task.eval_type == "generative":
        return run_generative_eval(task, tokenizer, model, engine, num_samples, max_new_tokens, temperature, top_k,
                                   max_problems, ranks=ranks, batch_size=batch_size)
    raise ValueError(f"task {type(task).__name__} has unknown eval_type {task.eval_type!r}")


def chatcore(results):
    """(mean centered accuracy over the tasks in results, {task: centered})."""
    centered = {name: (acc - BASELINES[name]) / (1.0 - BASELINES[name]) for name, acc in results.items()}
    return (sum(centered.values()) / len(centered) if centered else float("nan")), centered
