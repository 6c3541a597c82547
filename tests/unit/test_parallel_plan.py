"""
The run's parallel plan (nanochat/distributed/parallel.py), in one process: the data ranks it owns (tensor parallelism,
the --data_world_size replay), its capabilities, and `prepare`'s order. The multi-process behaviour it drives is pinned
by tests/distributed/test_dist_train.py, test_tp.py, test_fsdp.py, test_ac.py, test_fp8.py and test_compile.py.
"""

import pytest
import torch

from nanochat.distributed.dist import DataRanks
from nanochat.distributed.parallel import FSDP, DataParallel, parallel_from_config


def tp(n):
    return parallel_from_config({"tp_size": n})
from nanochat.gpt import GPT, GPTConfig

CONFIG = GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)


def tiny_model():
    torch.manual_seed(0)
    model = GPT(CONFIG, attn="sdpa")
    model.init_weights()
    return model


def test_the_plan_owns_the_data_ranks():
    # tp ranks of a group read the same data; only tp rank 0 counts a group's evaluation results
    assert [tp(2).bind(r, 8).data_ranks for r in (0, 1, 6, 7)] == [
        DataRanks(0, 4, 0), DataRanks(0, 4, 1), DataRanks(3, 4, 0), DataRanks(3, 4, 1)]
    assert FSDP().bind(5, 8).data_ranks == DataRanks(5, 8, 0)
    plan = parallel_from_config({"tp_size": 2}, rank=3, world=4)
    assert (plan.data_rank, plan.data_world, plan.read_ranks, plan.read_world) == (1, 2, [1], 2)
    # unbound: no silent fallback to the process's rank (wrong under TP)
    with pytest.raises(RuntimeError, match=r"not bound to this process's ranks: call parallel.bind"):
        DataParallel().data_ranks
    with pytest.raises(ValueError, match=r"--tp_size=3 does not divide the world size 4; use one of: 1, 2, 4"):
        parallel_from_config({"tp_size": 3}, rank=0, world=4)


def test_the_data_world_size_replay_is_the_plans():
    plan = parallel_from_config({"data_world_size": 4}, rank=0, world=1)
    assert (plan.data_rank, plan.data_world) == (0, 1)  # evaluations: the one real rank
    assert (plan.read_ranks, plan.read_world) == ([0, 1, 2, 3], 4)  # training data: as 4 ranks would read it
    with pytest.raises(ValueError, match=r"--data_world_size is for single-process runs"):
        parallel_from_config({"data_world_size": 4}, rank=0, world=2)


def test_a_script_that_samples_alone_refuses_a_plan_without_full_weights():
    with pytest.raises(ValueError, match=r"chat_rl samples on each rank alone, which --tp_size=2 cannot do.*use "
                                         r"--tp_size=1, with --use_fsdp=1"):
        parallel_from_config({"tp_size": 2}, samples_alone="chat_rl")
    assert parallel_from_config({"use_fsdp": True}, samples_alone="chat_rl").has_full_weights
    with pytest.raises(ValueError, match=r"this run samples on each rank alone, which --tp_size=2"):
        tp(2).full_weights(None)


def test_capabilities_not_names():
    plans = DataParallel(), FSDP(), tp(2)
    assert [p.shards_weights for p in plans] == [False, True, True]
    assert [p.fp8_supported for p in plans] == [True, True, False]
    assert [p.has_full_weights for p in plans] == [True, True, False]
    assert [p.collective_forward for p in plans] == [False, True, True]
    assert [p.reads_sharded_checkpoint for p in plans] == [False, True, True]  # TP reshards as FSDP does
    assert [p.checkpoint_format for p in plans] == ["single", "sharded", "sharded"]


def test_prepare_applies_ac_then_the_layout_then_compile(monkeypatch):
    import nanochat.compile as C

    seen = []

    def fake_compile(model, flag, device, batch_size, seq_len, per_block=False, autocast=None):
        seen.append((flag, batch_size, seq_len, per_block, [b.checkpointed for b in model.transformer.h]))
        return "compiled"

    monkeypatch.setattr(C, "maybe_compile", fake_compile)
    model = tiny_model()
    config = {"activation_checkpointing": "selective", "ac_every": 2, "compile": "1", "device_batch_size": 2,
              "max_seq_len": 16}
    train_model, orig = parallel_from_config(config).prepare(model, config, "cpu")  # AC: the plan's own flags
    assert (train_model, orig) == ("compiled", model)  # compile gets the wrapped model; the uncompiled one comes back
    assert seen == [("1", 2, 16, False, [True, False])]  # AC was in place before compile
    # a script without --compile (SFT, RL) gets its model back, uncompiled
    model = tiny_model()
    assert DataParallel().prepare(model, {}, "cpu") == (model, model)
    assert len(seen) == 1


def test_prepare_refuses_fp8_under_tp_before_any_collective():
    with pytest.raises(ValueError, match=r"--fp8=1 does not work with --tp_size=2 yet"):
        tp(2).prepare(tiny_model(), {"fp8": True}, "cpu")


def test_the_stage_skeleton_in_one_process(tmp_path):
    """nanochat/stage.py's pieces the scripts share: the bound plan, eval mode that always comes back, the step line."""
    from nanochat.metrics import read_metrics
    from nanochat.stage import Stage

    config = {"device_type": "cpu", "seed": 0, "dtype": "float32", "deterministic": False, "run": "dummy",
              "eval_every": 5, "embedding_lr": 0.2, "unembedding_lr": 0.004, "matrix_lr": 0.02, "weight_decay": 0.0}
    stage = Stage(config)
    assert stage.parallel.data_ranks == DataRanks(0, 1, 0) and stage.parallel.read_ranks == [0]
    assert [stage.due(s, "eval_every") for s in (0, 3, 5)] == [True, False, True]
    model = tiny_model()
    with pytest.raises(RuntimeError, match="boom"):
        with stage.evaluating(model):
            assert not model.training
            raise RuntimeError("boom")
    assert model.training  # back in train mode although the evaluation failed
    assert len(stage.optimizers(model)) == 2  # AdamW + Muon in one process
    stage.open_log(str(tmp_path), "nanochat-test", None, {})
    stage.start_meter(tokens_per_step=64, flops_per_token=1.0, num_iterations=10)
    stage.log_step(0, 2.5, 0.5, 1.0, {"train/grad_norm": 0.25}, mfu=False)
    assert not stage.stopping(1, 0, str(tmp_path))
    stage.finish()
    [record] = read_metrics(tmp_path / "metrics.jsonl")
    assert [k for k in record if k.startswith("train/")] == ["train/loss", "train/raw_loss", "train/lrm",
                                                             "train/grad_norm", "train/tok_per_sec"]
    assert record["step"] == 1 and record["train/raw_loss"] == 2.5 and record["train/tok_per_sec"] == 128
