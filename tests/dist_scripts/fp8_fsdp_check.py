"""
Emulated FP8 under FSDP2 (tests/unit/test_fp8.py): the tiny GPT of test_fp8 converted with torchao's emulated float8
(tensorwise and rowwise), and with nanochat's own tensorwise Float8Linear ("native": torch._scaled_mm runs on CPU),
wrapped with nanochat's apply_fsdp and trained for 3 steps on 2 gloo ranks, each taking half of the batch. Rank 0
prints one JSON line {"<recipe>": [losses], "scales": {...}}.

The FP8 all-gather (--fp8_recipe=tensorwise under FSDP2 on CUDA: the shards are cast to float8 before the
all-gather) cannot run here: gloo has no float8 dtypes ("RuntimeError: Invalid scalar type"), NCCL has. So the
weights are gathered in fp32 and cast after the gather, torchao's path for rowwise and for fsdp=False. What does run
on gloo is the scale precomputation for that all-gather (parallel.FSDP.after_optimizer_step): `scales` checks that it
gives every weight finfo(e4m3).max / max|W| over the whole sharded weight, and follows the weights when they change.

    torchrun --nproc_per_node=2 fp8_fsdp_check.py
"""

import json

import torch
import torch.distributed as dist

from nanochat.distributed.dist import compute_cleanup
from nanochat.fp8 import convert_to_fp8
from nanochat.distributed.fsdp import apply_fsdp
from nanochat.gpt import GPT, GPTConfig
from nanochat.optim.sharded import setup_fsdp_optimizers
from nanochat.distributed.parallel import FSDP

CONFIG = GPTConfig(sequence_len=64, vocab_size=256, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
STEPS = 3


def run(recipe, rank, world):
    torch.manual_seed(0)
    model = GPT(CONFIG, attn="sdpa")
    model.init_weights("nanochat")
    with torch.no_grad():  # as test_fp8.cpu_model: the same weights
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    if recipe == "native":
        convert_to_fp8(model, "tensorwise", filter="all", impl="native")
    elif recipe != "none":
        convert_to_fp8(model, recipe, fsdp=False, emulate=True, filter="all")
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


def expected_scale(weight):
    """finfo(e4m3).max / amax of the whole weight, from this rank's shard and an all-reduce(MAX) done here."""
    amax = weight._local_tensor._tensor.detach().abs().max().clamp(min=1e-12)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return (torch.finfo(torch.float8_e4m3fn).max / amax.double()).float()


def check_scales():
    """FSDP strategy + FP8 all-gather: which models it detects, and the scales its after_optimizer_step sets."""
    from torchao.float8.float8_linear import Float8Linear

    detected = {}
    for recipe in ("none", "tensorwise", "rowwise", "native"):
        model = GPT(CONFIG, attn="sdpa")
        if recipe == "native":  # no FP8 all-gather: the weights are gathered as they are and cast after
            convert_to_fp8(model, "tensorwise", fsdp=True, filter="all", impl="native")
        elif recipe != "none":
            convert_to_fp8(model, recipe, fsdp=True, emulate=True, filter="all")
        parallel = FSDP()
        parallel.wrap(model, "cpu")
        detected[recipe] = parallel.fp8_all_gather
    torch.manual_seed(0)
    model = GPT(CONFIG, attn="sdpa")
    model.init_weights("nanochat")
    convert_to_fp8(model, "tensorwise", fsdp=True, emulate=True, filter="all")
    parallel = FSDP()
    model = parallel.wrap(model, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
    before = [m.weight._local_tensor._precomputed_scale for m in linears]
    errors = []
    for round_ in range(2):
        if round_:  # as an optimizer step would: change every shard, differently on each rank
            with torch.no_grad():
                for i, m in enumerate(linears):
                    m.weight._local_tensor._tensor.mul_(1.0 + 0.5 * (i + dist.get_rank()))
        parallel.after_optimizer_step(model)
        for m in linears:
            got = m.weight._local_tensor._precomputed_scale
            errors.append(((got - expected_scale(m.weight)).abs() / got).item())
    return {"detected": detected, "linears": len(linears), "unset_before": all(s is None for s in before),
            "max_rel_error": max(errors)}


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {recipe: run(recipe, rank, world) for recipe in ("none", "tensorwise", "rowwise", "native")}
    out["scales"] = check_scales()
    if rank == 0:
        print(json.dumps(out))
    compute_cleanup()  # barrier first: a rank that tears gloo down while its peer still works can abort the peer


if __name__ == "__main__":
    main()
