"""
nanochat.distributed.fsdp.full_weights on 2 gloo ranks (tests/distributed/test_fsdp.py). A 3-block GPT is trained for 2 steps as chat_rl
trains under FSDP: each step, inside full_weights, rank r runs 2r+1 forwards of its own (different numbers per rank, so
one collective inside would hang the test), then 2 micro-batches of its own rows. One process trains the same model on
all rows. Rank 0 prints one JSON line:
  inside: [max |weight inside - gathered master| per step], plain: whether every weight inside was a plain tensor,
  logits: [max |logits inside - one process's logits| per step], after: whether every weight was a DTensor again,
  reshard: [block 0 .. last block, root] reshard-after-forward flags before and after, max_diff: max |FSDP - one
  process| over all weights after the 2 steps, moved: how far one process's weights moved.

    torchrun --nproc_per_node=2 full_weights_check.py
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nanochat.distributed.dist import compute_cleanup
from nanochat.distributed.fsdp import apply_fsdp, full_weights
from nanochat.gpt import GPT, GPTConfig
from nanochat.optim.sharded import setup_fsdp_optimizers
from nanochat.training import train_step

CONFIG = GPTConfig(sequence_len=32, vocab_size=64, n_layer=3, n_head=2, n_kv_head=1, n_embd=64)


def model():
    torch.manual_seed(0)
    m = GPT(CONFIG, attn="sdpa")
    m.init_weights("nanochat")
    with torch.no_grad():  # nanochat's init zeroes the output projections: make every weight get a gradient
        for p in m.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return m


def reshard_flags(m):
    groups = [*m.transformer.h, m]
    return [g._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for g in groups]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    steps = [[(torch.randint(0, 64, (1, 12), generator=g), torch.randint(0, 64, (1, 12), generator=g)) for _ in range(4)]
             for _ in range(2)]
    probe = torch.randint(0, 64, (1, 9), generator=g)

    ref = model()
    ref_opts = ref.setup_optimizers()
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    fsdp = apply_fsdp(model())
    opts = setup_fsdp_optimizers(fsdp)
    with torch.no_grad():
        fsdp(probe)  # FSDP's lazy init (it settles the root's reshard-after-forward flag) before reading the flags
    flags_before = reshard_flags(fsdp)
    for m in [*fsdp.transformer.h, fsdp]:
        m.reshard()  # the root and the last block stay gathered after a forward without backward
    out = {"inside": [], "plain": True, "logits": [], "after": True}
    for batches in steps:
        masters = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
        with torch.no_grad():
            ref_logits = ref(probe)
        with full_weights(fsdp), torch.inference_mode():
            params = dict(fsdp.named_parameters())
            out["plain"] &= not any(isinstance(p, DTensor) for p in params.values())
            out["inside"].append(max((params[n] - masters[n]).abs().max().item() for n in masters))
            for _ in range(2 * rank + 1):  # a different number of forwards on each rank
                logits = fsdp(probe)
            out["logits"].append((logits - ref_logits).abs().max().item())
        out["after"] &= all(isinstance(p, DTensor) for p in fsdp.parameters())
        it = iter(batches)
        train_step(ref, ref_opts, lambda: next(it), 4, grad_clip=0.0)
        mine = iter(batches[2 * rank : 2 * rank + 2])
        train_step(fsdp, opts, lambda: next(mine), 2, grad_clip=0.0)
    out["reshard"] = [flags_before, reshard_flags(fsdp)]
    final = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
    out["max_diff"] = max((final[n] - p).abs().max().item() for n, p in ref.named_parameters())
    out["moved"] = max((p - start[n]).abs().max().item() for n, p in ref.named_parameters())
    if rank == 0:
        print(json.dumps(out))
    compute_cleanup()  # barrier first: a rank that tears gloo down while its peer still works can abort the peer


if __name__ == "__main__":
    main()
