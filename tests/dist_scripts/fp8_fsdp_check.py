"""
Emulated FP8 under FSDP2 (tests/test_fp8.py): the tiny GPT of test_fp8 converted with torchao's emulated float8
(tensorwise and rowwise), wrapped with nanochat's apply_fsdp and trained for 3 steps on 2 gloo ranks, each taking
half of the batch. Rank 0 prints one JSON line {"<recipe>": [losses]}.

The FP8 all-gather (--fp8_recipe=tensorwise under FSDP2 on CUDA: the shards are cast to float8 before the
all-gather) cannot run here: gloo has no float8 dtypes ("RuntimeError: Invalid scalar type"), NCCL has. So the
weights are gathered in fp32 and cast after the gather, torchao's path for rowwise and for fsdp=False.

    torchrun --nproc_per_node=2 fp8_fsdp_check.py
"""

import json

import torch
import torch.distributed as dist

from nanochat.fp8 import convert_to_fp8
from nanochat.fsdp import apply_fsdp, setup_fsdp_optimizers
from nanochat.gpt import GPT, GPTConfig

CONFIG = GPTConfig(sequence_len=64, vocab_size=256, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
STEPS = 3


def run(recipe, rank, world):
    torch.manual_seed(0)
    model = GPT(CONFIG, attn="sdpa")
    model.init_weights("nanochat")
    with torch.no_grad():  # as test_fp8.cpu_model: the same weights
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    if recipe != "none":
        convert_to_fp8(model, recipe, fsdp=False, emulate=True)
    apply_fsdp(model)
    opts = setup_fsdp_optimizers(model, use_muon=True)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.sequence_len + 1), generator=g)
    n = data.size(0) // world
    x, y = data[rank * n : (rank + 1) * n, :-1], data[rank * n : (rank + 1) * n, 1:]
    losses = []
    for _ in range(STEPS):
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
    out = {recipe: run(recipe, rank, world) for recipe in ("none", "tensorwise", "rowwise")}
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
