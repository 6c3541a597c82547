"""
The GPT model, laid out like nanochat's so its checkpoints load and give the same logits.

Notable features:
- rotary position embeddings (no learned positional embedding)
- QK norm (parameter-free RMSNorm of queries and keys after rotary)
- untied token embedding and lm_head; vocab padded to a multiple of 64 (logits sliced back)
- ReLU^2 MLP, no biases anywhere, parameter-free RMSNorm
- grouped-query attention (n_kv_head <= n_head)
- logit softcap 15*tanh(logits/15), computed in fp32
- attention through nanochat.attention (--attn: SDPA with the GPU's kernel order, FlexAttention, FA3, FA4), KV-cache
  aware for inference
- optional activation checkpointing of all or every k-th block (GPT.set_activation_checkpointing)

Dtype policy (explicit, because autocast alone does not give it):
- Parameters are fp32 for training (master weights for the optimizers; FSDP gathers them in bf16 on CUDA). A model
  loaded for evaluation on CUDA holds bf16 weights (checkpoint_manager.weights_dtype_for).
- The compute dtype is autocast's dtype when autocast is on (bf16 on CUDA), else the embedding's dtype (fp32 on CPU).
- The residual stream is in the compute dtype: the embedding output is cast to it (as nanochat, which casts `wte` to
  bf16 on CUDA; here the activation is cast so the weight stays an fp32 master).
- Attention inputs (q, k, v), and so the engine's KV cache (allocated with k's dtype), are in the compute dtype.
  `norm` returns its input's dtype: on torch >= 2.12 CUDA autocast runs F.rms_norm in fp32 and returns fp32, which
  would otherwise make q/k, the KV cache and the FA3 output fp32 (slower kernels, twice the cache memory).
- The rotary tables are bf16 on CUDA (nanochat's rounding), fp32 elsewhere; rotary returns its input's dtype.
- Logits are cast to fp32 before the softcap; softcap and cross-entropy run in fp32.
Without autocast on fp32 weights everything is fp32 (the CPU default), bit for bit as before.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from nanochat.attention import attention, resolve_attn


AC_MODES = ("none", "full", "selective")  # --activation_checkpointing (GPT.set_activation_checkpointing)


@dataclass
class GPTConfig:
    # Exactly these fields: the dataclass is saved as `model_config` in checkpoint meta json (nanochat's names).
    sequence_len: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 6  # number of query heads
    n_kv_head: int = 6  # number of key/value heads (GQA when < n_head)
    n_embd: int = 768


def config_for_depth(depth, vocab_size, sequence_len):
    """nanochat's depth -> shape rule: width 64*depth, head dim 128 (fewer heads at small widths)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    n_embd = 64 * depth
    n_head = max(1, math.ceil(n_embd / 128))
    if n_embd % n_head != 0:
        ok = [d for d in range(max(1, depth - 3), depth + 4) if (64 * d) % max(1, math.ceil(64 * d / 128)) == 0]
        raise ValueError(
            f"--depth={depth} gives n_embd={n_embd} which does not split into {n_head} heads; "
            f"pick a depth such as {', '.join(map(str, ok))}"
        )
    return GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_head, n_embd=n_embd)


