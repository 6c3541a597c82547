"""
FP8 training of the transformer blocks with torchao's float8 training (`--fp8=1`, `--fp8_recipe=tensorwise|rowwise`).

What: the Linear layers inside the blocks (attention c_q/c_k/c_v/c_proj, MLP c_fc/c_proj) become torchao Float8Linear:
their matmuls (forward and both backward matmuls) run on FP8 tensor cores with dynamic scales computed on the fly;
the weights stay fp32 masters (state dict names and checkpoint files are unchanged, so an FP8 run's checkpoints load
anywhere, FP8 or not). lm_head and the embedding stay in bf16: the logits are the most precision-sensitive matmul and
the embedding is a lookup, not a matmul.

Why: FP8 tensor cores (Hopper and Ada) do about twice the FLOPs of bf16, so the block matmuls, which are nearly all of a
model's compute, run up to ~2x faster (less in practice: casts and scale computation, which torch.compile fuses).

Recipes: 'tensorwise' = one scale per tensor (fastest; under FSDP2 the weights are all-gathered in FP8, halving that
traffic); 'rowwise' = one scale per row (more accurate with outliers, a bit slower; FSDP2 gathers bf16 then casts,
torchao supports FP8 all-gather for tensorwise only). With the FP8 all-gather, each weight's scale needs the amax of
the whole weight, i.e. one all-reduce per weight per all-gather (forward and backward); `precompute_fp8_scales` after
the optimizer step computes all of them in one all-reduce instead (training.train_step calls it through the FSDP
strategy, as torchtitan does).

Limits: needs CUDA and compute capability >= 8.9 (H100, L4, RTX 4090...); `check_fp8_supported` refuses anything else
with the fix (--fp8=0). torch._scaled_mm needs both dims of a weight divisible by 16: Linears that are not are left
in bf16 and listed (at nanochat's depth rule, width 64*depth, all block Linears qualify). Use it with torch.compile,
eager FP8 is slower than bf16 (the casts are separate kernels). torchao is the optional extra `fp8`
(pip install -e '.[fp8]').
"""

import dataclasses
import sys

import torch
import torch.nn as nn

from nanochat.usage import BadValue, CannotRun

FP8_RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)


def check_fp8_supported(device, recipe="tensorwise"):
    """Raise RuntimeError naming the device and the fix when FP8 training cannot run on `device`."""
    if recipe not in FP8_RECIPES:
        raise BadValue(f"--fp8_recipe must be one of {'|'.join(FP8_RECIPES)}, got {recipe!r}")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise CannotRun(f"--fp8=1 needs an NVIDIA GPU of compute capability >= 8.9 (Hopper/Ada), but this run is on "
                           f"{device.type}: use --fp8=0")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise CannotRun(f"--fp8=1 needs compute capability >= 8.9 (Hopper/Ada FP8 tensor cores), but {name} has "
                           f"{cap[0]}.{cap[1]}: use --fp8=0")


def _import_torchao():
    try:
        from torchao import float8
    except ImportError as e:
        raise CannotRun(f"--fp8=1 needs torchao ({e}): pip install -e '.[fp8]' (or pip install torchao), or use --fp8=0") from None
    return float8


def fp8_config(recipe, fsdp=False, emulate=False):
    """
    torchao's Float8LinearConfig for `recipe`; FP8 all-gather under FSDP2 where torchao supports it (tensorwise).
    emulate=True: the same casts and scales, with the matmul done in high precision instead of torch._scaled_mm, so
    FP8 numerics run on any device (tests/test_fp8.py trains with it on CPU). No speedup; not a training option.
    """
    if recipe not in FP8_RECIPES:
        raise BadValue(f"--fp8_recipe must be one of {'|'.join(FP8_RECIPES)}, got {recipe!r}")
    float8 = _import_torchao()
    if recipe == "tensorwise":
        return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp, emulate=emulate)
    return dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)


def fp8_eligible(module, fqn):
    """Block Linears whose both dims are multiples of 16 (torch._scaled_mm's requirement); never lm_head/wte."""
    if not isinstance(module, nn.Linear) or not fqn.startswith("transformer.h."):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_fp8(model, recipe="tensorwise", fsdp=False, emulate=False):
    """
    Swap the eligible block Linears of `model` (a GPT, before FSDP wrapping and compile; any device, meta included)
    for Float8Linear in place. Runs nothing. Returns (converted names, skipped block Linear names).
    emulate: see fp8_config (tests only).
    """
    float8 = _import_torchao()
    config = fp8_config(recipe, fsdp, emulate)
    block_linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("transformer.h.")]
    skipped = [n for n in block_linears if not fp8_eligible(model.get_submodule(n), n)]
    float8.convert_to_float8_training(model, module_filter_fn=fp8_eligible, config=config)
    converted = [n for n in block_linears if n not in skipped]
    return converted, skipped


def apply_fp8(model, recipe, device, fsdp=False, log=print):
    """The scripts' call for --fp8=1: refuse unsupported hardware, convert, and say what was converted."""
    check_fp8_supported(device, recipe)
    converted, skipped = convert_to_fp8(model, recipe, fsdp)
    gather = " (FP8 all-gather under FSDP2)" if fsdp and recipe == "tensorwise" else ""
    log(f"FP8 ({recipe}{gather}): {len(converted)} block Linear layers converted; lm_head and wte stay bf16")
    if skipped:
        log(f"FP8: left in bf16 (a dim not divisible by 16): {', '.join(skipped)}")
    return model


def uses_fp8_all_gather(model):
    """True when `model` has Float8Linear layers whose weights FSDP2 all-gathers in FP8 (tensorwise, fsdp=True)."""
    if "torchao.float8" not in sys.modules:  # torchao never imported: no Float8Linear can exist (and none is imported)
        return False
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules())


def precompute_fp8_scales(model):
    """
    After the optimizer step, under FSDP2 with the FP8 all-gather: compute the FP8 scale of every weight (max of |W|
    over the whole, sharded, weight) in one all-reduce, for the next forward's and backward's all-gathers to use.
    Without it each weight's pre-all-gather hook all-reduces its own amax: two small blocking collectives per weight per
    micro-step. A scale holds until the weights change, so call this after every optimizer step (train_step does).
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
