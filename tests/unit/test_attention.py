"""
Attention backends (nanochat/attention.py): the selection rule for every compute capability, the refusals of
kernels that cannot load (no fallback), and every backend that runs on CPU against a float64 math reference,
forward and gradients, alone and inside the GPT, with and without a sliding window (training, prefill, decode and a
chunk after a cached prefix). FA4's custom-op wrapper is checked with a reference kernel pair, FA3's window argument
with a stand-in kernel.
"""

import math
import sys
import types

import pytest
import torch

from nanochat import attention as A
from nanochat.gpt import GPT, GPTConfig, RecordConfig, RecordGPT

# Every CUDA compute capability torch has shipped kernels for, and CPU (None).
CAPABILITIES = [(3, 7), (5, 0), (5, 2), (6, 0), (6, 1), (7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0),
                (10, 0), (10, 3), (11, 0), (12, 0), (12, 1), None]


def loaded(name):
    return None


@pytest.mark.parametrize("cap", CAPABILITIES, ids=str)
def test_auto_and_sdpa_order_for_every_capability(cap):
    choice = A.choose("auto", cap)
    assert choice.name == "sdpa" and choice.why.startswith("auto: ")
    assert A.choose("sdpa", cap).order == choice.order
    order = choice.order
    assert order[-1] == "math"  # always something that runs
    if cap is None:
        assert order == ("flash", "math")
    elif cap[0] == 9:
        assert order[0] == "cudnn"  # Hopper: cuDNN first
    elif cap >= (8, 0):
        assert order[0] == "flash"
    else:
        assert "flash" not in order and "cudnn" not in order  # torch has no flash kernel below sm80
    # auto never loads anything: a loader that fails the test if called
    A.choose("auto", cap, load=lambda name: pytest.fail("auto tried to load " + name))


@pytest.mark.parametrize("cap", CAPABILITIES, ids=str)
def test_fa3_fa4_only_where_they_run_and_only_when_asked(cap):
    for name, ok in (("fa3", cap is not None and cap[0] == 9), ("fa4", cap is not None and cap[0] in (9, 10))):
        if ok:
            choice = A.choose(name, cap, load=loaded)
            assert choice.name == name and "cached decode" in choice.describe()
            # it cannot load: refused with the loader's reason and the alternative, never a quiet sdpa
            with pytest.raises(RuntimeError, match=rf"--attn={name}: no wheel here \(pip install x\); or use --attn=sdpa"):
                A.choose(name, cap, load=lambda n: "no wheel here (pip install x)")
        else:
            with pytest.raises(RuntimeError, match=rf"--attn={name} needs a .* GPU, but the model is on .*; use --attn=sdpa"):
                A.choose(name, cap, load=loaded)


@pytest.mark.parametrize("cap", CAPABILITIES, ids=str)
def test_pinned_sdpa_kernels(cap):
    assert A.choose("sdpa_math", cap).order == ("math",)
    for kernel in ("flash", "cudnn", "efficient"):
        runs = (cap is None and kernel == "flash") or (cap is not None and (kernel == "efficient" or cap >= (8, 0)))
        if runs:
            assert A.choose(f"sdpa_{kernel}", cap).order == (kernel,)
        else:
            with pytest.raises(RuntimeError, match=rf"no {kernel} attention kernel for .*; use --attn=sdpa"):
                A.choose(f"sdpa_{kernel}", cap)
    assert A.choose("flex", cap).name == "flex"
    with pytest.raises(ValueError, match=r"--attn must be one of auto\|sdpa\|"):
        A.choose("flash3", cap)


