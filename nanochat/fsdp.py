"""
The FSDP2 path (`--use_fsdp=1`, for models whose parameters + optimizer state do not fit one GPU: d40 and up).

API (every function is collective: call it on every rank, in the same order):

    model = GPT(config); model.to_empty(device=...); model.init_weights()   # identical on every rank (same seed)
    apply_fsdp(model, mesh=None, param_dtype=None, reduce_dtype=torch.float32)
        # in place: fully_shard every Block, then the whole model, on a 1-D mesh over all ranks. Parameters become
        # DTensors sharded along dim 0 (rank r keeps rows [r*c, (r+1)*c), c = ceil(rows/world), as torch.chunk).
        # param_dtype: the dtype of the all-gathered parameters used in forward/backward (None -> bf16 on CUDA, fp32
        # on CPU); the sharded master weights stay fp32. reduce_dtype: dtype of the gradient reduce-scatter.
        # A first forward under inference_mode (sampling) is safe: keep_unsharded_params_out_of_inference_mode.
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
    with full_weights(model): ...                # every rank holds the whole model (compute dtype) and its forwards
                                                 # are local: ranks may run different forwards (RL sampling)

Evaluation and sampling during FSDP training: call the model as usual (`model(x)`, `model(x, y)`,
`model.generate(...)`, the KV-cache engine) -- FSDP's hooks all-gather each block's weights for its forward, so
the weights code sees inside forward are ordinary full tensors. Two rules:
  * every rank must run the same sequence of forward calls (each forward is a collective): sample on every rank with
    the same seed and print on rank 0; an eval loop that splits examples across ranks must give every rank the same
    number of forward calls (pad with a dummy example). Rank-0-only sampling under FSDP deadlocks.
  * or, for a long stretch of forwards that differ across ranks (chat_rl's sampling with the Engine), hold the whole
    model on every rank with `full_weights(model)`: one all-gather on entry, no collective in any forward inside, and
    the gathered copy freed on exit. It costs what DDP holds anyway: the full weights in param_dtype.
  * outside forward, `model.<module>.weight` is a DTensor shard: `.shape`, `.numel()`, `.device`, `.dtype` are the
    global/full ones, but arithmetic on it is DTensor arithmetic. After a forward without backward (eval), the root's
    wte/lm_head and the last block stay gathered until the next backward; `model.reshard()` frees them. For a plain
    copy of the weights use full_model_state_dict().

FSDPMuon (why it exists; it is ShardedMuon checked for this layout, and ShardedMuon also serves FSDP x TP's 2-D
layouts, nanochat/tensor_parallel.py): FSDP2 hands the optimizer dim-0 shards of each matrix. Orthogonalising a shard is not
orthogonalising the matrix (it is wrong, and running Newton-Schulz on DTensors is also very slow: DTensor matmuls
gather behind your back). FSDPMuon keeps the momentum on the shards (elementwise, exact), then per shape group
assigns matrix m to rank m % world: one all-to-all sends every rank's shard of each matrix to its owner (each rank
sends and receives 1/world of the group), the owner orthogonalises whole matrices (batched), and a second all-to-all
returns each rank its rows of the updates. Each full matrix is orthogonalised exactly once per step; the all-to-alls
carry the Newton-Schulz dtype (bf16 on CUDA, which Newton-Schulz would cast to anyway), and each shape group's
communication overlaps the previous group's compute. docs/distributed.md compares its communication per step with
FSDP+AdamW.
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # FSDP2 (public here since torch 2.6)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private; the one helper that knows FSDP x TP (_StridedShard) layouts

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
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=_reshards_after_forward(i, len(blocks)))
    # the root group holds wte and lm_head
    fully_shard(model, mesh=mesh, mp_policy=mp)
    keep_unsharded_params_out_of_inference_mode(model)
    return model


def keep_unsharded_params_out_of_inference_mode(model):
    """
    FSDP2 creates a group's unsharded parameters at its first all-gather and reuses those tensors for the model's life
    (later all-gathers only refill their storage). If that first all-gather ran inside torch.inference_mode (sampling
    with GPT.generate or the Engine before any training forward: a run resumed on a --sample_every step, chat_sft's
    evals at step 0), they would be inference tensors for good and the next training forward fails ("Inference
    tensors cannot be saved for backward" / "Inplace update to inference tensor outside InferenceMode"). So when the
    model's first forward comes under inference_mode, this hook on the root first gathers (and frees) every group
    outside it: one extra all-gather, once. A first forward with autograd on creates them as usual. (full_weights
    gathers outside inference mode itself.)
    """

    def before_first_forward(module, args):
        handle.remove()
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():  # this order: inference_mode(False) turns grad on
                for m in [*module.transformer.h, module]:
                    m.unshard()
                    m.reshard()

    handle = model.register_forward_pre_hook(torch._dynamo.disable(before_first_forward), prepend=True)  # before FSDP's


def _reshards_after_forward(block_index, num_blocks):
    """apply_fsdp's rule: free a block's gathered weights after its forward, except the last block's, which backward
    would all-gather again right away. (FSDP2 never reshards the root, wte and lm_head, after forward.)"""
    return block_index < num_blocks - 1


@contextlib.contextmanager
def full_weights(model):
    """
    Inside: every rank holds the whole model in the compute dtype (FSDP2's unsharded parameters) and a forward makes
    no collective, so ranks may run different numbers of forwards (sampling with the KV-cache Engine: each rank's rows
    stop at different lengths). Entry all-gathers every group once (collective: all ranks, same point); exit frees the
    gathered copies and restores apply_fsdp's reshard-after-forward rule. For forwards without backward only.
    """
    blocks = list(model.transformer.h)
    if not isinstance(model, FSDPModule) or not all(isinstance(b, FSDPModule) for b in blocks):
        raise TypeError("full_weights needs a model sharded by apply_fsdp (every Block and the root fully_shard-ed)")
    groups = [*blocks, model]
    for m in groups:
        m.set_reshard_after_forward(False, recurse=False)  # or each forward would free what we gathered
    try:
        # outside inference mode even when entered inside it: a first all-gather there would leave FSDP2's unsharded
        # parameters as inference tensors for good (keep_unsharded_params_out_of_inference_mode)
        with torch.inference_mode(False), torch.no_grad():
            for m in groups:
                m.unshard()
        yield model
    finally:
        for m in groups:
            m.reshard()
        for i, b in enumerate(blocks):
            b.set_reshard_after_forward(_reshards_after_forward(i, len(blocks)), recurse=False)
        model.set_reshard_after_forward(False, recurse=False)  # FSDP2's own choice for the root


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


def local_box(p):
    """(rows, cols, row0, col0): the rectangle of the full matrix that this rank's DTensor shard of `p` holds."""
    if not isinstance(p, DTensor):
        return (*p.shape, 0, 0)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if tuple(shape) != tuple(p.to_local().shape):
        raise RuntimeError(f"local shard of a {tuple(p.shape)} parameter is {tuple(p.to_local().shape)}, expected {tuple(shape)} from its placements {p.placements}")
    return (shape[0], shape[1], offset[0], offset[1])


class ShardedMuon(torch.optim.Optimizer):
    """
    Muon for DTensor matrices sharded over any mesh that spans all ranks, 1-D (FSDP) or 2-D (FSDP x TP): each rank
    holds a rectangle of each matrix (see "FSDPMuon" in the module docstring: rectangles in place of row ranges).
    State: one momentum buffer per parameter, the size of this rank's shard (so the state is sharded exactly like the
    parameters). Groups are split by shape; the hyperparameters per group are Muon's (lr, momentum, nesterov,
    ns_steps). state_dict() is per rank, tagged with `kind` and checked on load.
    """

    kind = "ShardedMuon"

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5):
        _check_muon_hparams(lr, momentum, ns_steps)
        self.rank, self.world_size = _require_dist()
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(group_params_by_shape(params), defaults)
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
                if p.grad is None:
                    raise RuntimeError(f"{self.kind}: a parameter of shape {tuple(p.shape)} has no gradient on rank {rank}; every rank must backprop through every matrix")
                g = p.grad.to_local()
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                d = muon_momentum_(g, state["momentum_buffer"], group["momentum"], group["nesterov"])
                k, j = divmod(m, W)
                send[j, k, : d.numel()] = d.reshape(-1)
            recv = torch.empty_like(send)
            work = dist.all_to_all_single(recv, send, async_op=True)
            pending.append((gi, group, K, recv, work, send))  # send kept alive until the all-to-all is done

        # 2) Per group: assemble my matrices from every rank's rectangles, orthogonalise them in one batch, send each
        #    rank its rectangles of the updates.
        returns = []
        for gi, group, K, recv, work, _ in pending:
            work.wait()
            rows, cols = group["params"][0].shape
            mine = list(range(rank, len(group["params"]), W))  # my matrices: m = k*W + rank
            send = torch.zeros_like(recv)
            if mine:
                full = torch.empty((len(mine), rows, cols), dtype=recv.dtype, device=recv.device)
                for k, m in enumerate(mine):
                    for i, (r, c, r0, c0) in enumerate(boxes[gi][m]):
                        full[k, r0 : r0 + r, c0 : c0 + c] = recv[i, k, : r * c].view(r, c)
                upd = muon_orthogonalize(full, group["ns_steps"]).to(recv.dtype)
                for k, m in enumerate(mine):
                    for i, (r, c, r0, c0) in enumerate(boxes[gi][m]):
                        send[i, k, : r * c] = upd[k, r0 : r0 + r, c0 : c0 + c].reshape(-1)
            back = torch.empty_like(send)
            returns.append((group, back, dist.all_to_all_single(back, send, async_op=True), send))

        # 3) Apply my rectangles: back[j, k] holds my part of matrix k*W + j.
        for group, back, work, _ in returns:
            work.wait()
            for m, p in enumerate(group["params"]):
                k, j = divmod(m, W)
                local = p.to_local()
                local.add_(back[j, k, : local.numel()].view_as(local).to(local.dtype), alpha=-group["lr"])
        return loss

    def state_dict(self):
        sd = super().state_dict()
        sd["dist"] = {"world_size": self.world_size, "rank": self.rank, "kind": self.kind}
        return sd

    def load_state_dict(self, state_dict):
        super().load_state_dict(_check_dist_state(state_dict, self.kind, self.rank, self.world_size))


class FSDPMuon(ShardedMuon):
    """ShardedMuon for apply_fsdp's layout (dim-0 shards on a 1-D mesh of all ranks; checked), with its own
    state-dict kind so FSDP checkpoints keep loading only into the FSDP path."""

    kind = "FSDPMuon"

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        for group in self.param_groups:
            for p in group["params"]:
                _dim0_rows(p)  # raises unless Shard(0) on a 1-D mesh


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
