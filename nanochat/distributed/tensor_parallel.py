"""
Tensor parallelism (`--tp_size=N`) composed with FSDP2 on the data dimension: the usual 2-D recipe, for models whose
blocks are too wide for one GPU's memory or whose per-GPU batch would get too small under FSDP alone.

API (every function is collective: call it on every rank, in the same order):

    model = GPT(config); model.to_empty(device=...); model.init_weights()   # identical on every rank (same seed)
    apply_tp(model, tp_size, param_dtype=None, reduce_dtype=torch.float32)
        # in place: a 2-D mesh ("dp", "tp") of shape (world/tp_size, tp_size) -- global rank r sits at
        # (r // tp_size, r % tp_size), so the tp ranks of a group are neighbours (one node's NVLink on GPUs).
        # Per block, over "tp": attention c_q/c_k/c_v and MLP c_fc column-wise (Shard(0): each rank gets
        # n_head/tp query heads, n_kv_head/tp key/value heads, 4*n_embd/tp hidden units), both c_proj row-wise
        # (Shard(1)), so attention runs on this rank's heads only. Then FSDP2 over "dp" (always, also when dp=1:
        # one code path, every parameter a DTensor). wte and lm_head are replicated over tp and FSDP-sharded over dp.
        # The record model (RecordGPT): its value embeddings column-wise and its value gates' outputs split by kv
        # head as c_v is (each rank mixes its own heads' values); the smear gate and the per-layer scalars are
        # replicated over tp like wte.
    optimizers = setup_tp_optimizers(model, unembedding_lr, embedding_lr, matrix_lr, weight_decay, use_muon)
        # [FSDPAdamW, ShardedMuon] (or [FSDPAdamW]; nanochat/optim/sharded.py): GPT.setup_optimizers' groups and
        # learning rates, DTensor-aware
    loss = model(x, y); loss.backward()    # x, y: the same batch on every tp rank of a data group (data rank r // tp)
    full_model_state_dict / load_full_model_state_dict (nanochat/distributed/fsdp.py): the single-file format, any layout

Collective rules (why each exists):
  * every tp rank of a data group must get the same tokens: a row-wise layer sums the partial products of the tp
    ranks, so different inputs give silently wrong activations (not an error). Loaders and evaluations therefore
    split work by DATA rank (the parallel plan's `data_rank`/`data_ranks`, passed to them), never by global rank.
  * every forward is a collective (two all-reduces per block), as under FSDP: sample on every rank, and an eval that
    splits problems over data ranks must give each rank the same number of forwards.
  * n_head, n_kv_head and 4*n_embd must be divisible by tp_size (heads are not split): the plan's check_layout
    (nanochat/distributed/parallel.py) says so with the valid sizes, before anything is built. Parameter names and
    shapes are unchanged, so a checkpoint's model is the same full model on every layout.

Why wte and lm_head are not tensor-parallel: sharding the vocabulary would need a vocab-parallel cross-entropy and
softcap (the logits would be sharded); at nanochat's sizes they are a small part of the model and FSDP over dp
already shards their memory. Their gradients are identical on the tp ranks (they see the replicated residual
stream), so no tp communication is needed for them.

Communication per block (B*T*d elements of the compute dtype each, d = n_embd): forward 2 all-reduces over tp (the
two row-wise outputs); backward 2 (the input gradients of attention -- one for q, k and v together, prepared as one
replicated DTensor -- and of the MLP). Activation checkpointing re-runs a block's forward in the backward, so its two
forward all-reduces happen again. docs/distributed.md has the totals and the measured numbers.

ShardedMuon (nanochat/optim/sharded.py; FSDPMuon is the same class checked for FSDP's 1-D layout): Muon for DTensor matrices
sharded over any mesh that spans all ranks (2-D here: FSDP's dim-0 shard of TP's dim-0 or dim-1 shard). Each rank
holds a rectangle of each matrix (compute_local_shape_and_global_offset). The momentum runs on the rectangles
(elementwise, exact); matrix m of a shape group is owned by rank m % world: one all-to-all sends every rank's
rectangle of each matrix to its owner, the owner orthogonalises whole matrices (batched), a second all-to-all returns
each rank its rectangle of the updates. So each full matrix is orthogonalised exactly once, and the update equals the
unsharded one (same full matrix, same Newton-Schulz).

Not TP-aware (they run in one process or on the DDP path, loading the full model file): the inference Engine,
chat_cli, chat_web, scripts.chat_eval, chat_rl (its plan needs full weights, which --tp_size refuses; it takes --use_fsdp=1).
--fp8=1 with tp_size > 1 is refused (torchao's float8 linears need their own TP styles).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from nanochat.distributed.fsdp import keep_unsharded_params_out_of_inference_mode
from nanochat.optim.sharded import ShardedMuon, setup_fsdp_optimizers


def _require_dist():
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("--tp_size needs torch.distributed initialised: launch with torchrun (--nproc_per_node=tp_size or more)")
    return dist.get_rank(), dist.get_world_size()


def tp_mesh(device_type, tp_size):
    """The 2-D ("dp", "tp") mesh over all ranks; tp is the inner (fastest-varying) dimension."""
    _, world = _require_dist()
    return init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


def block_plan(block=None):
    """The parallelize_module plan of one Block (module paths relative to the block). A record-model block
    (nanochat/gpt.py RecordBlock) hands its attention six inputs (x, ve, cos_sin, window, kv_cache, backend; ve is
    already this rank's kv heads: apply_tp splits the value embeddings too) and may have a value-embedding gate, whose
    outputs (one per kv head) are split like c_v's."""
    record = block is not None and hasattr(block.attn, "ve_gate")
    others = (None,) * (5 if record else 3)  # the inputs after x: not tensors to lay out
    plan = {
        # attention's input becomes one replicated DTensor shared by c_q, c_k and c_v: their three partial input
        # gradients add up as DTensors and are all-reduced once (not three times) in the backward
        "attn": PrepareModuleInput(input_layouts=(Replicate(), *others), desired_input_layouts=(Replicate(), *others)),
        # column-wise: output feature dim sharded, returned as a local tensor (this rank's heads / hidden units)
        "attn.c_q": ColwiseParallel(),
        "attn.c_k": ColwiseParallel(),
        "attn.c_v": ColwiseParallel(),
        # row-wise: takes the local shard of its input features, all-reduces the output (the block's forward comms)
        "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(),
    }
    if record and block.attn.ve_gate is not None:
        plan["attn.ve_gate"] = ColwiseParallel()  # the gate of this rank's kv heads
    return plan


def apply_tp(model, tp_size, param_dtype=None, reduce_dtype=torch.float32, mesh=None):
    """Tensor-parallel blocks over "tp", then FSDP2 over "dp" (see the module docstring); mesh: the run's
    ("dp", "tp") mesh (the parallel plan's, built in its bind), default tp_mesh() for tools that use this module
    alone. Returns the model."""
    _require_dist()  # the sizes were checked by the plan (nanochat/distributed/parallel.py check_layout)
    device = model.get_device()
    if device.type == "meta":
        raise ValueError("apply_tp: the model is on the meta device; call model.to_empty(device=...) and model.init_weights() first")
    mesh = mesh if mesh is not None else tp_mesh(device.type, tp_size)
    for block in model.transformer.h:
        parallelize_module(block, mesh["tp"], block_plan(block))
    value_embeds = getattr(model, "value_embeds", None)  # the record model's: column-wise, this rank's kv heads
    if value_embeds is not None and len(value_embeds):
        parallelize_module(model, mesh["tp"], {f"value_embeds.{k}": ColwiseParallel() for k in value_embeds})
    if param_dtype is None:
        param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.transformer.h)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    keep_unsharded_params_out_of_inference_mode(model)  # a first forward may be a sample (see there)
    model.tp_mesh = mesh  # for the optimizers and tools; not a module attribute that state_dict sees
    return model