def test_fa3_loader_pins_the_kernel_version_and_caches_a_failure(monkeypatch):
    calls = []
    fake_kernels = types.ModuleType("kernels")

    def get_kernel(repo, version=None):
        calls.append((repo, version))
        raise TimeoutError("Hub unreachable")

    fake_kernels.get_kernel = get_kernel
    monkeypatch.setitem(sys.modules, "kernels", fake_kernels)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # not installed
    monkeypatch.setattr(A, "_FLASH", {})
    monkeypatch.setattr(A, "_FLASH_ERROR", {})
    monkeypatch.delenv("NANOCHAT_FA3", raising=False)
    first = A.load_flash("fa3")
    assert A.load_flash("fa3") == first
    assert calls == [A.FA3_KERNEL]  # one Hub attempt per process, at the pinned version
    assert "TimeoutError: Hub unreachable" in first and "flash_attn_interface" in first and "pip install kernels" in first
    with pytest.raises(RuntimeError, match="--attn=fa3: FlashAttention-3 could not be loaded.*use --attn=sdpa"):
        A.choose("fa3", (9, 0))

    # both available: the kernels build wins, and its (out, lse) tuple is unwrapped
    fake_kernels.get_kernel = lambda repo, version=None: types.SimpleNamespace(flash_attn_func=lambda q, k, v, causal: (q + 1, None))
    fake_interface = types.ModuleType("flash_attn_interface")
    fake_interface.flash_attn_func = lambda q, k, v, causal: q - 1
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake_interface)
    monkeypatch.setattr(A, "_FLASH_ERROR", {})
    assert A.load_flash("fa3") is None and A._FLASH["fa3"](torch.zeros(1), None, None).item() == 1.0

    # NANOCHAT_FA3=0: no attempt at all
    monkeypatch.setattr(A, "_FLASH", {})
    monkeypatch.setattr(A, "_FLASH_ERROR", {})
    monkeypatch.setenv("NANOCHAT_FA3", "0")
    fake_kernels.get_kernel = get_kernel
    calls.clear()
    assert "NANOCHAT_FA3=0" in A.load_flash("fa3") and calls == []


def test_fa4_refused_with_the_install_command_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import fails as when flash-attn-4 is absent
    monkeypatch.setattr(A, "_FLASH", {})
    monkeypatch.setattr(A, "_FLASH_ERROR", {})
    with pytest.raises(RuntimeError, match=r"--attn=fa4: FlashAttention-4 could not be loaded .*pip install flash-attn-4.*use --attn=sdpa"):
        A.choose("fa4", (9, 0))


def test_gpt_refuses_what_cannot_run_on_its_device():
    cfg = GPTConfig(sequence_len=8, vocab_size=10, n_layer=1, n_head=1, n_kv_head=1, n_embd=8)
    model = GPT(cfg, attn="sdpa_math")
    model.init_weights()
    assert model.attn_choice.describe() == "sdpa_math (math)"
    for attn in ("fa3", "fa4", "sdpa_cudnn", "sdpa_efficient"):
        with pytest.raises(RuntimeError, match="use --attn=sdpa"):
            GPT(cfg, attn=attn).init_weights()


# -----------------------------------------------------------------------------
# numerics: every backend that runs on CPU against float64 math


