"""
FP8 training of the transformer blocks (`--fp8=1`, `--fp8_recipe=tensorwise|rowwise`, `--fp8_impl=torchao|native`).

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

Which layers (`--fp8_filter`, fp8_plan): FP8 only pays on GEMMs large enough for the faster tensor cores to outweigh
the casts and scale computations (torchao's H100 tables: small GEMMs run at 0.8x of bf16, large ones at ~1.4x). The
default `auto` converts the block Linears past torchao's break-even for the recipe (fp8_gains) and keeps the rest in
bf16; `all` converts every one; a comma list of name parts picks by hand. The log lists each layer kind, its
decision and why. torch._scaled_mm also needs both dims of a weight divisible by 16: Linears that are not stay bf16.

Two implementations (`--fp8_impl`), the same layers (fp8_plan) and the same tensorwise numerics:
- torchao (the default): torchao's Float8Linear, a tensor subclass whose casts torch.compile sees and fuses with the
  neighbouring ops; both recipes; FP8 all-gather under FSDP2. torchao is the optional extra `fp8`
  (pip install -e '.[fp8]').
- native: this file's Float8Linear (nanochat 92d63d4 dropped torchao for its own, about 3% faster in its log): one
  autograd.Function around torch._scaled_mm that casts its operands itself (one scale per tensor: e4m3 for inputs
  and weights, e5m2 for output gradients), opaque to torch.compile. Tensorwise only; under FSDP2 the weights are
  gathered in the compute dtype and cast after. No dependency beyond torch.
Which one is faster is measured by `bash bench/gpu_suite.sh fp8impl` (docs/gpu.md); torchao stays the default until a
GPU has measured it.

Limits: needs CUDA and compute capability >= 8.9 (H100, L4, RTX 4090...); `check_fp8_supported` refuses anything else
with the fix (--fp8=0). Use it with torch.compile, eager FP8 is slower than bf16 (the casts are separate kernels).
"""

import dataclasses
import sys

import torch
import torch.nn as nn

from nanochat.usage import BadValue, CannotRun

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_IMPLS = ("torchao", "native")
MIN_CAPABILITY = (8, 9)


def check_fp8_options(recipe="tensorwise", impl="torchao"):
    """Refuse an unknown recipe or implementation, and the pair that does not exist (native rowwise)."""
    if recipe not in FP8_RECIPES:
        raise BadValue(f"--fp8_recipe must be one of {'|'.join(FP8_RECIPES)}, got {recipe!r}")
    if impl not in FP8_IMPLS:
        raise BadValue(f"--fp8_impl must be one of {'|'.join(FP8_IMPLS)}, got {impl!r}")
    if impl == "native" and recipe != "tensorwise":
        raise BadValue(f"--fp8_impl=native scales tensorwise only, not {recipe}: use --fp8_recipe=tensorwise, or "
                       f"--fp8_impl=torchao for {recipe}")


