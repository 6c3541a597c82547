"""
The CORE metric of the DCLM paper (https://arxiv.org/abs/2406.11794): 22 in-context-learning tasks, each scored
as an accuracy, turned into a "centered" accuracy against the task's random-guess baseline, averaged.

Task types (from core.yaml):
- multiple_choice: one query, several choices; each choice is appended to the prompt and the choice whose tokens
  get the lowest mean loss wins.
- schema: several contexts, one continuation (Winograd); the context under which the continuation gets the
  lowest mean loss wins.
- language_modeling: one context and a continuation; correct iff greedy (argmax) decoding reproduces every
  continuation token.
Few-shot examples are drawn per example from the rest of the task's data with random.Random(1234 + idx), and
tasks are shuffled with random.Random(1337) before --max_per_task cuts them, exactly as nanochat does, so numbers
compare with nanochat's.

The data is nanochat's eval bundle (core.yaml, eval_meta_data.csv, eval_data/<category>/<task>.jsonl): downloaded
to <base_dir>/eval_bundle, or a local directory with that layout (e.g. ../shared/data/core_eval). A task whose file
is missing is skipped *by name*: the result is then marked partial and lists what was missing, never silently
averaged over fewer tasks.
"""

import csv
import json
import os
import random
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanochat.usage import BadValue, Missing

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"

# -----------------------------------------------------------------------------
# Finding / downloading the bundle


def _is_bundle(path):
    return path is not None and (Path(path) / "core.yaml").is_file()


