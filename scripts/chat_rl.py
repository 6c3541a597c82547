"""
Reinforcement learning on GSM8K: REINFORCE with a per-question mean baseline, as nanochat.

    python -m scripts.chat_rl
    python -m scripts.chat_rl --device_type=cpu --num_samples=4 --device_batch_size=4 --examples_per_step=2 --max_new_tokens=64 --num_iterations=10
    torchrun --nproc_per_node=8 -m scripts.chat_rl

Each step, every rank takes examples_per_step / world_size GSM8K train questions; for each it samples num_samples
completions with the engine (calculator tool included), rewards each one (1 for the right '#### n', else 0) and sets
advantage = reward - mean reward of that question. The loss is -(log p(token) * advantage) summed over the sampled
tokens (the prompt and the tool outputs the engine forced are not trained) and divided by the number of those tokens.
Every --eval_every steps: pass@k on GSM8K test. Loads the SFT model, saves to chatrl_checkpoints/<tag>/.

--use_fsdp=1 (the d40+ presets' layout) shards the model for the update; for sampling each rank gathers the whole
model once per phase (nanochat.distributed.fsdp.full_weights), so its rollouts run without collectives, as on the DDP path.
"""

import itertools
import math
import os
import time

import torch

from nanochat.checkpoint.resume import already_finished, require_resume_step, resume_flag
from nanochat.checkpoint.train_state import save_stage_model, save_train_state
from nanochat.checkpoint_manager import checkpoint_model_config, checkpoint_root
from nanochat.common import check_wandb, print0, print_banner
from nanochat.configurator import Flag, Flags, Rule, parse_flags_or_exit
from nanochat.data.conversations import check_stage_model, collate_sft, load_stage_model, scale_initial_lr
from nanochat.distributed.dist import all_reduce_sum, dist_world_size, get_dist_info
from nanochat.distributed.parallel import parallel_flags, parallel_from_config
from nanochat.attention import attn_flag
from nanochat.engine import Engine, decode_compile_flag
from nanochat.recipe import checkpoint_recipe
from nanochat.stage import Stage
from nanochat.training import (
    apply_schedule, assert_finite, lr_multiplier, optimizer_flags, run_flags, source_flags, train_step
)
from nanochat.usage import BadValue, run_main

FLAGS = Flags(
    "run",
    run_flags(),
    "input model (--model_tag also names the output checkpoint)",
    source_flags("sft", ["sft", "mid"]),
    "sampling",
    Flag("num_samples", 16, "completions sampled per question", min=1),
    Flag("max_new_tokens", 256, "most tokens per completion", min=1),
    Flag("temperature", 1.0, "sampling temperature", min=0.0),
    Flag("top_k", 50, "sample among the k most likely tokens (0 = all)", min=0),
    Flag("rollout_batch", 64, "sequences sampled together across questions by the continuous-batching scheduler "
         "(nanochat/serving/scheduler.py); 0 = one question at a time through the Engine, device_batch_size "
         "samples per call", min=0),
    attn_flag(),
    decode_compile_flag(),
    "horizon and batch",
    Flag("device_batch_size", 8, "sequences per forward pass (sampling and training)", min=1),
    Flag("examples_per_step", 16, "questions per optimisation step, over all ranks (a multiple of the world size)",
         min=1),
    Flag("num_epochs", 1, "passes over GSM8K train when --num_iterations is -1", min=1),
    Flag("num_iterations", -1, "optimisation steps; -1 = --num_epochs over GSM8K train"),
    "optimisation",
    optimizer_flags(),
    Flag("init_lr_frac", 0.05, "train at this fraction of the learning rates above"),
    Rule(("init_lr_frac",), lambda frac: frac > 0, "--init_lr_frac must be > 0 (got {init_lr_frac})"),
    "memory (--tp_size is refused: sampling needs whole weights on each rank)",
    parallel_flags(),
    "periodic actions (<= 0 turns one off)",
    Flag("eval_every", 60, "pass@k on GSM8K test every this many steps"),
    Flag("eval_examples", 400, "GSM8K test questions for pass@k", min=1),
    Flag("save_every", 60, "checkpoint every this many steps, with the optimizer state to resume from (the final "
         "step is always saved, as the model alone)"),
    resume_flag(),
)
DEFAULTS = FLAGS.defaults()


# -----------------------------------------------------------------------------
# the pieces of one RL step


def sample_seed(seed, step, example_idx, sampling_pass):
    """A distinct, reproducible sampling seed per (run seed, step, question, pass), the same on any machine."""
    return (((seed * 1_000_003 + step) * 1_000_033 + example_idx) * 1_009 + sampling_pass) & 0x7FFFFFFF