# -----------------------------------------------------------------------------
# optimizers


def setup_tp_optimizers(model, **kwargs):
    """FSDPAdamW for wte/lm_head (and the matrices when use_muon is false), ShardedMuon for the block matrices; the
    groups, learning rates and options of the model's setup_optimizers(**kwargs) (via setup_fsdp_optimizers)."""
    return setup_fsdp_optimizers(model, muon_cls=ShardedMuon, **kwargs)


# -----------------------------------------------------------------------------
# gradient norm


@torch.no_grad()
def grad_norm_sq(grads):
    """
    The squared global norm of gradients that may be DTensors on different meshes (2-D block matrices, 1-D
    dp-sharded embeddings) or plain tensors (identical on every rank), as in the unsharded model. Summed over all
    ranks, a tensor's local squared norms count its true squared norm once per replica: world / (product of the sizes
    of the mesh dims that shard it) times (a replicated mesh dim, or another mesh's ranks, hold copies). So: one local
    sum per (mesh, sharded dims) group, one all-reduce of those sums over the world, each divided by its replica
    count. Returns a plain 0-dim fp32 tensor, equal on all ranks.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    groups = {}
    for g in grads:
        if isinstance(g, DTensor):
            sharded = [g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_shard()]
            replicas = world // max(1, _prod(sharded))
            groups.setdefault(replicas, []).append(g.to_local())
        else:
            groups.setdefault(world, []).append(g)
    if not groups:
        return torch.zeros(())
    device = next(iter(groups.values()))[0].device
    replicas = sorted(groups)
    sums = torch.stack([torch.stack([n.float() for n in torch._foreach_norm(groups[k])]).square().sum().to(device) for k in replicas])
    if world > 1:
        dist.all_reduce(sums)
    return (sums / torch.tensor(replicas, dtype=sums.dtype, device=device)).sum()


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


@torch.no_grad()
def clip_grad_norm_(params, max_norm):
    """torch.nn.utils.clip_grad_norm_ for gradients on several meshes (torch's cannot mix meshes). Returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = grad_norm_sq(grads).sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    for device in {t.device for t in locals_}:
        torch._foreach_mul_([t for t in locals_ if t.device == device], coef.to(device))
    return norm