def reference(q, k, v, mask=None, window=None):
    """softmax(q k^T / sqrt(D) + mask) v in float64, GQA by repeating kv heads, causal at offset Tk - Tq; with a
    window, query position p sees keys p - window .. p only."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    Tq, Tk = q.size(2), k.size(2)
    if mask is None:
        qpos = (Tk - Tq + torch.arange(Tq, device=q.device)).view(-1, 1)
        kpos = torch.arange(Tk, device=q.device).view(1, -1)
        mask = (kpos <= qpos) & (kpos >= qpos - (Tk if window is None else window))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


CPU_BACKENDS = ["sdpa", "sdpa_flash", "sdpa_math", "flex"]
SHAPES = [  # (Hq, Hkv, Tq, Tk): training/prefill, GQA, one decode token, a chunk after a prefix
    (4, 4, 16, 16), (4, 2, 16, 16), (4, 1, 1, 12), (4, 2, 5, 12)]


def qkv(Hq, Hkv, Tq, Tk, requires_grad):
    g = torch.Generator().manual_seed(Hq * 100 + Hkv * 10 + Tq + Tk)
    B, D = 2, 16
    q = torch.randn(B, Hq, Tq, D, generator=g)
    k, v = torch.randn(B, Hkv, Tk, D, generator=g), torch.randn(B, Hkv, Tk, D, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_gradients_match_math(backend, shape):
    choice = A.choose(backend, None)
    grads_ok = backend != "flex"  # torch's FlexAttention has no backward on CPU (it raises, checked below)
    q, k, v = qkv(*shape, requires_grad=grads_ok)
    y = A.attention(q, k, v, choice)
    ref = reference(q, k, v)
    torch.testing.assert_close(y.double(), ref, atol=2e-6, rtol=2e-6)
    if grads_ok:
        assert_same_gradients(y, ref, (q, k, v))


def assert_same_gradients(y, ref, inputs):
    """The gradients of y and of its float64 reference with respect to the inputs, for one random output gradient."""
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, inputs, dy), torch.autograd.grad(ref, inputs, dy.double())):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_explicit_mask_matches_math(backend):
    # the engine's fixed-shape decode step: one token over a static cache of 12 of which the first 7 are filled
    q, k, v = qkv(4, 2, 1, 12, requires_grad=False)
    mask = (torch.arange(12) < 7).view(1, 1, 1, 12)
    y = A.attention(q, k, v, A.choose(backend, None), mask)
    torch.testing.assert_close(y.double(), reference(q, k, v, mask.view(1, 12)), atol=2e-6, rtol=2e-6)


# (Hq, Hkv, Tq, Tk, window): training/prefill with the window inside T, GQA, a decode step past the window and one
# still inside it, a chunk after a cached prefix, a window of 0 (each query sees itself only)
WINDOW_SHAPES = [(4, 4, 16, 16, 5), (4, 2, 16, 16, 3), (4, 1, 1, 12, 4), (4, 2, 1, 6, 8), (4, 2, 5, 12, 3), (2, 2, 8, 8, 0)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=str)
def test_sliding_window_matches_math(backend, shape):
    *dims, window = shape
    grads_ok = backend != "flex"
    q, k, v = qkv(*dims, requires_grad=grads_ok)
    y = A.attention(q, k, v, A.choose(backend, None), window=window)
    ref = reference(q, k, v, window=window)
    torch.testing.assert_close(y.double(), ref, atol=2e-6, rtol=2e-6)
    assert not torch.allclose(ref, reference(q, k, v), atol=1e-3) or dims[3] <= window + 1  # the window mattered
    if grads_ok:
        assert_same_gradients(y, ref, (q, k, v))


def test_window_reaching_the_first_key_is_plain_causal_attention():
    # the record model's long layers have window = sequence_len: over a training row that is ordinary causal attention
    q, k, v = qkv(4, 2, 16, 16, requires_grad=False)
    for backend in CPU_BACKENDS:
        choice = A.choose(backend, None)
        assert torch.equal(A.attention(q, k, v, choice, window=15), A.attention(q, k, v, choice))
        assert torch.equal(A.attention(q, k, v, choice, window=64), A.attention(q, k, v, choice))


def test_flex_block_masks_are_cached_per_window():
    a, b = A._causal_block_mask(16, "cpu", 3), A._causal_block_mask(16, "cpu", 5)
    assert a is A._causal_block_mask(16, "cpu", 3) and a is not b and A._causal_block_mask(16, "cpu") is not a
    dense = a.to_dense()  # (1, 1, blocks, blocks) of the 128-token tiles: one block here
    assert dense.numel() == 1


def test_a_chunks_mask_is_built_once_per_shape_and_attends_as_the_bool_mask():
    # a prompt chunk after a cached prefix (the prefix cache's common case): every layer and every later forward of
    # the same shape reuse one additive mask, which gives SDPA's output for the bool mask bit for bit
    mask = A.chunk_mask(5, 12, torch.device("cpu"), torch.float32)
    assert mask is A.chunk_mask(5, 12, torch.device("cpu"), torch.float32)
    assert mask is not A.chunk_mask(5, 12, torch.device("cpu"), torch.float64)
    bool_mask = A.causal_mask(5, 12, "cpu")
    assert torch.equal(mask == 0, bool_mask) and torch.isneginf(mask[~bool_mask]).all()
    q, k, v = qkv(4, 2, 5, 12, requires_grad=False)
    for backend in ("sdpa", "sdpa_flash", "sdpa_math"):
        with torch.nn.attention.sdpa_kernel([A._SDPB[n] for n in A.choose(backend, None).order], set_priority=True):
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, enable_gqa=True)
        assert torch.equal(A.attention(q, k, v, A.choose(backend, None)), want), backend


def test_fa3_gets_the_window_as_flash_attentions_window_size(monkeypatch):
    calls = []

    def fake_fa3(q, k, v, causal, window_size=(-1, -1)):  # FA3's convention: (B, T, H, D), window (left, right)
        calls.append(window_size)
        left = window_size[0]
        y = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=None if left < 0 else left)
        return y.transpose(1, 2).to(q.dtype), None

    monkeypatch.setitem(A._FLASH, "fa3", A._first_output(fake_fa3))
    choice = A.Attn("fa3", ("flash", "math"), "test")
    q, k, v = qkv(4, 2, 16, 16, requires_grad=False)
    for window in (None, 3):
        y = A.attention(q, k, v, choice, window=window)
        ref = reference(*(t.bfloat16() for t in (q, k, v)), window=window)  # FA runs in bf16
        torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=2e-2)
    assert calls == [(-1, -1), (3, 0)]  # no window: FA3's own default, as before windows existed


def test_flex_backward_on_cpu_is_torchs_clear_error():
    q, k, v = qkv(4, 4, 16, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        A.attention(q, k, v, A.choose("flex", None))


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_flash", "flex"])
@pytest.mark.parametrize("record", [False, True], ids=["december", "record"])
def test_gpt_with_each_backend_matches_math(backend, record):
    # record: the record model (value embeddings, smear, backout) with windows of 128 and 512 over rows of 512
    cfg = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    if record:
        cfg = RecordConfig(**dict(vars(cfg), sequence_len=512), window_pattern="SL")
    models = {}
    for name in (backend, "sdpa_math"):
        torch.manual_seed(0)
        models[name] = (RecordGPT if record else GPT)(cfg, attn=name)
        models[name].init_weights("record" if record else "nanochat")
        with torch.no_grad():
            for p in models[name].parameters():
                p.add_(0.05 * torch.randn_like(p))
    assert not record or models[backend].windows == [128, 512]
    idx = torch.randint(0, 64, (2, cfg.sequence_len), generator=torch.Generator().manual_seed(1))
    if backend == "flex":
        with torch.no_grad():
            torch.testing.assert_close(models[backend](idx), models["sdpa_math"](idx), atol=1e-5, rtol=1e-5)
        return
    losses = {}
    for name, m in models.items():
        losses[name] = m(idx, idx)
        losses[name].backward()
    torch.testing.assert_close(losses[backend], losses["sdpa_math"], atol=1e-6, rtol=1e-6)
    for (n, a), b in zip(models[backend].named_parameters(), models["sdpa_math"].parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_sdpa_order_compiles_without_graph_breaks():
    # the kernel order is a context manager inside the model's forward: dynamo must trace it (one graph)
    cfg = GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    model = GPT(cfg, attn="sdpa")
    model.init_weights()
    idx = torch.randint(0, 64, (1, 16))
    explained = torch._dynamo.explain(model)(idx, idx)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


# -----------------------------------------------------------------------------
# FA4's custom-op wrapper, with a reference kernel pair in FA4's calling convention


def ref_mask(T, window_size_left=None):
    """FA4's causal mask for T x T, with its sliding window (query i sees keys i - left .. i)."""
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if window_size_left is not None:
        mask &= ~torch.ones(T, T, dtype=torch.bool).tril(-window_size_left - 1)
    return mask


