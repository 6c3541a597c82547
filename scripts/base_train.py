"""
Pretrain the base model.

    python -m scripts.base_train --depth=4 --max_seq_len=256 --device_batch_size=8 --total_batch_size=4096 ...
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=20
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=40 --use_fsdp=1
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=40 --tp_size=2   # 4 data ranks x 2 tensor-parallel
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=24 --recipe=record --target_param_data_ratio=8

--recipe picks the model and the defaults of every flag that depends on it (nanochat/recipe.py): december (the
default) or record (nanochat 92d63d4's time-to-GPT-2 recipe); a flag given explicitly wins over the recipe.

Flags use nanochat's names; `--a_b=v` and `--a-b v` both work; unknown flags are errors (run with --help).
The loop below reads top to bottom: evaluate / sample / checkpoint when due, then one optimisation step.
"""

import os

import torch

from nanochat.attention import attn_flag
from nanochat.batching import batch_arithmetic
from nanochat.checkpoint.resume import require_resume_step, resolve_resume_step, resume_flag, resume_loop_state
from nanochat.checkpoint.train_state import load_train_state, save_train_state, saved_loader_states
from nanochat.checkpoint_manager import checkpoint_root
from nanochat.compile import compile_flag
from nanochat.common import check_wandb, print0, print_banner
from nanochat.configurator import Flag, Flags, parse_flags_or_exit
from nanochat.dataloader import (PACKINGS, cropped_fraction, loader_states_for_world, resolve_packing,
                                 tokenizing_distributed_data_loader)
from nanochat.dataset import SOURCES, base_data_dir, resolve_source, split_parquet_files
from nanochat.distributed.parallel import parallel_flags
from nanochat.fp8 import FP8_FILTER_HELP, FP8_IMPL_HELP, FP8_IMPLS, FP8_RECIPES
from nanochat.gpt import check_config
from nanochat.loss_eval import evaluate_bpb
from nanochat.recipe import RECORD_EVAL_TOKENS, recipe_flags, resolve_recipe
from nanochat.stage import Stage
from nanochat.tokenizer import get_token_bytes, get_tokenizer
from nanochat.training import (
    CPU_EVAL_STEPS, DEFAULT_EVAL_TOKENS, apply_schedule, eval_steps_for, format_duration, init_model,
    round_robin_batches, run_flags
)
from nanochat.usage import BadValue, run_main

CORE_MAX_PER_TASK = 500  # --core_metric_max_per_task=auto on GPU (nanochat's)
CPU_CORE_MAX_PER_TASK = 16  # and on CPU

FLAGS = Flags(
    "run",
    run_flags(),
    "recipe (the flags left on auto take the recipe's value; the horizon's --target_param_data_ratio is one)",
    recipe_flags(),
    "model",
    Flag("depth", 20, "transformer blocks; width (64 x depth) and heads follow from it, as nanochat (record: "
         "--aspect_ratio and --head_dim)", min=1),
    Flag("max_seq_len", 2048, "context length in tokens (rows of the training batch)", min=1),
    attn_flag(),
    "horizon (the first one > 0 wins: --num_iterations, --target_flops, --target_param_data_ratio)",
    Flag("num_iterations", -1, "optimisation steps"),
    Flag("target_flops", -1.0, "train for this many FLOPs"),
    "batch",
    Flag("device_batch_size", 32, "rows per forward pass on each GPU; gradient accumulation makes up the rest of "
         "--total_batch_size", min=1),
    Flag("packing", None, "how documents fill the rows: concat (one token stream cut into rows) or bestfit (every row "
         "starts at a document, best-fit packed, nanochat 92d63d4's); auto = the recipe's (december concat, record "
         "bestfit)", type=str, choices=PACKINGS),
    Flag("data", None, "which shards: fineweb_edu (base_data/) or climbmix (base_data_climbmix/); auto = the "
         "recipe's (december fineweb_edu, record climbmix; python -m nanochat.dataset fills either)", type=str,
         choices=list(SOURCES)),
    "optimisation",
    Flag("use_muon", True, "Muon for the matrices (0: AdamW for everything; december only)"),
    "periodic actions (<= 0 turns one off)",
    Flag("eval_every", 250, "validation bits per byte every this many steps"),
    Flag("eval_tokens", None, f"tokens per validation; auto = {DEFAULT_EVAL_TOKENS:,} (record: {RECORD_EVAL_TOKENS:,}; "
         f"{CPU_EVAL_STEPS} batches on CPU, where that would take hours)", type=int, min=1),
    Flag("core_metric_every", 2000, "CORE metric (nanochat/core_eval.py) every this many steps"),
    Flag("core_metric_max_per_task", None, f"examples per CORE task, -1 = all; auto = {CORE_MAX_PER_TASK} "
         f"({CPU_CORE_MAX_PER_TASK} on CPU, where {CORE_MAX_PER_TASK} means ~11k forwards)", type=int, min=-1),
    Flag("sample_every", 2000, "print a few greedy samples every this many steps"),
    Flag("save_every", -1, "intermediate checkpoint every this many steps (the final step is always saved)"),
    resume_flag(),
    Flag("model_tag", None, "checkpoint directory name under base_checkpoints/; auto = d<depth>", type=str),
    "systems",
    compile_flag(),
    parallel_flags(),
    Flag("fp8", False, "FP8 matmuls in the blocks (CUDA, compute capability >= 8.9; nanochat/fp8.py; --fp8_impl: whose)"),
    Flag("fp8_recipe", "tensorwise", "FP8 scaling granularity", choices=list(FP8_RECIPES)),
    Flag("fp8_impl", "torchao", FP8_IMPL_HELP, choices=list(FP8_IMPLS)),
    Flag("fp8_filter", "auto", FP8_FILTER_HELP),
    Flag("data_world_size", 1, "single process only: read the data as W ranks would, to reproduce a W-rank run "
         "exactly", min=1),
)
DEFAULTS = resolve_recipe(FLAGS.defaults()).config  # what a run with no flags uses: the december recipe's values


