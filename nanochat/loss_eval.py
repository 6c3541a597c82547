"""
Validation loss in bits per byte (bpb): summed cross-entropy in nats over summed byte length of the target tokens,
divided by ln 2. Unlike loss per token it does not depend on the vocabulary, so models with different tokenizers
compare. Special tokens (0 bytes) and ignored targets (-1) count for neither nats nor bytes.
"""

import math

import torch
import torch.distributed as dist

from nanochat.distributed.dist import dist_world_size


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes):
    """
    model: called as model(x, y, loss_reduction='none') -> per-token loss.
    batches: iterator of (x, y) or (x, y, state). steps: batches to consume on this rank.
    token_bytes: int tensor (vocab,) of byte lengths, on the model's device.
    Sums are all-reduced across ranks, so every rank returns the same number. Under tensor parallelism the tp ranks of
    a group read the same batches (data rank loaders), so each group's sums count tp times in both nats and bytes: the
    ratio is unchanged.
    """
    device = token_bytes.device
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    for _ in range(steps):
        batch = next(batches)
        x, y = batch[0], batch[1]
        loss = model(x, y, loss_reduction="none").reshape(-1).double()
        y = y.reshape(-1)
        valid = y >= 0
        num_bytes = torch.where(valid, token_bytes[torch.where(valid, y, torch.zeros_like(y))], torch.zeros_like(y))
        counted = num_bytes > 0
        total_nats += (loss * counted).sum()
        total_bytes += num_bytes.sum()
    if dist_world_size() > 1:
        # float64 so the byte count (up to ~1e10 at scale) and nat sum stay exact; tensors live on the rank's device
        stats = torch.stack([total_nats, total_bytes.double()])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        total_nats_v, total_bytes_v = stats[0].item(), stats[1].item()
    else:
        total_nats_v, total_bytes_v = total_nats.item(), total_bytes.item()
    if total_bytes_v == 0:
        return float("inf")
    return total_nats_v / (math.log(2) * total_bytes_v)
