"""
Activation checkpointing on the two data-parallel paths (tests/unit/test_ac.py): the same tiny GPT trained for 3 steps
with --activation_checkpointing none, full and selective (every 2nd block), under FSDP2 and on the DDP path (the whole
model on each rank, DistAdamW/DistMuon average the gradients), eager and with nanochat.compile's compile (FSDP: per
block; DDP: the whole model; backend aot_eager: no C++ compiler needed, fast). Rank 0 prints one JSON line
{"<strategy>": {"<mode>": [losses], "calls": ...}}, calls being how many times the eager runs ran a block's body (a
checkpointed block runs it again in the backward).

    torchrun --nproc_per_node=2 ac_check.py
"""

import json

import torch
import torch.distributed as dist

from nanochat.distributed.dist import compute_cleanup
from nanochat.distributed.fsdp import apply_fsdp
from nanochat.gpt import GPT, Block, GPTConfig
from nanochat.optim.sharded import setup_fsdp_optimizers

CONFIG = GPTConfig(sequence_len=16, vocab_size=128, n_layer=4, n_head=2, n_kv_head=1, n_embd=64)
STEPS = 3


def batch(step, rank, world):
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.sequence_len + 1), generator=g)
    n = data.size(0) // world
    rows = data[rank * n : (rank + 1) * n]
    return rows[:, :-1], rows[:, 1:]


def run(strategy, mode, compiled, rank, world):
    from nanochat.compile import compile_model

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(CONFIG, attn="sdpa")
    model.to_empty(device="cpu")
    model.init_weights("nanochat")
    model.set_activation_checkpointing(mode, every=2)
    if strategy == "fsdp":
        apply_fsdp(model)
        opts = setup_fsdp_optimizers(model, matrix_lr=0.02, use_muon=True)
    else:  # the DDP path (nanochat.distributed.parallel.DataParallel): no wrapper, the distributed optimizers communicate
        opts = model.setup_optimizers(matrix_lr=0.02, use_muon=True)
    if compiled:
        model = compile_model(model, per_block=strategy == "fsdp", backend="aot_eager")
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank, world)
        loss = model(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"fsdp": {}, "ddp": {}}
    body, count = Block._forward, [0]

    def counted(self, *args):
        count[0] += 1
        return body(self, *args)

    for strategy, res in out.items():
        res["calls"] = {}
        for mode in ("none", "full", "selective"):
            Block._forward, count[0] = counted, 0
            res[mode] = run(strategy, mode, False, rank, world)
            Block._forward, res["calls"][mode] = body, count[0]
    # compiled last: compile_model turns on Muon's compile for the rest of the process
    for strategy, res in out.items():
        res["full+compile"] = run(strategy, "full", True, rank, world)
    if rank == 0:
        print(json.dumps(out))
    compute_cleanup()  # barrier first: a rank that tears gloo down while its peer still works can abort the peer


if __name__ == "__main__":
    main()
