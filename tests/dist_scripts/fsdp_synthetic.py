"""
FSDPMuon and FSDPAdamW on awkward shapes against Muon and torch AdamW in one process (called from
gpt_train_check.py --mode=fsdp --synthetic=1, inside torchrun).

The module has matrices whose dim 0 does not split evenly over 2 ranks (5 rows, 9 rows, and 1 row: rank 1 holds an
empty shard), and shape groups with 3 matrices (not a multiple of the world size). Each rank trains the sharded copy
on its half of the batch; every rank also trains an unsharded reference on the whole batch (no collectives).
record=True: the record recipe's Muon options (nanochat/muon.py RECORD_MUON, cautious weight decay on a schedule) and
AdamW groups with their own betas. This toy's gradients are nearly low-rank, and Polar Express and NorMuon amplify
their last-bit differences (whole batch vs the mean of the ranks' halves: ~4e-5 after 5 steps, in one process
alone); so with record=True the reference steps on the mean of the ranks' half-batch gradients, the numbers FSDP's
reduce-scatter averages, and what is compared is the optimizer alone.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from nanochat.distributed.fsdp import apply_fsdp, full_model_state_dict
from nanochat.muon import RECORD_MUON, Muon
from nanochat.optim.sharded import FSDPAdamW, FSDPMuon

STEPS = 5
BATCH = 8


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5, bias=False)  # 5 rows: 3 + 2
        self.b = nn.Linear(5, 9, bias=False)  # 9 rows: 5 + 4, tall
        self.c = nn.Linear(9, 6, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


class Toy(nn.Module):
    """Three layers (3 matrices per shape group) + an 'embedding' of 5 rows and a 1-row head."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(h=nn.ModuleList([Layer() for _ in range(3)])))
        self.inp = nn.Linear(6, 5, bias=False).weight  # (5, 6): AdamW, uneven
        self.head = nn.Linear(6, 1, bias=False)  # (1, 6): AdamW, rank 1 holds no rows

    def get_device(self):
        return self.head.weight.device

    def forward(self, x):
        x = x + 0.1 * torch.tanh(x @ self.inp.T).sum(-1, keepdim=True)
        for layer in self.transformer.h:
            x = x + layer(x)
        return self.head(x).pow(2).mean()


def build():
    torch.manual_seed(0)
    return Toy()


def optimizers(model, sharded, record=False):
    matrices = list(model.transformer.h.parameters())
    adam_groups = [dict(params=[model.inp], lr=0.01, weight_decay=0.1), dict(params=[model.head.weight], lr=0.02, weight_decay=0.0)]
    kw = dict(betas=(0.8, 0.95), eps=1e-10)
    muon_kw = dict(lr=0.03)
    if record:
        adam_groups[0]["betas"], adam_groups[1]["betas"] = (0.8, 0.995), (0.96, 0.95)
        muon_kw.update(RECORD_MUON, weight_decay=0.2)
    if sharded:
        return [FSDPAdamW(adam_groups, **kw), FSDPMuon(matrices, **muon_kw)]
    return [torch.optim.AdamW(adam_groups, foreach=False, **kw), Muon(matrices, **muon_kw)]


def run(rank, world, record=False):
    ref, sharded = build(), build()
    apply_fsdp(sharded)
    opts_ref, opts_sh = optimizers(ref, False, record), optimizers(sharded, True, record)
    n = BATCH // world
    worst = 0.0
    for step in range(STEPS):
        for opt in opts_ref + opts_sh:  # a weight-decay schedule, as the record recipe's loop sets it
            for g in opt.param_groups:
                if "cautious_wd" in g and record:
                    g["weight_decay"] = 0.2 * (1 - step / STEPS)
        x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(step))
        for model, opts, xb in ((ref, opts_ref, x), (sharded, opts_sh, x[rank * n : (rank + 1) * n])):
            if record and model is ref:
                halves = [torch.autograd.grad(model(x[r * n : (r + 1) * n]), list(model.parameters())) for r in range(world)]
                for p, *gs in zip(model.parameters(), *halves):
                    p.grad = sum(gs) / world
            else:
                model(xb).backward()
            for opt in opts:
                opt.step()
            model.zero_grad(set_to_none=True)
        full = full_model_state_dict(sharded)
        obj = [full]
        dist.broadcast_object_list(obj, src=0)
        worst = max(worst, max((obj[0][k] - v).abs().max().item() for k, v in ref.state_dict().items()))
    moved = max((v - build().state_dict()[k]).abs().max().item() for k, v in ref.state_dict().items())
    return {"max_param_diff": worst, "moved": moved, "ok": worst < 1e-5 and moved > 1e-2}
