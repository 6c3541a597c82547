"""
Tests of nanochat/gpt.py: architecture against an independent reference forward, causality, GQA, KV cache,
init statistics, optimizer groups, nanochat state-dict layout and checkpoint compatibility, and a small
learning run on WikiText-2 bytes.
"""

import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanochat.gpt import GPT, GPTConfig, config_for_depth

DATA_DIR = Path(__file__).resolve().parents[1] / "assets" / "data"  # excerpts of ../shared/data (tests/assets/README.md)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny models gain little from threads, and on shared 2-core machines oversubscribed threads are ~5x slower;
    # restore the setting for other test modules
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_model(seed=0, randomize=True, attn="sdpa", **kw):
    """Tiny CPU model. randomize=True overwrites every weight with N(0, 0.2) so nothing is zero
    (init zeroes c_proj and lm_head, which would hide bugs in attention/MLP/logits)."""
    cfg = dict(sequence_len=32, vocab_size=97, n_layer=2, n_head=4, n_kv_head=4, n_embd=32)
    cfg.update(kw)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**cfg), attn=attn)
    model.init_weights()
    if randomize:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
    return model.eval()


# -----------------------------------------------------------------------------
# An independent reference forward, written from the architecture description (not from gpt.py):
# x = rms(wte[idx]); per block x += attn(rms(x)); x += mlp(rms(x)); rms; lm_head; slice; softcap.


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def reference_logits(model, idx):
    c = model.config
    sd = {k: v.detach().double() for k, v in model.state_dict().items()}
    B, T = idx.shape
    H, Hkv, D = c.n_head, c.n_kv_head, c.n_embd // c.n_head
    half = D // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, D/2)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]

    def rotate(t):
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos + b * sin, -a * sin + b * cos], dim=-1)

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = _rms(sd["transformer.wte.weight"][idx])
    for i in range(c.n_layer):
        p = f"transformer.h.{i}."
        h = _rms(x)
        q = (h @ sd[p + "attn.c_q.weight"].T).view(B, T, H, D)
        k = (h @ sd[p + "attn.c_k.weight"].T).view(B, T, Hkv, D)
        v = (h @ sd[p + "attn.c_v.weight"].T).view(B, T, Hkv, D)
        q, k = _rms(rotate(q)), _rms(rotate(k))
        # query head j reads kv head j // (H / Hkv)
        k = k.repeat_interleave(H // Hkv, dim=2)
        v = v.repeat_interleave(H // Hkv, dim=2)
        att = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        y = torch.einsum("bhts,bshd->bthd", att, v).reshape(B, T, H * D)
        x = x + y @ sd[p + "attn.c_proj.weight"].T
        h = _rms(x)
        x = x + torch.relu(h @ sd[p + "mlp.c_fc.weight"].T).pow(2) @ sd[p + "mlp.c_proj.weight"].T
    x = _rms(x)
    logits = (x @ sd["lm_head.weight"].T)[..., : c.vocab_size]
    return 15.0 * torch.tanh(logits / 15.0)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_forward_matches_reference(n_kv_head):
    # n_kv_head == n_head: plain MHA; fewer: GQA against the explicit repeat-kv computation.
    model = make_model(n_kv_head=n_kv_head)
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(idx)
    ref = reference_logits(model, idx)
    assert got.dtype == torch.float32 and got.shape == (2, 20, 97)
    torch.testing.assert_close(got.double(), ref, atol=2e-4, rtol=1e-4)


def test_gqa_equals_mha_with_duplicated_kv_heads():
    gqa = make_model(n_kv_head=2)
    mha = make_model(n_kv_head=4, randomize=False)
    D = 32 // 4
    sd = gqa.state_dict()
    for k, v in list(sd.items()):
        if k.endswith(("attn.c_k.weight", "attn.c_v.weight")):
            # rows are (kv_head, head_dim); duplicate each kv head for the 2 query heads that share it
            sd[k] = v.view(2, D, 32).repeat_interleave(2, dim=0).reshape(4 * D, 32)
    mha.load_state_dict(sd)
    idx = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx), mha(idx), atol=1e-5, rtol=1e-5)