def ref_fwd(q, k, v, causal=True, window_size_left=None, window_size_right=None, return_lse=False):
    """(B, T, H, D) attention and its log-sum-exp (B, H, T), as FA4's _flash_attn_fwd returns them with return_lse."""
    assert window_size_right in (None, 0)
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
    rep = qh.size(1) // kh.size(1)
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    T = q.size(1)
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.size(-1))
    s = s.masked_fill(~ref_mask(T, window_size_left), float("-inf"))
    lse = s.logsumexp(-1)
    return ((s - lse[..., None]).exp() @ vh).transpose(1, 2).to(q.dtype), lse


def ref_bwd(q, k, v, out, dout, lse, causal=True, window_size_left=None, window_size_right=None):
    """FlashAttention's backward from the saved lse (the probabilities are recomputed, not stored)."""
    qh, kh, vh, oh, doh = (t.transpose(1, 2).float() for t in (q, k, v, out, dout))
    rep = qh.size(1) // kh.size(1)
    kr, vr = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    T, scale = q.size(1), 1 / math.sqrt(q.size(-1))
    s = (qh @ kr.transpose(-1, -2)) * scale
    p = (s.masked_fill(~ref_mask(T, window_size_left), float("-inf")) - lse[..., None]).exp()
    dv = p.transpose(-1, -2) @ doh
    ds = p * (doh @ vr.transpose(-1, -2) - (doh * oh).sum(-1, keepdim=True))
    dq, dk = ds @ kr * scale, ds.transpose(-1, -2) @ qh * scale
    B, H, _, D = dk.shape
    dk, dv = (t.view(B, H // rep, rep, T, D).sum(2) for t in (dk, dv))  # GQA: sum over the heads sharing a kv head
    return tuple(t.transpose(1, 2).to(q.dtype) for t in (dq, dk, dv))


def test_fa4_custom_op_forward_backward_and_compile():
    fn = A.register_fa4_ops(ref_fwd, ref_bwd)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 16, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 16, 2, 8, generator=g, requires_grad=True)
    y = fn(q, k, v)
    ref = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(y.double(), ref, atol=2e-6, rtol=2e-6)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (q, k, v), dy)
    want = torch.autograd.grad(ref, (q, k, v), dy.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # one node for torch.compile: no graph break, same result
    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 0
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), y)
    torch.library.opcheck(torch.ops.nanochat.fa4_fwd.default, (q.detach(), k.detach(), v.detach()))


