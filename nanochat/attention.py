"""
Attention kernels (`--attn`), chosen per device and never silently.

    choice = resolve_attn("auto", torch.device("cuda"))   # -> Attn(name='sdpa', order=('cudnn', 'flash', ...), why=...)
    y = attention(q, k, v, choice)                         # q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) -> (B, Hq, Tq, D)
    y = attention(q, k, v, choice, window=w)               # sliding window: each query sees itself and w keys back

Backends:
- `sdpa`: PyTorch's scaled_dot_product_attention with an explicit kernel order for the device (SDPA_ORDERS below:
  cuDNN first on Hopper, FlashAttention-2 first elsewhere, torch's CPU flash kernel on CPU). SDPA runs the first
  kernel of the order that takes the inputs (e.g. a masked decode step skips flash), so one order serves training,
  prefill and decode. Ships with torch: nothing to download.
- `sdpa_cudnn`, `sdpa_flash`, `sdpa_efficient`, `sdpa_math`: SDPA pinned to that one kernel (for benchmarks and
  checks; `sdpa_math` is the reference the others are tested against). Refused where torch has no such kernel.
- `flex`: torch's FlexAttention with a causal block mask (compiled with the model; eager it runs an unfused
  reference). On CPU, torch has its forward but no backward: evaluation and chat run, training stops with torch's error.
- `fa3`: FlashAttention-3 (Hopper), only when asked: through Hugging Face `kernels` at a pinned version
  (FA3_KERNEL; it downloads from the Hub the first time), else an installed `flash_attn_interface` build.
- `fa4`: FlashAttention-4 (`pip install flash-attn-4`, the optional extra `fa4`; Hopper and Blackwell), only when
  asked, wrapped as torch custom ops so torch.compile traces it as one node.
fa3/fa4 that cannot load are refused with the reason and the fix: there is no fallback. They run attention without
a KV cache (training, evaluation); the engine's cached prefill/decode runs on the device's SDPA order (their
KV-cache APIs are not wired), and the choice says so.

Sliding windows (the record recipe's model) run on every backend: FlashAttention's window_size for fa3/fa4, a
sliding-window block mask for flex, an explicit mask for SDPA (which has no window argument), and in cached decode
only the window's keys.

`auto` is the table AUTO below, keyed by compute capability: `sdpa` with the device's order everywhere. It never
picks fa3/fa4 (downloads, extra packages) and not flex until a measurement (bench/gpu_suite.sh attn) shows it faster.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanochat.usage import BadValue, CannotRun

ATTN_CHOICES = ("auto", "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math", "flex", "fa3", "fa4")

_SDPB = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

# SDPA kernel order for `sdpa` (and so `auto`), by compute capability: (lowest, below, order, where it comes from).
# torch's own order (torch_sdpa_order) is flash > efficient > math > cudnn, except that torch 2.15 puts cuDNN first on
# 9.x and 10.x when the runtime cuDNN is newer than 9.15.0 (its check_prefer_cudnn_attention; CUDA 12 builds only on
# x.0 and x.3): so Hopper's row is torch's own order there, and Blackwell's differs from it. None of these is measured
# by this project yet: `bash bench/gpu_suite.sh speed` records the kernel each row ran and torch's order beside it.
SDPA_ORDERS = (
    ((0, 0), (8, 0), ("efficient", "math"), "pre-Ampere: no flash kernels below sm80 (torch's rule)"),
    ((8, 0), (9, 0), ("flash", "efficient", "cudnn", "math"), "Ampere/Ada: FlashAttention-2 first, as torch's default"),
    ((9, 0), (10, 0), ("cudnn", "flash", "efficient", "math"),
     "Hopper: cuDNN first, as torch 2.15 itself orders it with cuDNN > 9.15; unmeasured here"),
    ((10, 0), (100, 0), ("flash", "cudnn", "efficient", "math"),
     "Blackwell and later: FlashAttention-2 first (torch 2.15 puts cuDNN first on 10.x with cuDNN > 9.15); unmeasured"),
)
CPU_ORDER = ("flash", "math")  # torch's CPU flash kernel; math for what it cannot take
AUTO = "sdpa"  # what auto picks at every capability (see the module doc for why not fa3/fa4/flex)

FA3_KERNEL = ("kernels-community/flash-attn3", 1)  # Hub repo and the pinned version `kernels` downloads


@dataclass(frozen=True)
class Attn:
    """A resolved choice: the backend's name, the SDPA kernel order it uses (also for cached decode), and why."""

    name: str
    order: tuple
    why: str

    def describe(self):
        """One line for banners and reports, e.g. `sdpa (cudnn > flash > efficient > math)`."""
        order = " > ".join(self.order)
        if self.name in ("fa3", "fa4", "flex"):
            return f"{self.name} (cached decode: sdpa {order})"
        return f"{self.name} ({order})"


