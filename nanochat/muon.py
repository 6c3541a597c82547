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
  padded with zero matrices (padding owners do no work). Momentum (and NorMuon's second moment) lives only on the
  owner (sharded state: one optimizer state file per rank). Communication is launched asynchronously so it overlaps
  the Newton-Schulz compute.
The variants for DTensor shards (FSDP2, FSDP x TP) are ShardedMuon and FSDPMuon in nanochat/optim/sharded.py; they
call the same two functions. All three subclass Muon (its hyperparameters, shape groups and momentum buffers), and the
distributed ones share their torchrun check and per-rank state dicts (nanochat/optim/base.py).

The record recipe's Muon (nanochat 92d63d4, the time-to-GPT-2 record) is the same optimizer with options per param
group, so every distributed form gets them from one implementation of the math. The interface (what GPT's optimizer
setup puts in a Muon param group; every key but params is optional and defaults to the December value):

    dict(params=[2-D tensors], lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,     # December Muon
         ns="quintic" | "polar_express",   # the orthogonaliser: Keller Jordan's fixed quintic, or Polar Express
         row_equilibrate=False,            # MuonEq: rows rescaled to the mean row norm before orthogonalising
         renormalize=False,                # Muon+: the orthogonalised update's Frobenius norm set to sqrt(min(rows, cols))
         normuon=False, beta2=0.9,         # NorMuon: per-row (rows >= cols) or per-column second moment, EMA beta2
         weight_decay=0.0, cautious_wd=False)  # decoupled decay lr*wd*p; cautious: only where the update and p agree
                                               # in sign

`RECORD_MUON` holds 92d63d4's values of the options (its groups add lr=matrix_lr, momentum, weight_decay). With any
option on, the step is 92d63d4's: momentum (Nesterov) -> [MuonEq] -> orthogonalise -> [Muon+] -> [NorMuon] ->
p -= lr' * (update + wd * p * mask), with lr' = lr * sqrt(max(1, rows/cols)); with all of them off (and
weight_decay=0) it is the December update, bit for bit. The training loop's schedules (lr, momentum, weight_decay)
write the group keys each step, as for lr today. State per matrix: momentum_buffer and, with normuon,
second_momentum_buffer ((rows, 1) or (1, cols)).

Which step runs where: the momentum is elementwise (any shard of a matrix); MuonEq, the orthogonalisation, Muon+ and
NorMuon's statistics need the whole matrix (its owner computes them, `muon_direction`); NorMuon's buffer update and
the final scaling and the (cautious) decay are elementwise again given those statistics (`muon_finish`,
`muon_apply_`), so the sharded optimizers apply them on each rank's own rectangle.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from nanochat.optim.base import PerRankState, run_closure

# Coefficients of the quintic iteration X <- aX + b(XX^T)X + c(XX^T)^2 X, chosen (Keller Jordan) to push every singular
# value in (0, 1] quickly into roughly [0.7, 1.2]: a steep slope at 0 matters more than exact convergence to 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): a different (a, b, c) for each step of the same
# quintic, each chosen to minimise the worst-case error of that step on the interval the previous one left, so five
# steps land the singular values much closer to 1 than the fixed quintic does. These are the paper's coefficients for
# 5 iterations with safety factor 2e-2 and cushion 2, as nanochat 92d63d4 uses them.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
ORTHOGONALIZERS = ("quintic", "polar_express")  # the values of a group's `ns`

# 92d63d4's values of the record options (see the module docstring); its Muon groups add lr, momentum, weight_decay.
RECORD_MUON = dict(ns="polar_express", ns_steps=5, row_equilibrate=True, renormalize=True, normuon=True, beta2=0.9,
                   cautious_wd=True)


def ns_dtype(device) -> torch.dtype:
    """Newton-Schulz compute dtype: bf16 on CUDA (tensor cores; the iteration tolerates it), fp32 elsewhere (CPU bf16
    matmuls are ~10x slower than fp32). FSDPMuon also communicates in this dtype: no precision is lost by it."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# Newton-Schulz is a chain of small matmuls and elementwise ops: compiled (as nanochat decorates it with
# @torch.compile) it fuses the elementwise work. Off by default, so plain uses and the test suite stay eager (compile
# time would dominate them); nanochat.compile turns it on for runs that compile the model.
_COMPILED_NS = {}  # {ns: the compiled iteration} while compiling is on, else empty


def set_compile(enabled, backend="inductor"):
    """Compile the orthogonalisers (enabled=True: each compiles on its first call) or run them eagerly (False)."""
    global _COMPILED_NS
    _COMPILED_NS = {ns: torch.compile(fn, dynamic=False, backend=backend) for ns, fn in _ITERATIONS.items()} if enabled else {}


def zeropower_via_newtonschulz5(G: Tensor, steps: int = 5) -> Tensor:
    """
    Approximately orthogonalise G (..., rows, cols): returns ~U V^T where G = U S V^T, batched over leading dims.
    Computes in ns_dtype(G.device) and returns that dtype; callers cast as they need. Compiled after set_compile(True).
    """
    return _orthogonalize("quintic", G, steps)


def zeropower_via_polar_express(G: Tensor, steps: int = 5) -> Tensor:
    """
    Polar Express orthogonalisation of G (..., rows, cols), up to 5 steps: same contract as zeropower_via_newtonschulz5
    (batched, computes and returns ns_dtype(G.device), compiled after set_compile(True)).
    """
    if not 1 <= steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"Polar Express has coefficients for 1 to {len(POLAR_EXPRESS_COEFFS)} steps, got {steps}")
    return _orthogonalize("polar_express", G, steps)


def _orthogonalize(ns, G, steps):
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz orthogonalisation needs a matrix (or a batch of them), got shape {tuple(G.shape)}")
    return (_COMPILED_NS.get(ns) or _ITERATIONS[ns])(G, steps)


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


@torch.no_grad()
def _polar_express(G: Tensor, steps: int) -> Tensor:
    X = G.to(ns_dtype(G.device))
    # a little below the unit interval (the 1.01): the coefficients' safety margin against bf16 rounding
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-6)
    # the smaller Gram matrix: X^T X (cols x cols) for a tall matrix, X X^T for a wide one (no transposes needed)
    if X.size(-2) > X.size(-1):
        for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
            A = X.mT @ X
            B = b * A + c * (A @ A)
            X = a * X + X @ B
    else:
        for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
            A = X @ X.mT
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    return X


_ITERATIONS = {"quintic": _newtonschulz5, "polar_express": _polar_express}


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


# The record options' step (see the module docstring), in the three parts the sharded optimizers run in different
# places: muon_direction on whole matrices (the owner), muon_finish and muon_apply_ on any rectangle of one.


def f32(x: float) -> float:
    """x rounded to float32. The record step does its scalar arithmetic (1 - momentum, 1 - beta2, lr * wd) in
    float32, as 92d63d4's 0-d float32 hyperparameter tensors do: the cautious mask (sign of update * p) is
    discontinuous, so one last bit of difference would flip it somewhere in a large matrix."""
    return torch.tensor(x, dtype=torch.float32).item()


def uses_record_options(group):
    """True when a Muon group's step is the record one (any option on), False for the December update."""
    return (group["ns"] != "quintic" or group["row_equilibrate"] or group["renormalize"] or group["normuon"]
            or group["weight_decay"] != 0)


def step_momentum(group):
    """The momentum the step uses: the group's, rounded to float32 in the record step (see f32)."""
    return f32(group["momentum"]) if uses_record_options(group) else group["momentum"]


def shape_lr_scale(shape):
    """sqrt(max(1, rows/cols)): tall matrices' per-element updates as large as wide ones' (see muon_orthogonalize)."""
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


def normuon_dim(shape):
    """The dim NorMuon averages over: per row (mean over the columns) when rows >= cols, else per column."""
    return -1 if shape[-2] >= shape[-1] else -2


def normuon_buffer_shape(shape):
    return (shape[-2], 1) if normuon_dim(shape) == -1 else (1, shape[-1])


def muon_direction(d: Tensor, group, dtype):
    """
    The whole-matrix part of the record step on d (..., rows, cols), the Nesterov direction: returns (X, factor, v_mean).
    X: d orthogonalised (with MuonEq first if row_equilibrate), in ns_dtype. factor: Muon+'s scale of X (..., 1, 1) in
    `dtype` (the parameters'), or None. v_mean: NorMuon's mean square per row/column of X*factor (fp32), or None.
    """
    X = d.to(ns_dtype(d.device))
    if group["row_equilibrate"]:  # MuonEq: every row to the mean row norm, a better-conditioned input to the iteration
        target = X.float().norm(dim=(-2, -1), keepdim=True) / X.size(-2) ** 0.5
        row_norm = X.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)
        X = X * (target / row_norm).to(X.dtype)
    X = (zeropower_via_polar_express if group["ns"] == "polar_express" else zeropower_via_newtonschulz5)(X, group["ns_steps"])
    g, factor, v_mean = X.to(dtype), None, None
    if group["renormalize"]:  # Muon+: the Frobenius norm an exactly semi-orthogonal matrix has (corrects under-convergence)
        factor = (min(g.size(-2), g.size(-1)) ** 0.5 / g.float().norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6)).to(dtype)
        g = g * factor
    if group["normuon"]:
        v_mean = g.float().square().mean(dim=normuon_dim(g.shape), keepdim=True)
    return X, factor, v_mean


