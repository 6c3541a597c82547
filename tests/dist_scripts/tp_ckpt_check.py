"""
Sharded checkpoints of the tensor-parallel path (--tp_size=2), saved and resumed through nanochat/checkpoint/train_state.py
as base_train does, for tests/distributed/test_sharded_checkpoint.py:

    torchrun --nproc_per_node=2 tp_ckpt_check.py --mode=save --dir=D                  # TP=2 (one data rank)
    torchrun --nproc_per_node=N tp_ckpt_check.py --mode=load --dir=D --layout=L       # L=tp (N=2), fsdp (N=1 or 2)

save: train STEPS steps with TP=2, save step STEPS with the plan's default format (D/tp/sharded_<STEPS>/), write the
full model and optimizer state (D/saved.pt), train MORE steps and write the final state and losses (D/continued_tp_w2.pt).
load: a fresh model and optimizers (another seed) on layout L over N ranks, load_train_state of D/tp's step, write the
state as loaded (D/loaded_<L>_w<N>.pt), train MORE steps on the same global batches, write D/continued_<L>_w<N>.pt.
Every data rank takes its rows of the same global batch (both tp ranks of a group the same rows), so the math of every
layout is the same up to the order of floating-point sums.
"""

import argparse
import dataclasses
import os

import torch

from gpt_train_check import CONFIG
from nanochat.checkpoint import train_state
from nanochat.distributed.dist import compute_cleanup, compute_init
from nanochat.distributed.parallel import parallel_from_config
from sharded_ckpt_check import MORE, STEPS, build, full_state, meta, train

TP_CONFIG = dataclasses.replace(CONFIG, n_kv_head=2)  # 2 query and 2 key/value heads: one of each per tp rank
LAYOUTS = {"tp": {"tp_size": 2}, "fsdp": {"use_fsdp": True}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["save", "load"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layout", choices=list(LAYOUTS), default="tp")
    args = ap.parse_args()
    _, rank, _, world, _ = compute_init("cpu", seed=0)
    parallel = parallel_from_config(LAYOUTS[args.layout], rank, world)
    data_rank, data_world, _ = parallel.data_ranks  # TP=2 on 2 ranks: one data rank, both take the whole batch
    checkpoint_dir = os.path.join(args.dir, "tp")
    if args.mode == "save":
        model, opts = build(0, parallel, TP_CONFIG)
        train(model, opts, range(STEPS), data_rank, data_world)
        state = full_state(model, opts)
        train_state.save_train_state(checkpoint_dir, STEPS, model, opts, meta(TP_CONFIG), None, parallel)
        losses = train(model, opts, range(STEPS, STEPS + MORE), data_rank, data_world)
        final = full_state(model, opts)
        if rank == 0:
            torch.save(state, os.path.join(args.dir, "saved.pt"))
            torch.save({"state": final, "losses": losses}, os.path.join(args.dir, "continued_tp_w2.pt"))
    else:
        model, opts = build(123, parallel, TP_CONFIG)
        train_state.load_train_state(checkpoint_dir, STEPS, model, opts, "cpu", parallel)
        loaded = full_state(model, opts)
        losses = train(model, opts, range(STEPS, STEPS + MORE), data_rank, data_world)
        final = full_state(model, opts)
        if rank == 0:
            tag = f"{args.layout}_w{world}"
            torch.save(loaded, os.path.join(args.dir, f"loaded_{tag}.pt"))
            torch.save({"state": final, "losses": losses}, os.path.join(args.dir, f"continued_{tag}.pt"))
    compute_cleanup()


if __name__ == "__main__":
    main()
