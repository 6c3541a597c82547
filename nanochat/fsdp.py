"""
The FSDP2 path (`--use_fsdp=1`, for models whose parameters + optimizer state do not fit one GPU: d40 and up).

API (every function is collective: call it on every rank, in the same order):

    model = GPT(config); model.to_empty(device=...); model.init_weights()   # identical on every rank (same seed)
    apply_fsdp(model, mesh=None, param_dtype=None, reduce_dtype=torch.float32)
        # in place: fully_shard every Block, then the whole model, on a 1-D mesh over all ranks. Parameters become
        # DTensors sharded along dim 0 (rank r keeps rows [r*c, (r+1)*c), c = ceil(rows/world), as torch.chunk).
        # param_dtype: the dtype of the all-gathered parameters used in forward/backward (None -> bf16 on CUDA, fp32
        # on CPU); the sharded master weights stay fp32. reduce_dtype: dtype of the gradient reduce-scatter.
    optimizers = setup_fsdp_optimizers(model, unembedding_lr, embedding_lr, matrix_lr, weight_decay, use_muon)
        # [FSDPAdamW, FSDPMuon] (or [FSDPAdamW] when use_muon is false). The group layout and learning rates come
        # from GPT.setup_optimizers itself (same LR scaling rules), rebuilt for DTensor parameters. Every group has
        # "initial_lr"; the training loop sets group["lr"] and FSDPMuon's group["momentum"] as for the DDP path.
    loss = model(x, y); loss.backward()          # gradients arrive reduce-scattered and averaged over ranks
    for opt in optimizers: opt.step()
    model.zero_grad(set_to_none=True)

    sd = full_model_state_dict(model)            # rank 0: {name: full fp32 CPU tensor}, nanochat's single-file
                                                 # format (what model.state_dict() gives in one process); others: {}
    load_full_model_state_dict(model, sd)        # a full state dict (DDP/single-process checkpoint, or the above) into
                                                 # the sharded model; every rank passes the full dict (each loads the file)
    opt.state_dict() / opt.load_state_dict(sd)   # per rank, plain local tensors (one optim file per rank); loading
                                                 # checks the rank and world size match

Evaluation and sampling during FSDP training: call the model as usual (`model(x)`, `model(x, y)`,
`model.generate(...)`, the KV-cache engine) -- FSDP's hooks all-gather each block's weights for its forward, so
the weights code sees inside forward are ordinary full tensors. Two rules:
  * every rank must run the same sequence of forward calls (each forward is a collective): sample on every rank with
    the same seed and print on rank 0; an eval loop that splits examples across ranks must give every rank the same
    number of forward calls (pad with a dummy example). Rank-0-only sampling under FSDP deadlocks.
  * outside forward, `model.<module>.weight` is a DTensor shard: `.shape`, `.numel()`, `.device`, `.dtype` are the
    global/full ones, but arithmetic on it is DTensor arithmetic. After a forward without backward (eval), the root's
    wte/lm_head and the last block stay gathered until the next backward; `model.reshard()` frees them. For a plain
    copy of the weights use full_model_state_dict().

FSDPMuon (why it exists): FSDP2 hands the optimizer dim-0 shards of each matrix. Orthogonalising a shard is not
orthogonalising the matrix (it is wrong, and running Newton-Schulz on DTensors is also very slow: DTensor matmuls
gather behind your back). FSDPMuon keeps the momentum on the shards (elementwise, exact), then per shape group
assigns matrix m to rank m % world: one all-to-all sends every rank's shard of each matrix to its owner (each rank
sends and receives 1/world of the group), the owner orthogonalises whole matrices (batched), and a second all-to-all
returns each rank its rows of the updates. Each full matrix is orthogonalised exactly once per step; the all-to-alls
carry the Newton-Schulz dtype (bf16 on CUDA, which Newton-Schulz would cast to anyway), and each shape group's
communication overlaps the previous group's compute. docs/distributed.md compares its communication per step with
FSDP+AdamW.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # FSDP2 (public here since torch 2.6)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private; knows FSDP x TP layouts

from nanochat.muon import _check_dist_state, _check_muon_hparams, group_params_by_shape, muon_momentum_, muon_orthogonalize, ns_dtype


def _require_dist():
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("FSDP needs torch.distributed initialised: launch with torchrun (even --nproc_per_node=1)")
    return dist.get_rank(), dist.get_world_size()


# -----------------------------------------------------------------------------
# sharding the model


def apply_fsdp(model, mesh=None, param_dtype=None, reduce_dtype=torch.float32):
    """
    Shard a GPT in place with FSDP2 (see the module docstring) and return it. The model must already hold its
    initial weights, identical on every rank (FSDP keeps each rank's slice of what is there).
    """
    _, world = _require_dist()
    device = model.get_device()
    if device.type == "meta":
        raise ValueError("apply_fsdp: the model is on the meta device; call model.to_empty(device=...) and model.init_weights() first")
    if mesh is None:
        mesh = init_device_mesh(device.type, (world,))
    if mesh.ndim != 1:
        raise ValueError(f"apply_fsdp supports a 1-D device mesh, got {mesh.ndim}-D (HSDP is not implemented)")
    if param_dtype is None:
        param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.transformer.h)
    for i, block in enumerate(blocks):
        # The last block's weights would be all-gathered again right away by backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    # the root group holds wte and lm_head
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


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


# -----------------------------------------------------------------------------
# checkpoints: the single-file full state dict


def full_model_state_dict(model):
    """
    Gather the full model state (every rank must call). Rank 0 gets {name: full tensor on CPU} with the same keys,
    shapes and dtypes as model.state_dict() of the unsharded model, so it saves in nanochat's single-file format;
    other ranks get {}. Tensors are gathered one at a time, so no rank ever holds more than one extra full tensor
    on the accelerator.
    """
    rank, _ = _require_dist()
    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            t = t.full_tensor()  # all-gather: every rank takes part
        if rank == 0:
            out[name] = t.detach().to("cpu", copy=True)
    return out


@torch.no_grad()
def load_full_model_state_dict(model, state_dict):
    """
    Load a full (unsharded) state dict into the FSDP (or FSDP x TP) model: each rank takes its own block, no communication. Every rank
    must pass the full dict (e.g. each rank reads the model_*.pt file). Keys must match exactly (strip `_orig_mod.`
    prefixes first); shapes must match the model's global shapes.
    """
    _require_dist()
    if not state_dict:
        raise ValueError("load_full_model_state_dict: empty state dict on this rank; every rank must pass the full state dict (load the checkpoint file on every rank)")
    current = model.state_dict()
    missing = sorted(set(current) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(current))
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    new = {}
    for name, cur in current.items():
        full = state_dict[name]
        if tuple(full.shape) != tuple(cur.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(cur.shape)}")
        if isinstance(cur, DTensor):
            # this rank's block of the full tensor, for any placements (FSDP's dim-0 rows, or a 2-D FSDP x TP box)
            shape, offset = compute_local_shape_and_global_offset(cur.shape, cur.device_mesh, cur.placements)
            local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(device=cur.device, dtype=cur.dtype).contiguous()
            new[name] = DTensor.from_local(local, cur.device_mesh, cur.placements, run_check=False, shape=cur.shape, stride=cur.stride())
        else:
            new[name] = full.to(device=cur.device, dtype=cur.dtype)
    model.load_state_dict(new, strict=True)


# -----------------------------------------------------------------------------
# optimizers


def _dtensor_state_to_local(sd):
    """Optimizer state dict with DTensor state replaced by this rank's local shard (plain tensors: portable files)."""
    state = {idx: {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in s.items()} for idx, s in sd["state"].items()}
    return dict(sd, state=state)


class FSDPAdamW(torch.optim.AdamW):
    """torch.optim.AdamW on FSDP's DTensor shards (the math is torch's); state_dict() holds this rank's local shards as
    plain tensors and load_state_dict() wraps them back as DTensors, so each rank saves and loads its own file."""

    def state_dict(self):
        sd = _dtensor_state_to_local(super().state_dict())
        sd["dist"] = {"world_size": dist.get_world_size(), "rank": dist.get_rank(), "kind": "FSDPAdamW"}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = _check_dist_state(state_dict, "FSDPAdamW", dist.get_rank(), dist.get_world_size())
        super().load_state_dict(state_dict)
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


class FSDPMuon(torch.optim.Optimizer):
    """
    Muon for FSDP2-sharded matrices (see the module docstring). State: one momentum buffer per parameter, the size of
    this rank's shard (so the state is sharded exactly like the parameters). Groups are split by shape; the
    hyperparameters per group are those of Muon (lr, momentum, nesterov, ns_steps).
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5):
        _check_muon_hparams(lr, momentum, ns_steps)
        self.rank, self.world_size = _require_dist()
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(group_params_by_shape(params), defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, DTensor):
                    raise TypeError("FSDPMuon takes FSDP-sharded (DTensor) parameters; use Muon/DistMuon for plain tensors")
                if p.device_mesh.size() != self.world_size:
                    raise ValueError("FSDPMuon expects the FSDP mesh to span all ranks (a 1-D mesh of the whole world)")
                _dim0_rows(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        W, rank = self.world_size, self.rank

        # 1) Momentum on my shards, packed per group into (W, K, chunk, cols): slot [j, k] is my shard of matrix
        #    k*W + j (owned by rank j), zero-padded to `chunk` rows. One all-to-all per group, all launched up front.
        pending = []
        for group in self.param_groups:
            ps = group["params"]
            rows, cols = ps[0].shape
            chunk = -(-rows // W)
            K = -(-len(ps) // W)  # matrices per owner (last round padded with zero matrices)
            cdtype = ns_dtype(ps[0].device)
            send = torch.zeros((W, K, chunk, cols), dtype=cdtype, device=ps[0].to_local().device)
            for m, p in enumerate(ps):
                if p.grad is None:
                    raise RuntimeError(f"FSDPMuon: a parameter of shape {tuple(p.shape)} has no gradient on rank {rank}; every rank must backprop through every matrix")
                g = p.grad.to_local()
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                k, j = divmod(m, W)
                d = muon_momentum_(g, state["momentum_buffer"], group["momentum"], group["nesterov"])
                send[j, k, : d.size(0)] = d
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, async_op=True)
            pending.append((group, rows, chunk, K, recv, work, send))  # send kept alive until the all-to-all is done

        # 2) Per group: assemble my K full matrices, orthogonalise them in one batch, send each rank its rows back.
        returns = []
        for group, rows, chunk, K, recv, work, _ in pending:
            work.wait()
            cols = recv.size(-1)
            # recv[i, k] = rank i's rows of matrix k*W + rank  ->  (K, W*chunk, cols), padding rows at the end
            full = recv.permute(1, 0, 2, 3).reshape(K, W * chunk, cols)[:, :rows]
            n_mine = len([m for m in range(rank, len(group["params"]), W)])  # my real matrices; the rest are padding
            upd = torch.zeros((K, W * chunk, cols), dtype=recv.dtype, device=recv.device)
            if n_mine > 0:
                upd[:n_mine, :rows] = muon_orthogonalize(full[:n_mine], group["ns_steps"]).to(recv.dtype)
            send = upd.view(K, W, chunk, cols).permute(1, 0, 2, 3).contiguous()  # slot [i, k]: rank i's rows
            back = torch.empty_like(send)
            returns.append((group, back, dist.all_to_all_single(back, send, async_op=True), send))

        # 3) Apply my rows of every update: back[j, k] holds my rows of matrix k*W + j.
        for group, back, work, _ in returns:
            work.wait()
            for m, p in enumerate(group["params"]):
                k, j = divmod(m, W)
                local = p.to_local()
                local.add_(back[j, k, : local.size(0)].to(local.dtype), alpha=-group["lr"])
        return loss

    def state_dict(self):
        sd = super().state_dict()
        sd["dist"] = {"world_size": self.world_size, "rank": self.rank, "kind": "FSDPMuon"}
        return sd

    def load_state_dict(self, state_dict):
        super().load_state_dict(_check_dist_state(state_dict, "FSDPMuon", self.rank, self.world_size))


def setup_fsdp_optimizers(model, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0, use_muon=True,
                          muon_cls=None):
    """
    The optimizers for an apply_fsdp()-sharded GPT: FSDPAdamW for lm_head and wte (and the matrices when use_muon is
    false), FSDPMuon (or `muon_cls`: the tensor-parallel path passes ShardedMuon) for the block matrices. The groups, learning rates (with GPT's width scaling), betas, eps and
    weight decay are taken from GPT.setup_optimizers so the two paths cannot drift apart; only the optimizer classes
    change. Every group carries "initial_lr".
    """
    _require_dist()
    from nanochat.gpt import GPT

    # GPT.setup_optimizers only groups the parameters here (its optimizers allocate state lazily); each one is
    # rebuilt below with the same groups for DTensor parameters.
    reference = GPT.setup_optimizers(model, unembedding_lr=unembedding_lr, embedding_lr=embedding_lr, matrix_lr=matrix_lr, weight_decay=weight_decay, use_muon=use_muon)
    optimizers = []
    for ref in reference:
        groups = [dict(g) for g in ref.param_groups]
        if "betas" in groups[0]:  # an AdamW (torch's or DistAdamW)
            keep = ("params", "lr", "betas", "eps", "weight_decay", "initial_lr")
            groups = [{k: g[k] for k in keep} for g in groups]
            # foreach on CUDA (torch's default) works with DTensors; the fused kernel is not used for them
            optimizers.append(FSDPAdamW(groups, lr=groups[0]["lr"], betas=groups[0]["betas"], eps=groups[0]["eps"], weight_decay=groups[0]["weight_decay"]))
        else:  # a Muon
            keep = ("params", "lr", "momentum", "nesterov", "ns_steps", "initial_lr")
            groups = [{k: g[k] for k in keep} for g in groups]
            optimizers.append((muon_cls or FSDPMuon)(groups))
    return optimizers
