"""
nanochat's own tensorwise FP8 Linear (`--fp8_impl=native`, nanochat/fp8.py), on CPU: torch._scaled_mm runs there (it
is what the GPU runs, minus the speed), so the real autograd function is tested, not a stand-in:

- the casts: one scale per tensor that puts max|x| on the format's largest value, saturation, the rounding bound
- the three matmuls against the same FP8 operands dequantized and multiplied in float64 (the emulation), and against
  the plain float matmul within FP8's error
- the same numbers as nanochat 92d63d4's Float8Linear (its nanochat/fp8.py from ../shared/bench), bit for bit
- the conversion picks exactly the layers of fp8_plan (--fp8_filter), the same as torchao's, and keeps the state dict
- a converted GPT trains like the plain one, eager and compiled; refusals (rowwise, CPU runs)
Under FSDP2: tests/unit/test_fp8.py::test_emulated_fp8_under_fsdp_trains_like_the_unconverted_model (its "native" run).
"""

import pytest
import torch
import torch.nn as nn

from anchors import load_92d63d4_module
from nanochat.fp8 import Float8Linear, _Float8Matmul, check_fp8_supported, convert_to_fp8, fp8_plan, to_fp8
from nanochat.gpt import GPT, GPTConfig

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_to_fp8_scales_casts_and_saturates(dtype):
    fmax = torch.finfo(dtype).max
    x = randn(64, 48, scale=3.0)
    x[0, 0] = -40.0  # the largest magnitude
    q, inv = to_fp8(x, dtype)
    assert q.dtype == dtype and inv.dtype == torch.float32 and inv.ndim == 0
    assert q[0, 0].float().item() == -fmax  # max |x| lands on the format's largest value
    assert inv.item() == pytest.approx(40.0 / fmax, rel=1e-6)
    back = q.float() * inv
    mantissa = {E4M3: 3, E5M2: 2}[dtype]
    normal = x.abs() > 40.0 / fmax * 2.0 ** -5  # away from the subnormals, rounding is relative
    assert ((back - x).abs()[normal] / x.abs()[normal]).max() <= 2.0 ** -(mantissa + 1)
    zeros, inv0 = to_fp8(torch.zeros(4, 4), dtype)  # an all-zero tensor: a finite scale, zeros out
    assert torch.isfinite(inv0) and torch.equal(zeros.float(), torch.zeros(4, 4))


def test_matmuls_are_the_dequantized_fp8_products():
    """Forward and both backward matmuls equal the float64 product of the dequantized FP8 operands (what
    torch._scaled_mm computes, accumulated in float32 here), and the plain float matmuls within FP8's error."""
    x, w, g = randn(96, 64, seed=1).requires_grad_(), randn(80, 64, seed=2, scale=0.1).requires_grad_(), randn(96, 80, seed=3)
    out = _Float8Matmul.apply(x, w)
    out.backward(g)

    def deq(t, dtype):
        q, inv = to_fp8(t, dtype)
        return q.double() * inv.double()

    xq, wq, gq = deq(x.detach(), E4M3), deq(w.detach(), E4M3), deq(g, E5M2)
    for got, emulated, exact in ((out, xq @ wq.T, x.detach() @ w.detach().T), (x.grad, gq @ wq, g @ w.detach()),
                                 (w.grad, gq.T @ xq, g.T @ x.detach())):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), emulated, rtol=1e-5, atol=1e-5 * emulated.abs().max().item())
        rel = ((got - exact).norm() / exact.norm()).item()
        assert rel < 0.1, rel  # e4m3 rounds by <= 6.25%, e5m2 by <= 12.5%, and the errors average out in a sum


def test_same_numbers_as_nanochat_92d63d4(tmp_path, monkeypatch):
    ref_mod = load_92d63d4_module("nanochat/fp8.py", tmp_path, monkeypatch)
    torch.manual_seed(0)
    plain = nn.Linear(64, 48, bias=False)
    ours, theirs = Float8Linear.from_float(plain), ref_mod.Float8Linear.from_float(plain)
    x = randn(4, 24, 64, seed=5)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    assert torch.equal(ya, yb)
    g = randn(*ya.shape, seed=6)
    (ga_x, ga_w), (gb_x, gb_w) = (torch.autograd.grad(y, (xx, plain.weight), g) for y, xx in ((ya, xa), (yb, xb)))
    assert torch.equal(ga_x, gb_x) and torch.equal(ga_w, gb_w)


def test_autocast_sets_the_compute_dtype():
    lin = Float8Linear.from_float(nn.Linear(32, 16))
    x = randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and lin.bias.grad is not None
    assert lin(x).dtype == torch.float32


# ----------------------------------------------------------------------------- the conversion


CONFIG = GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=4, n_kv_head=1, n_embd=96)  # c_k/c_v: 96 -> 24


def meta_model():
    with torch.device("meta"):
        return GPT(CONFIG, attn="sdpa")


@pytest.mark.parametrize("filter", ["all", "auto", "mlp.c_fc,attn.c_proj"])
def test_conversion_picks_the_filters_layers(filter):
    model = meta_model()
    converted, skipped, plan = convert_to_fp8(model, "tensorwise", filter=filter, impl="native")
    fp8 = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert fp8 == sorted(converted) == sorted(n for n, c, _ in fp8_plan(meta_model(), "tensorwise", filter) if c)
    assert not any("c_k" in n or "c_v" in n for n in fp8)  # 24 is not a multiple of 16
    assert type(model.lm_head) is nn.Linear and model.transformer.h[0].mlp.c_fc.weight.device.type == "meta"
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in meta_model().state_dict().items()}
    try:
        from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear
    except ImportError:
        return
    other = meta_model()
    convert_to_fp8(other, "tensorwise", filter=filter, impl="torchao")
    assert sorted(n for n, m in other.named_modules() if isinstance(m, TorchaoFloat8Linear)) == fp8


