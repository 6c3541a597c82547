"""
Supervised fine-tuning: one conversation per row, loss on the assistant's tokens only.

    python -m scripts.chat_sft
    python -m scripts.chat_sft --source=base --device_type=cpu --device_batch_size=4 --target_examples_per_step=8 --num_iterations=50
    torchrun --nproc_per_node=8 -m scripts.chat_sft

Loads the mid-trained model (--source=base starts from the base model instead), fine-tunes on ARC-Easy,
ARC-Challenge, GSM8K, 10k SmolTalk conversations, the identity conversations, SimpleSpelling and SpellingBee (a task
whose data cannot be found is left out with a message), with the learning rate decaying linearly to 0, and saves to
chatsft_checkpoints/<tag>/ (--model_tag names both the input and the output checkpoint, as nanochat). Every
--eval_every steps: loss per assistant token on the held-out conversations mid-training validates on (SmolTalk test,
MMLU test, GSM8K test); every --eval_metrics_every steps: MMLU and ARC-Easy accuracy (nanochat.chat_eval's
categorical evaluation).
"""

import os

import torch

from nanochat.attention import attn_flag
from nanochat.batching import sft_batch_arithmetic
from nanochat.checkpoint.resume import already_finished, require_resume_step, resume_flag
from nanochat.checkpoint.train_state import save_stage_model, save_train_state
from nanochat.checkpoint_manager import checkpoint_model_config, checkpoint_root
from nanochat.common import check_wandb, print0, print_banner
from nanochat.configurator import Flag, Flags, Rule, parse_flags_or_exit
from nanochat.data.conversations import check_stage_model, load_stage_model, scale_initial_lr, sft_batches
from nanochat.distributed.dist import all_reduce_mean
from nanochat.distributed.parallel import parallel_flags
from nanochat.recipe import checkpoint_recipe
from nanochat.stage import Stage
from nanochat.training import MicroBatches, apply_schedule, lr_multiplier, optimizer_flags, run_flags, source_flags
from nanochat.usage import BadValue, run_main
from tasks.suites import build_mixture, held_out_tasks

FLAGS = Flags(
    "run",
    run_flags(),
    "input model (--model_tag also names the output checkpoint)",
    source_flags("mid", ["base", "mid"]),
    "horizon and batch",
    Flag("device_batch_size", 4, "conversations per forward pass (rows are padded to the longest, so keep it small)",
         min=1),
    Flag("num_epochs", 1, "passes over the training mixture when --num_iterations is -1", min=1),
    Flag("num_iterations", -1, "optimisation steps; -1 = --num_epochs over the training mixture"),
    Flag("target_examples_per_step", 32, "conversations per optimisation step, over all ranks", min=1),
    "optimisation",
    optimizer_flags(),
    Flag("init_lr_frac", 0.02, "fine-tune at this fraction of the learning rates above"),
    Rule(("init_lr_frac",), lambda frac: frac > 0, "--init_lr_frac must be > 0 (got {init_lr_frac})"),
    "evaluation (<= 0 turns one off)",
    Flag("eval_every", 100, "validation loss every this many steps"),
    Flag("eval_steps", 100, "validation batches per rank", min=1),
    Flag("eval_metrics_every", 200, "MMLU and ARC-Easy accuracy every this many steps"),
    Flag("eval_metrics_max_problems", 1024, "problems per task for those accuracies", min=1),
    "checkpoints",
    Flag("save_every", -1, "checkpoint every this many steps, with the optimizer state to resume from (the final step "
         "is always saved, as the model alone)"),
    resume_flag(),
    "systems",
    attn_flag(),
    parallel_flags(),
)
DEFAULTS = FLAGS.defaults()

METRIC_TASKS = ["MMLU", "ARC-Easy"]


def train_tasks():
    """(name, factory) of the SFT mixture, nanochat's."""
    from tasks.arc import ARC
    from tasks.customjson import CustomJSON, identity_conversations_path
    from tasks.gsm8k import GSM8K
    from tasks.smoltalk import SmolTalk
    from tasks.spellingbee import SimpleSpelling, SpellingBee

    return [
        ("ARC-Easy", lambda: ARC(subset="ARC-Easy", split="train")),
        ("ARC-Challenge", lambda: ARC(subset="ARC-Challenge", split="train")),
        ("GSM8K", lambda: GSM8K(subset="main", split="train")),
        ("SmolTalk", lambda: SmolTalk(split="train", stop=10_000)),
        ("identity conversations", lambda: CustomJSON(filepath=identity_conversations_path())),
        ("SimpleSpelling", lambda: SimpleSpelling(size=300, split="train")),
        ("SpellingBee", lambda: SpellingBee(size=300, split="train")),
    ]


