"""
Mid-training, SFT and RL: the RL arithmetic on toy batches, and the three stages run end to end on CPU from a tiny
base checkpoint, each saving a checkpoint the next stage loads.
"""

import math
from pathlib import Path

import pytest
import torch

from nanochat.checkpoint_manager import load_model, save_checkpoint
from chat_fixtures import tiny_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[1] / "assets" / "data"  # excerpts of ../shared/data (tests/assets/README.md)


def require_chat_data():
    for sub in ("gsm8k/train.jsonl", "sft/identity_conversations.jsonl", "arc", "mmlu/test", "words/words_alpha.txt"):
        if not (SHARED_DATA / sub).exists():
            pytest.skip(f"real chat data not found: {SHARED_DATA / sub}")


@pytest.fixture
def chat_env(tmp_path, monkeypatch):
    """
    A base dir with a small real tokenizer and a d1 base checkpoint; the task data from ../shared/data, and the
    Hugging Face hub pointed at a closed local port so the missing datasets (SmolTalk, MMLU auxiliary_train) fail
    at once instead of being downloaded.
    """
    require_chat_data()
    from nanochat.training import init_model
    from nanochat.gpt import config_for_depth
    from nanochat.tokenizer import compute_token_bytes, save_token_bytes

    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(SHARED_DATA))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    torch.set_num_threads(1)

    tok = tiny_tokenizer()
    tok_dir = base / "tokenizer"
    tok.save(str(tok_dir))
    save_token_bytes(compute_token_bytes(tok), str(tok_dir))
    torch.manual_seed(0)
    config = config_for_depth(1, tok.get_vocab_size(), 128)
    model = init_model(config, "cpu")
    save_checkpoint(str(base / "base_checkpoints" / "d1"), 0, model.state_dict(), None,
                    {"model_config": vars(config), "step": 0})
    return base


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a)


# -----------------------------------------------------------------------------
# RL arithmetic


def test_advantages_are_reward_minus_mean():
    from scripts.chat_rl import advantages_from_rewards

    assert advantages_from_rewards([1.0, 0.0, 0.0, 1.0]).tolist() == [0.5, -0.5, -0.5, 0.5]
    assert advantages_from_rewards([1.0, 0.0, 0.0, 0.0]).tolist() == [0.75, -0.25, -0.25, -0.25]
    assert advantages_from_rewards([1.0, 1.0]).tolist() == [0.0, 0.0]  # nothing to learn when all agree


def test_policy_gradient_loss_on_a_uniform_model():
    """lm_head starts at zero, so every token has log p = -ln V: the loss is hand-computable."""
    from nanochat.training import init_model
    from nanochat.gpt import config_for_depth
    from scripts.chat_rl import policy_gradient_loss

    V = 300
    model = init_model(config_for_depth(1, V, 32), "cpu")
    inputs = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
    targets = torch.tensor([[6, 7, 8, -1, -1], [-1, -1, -1, 14, -1]])  # 3 trained tokens in row 0, 1 in row 1
    advantages = torch.tensor([0.5, -0.5])
    loss = policy_gradient_loss(model, inputs, targets, advantages)
    # -(3 * 0.5 * (-ln V) + 1 * (-0.5) * (-ln V)) / 4 = ln V / 4
    assert loss.item() == pytest.approx(math.log(V) / 4, rel=1e-5)


def test_policy_gradient_step_moves_probability_towards_rewarded_samples():
    from nanochat.training import init_model, train_step
    from nanochat.gpt import config_for_depth
    from scripts.chat_rl import micro_batches, policy_gradient_loss

    torch.manual_seed(0)
    model = init_model(config_for_depth(1, 64, 32), "cpu")
    optimizers = model.setup_optimizers(unembedding_lr=0.02, embedding_lr=0.02, matrix_lr=0.002)
    prompt = [1, 2, 3]
    good, bad = prompt + [10, 11, 12], prompt + [20, 21, 22]
    masks = [[0, 0, 0, 1, 1, 1]] * 2

    def logp(seq):
        x, y = torch.tensor([seq[:-1]]), torch.tensor([[-1] * 2 + seq[3:]])
        with torch.no_grad():
            return -model(x, y, loss_reduction="sum").item()

    before = logp(good), logp(bad)
    (batch,) = micro_batches([good, bad], masks, torch.tensor([0.5, -0.5]), 2, pad_id=0, device="cpu")
    assert batch[1].tolist() == [[-1, -1, 10, 11, 12], [-1, -1, 20, 21, 22]]  # the prompt is not trained
    it = iter([batch])
    train_step(model, optimizers, lambda: next(it), 1, grad_clip=0.0,
                 loss_fn=lambda m, b: policy_gradient_loss(m, b[0], b[1], b[2]))
    after = logp(good), logp(bad)
    assert after[0] > before[0] and after[1] < before[1]


