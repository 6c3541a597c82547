"""
DistAdamW: AdamW with ZeRO-2 sharding, for the DDP path (no DDP wrapper: every rank holds the full parameters and
its own local gradients, and this optimizer does the gradient averaging).

Per parameter of dim-0 size D on W ranks, with chunk = ceil(D / W):
  1. reduce-scatter (AVG) the gradient along dim 0: rank r receives the averaged rows [r*chunk, (r+1)*chunk).
     When D is not a multiple of W the gradient is zero-padded to W*chunk rows first (the last ranks own fewer,
     possibly zero, real rows).
  2. AdamW on the local rows only, with fp32 moment estimates (the optimizer state is 1/W of the full state:
     `state_dict()` is per rank, one file per rank, loadable only by the same rank of the same world size).
  3. all-gather the updated rows back into the full parameter on every rank.
Communication per step = one reduce-scatter + one all-gather of every parameter, the same volume as DDP's
all-reduce, while the optimizer state and its compute are split W ways. All reduce-scatters are launched before the
first update and every all-gather right after its update, so communication overlaps the AdamW math.

The math is torch.optim.AdamW's (decoupled weight decay p *= 1 - lr*wd, bias-corrected moments), so one process
with the averaged gradient gives the same parameters within float tolerance. Optional per-parameter attributes
`p.lr_mul` and `p.wd_mul` multiply the group's lr and weight decay for that parameter.

On FSDP2's DTensor shards the AdamW is torch's own: FSDPAdamW in nanochat/optim/sharded.py (the map of all the
optimizers is nanochat/optim/__init__.py).
"""

import torch
import torch.distributed as dist
from torch import Tensor

from nanochat.optim.base import PerRankState, run_closure


@torch.no_grad()
def adamw_update_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float):
    """
    One AdamW step in place on `p` (any dtype) with fp32 `grad`, `exp_avg`, `exp_avg_sq`; `step` counts from 1.
    Same operation order as torch.optim.AdamW's single-tensor path, so results agree to float rounding.
    """
    p32 = p.float() if p.dtype != torch.float32 else p
    if weight_decay != 0:
        p32.mul_(1 - lr * weight_decay)  # decoupled: shrinks the weight, not added to the gradient
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / (bias_correction2**0.5)).add_(eps)
    p32.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if p32 is not p:
        p.copy_(p32)


@torch.no_grad()
def record_adamw_update_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float):
    """
    The same AdamW step in nanochat 92d63d4's arithmetic (its fused kernel, the record recipe's): every
    hyperparameter is a float32 scalar tensor, so 1 - lr*wd, 1 - beta, the bias corrections and lr / bias1 round as
    float32 (torch's AdamW keeps them in Python doubles), and both moments move by lerp. The two differ in the last
    bit of some elements each step, and training amplifies that (the cautious Muon decay flips with the sign of an
    update): the record recipe uses this one so that its losses are 92d63d4's step for step
    (bench/record_side_by_side.py).
    """
    lr_t, wd_t, eps_t, step_t, beta1_t, beta2_t = (torch.tensor(float(v), dtype=torch.float32)
                                                   for v in (lr, weight_decay, eps, step, beta1, beta2))
    p32, grad = p.float(), grad.float()  # p.float() is p itself for fp32 parameters
    p32.mul_(1 - lr_t * wd_t)
    exp_avg.lerp_(grad, 1 - beta1_t)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2_t)
    denom = (exp_avg_sq / (1 - beta2_t**step_t)).sqrt() + eps_t
    p32.add_(exp_avg / denom, alpha=-(lr_t / (1 - beta1_t**step_t)))
    if p32 is not p:
        p.copy_(p32)


ADAMW_MATHS = {"torch": adamw_update_, "record": record_adamw_update_}  # an AdamW group's "math" (default torch)


def adamw_math(group):
    """The update function of an AdamW param group: its "math" key, torch's order when absent."""
    math = group.get("math", "torch")
    if math not in ADAMW_MATHS:
        raise ValueError(f"an AdamW group's math must be one of {', '.join(ADAMW_MATHS)}, got {math!r}")
    return ADAMW_MATHS[math]