def _validate_config(c):
    if c.vocab_size < 1 or c.sequence_len < 1 or c.n_layer < 1 or c.n_head < 1 or c.n_kv_head < 1 or c.n_embd < 1:
        raise ValueError(f"every GPTConfig field must be >= 1, got {c}")
    if c.n_embd % c.n_head != 0:
        raise ValueError(f"n_embd={c.n_embd} must be divisible by n_head={c.n_head}")
    if (c.n_embd // c.n_head) % 2 != 0:
        raise ValueError(f"head dim n_embd/n_head={c.n_embd // c.n_head} must be even for rotary embeddings")
    if c.n_kv_head > c.n_head or c.n_head % c.n_kv_head != 0:
        raise ValueError(f"n_kv_head={c.n_kv_head} must divide n_head={c.n_head} (and be <= it) for grouped-query attention")


def norm(x):
    # Parameter-free RMSNorm (no learnable gain), as nanochat. Returns x's dtype whatever autocast does (see the top).
    return F.rms_norm(x, (x.size(-1),)).to(x.dtype)


def compute_dtype(x):
    """The dtype activations run in: autocast's when it is on for x's device, else x's own."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def apply_rotary_emb(x, cos, sin):
    # x: (B, T, H, D); cos/sin: (1, T, 1, D/2). The head dim is split in halves (not interleaved pairs).
    return rotate(x, *full_rotary_tables(cos, sin))


def full_rotary_tables(cos, sin):
    """(cos, cos) and (sin, -sin) along the head dim: the tables `rotate` takes, built once per forward."""
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, -sin], dim=-1)


def rotate(x, cos2, sin2):
    # With x = (x1, x2) the rotation is (x1*cos + x2*sin, x1*(-sin) + x2*cos) = x*(cos, cos) + (x2, x1)*(sin, -sin):
    # the same products and sums (so the same bits) in 4 ops instead of 9, which matters in per-token decoding.
    return (x * cos2 + x.roll(x.size(-1) // 2, dims=-1) * sin2).to(x.dtype)


# -----------------------------------------------------------------------------
# Model


HEAD_CHUNK_ELEMENTS = 2**28  # evaluation computes at most this many logits (1 GiB in fp32) at once: head()


def head(x, lm_head_weight, vocab_size, targets=None, loss_reduction="mean"):
    """
    Final norm, lm_head, softcap and (with targets) cross-entropy: logits (B, T, vocab_size) or the loss.
    A plain function of tensors (the lm_head weight is passed in, not read from a module) so that the FSDP path can
    compile it on its own (nanochat.compile): the FSDP hooks around the whole model would otherwise leave it eager.
    """
    B, T, _ = x.shape
    if targets is not None and loss_reduction not in ("mean", "sum", "none"):
        raise ValueError(f"loss_reduction must be 'mean', 'sum' or 'none', got {loss_reduction!r}")
    if (targets is not None and B > 1 and B * T * vocab_size > HEAD_CHUNK_ELEMENTS and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):
        # Evaluation of a large batch, eager: d20's 32 x 2048 rows x 65536 vocab would be 16 GiB of fp32 logits (and
        # as much again for the softcap), so compute the per-token losses a few rows at a time. Training keeps one
        # pass (the backward needs every chunk's activations anyway) and compiled graphs fuse the head themselves.
        rows = max(1, HEAD_CHUNK_ELEMENTS // (T * vocab_size))
        loss = torch.cat([head(xc, lm_head_weight, vocab_size, tc, "none")
                          for xc, tc in zip(x.split(rows), targets.split(rows))])
        if loss_reduction == "none":
            return loss
        total = loss.sum()
        return total if loss_reduction == "sum" else total / (targets != -1).sum()
    logits = F.linear(norm(x), lm_head_weight)
    softcap = 15.0
    logits = logits[..., :vocab_size].float()  # drop the padding columns, softcap in fp32
    logits = softcap * torch.tanh(logits / softcap)
    if targets is None:
        return logits
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=loss_reduction)
    if loss_reduction == "none":
        # per-token losses, 0 where target == -1. A copy, not a view of the flat losses: FSDP2 warns (and would drop
        # its pre-backward hook on an in-place op) when a wrapped module returns a view; B*T floats cost nothing.
        loss = loss.view(B, T).clone()
    return loss


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(self.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd, bias=False)

    def forward(self, x, cos_sin, kv_cache, backend):
        B, T, C = x.size()
        # -1 heads: under tensor parallelism c_q/c_k/c_v return this rank's heads only (nanochat/distributed/tensor_parallel.py)
        q = self.c_q(x).view(B, T, -1, self.head_dim)
        k = self.c_k(x).view(B, T, -1, self.head_dim)
        v = self.c_v(x).view(B, T, -1, self.head_dim)
        q, k = rotate(q, *cos_sin), rotate(k, *cos_sin)  # cos_sin: full_rotary_tables of this forward's positions
        q, k = norm(q), norm(k)  # QK norm, after rotary as nanochat

        # attention takes (B, H, T, D); the cache stores that layout
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = None
        if kv_cache is not None:
            k, v = kv_cache.insert_kv(self.layer_idx, k, v)
            mask = getattr(kv_cache, "attn_mask", None)  # the engine's fixed-shape decode step: valid cache positions
        attend = getattr(kv_cache, "attend", None)  # a cache that attends over its own layout (the serving scheduler's)
        if attend is not None:
            y = attend(self.layer_idx, q, k, v)
        else:
            y = attention(q, k, v, backend, mask)  # backend: the model's resolved nanochat.attention.Attn
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.checkpointed = False  # activation checkpointing, set by GPT.set_activation_checkpointing

    def forward(self, x, cos_sin, kv_cache, backend):
        # Checkpointed: keep only the block's input, recompute its activations in the backward. The checkpoint sits
        # inside forward (not around the module call) so FSDP's hooks stay outside it and the per-block compile of
        # nanochat.compile traces it; only when gradients are on (evaluation and sampling have nothing to save).
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos_sin, kv_cache, backend, use_reentrant=False)
        return self._forward(x, cos_sin, kv_cache, backend)

    def _forward(self, x, cos_sin, kv_cache, backend):
        x = x + self.attn(norm(x), cos_sin, kv_cache, backend)
        x = x + self.mlp(norm(x))
        return x


class GPT(nn.Module):
    def __init__(self, config, attn="auto"):
        """Builds the modules only (no data-dependent ops), so it works under `with torch.device("meta")`.
        Call init_weights() afterwards (after to_empty() when built on meta), or load a state dict with assign=True
        and call init_buffers()."""
        super().__init__()
        _validate_config(config)
        self.config = config
        self.attn = attn  # as asked (--attn); attn_choice is what runs on this device
        # Resolved again in init_buffers() once the real device is known (the model is often built on meta).
        default_type = torch.get_default_device().type
        self.attn_choice = resolve_attn(attn, "cuda" if default_type in ("cuda", "meta") and torch.cuda.is_available() else default_type)
        # Pad the vocab to a multiple of 64 for efficient matmuls; the extra rows are never targets.
        self.padded_vocab_size = ((config.vocab_size + 63) // 64) * 64
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(self.padded_vocab_size, config.n_embd),
                "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, self.padded_vocab_size, bias=False)
        self.head = head  # nanochat.compile replaces it by a compiled copy on the FSDP path
        # Rotary table for 10x the training length so generation can run past sequence_len.
        self.rotary_seq_len = config.sequence_len * 10
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, config.n_embd // config.n_head)
        # Non-persistent: derived data, not part of the checkpoint (nanochat's state dict has no rotary keys).
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _precompute_rotary_embeddings(self, seq_len, head_dim, base=10000, device=None):
        if device is None:
            device = self.transformer.wte.weight.device
        channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (base ** (channel_range / head_dim))
        t = torch.arange(seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if device.type == "cuda":
            # bf16 tables on CUDA, as nanochat (its logits depend on this rounding)
            cos, sin = cos.bfloat16(), sin.bfloat16()
        return cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, D/2) broadcasts over (B, T, H, D/2)

    @torch.no_grad()
    def init_weights(self, scheme="normal"):
        """Initialise every parameter in place and recompute the rotary tables on the model's device.
        'normal': arXiv 2310.17813 (N(0, 1/sqrt(fan_in) * min(1, sqrt(fan_out/fan_in)))), lm_head and c_proj zero.
        'nanochat': uniform +-sqrt(3)/sqrt(n_embd) for q/k/v/c_fc, c_proj zero, lm_head N(0, 0.001)."""
        if scheme not in ("normal", "nanochat"):
            raise ValueError(f"init scheme must be 'normal' or 'nanochat', got {scheme!r}")
        torch.nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        zero = [self.lm_head.weight] if scheme == "normal" else []
        for block in self.transformer.h:
            zero += [block.attn.c_proj.weight, block.mlp.c_proj.weight]
        for w in zero:
            torch.nn.init.zeros_(w)
        if scheme == "nanochat":
            torch.nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                if scheme == "normal":
                    fan_out, fan_in = lin.weight.shape
                    std = 1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))
                    torch.nn.init.normal_(lin.weight, mean=0.0, std=std)
                else:
                    s = math.sqrt(3) / math.sqrt(self.config.n_embd)
                    torch.nn.init.uniform_(lin.weight, -s, s)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self):
        """Recompute what is not in the checkpoint (the rotary tables) on the model's device and resolve the attention
        backend for it. init_weights() calls it; a model loaded from a checkpoint onto meta calls only this."""
        device = self.get_device()
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, self.config.n_embd // self.config.n_head, device=device)
        self.cos, self.sin = cos, sin
        self.attn_choice = resolve_attn(self.attn, device)  # raises with the fix when the asked kernel cannot run here

    def set_attn(self, attn):
        """Use another attention kernel (--attn of the scripts that load a checkpoint); refused like at build time."""
        self.attn_choice = resolve_attn(attn, self.get_device())
        self.attn = attn
        return self.attn_choice

    @property
    def attn_backend(self):
        """The attention kernel's name (nanochat.attention: 'sdpa', 'flex', 'fa3', ...); attn_choice has the rest."""
        return self.attn_choice.name

    def get_device(self):
        return self.transformer.wte.weight.device

    def set_activation_checkpointing(self, mode="none", every=2):
        """
        --activation_checkpointing: 'none' keeps every block's activations for the backward; 'full' keeps only each
        block's input and recomputes the rest in the backward (about one more forward: ~+33% compute for the least
        activation memory); 'selective' does that for every `every`-th block (blocks 0, every, 2*every, ...), so
        about 1/every of the activation memory is traded for 1/every of the recompute. Works the same on every
        parallelism path and under torch.compile (the checkpoint is inside Block.forward). Returns the indices of
        the checkpointed blocks.
        """
        if mode not in AC_MODES:
            raise ValueError(f"--activation_checkpointing must be one of {'|'.join(AC_MODES)}, got {mode!r}")
        if mode == "selective" and (not isinstance(every, int) or every < 1):
            raise ValueError(f"--ac_every must be a whole number >= 1 for --activation_checkpointing=selective, got {every!r}")
        step = {"none": None, "full": 1, "selective": every}[mode]
        chosen = []
        for i, block in enumerate(self.transformer.h):
            block.checkpointed = step is not None and i % step == 0
            if block.checkpointed:
                chosen.append(i)
        return chosen

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self):
        """FLOPs per token for forward+backward: 6 per matmul weight (embedding lookup excluded) plus attention."""
        nparams = self.num_params()
        nparams_embedding = self.transformer.wte.weight.numel()
        l, h, q, t = self.config.n_layer, self.config.n_head, self.config.n_embd // self.config.n_head, self.config.sequence_len
        return 6 * (nparams - nparams_embedding) + 12 * l * h * q * t

    def setup_optimizers(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0, use_muon=True):
        """AdamW for lm_head and wte (LR scaled by (n_embd/768)^-0.5), Muon for the 2-D block matrices
        (or AdamW for them too with use_muon=False). Returns a list of optimizers; every group has 'initial_lr'."""
        model_dim = self.config.n_embd
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        matrix_params = list(self.transformer.h.parameters())
        embedding_params = list(self.transformer.wte.parameters())
        lm_head_params = list(self.lm_head.parameters())
        assert len(list(self.parameters())) == len(matrix_params) + len(embedding_params) + len(lm_head_params)
        for p in matrix_params:
            if p.dim() != 2:
                raise ValueError(f"block parameter of shape {tuple(p.shape)} is not a matrix; Muon only takes 2-D parameters")
        # AdamW's optimal LR shrinks with width; 768 is the width these LRs were tuned at.
        dmodel_lr_scale = (model_dim / 768) ** -0.5
        adam_groups = [
            dict(params=lm_head_params, lr=unembedding_lr * dmodel_lr_scale, weight_decay=weight_decay),
            dict(params=embedding_params, lr=embedding_lr * dmodel_lr_scale, weight_decay=0.0),
        ]
        if not use_muon:
            adam_groups.append(dict(params=matrix_params, lr=matrix_lr * dmodel_lr_scale, weight_decay=weight_decay))
        adamw_kwargs = dict(lr=adam_groups[0]["lr"], betas=(0.8, 0.95), eps=1e-10, weight_decay=weight_decay)
        if distributed:
            from nanochat.adamw import DistAdamW

            adamw = DistAdamW(adam_groups, **adamw_kwargs)
        else:
            # torch's fused kernel (one pass over each tensor) on CUDA. Not on CPU: there it rounds differently from
            # DistAdamW's update (which is torch's single-tensor math bit for bit), and an AdamW-only run (eps 1e-10)
            # amplifies that last-bit difference to ~1e-2 in a few steps, so 1 process would no longer equal N ranks;
            # the fused kernel saves under 1% of a CPU training step.
            fused = self.get_device().type == "cuda"
            adamw = torch.optim.AdamW(adam_groups, fused=fused, **adamw_kwargs)
        optimizers = [adamw]
        if use_muon:
            from nanochat.muon import DistMuon, Muon  # imported here: muon.py is optional for AdamW-only use

            MuonFactory = DistMuon if distributed else Muon
            optimizers.append(MuonFactory(matrix_params, lr=matrix_lr, momentum=0.95))
        for opt in optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
        return optimizers

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        T = idx.size(1)
        # the engine's fixed-shape decode step: a device tensor, (1,) or one position per row (B, 1) for the serving
        # scheduler's batch of sequences at different lengths (nanochat/serving/kv_slots.py)
        positions = getattr(kv_cache, "positions", None)
        pos = kv_cache.get_pos() if kv_cache is not None and positions is None else 0
        if pos + T > self.cos.size(1):
            raise ValueError(
                f"sequence of {pos + T} tokens exceeds the rotary table ({self.cos.size(1)} = 10 x sequence_len); "
                "build the model with a larger sequence_len"
            )
        if self.cos.device != idx.device:
            raise RuntimeError(f"rotary tables are on {self.cos.device} but the input is on {idx.device}; call init_weights() after moving the model")
        backend = self.attn_choice
        if positions is None:
            cos_sin = full_rotary_tables(self.cos[:, pos : pos + T], self.sin[:, pos : pos + T])
        else:  # read from the tensor, so a compiled/graphed step does not change (and recompile) with every position
            cos_sin = full_rotary_tables(self.cos[0, positions], self.sin[0, positions])

        x = self.transformer.wte(idx)
        x = norm(x.to(compute_dtype(x)))  # the residual stream runs in the compute dtype (see the top)
        for block in self.transformer.h:
            x = block(x, cos_sin, kv_cache, backend)
        if targets is None and getattr(kv_cache, "last_only", False):  # a serving prefill reads the next token's logits only
            x = x[:, -1:]
        return self.head(x, self.lm_head.weight, self.config.vocab_size, targets, loss_reduction)

    @torch.inference_mode()
    def generate(self, tokens, max_tokens, temperature=1.0, top_k=None, seed=42):
        """Naive autoregressive sampling (whole context re-run each step, no KV cache). Yields token ids.
        temperature 0 = greedy."""
        if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, int) for t in tokens) or not tokens:
            raise ValueError("generate() takes a non-empty list of int token ids")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        device = self.get_device()
        rng = None
        if temperature > 0:
            rng = torch.Generator(device=device)
            rng.manual_seed(seed)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
        for _ in range(max_tokens):
            ctx = ids[:, -self.rotary_seq_len :]  # the model cannot see further back than its rotary table
            logits = self(ctx)[:, -1, :]  # via __call__, not .forward: FSDP2 gathers sharded weights in its hooks
            if top_k is not None and top_k > 0:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            if temperature > 0:
                probs = F.softmax(logits / temperature, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=rng)
            else:
                next_id = torch.argmax(logits, dim=-1, keepdim=True)
            ids = torch.cat((ids, next_id), dim=1)
            yield next_id.item()