def check_fp8_supported(device, recipe="tensorwise", impl="torchao"):
    """Raise RuntimeError naming the device and the fix when FP8 training cannot run on `device`."""
    check_fp8_options(recipe, impl)
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
    FP8 numerics run on any device (tests/unit/test_fp8.py trains with it on CPU). No speedup; not a training option.
    """
    if recipe not in FP8_RECIPES:
        raise BadValue(f"--fp8_recipe must be one of {'|'.join(FP8_RECIPES)}, got {recipe!r}")
    float8 = _import_torchao()
    if recipe == "tensorwise":
        return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp, emulate=emulate)
    return dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)


FP8_IMPL_HELP = ("whose FP8 Linear: torchao's (both recipes, FP8 all-gather under FSDP2) or native, nanochat's own "
                 "tensorwise one (92d63d4's choice; no torchao needed); bench/gpu_suite.sh fp8impl measures both")
FP8_FILTER_HELP = ("which block Linears run in FP8: auto = those whose GEMM shape gains by torchao's H100 tables "
                   "(the rule in nanochat/fp8.py), all = every one, or a comma list of name parts (e.g. mlp.c_fc,mlp.c_proj)")


def fp8_gains(in_features, out_features, recipe):
    """
    (convert?, why) for a Linear of weight (N, K) = (out_features, in_features) under torchao's rule of thumb:
    FP8 pays where the GEMM is large enough for the 2x tensor-core rate to outweigh the casts and scales. torchao's
    H100 benchmark tables (torchao/float8 README, "performance") put the break-even for tensorwise at K > 4096 or
    N > 1024, and for rowwise (slower scales) at N > 2048 and K > 1024, and not both N <= 4096 and K <= 2048.
    The thresholds are theirs; whether a given model gains is measured by bench/gpu_suite.sh fp8filter.
    """
    N, K = out_features, in_features
    if recipe == "tensorwise":
        if K <= 4096 and N <= 1024:
            return False, f"K={K} <= 4096 and N={N} <= 1024: too small to gain (tensorwise)"
        return True, f"K={K}, N={N}: past tensorwise's break-even (K > 4096 or N > 1024)"
    if N <= 2048 or K <= 1024 or (N <= 4096 and K <= 2048):
        return False, f"K={K}, N={N}: below rowwise's break-even (N > 2048, K > 1024, not both N <= 4096 and K <= 2048)"
    return True, f"K={K}, N={N}: past rowwise's break-even"


def fp8_plan(model, recipe="tensorwise", filter="auto"):
    """
    For every block Linear of `model`: (name, convert?, why). Never lm_head or wte. A dim not divisible by 16
    (torch._scaled_mm's requirement) is never converted; `filter` (--fp8_filter) decides the rest: 'auto' =
    fp8_gains, 'all' = every one, else a comma list of name parts (a Linear whose name contains one is converted).
    """
    if recipe not in FP8_RECIPES:
        raise BadValue(f"--fp8_recipe must be one of {'|'.join(FP8_RECIPES)}, got {recipe!r}")
    parts = None
    if filter not in ("auto", "all"):
        parts = [p.strip() for p in str(filter).split(",") if p.strip()]
        if not parts:
            raise BadValue(f"--fp8_filter must be auto, all or a comma list of layer name parts, got {filter!r}")
    plan = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not name.startswith("transformer.h."):
            continue
        if m.in_features % 16 or m.out_features % 16:
            plan.append((name, False, f"{m.in_features}->{m.out_features}: a dim not divisible by 16 (torch._scaled_mm)"))
        elif filter == "auto":
            plan.append((name, *fp8_gains(m.in_features, m.out_features, recipe)))
        elif filter == "all":
            plan.append((name, True, "--fp8_filter=all"))
        else:
            hit = next((p for p in parts if p in name), None)
            plan.append((name, hit is not None, f"--fp8_filter names {hit!r}" if hit else "not named by --fp8_filter"))
    if parts is not None and not any(convert for _, convert, _ in plan):
        raise BadValue(f"--fp8_filter={filter} matches no block Linear (names look like transformer.h.0.mlp.c_fc)")
    return plan


def convert_to_fp8(model, recipe="tensorwise", fsdp=False, emulate=False, filter="auto", impl="torchao"):
    """
    Swap the block Linears of `model` that fp8_plan picks (a GPT, before FSDP wrapping and compile; any device, meta
    included) for torchao's Float8Linear, or this file's (impl="native"), in place. Runs nothing. Returns
    (converted names, names left in bf16, plan). emulate: see fp8_config (tests only; torchao's).
    """
    check_fp8_options(recipe, impl)
    plan = fp8_plan(model, recipe, filter)
    chosen = {name for name, convert, _ in plan if convert}
    if impl == "native":
        for name in chosen:
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, attr, Float8Linear.from_float(getattr(owner, attr)))
    else:
        float8 = _import_torchao()
        config = fp8_config(recipe, fsdp, emulate)
        float8.convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in chosen, config=config)
    converted = [name for name, convert, _ in plan if convert]
    skipped = [name for name, convert, _ in plan if not convert]
    return converted, skipped, plan


def describe_plan(plan):
    """The plan in a few lines: one per layer kind (attn.c_q, mlp.c_fc, ...) and decision, with the count and why."""
    groups = {}
    for name, convert, why in plan:
        kind = name.split(".", 3)[-1]  # transformer.h.<i>.<kind>
        groups.setdefault((kind, convert, why), []).append(name)
    return [f"  {kind}: {'FP8' if convert else 'bf16'} x{len(names)} ({why})" for (kind, convert, why), names in groups.items()]


def apply_fp8(model, recipe, device, fsdp=False, log=print, filter="auto", impl="torchao"):
    """The scripts' call for --fp8=1: refuse unsupported hardware, convert, and say which layers and why."""
    check_fp8_supported(device, recipe, impl)
    converted, skipped, plan = convert_to_fp8(model, recipe, fsdp, filter=filter, impl=impl)
    gather = " (FP8 all-gather under FSDP2)" if fsdp and recipe == "tensorwise" and impl == "torchao" else ""
    log(f"FP8 ({recipe}{gather}, --fp8_impl={impl}, --fp8_filter={filter}): {len(converted)} of {len(plan)} block "
        "Linear layers converted; lm_head and wte stay bf16")
    for line in describe_plan(plan):
        log(line)
    if not converted:
        log("FP8: no layer gains by the filter's rule, so this run is bf16; --fp8_filter=all converts them anyway")
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


# -----------------------------------------------------------------------------
# nanochat's own tensorwise FP8 Linear (--fp8_impl=native)
#
# A Linear does three matmuls: out = x W^T forward, grad_x = grad_out W and grad_W = grad_out^T x backward. Each runs
# as torch._scaled_mm on FP8 operands: every operand is scaled so that its largest magnitude lands on the FP8 format's
# largest finite value (one scale per tensor, from the current values: "dynamic tensorwise"), cast with saturation,
# and the matmul multiplies the result back by the two inverse scales. Inputs and weights use e4m3 (more mantissa),
# output gradients e5m2 (more range). The FP8 copies of x and W are what the backward keeps (half of bf16's memory).


@torch.no_grad()
def to_fp8(x, fp8_dtype):
    """(x in `fp8_dtype`, the inverse scale) with one dynamic scale for the whole tensor: the largest |x| maps to the
    format's largest finite value, out-of-range values saturate. The scale is divided out in float64 and rounded to
    float32 once (torchao does the same: compiled and eager code then agree)."""
    fp8_max = torch.finfo(fp8_dtype).max
    amax = x.float().abs().max()
    scale = (fp8_max / amax.double().clamp(min=1e-12)).float()
    x_fp8 = (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)  # a plain cast would overflow, not saturate
    return x_fp8, scale.reciprocal()


def _scaled_matmul(a, b, a_inv, b_inv, out_dtype, fast_accum):
    """a @ b on FP8 operands with their inverse scales. cuBLAS wants a row-major and b column-major."""
    if not b.t().is_contiguous():
        b = b.t().contiguous().t()
    return torch._scaled_mm(a.contiguous(), b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)


class _Float8Matmul(torch.autograd.Function):
    """out = x @ W^T with the three matmuls in FP8 (see above). x is 2-D, in the compute dtype (the output's).
    torch.compile sees it as one opaque node (the casts are not traced and re-fused): Float8Linear.from_float tells
    dynamo so, not this module's import, since importing torch._dynamo costs seconds that a process which never builds
    an optimizer or compiles (a usage error, chat_web) need not pay."""

    @staticmethod
    def forward(ctx, x, weight):
        x_fp8, x_inv = to_fp8(x, torch.float8_e4m3fn)
        w_fp8, w_inv = to_fp8(weight, torch.float8_e4m3fn)
        ctx.save_for_backward(x_fp8, x_inv, w_fp8, w_inv)
        # the forward accumulates in cuBLAS's faster, less precise mode (the usual choice); the backward does not
        return _scaled_matmul(x_fp8, w_fp8.t(), x_inv, w_inv, x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, grad_out):
        x_fp8, x_inv, w_fp8, w_inv = ctx.saved_tensors
        g_fp8, g_inv = to_fp8(grad_out, torch.float8_e5m2)
        grad_x = _scaled_matmul(g_fp8, w_fp8, g_inv, w_inv, grad_out.dtype, fast_accum=False)
        grad_w = _scaled_matmul(g_fp8.t(), x_fp8, g_inv, x_inv, grad_out.dtype, fast_accum=False)
        return grad_x, grad_w


class Float8Linear(nn.Linear):
    """
    nn.Linear whose matmuls run in FP8 (tensorwise, _Float8Matmul). The weight (and bias) stay the Linear's own
    parameters, same names, shapes and dtypes: checkpoints are the plain model's. The compute dtype is autocast's when
    autocast is on for the input's device, else the input's (as the rest of the model computes, nanochat/gpt.py).
    """

    def forward(self, x):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        out = _Float8Matmul.apply(x.to(dtype).reshape(-1, x.size(-1)), self.weight)
        out = out.reshape(*x.shape[:-1], out.size(-1))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    @classmethod
    def from_float(cls, linear):
        """The same parameters (shared, not copied) in a Float8Linear; works on the meta device."""
        torch._dynamo.allow_in_graph(_Float8Matmul)  # before any compile traces a forward (idempotent)
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight, new.bias = linear.weight, linear.bias
        return new