def normuon_scale_(buf: Tensor, v_mean: Tensor, beta2: float, red_size: int) -> Tensor:
    """
    NorMuon (arXiv:2510.05491): fold this step's mean squares into `buf` (an EMA, updated in place) and return the
    per-row/column scale (buf's shape) that evens out the rows' (columns') update sizes, normalised so the update keeps
    its total norm. Elementwise in the rows (columns), given v_mean: any holder of the buffer can run it.
    """
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * red_size).sqrt()
    buf.lerp_(v_mean.to(buf.dtype), 1 - f32(beta2))  # f32(b) is exact in a double, so 1 - f32(b) rounds as float32 does
    step_size = buf.clamp_min(1e-10).rsqrt()
    v_norm_new = ((v_mean * red_size) * step_size.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return step_size * (v_norm / v_norm_new.clamp_min(1e-10))


def muon_finish(X: Tensor, factor, v_mean, buf, group, dtype, shape, box=None) -> Tensor:
    """
    The update (in `dtype`, the parameter's) for X, one matrix of shape `shape` or its rectangle `box` = (rows, cols,
    row0, col0), from the owner's statistics (muon_direction): X * factor * NorMuon's scale. Advances `buf` (NorMuon's
    second moment of the whole matrix; None without normuon). Every holder of the matrix runs it with the same numbers.
    """
    g = X.to(dtype)
    if factor is not None:
        g = g * factor
    if v_mean is not None:
        dim = normuon_dim(shape)
        scale = normuon_scale_(buf, v_mean, group["beta2"], shape[dim])
        if box is not None:
            r, c, r0, c0 = box
            scale = scale[r0 : r0 + r] if dim == -1 else scale[:, c0 : c0 + c]
        g = g * scale.to(g.dtype)
    return g


def muon_apply_(p: Tensor, g: Tensor, lr: float, weight_decay: float, cautious: bool):
    """p -= lr * (g + weight_decay * p [* mask]); cautious: decay only where g and p agree in sign (the update already
    pulls p toward zero there), so decay never fights the gradient. Elementwise: runs on any rectangle of p."""
    if weight_decay == 0:
        p.sub_(lr * g)
        return
    decay = p * ((g * p) >= 0) if cautious else p
    p.sub_(lr * g + f32(f32(lr) * f32(weight_decay)) * decay)


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
    Hyperparameters per group: lr, momentum (the training loop ramps it), nesterov, ns_steps, and the record options
    (module docstring: ns, row_equilibrate, renormalize, normuon, beta2, weight_decay, cautious_wd).
    State per parameter: momentum_buffer (same dtype as the parameter), second_momentum_buffer with normuon. The
    distributed variants (DistMuon here, ShardedMuon/FSDPMuon in nanochat/optim/sharded.py) subclass it for these
    and write their own step().
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns="quintic", row_equilibrate=False,
                 renormalize=False, normuon=False, beta2=0.9, weight_decay=0.0, cautious_wd=False):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns=ns,
                        row_equilibrate=row_equilibrate, renormalize=renormalize, normuon=normuon, beta2=beta2,
                        weight_decay=weight_decay, cautious_wd=cautious_wd)
        super().__init__(group_params_by_shape(params), defaults)
        for group in self.param_groups:
            check_muon_group(group)

    def momentum_buffer(self, p, like=None):
        """p's momentum buffer, zeros shaped like `like` (p itself, or this rank's shard of it) on first use."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p if like is None else like)
        return state["momentum_buffer"]

    def second_moment(self, p, group, dtype):
        """NorMuon's buffer of p's whole matrix ((rows, 1) or (1, cols), zeros on first use), or None without normuon."""
        if not group["normuon"]:
            return None
        state = self.state[p]
        if "second_momentum_buffer" not in state:
            state["second_momentum_buffer"] = torch.zeros(normuon_buffer_shape(p.shape), dtype=dtype, device=p.device)
        elif state["second_momentum_buffer"].device != p.device:  # a sharded checkpoint loads replicated state on CPU
            state["second_momentum_buffer"] = state["second_momentum_buffer"].to(p.device)
        return state["second_momentum_buffer"]

    def update_whole_(self, p, grad, group):
        """One step of matrix p (held whole) with gradient `grad`: the December update, or the record one."""
        if not uses_record_options(group):
            update = muon_update(grad, self.momentum_buffer(p), group["momentum"], group["nesterov"], group["ns_steps"])
            p.add_(update.to(p.dtype), alpha=-group["lr"])
            return
        d = muon_momentum_(grad, self.momentum_buffer(p), step_momentum(group), group["nesterov"])
        # as a batch of one: CPU matmuls of small matrices round differently in 2-D and batched, and the sharded
        # optimizers (and 92d63d4, which stacks each shape group) orthogonalise batches
        X, factor, v_mean = (t if t is None else t[0] for t in muon_direction(d[None], group, p.dtype))
        g = muon_finish(X, factor, v_mean, self.second_moment(p, group, p.dtype), group, p.dtype, p.shape)
        muon_apply_(p, g, group["lr"] * shape_lr_scale(p.shape), group["weight_decay"], group["cautious_wd"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update_whole_(p, p.grad, group)
        return loss


def check_muon_group(group):
    """Refuse a Muon param group's bad hyperparameters with the value and the valid range."""
    if group["lr"] < 0:
        raise ValueError(f"Muon lr must be >= 0, got {group['lr']}")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"Muon momentum must be in [0, 1), got {group['momentum']}")
    if int(group["ns_steps"]) != group["ns_steps"] or group["ns_steps"] < 1:
        raise ValueError(f"Muon ns_steps must be a positive integer, got {group['ns_steps']}")
    if group["ns"] not in ORTHOGONALIZERS:
        raise ValueError(f"Muon ns must be one of {'|'.join(ORTHOGONALIZERS)}, got {group['ns']!r}")
    if group["ns"] == "polar_express" and group["ns_steps"] > len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"Muon ns=polar_express has coefficients for at most {len(POLAR_EXPRESS_COEFFS)} steps, got ns_steps={group['ns_steps']}")
    if not 0.0 <= group["beta2"] < 1.0:
        raise ValueError(f"Muon beta2 (NorMuon) must be in [0, 1), got {group['beta2']}")
    if group["weight_decay"] < 0:
        raise ValueError(f"Muon weight_decay must be >= 0, got {group['weight_decay']}")


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
                self.update_whole_(mine, grad, group)
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