class ScriptedEngine:
    """Returns fixed completions (as text) in place of sampling, to check the reward and mask wiring."""

    def __init__(self, tokenizer, completions):
        self.tokenizer, self.completions, self.calls = tokenizer, list(completions), []

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        self.calls.append((num_samples, kwargs["seed"]))
        out = [self.completions.pop(0) for _ in range(num_samples)]
        seqs = [list(tokens) + self.tokenizer.encode(c) for c in out]
        masks = [[0] * len(tokens) + [1] * (len(s) - len(tokens)) for s in seqs]
        return seqs, masks


def test_rollout_rewards_gsm8k_answers():
    require_chat_data()
    from scripts.chat_rl import advantages_from_rewards, rollout
    from tasks.gsm8k import GSM8K

    tok = tiny_tokenizer()
    task = GSM8K(subset="main", split="train", data_dir=str(SHARED_DATA))
    conversation = task[0]  # Natalia's clips: the answer is 72
    assert conversation["messages"][-1]["content"][-1]["text"].endswith("#### 72")
    engine = ScriptedEngine(tok, ["She sold 72 clips.\n#### 72", "#### 48", "no idea", "48 + 24 = 72\n#### 72", "#### 7,2"])
    seqs, masks, rewards = rollout(engine, tok, task, conversation, num_samples=5, device_batch_size=2, seed=100,
                                   max_tokens=32, temperature=1.0, top_k=50)
    assert rewards == [1.0, 0.0, 0.0, 1.0, 1.0]  # "7,2" has its comma dropped, as GSM8K's extraction does
    assert engine.calls == [(2, 100), (2, 101), (1, 102)]  # device_batch_size at a time, a new seed per pass
    assert advantages_from_rewards(rewards).tolist() == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4])
    prompt = tok.render_for_completion(conversation)
    assert all(s[: len(prompt)] == prompt and m[: len(prompt)] == [0] * len(prompt) for s, m in zip(seqs, masks))


@pytest.mark.slow  # 17-29 s on the shared 2-core CPU (the fast lane's batched-vs-Engine check: test_chat_eval)
def test_batched_rollouts_are_the_engines_and_ignore_the_other_questions():
    """--rollout_batch: every question's passes decode together through the scheduler. At temperature 0 the samples,
    masks and rewards are the Engine's (one question at a time); sampled, a question's rollouts are the same whether
    it shares the batch with other questions or not (what makes 1 rank x N questions == 2 ranks x N/2)."""
    require_chat_data()
    from nanochat.engine import Engine
    from scripts.chat_rl import evaluate_pass_at_k, rollouts
    from tasks.gsm8k import GSM8K
    from tests.chat_fixtures import tiny_model

    tok = tiny_tokenizer()
    model = tiny_model(tok.get_vocab_size(), depth=2, sequence_len=256, seed=2)
    engine = Engine(model, tok)
    task = GSM8K(subset="main", split="train", data_dir=str(SHARED_DATA))
    convs = [task[i] for i in range(3)]
    greedy = dict(max_tokens=8, temperature=0.0, top_k=50)
    seeds = [10, 20, 30]
    by_engine = rollouts(engine, tok, task, convs, 3, 2, seeds, 0, **greedy)
    assert rollouts(engine, tok, task, convs, 3, 2, seeds, 8, **greedy) == by_engine
    sampled = dict(max_tokens=8, temperature=1.0, top_k=50)
    together = rollouts(engine, tok, task, convs, 5, 2, seeds, 6, **sampled)
    apart = [rollouts(engine, tok, task, [c], 5, 2, [seed], 6, **sampled)[0] for c, seed in zip(convs, seeds)]
    assert together == apart and len({tuple(s) for s in together[0][0]}) > 1
    assert evaluate_pass_at_k(task, engine, tok, 3, 2, "cpu", seed=1, rollout_batch=8, **greedy) == \
        evaluate_pass_at_k(task, engine, tok, 3, 2, "cpu", seed=1, **greedy)


