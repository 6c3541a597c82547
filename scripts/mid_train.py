"""
Mid-training: teach the base model the chat format, multiple choice, tool use and spelling, on packed conversations.

    python -m scripts.mid_train
    python -m scripts.mid_train --device_type=cpu --max_seq_len=256 --device_batch_size=4 --total_batch_size=1024 --num_iterations=50
    torchrun --nproc_per_node=8 -m scripts.mid_train -- --device_batch_size=16

Loads the base model (--model_tag / --model_step; latest by default), trains on a mixture of SmolTalk, MMLU
auxiliary_train, GSM8K, the identity conversations (twice), SimpleSpelling and SpellingBee, rendered with
render_conversation and packed into (B, T) rows (every token trained, as nanochat), and saves to
mid_checkpoints/<tag>/. A task whose data cannot be found is left out with a message. --num_iterations=-1 trains
one epoch of the mixture. Validation: bits per byte on held-out conversations (SmolTalk test, MMLU test, GSM8K test).
"""

import os


from nanochat.attention import attn_flag
from nanochat.batching import batch_arithmetic
from nanochat.checkpoint.resume import require_resume_step, resume_flag
from nanochat.checkpoint.train_state import save_train_state
from nanochat.checkpoint_manager import checkpoint_model_config, checkpoint_root
from nanochat.common import check_wandb, print0, print_banner
from nanochat.compile import compile_flag
from nanochat.configurator import Flag, Flags, Rule, parse_flags_or_exit
from nanochat.data.conversations import ConversationPacker, check_stage_model, load_stage_model, scale_initial_lr
from nanochat.distributed.dist import all_reduce_mean, any_rank
from nanochat.distributed.parallel import parallel_flags
from nanochat.loss_eval import evaluate_bpb
from nanochat.recipe import checkpoint_recipe
from nanochat.stage import Stage
from nanochat.tokenizer import get_token_bytes
from nanochat.training import (
    CPU_EVAL_STEPS, DEFAULT_EVAL_TOKENS, MicroBatches, apply_schedule, check_sequence_length, eval_steps_for,
    format_duration, muon_momentum, optimizer_flags, run_flags, source_flags
)
from nanochat.usage import run_main
from tasks.suites import build_mixture, held_out_tasks

FLAGS = Flags(
    "run",
    run_flags(),
    Flag("dry_run", False, "train and evaluate, but save no checkpoint and log no report / wandb"),
    "input model",
    source_flags(),
    "horizon and batch",
    Flag("num_iterations", -1, "optimisation steps; -1 = one epoch of the mixture"),
    Flag("max_seq_len", 2048, "tokens per packed row", min=1),
    Flag("device_batch_size", 32, "rows per forward pass on each GPU; gradient accumulation makes up the rest of "
         "--total_batch_size", min=1),
    Flag("total_batch_size", 524288, "tokens per optimisation step, over all ranks and micro-steps", min=1),
    "optimisation",
    optimizer_flags(),
    Flag("init_lr_frac", 1.0, "start at this fraction of the learning rates above"),
    Rule(("init_lr_frac",), lambda frac: frac > 0, "--init_lr_frac must be > 0 (got {init_lr_frac})"),
    Flag("grad_clip", 1.0, "clip the gradient norm to this (<= 0: no clipping)"),
    "evaluation",
    Flag("eval_every", 150, "validation bits per byte every this many steps (<= 0: off)"),
    Flag("eval_tokens", None, f"tokens per validation; auto = {DEFAULT_EVAL_TOKENS:,} ({CPU_EVAL_STEPS} batches on "
         f"CPU, where that would take hours)", type=int, min=1),
    "checkpoints",
    Flag("save_every", -1, "checkpoint every this many steps (the final step is always saved)"),
    resume_flag(),
    "systems",
    compile_flag(),
    attn_flag(),
    parallel_flags(),
)
DEFAULTS = FLAGS.defaults()

WARMDOWN_RATIO = 0.2  # the last 20% of the run decays the LR linearly to 0


def train_tasks():
    """(name, factory) of the mid-training mixture, nanochat's. Imports are inside the factories so a missing
    dataset only costs that task."""
    from tasks.customjson import CustomJSON, identity_conversations_path
    from tasks.gsm8k import GSM8K
    from tasks.mmlu import MMLU
    from tasks.smoltalk import SmolTalk
    from tasks.spellingbee import SimpleSpelling, SpellingBee

    return [
        ("SmolTalk", lambda: SmolTalk(split="train")),  # general conversations
        ("MMLU auxiliary_train", lambda: MMLU(subset="auxiliary_train", split="train")),  # multiple choice
        ("GSM8K", lambda: GSM8K(subset="main", split="train")),  # arithmetic with the calculator tool
        ("identity conversations", lambda: CustomJSON(filepath=identity_conversations_path())),
        ("identity conversations (2nd epoch)", lambda: CustomJSON(filepath=identity_conversations_path())),
        ("SimpleSpelling", lambda: SimpleSpelling(size=200000, split="train")),
        ("SpellingBee", lambda: SpellingBee(size=80000, split="train")),
    ]