def test_causality():
    model = make_model(n_kv_head=2)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 97, (2, 24), generator=g)
    idx2 = idx.clone()
    idx2[:, 12:] = torch.randint(0, 97, (2, 12), generator=g)
    assert not torch.equal(idx[:, 12:], idx2[:, 12:])
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0, rtol=0)  # past positions bit-identical
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3  # and the future did change something


# -----------------------------------------------------------------------------
# KV cache: a minimal cache following the engine contract


class MiniKVCache:
    def __init__(self, n_layer):
        self.n_layer = n_layer
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.pos = 0

    def get_pos(self):
        return self.pos

    def insert_kv(self, layer_idx, k, v):
        assert k.dim() == 4 and k.shape == v.shape  # (B, n_kv_head, T_new, head_dim)
        self.k[layer_idx] = k if self.k[layer_idx] is None else torch.cat([self.k[layer_idx], k], dim=2)
        self.v[layer_idx] = v if self.v[layer_idx] is None else torch.cat([self.v[layer_idx], v], dim=2)
        out = self.k[layer_idx], self.v[layer_idx]
        if layer_idx == self.n_layer - 1:
            self.pos += k.size(2)
        return out


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_kv_cache_step_by_step_and_chunked_prefill(n_kv_head):
    model = make_model(n_kv_head=n_kv_head)
    idx = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(4))  # 40 > sequence_len 32 too
    with torch.no_grad():
        full = model(idx)
        # one token at a time
        cache = MiniKVCache(model.config.n_layer)
        steps = torch.cat([model(idx[:, t : t + 1], kv_cache=cache) for t in range(40)], dim=1)
        assert cache.get_pos() == 40 and cache.k[0].shape == (2, n_kv_head, 40, 8)
        # prefill 16 (Tq == Tk), then chunks of 7 and 9 (prefix + causal within chunk), then single tokens
        cache = MiniKVCache(model.config.n_layer)
        parts = [model(idx[:, :16], kv_cache=cache), model(idx[:, 16:23], kv_cache=cache), model(idx[:, 23:32], kv_cache=cache)]
        parts += [model(idx[:, t : t + 1], kv_cache=cache) for t in range(32, 40)]
        chunked = torch.cat(parts, dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)


# -----------------------------------------------------------------------------
# Attention backend


def test_attention_backend_selection():
    # the full rule for every capability is in tests/unit/test_attention.py; here: what the GPT resolves on this machine
    assert make_model(attn="sdpa").attn_backend == "sdpa"
    if not torch.cuda.is_available():
        assert make_model(attn="auto").attn_backend == "sdpa"  # auto never picks fa3 off CUDA
        with pytest.raises(RuntimeError, match="fa3.*Hopper.*--attn=sdpa"):
            GPT(GPTConfig(sequence_len=8, vocab_size=10, n_layer=1, n_head=1, n_kv_head=1, n_embd=8), attn="fa3")
    with pytest.raises(ValueError, match="auto\\|sdpa\\|"):
        GPT(GPTConfig(sequence_len=8, vocab_size=10, n_layer=1, n_head=1, n_kv_head=1, n_embd=8), attn="flash")


def _fa3_unavailable_reason():
    from nanochat.attention import load_flash

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return "FlashAttention-3 needs a Hopper GPU (compute capability 9.x); none here"
    if load_flash("fa3") is not None:
        return "FlashAttention-3 is not installed (flash_attn_interface or the kernels package)"
    return None


@pytest.mark.skipif(_fa3_unavailable_reason() is not None, reason=str(_fa3_unavailable_reason()))
def test_fa3_matches_sdpa_on_hopper():
    cfg = GPTConfig(sequence_len=256, vocab_size=1000, n_layer=2, n_head=4, n_kv_head=2, n_embd=512)
    torch.manual_seed(0)
    with torch.device("meta"):
        fa3, sdpa = GPT(cfg, attn="fa3"), GPT(cfg, attn="sdpa")
    for m in (fa3, sdpa):
        m.to_empty(device="cuda")
    fa3.init_weights()
    with torch.no_grad():
        for p in fa3.parameters():
            p.normal_(0.0, 0.05)
    sdpa.init_weights()
    sdpa.load_state_dict(fa3.state_dict())
    assert (fa3.attn_backend, sdpa.attn_backend) == ("fa3", "sdpa")
    idx = torch.randint(0, 1000, (4, 256), device="cuda")
    with torch.no_grad(), torch.amp.autocast("cuda", dtype=torch.bfloat16):
        a, b = fa3(idx), sdpa(idx)
        la, lb = fa3(idx, idx), sdpa(idx, idx)
    torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)  # bf16 tolerance
    assert abs(la.item() - lb.item()) < 1e-2