def sdpa_order(capability):
    """The SDPA kernel order of `sdpa` for a CUDA compute capability (major, minor), or None for CPU/MPS."""
    if capability is None:
        return CPU_ORDER, "CPU: torch's flash kernel, then math"
    for lo, hi, order, why in SDPA_ORDERS:
        if lo <= tuple(capability) < hi:
            return order, why
    raise ValueError(f"no SDPA order for compute capability {capability}")


def choose(attn, capability, load=None):
    """
    The selection rule, a pure function so it is tested for every capability: `attn` (an ATTN_CHOICES value),
    `capability` (CUDA (major, minor), or None off CUDA), `load(name)` -> None when fa3/fa4 loaded, else the reason.
    Returns an Attn; raises a usage error (BadValue, CannotRun) naming what to use instead when the choice cannot run.
    """
    if attn not in ATTN_CHOICES:
        raise BadValue(f"--attn must be one of {'|'.join(ATTN_CHOICES)}, got {attn!r}")
    order, why = sdpa_order(capability)
    where = "CPU/MPS" if capability is None else f"a GPU of compute capability {capability[0]}.{capability[1]}"
    if attn in ("auto", "sdpa"):
        return Attn("sdpa", order, ("auto: " if attn == "auto" else "") + why)
    if attn.startswith("sdpa_"):
        kernel = attn.removeprefix("sdpa_")
        runs = kernel == "math" or (capability is None and kernel == "flash") or (
            capability is not None and (kernel != "flash" or tuple(capability) >= (8, 0))
            and (kernel != "cudnn" or tuple(capability) >= (8, 0)))
        if not runs:
            raise CannotRun(f"--attn={attn}: torch has no {kernel} attention kernel for {where}; use --attn=sdpa")
        return Attn(attn, (kernel,), "asked for")
    if attn == "flex":
        return Attn("flex", order, "asked for; cached decode runs SDPA's order")
    # fa3 / fa4: only when asked, never a fallback
    need = {"fa3": ((9, 0), (10, 0), "Hopper (9.x)"), "fa4": ((9, 0), (11, 0), "Hopper or Blackwell (9.x, 10.x)")}[attn]
    if capability is None or not need[0] <= tuple(capability) < need[1]:
        raise CannotRun(f"--attn={attn} needs a {need[2]} GPU, but the model is on {where}; use --attn=sdpa")
    reason = (load or load_flash)(attn)
    if reason is not None:
        raise CannotRun(f"--attn={attn}: {reason}; or use --attn=sdpa")
    return Attn(attn, order, "asked for; cached decode runs SDPA's order")