# -----------------------------------------------------------------------------
# the three stages end to end


def test_mid_sft_rl_chain(chat_env, capsys):
    from scripts import chat_rl, chat_sft, mid_train

    base_model, _, _ = load_model("base", "cpu", "eval")

    mid = mid_train.main(["--device_type=cpu", "--max_seq_len=64", "--device_batch_size=2", "--total_batch_size=256",
                          "--num_iterations=3", "--eval_every=2", "--eval_tokens=256"])
    out = capsys.readouterr().out
    assert "leaving out SmolTalk" in out and "leaving out MMLU auxiliary_train" in out  # not in ../shared/data
    assert mid["train_tasks"] == ["GSM8K", "identity conversations", "identity conversations (2nd epoch)",
                                  "SimpleSpelling", "SpellingBee"]
    assert mid["step"] == 3 and math.isfinite(mid["val_bpb"])
    mid_model, _, mid_meta = load_model("mid", "cpu", "eval")
    assert mid_meta["step"] == 3 and mid_meta["model_config"] == vars(base_model.config)
    assert mid_meta["recipe"] == "december"  # a base meta from before the "recipe" key: a December model_config
    assert changed(params(base_model), params(mid_model))

    sft = chat_sft.main(["--device_type=cpu", "--device_batch_size=2", "--target_examples_per_step=4",
                         "--num_iterations=2", "--eval_every=2", "--eval_steps=2", "--eval_metrics_every=2",
                         "--eval_metrics_max_problems=4"])
    out = capsys.readouterr().out
    assert "leaving out SmolTalk" in out
    assert sft["step"] == 2 and math.isfinite(sft["train_loss"]) and math.isfinite(sft["val_loss"])
    assert set(sft["metrics"]) == {"MMLU", "ARC-Easy"}  # categorical eval via scripts.chat_eval
    assert all(0.0 <= v <= 1.0 for v in sft["metrics"].values())
    sft_model, _, sft_meta = load_model("sft", "cpu", "eval")
    assert sft_meta["source"]["phase"] == "mid" and sft_meta["val_loss"] == sft["val_loss"]
    assert sft_meta["recipe"] == "december"
    assert changed(params(mid_model), params(sft_model))

    rl = chat_rl.main(["--device_type=cpu", "--num_samples=2", "--device_batch_size=2", "--examples_per_step=2",
                       "--max_new_tokens=8", "--num_iterations=2", "--eval_every=2", "--eval_examples=2",
                       "--save_every=-1"])
    out = capsys.readouterr().out
    assert "pass@1" in out and "pass@2" in out
    assert rl["step"] == 2 and len(rl["rewards"]) == 2 and all(0.0 <= r <= 1.0 for r in rl["rewards"])
    assert len(rl["pass_at_k"]) == 2 and rl["pass_at_k"][0] <= rl["pass_at_k"][1]
    _, _, rl_meta = load_model("rl", "cpu", "eval")
    assert rl_meta["step"] == 2 and rl_meta["source"]["phase"] == "sft" and rl_meta["recipe"] == "december"

    # one metrics path: every stage's metrics.jsonl has the same namespaced keys for the same things
    from nanochat.metrics import read_metrics

    keys = {stage: set().union(*read_metrics(chat_env / f"{stage}_checkpoints" / "d1" / "metrics.jsonl"))
            for stage in ("mid", "chatsft", "chatrl")}
    assert {"step", "train/loss", "train/lrm", "val/bpb"} <= keys["mid"]
    assert {"step", "train/loss", "train/lrm", "val/loss", "eval/MMLU_acc", "eval/ARC-Easy_acc"} <= keys["chatsft"]
    assert {"step", "train/loss", "train/lrm", "rl/reward", "eval/pass@1", "eval/pass@2"} <= keys["chatrl"]

    report_dir = chat_env / "report"
    for name in ("midtraining.md", "chat-sft.md", "chat-rl.md", "curve-midtraining-loss.json",
                 "curve-chat-sft-loss.json", "curve-chat-rl-mean-reward.json"):
        assert (report_dir / name).exists(), name