def chat_metrics(model, tokenizer, batch_size, max_problems, autocast, lockstep, ranks):
    """{task: accuracy} for METRIC_TASKS (nanochat.chat_eval); a task whose data is missing is left out with a note.
    lockstep: the model's forward is a collective (FSDP, TP)."""
    from nanochat.chat_eval import evaluate_task
    from nanochat.data.task_data import TaskDataNotFound
    from nanochat.engine import Engine
    from tasks.suites import build_eval_task_on_every_rank

    engine = Engine(model, tokenizer)
    metrics = {}
    with autocast():
        for task_name in METRIC_TASKS:
            try:
                task = build_eval_task_on_every_rank(task_name)
            except TaskDataNotFound as e:
                print0(f"Note: skipping the {task_name} accuracy: {e}")
                continue
            metrics[task_name] = evaluate_task(task, model, tokenizer, engine, batch_size=batch_size,
                                               max_problems=max_problems, lockstep=lockstep, ranks=ranks)
    return metrics


def startup_checks(config):
    """Before anything is built: the model exists (its shape from its meta), the step to resume from exists, wandb has
    a login. Returns (the model's tag, its step, its GPTConfig, the output checkpoint dir)."""
    source_tag, source_step = check_stage_model(config["source"], config["model_tag"], config["model_step"])
    model_config = checkpoint_model_config(config["source"], source_tag, source_step)
    checkpoint_dir = os.path.join(checkpoint_root("sft"), config["model_tag"] or f"d{model_config.n_layer}")
    require_resume_step(config, checkpoint_dir)
    check_wandb(config["run"])
    return source_tag, source_step, model_config, checkpoint_dir