# -----------------------------------------------------------------------------
# Loss


def test_loss_reductions_and_ignore_index():
    model = make_model()
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 97, (2, 10), generator=g)
    tgt = torch.randint(0, 97, (2, 10), generator=g)
    tgt[0, :3] = -1
    tgt[1, 7] = -1
    with torch.no_grad():
        logits = model(idx)
        none = model(idx, tgt, loss_reduction="none")
        mean = model(idx, tgt)
        total = model(idx, tgt, loss_reduction="sum")
    # per-token loss computed by hand from the logits: -log softmax at the target
    logp = logits.log_softmax(-1)
    valid = tgt != -1
    manual = torch.zeros(2, 10)
    manual[valid] = -logp[valid, tgt[valid]]
    assert none.shape == (2, 10)
    torch.testing.assert_close(none, manual, atol=1e-5, rtol=1e-5)
    assert torch.all(none[~valid] == 0)
    torch.testing.assert_close(total, manual.sum(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mean, manual.sum() / valid.sum(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="loss_reduction"):
        model(idx, tgt, loss_reduction="avg")


def test_eval_head_in_row_chunks_gives_the_same_losses(monkeypatch):
    """Without gradients a large batch's head runs a few rows at a time (an H100 ran out of memory on d20's 16 GiB of
    eager fp32 eval logits): same per-token, summed and mean losses, ignored targets included; training is one pass."""
    import nanochat.gpt as gpt

    model = make_model()
    g = torch.Generator().manual_seed(6)
    idx = torch.randint(0, 97, (5, 10), generator=g)
    tgt = torch.randint(0, 97, (5, 10), generator=g)
    tgt[0, :4] = -1
    tgt[3] = -1  # a whole row ignored
    with torch.no_grad():
        whole = {r: model(idx, tgt, loss_reduction=r) for r in ("none", "sum", "mean")}
    calls = []
    real_linear = gpt.F.linear
    monkeypatch.setattr(gpt.F, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real_linear(*a, **kw))
    monkeypatch.setattr(gpt, "HEAD_CHUNK_ELEMENTS", 2 * 10 * 97)  # two rows of logits at a time
    with torch.no_grad():
        chunked = {r: model(idx, tgt, loss_reduction=r) for r in ("none", "sum", "mean")}
    head_calls = [n for n in calls if n <= 5]  # the head's lm_head calls see (rows, T, C); the blocks' see (B, T, C) too
    assert head_calls.count(2) == 3 * 2 and head_calls.count(1) == 3, calls  # 5 rows -> 2 + 2 + 1, for each reduction
    for r in whole:
        torch.testing.assert_close(chunked[r], whole[r], atol=1e-5, rtol=1e-5)
    assert torch.all(chunked["none"][tgt == -1] == 0)
    calls.clear()
    loss = model(idx, tgt)  # gradients on: one pass, so the backward has what it needs
    loss.backward()
    assert 5 in calls and 2 not in calls
    with pytest.raises(ValueError, match="loss_reduction"):
        with torch.no_grad():
            model(idx, tgt, loss_reduction="avg")


def test_padded_vocab_is_sliced_off():
    model = make_model(vocab_size=97)
    assert model.padded_vocab_size == 128
    assert model.lm_head.weight.shape == (128, 32) and model.transformer.wte.weight.shape == (128, 32)
    idx = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        before = model(idx)
        model.lm_head.weight[97:] = 100.0  # padding rows can never win a softmax because they are dropped
        after = model(idx)
    assert before.shape == (1, 8, 97)
    torch.testing.assert_close(before, after, atol=0, rtol=0)
    assert before.abs().max() < 15.0  # softcap


def test_config_for_depth():
    c = config_for_depth(4, vocab_size=65536, sequence_len=2048)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.sequence_len, c.vocab_size) == (4, 256, 2, 2, 2048, 65536)
    c = config_for_depth(20, vocab_size=65536, sequence_len=2048)
    assert (c.n_embd, c.n_head, c.n_kv_head) == (1280, 10, 10)
    c = config_for_depth(26, vocab_size=65536, sequence_len=2048)
    assert (c.n_embd, c.n_head) == (1664, 13)
    with pytest.raises(ValueError, match="depth"):
        config_for_depth(5, vocab_size=100, sequence_len=64)  # 320 wide, 3 heads: does not divide
    with pytest.raises(ValueError, match="n_kv_head"):
        GPT(GPTConfig(sequence_len=8, vocab_size=10, n_layer=1, n_head=4, n_kv_head=3, n_embd=32))


def test_estimate_flops_and_num_params():
    # d4 at nanochat's vocab: n_embd 256, 2 heads of 128, MHA; 65536 is already a multiple of 64
    c = config_for_depth(4, vocab_size=65536, sequence_len=2048)
    with torch.device("meta"):
        model = GPT(c, attn="sdpa")
    d, L, V = 256, 4, 65536
    per_layer = 4 * d * d + 2 * 4 * d * d  # q, k, v, proj + fc, proj
    assert model.num_params() == 2 * V * d + L * per_layer
    assert model.estimate_flops() == 6 * (L * per_layer + V * d) + 12 * L * 2 * 128 * 2048


# -----------------------------------------------------------------------------
# Parameter layout and nanochat checkpoints


def nanochat_layout(n_layer, n_embd, n_head, n_kv_head, vocab_size):
    """Expected state dict of a nanochat GPT, from its architecture (independent of gpt.py)."""
    pv = (vocab_size + 63) // 64 * 64
    hd = n_embd // n_head
    shapes = {"transformer.wte.weight": (pv, n_embd)}
    for i in range(n_layer):
        shapes[f"transformer.h.{i}.attn.c_q.weight"] = (n_head * hd, n_embd)
        shapes[f"transformer.h.{i}.attn.c_k.weight"] = (n_kv_head * hd, n_embd)
        shapes[f"transformer.h.{i}.attn.c_v.weight"] = (n_kv_head * hd, n_embd)
        shapes[f"transformer.h.{i}.attn.c_proj.weight"] = (n_embd, n_embd)
        shapes[f"transformer.h.{i}.mlp.c_fc.weight"] = (4 * n_embd, n_embd)
        shapes[f"transformer.h.{i}.mlp.c_proj.weight"] = (n_embd, 4 * n_embd)
    shapes["lm_head.weight"] = (pv, n_embd)
    return shapes


@pytest.mark.parametrize("depth,n_embd,n_head", [(4, 256, 2), (20, 1280, 10)])
@pytest.mark.parametrize("vocab_size", [65536, 50257])
def test_state_dict_matches_nanochat_layout(depth, n_embd, n_head, vocab_size):
    with torch.device("meta"):
        model = GPT(config_for_depth(depth, vocab_size=vocab_size, sequence_len=2048), attn="sdpa")
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == nanochat_layout(depth, n_embd, n_head, n_head, vocab_size)
    assert list(got) == list(nanochat_layout(depth, n_embd, n_head, n_head, vocab_size))  # same order too
    assert all(p.is_meta for p in model.parameters())


def test_load_nanochat_style_checkpoint_built_on_meta():
    # A state dict as torch.compile'd nanochat saves it: nanochat's names and shapes with `_orig_mod.` prefixes.
    cfg = GPTConfig(sequence_len=16, vocab_size=70, n_layer=2, n_head=2, n_kv_head=1, n_embd=32)
    g = torch.Generator().manual_seed(6)
    saved = {
        "_orig_mod." + k: torch.randn(shape, generator=g) * 0.3
        for k, shape in nanochat_layout(2, 32, 2, 1, 70).items()
    }
    stripped = {k.removeprefix("_orig_mod."): v for k, v in saved.items()}
    with torch.device("meta"):
        model = GPT(cfg, attn="auto")
    model.to_empty(device="cpu")
    model.init_weights()
    model.load_state_dict(stripped, strict=True, assign=True)
    model.eval()
    assert model.attn_backend == "sdpa" or torch.cuda.is_available()
    for k, v in model.state_dict().items():
        assert torch.equal(v, stripped[k])
    idx = torch.randint(0, 70, (2, 12), generator=g)
    with torch.no_grad():
        got = model(idx)
    torch.testing.assert_close(got.double(), reference_logits(model, idx), atol=2e-4, rtol=1e-4)


# -----------------------------------------------------------------------------
# Init


def test_init_statistics_normal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=1000, n_layer=2, n_head=4, n_kv_head=1, n_embd=256), attn="sdpa")
    model.init_weights("normal")
    wte = model.transformer.wte.weight
    assert abs(wte.mean().item()) < 0.01 and abs(wte.std().item() - 1.0) < 0.02
    assert torch.all(model.lm_head.weight == 0)
    for block in model.transformer.h:
        assert torch.all(block.attn.c_proj.weight == 0) and torch.all(block.mlp.c_proj.weight == 0)
        # std = 1/sqrt(fan_in) * min(1, sqrt(fan_out / fan_in))
        expected = {
            "c_q": 1 / 16,  # 256 -> 256
            "c_k": 1 / 16 * math.sqrt(64 / 256),  # 256 -> 64 (one kv head of 64)
            "c_v": 1 / 16 * math.sqrt(64 / 256),
            "c_fc": 1 / 16,  # 256 -> 1024: min(1, 2) = 1
        }
        for name, std in expected.items():
            w = (block.mlp.c_fc if name == "c_fc" else getattr(block.attn, name)).weight
            assert abs(w.mean().item()) < 0.1 * std, name
            assert abs(w.std().item() / std - 1) < 0.05, (name, w.std().item(), std)


