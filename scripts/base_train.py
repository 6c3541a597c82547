"""
Pretrain the base model.

    python -m scripts.base_train --depth=4 --max_seq_len=256 --device_batch_size=8 --total_batch_size=4096 ...
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=20
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=40 --use_fsdp=1
    torchrun --nproc_per_node=8 -m scripts.base_train --depth=40 --tp_size=2   # 4 data ranks x 2 tensor-parallel

Flags use nanochat's names; `--a_b=v` and `--a-b v` both work; unknown flags are errors (run with --help).
The loop below reads top to bottom: evaluate / sample / checkpoint when due, then one optimisation step.
"""

import os

import torch

from nanochat.attention import attn_flag
from nanochat.batching import batch_arithmetic
from nanochat.checkpoint_manager import checkpoint_root
from nanochat.compile import compile_flag
from nanochat.common import check_wandb, print0, print_banner
from nanochat.configurator import Flag, Flags, parse_flags_or_exit
from nanochat.dataloader import loader_states_for_world, tokenizing_distributed_data_loader
from nanochat.dataset import split_parquet_files
from nanochat.fp8 import FP8_FILTER_HELP, FP8_RECIPES
from nanochat.gpt import check_config, config_for_depth
from nanochat.loss_eval import evaluate_bpb
from nanochat.stage import Stage
from nanochat.tokenizer import get_token_bytes, get_tokenizer
from nanochat.training import (
    CPU_EVAL_STEPS, DEFAULT_EVAL_TOKENS, apply_schedule,
    build_model, eval_steps_for, format_duration, load_train_state,
    lr_multiplier, memory_flags, muon_momentum, optimizer_flags, require_resume_step, resolve_resume_step, resume_flag,
    resume_loop_state,
    round_robin_batches, run_flags, save_train_state, schedule_flags
)
from nanochat.usage import BadValue, run_main

CORE_MAX_PER_TASK = 500  # --core_metric_max_per_task=auto on GPU (nanochat's)
CPU_CORE_MAX_PER_TASK = 16  # and on CPU

FLAGS = Flags(
    "run",
    run_flags(),
    "model",
    Flag("depth", 20, "transformer blocks; width (64 x depth) and heads follow from it, as nanochat", min=1),
    Flag("max_seq_len", 2048, "context length in tokens (rows of the training batch)", min=1),
    Flag("init", "normal", "weight init: normal (arXiv 2310.17813's scaling), or nanochat's exact scheme "
         "(nanochat/gpt.py)", choices=["normal", "nanochat"]),
    attn_flag(),
    "horizon (the first one > 0 wins)",
    Flag("num_iterations", -1, "optimisation steps"),
    Flag("target_flops", -1.0, "train for this many FLOPs"),
    Flag("target_param_data_ratio", 20, "train on ratio x parameters tokens (Chinchilla: 20)"),
    "batch",
    Flag("device_batch_size", 32, "rows per forward pass on each GPU; gradient accumulation makes up the rest of "
         "--total_batch_size", min=1),
    Flag("total_batch_size", 524288, "tokens per optimisation step, over all ranks and micro-steps", min=1),
    "optimisation",
    optimizer_flags(),
    Flag("use_muon", True, "Muon for the matrices (0: AdamW for everything)"),
    Flag("grad_clip", 1.0, "clip the gradient norm to this (<= 0: no clipping)"),
    schedule_flags(),
    "periodic actions (<= 0 turns one off)",
    Flag("eval_every", 250, "validation bits per byte every this many steps"),
    Flag("eval_tokens", None, f"tokens per validation; auto = {DEFAULT_EVAL_TOKENS:,} ({CPU_EVAL_STEPS} batches on "
         f"CPU, where that would take hours)", type=int, min=1),
    Flag("core_metric_every", 2000, "CORE metric (nanochat/core_eval.py) every this many steps"),
    Flag("core_metric_max_per_task", None, f"examples per CORE task, -1 = all; auto = {CORE_MAX_PER_TASK} "
         f"({CPU_CORE_MAX_PER_TASK} on CPU, where {CORE_MAX_PER_TASK} means ~11k forwards)", type=int, min=-1),
    Flag("sample_every", 2000, "print a few greedy samples every this many steps"),
    Flag("save_every", -1, "intermediate checkpoint every this many steps (the final step is always saved)"),
    resume_flag(),
    Flag("model_tag", None, "checkpoint directory name under base_checkpoints/; auto = d<depth>", type=str),
    "systems",
    compile_flag(),
    memory_flags(),
    Flag("fsdp_defer_grad_sync", False, "FSDP: reduce-scatter gradients once per step, not per micro-step (more "
         "memory, less traffic)"),
    Flag("fp8", False, "FP8 matmuls in the blocks via torchao (CUDA, compute capability >= 8.9; nanochat/fp8.py)"),
    Flag("fp8_recipe", "tensorwise", "FP8 scaling granularity", choices=list(FP8_RECIPES)),
    Flag("fp8_filter", "auto", FP8_FILTER_HELP),
    Flag("data_world_size", 1, "single process only: read the data as W ranks would, to reproduce a W-rank run "
         "exactly", min=1),
)
DEFAULTS = FLAGS.defaults()


SAMPLE_PROMPTS = ["The capital of France is", "The chemical symbol of gold is",
                  "If yesterday was Friday, then tomorrow will be", "The opposite of hot is",
                  "The planets of the solar system are:"]