def resolve_attn(attn, device):
    """choose() for a real device: reads its compute capability and loads fa3/fa4 when asked. Says once per process
    when masked calls of the choice run other kernels (masked_order)."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    choice = choose(attn, capability)
    note = masked_note(choice, device.type)
    if note and note not in _SAID:
        _SAID.add(note)
        from nanochat.common import print0

        print0(note)
    return choice


_SAID = set()
# SDPA kernels that refuse an explicit attn_mask, by device type: CUDA's flash kernel (torch's CPU flash kernel takes one)
NO_MASK = {"cuda": ("flash",)}
MASK_FALLBACK = ("efficient", "math")  # what a masked call of a pinned kernel that takes no mask runs instead


# cuDNN's SDPA builds one execution graph per shape (cached after): a call whose key length differs from call to call
# (eager decode, where the cache grows by one token a step; a chunk after a cached prefix) would build one per call.
# Measured on an H100 (2026-11-27, d20, bf16): eager decode ran 35 tok/s at batch 1 and 335 at batch 8, the same
# ~28 ms a step whatever the batch, with cuDNN first in torch's own order. Such calls run their order without cuDNN;
# fixed shapes (training, the compiled decode step's static cache with its mask) keep it.
GROWING_FALLBACK = ("flash", "efficient", "math")  # what a growing call of a pinned `sdpa_cudnn` runs instead


def growing_order(order):
    """The SDPA kernel order of a call whose shape changes from call to call: `order` without cuDNN."""
    return tuple(k for k in order if k != "cudnn") or GROWING_FALLBACK


def masked_order(order, device_type):
    """The SDPA kernel order of a call with an explicit mask (the engine's fixed-shape decode step, a chunk after a
    cached prefix): `order` without the kernels that refuse masks on this device type, or MASK_FALLBACK when none is
    left (a pinned `sdpa_flash` on CUDA would otherwise stop with torch's "No available kernel")."""
    kept = tuple(k for k in order if k not in NO_MASK.get(device_type, ()))
    return kept or MASK_FALLBACK


def masked_note(choice, device_type):
    """The line saying that masked calls of a pinned kernel run other kernels on this device type, or None."""
    if not choice.name.startswith("sdpa_") or masked_order(choice.order, device_type) == choice.order:
        return None
    return (f"attn {choice.name}: {device_type.upper()}'s {' and '.join(choice.order)} kernel takes no attention mask, so "
            f"masked calls (the engine's fixed-shape decode step) run {' > '.join(masked_order(choice.order, device_type))}")


def _sdpb_name(value):
    """nanochat's name of an SDPBackend value: 'cudnn', 'flash', 'efficient', 'math', 'overrideable'."""
    return SDPBackend(int(value)).name.lower().removesuffix("_attention")


def torch_sdpa_order(device):
    """torch's own SDPA kernel priority on `device` (no sdpa_kernel context), as it stands after an SDPA call there:
    on CUDA torch picks its default at the first call (check_prefer_cudnn_attention in torch 2.15: cuDNN first on
    compute capability 9.x/10.x when the runtime cuDNN is newer than 9.15.0, unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1),
    so this makes one tiny call first. Call it before any model runs: by torch's sdp_utils.cpp a first call inside
    an sdpa_kernel context would replace that context's order by torch's default."""
    device = torch.device(device)
    if device.type == "cuda":
        q = torch.zeros(1, 1, 128, 64, device=device, dtype=torch.bfloat16)
        torch._fused_sdp_choice(q, q, q, is_causal=True)  # settles torch's default order (the first call does)
    return tuple(_sdpb_name(b) for b in torch._C._get_sdp_priority_order())


def sdpa_kernel_for(order, q, k, v, attn_mask=None, is_causal=False):
    """The kernel SDPA dispatches to for these arguments under the kernel `order` (None: torch's own order), asked
    without running it: 'cudnn', 'flash', 'efficient' or 'math', or 'none: <torch's error>'."""
    gqa = q.size(1) != k.size(1)
    try:
        if order is None:
            return _sdpb_name(torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa))
        with sdpa_kernel([_SDPB[n] for n in order], set_priority=True):
            return _sdpb_name(torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa))
    except RuntimeError as e:
        return f"none: {str(e).splitlines()[0]}"