def test_init_statistics_nanochat():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=1000, n_layer=2, n_head=4, n_kv_head=2, n_embd=256), attn="sdpa")
    model.init_weights("nanochat")
    wte = model.transformer.wte.weight
    assert abs(wte.mean().item()) < 0.01 and abs(wte.std().item() - 1.0) < 0.02
    lm = model.lm_head.weight
    assert abs(lm.std().item() / 0.001 - 1) < 0.02 and abs(lm.mean().item()) < 1e-4
    bound = math.sqrt(3) / math.sqrt(256)
    for block in model.transformer.h:
        assert torch.all(block.attn.c_proj.weight == 0) and torch.all(block.mlp.c_proj.weight == 0)
        for w in (block.attn.c_q.weight, block.attn.c_k.weight, block.attn.c_v.weight, block.mlp.c_fc.weight):
            assert w.abs().max().item() <= bound
            assert w.abs().max().item() > 0.99 * bound  # uniform fills the whole interval
            assert abs(w.std().item() / (bound / math.sqrt(3)) - 1) < 0.05
    with pytest.raises(ValueError, match="normal.*nanochat"):
        model.init_weights("xavier")


def test_init_is_reproducible_and_rotary_not_in_state_dict():
    a, b = make_model(seed=7, randomize=False), make_model(seed=7, randomize=False)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert not any("cos" in k or "sin" in k for k in a.state_dict())
    assert a.cos.shape == (1, 320, 1, 4) and a.cos.dtype == torch.float32  # 10 x sequence_len, fp32 on CPU


