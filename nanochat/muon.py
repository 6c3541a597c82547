"""
Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan, 2024), for the 2-D matrices of the transformer blocks.

Each step takes the SGD-Nesterov momentum update of a matrix and replaces it by (approximately) the nearest
semi-orthogonal matrix U V^T of its SVD U S V^T, computed with a few Newton-Schulz iterations instead of an SVD.
All singular values of the update become ~1, so every direction of the matrix moves by about the same amount.

The math lives in two functions that every Muon variant in nanochat calls:
- `zeropower_via_newtonschulz5(G, steps)`: the orthogonalisation (batched over leading dims).
- `muon_update(grad, momentum_buffer, momentum, nesterov, ns_steps)`: momentum + orthogonalisation + shape scale,
  i.e. `muon_orthogonalize(muon_momentum_(...), ns_steps)` (ShardedMuon calls the two halves on different ranks).

Optimizers here:
- `Muon`: one process (params grouped by shape).
- `DistMuon`: the DDP path (no DDP wrapper; each rank holds full params and its own local gradients). Per shape
  group, the matrices are taken in blocks of `world_size`; in each block rank r owns matrix r. One reduce-scatter
  (AVG) per block brings the averaged gradient of its matrix to the owner, the owner updates its momentum and
  orthogonalises, one all-gather per block sends every updated matrix to every rank. A block that is not full is
  padded with zero matrices (padding owners do no work). Momentum lives only on the owner (sharded state: one
  optimizer state file per rank). Communication is launched asynchronously so it overlaps the Newton-Schulz compute.
The variants for DTensor shards (FSDP2, FSDP x TP) are ShardedMuon and FSDPMuon in nanochat/optim/sharded.py; they
call the same two functions. All three subclass Muon (its hyperparameters, shape groups and momentum buffers), and the
distributed ones share their torchrun check and per-rank state dicts (nanochat/optim/base.py).
"""

import torch
import torch.distributed as dist
from torch import Tensor

from nanochat.optim.base import PerRankState, run_closure