def test_missing_checkpoint_names_the_command(chat_env):
    from scripts import chat_rl, chat_sft

    with pytest.raises(FileNotFoundError, match=r"python -m scripts\.mid_train"):
        chat_sft.main(["--device_type=cpu"])
    with pytest.raises(FileNotFoundError, match=r"python -m scripts\.chat_sft"):
        chat_rl.main(["--device_type=cpu"])
    # RL samples on each rank alone: tensor parallelism (every forward a collective) is refused before any loading
    with pytest.raises(ValueError, match=r"use --tp_size=1, with --use_fsdp=1"):
        chat_rl.main(["--device_type=cpu", "--tp_size=2"])


def test_mid_one_epoch_mode_stops_after_one_pass(chat_env, monkeypatch, capsys):
    """--num_iterations=-1: train until the packed stream has used every conversation of the mixture once."""
    from nanochat.tokenizer import get_tokenizer
    from scripts import mid_train
    from tasks.customjson import CustomJSON

    path = str(SHARED_DATA / "sft" / "identity_conversations.jsonl")
    monkeypatch.setattr(mid_train, "train_tasks", lambda: [("identity (first 6)", lambda: CustomJSON(filepath=path, stop=6))])
    mixture = mid_train.build_mixture(mid_train.train_tasks(), "check")[0]
    tok = get_tokenizer()
    total = sum(len(tok.render_conversation(mixture[i])[0]) for i in range(len(mixture)))
    BT = 2 * 64
    out = mid_train.main(["--device_type=cpu", "--max_seq_len=64", "--device_batch_size=2", f"--total_batch_size={BT}",
                          "--num_iterations=-1", "--eval_every=-1"])
    # step s reads tokens up to s*BT (+1 for the last target): the first step that needs more than one pass is the last
    assert out["step"] == (total - 1) // BT + 1
    assert out["val_bpb"] is None  # evaluation was turned off
    _, _, meta = load_model("mid", "cpu", "eval")
    assert meta["step"] == out["step"]