# -----------------------------------------------------------------------------
# Optimizers


def _check_groups(model, optimizers):
    seen = {}
    for opt in optimizers:
        for group in opt.param_groups:
            assert group["initial_lr"] == group["lr"]
            for p in group["params"]:
                seen[id(p)] = seen.get(id(p), 0) + 1
    assert set(seen) == {id(p) for p in model.parameters()}
    assert all(n == 1 for n in seen.values())


def test_optimizer_groups_adamw_only():
    model = make_model(n_embd=192, n_head=2, n_kv_head=1, randomize=False)
    opts = model.setup_optimizers(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.1, use_muon=False)
    assert len(opts) == 1 and isinstance(opts[0], torch.optim.AdamW)
    _check_groups(model, opts)
    scale = (192 / 768) ** -0.5  # = 2
    groups = opts[0].param_groups
    by_param = {id(p): g for g in groups for p in g["params"]}
    lm, emb = by_param[id(model.lm_head.weight)], by_param[id(model.transformer.wte.weight)]
    mat = by_param[id(model.transformer.h[0].attn.c_q.weight)]
    assert lm["lr"] == pytest.approx(0.004 * scale) and lm["weight_decay"] == 0.1
    assert emb["lr"] == pytest.approx(0.2 * scale) and emb["weight_decay"] == 0.0
    assert mat["lr"] == pytest.approx(0.02 * scale) and mat["weight_decay"] == 0.1
    for g in groups:
        assert g["betas"] == (0.8, 0.95) and g["eps"] == 1e-10
    # one real step moves every parameter (all receive gradients once no weight is zero)
    model.train()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    before = [p.detach().clone() for p in model.parameters()]
    idx = torch.randint(0, 97, (2, 8))
    model(idx, idx).backward()
    for opt in opts:
        opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_optimizer_groups_with_muon():
    try:
        from nanochat.muon import Muon
    except ImportError as e:
        pytest.skip(f"nanochat.muon does not import yet ({e}); the Muon optimizer is another engineer's file")
    model = make_model(randomize=False)
    opts = model.setup_optimizers(use_muon=True)
    assert len(opts) == 2 and isinstance(opts[0], torch.optim.AdamW) and isinstance(opts[1], Muon)
    _check_groups(model, opts)
    assert len(opts[0].param_groups) == 2  # lm_head, wte
    muon_params = {id(p) for g in opts[1].param_groups for p in g["params"]}
    assert muon_params == {id(p) for p in model.transformer.h.parameters()}
    assert all(g["lr"] == 0.02 for g in opts[1].param_groups)