def rollout(engine, tokenizer, task, conversation, num_samples, device_batch_size, seed, **sampling):
    """
    Sample num_samples completions of `conversation` (device_batch_size at a time) and reward each one.
    Returns (sequences, masks, rewards): sequences start with the prompt (mask 0); sampled tokens have mask 1 and
    tokens forced by the tool mask 0; rewards are task.reward(conversation, decoded completion).
    """
    prompt = tokenizer.render_for_completion(conversation)
    sequences, masks = [], []
    for p in range(math.ceil(num_samples / device_batch_size)):
        n = min(device_batch_size, num_samples - p * device_batch_size)
        seqs, ms = engine.generate_batch(prompt, num_samples=n, seed=seed + p, **sampling)
        sequences.extend(seqs)
        masks.extend(ms)
    rewards = [float(task.reward(conversation, tokenizer.decode(seq[len(prompt):]))) for seq in sequences]
    return sequences, masks, rewards


def rollouts(engine, tokenizer, task, conversations, num_samples, device_batch_size, seeds, rollout_batch, **sampling):
    """
    rollout() for each conversation (seeds[i] for the i-th): with rollout_batch > 0 the questions decode together
    through the continuous-batching scheduler, at most rollout_batch sequences at a time, each question one request
    of num_samples rows: its prompt is prefilled once (rollout() prefills it once per pass of device_batch_size) and,
    on CPU, its rows attend the prompt once per step (kv_slots.shared_prompt_attention). At temperature 0 the same
    sequences as rollout() (up to float rounding of the batched decode step); sampled, a question's samples depend on
    its seed alone, not on the other questions nor on rollout_batch (the scheduler's per-row uniforms).
    """
    if rollout_batch == 0:
        return [rollout(engine, tokenizer, task, c, num_samples, device_batch_size, seed, **sampling)
                for c, seed in zip(conversations, seeds)]
    from nanochat.serving.scheduler import Job, generate_many

    prompts = [tokenizer.render_for_completion(c) for c in conversations]
    jobs = [Job(prompt, num_samples=num_samples, seed=seed, max_tokens=sampling["max_tokens"],
                temperature=sampling["temperature"], top_k=sampling["top_k"]) for prompt, seed in zip(prompts, seeds)]
    out = generate_many(engine, jobs, max_batch=rollout_batch)
    return [(seqs, masks, [float(task.reward(c, tokenizer.decode(s[len(p):]))) for s in seqs])
            for c, p, (seqs, masks) in zip(conversations, prompts, out)]


def advantages_from_rewards(rewards):
    """REINFORCE baseline: each sample's reward minus the mean reward of its question's samples."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    return rewards - rewards.mean()


def policy_gradient_loss(model, inputs, targets, advantages):
    """
    -(sum over trained tokens of log p(token) * advantage of its sequence) / (number of trained tokens).
    targets are -1 on the prompt, forced tokens and padding: the model's per-token loss is 0 there.
    """
    logp = -model(inputs, targets, loss_reduction="none")  # (B, T) log-probs of the targets
    objective = (logp * advantages.unsqueeze(-1)).sum()
    num_valid = (targets >= 0).sum().clamp(min=1)
    return -objective / num_valid


def micro_batches(sequences, masks, advantages, device_batch_size, pad_id, device):
    """Split one question's samples into training micro-batches (inputs, targets, advantages) on `device`."""
    out = []
    for b0 in range(0, len(sequences), device_batch_size):
        b1 = b0 + device_batch_size
        inputs, targets = collate_sft(list(zip(sequences[b0:b1], masks[b0:b1])), pad_id)
        out.append((inputs.to(device), targets.to(device), advantages[b0:b1].to(device)))
    return out