SAMPLE_PROMPTS = ["The capital of France is", "The chemical symbol of gold is",
                  "If yesterday was Friday, then tomorrow will be", "The opposite of hot is",
                  "The planets of the solar system are:"]


def startup_checks(config):
    """Before any process group, model, compile or download: the recipe's flags, the model's shape (--depth), the data,
    the tokenizer, the step to resume from, a training horizon, wandb for --run. Resolves --packing and --data.
    Returns (recipe, tokenizer, checkpoint_dir, model config)."""
    recipe = resolve_recipe(config)  # the flags left on auto take the recipe's values (nanochat/recipe.py)
    if config["num_iterations"] <= 0 and config["target_flops"] <= 0 and config["target_param_data_ratio"] <= 0:
        raise BadValue("set one of --num_iterations, --target_flops or --target_param_data_ratio to a positive value")
    config["packing"] = resolve_packing(config["packing"], recipe.packing)
    config["data"] = resolve_source(config["data"], recipe.data_source)
    data_dir = base_data_dir(source=config["data"])
    split_parquet_files("train", data_dir), split_parquet_files("val", data_dir)
    tokenizer = get_tokenizer()
    model_config = recipe.model_config(config, tokenizer.get_vocab_size())
    check_config(model_config)
    checkpoint_dir = os.path.join(checkpoint_root("base"), config["model_tag"] or f"d{config['depth']}")
    require_resume_step(config, checkpoint_dir)
    check_wandb(config["run"])
    return recipe, tokenizer, checkpoint_dir, model_config