# -----------------------------------------------------------------------------
# Generation


def test_generate():
    model = make_model()
    prompt = [1, 2, 3, 4]
    greedy = list(model.generate(prompt, max_tokens=6, temperature=0.0))
    # greedy = argmax of the full forward, token by token
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert greedy == ids[4:]
    s1 = list(model.generate(prompt, max_tokens=8, temperature=1.0, top_k=5, seed=3))
    s2 = list(model.generate(prompt, max_tokens=8, temperature=1.0, top_k=5, seed=3))
    assert s1 == s2 and all(isinstance(t, int) and 0 <= t < 97 for t in s1)
    # top_k=1 sampling is greedy
    assert list(model.generate(prompt, max_tokens=6, temperature=1.0, top_k=1)) == greedy
    # generation can run past sequence_len (rotary table covers 10x)
    assert len(list(model.generate(prompt, max_tokens=40, temperature=0.0))) == 40


@pytest.mark.parametrize("record", [0, 1])
def test_generate_greedy_gives_each_prompt_what_generate_gives_it_alone(record):
    """The training loop's sample prints: prompts of different lengths in one right-padded batch, one forward per new
    token; each row continues as greedy `generate` continues it alone (the record model: its
    16-position window cuts the longer rows)."""
    from nanochat.gpt import RecordConfig, RecordGPT

    if record:
        torch.manual_seed(0)
        model = RecordGPT(RecordConfig(sequence_len=16, vocab_size=97, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                                       window_pattern="SL"), attn="sdpa")
        model.init_weights()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
    else:
        model = make_model()
    model.eval()
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7]]
    got = model.generate_greedy(prompts, max_tokens=12)
    assert got == [list(model.generate(p, max_tokens=12, temperature=0)) for p in prompts]
    assert len({tuple(g) for g in got}) == len(prompts)  # the rows are not all the same continuation
    with pytest.raises(ValueError, match="use generate"):
        model.generate_greedy([[1] * model.rotary_seq_len], max_tokens=2)
    with pytest.raises(ValueError, match="non-empty lists"):
        model.generate_greedy([[1], []], max_tokens=2)


# -----------------------------------------------------------------------------
# Learning