def test_fa4_custom_op_with_a_sliding_window():
    fn = A.register_fa4_ops(ref_fwd, ref_bwd)
    q, k, v = qkv(4, 2, 16, 16, requires_grad=True)  # (B, H, T, D); FA4 takes (B, T, H, D)
    fa = [t.transpose(1, 2) for t in (q, k, v)]
    y = fn(*fa, 3).transpose(1, 2)
    ref = reference(q, k, v, window=3)
    torch.testing.assert_close(y.double(), ref, atol=2e-6, rtol=2e-6)
    assert_same_gradients(y, ref, (q, k, v))  # the backward got the window too
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*fa, 3).transpose(1, 2), y)
    torch.library.opcheck(torch.ops.nanochat.fa4_fwd.default, tuple(t.detach().contiguous() for t in fa) + (3,))


def test_a_windowed_call_of_a_kernel_that_takes_no_mask_runs_the_masked_order(monkeypatch):
    # Found on an H100 (2026-11-27): SDPA has no sliding window, so a windowed call passes an explicit mask, and a
    # pinned `sdpa_flash` (CUDA's flash kernel takes no mask) stopped with torch's "No available kernel". Here CUDA's
    # rule is put on the CPU's flash kernel: the windowed call must ask for the masked order, and still be right.
    monkeypatch.setitem(A.NO_MASK, "cpu", ("flash",))
    asked = []
    real = A.sdpa_kernel

    def spy(backends, set_priority=False):
        asked.append(tuple(backends))
        return real(backends, set_priority=set_priority)

    monkeypatch.setattr(A, "sdpa_kernel", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    flash = A.choose("sdpa_flash", None)
    y = A.attention(q, k, v, flash, None, 4)
    assert asked == [tuple(A._SDPB[n] for n in A.MASK_FALLBACK)]
    torch.testing.assert_close(y, reference(q, k, v, window=4))
    asked.clear()
    A.attention(q, k, v, flash, None, None)  # no window, no mask: the pinned kernel itself
    assert asked == [(A._SDPB["flash"],)]


def test_calls_whose_shape_grows_every_step_do_not_ask_for_cudnn(monkeypatch):
    # cuDNN builds a graph per shape: eager decode (the cache one token longer each step) and a chunk after a cached
    # prefix would build one per call (an H100 ran d20 eager decode at 35 tok/s so). Fixed shapes keep Hopper's order.
    asked = []
    real = A.sdpa_kernel
    monkeypatch.setattr(A, "sdpa_kernel", lambda b, set_priority=False: asked.append(tuple(b)) or real(b, set_priority=set_priority))
    hopper = A.choose("sdpa", (9, 0))
    assert hopper.order[0] == "cudnn"
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(2))
    names = lambda order: tuple(A._SDPB[n] for n in order)  # noqa: E731
    one = torch.randn(1, 2, 1, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(A.attention(one, k, v, hopper), reference(one, k, v))  # decode: one new token
    chunk = torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(A.attention(chunk, k, v, hopper), reference(chunk, k, v))  # a chunk after 8 cached
    A.attention(k, k, v, hopper)  # training / a prefill into an empty cache: a fixed shape
    A.attention(one, k, v, hopper, torch.ones(1, 12, dtype=torch.bool))  # the compiled step: a static cache, a mask
    assert asked == [names(("flash", "efficient", "math")), names(A.masked_order(("flash", "efficient", "math"), "cpu")),
                     names(hopper.order), names(hopper.order)]
    asked.clear()
    A.attention(one, k, v, A.choose("sdpa_cudnn", (9, 0)))  # pinned cuDNN: the growing call runs the others
    assert asked == [names(A.GROWING_FALLBACK)]


# -----------------------------------------------------------------------------
# on a GPU (skipped without one): every SDPA kernel the card has, and flex, against float64 math


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex"])
@pytest.mark.parametrize("window", [None, 64])
def test_cuda_backends_match_math(backend, window):
    try:
        choice = A.resolve_attn(backend, "cuda")
    except RuntimeError as e:
        pytest.skip(str(e))
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hq, Hkv, T, D = 2, 8, 8, 256, 128  # d20's head dim
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
               for H in (Hq, Hkv, Hkv))
    fn = torch.compile(A.attention) if backend == "flex" else A.attention  # flex is meant to run compiled
    y = fn(q, k, v, choice, None, window)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), window=window)
    torch.testing.assert_close(y.double().cpu(), ref, atol=2e-2, rtol=2e-2)  # bf16 inputs and outputs
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (q, k, v), dy)
    want = torch.autograd.grad(reference(q, k, v, window=window).to(y.device), (q, k, v), dy.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-2, rtol=5e-2)


@pytest.mark.slow  # one tiny base_train run
def test_base_train_prints_and_records_the_choice(base_dir, capsys):
    from nanochat.metrics import read_metrics
    from scripts import base_train

    base_train.main(["--depth=1", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=256",
                     "--num_iterations=1", "--eval_every=-1", "--core_metric_every=-1", "--sample_every=-1",
                     "--device_type=cpu", "--attn=sdpa_math", "--model_tag=attn"])
    assert "attn sdpa_math (math) |" in capsys.readouterr().out  # the banner
    records = read_metrics(base_dir / "base_checkpoints" / "attn" / "metrics.jsonl")
    assert records[0] == {"step": 0, "system/attn": "sdpa_math (math)"}
    report = (base_dir / "report").glob("*.md")
    assert any("Attention kernel: sdpa_math (math)" in p.read_text() for p in report)
