"""
Sharded checkpoints (nanochat/checkpoint/sharded.py) of a tiny FSDP GPT, for tests/distributed/test_sharded_checkpoint.py:

    torchrun --nproc_per_node=2 sharded_ckpt_check.py --mode=save --dir=D [--crash=1]
    torchrun --nproc_per_node=N sharded_ckpt_check.py --mode=load --dir=D          # N = 1, 2, 4

save: train STEPS steps on 2 ranks; at step STEPS save the same state three ways: sharded (D/sharded), the
gather-to-rank-0 single-file path (D/single), and sharded with async_save (D/async: training goes on while it is
written, so it must hold the state of its step, not a later one); rank 0 writes the full model + optimizer state (D/saved.pt); then
train MORE steps and write the final weights and losses (D/continued_w2.pt).
--crash=1: then start saving step STEPS + MORE and kill rank 1 with SIGKILL while it writes its shard.
load: fresh model and optimizers (another seed), load D/sharded's step through train_state.load_train_state, write the
full state as loaded (D/loaded_wN.pt), train MORE steps on the same global batches, write D/continued_wN.pt.
Every rank takes its rows of the same global batch, so the math of every world size is the same up to the order of
floating-point sums. --record=1 (both modes): the record recipe's optimizer options (gpt_train_check.record_options),
so the state holds NorMuon's second moments too.
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gpt_train_check import CONFIG, GLOBAL_BATCH, global_batch, record_options  # the tiny GPT and batches of test_fsdp
from nanochat.distributed.dist import compute_cleanup, compute_init
from nanochat.gpt import GPT
from nanochat.distributed.parallel import FSDP, parallel_from_config

STEPS, MORE = 2, 2


def build(seed, parallel, config=CONFIG, record=False):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(config, attn="sdpa")
    model.to_empty(device="cpu")
    model.init_weights("nanochat")
    model = parallel.wrap(model, "cpu")
    opts = parallel.setup_optimizers(model, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.01,
                                     use_muon=True)
    if record:
        record_options(opts)
    return model, opts


def train(model, opts, steps, rank, world):
    """`steps` steps on data rank `rank` of `world` (its rows of each global batch); the losses averaged over ranks."""
    losses = []
    n = GLOBAL_BATCH // world
    for step in steps:
        x, y = global_batch(step)
        loss = model(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])
        loss.backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())  # the tp ranks of a group (tp_ckpt_check.py) hold the same
    return losses


def full_state(model, opts):
    """Every model and optimizer tensor whole (collective), keyed as in the sharded checkpoint."""
    from nanochat.checkpoint.sharded import train_state_dict

    out = {}
    for k, v in train_state_dict(model, opts).items():
        if k == "layout":
            continue
        # full_tensor() on one rank is the parameter itself: clone, or training goes on changing it
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in opts]
    return {"tensors": out, "groups": groups}


def meta(config=CONFIG):
    return {"model_config": vars(config), "user_config": {"use_muon": True}, "loop_state": {}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["save", "load"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--crash", type=int, default=0)
    ap.add_argument("--record", type=int, default=0)
    args = ap.parse_args()
    _, rank, _, world, _ = compute_init("cpu", seed=0)
    from nanochat.checkpoint import train_state

    parallel = FSDP()
    if args.mode == "save":
        model, opts = build(0, parallel, record=args.record)
        train(model, opts, range(STEPS), rank, world)
        state = full_state(model, opts)
        train_state.save_train_state(os.path.join(args.dir, "sharded"), STEPS, model, opts, meta(), None, parallel)
        single = parallel_from_config({"use_fsdp": True, "checkpoint_format": "single"}, rank, world)
        train_state.save_train_state(os.path.join(args.dir, "single"), STEPS, model, opts, meta(), None, single)
        asynchronous = parallel_from_config({"use_fsdp": True, "async_save": True}, rank, world)
        train_state.save_train_state(os.path.join(args.dir, "async"), STEPS, model, opts, meta(), None, asynchronous)
        losses = train(model, opts, range(STEPS, STEPS + MORE), rank, world)  # while the async save is written
        final = full_state(model, opts)
        if rank == 0:
            torch.save(state, os.path.join(args.dir, "saved.pt"))
            torch.save({"state": final, "losses": losses}, os.path.join(args.dir, "continued_w2.pt"))
        if args.crash:
            from torch.distributed.checkpoint import FileSystemWriter

            write_data = FileSystemWriter.write_data

            def dying_write(self, plan, planner):
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # as a node dies: no exception, no cleanup
                return write_data(self, plan, planner)

            FileSystemWriter.write_data = dying_write
            train_state.save_train_state(os.path.join(args.dir, "sharded"), STEPS + MORE, model, opts, meta(), None,
                                         parallel)
    else:
        model, opts = build(123, parallel, record=args.record)
        train_state.load_train_state(os.path.join(args.dir, "sharded"), STEPS, model, opts, "cpu", parallel)
        loaded = full_state(model, opts)
        losses = train(model, opts, range(STEPS, STEPS + MORE), rank, world)
        final = full_state(model, opts)
        if rank == 0:
            torch.save(loaded, os.path.join(args.dir, f"loaded_w{world}.pt"))
            torch.save({"state": final, "losses": losses}, os.path.join(args.dir, f"continued_w{world}.pt"))
    compute_cleanup()


if __name__ == "__main__":
    main()