def download_eval_bundle(base_dir, url=None):
    """Download the bundle zip into base_dir and unpack it to base_dir/eval_bundle (atomically). Returns that path."""
    from nanochat.data.download import download_file

    url = url or EVAL_BUNDLE_URL
    base_dir = Path(base_dir)
    target = base_dir / "eval_bundle"
    zip_path = base_dir / "eval_bundle.zip"
    print(f"Downloading the CORE eval bundle from {url} ...")
    download_file(url, zip_path, timeout=60.0)
    # unpack next to the target, then rename: an interrupted unzip never leaves a half bundle at the target
    staging = Path(tempfile.mkdtemp(prefix="eval_bundle.", dir=base_dir))
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(staging)  # extractall drops absolute paths and ".." components
        # nanochat's zip holds a top-level eval_bundle/ folder; accept a zip of the folder's contents too
        root = staging / "eval_bundle" if _is_bundle(staging / "eval_bundle") else staging
        if not _is_bundle(root):
            raise BadValue(f"{url} does not contain an eval bundle (no core.yaml at its top or in eval_bundle/)")
        if not _is_bundle(target):  # else another node sharing this base dir finished first: keep theirs
            if target.exists():
                shutil.rmtree(target)  # a leftover without core.yaml is not a bundle
            os.replace(root, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        zip_path.unlink(missing_ok=True)
    return target


def resolve_bundle_dir(bundle_dir=None, base_dir=None, download=True, url=None):
    """
    Where the CORE data is, in this order: the explicit bundle_dir; $NANOCHAT_DATA_DIR/core_eval;
    <base_dir>/eval_bundle; else download the bundle to <base_dir>/eval_bundle (if download=True).
    """
    if bundle_dir is not None:
        if not _is_bundle(bundle_dir):
            raise Missing(f"--bundle_dir {bundle_dir} is not a CORE eval bundle: it has no core.yaml "
                                    f"(expected core.yaml, eval_meta_data.csv and eval_data/ as in nanochat's eval_bundle)")
        return Path(bundle_dir)
    looked = []
    data_dir = os.environ.get("NANOCHAT_DATA_DIR")
    if data_dir:
        candidate = Path(data_dir) / "core_eval"
        if _is_bundle(candidate):
            return candidate
        looked.append(f"{candidate} (no core.yaml)")
    if base_dir is None:
        from nanochat.common import get_base_dir

        base_dir = get_base_dir()
    candidate = Path(base_dir) / "eval_bundle"
    if _is_bundle(candidate):
        return candidate
    looked.append(f"{candidate} (no core.yaml)")
    if download:
        url = url or EVAL_BUNDLE_URL
        try:
            return download_eval_bundle(base_dir, url)
        except (OSError, zipfile.BadZipFile, ValueError) as e:
            looked.append(f"download from {url} failed ({type(e).__name__}: {e})")
    raise Missing("could not find the CORE eval bundle. Looked in:\n" + "\n".join(f"  - {x}" for x in looked)
                            + "\nPass --bundle_dir, set NANOCHAT_DATA_DIR to a dir with core_eval/, or allow the download.")


def get_bundle_dir(bundle_dir=None, url=None):
    """
    resolve_bundle_dir for every rank of a torchrun job: local rank 0 of each node finds (or downloads) the bundle
    while the other ranks wait, then they find it on disk (base dirs may be per node). A failure on any node is
    raised on every rank, so nobody is left waiting in a collective.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return resolve_bundle_dir(bundle_dir, url=url)
    from nanochat.common import get_dist_info

    error = None
    if get_dist_info()[2] == 0:
        try:
            resolve_bundle_dir(bundle_dir, url=url)
        except FileNotFoundError as e:
            error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    errors = [e for e in errors if e]
    if errors:
        raise Missing(errors[0])
    return resolve_bundle_dir(bundle_dir, download=False)


def load_core_config(bundle_dir):
    """The task list of core.yaml, each {label, dataset_uri, task_type, num_fewshot, continuation_delimiter}."""
    import yaml

    with open(Path(bundle_dir) / "core.yaml", encoding="utf-8") as f:
        config = yaml.safe_load(f)
    tasks = []
    for t in config["icl_tasks"]:
        shots = t["num_fewshot"]
        tasks.append({
            "label": t["label"],
            "dataset_uri": t["dataset_uri"],
            "task_type": t["icl_task_type"],
            "num_fewshot": shots[0] if isinstance(shots, list) else shots,
            "continuation_delimiter": t.get("continuation_delimiter", " "),
        })
    return tasks


def load_random_baselines(bundle_dir):
    """{task label: random-guess accuracy in percent} from eval_meta_data.csv."""
    with open(Path(bundle_dir) / "eval_meta_data.csv", newline="", encoding="utf-8") as f:
        return {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}


def load_task_data(bundle_dir, dataset_uri):
    with open(Path(bundle_dir) / "eval_data" / dataset_uri, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def centered_accuracy(accuracy, random_baseline_percent):
    """Rescale so that random guessing scores 0 and a perfect score 1: (acc - b) / (1 - b), b = baseline/100."""
    b = 0.01 * random_baseline_percent
    return (accuracy - b) / (1.0 - b)


# -----------------------------------------------------------------------------
# Prompts. Few-shot examples come first, each followed by a blank line; then the item itself.


def render_prompts_mc(item, delimiter, fewshot):
    """One prompt per choice: '<query><delimiter><choice>'."""
    prefix = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
    return [f"{prefix}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_prompts_schema(item, delimiter, fewshot):
    """One prompt per context option: '<context option><delimiter><continuation>'."""
    prefix = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    return [f"{prefix}{ctx}{delimiter}{item['continuation']}" for ctx in item["context_options"]]


def render_prompts_lm(item, delimiter, fewshot):
    """
    Two prompts: without and with the continuation. The one without is stripped of trailing whitespace: a
    trailing space would otherwise be a token of its own there but merge into the continuation's first token in
    the other ("Answer:" + " Paris"), and the prompt without would no longer be a token prefix of the one with.
    """
    prefix = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    without = f"{prefix}{item['context'].strip()}{delimiter}"
    return [without.strip(), without + item["continuation"]]


def common_length(seqs, from_end=False):
    """Length of the longest common prefix (or suffix) of token lists."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        pos = -1 - i if from_end else i
        if any(s[pos] != seqs[0][pos] for s in seqs):
            return i
    return n


def batch_sequences(tokenizer, prompts, task_type):
    """
    Tokenize (each with a leading BOS) and locate the scored span [start, end) of every sequence:
    MC: the choices differ after a common prefix; schema: the contexts differ before a common suffix;
    LM: only the prompt with the continuation is run, scored on the tokens the prompt without does not have.
    """
    tokens = tokenizer(prompts, prepend=tokenizer.get_bos_token_id())
    if task_type == "multiple_choice":
        # a choice that is a prefix of another would leave it an empty span: keep at least its last token
        start = min(common_length(tokens), min(len(t) for t in tokens) - 1)
        return tokens, [start] * len(tokens), [len(t) for t in tokens]
    if task_type == "schema":
        suffix = common_length(tokens, from_end=True)
        return tokens, [len(t) - suffix for t in tokens], [len(t) for t in tokens]
    if task_type == "language_modeling":
        without, with_ = tokens
        if not (len(without) < len(with_) and with_[: len(without)] == without):
            raise ValueError("language_modeling: the prompt without the continuation does not tokenize to a prefix "
                             f"of the prompt with it (prompt ends {prompts[0][-40:]!r})")
        return [with_], [len(without)], [len(with_)]
    raise ValueError(f"unknown CORE task type {task_type!r} (expected multiple_choice, schema or language_modeling)")


def model_max_len(model):
    """The longest sequence the model can take, if it declares one (HF-style max_seq_len, or nanochat's rotary table)."""
    limits = [getattr(model, name, None) for name in ("max_seq_len", "rotary_seq_len")]
    limits = [int(x) for x in limits if x is not None]
    return min(limits) if limits else None


@torch.no_grad()
def forward_model(model, input_ids):
    """(B, T) ids -> per-position loss of predicting the next token (B, T-1) and argmax predictions (B, T-1)."""
    logits = model(input_ids)
    B, T, V = logits.shape
    logits = logits[:, :-1].float()
    losses = F.cross_entropy(logits.reshape(-1, V), input_ids[:, 1:].reshape(-1), reduction="none").view(B, T - 1)
    return losses, logits.argmax(dim=-1)


def sample_fewshot(data, idx, num_fewshot):
    """nanochat's few-shot draw for example idx: seeded by idx, never the example itself."""
    if num_fewshot <= 0:
        return []
    rng = random.Random(1234 + idx)
    available = [i for i in range(len(data)) if i != idx]
    return [data[i] for i in rng.sample(available, num_fewshot)]


@torch.no_grad()
def evaluate_example(idx, model, tokenizer, data, device, task_meta):
    """True if the model gets example idx of a task right. All choices of the example run as one batch."""
    item = data[idx]
    task_type, delimiter = task_meta["task_type"], task_meta["continuation_delimiter"]
    fewshot = sample_fewshot(data, idx, task_meta["num_fewshot"])
    render = {"multiple_choice": render_prompts_mc, "schema": render_prompts_schema,
              "language_modeling": render_prompts_lm}.get(task_type)
    if render is None:
        raise ValueError(f"unknown CORE task type {task_type!r}")
    tokens, starts, ends = batch_sequences(tokenizer, render(item, delimiter, fewshot), task_type)

    # a sequence longer than the model can take loses tokens from the left (the oldest few-shot text first)
    max_len = model_max_len(model)
    if max_len is not None:
        for i, t in enumerate(tokens):
            crop = len(t) - max_len
            if crop > 0:
                if starts[i] - crop < 1:
                    raise ValueError(f"example {idx}: the scored continuation alone is longer than the model's {max_len} positions")
                tokens[i], starts[i], ends[i] = t[crop:], starts[i] - crop, ends[i] - crop

    # right-pad with BOS: padding sits after every scored span, and a causal model never looks ahead at it
    width = max(len(t) for t in tokens)
    input_ids = torch.full((len(tokens), width), tokenizer.get_bos_token_id(), dtype=torch.long)
    for i, t in enumerate(tokens):
        input_ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    input_ids = input_ids.to(device)
    losses, predictions = forward_model(model, input_ids)

    # position p of losses/predictions is about token p+1, so the span [s, e) is read at [s-1, e-1)
    if task_type == "language_modeling":
        s, e = starts[0], ends[0]
        return bool(torch.equal(predictions[0, s - 1 : e - 1], input_ids[0, s:e]))
    mean_losses = [losses[i, s - 1 : e - 1].mean().item() for i, (s, e) in enumerate(zip(starts, ends))]
    pred = min(range(len(mean_losses)), key=lambda i: mean_losses[i])  # ties go to the first option
    return pred == item["gold"]


def evaluate_task(model, tokenizer, data, device, task_meta, *, ranks):
    """
    Accuracy on one task. Under torchrun each data rank takes every data_world-th example; counts are all-reduced.
    Every rank runs the same number of forward passes (a rank short of examples re-runs one and discards it):
    a model sharded with FSDP all-gathers its weights inside forward, which every rank must join.
    """
    # by data rank (DataRanks; the parallel plan's under TP: the tp ranks of a group run the same examples together)
    rank, world, tp_rank = ranks
    correct = torch.zeros(len(data), dtype=torch.float32, device=device)
    for step in range(-(-len(data) // world)):
        idx = rank + step * world
        if idx < len(data):
            correct[idx] = float(evaluate_example(idx, model, tokenizer, data, device, task_meta))
        else:
            evaluate_example(0, model, tokenizer, data, device, task_meta)  # keep in step with the other ranks
    if tp_rank != 0:
        correct.zero_()  # each tensor-parallel group's results count once
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(correct, op=dist.ReduceOp.SUM)
    return correct.sum().item() / len(data)  # an exact count (float32 holds integers < 2^24), exact division


def prepare_task_data(data, max_per_task=-1):
    """nanochat's order: shuffle with Random(1337) (many files are sorted), then keep the first max_per_task."""
    data = list(data)
    random.Random(1337).shuffle(data)
    return data[:max_per_task] if max_per_task > 0 else data


def evaluate_model(model, tokenizer, device, max_per_task=-1, bundle_dir=None, log=print, *, ranks):
    """
    CORE of `model`. Returns {"results": {label: accuracy}, "centered_results": {label: centered},
    "core_metric": mean centered accuracy over the tasks that ran, "partial": bool, "missing": [labels whose file
    is missing], "num_tasks": tasks that ran, "num_tasks_total": tasks in core.yaml, "bundle_dir": path}.
    Call it on every rank under torchrun (the bundle is fetched by rank 0 while the others wait). Raises
    FileNotFoundError, naming where it looked, when there is no bundle at all: callers that train for hours should
    call get_bundle_dir() up front instead of finding out at the first CORE evaluation. ranks: how examples are split
    (DataRanks: the parallel plan's `data_ranks` in training, dist.process_data_ranks() in a script without tensor
    parallelism); required, as the process's rank is the wrong split under TP.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    resolved = get_bundle_dir(bundle_dir)
    tasks = load_core_config(resolved)
    baselines = load_random_baselines(resolved)
    verbose = log if rank == 0 and log is not None else (lambda *a, **k: None)

    was_training = model.training
    model.eval()
    results, centered, missing = {}, {}, []
    for task in tasks:
        label = task["label"]
        if label not in baselines:
            raise BadValue(f"CORE task {label!r} has no random baseline in {resolved}/eval_meta_data.csv")
        path = Path(resolved) / "eval_data" / task["dataset_uri"]
        if not path.is_file():
            missing.append(label)
            verbose(f"CORE: {label}: data file {path} is missing, skipping (CORE will be marked partial)")
            continue
        data = prepare_task_data(load_task_data(resolved, task["dataset_uri"]), max_per_task)
        meta = dict(task)
        if meta["num_fewshot"] > len(data) - 1:
            verbose(f"CORE: {label}: only {len(data)} examples, using {len(data) - 1}-shot instead of {meta['num_fewshot']}-shot")
            meta["num_fewshot"] = len(data) - 1
        accuracy = evaluate_task(model, tokenizer, data, device, meta, ranks=ranks)
        results[label] = accuracy
        centered[label] = centered_accuracy(accuracy, baselines[label])
        verbose(f"CORE: {label:<35} ({task['num_fewshot']}-shot, {task['task_type']}, {len(data)} ex) "
                f"accuracy {accuracy:.4f} centered {centered[label]:.4f}")
    if was_training:
        model.train()
    core = sum(centered.values()) / len(centered) if centered else float("nan")
    if missing:
        verbose(f"CORE is PARTIAL: {len(centered)}/{len(tasks)} tasks; missing: {', '.join(missing)}")
    return {"results": results, "centered_results": centered, "core_metric": core, "partial": bool(missing),
            "missing": missing, "num_tasks": len(centered), "num_tasks_total": len(tasks), "bundle_dir": str(resolved)}