def attn_flag():
    """--attn, as every script that builds or loads a model declares it."""
    from nanochat.configurator import Flag

    return Flag("attn", "auto", "attention kernel: auto = sdpa with the GPU's kernel order (cuDNN first on Hopper); "
                "sdpa_cudnn|sdpa_flash|sdpa_efficient|sdpa_math pin one SDPA kernel; flex = FlexAttention; fa3 = "
                "FlashAttention-3 via `kernels` (downloads once) or flash_attn_interface; fa4 = flash-attn-4 "
                "(docs/gpu.md#attention)", choices=list(ATTN_CHOICES))


# -----------------------------------------------------------------------------
# The call


def attention(q, k, v, choice, mask=None, window=None):
    """
    Causal attention of q (B, Hq, Tq, D) over k, v (B, Hkv, Tk, D), Hkv dividing Hq (grouped-query): query i sits at
    position Tk - Tq + i (a cached prefix comes first). `window` (sliding-window attention, FlashAttention's left
    window): query at position p attends keys p - window .. p only (window + 1 keys); None = all earlier keys.
    `mask` (bool, broadcastable to (B, Hq, Tq, Tk), True = attend) replaces both rules: the engine's fixed-shape decode
    step attends a static cache up to its current length (and within the window: KVCache.attn_mask_for).
    Returns (B, Hq, Tq, D) in q's dtype.
    """
    if window is not None and mask is None:
        if q.size(2) == 1 and k.size(2) > window + 1:  # one new token: its window is the last window + 1 cached keys
            k, v = k[:, :, -(window + 1) :], v[:, :, -(window + 1) :]
        if window >= k.size(2) - 1:  # the window reaches back past the first key: plain causal attention
            window = None
    Tq, Tk = q.size(2), k.size(2)
    gqa = q.size(1) != k.size(1)
    if choice.name in ("fa3", "fa4") and mask is None and Tq == Tk:
        fn = _FLASH[choice.name]
        dtype = q.dtype
        half = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16  # FA runs in half precision only
        q, k, v = (t.transpose(1, 2).to(half) for t in (q, k, v))  # FA takes (B, T, H, D); GQA is native
        y = fn(q, k, v) if window is None else fn(q, k, v, window)
        return y.to(dtype).transpose(1, 2)
    if choice.name == "flex" and (mask is None and (Tq == Tk or Tq == 1)):
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = None if Tq == 1 else _causal_block_mask(Tq, q.device, window)  # one new token sees everything cached
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    # an explicit mask below: the decode step's, the sliding window's, or a chunk's after a cached prefix
    masked = mask is not None or window is not None or Tq not in (Tk, 1)
    order = growing_order(choice.order) if Tq != Tk and mask is None else choice.order  # an eager cached call
    order = masked_order(order, q.device.type) if masked else order
    with sdpa_kernel([_SDPB[n] for n in order], set_priority=True):
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        if window is not None:  # SDPA has no sliding window: an explicit mask (the kernels that take masks run it)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(Tq, Tk, q.device, window), enable_gqa=gqa)
        if Tq == Tk:  # training, or a prefill into an empty cache
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if Tq == 1:  # one new token attends to everything cached so far
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        # a chunk after a cached prefix: all of the prefix, causal within the chunk
        return F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_mask(Tq, Tk, q.device, q.dtype), enable_gqa=gqa)


def causal_mask(Tq, Tk, device, window=None):
    """(Tq, Tk) bool, True = attend: query i at position Tk - Tq + i sees keys up to its position, and with a window
    only the last window + 1 of them."""
    mask = torch.ones((Tq, Tk), dtype=torch.bool, device=device).tril(diagonal=Tk - Tq)
    if window is not None:
        mask &= ~torch.ones((Tq, Tk), dtype=torch.bool, device=device).tril(diagonal=Tk - Tq - window - 1)
    return mask


_CHUNK_MASKS = {}