def lr_multiplier(progress):
    """1.0, then a linear decay to 0 over the last WARMDOWN_RATIO of the run; progress in [0, 1]."""
    if progress < 1 - WARMDOWN_RATIO:
        return 1.0
    return max(0.0, (1 - progress) / WARMDOWN_RATIO)


def trained_batches(loader):
    """The micro-batches of the packed loader, and where the batches trained so far reached in the data: the schedule
    and the one-epoch stop read that position, not the loader's own, which is one prefetched batch ahead."""
    position = {"progress": loader.progress, "epoch": loader.epoch}

    def fetch():
        x, y = next(loader)
        return x, y, loader.progress, loader.epoch

    def on_take(batch):
        position["progress"], position["epoch"] = batch[2], batch[3]

    return MicroBatches(fetch, on_take), position


def main(argv=None):
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    user_config = dict(config)
    dry_run = config["dry_run"]
    # start-up checks, before anything is built: the base model exists, its shape (from its meta) takes
    # --max_seq_len, the step to resume from exists, wandb has a login
    base_tag, base_step = check_stage_model("base", config["model_tag"], config["model_step"])
    model_config = checkpoint_model_config("base", base_tag, base_step)
    check_sequence_length("--max_seq_len", config["max_seq_len"], model_config, f"the base model {base_tag}")
    checkpoint_dir = os.path.join(checkpoint_root("mid"), config["model_tag"] or f"d{model_config.n_layer}")
    if not dry_run:
        require_resume_step(config, checkpoint_dir)
        check_wandb(config["run"])
    print_banner()

    # device, process group, the parallel plan (its layout checked against the model's shape first): nanochat/stage.py
    stage = Stage(config, model_config=model_config)
    parallel, device = stage.parallel, stage.device
    data_rank, data_world = parallel.data_rank, parallel.data_world  # tp ranks of a group read the same data

    # the batch and the data first: a batch that does not divide, or task data that is missing, stops the run before
    # the model loads (the training mixture, packed; a held-out mixture for validation, rebuilt per eval)
    B, Tlen = config["device_batch_size"], config["max_seq_len"]
    grad_accum, tokens_per_fwdbwd = batch_arithmetic(config["total_batch_size"], B, Tlen, data_world)
    total_batch = tokens_per_fwdbwd * grad_accum
    train_ds, train_names = build_mixture(train_tasks(), "mid-training data")
    val_ds, _ = build_mixture(held_out_tasks(), "mid-training validation")

    # the base model and its tokenizer
    model, tokenizer, base_meta = load_stage_model("base", device, base_tag, base_step)
    print0(f"attention: {model.set_attn(config['attn']).describe()}")
    model, orig_model = stage.prepare(model)  # orig_model: uncompiled, for eval and saving
    token_bytes = get_token_bytes(device=device)
    recipe = checkpoint_recipe(base_meta)  # the base run's, recorded in this stage's meta and report too
    print0(f"Base model step {base_meta.get('step')} ({recipe} recipe): {model_config} | {orig_model.num_params():,} params")
    if Tlen != model_config.sequence_len:
        print0(f"Note: training at --max_seq_len={Tlen}; the base model was trained at {model_config.sequence_len}")
    print0(f"Batch: {B} x {Tlen} x {data_world} rank(s) x {grad_accum} accumulation = {total_batch:,} tokens/step")
    eval_steps = eval_steps_for(config["eval_tokens"], tokens_per_fwdbwd, device.type, enabled=config["eval_every"] > 0)

    optimizers = stage.optimizers(orig_model)
    scale_initial_lr(optimizers, config["init_lr_frac"])
    train_loader = ConversationPacker(train_ds, tokenizer, B, Tlen, device, data_rank, data_world)
    num_iterations = config["num_iterations"]
    print0(f"Training for {num_iterations:,} steps = {num_iterations * total_batch:,} tokens" if num_iterations > 0
           else f"Training for one epoch of {len(train_ds):,} conversations")

    start_step, loop = (0, None) if dry_run else stage.resume(
        checkpoint_dir, orig_model, optimizers, ("meter", "min_val_bpb", "finished"))
    if loop is not None and loop["finished"]:
        print0(f"Step {start_step} is the last and is already saved in {checkpoint_dir}: mid-training is complete")
        stage.close()
        return {"step": start_step, "checkpoint_dir": checkpoint_dir, "train_tasks": train_names}
    metrics = stage.open_log(None if dry_run else checkpoint_dir, "nanochat-mid",
                             start_step if loop is not None else None, user_config, run="dummy" if dry_run else None)
    # in one-epoch mode the step count is not known in advance: the meter's ETA uses an estimate from progress
    meter = stage.start_meter(total_batch, orig_model.estimate_flops(), max(num_iterations, 1),
                              loop["meter"] if loop else None)

    # ---------------------------------------------------------------- the loop
    train_batches, position = trained_batches(train_loader)
    for _ in range(start_step * grad_accum):  # a resumed run: the batches the saved run already trained on
        train_batches.take()
    val_bpb, min_val_bpb = None, loop["min_val_bpb"] if loop else float("inf")

    def save(step, finished):
        meta = {
            "model_config": vars(model_config), "user_config": user_config, "val_bpb": val_bpb, "recipe": recipe,
            "min_val_bpb": min_val_bpb if val_bpb is not None else None, "device_batch_size": B, "max_seq_len": Tlen,
            "source": {"phase": "base", "model_tag": config["model_tag"] or None, "step": base_meta.get("step")},
            "loop_state": {"meter": meter.state_dict(), "min_val_bpb": min_val_bpb, "finished": finished},
        }
        save_train_state(checkpoint_dir, step, orig_model, optimizers, meta, None, parallel)
        print0(f"Saved mid-training checkpoint step {step} to {checkpoint_dir}")

    step, epoch_done, stopped = start_step, False, False
    while True:
        last_step = step == num_iterations if num_iterations > 0 else epoch_done
        if stage.stopping(step, start_step, checkpoint_dir, None if dry_run else lambda: save(step, finished=False)):
            stopped = True
            break

        if stage.due(step, "eval_every", last_step):
            with stage.evaluating(orig_model):
                val_loader = ConversationPacker(val_ds, tokenizer, B, Tlen, device, data_rank, data_world)
                val_bpb = evaluate_bpb(orig_model, val_loader, eval_steps, token_bytes)
            min_val_bpb = min(min_val_bpb, val_bpb)
            metrics.log(step, {"val/bpb": val_bpb}, console=f"step {step:05d} | val bpb: {val_bpb:.4f}")

        if last_step:
            break
        if step > start_step and stage.due(step, "save_every") and not dry_run:
            save(step, finished=False)

        progress = step / num_iterations if num_iterations > 0 else all_reduce_mean(position["progress"], device)
        lrm = lr_multiplier(progress)
        apply_schedule(optimizers, lrm, muon_momentum(step))
        loss, grad_norm, _, dt = stage.timed_step(step, model, optimizers, train_batches, grad_accum, config["grad_clip"])
        if num_iterations <= 0:
            epoch_done = any_rank(position["epoch"] >= 1, device)
            meter.num_iterations = step + 1 if epoch_done else max(step + 2, round((step + 1) / max(position["progress"], 1e-9)))
        stage.log_step(step, loss, dt, lrm, {"train/grad_norm": grad_norm},
                       f" | gnorm: {grad_norm:.3f}" if grad_norm is not None else "")
        step += 1

    # ---------------------------------------------------------------- wrap up
    if not dry_run and not stopped:
        save(step, finished=True)
    print0(f"Total training time: {format_duration(meter.total_time)}" +
           (f" | min val bpb: {min_val_bpb:.4f}" if val_bpb is not None else ""))
    stage.finish(None if dry_run else "Midtraining", [
        user_config,
        {"Training tasks": ", ".join(train_names), "Training conversations": len(train_ds),
         "Number of iterations": step, "Tokens per step": total_batch, "DDP world size": stage.world_size,
         "Recipe": recipe},
        {"Minimum validation bpb": min_val_bpb if val_bpb is not None else None, "Final validation bpb": val_bpb,
         "Total training time": format_duration(meter.total_time)},
    ], {"train/loss": ("Midtraining loss", "loss (EMA)"), "val/bpb": ("Midtraining validation bpb", "bits per byte")})
    return {"step": step, "val_bpb": val_bpb, "min_val_bpb": min_val_bpb, "checkpoint_dir": checkpoint_dir,
            "train_tasks": train_names}


if __name__ == "__main__":
    run_main(main)  # a usage error: one line, exit 2 (nanochat/usage.py); a bug keeps its traceback