def test_refusals():
    with pytest.raises(ValueError, match="--fp8_impl=native scales tensorwise only.*--fp8_recipe=tensorwise"):
        convert_to_fp8(meta_model(), "rowwise", impl="native")
    with pytest.raises(ValueError, match="--fp8_impl must be one of torchao|native"):
        check_fp8_supported("cuda", "tensorwise", impl="nvidia")
    with pytest.raises(RuntimeError, match=r"compute capability >= 8.9.*cpu: use --fp8=0"):
        check_fp8_supported("cpu", "tensorwise", impl="native")


def test_apply_fp8_says_which_implementation():
    from nanochat import fp8

    lines = []
    model = meta_model()
    with pytest.MonkeyPatch.context() as m:  # the hardware check is tested above; on meta nothing runs
        m.setattr(fp8, "check_fp8_supported", lambda device, recipe, impl: None)
        fp8.apply_fp8(model, "tensorwise", "meta", fsdp=True, log=lines.append, filter="all", impl="native")
    assert lines[0].startswith("FP8 (tensorwise, --fp8_impl=native, --fp8_filter=all): 8 of 12 block Linear layers")
    assert "all-gather" not in lines[0]  # native has no FP8 all-gather: FSDP2 gathers the weights as they are


def test_gpu_suite_fp8impl_compares_the_two_implementations():
    """bench/gpu_suite.sh fp8impl: the same d20 run with each --fp8_impl, nothing else different, within 9 minutes."""
    import re
    import subprocess

    from conftest import REPO

    out = subprocess.run(["bash", "bench/gpu_suite.sh", "fp8impl", "--dry-run"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    steps = re.findall(r"^=== (\S+) \(limit (\d+) s\): (.*)$", out, re.M)
    assert [s[0] for s in steps] == ["d20_fp8_torchao", "d20_fp8_native"]
    assert sum(int(s[1]) for s in steps) <= 540
    a, b = steps[0][2], steps[1][2]
    assert "--fp8=1" in a and a.replace("--fp8_impl=torchao", "--fp8_impl=native") == b


def test_base_train_refuses_native_rowwise_before_any_work(base_dir):
    from scripts import base_train

    with pytest.raises(ValueError, match="--fp8_impl=native scales tensorwise only"):
        base_train.main(["--fp8=1", "--fp8_impl=native", "--fp8_recipe=rowwise", "--device_type=cpu", "--depth=2",
                         "--num_iterations=1"])


# ----------------------------------------------------------------------------- training


TRAIN_CONFIG = GPTConfig(sequence_len=64, vocab_size=256, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)


def cpu_model(recipe=None, impl="native"):
    """The same weights every call; recipe: convert the block Linears with `impl` (torchao's emulated, since torchao
    refuses CPU matmuls; native runs torch._scaled_mm as it is). None: plain. tests/unit/test_fp8.py uses it too."""
    torch.manual_seed(0)
    model = GPT(TRAIN_CONFIG, attn="sdpa")
    model.init_weights("nanochat")
    with torch.no_grad():  # the nanochat init zeroes c_proj, which would make the blocks' FP8 matmuls moot
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    if recipe is not None:
        convert_to_fp8(model, recipe, emulate=impl == "torchao", filter="all", impl=impl)
    return model


def train_batch():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, TRAIN_CONFIG.vocab_size, (4, TRAIN_CONFIG.sequence_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train(model, steps, call=None):
    """Losses of `steps` full steps with the training's optimizers (Muon for the block matrices, AdamW the rest), and
    the first step's gradients."""
    x, y = train_batch()
    opts = model.setup_optimizers(use_muon=True)
    losses, grads = [], None
    for step in range(steps):
        loss = (model if call is None else call)(x, y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def test_native_fp8_trains_like_the_plain_model():
    """Within FP8's rounding of the plain model's losses (the bound and why: tests/unit/test_fp8.py LOSS_ATOL), and it
    learns; its state dict loads into the plain model and gives the same outputs as the FP8 one's weights."""
    ref, _ = train(cpu_model(), 4)
    model = cpu_model("tensorwise")
    losses, _ = train(model, 4)
    assert losses[-1] < losses[0] - 1.0, losses
    for a, b in zip(losses, ref):
        assert abs(a - b) < 1e-2, (losses, ref)
    plain = cpu_model()
    plain.load_state_dict(model.state_dict(), strict=True)
    assert all(type(v) is torch.Tensor for v in model.state_dict().values())


@pytest.mark.slow  # one aot_eager compile of the converted model
def test_native_fp8_under_compile_matches_eager():
    torch._dynamo.reset()
    eager, _ = train(cpu_model("tensorwise"), 2)
    model = cpu_model("tensorwise")
    compiled, _ = train(model, 2, call=torch.compile(model, backend="aot_eager", dynamic=False))
    torch._dynamo.reset()
    for a, b in zip(compiled, eager):
        assert abs(a - b) < 1e-5, (compiled, eager)