def startup_checks(config):
    """Before any process group, model, compile or download: the model's shape (--depth), the data, the tokenizer,
    the step to resume from, a training horizon, wandb for --run. Returns (tokenizer, model config, checkpoint_dir)."""
    if config["num_iterations"] <= 0 and config["target_flops"] <= 0 and config["target_param_data_ratio"] <= 0:
        raise BadValue("set one of --num_iterations, --target_flops or --target_param_data_ratio to a positive value")
    split_parquet_files("train"), split_parquet_files("val")
    tokenizer = get_tokenizer()
    model_config = config_for_depth(config["depth"], tokenizer.get_vocab_size(), config["max_seq_len"])
    check_config(model_config)
    checkpoint_dir = os.path.join(checkpoint_root("base"), config["model_tag"] or f"d{config['depth']}")
    require_resume_step(config, checkpoint_dir)
    check_wandb(config["run"])
    return tokenizer, model_config, checkpoint_dir


def main(argv=None):
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    user_config = dict(config)
    tokenizer, model_config, checkpoint_dir = startup_checks(config)
    print_banner()

    # device, process group, the parallel plan (its layout checked against the model's shape first): nanochat/stage.py
    stage = Stage(config, model_config=model_config)
    parallel, device, world_size = stage.parallel, stage.device, stage.world_size
    data_world = parallel.read_world  # tp ranks of a group read the same data; --data_world_size replays W ranks

    # batch arithmetic (before the model: a batch that does not divide stops here)
    B, Tlen = config["device_batch_size"], config["max_seq_len"]
    grad_accum, tokens_per_fwdbwd = batch_arithmetic(config["total_batch_size"], B, Tlen, data_world)
    total_batch = tokens_per_fwdbwd * grad_accum
    print0(f"Batch: {B} x {Tlen} x {data_world} rank(s) x {grad_accum} accumulation = {total_batch:,} tokens/step")

    # tokenizer and model
    token_bytes = get_token_bytes(device=device)
    model, orig_model = stage.prepare(build_model(model_config, device, config["init"], config["attn"]))
    num_params, flops_per_token = orig_model.num_params(), orig_model.estimate_flops()
    print0(f"Model d{config['depth']}: {model_config} | {num_params:,} params | attn {orig_model.attn_choice.describe()} | "
           f"{flops_per_token:.3e} FLOPs/token")
    num_iterations = horizon(config, num_params, flops_per_token, total_batch)
    eval_steps = eval_steps_for(config["eval_tokens"], tokens_per_fwdbwd, device.type, enabled=config["eval_every"] > 0)
    core_bundle = find_core_bundle(config, device.type)  # now, not hours into training
    optimizers = stage.optimizers(orig_model, use_muon=config["use_muon"])

    # checkpoints and resume
    meter = stage.start_meter(total_batch, flops_per_token, num_iterations)
    resume_step = resolve_resume_step(config["resume_from_step"], checkpoint_dir)
    start_step, min_val_bpb, val_bpb, loader_states = resume(stage, checkpoint_dir, resume_step, orig_model, optimizers)

    # data: one loader per data rank this process reads (exactly one under torchrun)
    train_loaders = [
        tokenizing_distributed_data_loader(B, Tlen, "train", device=device.type, resume_state_dict=st,
                                           tokenizer=tokenizer, rank=r, world_size=data_world)
        for r, st in zip(parallel.read_ranks, loader_states)
    ]
    train_batches = round_robin_batches(train_loaders, grad_accum, loader_states)
    metrics = stage.open_log(checkpoint_dir, "nanochat", resume_step, user_config)
    metrics.log(start_step, {"system/attn": orig_model.attn_choice.describe()})  # the kernel that ran, not just --attn

    def save(step):
        loop_state = {"meter": meter.state_dict(), "min_val_bpb": min_val_bpb,
                      "data_loader_states": loader_states if world_size == 1 else None}
        meta = {"model_config": vars(model_config), "user_config": user_config, "val_bpb": val_bpb,
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
                val_loader = tokenizing_distributed_data_loader(B, Tlen, "val", device=device.type, tokenizer=tokenizer,
                                                                rank=parallel.data_rank, world_size=parallel.data_world)
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
                for prompt in SAMPLE_PROMPTS:
                    out = list(orig_model.generate(tokenizer(prompt, prepend="<|bos|>"), max_tokens=16, temperature=0))
                    print0(f"  {prompt!r} -> {tokenizer.decode(out)!r}")

        if step > start_step and (stage.due(step, "save_every", last_step, at_last=False) or last_step):
            save(step)
        if last_step:
            break

        lrm = lr_multiplier(step, num_iterations, config["warmup_ratio"], config["warmdown_ratio"], config["final_lr_frac"])
        apply_schedule(optimizers, lrm, muon_momentum(step))
        loss, grad_norm, _, dt = stage.timed_step(step, model, optimizers, train_batches,
                                                  grad_accum * len(train_loaders), config["grad_clip"])
        stage.log_step(step, loss, dt, lrm, {"train/grad_norm": grad_norm},
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
         "Attention kernel": orig_model.attn_choice.describe()},
        {"Minimum validation bpb": min_val_bpb, "Final validation bpb": val_bpb, "CORE metric": core_metric,
         "Total training time": format_duration(meter.total_time)},
    ], {"train/loss": ("Base training loss", "loss (EMA)"), "val/bpb": ("Base validation bpb", "bits per byte")})
    return {"val_bpb": val_bpb, "min_val_bpb": min_val_bpb, "num_iterations": num_iterations, "step": step}


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
    loader_states = (loader_states_for_world(loop["data_loader_states"] or meta["loader_state"], parallel.read_world,
                                             print0) if stage.world_size == 1 else [my_state])
    print0(f"Resumed from step {step} in {checkpoint_dir}")
    return step, loop["min_val_bpb"], meta.get("val_bpb"), loader_states


def horizon(config, num_params, flops_per_token, total_batch):
    """The number of steps: --num_iterations, else --target_flops, else --target_param_data_ratio (the first > 0)."""
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