def main(argv=None):
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    recipe, tokenizer, checkpoint_dir, model_config = startup_checks(config)
    user_config = dict(config)  # with the recipe's values of the flags left on auto
    batch = recipe.batch(config, model_config)  # record: the batch size and lr/wd scaling from the horizon
    print_banner()

    # device, process group, the parallel plan (its layout checked against the model's shape first): nanochat/stage.py
    stage = Stage(config, model_config=model_config)
    parallel, device, world_size = stage.parallel, stage.device, stage.world_size
    data_world = parallel.read_world  # tp ranks of a group read the same data; --data_world_size replays W ranks

    # batch arithmetic (before the model: a batch that does not divide stops here)
    B, Tlen = config["device_batch_size"], config["max_seq_len"]
    grad_accum, tokens_per_fwdbwd = batch_arithmetic(batch.total_batch_size, B, Tlen, data_world)
    total_batch = tokens_per_fwdbwd * grad_accum
    print0("\n".join([*batch.notes, f"Batch: {B} x {Tlen} x {data_world} rank(s) x {grad_accum} accumulation = "
                                    f"{total_batch:,} tokens/step"]))

    # tokenizer and model
    token_bytes = get_token_bytes(device=device)
    model, orig_model = stage.prepare(init_model(model_config, device, config["init"], config["attn"]))
    num_params, flops_per_token = orig_model.num_params(), orig_model.estimate_flops()
    print0(f"Model d{config['depth']} ({recipe.name} recipe): {model_config} | {num_params:,} params | attn "
           f"{orig_model.attn_choice.describe()} | {flops_per_token:.3e} FLOPs/token")
    num_iterations = horizon(config, recipe.horizon_params(orig_model), flops_per_token, total_batch)
    eval_steps = eval_steps_for(config["eval_tokens"], tokens_per_fwdbwd, device.type, enabled=config["eval_every"] > 0,
                                default_tokens=recipe.eval_tokens)
    core_bundle = find_core_bundle(config, device.type)  # now, not hours into training
    optimizers = stage.optimizers(orig_model, use_muon=config["use_muon"], **batch.optimizer_kwargs)

    # checkpoints and resume
    meter = stage.start_meter(total_batch, flops_per_token, num_iterations)
    resume_step = resolve_resume_step(config["resume_from_step"], checkpoint_dir)
    start_step, min_val_bpb, val_bpb, loader_states = resume(stage, checkpoint_dir, resume_step, orig_model, optimizers)

    # data: one loader per data rank this process reads (exactly one under torchrun)
    train_loaders = [data_loader(config, "train", B, device, tokenizer, r, data_world, st)
                     for r, st in zip(parallel.read_ranks, loader_states)]
    train_batches = round_robin_batches(train_loaders, grad_accum, loader_states)
    metrics = stage.open_log(checkpoint_dir, "nanochat", resume_step, user_config)
    metrics.log(start_step, {"system/attn": orig_model.attn_choice.describe()})  # the kernel that ran, not just --attn
    metrics.log(start_step, {"system/recipe": recipe.name})

    def save(step):
        loop_state = {"meter": meter.state_dict(), "min_val_bpb": min_val_bpb,
                      "data_loader_states": loader_states if world_size == 1 else None}
        meta = {"model_config": vars(model_config), "user_config": user_config, "val_bpb": val_bpb, "recipe": recipe.name,
                "device_batch_size": B, "max_seq_len": Tlen, "loop_state": loop_state}
        my_state = loader_states[0] if len(loader_states) == 1 else None  # this rank's; W virtual ranks live in loop_state
        save_train_state(checkpoint_dir, step, orig_model, optimizers, meta, my_state, parallel)

    # ---------------------------------------------------------------- the loop
    core_metric = None
    step = start_step
    for step in range(start_step, num_iterations + 1):
        last_step = step == num_iterations
        if stage.stopping(step, start_step, checkpoint_dir, lambda: save(step)):  # every rank at the same step
            break
        if last_step and resume_step == num_iterations:  # a restart of a finished run: nothing to train or evaluate
            print0(f"Step {step} is the last and is already saved in {checkpoint_dir}: base training is complete")
            break

        if stage.due(step, "eval_every", last_step):
            with stage.evaluating(orig_model):
                val_loader = data_loader(config, "val", B, device, tokenizer, parallel.data_rank, parallel.data_world)
                val_bpb = evaluate_bpb(orig_model, val_loader, eval_steps, token_bytes)
            min_val_bpb = min(min_val_bpb, val_bpb)
            metrics.log(step, {"val/bpb": val_bpb}, console=f"step {step:05d} | val bpb: {val_bpb:.4f}")

        if stage.due(step, "core_metric_every", last_step) and step > 0:
            from nanochat.core_eval import evaluate_model

            with stage.evaluating(orig_model):
                out = evaluate_model(orig_model, tokenizer, device, max_per_task=config["core_metric_max_per_task"],
                                     bundle_dir=core_bundle, ranks=parallel.data_ranks)
            core_metric = out.get("core_metric")
            metrics.log(step, {"eval/core_metric": core_metric},
                        console=f"step {step:05d} | CORE: {core_metric:.4f}" + (" (partial)" if out.get("partial") else ""))

        # under FSDP/TP every rank runs the forward (the all-gathers are collective); rank 0 prints
        if step > 0 and stage.due(step, "sample_every", last_step) and (stage.master or parallel.collective_forward):
            with stage.evaluating(orig_model):
                prompts = [tokenizer(prompt, prepend="<|bos|>") for prompt in SAMPLE_PROMPTS]
                for prompt, out in zip(SAMPLE_PROMPTS, orig_model.generate_greedy(prompts, max_tokens=16)):
                    print0(f"  {prompt!r} -> {tokenizer.decode(out)!r}")

        if step > start_step and (stage.due(step, "save_every", last_step, at_last=False) or last_step):
            save(step)
        if last_step:
            break

        lrm, momentum, weight_decay = recipe.schedule(step, num_iterations)
        apply_schedule(optimizers, lrm, momentum, weight_decay)
        loss, grad_norm, _, dt = stage.timed_step(step, model, optimizers, train_batches,
                                                  grad_accum * len(train_loaders), config["grad_clip"])
        stage.log_step(step, loss, dt, lrm, {"train/grad_norm": grad_norm, **packing_metrics(config, loader_states)},
                       f" | gnorm: {grad_norm:.3f}" if grad_norm is not None else "")

    # ---------------------------------------------------------------- wrap up
    if device.type == "cuda":
        print0(f"Peak memory: {torch.cuda.max_memory_allocated() / 1024**2:.0f} MiB")
    print0(f"Total training time: {format_duration(meter.total_time)} | min val bpb: {min_val_bpb:.4f}")
    stage.finish("Base model training", [
        user_config,
        {"Number of parameters": num_params, "FLOPs per token": f"{flops_per_token:e}",
         "Calculated number of iterations": num_iterations, "Tokens per step": total_batch,
         "Number of training tokens": num_iterations * total_batch, "DDP world size": world_size,
         "Data": f"{config['data']}, {config['packing']} packing",
         "Attention kernel": orig_model.attn_choice.describe(), "Recipe": recipe.name},
        {"Minimum validation bpb": min_val_bpb, "Final validation bpb": val_bpb, "CORE metric": core_metric,
         "Total training time": format_duration(meter.total_time),
         **packing_metrics(config, loader_states, "Cropped fraction (best-fit packing)")},
    ], {"train/loss": ("Base training loss", "loss (EMA)"), "val/bpb": ("Base validation bpb", "bits per byte")})
    return {"val_bpb": val_bpb, "min_val_bpb": min_val_bpb, "num_iterations": num_iterations, "step": step}