@pytest.mark.slow
@pytest.mark.dist
def test_sft_and_rl_two_ranks_match_one_process(chat_env, capsys, monkeypatch):
    """Examples are split over ranks: 2 ranks x 1 conversation == 1 process x 2 accumulated, step for step (SFT, on the
    DDP path and under FSDP); 2 ranks x 1 question == 1 process x 2 questions, same samples and update (RL, both)."""
    import shutil

    from conftest import subprocess_env
    from ranks import run_ranks
    from nanochat.checkpoint_manager import load_checkpoint
    from nanochat.metrics import read_metrics
    from scripts import chat_rl, chat_sft

    def sft_args(tag, eval_steps):
        return ["--source=base", "--device_type=cpu", "--device_batch_size=1", "--target_examples_per_step=2",
                "--num_iterations=3", "--eval_every=3", f"--eval_steps={eval_steps}", "--eval_metrics_every=3",
                "--eval_metrics_max_problems=4", f"--model_tag={tag}"]

    for tag in ("one", "two"):  # --model_tag names the input checkpoint and the output one (as nanochat)
        shutil.copytree(chat_env / "base_checkpoints" / "d1", chat_env / "base_checkpoints" / tag)
    # validation: the single process reads 2 batches of 1 row, each of the 2 ranks 1 batch: the same rows
    def series(path, key):
        return [(r["step"], r[key]) for r in read_metrics(path) if key in r]

    def assert_same_series(a, b, abs):
        assert [s for s, _ in a] == [s for s, _ in b]
        assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=abs)

    root = chat_env / "chatsft_checkpoints"

    def assert_same_sft(one_tag, multi_tag):
        """The multi-rank run's losses, accuracies and final model are the single process's."""
        one, multi = root / one_tag / "metrics.jsonl", root / multi_tag / "metrics.jsonl"
        assert [s for s, _ in series(one, "train/loss")] == [1, 2, 3] and [s for s, _ in series(one, "val/loss")] == [0, 3]
        assert_same_series(series(multi, "train/loss"), series(one, "train/loss"), abs=1e-5)
        assert_same_series(series(multi, "val/loss"), series(one, "val/loss"), abs=1e-6)
        for key in ("eval/MMLU_acc", "eval/ARC-Easy_acc"):
            assert len(series(one, key)) == 2 and series(multi, key) == series(one, key)
        a, _, _ = load_checkpoint(str(root / one_tag), 3, "cpu")
        b, _, _ = load_checkpoint(str(root / multi_tag), 3, "cpu")
        for k in a:
            assert torch.allclose(a[k], b[k], atol=1e-5), k

    single = chat_sft.main(sft_args("one", 2))
    run_ranks(["-m", "scripts.chat_sft", *sft_args("two", 1)], env=subprocess_env(chat_env))
    assert single["step"] == 3
    assert_same_sft("one", "two")

    # FSDP: every forward is a collective, so the accuracy evals run in lockstep. 5 problems: data rank 0 has 3 (two
    # batches of 2), rank 1 has 2 (one batch) and runs a filler forward; without it rank 0 would wait forever.
    def odd(args):
        return [a.replace("--eval_metrics_max_problems=4", "--eval_metrics_max_problems=5") for a in args]

    shutil.copytree(chat_env / "base_checkpoints" / "d1", chat_env / "base_checkpoints" / "fsdp")
    shutil.copytree(chat_env / "base_checkpoints" / "d1", chat_env / "base_checkpoints" / "one5")
    chat_sft.main(odd(sft_args("one5", 2)))
    p = run_ranks(["-m", "scripts.chat_sft", *odd(sft_args("fsdp", 1)), "--use_fsdp=1"], env=subprocess_env(chat_env))
    assert "skipping" not in p.stdout
    assert_same_sft("one5", "fsdp")

    # RL: GSM8K's reward swapped for one this tiny model earns (tests/dist_scripts/rl_parity.py), so the update is
    # not zero. One step on the DDP path and under FSDP (the d40+ layout: each rank gathers the whole model to sample,
    # fsdp.full_weights, so rollouts of different lengths need no lockstep) gives the same samples, rewards, loss and
    # updated model as 1 process. (One step: after an update, the ~1e-8 differences between the paths' weights can
    # flip a sampled token, as any two numerically different runs can; tests/distributed/test_fsdp.py covers full_weights itself.)
    import importlib.util

    from tasks.gsm8k import GSM8K

    script = Path(__file__).resolve().parents[1] / "dist_scripts" / "rl_parity.py"
    spec = importlib.util.spec_from_file_location("rl_parity", script)
    rl_parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rl_parity)
    rl_args = ["--device_type=cpu", "--model_tag=one", "--num_samples=4", "--device_batch_size=2",
               "--examples_per_step=2", "--max_new_tokens=12", "--num_iterations=1", "--eval_every=1",
               "--eval_examples=2", "--save_every=-1"]
    rl_dir = chat_env / "chatrl_checkpoints" / "one"  # every run writes here: read each one's results in between
    keys = ("rl/reward", "rl/sequence_length", "train/loss", "eval/pass@1", "eval/pass@2")

    def rl_run(launch):
        out = launch()
        metrics = {k: series(rl_dir / "metrics.jsonl", k)[-2:] for k in keys}
        return metrics, load_checkpoint(str(rl_dir), 1, "cpu")[0], out

    monkeypatch.setattr(GSM8K, "reward", rl_parity.parity_reward)
    single, single_model, _ = rl_run(lambda: chat_rl.main(rl_args))
    assert [s for s, _ in single["rl/reward"]] == [1] and [s for s, _ in single["eval/pass@1"]] == [0, 1]
    assert 0 < single["rl/reward"][0][1] < 1 and single["train/loss"][0][1] != 0
    sft_model, _, _ = load_checkpoint(str(root / "one"), 3, "cpu")  # where RL started: the update moved it
    assert any(not torch.equal(single_model[k], sft_model[k]) for k in single_model)
    for extra in ([], ["--use_fsdp=1"]):
        got, model, proc = rl_run(lambda: run_ranks([str(script), *rl_args, *extra], env=subprocess_env(chat_env)))
        assert "returned a view tensor" not in proc.stderr  # FSDP2's warning: the per-token loss is not a view
        for key in keys:
            assert_same_series(got[key], single[key], abs=1e-5 if key == "train/loss" else 1e-9)
        # within float noise of how far the step moved each tensor: AdamW divides an embedding row's gradient by its
        # own magnitude, so a rarely seen token's row turns the reduction order's ~1e-9 into ~1e-6 (measured under
        # FSDP: wte 3.8e-6 of a 0.035 move, 1.1e-4 of it; every other tensor <= 1.5e-8); a lost or doubled gradient
        # would be off by the whole move
        for k in single_model:
            moved = (single_model[k] - sft_model[k]).abs().max().item()
            assert torch.allclose(model[k], single_model[k], rtol=0, atol=1e-6 + 1e-3 * moved), (extra, k)


