"""
Optimizers for DTensor parameters: what FSDP2 (`--use_fsdp=1`, nanochat/distributed/fsdp.py) and FSDP x TP (`--tp_size`,
nanochat/distributed/tensor_parallel.py) hand the optimizer. nanochat/optim/__init__.py has the map of all the optimizers.

    optimizers = setup_fsdp_optimizers(model, **GPT.setup_optimizers' kwargs)
        # [FSDPAdamW, FSDPMuon] (or [FSDPAdamW] when use_muon is false; muon_cls=ShardedMuon for FSDP x TP). The
        # group layout, learning rates and options come from GPT.setup_optimizers itself (same LR scaling rules),
        # rebuilt for DTensor parameters. Every group has "initial_lr"; the training loop sets group["lr"] and the
        # Muon's group["momentum"] (and "weight_decay") as for the DDP path.
    opt.state_dict() / opt.load_state_dict(sd)   # per rank, plain local tensors (one optim file per rank); loading
                                                 # checks the class, rank and world size match (optim/base.py)

FSDPAdamW is torch.optim.AdamW: its math is elementwise, so it runs on the DTensor shards with no communication.

ShardedMuon (why it exists): FSDP2 hands the optimizer dim-0 shards of each matrix (FSDP x TP: rectangles of it).
Orthogonalising a shard is not orthogonalising the matrix (it is wrong, and running Newton-Schulz on DTensors is also
very slow: DTensor matmuls gather behind your back). ShardedMuon keeps the momentum on the shards (elementwise,
exact), then per shape group assigns matrix m to rank m % world: one all-to-all sends every rank's rectangle of each
matrix to its owner (each rank sends and receives 1/world of the group), the owner orthogonalises whole matrices
(batched), and a second all-to-all returns each rank its rectangle of the updates. Each full matrix is orthogonalised
exactly once per step, so the update equals the unsharded one; the all-to-alls carry the Newton-Schulz dtype (bf16 on
CUDA, which Newton-Schulz would cast to anyway), and each shape group's communication overlaps the previous group's
compute. With the record options (nanochat/muon.py) the owner also computes each matrix's whole-matrix statistics
(Muon+'s norm factor, NorMuon's mean squares per row or column: rows + 1 floats) and one all-gather per group gives
them to every rank, which updates its copy of the NorMuon buffer and scales and decays its own rectangle with exactly
the numbers one process would use. FSDPMuon is ShardedMuon checked for apply_fsdp's layout (dim-0 shards on a 1-D mesh), with its own
state-dict kind so FSDP checkpoints load only into the FSDP path. docs/distributed.md compares its communication per
step with FSDP+AdamW.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private; the one helper that knows FSDP x TP (_StridedShard) layouts

from nanochat.muon import (Muon, muon_apply_, muon_direction, muon_finish, muon_momentum_, muon_orthogonalize,
                           normuon_buffer_shape, ns_dtype, shape_lr_scale, step_momentum, uses_record_options)
from nanochat.optim.base import PerRankState, run_closure


def _dtensor_state_to_local(sd):
    """Optimizer state dict with DTensor state replaced by this rank's local shard (plain tensors: portable files)."""
    state = {idx: {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in s.items()} for idx, s in sd["state"].items()}
    return dict(sd, state=state)