@torch.no_grad()
def evaluate_pass_at_k(task, engine, tokenizer, num_examples, num_samples, device, seed=0, rollout_batch=0, **sampling):
    """
    pass@k for k = 1..num_samples on the first num_examples of `task`: the fraction of questions where one of the
    first k samples is correct. Ranks split the questions; the counts are summed over ranks. rollout_batch > 0: the
    questions decode together through the continuous-batching scheduler (same seeds), as rollouts() does.
    """
    _, rank, _, world_size = get_dist_info()
    hits = torch.zeros(num_samples, dtype=torch.float64, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    indices = list(range(rank, min(num_examples, len(task)), world_size))
    conversations = [task[idx] for idx in indices]
    prompts = [tokenizer.render_for_completion(c) for c in conversations]
    if rollout_batch:
        from nanochat.serving.scheduler import Job, generate_many

        jobs = [Job(p, num_samples=num_samples, seed=seed + idx, max_tokens=sampling["max_tokens"],
                    temperature=sampling["temperature"], top_k=sampling["top_k"]) for p, idx in zip(prompts, indices)]
        outputs = [seqs for seqs, _ in generate_many(engine, jobs, max_batch=rollout_batch)]
    else:
        outputs = [engine.generate_batch(p, num_samples=num_samples, seed=seed + idx, **sampling)[0]
                   for p, idx in zip(prompts, indices)]
    for conversation, prompt, seqs in zip(conversations, prompts, outputs):
        correct = [bool(task.evaluate(conversation, tokenizer.decode(s[len(prompt):]))) for s in seqs]
        hits += torch.tensor(list(itertools.accumulate(correct, lambda a, b: a or b)), dtype=torch.float64, device=device)
        total += 1
    if dist_world_size() > 1:
        torch.distributed.all_reduce(hits)
        torch.distributed.all_reduce(total)
    return (hits / total.clamp(min=1)).tolist()


# -----------------------------------------------------------------------------


def collect_rollouts(model, engine, tokenizer, task, questions, step, config, parallel, autocast, pad_id, device,
                     sampling):
    """One step's rollouts on this rank: num_samples completions of each question, rewarded, turned into advantages
    and micro-batches. Returns (micro-batches, sum of rewards, sum of sequence lengths)."""
    model.eval()
    batches, reward_sum, length_sum = [], 0.0, 0
    with parallel.full_weights(model), autocast():  # FSDP: gathered once; each rank's rollouts stop at their own lengths
        sampled = rollouts(engine, tokenizer, task, [task[idx] for idx in questions], config["num_samples"],
                           config["device_batch_size"], [sample_seed(config["seed"], step, idx, 0) for idx in questions],
                           config["rollout_batch"], **sampling)
    for seqs, masks, rewards in sampled:
        advantages = advantages_from_rewards(rewards)
        batches.extend(micro_batches(seqs, masks, advantages, config["device_batch_size"], pad_id, device))
        reward_sum += sum(rewards)
        length_sum += sum(len(s) for s in seqs)
    model.train()
    return batches, reward_sum, length_sum


def main(argv=None):
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    user_config = dict(config)
    # start-up checks, before anything is built: each rank samples alone, so a plan without full weights (tensor
    # parallelism) is refused first; the model exists (its shape from its meta); the step to resume from exists;
    # wandb has a login
    parallel_from_config(config, samples_alone="chat_rl")
    source_tag, source_step = check_stage_model(config["source"], config["model_tag"], config["model_step"])
    model_config = checkpoint_model_config(config["source"], source_tag, source_step)
    checkpoint_dir = os.path.join(checkpoint_root("rl"), config["model_tag"] or f"d{model_config.n_layer}")
    require_resume_step(config, checkpoint_dir)
    check_wandb(config["run"])
    world_size = get_dist_info()[3]  # torchrun's, before the process group exists
    if config["examples_per_step"] % world_size != 0:
        raise BadValue(f"--examples_per_step={config['examples_per_step']} must be divisible by the {world_size} ranks")
    examples_per_rank = config["examples_per_step"] // world_size
    print_banner()

    # the DDP path or FSDP2 (nanochat/stage.py, nanochat/distributed/parallel.py)
    stage = Stage(config, samples_alone="chat_rl", model_config=model_config)
    parallel, device, autocast = stage.parallel, stage.device, stage.autocast
    rank = stage.rank
    from tasks.gsm8k import GSM8K

    train_task = GSM8K(subset="main", split="train")  # before the model: missing data stops the run here
    val_task = GSM8K(subset="main", split="test")

    model, tokenizer, source_meta = load_stage_model(config["source"], device, source_tag, source_step)
    attn = model.set_attn(config["attn"]).describe()
    model, _ = stage.prepare(model)  # --activation_checkpointing, --fp8, the layout
    engine = Engine(model, tokenizer, config["decode_compile"])
    print0(f"attention: {attn}; decode step: {'compiled' if engine.decode_compiled else 'eager'}")
    pad_id = tokenizer.encode_special("<|assistant_end|>")
    recipe = checkpoint_recipe(source_meta)  # the base run's, recorded in this stage's meta and report too
    print0(f"RL on the {config['source']} model (step {source_meta.get('step')}, {recipe} recipe): {model_config}")

    num_iterations = config["num_iterations"]
    if num_iterations <= 0:
        num_iterations = (len(train_task) // config["examples_per_step"]) * config["num_epochs"]
    print0(f"Training for {num_iterations:,} steps of {config['examples_per_step']} questions x "
           f"{config['num_samples']} samples ({len(train_task):,} GSM8K train questions)")

    optimizers = stage.optimizers(model)
    scale_initial_lr(optimizers, config["init_lr_frac"])

    sampling = dict(max_tokens=config["max_new_tokens"], temperature=config["temperature"], top_k=config["top_k"])
    example_indices = itertools.cycle(range(rank, len(train_task), world_size))  # this rank's questions

    def save(step, passk, final):
        meta = {"model_config": vars(model_config), "user_config": user_config, "recipe": recipe, "pass_at_k": passk,
                "source": {"phase": config["source"], "model_tag": config["model_tag"] or None, "step": source_meta.get("step")}}
        if final:  # nanochat's RL checkpoint: the model alone
            save_stage_model(checkpoint_dir, step, model, meta, parallel)
        else:  # one to resume from: the optimizer state too
            save_train_state(checkpoint_dir, step, model, optimizers, dict(meta, loop_state={"pass_at_k": passk}),
                             None, parallel)
        print0(f"Saved RL checkpoint step {step} to {checkpoint_dir}")

    if already_finished(config, checkpoint_dir, num_iterations):
        stage.close()
        return {"step": num_iterations, "pass_at_k": None, "rewards": [], "checkpoint_dir": checkpoint_dir}
    start_step, loop = stage.resume(checkpoint_dir, model, optimizers, ("pass_at_k",))
    for _ in range(start_step * examples_per_rank):  # the questions the saved run already trained on
        next(example_indices)
    metrics = stage.open_log(checkpoint_dir, "nanochat-rl", start_step if loop is not None else None, user_config)

    # ---------------------------------------------------------------- the loop
    passk = loop["pass_at_k"] if loop else None
    step = start_step
    for step in range(start_step, num_iterations + 1):
        last_step = step == num_iterations
        if stage.stopping(step, start_step, checkpoint_dir, lambda: save(step, passk, final=False)):
            break

        if stage.due(step, "eval_every", last_step):
            with stage.evaluating(model), parallel.full_weights(model):  # each rank samples its own questions
                passk = evaluate_pass_at_k(val_task, engine, tokenizer, config["eval_examples"], config["device_batch_size"],
                                           device, seed=config["seed"], rollout_batch=config["rollout_batch"], **sampling)
            metrics.log(step, {f"eval/pass@{k + 1}": p for k, p in enumerate(passk)},
                        console=f"step {step:05d} | " + " | ".join(f"pass@{k + 1}: {p:.4f}" for k, p in enumerate(passk)))

        if step > start_step and (stage.due(step, "save_every", last_step, at_last=False) or last_step):
            save(step, passk, final=last_step)

        if last_step:
            break

        # rollouts: sample and reward with the current policy
        t0 = time.time()
        questions = [next(example_indices) for _ in range(examples_per_rank)]
        batches, reward_sum, length_sum = collect_rollouts(model, engine, tokenizer, train_task, questions, step, config,
                                                           parallel, autocast, pad_id, device, sampling)

        # policy-gradient update: every micro-batch's loss is averaged over all of this step's micro-batches
        lrm = lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=1.0)  # = 1 - step/num_iterations
        apply_schedule(optimizers, lrm)
        it = iter(batches)
        loss, _, _ = train_step(model, optimizers, lambda: next(it), len(batches), grad_clip=0.0, autocast=autocast,
                                loss_fn=lambda m, b: policy_gradient_loss(m, b[0], b[1], b[2]), parallel=parallel)
        dt = time.time() - t0
        assert_finite(loss, step)
        n_samples = examples_per_rank * config["num_samples"]
        reward_total, length_total, count = all_reduce_sum([reward_sum, length_sum, n_samples], device)
        mean_reward, mean_length = reward_total / count, length_total / count
        metrics.log(step + 1, {"train/loss": loss, "train/lrm": lrm, "rl/reward": mean_reward,
                               "rl/sequence_length": mean_length},
                    console=f"step {step + 1:05d}/{num_iterations:05d} | pg loss: {loss:.6f} | mean reward: "
                            f"{mean_reward:.4f} | mean sequence length: {mean_length:.1f} | lrm: {lrm:.2f} | dt: {dt:.2f}s")

    # ---------------------------------------------------------------- wrap up
    recent = [r for _, r in metrics.curve("rl/reward")[-10:]]
    stage.finish("Chat RL", [
        user_config,
        {"Number of iterations": num_iterations, "DDP world size": world_size, "Recipe": recipe,
         "Mean reward (last 10 steps)": sum(recent) / len(recent) if recent else None},
        {f"GSM8K test pass@{k + 1}": p for k, p in enumerate(passk)} if passk else {},
    ], {"rl/reward": ("Chat RL mean reward", "mean reward"), "eval/pass@1": ("Chat RL GSM8K pass@1", "pass@1")})
    return {"step": step, "pass_at_k": passk, "rewards": [r for _, r in metrics.curve("rl/reward")],
            "checkpoint_dir": checkpoint_dir}


if __name__ == "__main__":
    run_main(main)  # a usage error: one line, exit 2 (nanochat/usage.py); a bug keeps its traceback