def main(argv=None):
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    user_config = dict(config)
    source_tag, source_step, model_config, checkpoint_dir = startup_checks(config)
    print_banner()

    # device, process group, the parallel plan (its layout checked against the model's shape first): nanochat/stage.py
    stage = Stage(config, model_config=model_config)
    parallel, device = stage.parallel, stage.device
    data_rank, data_world = parallel.data_rank, parallel.data_world  # tp ranks of a group read the same data

    # batch arithmetic (whole conversations per step) and the data first: a batch that does not divide, or task data
    # that is missing, stops the run before the model loads
    B = config["device_batch_size"]
    grad_accum = sft_batch_arithmetic(config["target_examples_per_step"], B, data_world)
    train_ds, train_names = build_mixture(train_tasks(), "SFT data")
    val_ds, _ = build_mixture(held_out_tasks(), "SFT validation")

    model, tokenizer, source_meta = load_stage_model(config["source"], device, source_tag, source_step)
    attn = model.set_attn(config["attn"]).describe()
    model, _ = stage.prepare(model)  # --activation_checkpointing, --fp8, the layout
    recipe = checkpoint_recipe(source_meta)  # the base run's, recorded in this stage's meta and report too
    print0(f"Fine-tuning the {config['source']} model (step {source_meta.get('step')}, {recipe} recipe): {model_config} "
           f"| attn {attn}")
    print0(f"Batch: {B} conversations x {data_world} rank(s) x {grad_accum} accumulation = "
           f"{config['target_examples_per_step']} conversations/step")

    # data: rows longer than the model's context are truncated (nanochat: 2048 = its sequence_len)
    max_tokens = model_config.sequence_len + 1
    train_iter = sft_batches(train_ds, tokenizer, B, device, data_rank, data_world, max_tokens)

    num_iterations = config["num_iterations"]
    if num_iterations <= 0:
        num_iterations = (len(train_ds) // config["target_examples_per_step"]) * config["num_epochs"]
        if num_iterations < 1:
            raise BadValue(f"{len(train_ds)} conversations make no step of {config['target_examples_per_step']}: "
                             f"lower --target_examples_per_step or set --num_iterations")
    print0(f"Training for {num_iterations:,} steps")

    optimizers = stage.optimizers(model)
    scale_initial_lr(optimizers, config["init_lr_frac"])

    if already_finished(config, checkpoint_dir, num_iterations):
        stage.close()
        return {"step": num_iterations, "checkpoint_dir": checkpoint_dir}
    start_step, loop = stage.resume(checkpoint_dir, model, optimizers, ("meter",))
    metrics_log = stage.open_log(checkpoint_dir, "nanochat-sft", start_step if loop is not None else None, user_config)
    meter = stage.start_meter(0, model.estimate_flops(), num_iterations, loop["meter"] if loop else None)

    # every rank counts what it processed (for tok/s) and what it trained on (tokens with a target)
    counts = torch.zeros(2, dtype=torch.float64, device=device)

    def on_take(batch):  # counted when trained on (the next step's first batch is fetched during this step)
        x, y = batch
        counts[0] += x.numel()
        counts[1] += (y >= 0).sum()

    train_batches = MicroBatches(lambda: next(train_iter), on_take)
    for _ in range(start_step * grad_accum):  # a resumed run: the batches the saved run already trained on
        train_batches.take()

    def save(step, final):
        meta = {"model_config": vars(model_config), "user_config": user_config, "val_loss": val_loss, **metrics,
                "recipe": recipe, "source": {"phase": config["source"], "model_tag": config["model_tag"] or None,
                                             "step": source_meta.get("step")}}
        if final:  # nanochat's SFT checkpoint: the model alone
            save_stage_model(checkpoint_dir, step, model, meta, parallel)
        else:  # one to resume from: the optimizer state too
            save_train_state(checkpoint_dir, step, model, optimizers, dict(meta, loop_state={"meter": meter.state_dict()}),
                             None, parallel)
        print0(f"Saved SFT checkpoint step {step} to {checkpoint_dir}")

    # ---------------------------------------------------------------- the loop
    val_loss, metrics, train_loss = None, {}, None
    step = start_step
    for step in range(start_step, num_iterations + 1):
        last_step = step == num_iterations
        if stage.stopping(step, start_step, checkpoint_dir, lambda: save(step, final=False)):
            break

        if stage.due(step, "eval_every", last_step):
            with stage.evaluating(model):
                val_iter = sft_batches(val_ds, tokenizer, B, device, data_rank, data_world, max_tokens)
                val_loss = validation_loss(model, val_iter, config["eval_steps"], device)
            metrics_log.log(step, {"val/loss": val_loss}, console=f"step {step:05d} | validation loss: {val_loss:.6f}")

        if stage.due(step, "eval_metrics_every", last_step):
            # FSDP/TP: every forward is a collective, so ranks with fewer problems run filler forwards (lockstep)
            with stage.evaluating(model):
                out = chat_metrics(model, tokenizer, 2 * B, config["eval_metrics_max_problems"], stage.autocast,
                                   lockstep=parallel.collective_forward, ranks=parallel.data_ranks)
            if out:
                metrics = out
                metrics_log.log(step, {f"eval/{k}_acc": v for k, v in metrics.items()},
                                console=f"step {step:05d} | " + " | ".join(f"{k} acc: {v:.4f}" for k, v in metrics.items()))

        if last_step:
            save(step, final=True)
            break
        if step > start_step and stage.due(step, "save_every", at_last=False):
            save(step, final=False)

        lrm = lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=1.0)  # = 1 - step/num_iterations
        apply_schedule(optimizers, lrm)
        counts.zero_()
        train_loss, _, _, dt = stage.timed_step(step, model, optimizers, train_batches, grad_accum, grad_clip=0.0)
        processed, trained = (all_reduce_mean(c, device) * data_world for c in counts.tolist())  # tp ranks count the same rows
        meter.tokens_per_step = processed  # rows are padded to each batch's longest: the count changes every step
        stage.log_step(step, train_loss, dt, lrm, {"train/num_tokens": trained}, f" | trained tokens: {int(trained):,}",
                       mfu=False)

    # ---------------------------------------------------------------- wrap up
    stage.finish("Chat SFT", [
        user_config,
        {"Training tasks": ", ".join(train_names), "Training rows": len(train_ds),
         "Number of iterations": num_iterations, "DDP world size": stage.world_size, "Recipe": recipe},
        {"Training loss": train_loss, "Validation loss": val_loss, **metrics},
    ], {"train/loss": ("Chat SFT loss", "loss (EMA)"), "val/loss": ("Chat SFT validation loss", "loss")})
    return {"step": step, "train_loss": train_loss, "val_loss": val_loss, "metrics": metrics,
            "checkpoint_dir": checkpoint_dir, "train_tasks": train_names}


def validation_loss(model, val_iter, steps, device):
    """Loss per trained token (those with a target) over every rank's `steps` batches of the held-out conversations."""
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, trained tokens
    with torch.no_grad():
        for _ in range(steps):
            x, y = next(val_iter)
            sums[0] += model(x, y, loss_reduction="sum").double()
            sums[1] += (y >= 0).sum()
    loss_sum, n_tokens = (all_reduce_mean(v, device) for v in sums.tolist())
    return loss_sum / n_tokens


if __name__ == "__main__":
    run_main(main)  # a usage error: one line, exit 2 (nanochat/usage.py); a bug keeps its traceback
