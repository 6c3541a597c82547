"""
The record model (nanochat/gpt.py RecordGPT: sliding windows, value embeddings and their gates, smear, backout,
per-layer scalars) under the sharded layouts, on 2 gloo ranks (tests/distributed/test_record_layouts.py), against the unsharded
model in the same process:

- fsdp: apply_fsdp over both ranks, each rank training on its half of the rows (FSDP averages the gradients)
- tp: apply_tp with tp_size 2 (one data rank: both ranks see every row); the value embeddings and their gates are
  split by kv head with c_v, the scalars, smear and lm_head stay whole

Each rank compares the loss of one forward/backward, every parameter's gradient (gathered), the logits of a forward
without gradients, and the full state dict; builds the layout's optimizers with the record groups and takes one step.
Rank 0 prints one JSON line: {"loss": |diff|, "grads": {name: max |diff| / max |ref grad|}, "logits": max |diff|,
"state": max |diff|, "optimizers": [class names], "finite": bool}.

    torchrun --nproc_per_node=2 record_layout_check.py fsdp|tp
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nanochat.distributed.dist import compute_cleanup
from nanochat.distributed.fsdp import apply_fsdp, full_model_state_dict
from nanochat.distributed.tensor_parallel import apply_tp, setup_tp_optimizers
from nanochat.gpt import RecordConfig, RecordGPT
from nanochat.optim.sharded import setup_fsdp_optimizers

# windows 128 (S) and 256 (L) over rows of 256; value embeddings on layers 0 and 2; 4 query heads, 2 kv heads
CONFIG = RecordConfig(sequence_len=256, vocab_size=96, n_layer=3, n_head=4, n_kv_head=2, n_embd=128, window_pattern="SL")
RECORD_KWARGS = dict(unembedding_lr=0.008, embedding_lr=0.3, matrix_lr=0.02, weight_decay=0.2, scalar_lr=0.5)


def model():
    torch.manual_seed(0)
    m = RecordGPT(CONFIG, attn="sdpa")
    m.init_weights()
    with torch.no_grad():  # the init zeroes the output projections: make every weight matter and get a gradient
        g = torch.Generator().manual_seed(1)
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def main():
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.sequence_len), generator=g)
    y = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.sequence_len), generator=g)

    ref = model()
    ref_loss = ref(x, y)
    ref_loss.backward()
    with torch.no_grad():
        ref_logits = ref(x[:1])

    if mode == "fsdp":
        sharded, rows = apply_fsdp(model()), slice(2 * rank, 2 * rank + 2)  # my half of the rows
    else:
        sharded, rows = apply_tp(model(), 2), slice(None)  # one data rank: every row on both tp ranks
    loss = sharded(x[rows], y[rows])
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world  # fsdp: the mean over the ranks' halves; tp: every rank holds the same loss
    out = {"loss": abs(mean_loss.item() - ref_loss.item()), "grads": {}}
    ref_params = dict(ref.named_parameters())
    for name, p in sharded.named_parameters():
        ref_grad = ref_params[name].grad
        out["grads"][name] = ((full(p.grad) - ref_grad).abs().max() / ref_grad.abs().max()).item()
    with torch.no_grad():
        out["logits"] = (sharded(x[:1]) - ref_logits).abs().max().item()
    state = full_model_state_dict(sharded)
    if rank == 0:
        out["state"] = max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        assert state.keys() == ref.state_dict().keys()
    opts = (setup_fsdp_optimizers if mode == "fsdp" else setup_tp_optimizers)(sharded, **RECORD_KWARGS)
    out["optimizers"] = [type(o).__name__ for o in opts]
    for o in opts:
        o.step()
    out["finite"] = all(bool(torch.isfinite(full(p)).all()) for p in sharded.parameters())
    if rank == 0:
        print(json.dumps(out))
    compute_cleanup()


if __name__ == "__main__":
    main()