def chunk_mask(Tq, Tk, device, dtype):
    """causal_mask(Tq, Tk) as the additive mask SDPA makes of a bool one (0 where attended, -inf elsewhere: the same
    arithmetic), built once for every layer of a forward and every forward of the same shape (a prompt chunk after
    a cached prefix, the prefix cache's common case). Eager calls share it; a compiled graph builds its own (reading
    the dict while dynamo traces would guard on its keys, see _causal_block_mask). A few shapes are kept: the
    chunks of a server's requests vary, and building the mask per layer and call was ~7% of such a prefill (d4, CPU)."""
    def build():
        return torch.zeros((Tq, Tk), dtype=dtype, device=device).masked_fill(~causal_mask(Tq, Tk, device), float("-inf"))

    if torch.compiler.is_compiling():
        return build()
    key = (Tq, Tk, str(device), dtype)
    if key not in _CHUNK_MASKS:
        if len(_CHUNK_MASKS) >= 8:
            _CHUNK_MASKS.clear()
        _CHUNK_MASKS[key] = build()
    return _CHUNK_MASKS[key]


_BLOCK_MASKS = {}


def _causal(b, h, q, kv):
    return q >= kv


def _sliding(window):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv <= window)

    return mask


def _causal_block_mask(T, device, window=None):
    """FlexAttention's causal (and with `window`, sliding-window) block mask for T x T. Blocks wholly outside the
    window are skipped, which is where flex gains on a windowed layer. Eager: built once per (T, window, device)
    (building it costs a kernel launch per block row, and every layer and step asks for the same one). Compiled: built
    inside the graph, where it is a few fused ops; reading the cache while dynamo traces would guard on its keys, and
    the key added by the first call would recompile the whole model at the second (tests/integration/test_speed_suite.py)."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod = _causal if window is None else _sliding(window)
    if torch.compiler.is_compiling():
        return create_block_mask(mask_mod, None, None, T, T, device=device)
    key = (T, window, str(device))
    if key not in _BLOCK_MASKS:
        _BLOCK_MASKS[key] = create_block_mask(mask_mod, None, None, T, T, device=device)
    return _BLOCK_MASKS[key]


# -----------------------------------------------------------------------------
# FlashAttention-3 / -4: loaded once per process, only when asked for


_FLASH = {}  # name -> fn(q, k, v[, window]) causal attention on (B, T, H, D) (no window: full), once loaded
_FLASH_ERROR = {}  # name -> why it could not be loaded (cached: a failed Hub lookup is not retried)


def load_flash(name):
    """Load fa3 or fa4 once; None when it loaded, else the reason with the fix (cached)."""
    if name in _FLASH:
        return None
    if name not in _FLASH_ERROR:
        try:
            _FLASH[name] = _load_fa3() if name == "fa3" else _load_fa4()
            return None
        except RuntimeError as e:
            _FLASH_ERROR[name] = str(e)
    return _FLASH_ERROR[name]


def _load_fa3():
    """FA3 through `kernels` at the pinned version (a registered torch op: torch.compile traces it), then the
    `flash_attn_interface` hopper build (its extension call may break the compiled graph: nanochat.compile says so).
    NANOCHAT_FA3=0 skips the attempt (offline machines, where the Hub lookup would wait for its timeout)."""
    if os.environ.get("NANOCHAT_FA3", "1") == "0":
        raise RuntimeError("FlashAttention-3 is turned off by NANOCHAT_FA3=0")
    reasons = []
    try:
        from kernels import get_kernel

        repo, version = FA3_KERNEL
        mod = get_kernel(repo, version=version)
        fn = getattr(mod, "flash_attn_func", None) or mod.flash_attn_interface.flash_attn_func
        return _first_output(fn)
    except Exception as e:  # ImportError, no network, no build for this GPU/torch
        reasons.append(f"kernels ({FA3_KERNEL[0]} version {FA3_KERNEL[1]}): {type(e).__name__}: {e}")
    try:
        from flash_attn_interface import flash_attn_func

        return _first_output(flash_attn_func)
    except Exception as e:  # ImportError, or a broken build raising at import
        reasons.append(f"flash_attn_interface: {type(e).__name__}: {e}")
    raise RuntimeError("FlashAttention-3 could not be loaded (pip install kernels, which downloads "
                       f"{FA3_KERNEL[0]} version {FA3_KERNEL[1]} from the Hugging Face Hub once, or install the FA3 "
                       f"hopper build providing flash_attn_interface): {'; '.join(reasons)}")


def _first_output(fn):
    def call(q, k, v, window=None):
        # FlashAttention's sliding window: window_size=(left, right), right 0 under causal
        y = fn(q, k, v, causal=True) if window is None else fn(q, k, v, causal=True, window_size=(window, 0))
        return y[0] if isinstance(y, tuple) else y  # some builds return (out, softmax_lse)
    return call


def _load_fa4():
    try:
        from flash_attn.cute import interface
    except Exception as e:
        raise RuntimeError(f"FlashAttention-4 could not be loaded ({type(e).__name__}: {e}): pip install flash-attn-4 "
                           "(or pip install -e '.[fa4]')") from None
    return register_fa4_ops(interface._flash_attn_fwd, interface._flash_attn_bwd)


def register_fa4_ops(fwd, bwd):
    """
    FA4 is an autograd.Function that dynamo would break the graph at; its forward and backward are registered here
    as two torch custom ops (`nanochat::fa4_fwd` returns (out, lse), `nanochat::fa4_bwd` (dq, dk, dv)) with fake
    (shape) implementations and the autograd link between them, so torch.compile keeps the model in one graph.
    fwd(q, k, v, causal=True) -> (out, lse); bwd(q, k, v, out, dout, lse, causal=True) -> (dq, dk, dv); a sliding
    window adds window_size_left=w, window_size_right=0 to both calls (FA4's names). Taking them as arguments lets the
    CPU tests register a reference pair. Returns fn(q, k, v, window=None) on (B, T, H, D).
    """
    lib = "nanochat"
    fwd_name, bwd_name = f"{lib}::fa4_fwd", f"{lib}::fa4_bwd"
    if not hasattr(torch.ops.nanochat, "fa4_fwd"):
        @torch.library.custom_op(fwd_name, mutates_args=())
        def fa4_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
            # return_lse: FA4 makes the lse (which the backward needs) only when asked or when an input needs grad,
            # and inside a compiled graph or under no_grad none does
            out, lse = _FA4_IMPL["fwd"](q, k, v, causal=True, return_lse=True, **_fa4_window(window))
            return out.contiguous(), lse.contiguous()

        @fa4_fwd.register_fake
        def _(q, k, v, window=-1):
            B, T, H, _ = q.shape
            return torch.empty_like(q), q.new_empty((B, H, T), dtype=torch.float32)

        @torch.library.custom_op(bwd_name, mutates_args=())
        def fa4_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                    lse: torch.Tensor, window: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            dq, dk, dv = _FA4_IMPL["bwd"](q, k, v, out, dout, lse, causal=True, **_fa4_window(window))
            return dq.contiguous(), dk.contiguous(), dv.contiguous()

        @fa4_bwd.register_fake
        def _(q, k, v, out, dout, lse, window=-1):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs[:3], *output)
            ctx.window = inputs[3] if len(inputs) > 3 else -1

        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            return *torch.ops.nanochat.fa4_bwd(q, k, v, out, dout.contiguous(), lse, ctx.window), None

        fa4_fwd.register_autograd(backward, setup_context=setup_context)
    _FA4_IMPL.update(fwd=fwd, bwd=bwd)
    return lambda q, k, v, window=None: torch.ops.nanochat.fa4_fwd(q, k, v, -1 if window is None else window)[0]


def _fa4_window(window):
    """FA4's keyword arguments for a left window (-1: none, and no arguments, as before windows existed)."""
    return {} if window < 0 else {"window_size_left": window, "window_size_right": 0}


_FA4_IMPL = {}