# Coefficients of the quintic iteration X <- aX + b(XX^T)X + c(XX^T)^2 X, chosen (Keller Jordan) to push every singular
# value in (0, 1] quickly into roughly [0.7, 1.2]: a steep slope at 0 matters more than exact convergence to 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def ns_dtype(device) -> torch.dtype:
    """Newton-Schulz compute dtype: bf16 on CUDA (tensor cores; the iteration tolerates it), fp32 elsewhere (CPU bf16
    matmuls are ~10x slower than fp32). FSDPMuon also communicates in this dtype: no precision is lost by it."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# Newton-Schulz is a chain of small matmuls and elementwise ops: compiled (as nanochat decorates it with
# @torch.compile) it fuses the elementwise work. Off by default, so plain uses and the test suite stay eager (compile
# time would dominate them); nanochat.compile turns it on for runs that compile the model.
_COMPILED_NS = None  # the compiled iteration while compiling is on, else None


def set_compile(enabled, backend="inductor"):
    """Compile Newton-Schulz (enabled=True) or run it eagerly (False)."""
    global _COMPILED_NS
    _COMPILED_NS = torch.compile(_newtonschulz5, dynamic=False, backend=backend) if enabled else None


def zeropower_via_newtonschulz5(G: Tensor, steps: int = 5) -> Tensor:
    """
    Approximately orthogonalise G (..., rows, cols): returns ~U V^T where G = U S V^T, batched over leading dims.
    Computes in ns_dtype(G.device) and returns that dtype; callers cast as they need. Compiled after set_compile(True).
    """
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz orthogonalisation needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    return (_COMPILED_NS or _newtonschulz5)(G, steps)


@torch.no_grad()
def _newtonschulz5(G: Tensor, steps: int) -> Tensor:
    a, b, c = NS_COEFFS
    X = G.to(ns_dtype(G.device))
    # Iterate on the wide orientation: X X^T is then the smaller (rows x rows) Gram matrix.
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    # The Frobenius norm bounds the spectral norm, so after this every singular value is <= 1 (the iteration's domain).
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X


# The update is split in two so that FSDPMuon can run the elementwise momentum on its parameter shards and the
# orthogonalisation on whole matrices gathered elsewhere; muon_update composes them for the unsharded optimizers.


def muon_momentum_(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool = True) -> Tensor:
    """Update `momentum_buffer` in place (EMA form: buf = momentum*buf + (1-momentum)*grad) and return the direction to
    orthogonalise: the Nesterov look-ahead grad + momentum*(buf - grad), or buf itself. Elementwise, so it can run on
    any slice of a matrix."""
    momentum_buffer.lerp_(grad.to(momentum_buffer.dtype), 1 - momentum)
    return grad.to(momentum_buffer.dtype).lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def muon_orthogonalize(g: Tensor, ns_steps: int = 5) -> Tensor:
    """Newton-Schulz of whole matrices (..., rows, cols), scaled by sqrt(max(1, rows/cols)) so tall matrices (whose
    orthogonalised rows are shorter) get per-element updates of the same size as wide ones. Returns ns_dtype."""
    return zeropower_via_newtonschulz5(g, ns_steps) * max(1.0, g.size(-2) / g.size(-1)) ** 0.5


def muon_update(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool = True, ns_steps: int = 5) -> Tensor:
    """One Muon update direction for a matrix (or a batch of same-shape matrices on the leading dim); updates
    `momentum_buffer` in place. The caller applies p -= lr * update (update in ns_dtype; cast to p's dtype)."""
    return muon_orthogonalize(muon_momentum_(grad, momentum_buffer, momentum, nesterov), ns_steps)


def group_params_by_shape(params):
    """
    Param groups with one shape each (sorted by shape, so every rank builds the same groups in the same order).
    `params` is an iterable of tensors, or of param-group dicts (each dict is split by shape, keeping its options).
    """
    params = list(params)
    if not params:
        raise ValueError("Muon got an empty parameter list")
    in_groups = params if isinstance(params[0], dict) else [dict(params=params)]
    out = []
    for g in in_groups:
        ps = list(g["params"])
        for p in ps:
            if p.ndim != 2:
                raise ValueError(f"Muon only optimises 2-D matrices; got a parameter of shape {tuple(p.shape)} (give it to AdamW)")
        options = {k: v for k, v in g.items() if k != "params"}
        for shape in sorted({tuple(p.shape) for p in ps}):
            out.append(dict(options, params=[p for p in ps if tuple(p.shape) == shape]))
    return out


class Muon(torch.optim.Optimizer):
    """
    Single-process Muon. Only for 2-D matrices (embeddings, lm_head and any 0/1-D params belong to AdamW).
    Hyperparameters per group: lr, momentum (the training loop ramps it), nesterov, ns_steps.
    State per parameter: momentum_buffer (same dtype as the parameter). The distributed variants (DistMuon here,
    ShardedMuon/FSDPMuon in nanochat/optim/sharded.py) subclass it for these and write their own step().
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5):
        if lr < 0:
            raise ValueError(f"Muon lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if int(ns_steps) != ns_steps or ns_steps < 1:
            raise ValueError(f"Muon ns_steps must be a positive integer, got {ns_steps}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(group_params_by_shape(params), defaults)

    def momentum_buffer(self, p, like=None):
        """p's momentum buffer, zeros shaped like `like` (p itself, or this rank's shard of it) on first use."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p if like is None else like)
        return state["momentum_buffer"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = muon_update(p.grad, self.momentum_buffer(p), group["momentum"], group["nesterov"], group["ns_steps"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])
        return loss


class DistMuon(PerRankState, Muon):
    """
    Muon for the DDP path (see the module docstring). Every rank must hold identical parameters and call step() with
    its own local gradients (not averaged: this optimizer averages them). Every parameter needs a gradient on every
    rank (a missing one would leave the collectives mismatched, so it is an error).

    state_dict() holds only the momentum buffers of the matrices this rank owns: save one file per rank and load it
    back with the same world size (checked on load).
    """

    def _blocks(self):
        """(group, block of up to world_size params) in a fixed order; rank r owns block[r]."""
        W = self.world_size
        for group in self.param_groups:
            ps = group["params"]
            for base in range(0, len(ps), W):
                yield group, ps[base : base + W]

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        rank, W = self.rank, self.world_size

        # 1) Launch every reduce-scatter up front: the first blocks' Newton-Schulz runs while later gradients travel.
        pending = []
        for group, block in self._blocks():
            grads = [self.grad_of(p) for p in block]
            grads += [torch.zeros_like(grads[0])] * (W - len(grads))  # pad a partial block: zero matrices
            rs_in = torch.cat(grads)  # (W*rows, cols): rows of slot r go to rank r (gloo wants the concatenated form)
            rs_out = torch.empty_like(grads[0])
            work = dist.reduce_scatter_tensor(rs_out, rs_in, op=dist.ReduceOp.AVG, async_op=True)
            pending.append((group, block, rs_out, work, rs_in))  # rs_in kept alive until the collective is done

        # 2) Per block: wait for my averaged gradient, update my matrix, launch the all-gather of the block.
        gathers = []
        for group, block, grad, work, _ in pending:
            work.wait()  # gloo's reduce-scatter has no get_future(); the work handle works on every backend
            mine = block[rank] if rank < len(block) else None
            if mine is not None:
                update = muon_update(grad, self.momentum_buffer(mine), group["momentum"], group["nesterov"], group["ns_steps"])
                mine.add_(update.to(mine.dtype), alpha=-group["lr"])
                ag_in = mine.detach()
            else:
                ag_in = torch.zeros_like(block[0])  # padding slot: nothing to send, but the collective needs a tensor
            ag_out = torch.empty((W * block[0].size(0), block[0].size(1)), dtype=block[0].dtype, device=block[0].device)
            ag_in = ag_in.contiguous()
            gathers.append((block, ag_out, dist.all_gather_into_tensor(ag_out, ag_in, async_op=True), ag_in))

        # 3) Copy the gathered matrices into the parameters of the other ranks' slots.
        for block, ag_out, work, _ in gathers:
            work.wait()
            gathered = ag_out.view(W, *block[0].shape)
            for i, p in enumerate(block):
                if i != rank:
                    p.copy_(gathered[i])
        return loss