class FSDPAdamW(PerRankState, torch.optim.AdamW):
    """torch.optim.AdamW on FSDP's DTensor shards (the math is torch's); state_dict() holds this rank's local shards as
    plain tensors and load_state_dict() wraps them back as DTensors, so each rank saves and loads its own file."""

    def state_dict(self):
        return _dtensor_state_to_local(super().state_dict())

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # PerRankState: checks the class, rank and world size first
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    continue
                st = self.state.get(p, {})
                for k, v in list(st.items()):
                    if torch.is_tensor(v) and not isinstance(v, DTensor) and k != "step":
                        if v.shape != p.to_local().shape:
                            raise ValueError(f"FSDPAdamW state {k!r} has local shape {tuple(v.shape)} but the parameter shard is {tuple(p.to_local().shape)}")
                        st[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _dim0_rows(dtensor):
    """(chunk, start, n): rows [start, start+n) of dim 0 that this rank holds, chunk = ceil(rows/world) (torch.chunk)."""
    mesh = dtensor.device_mesh
    if mesh.ndim != 1 or tuple(dtensor.placements) != (Shard(0),):
        raise ValueError(f"expected a DTensor sharded along dim 0 on a 1-D mesh, got placements {dtensor.placements} on a {mesh.ndim}-D mesh")
    W, r = mesh.size(), mesh.get_local_rank()
    D = dtensor.shape[0]
    chunk = -(-D // W)
    start = min(r * chunk, D)
    n = min(chunk, D - start)
    local = dtensor.to_local()
    if local.shape[0] != n:
        raise RuntimeError(f"FSDP shard of a {tuple(dtensor.shape)} parameter has {local.shape[0]} rows on rank {r}; expected {n} (torch.chunk layout)")
    return chunk, start, n


def local_box(p):
    """(rows, cols, row0, col0): the rectangle of the full matrix that this rank's DTensor shard of `p` holds."""
    if not isinstance(p, DTensor):
        return (*p.shape, 0, 0)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(p.to_local().shape):
        raise RuntimeError(f"local shard of a {tuple(p.shape)} parameter is {tuple(p.to_local().shape)}, expected {tuple(shape)} from its placements {p.placements}")
    return (shape[0], shape[1], offset[0], offset[1])


class ShardedMuon(PerRankState, Muon):
    """
    Muon for DTensor matrices sharded over any mesh that spans all ranks, 1-D (FSDP) or 2-D (FSDP x TP): each rank
    holds a rectangle of each matrix (see the module docstring). State: one momentum buffer per parameter, the size
    of this rank's shard (so the state is sharded exactly like the parameters), and with normuon the whole matrix's
    NorMuon second moment ((rows, 1) or (1, cols)), the same on every rank: a checkpoint resharded to another number
    of ranks finds it whole. Groups are split by shape; the hyperparameters per group are Muon's (lr, momentum,
    nesterov, ns_steps and the record options of nanochat/muon.py). state_dict() is per rank, tagged with the class
    name and checked on load.
    """

    def __init__(self, params, **hyperparameters):
        super().__init__(params, **hyperparameters)
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    raise TypeError(f"{self.kind} takes sharded (DTensor) parameters; use Muon/DistMuon for plain tensors")
                if p.device_mesh.size() != self.world_size:
                    raise ValueError(f"{self.kind} expects each parameter's mesh to span all {self.world_size} ranks, got a mesh of {p.device_mesh.size()}")
        self._boxes = None  # per group: [per matrix: [per global rank: (rows, cols, row0, col0)]], gathered once

    def _all_boxes(self):
        if self._boxes is None:
            mine = [[local_box(p) for p in g["params"]] for g in self.param_groups]
            every = [None] * self.world_size
            dist.all_gather_object(every, mine)  # once: the layout does not change during training
            self._boxes = [[[every[r][gi][m] for r in range(self.world_size)] for m in range(len(g["params"]))] for gi, g in enumerate(self.param_groups)]
        return self._boxes

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        W, rank = self.world_size, self.rank
        boxes = self._all_boxes()

        # 1) Momentum on my shards; slot [j, k] of the send buffer is my shard of matrix k*W + j (owner j),
        #    flattened and zero-padded to the largest shard of the group. One all-to-all per group, all up front.
        pending = []
        for gi, group in enumerate(self.param_groups):
            ps = group["params"]
            K = -(-len(ps) // W)
            slot = max(b[0] * b[1] for per_rank in boxes[gi] for b in per_rank)
            device = ps[0].to_local().device
            send = torch.zeros((W, K, slot), dtype=ns_dtype(device), device=device)
            for m, p in enumerate(ps):
                g = self.grad_of(p).to_local()
                d = muon_momentum_(g, self.momentum_buffer(p, like=g), step_momentum(group), group["nesterov"])
                k, j = divmod(m, W)
                send[j, k, : d.numel()] = d.reshape(-1)
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, async_op=True)
            pending.append((gi, group, K, recv, work, send))  # send kept alive until the all-to-all is done

        # 2) Per group: assemble my matrices from every rank's rectangles, orthogonalise them in one batch, send each
        #    rank its rectangles of the updates. Record step: the rectangles are of the orthogonalised X, and every
        #    rank also gets each matrix's statistics (Muon+'s factor, NorMuon's mean squares) to finish its own part.
        returns = []
        for gi, group, K, recv, work, _ in pending:
            work.wait()
            record = uses_record_options(group)
            rows, cols = group["params"][0].shape
            dtype = group["params"][0].to_local().dtype
            mine = list(range(rank, len(group["params"]), W))  # my matrices: m = k*W + rank
            send = torch.zeros_like(recv)
            stats = None  # record step, per slot: [Muon+ factor, NorMuon's mean squares of the rows (or columns)...]
            if record:
                stats = torch.zeros((K, 1 + math.prod(normuon_buffer_shape((rows, cols)))), dtype=torch.float32, device=recv.device)
            if mine:
                full = torch.empty((len(mine), rows, cols), dtype=recv.dtype, device=recv.device)
                for k, m in enumerate(mine):
                    for i, (r, c, r0, c0) in enumerate(boxes[gi][m]):
                        full[k, r0 : r0 + r, c0 : c0 + c] = recv[i, k, : r * c].view(r, c)
                if record:
                    upd, factor, v_mean = muon_direction(full, group, dtype)
                    if factor is not None:
                        stats[: len(mine), 0] = factor.view(-1).float()
                    if v_mean is not None:
                        stats[: len(mine), 1:] = v_mean.reshape(len(mine), -1)
                else:
                    upd = muon_orthogonalize(full, group["ns_steps"])
                upd = upd.to(recv.dtype)
                for k, m in enumerate(mine):
                    for i, (r, c, r0, c0) in enumerate(boxes[gi][m]):
                        send[i, k, : r * c] = upd[k, r0 : r0 + r, c0 : c0 + c].reshape(-1)
            back = torch.empty_like(send)
            work = dist.all_to_all_single(back, send, async_op=True)
            gathered = stats_work = None
            if record:
                gathered = torch.empty((W * K, stats.size(1)), dtype=stats.dtype, device=stats.device)  # gloo: dim-0 concat
                stats_work = dist.all_gather_into_tensor(gathered, stats, async_op=True)
            returns.append((gi, group, back, work, send, gathered, stats_work, stats))

        # 3) Apply my rectangles: back[j, k] holds my part of matrix k*W + j (and gathered[j, k] its statistics).
        for gi, group, back, work, _, gathered, stats_work, _ in returns:
            work.wait()
            if stats_work is not None:
                stats_work.wait()
                gathered = gathered.view(W, -1, gathered.size(1))
            for m, p in enumerate(group["params"]):
                k, j = divmod(m, W)
                local = p.to_local()
                X = back[j, k, : local.numel()].view_as(local)
                if gathered is None:
                    local.add_(X.to(local.dtype), alpha=-group["lr"])
                    continue
                factor = gathered[j, k, :1].view(1, 1).to(local.dtype) if group["renormalize"] else None
                v_mean = gathered[j, k, 1:].view(normuon_buffer_shape(p.shape)) if group["normuon"] else None
                buf = self.second_moment(p, group, local.dtype)  # the whole matrix's, the same on every rank
                g = muon_finish(X, factor, v_mean, buf, group, local.dtype, p.shape, box=boxes[gi][m][rank])
                muon_apply_(local, g, group["lr"] * shape_lr_scale(p.shape), group["weight_decay"], group["cautious_wd"])
        return loss


class FSDPMuon(ShardedMuon):
    """ShardedMuon for apply_fsdp's layout (dim-0 shards on a 1-D mesh of all ranks; checked), with its own
    state-dict kind so FSDP checkpoints keep loading only into the FSDP path."""

    def __init__(self, params, **hyperparameters):
        super().__init__(params, **hyperparameters)
        for group in self.param_groups:
            for p in group["params"]:
                _dim0_rows(p)  # raises unless Shard(0) on a 1-D mesh


def setup_fsdp_optimizers(model, muon_cls=None, **kwargs):
    """
    The optimizers for an apply_fsdp()-sharded GPT: FSDPAdamW for lm_head and wte (and the matrices when use_muon is
    false), FSDPMuon (or `muon_cls`: the tensor-parallel path passes ShardedMuon) for the block
    matrices. The groups, learning rates (with GPT's width scaling), betas, eps and weight decay, and the Muon groups'
    options, are taken from the model's own setup_optimizers(**kwargs) (GPT's or RecordGPT's: unembedding_lr,
    embedding_lr, matrix_lr, weight_decay, use_muon, ...) so the paths cannot drift apart; only the optimizer classes change. Every group
    carries "initial_lr".
    """
    # setup_optimizers only groups the parameters here (its optimizers allocate state lazily); each one is
    # rebuilt below with the same groups for DTensor parameters.
    reference = model.setup_optimizers(**kwargs)
    optimizers = []
    for ref in reference:
        groups = [dict(g) for g in ref.param_groups]
        if "betas" in groups[0]:  # an AdamW (torch's or DistAdamW)
            keep = ("params", "lr", "betas", "eps", "weight_decay", "initial_lr")
            groups = [{k: g[k] for k in keep} for g in groups]
            # foreach on CUDA (torch's default) works with DTensors; the fused kernel is not used for them
            optimizers.append(FSDPAdamW(groups, lr=groups[0]["lr"], betas=groups[0]["betas"], eps=groups[0]["eps"], weight_decay=groups[0]["weight_decay"]))
        else:  # a Muon: every group key is a Muon hyperparameter (nanochat/muon.py), kept as they are
            optimizers.append((muon_cls or FSDPMuon)(groups))
    return optimizers