@pytest.mark.slow  # a 120-step training run
def test_learns_wikitext2_bytes():
    # 120 AdamW steps of a d4-like model (4 layers, 128 wide) on 8 x 64-byte windows: a few seconds on an idle CPU
    path = DATA_DIR / "pretrain" / "wikitext-2"
    if not (path / "train.txt").exists():
        pytest.skip(f"WikiText-2 not found at {path} (shared data absent)")
    train = (path / "train.txt").read_bytes()[:400_000]
    val = (path / "valid.txt").read_bytes()[:50_000]
    BOS, V, T, B = 256, 257, 64, 8  # byte-level vocabulary + BOS: no tokenizer dependency
    train_ids = torch.tensor([BOS] + list(train), dtype=torch.long)
    val_ids = torch.tensor([BOS] + list(val), dtype=torch.long)

    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=T, vocab_size=V, n_layer=4, n_head=2, n_kv_head=2, n_embd=128), attn="sdpa")
    model.init_weights()
    # AdamW on the matrices too; matrix_lr 0.02 (x2.45 width scaling) sits on the unigram plateau for ~150
    # steps at this size, 0.005 leaves it within ~50
    opts = model.setup_optimizers(use_muon=False, matrix_lr=0.005)
    g = torch.Generator().manual_seed(0)
    val_starts = torch.arange(0, 16 * 3 * T, 3 * T)

    def val_loss():
        model.eval()
        with torch.no_grad():
            x = torch.stack([val_ids[s : s + T] for s in val_starts])
            y = torch.stack([val_ids[s + 1 : s + T + 1] for s in val_starts])
            loss = model(x, y).item()
        model.train()
        return loss

    v0 = val_loss()
    assert abs(v0 - math.log(V)) < 0.05  # zero lm_head: uniform prediction at start
    t0 = time.time()
    losses = []
    for step in range(120):
        starts = torch.randint(0, len(train_ids) - T - 1, (B,), generator=g)
        x = torch.stack([train_ids[s : s + T] for s in starts])
        y = torch.stack([train_ids[s + 1 : s + T + 1] for s in starts])
        loss = model(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    v1 = val_loss()
    elapsed = time.time() - t0
    print(f"train loss {losses[0]:.3f} -> {sum(losses[-10:]) / 10:.3f}, val {v0:.3f} -> {v1:.3f} in {elapsed:.1f}s")
    assert sum(losses[-10:]) / 10 < losses[0] - 2.5
    assert v1 < v0 - 2.5  # held-out text, not memorisation
    # below the unigram byte entropy of the held-out text: the model uses context, not just byte frequencies
    counts = torch.bincount(val_ids[1:], minlength=V).double()
    probs = counts[counts > 0] / counts.sum()
    unigram_entropy = -(probs * probs.log()).sum().item()
    assert v1 < unigram_entropy - 0.3, (v1, unigram_entropy)


# -----------------------------------------------------------------------------
# The training benchmark runs end to end (tiny config)


def test_train_bench_runs(capsys):
    import json

    from bench.train_bench import main

    main(["--depth=1", "--max_seq_len=32", "--device_batch_size=2", "--vocab_size=256", "--steps=2", "--warmup=1",
          "--device_type=cpu", "--attn=sdpa"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| device |") and out[2].startswith("| cpu")
    r = json.loads(out[-1])
    assert r["depth"] == 1 and r["attn"] == "sdpa" and r["mfu_pct"] is None and r["tok_per_s"] > 0
    # d1: 64 wide, 1 head; 6 x (matrices + lm_head) + attention term
    assert r["flops_per_token"] == 6 * (12 * 64 * 64 + 256 * 64) + 12 * 1 * 1 * 64 * 32


@pytest.mark.slow
def test_train_bench_batches_do_not_recompile_the_warmed_up_model():
    """The compile warm-up traces contiguous (B, T) tensors; train_bench's synthetic batches must hit that graph. Its
    earlier strided views of a (B, T + 1) tensor recompiled the model at the first step (an H100 FP8 run spent its
    time limit on that second compile)."""
    from torch._dynamo.utils import counters

    from bench.train_bench import synthetic_batches
    from nanochat.compile import maybe_compile
    from nanochat.training import init_model

    cfg = {"vocab_size": 256, "device_batch_size": 2, "max_seq_len": 32, "seed": 0}
    model = init_model(config_for_depth(1, 256, 32), "cpu")
    compiled = maybe_compile(model, True, "cpu", 2, 32, log=lambda *a: None)
    graphs = counters["stats"]["unique_graphs"]
    for x, y in synthetic_batches(cfg, "cpu"):
        compiled(x, y).backward()
    assert counters["stats"]["unique_graphs"] == graphs
    x, y = synthetic_batches(cfg, "cpu")[0]
    b = torch.cat([x, y[:, -1:]], dim=1)  # the old layout: views of one (B, T + 1) tensor
    compiled(b[:, :-1], b[:, 1:]).backward()
    assert counters["stats"]["unique_graphs"] > graphs  # the guard this test relies on still exists


@pytest.mark.slow
def test_step_breakdown_accounts_for_the_step(capsys):
    """bench/step_breakdown.py (the issue-13 roofline): its Newton-Schulz FLOP count by hand, and one tiny run of this
    tree whose parts are positive and whose table row adds them up."""
    from bench.step_breakdown import main, ns_flops

    # 5 iterations of X X^T (2*m*m*n), A A (2*m^3), B X (2*m*m*n), m the smaller side
    assert ns_flops([(4, 8), (8, 4)]) == 2 * 5 * (2 * 16 * 8 + 2 * 64 + 2 * 16 * 8)
    main(["--depth=1", "--max_seq_len=32", "--device_batch_size=2", "--vocab_size=256", "--steps=2", "--warmup=1"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| ours |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    fb, clip, adamw, muon, step = (float(cells[i].split()[0]) for i in (2, 3, 4, 5, 6))
    assert min(fb, clip, adamw, muon) > 0 and abs(fb + clip + adamw + muon - step) <= 2, row


@pytest.mark.dist
@pytest.mark.slow
def test_train_bench_on_two_ranks_takes_the_ddp_and_fsdp_paths(capsys):
    """`torchrun -m bench.train_bench --use_fsdp=0|1` (the DDP-vs-FSDP MFU rows of docs/benchmarks.md): each rank
    trains on the same synthetic batches, so every step's loss equals one process's; one process refuses --use_fsdp=1."""
    import json

    from bench.train_bench import main
    from ranks import run_ranks

    tiny = ["--depth=1", "--max_seq_len=32", "--device_batch_size=2", "--vocab_size=256", "--steps=2", "--warmup=1",
            "--device_type=cpu", "--attn=sdpa", "--compile=0"]
    main(tiny)
    ref = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for use_fsdp, name in ((0, "ddp"), (1, "fsdp")):
        p = run_ranks(["-m", "bench.train_bench", *tiny, f"--use_fsdp={use_fsdp}"])
        r = json.loads(p.stdout.strip().splitlines()[-1])  # rank 0 alone prints
        assert r["parallel"] == f"{name} x2" and p.stdout.count('"parallel"') == 1
        assert abs(r["first_loss"] - ref["first_loss"]) < 1e-5 and abs(r["last_loss"] - ref["last_loss"]) < 1e-4, (r, ref)
    with pytest.raises(SystemExit):
        main([*tiny, "--use_fsdp=1"])
    assert "needs torchrun" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# Dtype policy (see the top of gpt.py)


def upcasting_rms_norm(monkeypatch):
    """Stand-in for torch >= 2.12's CUDA autocast rule for F.rms_norm: the output comes back in fp32."""
    real = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda x, shape, *a, **kw: real(x, shape, *a, **kw).float())


def test_dtype_policy_under_bf16_autocast(monkeypatch):
    from nanochat.engine import KVCache

    upcasting_rms_norm(monkeypatch)
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real_sdpa(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = make_model(n_kv_head=2)
    residual = []
    for block in model.transformer.h:
        block.register_forward_hook(lambda mod, args, out: residual.append((args[0].dtype, out.dtype)))
    idx = torch.randint(0, 97, (2, 12))
    cache = KVCache(batch_size=2, num_heads=2, seq_len=16, head_dim=8, num_layers=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
        logits = model(idx[:, :8], kv_cache=cache)
        model(idx[:, 8:9], kv_cache=cache)
    assert len(seen) == 6 and all(d == (torch.bfloat16,) * 3 for d in seen), seen
    assert residual and all(d == (torch.bfloat16, torch.bfloat16) for d in residual), residual
    assert cache.kv_cache.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and logits.dtype == torch.float32  # softcap and loss in fp32
    assert model.transformer.wte.weight.dtype == torch.float32  # fp32 master weights stay fp32


def test_fp32_forward_untouched_by_the_dtype_policy():
    # no autocast: everything fp32, and the logits are those of the independent reference
    model = make_model()
    idx = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        got = model(idx)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference_logits(model, idx), atol=2e-4, rtol=1e-4)
