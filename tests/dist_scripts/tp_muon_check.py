"""
ShardedMuon (nanochat/distributed/tensor_parallel.py) on awkward layouts against Muon on the full matrices (run under torchrun,
4 ranks, a 2 x 2 mesh; called by tests/distributed/test_tp.py). Layouts: Shard(0) x Shard(1), Shard(1) x Shard(0), replicated
mesh dims, uneven rectangles (5 x 7 over 2 x 2), a 1-row matrix (some ranks hold nothing), a tall matrix, and a shape
group of 5 matrices (not a multiple of the world size). Every rank gets the same full gradients and keeps its
rectangle. Twice: with the December options and with the record recipe's (RECORD_MUON and cautious weight decay on a
schedule: NorMuon per row and per column, its buffer and the decay mask on rectangles). Prints one JSON line per
options and step: {"options", "step", "max_diff", "ok"} (rank 0).
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from nanochat.distributed.dist import compute_cleanup
from nanochat.muon import RECORD_MUON, Muon
from nanochat.optim.sharded import ShardedMuon

STEPS = 3
LAYOUTS = [
    ((5, 7), (Shard(0), Shard(1))),
    ((5, 7), (Shard(1), Shard(0))),
    ((5, 7), (Replicate(), Shard(0))),
    ((5, 7), (Shard(0), Shard(0))),
    ((5, 7), (Shard(1), Replicate())),
    ((9, 4), (Shard(0), Replicate())),
    ((1, 6), (Shard(0), Shard(0))),
]


def compare(mesh, rank, name, options):
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=g) for shape, _ in LAYOUTS]
    ref = [torch.nn.Parameter(w.clone()) for w in fulls]
    sharded = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, list(pl))) for w, (_, pl) in zip(fulls, LAYOUTS)]
    ref_opt = Muon(ref, lr=0.1, momentum=0.9, **options)
    opt = ShardedMuon(sharded, lr=0.1, momentum=0.9, **options)
    for step in range(STEPS):
        for o in (ref_opt, opt):
            for group in o.param_groups:
                group["weight_decay"] = options.get("weight_decay", 0.0) * (1 - step / STEPS)
        grads = [torch.randn(w.shape, generator=g) for w in fulls]
        for p, q, gr, (_, pl) in zip(ref, sharded, grads, LAYOUTS):
            p.grad = gr.clone()
            q.grad = distribute_tensor(gr.clone(), mesh, list(pl))
        ref_opt.step()
        opt.step()
        diff = max((p.detach() - q.detach().full_tensor()).abs().max().item() for p, q in zip(ref, sharded))
        if rank == 0:
            print(json.dumps({"options": name, "step": step, "max_diff": diff, "ok": diff < 1e-5}), flush=True)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    compare(mesh, rank, "december", {})
    compare(mesh, rank, "record", dict(RECORD_MUON, weight_decay=0.3))
    compute_cleanup()  # barrier first: a rank that tears gloo down while its peer still works can abort the peer


if __name__ == "__main__":
    main()