class AdamW(torch.optim.Optimizer):
    """
    AdamW whose param groups choose their arithmetic ("math": torch, the default, or record: record_adamw_update_),
    with fp32 moments. GPT.build_optimizers gives it to a model whose groups ask for the record math in one process
    (December's groups keep torch.optim.AdamW itself); FSDPRecordAdamW (nanochat/optim/sharded.py) runs it on FSDP's
    DTensor shards, through their local tensors (the math is elementwise).
    """

    def __init__(self, param_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            adamw_math(group)  # an unknown math fails here, not at the first step

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            update = adamw_math(group)
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                local, grad = (p.to_local(), p.grad.to_local()) if hasattr(p, "to_local") else (p, p.grad)
                state = self.state[p]
                if not state:  # torch's AdamW layout (the step a float32 scalar tensor: sharded checkpoints save tensors)
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(local, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(local, dtype=torch.float32)
                state["step"] += 1
                update(local, grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"]), group["lr"], beta1, beta2,
                       group["eps"], group["weight_decay"])
        return loss


class DistAdamW(PerRankState, torch.optim.Optimizer):
    """
    ZeRO-2 AdamW (see the module docstring). `param_groups` as for torch.optim.AdamW (list of tensors or of dicts).
    Every parameter needs a gradient on every rank, and every rank must build the groups in the same order.
    """

    def __init__(self, param_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"DistAdamW: lr, eps and weight_decay must be >= 0, got lr={lr} eps={eps} weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"DistAdamW: betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(param_groups, defaults)

    def _rows(self, p):
        """(chunk, first row I own, number of real rows I own) of p's dim 0."""
        D = p.size(0)
        chunk = -(-D // self.world_size)
        start = min(self.rank * chunk, D)
        return chunk, start, min(chunk, D - start)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        W = self.world_size

        # 1) all reduce-scatters first, so the later ones travel while the first updates compute
        pending = []
        for group in self.param_groups:
            for p in group["params"]:
                grad = self.grad_of(p)
                if p.ndim == 0:
                    raise ValueError("DistAdamW shards along dim 0 and cannot take 0-d parameters")
                chunk, _, _ = self._rows(p)
                g = grad.contiguous()
                if chunk * W != p.size(0):
                    pad = g.new_zeros((chunk * W - p.size(0), *g.shape[1:]))
                    g = torch.cat([g, pad])
                g_slice = torch.empty((chunk, *g.shape[1:]), dtype=g.dtype, device=g.device)
                work = dist.reduce_scatter_tensor(g_slice, g, op=dist.ReduceOp.AVG, async_op=True)
                pending.append((group, p, g_slice, work, g))  # g (maybe a padded copy) kept alive until done

        # 2) AdamW on my rows, then launch the all-gather of the updated rows
        gathers = []
        for group, p, g_slice, work, _ in pending:
            work.wait()  # gloo has no get_future() on reduce-scatter; wait() works everywhere
            chunk, start, n = self._rows(p)
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros((n, *p.shape[1:]), dtype=torch.float32, device=p.device)
                state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
            state["step"] += 1
            beta1, beta2 = group["betas"]
            lr = group["lr"] * getattr(p, "lr_mul", 1.0)
            wd = group["weight_decay"] * getattr(p, "wd_mul", 1.0)
            p_rows = p[start : start + n]
            if n > 0:
                adamw_math(group)(p_rows, g_slice[:n].float(), state["exp_avg"], state["exp_avg_sq"], state["step"], lr, beta1, beta2, group["eps"], wd)
            if chunk * W == p.size(0) and p.is_contiguous():
                # even split: gather straight into the parameter (my rows are already in place)
                gathers.append((None, p, dist.all_gather_into_tensor(p, p_rows, async_op=True), p_rows))
            else:
                send = p.new_zeros((chunk, *p.shape[1:]))
                send[:n] = p_rows
                out = p.new_empty((chunk * W, *p.shape[1:]))
                gathers.append((out, p, dist.all_gather_into_tensor(out, send, async_op=True), send))

        # 3) finish the gathers (padded ones are copied into the parameter without their padding rows)
        for out, p, work, _ in gathers:
            work.wait()
            if out is not None:
                p.copy_(out[: p.size(0)])
        return loss

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # PerRankState: checks the rank and world size first
        # torch casts floating-point state to each parameter's dtype on load; our moments are fp32 by design
        # (bf16 moments would lose the small second-moment values), so restore the saved fp32 tensors.
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, saved in state_dict["state"].items():
            p = params[idx]
            for k, v in saved.items():
                if torch.is_tensor(v) and v.is_floating_point():
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32, copy=True)