def data_loader(config, split, B, device, tokenizer, rank, world, state=None):
    """The pretraining loader of one data rank: --data's shards, packed as --packing says (nanochat/dataloader.py)."""
    return tokenizing_distributed_data_loader(B, config["max_seq_len"], split, device=device.type, resume_state_dict=state,
                                              tokenizer=tokenizer, rank=rank, world_size=world,
                                              data_dir=base_data_dir(source=config["data"]), packing=config["packing"])


def packing_metrics(config, loader_states, key="train/cropped_fraction"):
    """{key: tokens dropped by cropping / tokens packed} of best-fit packing, over this process's data ranks since the
    run started; {} for concat packing, which drops nothing."""
    return {key: cropped_fraction(loader_states)} if config["packing"] == "bestfit" else {}


def resume(stage, checkpoint_dir, step, model, optimizers):
    """(start step, min val bpb, val bpb, one loader state per data rank this process reads): fresh when step is None,
    else the saved run's, model, optimizers and meter restored in place."""
    parallel = stage.parallel
    if step is None:
        return 0, float("inf"), None, [None] * len(parallel.read_ranks)
    meta, my_state = load_train_state(checkpoint_dir, step, model, optimizers, stage.device, parallel)
    loop = resume_loop_state(meta, checkpoint_dir, step, ("meter", "min_val_bpb", "data_loader_states"))
    stage.meter.load_state_dict(loop["meter"])
    # one process reads as read_world ranks: their saved positions (resharded when another world saved them)
    loader_states = (loader_states_for_world(saved_loader_states(meta), parallel.read_world, print0)
                     if stage.world_size == 1 else [my_state])
    print0(f"Resumed from step {step} in {checkpoint_dir}")
    return step, loop["min_val_bpb"], meta.get("val_bpb"), loader_states


def horizon(config, num_params, flops_per_token, total_batch):
    """The number of steps: --num_iterations, else --target_flops, else --target_param_data_ratio (the first > 0) times
    num_params (the recipe's count: Recipe.horizon_params)."""
    if config["num_iterations"] > 0:
        num_iterations = config["num_iterations"]
    elif config["target_flops"] > 0:
        num_iterations = round(config["target_flops"] / (flops_per_token * total_batch))
    else:
        num_iterations = config["target_param_data_ratio"] * num_params // total_batch
    num_iterations = max(int(num_iterations), 1)
    print0(f"Training for {num_iterations:,} steps = {num_iterations * total_batch:,} tokens "
           f"(tokens:params = {num_iterations * total_batch / num_params:.2f}), "
           f"{flops_per_token * num_iterations * total_batch:.3e} FLOPs")
    return num_iterations


def find_core_bundle(config, device_type):
    """CORE's eval bundle, found (or downloaded) before training; None, with CORE turned off, when there is none.
    Resolves --core_metric_max_per_task=auto for the device."""
    if config["core_metric_every"] <= 0:
        return None
    from nanochat.core_eval import get_bundle_dir

    if config["core_metric_max_per_task"] is None:  # auto: the user's number, when given, is used as is
        cpu = device_type == "cpu"
        config["core_metric_max_per_task"] = CPU_CORE_MAX_PER_TASK if cpu else CORE_MAX_PER_TASK
        if cpu:
            print0(f"Note: on CPU CORE uses {CPU_CORE_MAX_PER_TASK} examples per task, not {CORE_MAX_PER_TASK} "
                   f"(~11k forwards); pass --core_metric_max_per_task=N to choose, or --core_metric_every=-1 to "
                   f"turn CORE off.")
    try:
        return get_bundle_dir()
    except FileNotFoundError as e:
        print0(f"Note: CORE evaluation turned off (--core_metric_every=-1): {e}")
        config["core_metric_every"] = -1
        return None


if __name__ == "__main__":
    run_main(main)  # a usage error: one line, exit 2 (nanochat/usage.py); a bug keeps its traceback
