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
    optimizers = setup_fsdp_optimizers(model, ...)   # nanochat/optim/sharded.py: [FSDPAdamW, FSDPMuon], which
        # take the DTensor shards (Muon must see whole matrices: FSDPMuon sends each to one owner rank and back)
    loss = model(x, y); loss.backward()          # gradients arrive reduce-scattered and averaged over ranks
    for opt in optimizers: opt.step()
    model.zero_grad(set_to_none=True)

    sd = full_model_state_dict(model)            # rank 0: {name: full fp32 CPU tensor}, nanochat's single-file
                                                 # format (what model.state_dict() gives in one process); others: {}
    load_full_model_state_dict(model, sd)        # a full state dict (DDP/single-process checkpoint, or the above) into
                                                 # the sharded model; every rank passes the full dict (each loads the file)
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
"""

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # FSDP2 (public here since torch 2.6)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private; the one helper that knows FSDP x TP (_StridedShard) layouts


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