@pytest.mark.slow  # each stage runs three times
def test_every_stage_resumes_where_it_stopped(chat_env, capsys):
    """mid_train, chat_sft and chat_rl with --save_every: a run that lost everything after step 2 (killed there) and
    is started again with --resume_from_step=auto ends with the weights of the run that was never stopped; started
    once more after its last step, it does not train again."""
    from nanochat.checkpoint_manager import checkpoint_root, load_checkpoint
    from scripts import chat_rl, chat_sft, mid_train

    steps = 4
    stages = [
        ("mid", mid_train, ["--max_seq_len=64", "--device_batch_size=2", "--total_batch_size=256", "--eval_every=-1"],
         "mid-training is complete"),
        ("sft", chat_sft, ["--device_batch_size=2", "--target_examples_per_step=4", "--eval_every=-1",
                           "--eval_metrics_every=-1"], "this stage is complete"),
        ("rl", chat_rl, ["--num_samples=2", "--device_batch_size=2", "--examples_per_step=2", "--max_new_tokens=8",
                         "--eval_every=-1"], "this stage is complete"),
    ]
    for source, script, args, done in stages:
        args = ["--device_type=cpu", f"--num_iterations={steps}", "--save_every=2", *args]
        d = Path(checkpoint_root(source)) / "d1"
        script.main(args)
        full = load_checkpoint(str(d), steps, "cpu")[0]
        assert (d / f"optim_{2:06d}_rank0.pt").exists()  # the intermediate step carries what a resume needs
        for f in d.glob(f"*_{steps:06d}*"):
            f.unlink()
        capsys.readouterr()
        script.main(args + ["--resume_from_step=auto"])
        assert f"resuming from step 2 in {d}" in capsys.readouterr().out, source
        resumed = load_checkpoint(str(d), steps, "cpu")[0]
        assert all(torch.equal(full[k], resumed[k]) for k in full), source
        out = script.main(args + ["--resume_from_step=auto"])
        assert done in capsys.readouterr().out and out["step"] == steps, source


@pytest.mark.slow  # two stages, each run three times as a process
@pytest.mark.parametrize("stage", ["mid", "sft"])
def test_ctrl_c_saves_the_step_and_auto_resume_finishes_the_same_run(chat_env, stage):
    """Ctrl-C (SIGINT) to mid_train / chat_sft mid-run, --deterministic: the step finishes and is saved, exit 130
    with one line saying where and how to resume; --resume_from_step=auto then ends with the weights of a run that
    was never stopped, bit for bit."""
    import signal
    import subprocess
    import sys

    from conftest import REPO, subprocess_env
    from nanochat.checkpoint.steps import latest_resumable_step
    from nanochat.checkpoint_manager import load_checkpoint

    module, stage_args, out_root = {
        "mid": ("scripts.mid_train", ["--max_seq_len=64", "--device_batch_size=2", "--total_batch_size=256",
                                      "--eval_every=-1"], "mid_checkpoints"),
        "sft": ("scripts.chat_sft", ["--source=base", "--device_batch_size=2", "--target_examples_per_step=4",
                                     "--eval_every=-1", "--eval_metrics_every=-1"], "chatsft_checkpoints"),
    }[stage]
    steps = 8
    cmd = [sys.executable, "-m", module, "--device_type=cpu", f"--num_iterations={steps}", "--save_every=100",
           "--deterministic=1", *stage_args]
    env = subprocess_env(chat_env)
    full = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    d = chat_env / out_root / "d1"
    d.rename(chat_env / out_root / "full")  # --model_tag names the input model too: the stopped run writes d1 again

    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if f"step 00002/{steps:05d}" in line:
            break
    proc.send_signal(signal.SIGINT)
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=300) == 130, out[-3000:]
    stopped_at = latest_resumable_step(str(d))
    assert stopped_at is not None and 2 <= stopped_at < steps and "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == (
        f"Stopped at step {stopped_at} on a stop signal (Ctrl-C (SIGINT)): checkpoint saved in {d}; start the same "
        f"command with --resume_from_step=auto (or --resume_from_step={stopped_at}) to continue")

    resumed = subprocess.run(cmd + ["--resume_from_step=auto"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0 and f"resuming from step {stopped_at}" in resumed.stdout, resumed.stdout[-3000:]
    a, b = load_checkpoint(str(chat_env / out_root / "full"), steps, "cpu")[0], load_checkpoint(str(d), steps, "cpu")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
