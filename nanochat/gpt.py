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
The record recipe's model (nanochat 92d63d4's: sliding windows, value embeddings, smear, backout, per-layer scalars)
is RecordGPT at the end of this file; config_from_dict tells from a checkpoint's model_config which of the two it is.

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
from nanochat.usage import BadValue


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
        raise BadValue(f"--depth must be >= 1, got {depth}")
    n_embd = 64 * depth
    n_head = max(1, math.ceil(n_embd / 128))
    if n_embd % n_head != 0:
        ok = [d for d in range(max(1, depth - 3), depth + 4) if (64 * d) % max(1, math.ceil(64 * d / 128)) == 0]
        raise BadValue(
            f"--depth={depth} gives n_embd={n_embd} which does not split into {n_head} heads; "
            f"pick a depth such as {', '.join(map(str, ok))}"
        )
    return GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_head, n_embd=n_embd)


def check_config(c):
    """A usage error (BadValue) for a shape GPT cannot build: checked before anything is built (a config from --depth,
    a checkpoint's meta, an imported config.json) and again by GPT itself."""
    if c.vocab_size < 1 or c.sequence_len < 1 or c.n_layer < 1 or c.n_head < 1 or c.n_kv_head < 1 or c.n_embd < 1:
        raise BadValue(f"every GPTConfig field must be >= 1, got {c}")
    if c.n_embd % c.n_head != 0:
        raise BadValue(f"n_embd={c.n_embd} must be divisible by n_head={c.n_head}")
    if (c.n_embd // c.n_head) % 2 != 0:
        raise BadValue(f"head dim n_embd/n_head={c.n_embd // c.n_head} must be even for rotary embeddings")
    if c.n_kv_head > c.n_head or c.n_head % c.n_kv_head != 0:
        raise BadValue(f"n_kv_head={c.n_kv_head} must divide n_head={c.n_head} (and be <= it) for grouped-query attention")


def rotary_positions(config):
    """Positions the rotary table covers: 10x the training length, so generation can run past sequence_len."""
    return config.sequence_len * 10


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
    attention_class = CausalSelfAttention  # the record model's block swaps in its own (RecordBlock)

    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = self.attention_class(config, layer_idx)
        self.mlp = MLP(config)
        self.checkpointed = False  # activation checkpointing, set by GPT.set_activation_checkpointing

    def forward(self, x, *args):
        # args: what _forward takes after x (this block's: cos_sin, kv_cache, backend).
        # Checkpointed: keep only the block's input, recompute its activations in the backward. The checkpoint sits
        # inside forward (not around the module call) so FSDP's hooks stay outside it and the per-block compile of
        # nanochat.compile traces it; only when gradients are on (evaluation and sampling have nothing to save).
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._forward, x, *args, use_reentrant=False)
        return self._forward(x, *args)

    def _forward(self, x, cos_sin, kv_cache, backend):
        x = x + self.attn(norm(x), cos_sin, kv_cache, backend)
        x = x + self.mlp(norm(x))
        return x


class GPT(nn.Module):
    block_class = Block  # what the blocks are, and the rotary base: the record model (RecordGPT) changes both
    rope_base = 10000
    # A token's arithmetic outside its matmuls and attention is elementwise or per token (norms, rotary, relu^2, the
    # softcap's tanh) and gives the same bits wherever the token sits in a sequence: so serving may pack several
    # prompts into one prefill forward and keep each prompt's bits where the BLAS does too (serving/invariance.py)
    packed_prefill_invariant = True

    def __init__(self, config, attn="auto"):
        """Builds the modules only (no data-dependent ops), so it works under `with torch.device("meta")`.
        Call init_weights() afterwards (after to_empty() when built on meta), or load a state dict with assign=True
        and call init_buffers()."""
        super().__init__()
        check_config(config)
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
                "h": nn.ModuleList([self.block_class(config, i) for i in range(config.n_layer)]),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, self.padded_vocab_size, bias=False)
        self.head = head  # nanochat.compile replaces it by a compiled copy on the FSDP path
        self.rotary_seq_len = rotary_positions(config)
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, config.n_embd // config.n_head)
        # Non-persistent: derived data, not part of the checkpoint (nanochat's state dict has no rotary keys).
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _precompute_rotary_embeddings(self, seq_len, head_dim, base=None, device=None):
        base = self.rope_base if base is None else base
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
        muon = (matrix_params, dict(lr=matrix_lr, momentum=0.95)) if use_muon else None
        return self.build_optimizers(adam_groups, adamw_kwargs, muon)

    def build_optimizers(self, adam_groups, adamw_kwargs, muon=None):
        """[AdamW over adam_groups (defaults adamw_kwargs), Muon over muon = (params or groups, defaults) when given]:
        torch's AdamW and Muon in one process, DistAdamW and DistMuon under torchrun. Every group gets 'initial_lr'."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            from nanochat.adamw import DistAdamW

            adamw = DistAdamW(adam_groups, **adamw_kwargs)
        else:
            # torch's fused kernel (one pass over each tensor) on CUDA. Not on CPU: there it rounds differently from
            # DistAdamW's update (which is torch's single-tensor math bit for bit), and an AdamW-only run (eps 1e-10)
            # amplifies that last-bit difference to ~1e-2 in a few steps, so 1 process would no longer equal N ranks;
            # the fused kernel saves under 1% of a CPU training step.
            fused = self.get_device().type == "cuda"
            if any(g.get("math") == "record" for g in adam_groups):  # 92d63d4's arithmetic (nanochat/adamw.py)
                from nanochat.adamw import AdamW

                adamw = AdamW(adam_groups, **adamw_kwargs)
            else:
                adamw = torch.optim.AdamW(adam_groups, fused=fused, **adamw_kwargs)
        optimizers = [adamw]
        if muon is not None:
            from nanochat.muon import DistMuon, Muon  # imported here: muon.py is optional for AdamW-only use

            MuonFactory = DistMuon if distributed else Muon
            optimizers.append(MuonFactory(muon[0], **muon[1]))
        for opt in optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
        return optimizers

    def rotary_tables(self, idx, kv_cache):
        """full_rotary_tables for the positions of idx: after what kv_cache holds (0 without one)."""
        T = idx.size(1)
        # the engine's fixed-shape decode step: a device tensor, (1,) or one position per row (B, 1) for the serving
        # scheduler's batch of sequences at different lengths (nanochat/serving/kv_slots.py)
        positions = getattr(kv_cache, "positions", None)
        pos = kv_cache.get_pos() if kv_cache is not None and positions is None else 0
        # (positions: each below the cache's slot length, which plan_kv keeps within the table; a packed prefill's T is
        # several prompts' chunks, longer than the table for a small sequence_len, yet no position in it is)
        if positions is None and pos + T > self.cos.size(1):
            raise ValueError(
                f"sequence of {pos + T} tokens exceeds the rotary table ({self.cos.size(1)} = 10 x sequence_len); "
                "build the model with a larger sequence_len"
            )
        if self.cos.device != idx.device:
            raise RuntimeError(f"rotary tables are on {self.cos.device} but the input is on {idx.device}; call init_weights() after moving the model")
        if positions is None:
            return full_rotary_tables(self.cos[:, pos : pos + T], self.sin[:, pos : pos + T])
        # read from the tensor, so a compiled/graphed step does not change (and recompile) with every position
        return full_rotary_tables(self.cos[0, positions], self.sin[0, positions])

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        cos_sin = self.rotary_tables(idx, kv_cache)
        backend = self.attn_choice
        x = self.transformer.wte(idx)
        x = norm(x.to(compute_dtype(x)))  # the residual stream runs in the compute dtype (see the top)
        for block in self.transformer.h:
            x = block(x, cos_sin, kv_cache, backend)
        if targets is None and hasattr(kv_cache, "last"):  # a serving prefill reads the next token's logits only
            x = kv_cache.last(x)
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

    @torch.inference_mode()
    def generate_greedy(self, prompts, max_tokens):
        """Greedy continuations of several prompts at once (the training loop's sample prints): one forward per new
        token for all of them, where `generate` takes one per prompt and token -- under FSDP/TP each forward is a
        round of collectives on every rank. The rows are right-padded; attention is causal, so the logits at a row's
        own last position never see the padding to its right, and each row gets what `generate(..., temperature=0)`
        gives it alone (up to the float rounding of a batched matmul). Returns a list of token lists."""
        if not prompts or not all(isinstance(p, (list, tuple)) and p and all(isinstance(t, int) for t in p)
                                  for p in prompts):
            raise ValueError("generate_greedy() takes a non-empty list of non-empty lists of int token ids")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"generate_greedy(): max_tokens must be an int >= 1, got {max_tokens!r}")
        lengths = [len(p) for p in prompts]
        if max(lengths) + max_tokens - 1 > self.rotary_seq_len:  # `generate` slides its window instead
            raise ValueError(f"generate_greedy(): a prompt of {max(lengths)} tokens + {max_tokens} new ones exceeds "
                             f"the model's {self.rotary_seq_len} positions; use generate()")
        device = self.get_device()
        ids = torch.zeros(len(prompts), max(lengths) + max_tokens, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        rows = torch.arange(len(prompts), device=device)
        ends = torch.tensor(lengths, device=device)  # each row's length so far: its next token goes there
        new = []
        for _ in range(max_tokens):
            # the same width every step: a new shape each token misses DTensor's sharding cache under TP/FSDP (~0.2 s
            # a linear on CPU) and would recompile a compiled model
            logits = self(ids[:, :-1])
            next_ids = logits[rows, ends - 1].argmax(dim=-1)
            ids[rows, ends] = next_ids
            ends += 1
            new.append(next_ids)
        return torch.stack(new, dim=1).tolist()


# -----------------------------------------------------------------------------
# The record model: nanochat 92d63d4's GPT (the time-to-GPT-2 record recipe, --recipe=record)
#
# The December model above with, as 92d63d4 has them (its parameter names, so its checkpoints load by name):
# - sliding-window attention: a pattern of S (short: a quarter of the context, rounded up to FlashAttention's tile of
#   128) and L (the whole context) tiled over the layers, the last layer always L (window_sizes)
# - value embeddings (ResFormer): on alternating layers, the last one always included (has_ve), a per-token embedding
#   of the kv width added to v through a per-head gate 3 * sigmoid(ve_gate(x[:12]))
# - smear: each token's embedding gets the previous token's, through a gate smear_lambda * sigmoid(smear_gate(x[:24]))
# - backout: the residual stream of the middle layer, times backout_lambda, is subtracted before the final norm
# - per-layer scalars: x = resid_lambdas[i] * x + x0_lambdas[i] * x0 before each block (x0: the smeared embedding)
# - QK norm times 1.2, rotary base 100,000, its own init (RecordGPT.init_weights), its optimizer groups
# Its model_config is GPTConfig's plus window_pattern (RecordConfig): what 92d63d4 writes, and how a checkpoint says
# which model it holds (config_from_dict).


@dataclass
class RecordConfig(GPTConfig):
    # nanochat 92d63d4's GPTConfig: these fields exactly (its checkpoints' model_config, and ours load there)
    window_pattern: str = "SSSL"  # tiled over the layers; S = short window, L = the whole context; last layer L


QK_SCALE = 1.2  # queries and keys after QK norm: sharper attention than unit vectors give
VE_GATE_CHANNELS = 12  # the value-embedding gate reads this many channels of the block input
SMEAR_CHANNELS = 24  # the smear gate reads this many channels of the embedding
WINDOW_TILE = 128  # short windows are rounded up to FlashAttention's tile
GATE_VECTOR = 64  # gate_sigmoid's row width: a multiple of every CPU vector loop's step (AVX-512: 2 x 16 floats)


def gate_sigmoid(z, kv_cache):
    """torch.sigmoid of a gate's logits z (..., k). Training (no kv_cache) and GPUs: as it is. Inference on CPU: each
    row padded to GATE_VECTOR values, so every value goes through torch's vectorized sigmoid. The CPU kernel computes
    a tensor's values in vectors of 32 and the rest (the tail) by a scalar path whose bits differ, so a token's gate
    depended on how many rows shared its forward (a decode step of 34+ rows, a packed prefill): with whole vectors
    per row a token's gate is the same alone, in a batch of any size and anywhere in a pack (the serving scheduler's
    batch invariance, serving/invariance.py)."""
    if kv_cache is None or z.device.type != "cpu":
        return torch.sigmoid(z)
    k = z.size(-1)
    return torch.sigmoid(F.pad(z, (0, -k % GATE_VECTOR)))[..., :k]


def config_from_dict(cfg):
    """The config a checkpoint's model_config describes: RecordConfig when it has a window_pattern (what nanochat
    92d63d4 writes), else GPTConfig (the December model). The one place that tells the two apart; model_class then
    says which model class builds it."""
    return (RecordConfig if "window_pattern" in cfg else GPTConfig)(**cfg)


def model_class(config):
    return RecordGPT if isinstance(config, RecordConfig) else GPT


def make_model(config, attn="auto"):
    """GPT or RecordGPT for `config` (modules only: see GPT.__init__ for the meta device and init)."""
    return model_class(config)(config, attn=attn)


def record_config_for_depth(depth, vocab_size, sequence_len, aspect_ratio=64, head_dim=128, window_pattern="SSSL"):
    """92d63d4's depth -> shape rule: width depth * aspect_ratio rounded up to a multiple of head_dim, so every head
    is exactly head_dim wide (n_head = width / head_dim)."""
    if depth < 1 or aspect_ratio < 1:
        raise ValueError(f"--depth and --aspect_ratio must be >= 1, got {depth} and {aspect_ratio}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"--head_dim must be an even number >= 2 (rotary embeddings rotate pairs), got {head_dim}")
    n_embd = -(-depth * aspect_ratio // head_dim) * head_dim
    n_head = n_embd // head_dim
    config = RecordConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                          n_kv_head=n_head, n_embd=n_embd, window_pattern=window_pattern)
    window_sizes(config)  # a bad pattern stops here
    return config


def window_sizes(config):
    """The left window of each layer (FlashAttention's convention: a query attends itself and the `window` keys before
    it). L layers get sequence_len, so they see the whole training context and slide only past it in generation."""
    pattern = str(config.window_pattern).upper()
    if not pattern or set(pattern) - set("SL"):
        raise ValueError(f"window_pattern must be a non-empty string of S (short window) and L (whole context), "
                         f"e.g. SSSL or L, got {config.window_pattern!r}")
    long = config.sequence_len
    short = -(-long // 4 // WINDOW_TILE) * WINDOW_TILE  # a quarter of the context, rounded up to the tile (as 92d63d4)
    windows = [long if pattern[i % len(pattern)] == "L" else short for i in range(config.n_layer)]
    windows[-1] = long
    return windows


def has_ve(layer_idx, n_layer):
    """Whether a layer has a value embedding: every other layer, the last one always."""
    return layer_idx % 2 == (n_layer - 1) % 2


class RecordAttention(CausalSelfAttention):
    """Attention with a sliding window, a gated value embedding (ve_gate on the layers has_ve picks) and QK norm x 1.2."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False) if has_ve(layer_idx, config.n_layer) else None

    def forward(self, x, ve, cos_sin, window, kv_cache, backend):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, -1, self.head_dim)  # -1 heads: this rank's under tensor parallelism
        k = self.c_k(x).view(B, T, -1, self.head_dim)
        v = self.c_v(x).view(B, T, -1, self.head_dim)
        if ve is not None:  # value residual: the token's value embedding, through a gate per kv head in (0, 3)
            gate = 3 * gate_sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]), kv_cache)
            v = v + gate.unsqueeze(-1) * ve.view(B, T, -1, self.head_dim)
        q, k = rotate(q, *cos_sin), rotate(k, *cos_sin)
        q, k = norm(q) * QK_SCALE, norm(k) * QK_SCALE
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = attend = None
        if kv_cache is not None:
            k, v = kv_cache.insert_kv(self.layer_idx, k, v)
            attend = getattr(kv_cache, "attend", None)  # a cache with its own layout (the serving scheduler's)
            if attend is None and getattr(kv_cache, "positions", None) is not None:  # fixed-shape decode
                mask = kv_cache.attn_mask_for(window)  # filled slots in the window
        y = attention(q, k, v, backend, mask, window) if attend is None else attend(self.layer_idx, q, k, v, window)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class RecordBlock(Block):
    attention_class = RecordAttention

    def _forward(self, x, ve, cos_sin, window, kv_cache, backend):
        x = x + self.attn(norm(x), ve, cos_sin, window, kv_cache, backend)
        x = x + self.mlp(norm(x))
        return x


class RecordGPT(GPT):
    """nanochat 92d63d4's model (see the section above); built, loaded and prepared like GPT."""

    # its gates' sigmoid would make a token's bits depend on where it falls in a pack; gate_sigmoid keeps them whole
    packed_prefill_invariant = True

    block_class = RecordBlock
    rope_base = 100000

    def __init__(self, config, attn="auto"):
        super().__init__(config, attn)
        self.windows = window_sizes(config)
        n, kv_dim = config.n_layer, config.n_kv_head * (config.n_embd // config.n_head)
        # placeholder values (the model is often built on meta): init_weights sets them
        self.resid_lambdas = nn.Parameter(torch.ones(n))
        self.x0_lambdas = nn.Parameter(torch.zeros(n))
        self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(0.2 * torch.ones(1))
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(self.padded_vocab_size, kv_dim) for i in range(n) if has_ve(i, n)})

    @torch.no_grad()
    def init_weights(self, scheme="record"):
        """92d63d4's init, drawing from the generator in its order (the same seed gives the same weights there):
        wte N(0, 0.8), lm_head N(0, 0.001); per block q/k/v uniform +-s (s = sqrt(3/n_embd): std 1/sqrt(n_embd)),
        c_fc +-0.4s, both projections zero; resid_lambdas 1.15 -> 1.05 and x0_lambdas 0.20 -> 0.05 from the first layer
        to the last; smear 0, backout 0.2, smear gate U(0, 0.02); value embeddings +-s; value gates U(0, 0.02)."""
        if scheme != "record":
            raise ValueError(f"the record model has one init (92d63d4's), not {scheme!r}")
        s = 3**0.5 * self.config.n_embd**-0.5
        torch.nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=0.8)
        torch.nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for block in self.transformer.h:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                torch.nn.init.uniform_(lin.weight, -s, s)
            torch.nn.init.zeros_(block.attn.c_proj.weight)
            torch.nn.init.uniform_(block.mlp.c_fc.weight, -s * 0.4, s * 0.4)
            torch.nn.init.zeros_(block.mlp.c_proj.weight)
        n = self.config.n_layer
        for i in range(n):
            self.resid_lambdas[i] = 1.15 - (0.10 * i / max(n - 1, 1))
            self.x0_lambdas[i] = 0.20 - (0.15 * i / max(n - 1, 1))
        torch.nn.init.zeros_(self.smear_lambda)
        torch.nn.init.constant_(self.backout_lambda, 0.2)
        torch.nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        for ve in self.value_embeds.values():
            torch.nn.init.uniform_(ve.weight, -s, s)
        for block in self.transformer.h:
            if block.attn.ve_gate is not None:
                torch.nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)
        self.init_buffers()

    def matmul_params(self):
        """Parameters that multiply the token stream (every Linear: blocks, gates, lm_head), 2 FLOPs each forward;
        the embeddings are lookups and the scalars elementwise."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    def estimate_flops(self):
        """FLOPs per token for forward+backward (92d63d4's count): 6 per matmul parameter, plus attention over the
        tokens each layer's window lets it see."""
        h, q, t = self.config.n_head, self.config.n_embd // self.config.n_head, self.config.sequence_len
        return 6 * self.matmul_params() + sum(12 * h * q * min(w, t) for w in self.windows)

    def scaling_params(self):
        """The parameter count the record recipe's horizon and batch size scale with: block matrices and lm_head
        (92d63d4's choice, dev/LOG.md there: the cleanest scaling laws)."""
        return sum(p.numel() for p in self.transformer.h.parameters()) + self.lm_head.weight.numel()

    def optimizer_groups(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0, scalar_lr=0.5):
        """
        92d63d4's parameter groups, every hyperparameter explicit (`kind` says which optimizer takes the group):
        AdamW (eps 1e-10, in 92d63d4's arithmetic: math="record", nanochat/adamw.py) for lm_head (betas 0.8/0.96,
        decay 0.01), wte (0.8/0.995, 0.001), the value embeddings (half the embedding lr, 0.8/0.995, 0.01),
        resid_lambdas (scalar_lr / 100, 0.8/0.95, 0.05), x0_lambdas (scalar_lr, 0.96/0.95, none), smear/backout (0.2,
        0.8/0.95, none); the lm_head and embedding lrs scaled by (n_embd/768)^-0.5. Muon for the block matrices (lr
        matrix_lr, momentum 0.95, weight_decay the cautious decay the training loop schedules) with the record options of nanochat/muon.py: Polar Express, MuonEq, Muon+,
        NorMuon (beta2 0.9).
        """
        scale = (self.config.n_embd / 768) ** -0.5
        adamw = dict(kind="adamw", eps=1e-10, math="record")  # its fused AdamW's float32 arithmetic (nanochat/adamw.py)
        groups = [
            dict(adamw, params=[self.lm_head.weight], lr=unembedding_lr * scale, betas=(0.8, 0.96), weight_decay=0.01),
            dict(adamw, params=[self.transformer.wte.weight], lr=embedding_lr * scale, betas=(0.8, 0.995), weight_decay=0.001),
            dict(adamw, params=list(self.value_embeds.parameters()), lr=embedding_lr * scale * 0.5, betas=(0.8, 0.995),
                 weight_decay=0.01),
            dict(adamw, params=[self.resid_lambdas], lr=scalar_lr * 0.01, betas=(0.8, 0.95), weight_decay=0.05),
            dict(adamw, params=[self.x0_lambdas], lr=scalar_lr, betas=(0.96, 0.95), weight_decay=0.0),
            dict(adamw, params=[self.smear_gate.weight, self.smear_lambda, self.backout_lambda], lr=0.2,
                 betas=(0.8, 0.95), weight_decay=0.0),
            dict(RECORD_MUON_GROUP, params=list(self.transformer.h.parameters()), lr=matrix_lr,
                 weight_decay=weight_decay),
        ]
        grouped = [p for g in groups for p in g["params"]]
        if len(grouped) != len(list(self.parameters())) or len(set(map(id, grouped))) != len(grouped):
            raise RuntimeError("the record model's optimizer groups do not hold every parameter exactly once")
        return groups

    def setup_optimizers(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0, scalar_lr=0.5,
                         use_muon=True):
        """[AdamW, Muon] over optimizer_groups (DistAdamW/DistMuon under torchrun); every group has 'initial_lr'."""
        if not use_muon:
            raise ValueError("the record recipe trains its block matrices with Muon: --use_muon=0 is December's option")
        groups = self.optimizer_groups(unembedding_lr, embedding_lr, matrix_lr, weight_decay, scalar_lr)
        adam_groups = [g for g in groups if g["kind"] == "adamw"]
        muon_groups = [g for g in groups if g["kind"] == "muon"]
        first = adam_groups[0]
        adamw_kwargs = dict(lr=first["lr"], betas=first["betas"], eps=first["eps"], weight_decay=first["weight_decay"])
        return self.build_optimizers(adam_groups, adamw_kwargs, (muon_groups, {}))

    def smear(self, x, kv_cache):
        """x[t] += smear_lambda * sigmoid(smear_gate(x[t][:24])) * x[t-1]: the previous token's embedding mixed in.
        With a KV cache the previous token of the first position is the last one of the cache's previous forward; a
        cache that knows each row's previous token id (`prev_ids`, -1 for none: the serving scheduler's) gets its
        embedding recomputed instead, so it keeps no embeddings of its own (a prefix-cache hit, a moved row)."""
        lam = self.smear_lambda.to(x.dtype)
        starts = getattr(kv_cache, "starts", None)
        if starts is not None:  # several prompts' chunks packed in one sequence (a serving prefill): a chunk's first
            # token takes its own previous token (prev_ids, one per chunk), not the last of the chunk before it
            prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
            prev[:, starts] = self.embed_prev(kv_cache.prev_ids, x.dtype)
            return x + lam * gate_sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]), kv_cache) * prev
        if kv_cache is not None and hasattr(kv_cache, "prev_ids"):
            prev = None if kv_cache.prev_ids is None else self.embed_prev(kv_cache.prev_ids, x.dtype)
        else:
            prev = None if kv_cache is None else kv_cache.exchange_prev_embedding(x[:, -1:])
        if x.size(1) > 1:
            gate = lam * gate_sigmoid(self.smear_gate(x[:, 1:, :SMEAR_CHANNELS]), kv_cache)
            first = x[:, :1]
            if prev is not None:  # a chunk after a cached prefix
                first = first + lam * gate_sigmoid(self.smear_gate(first[..., :SMEAR_CHANNELS]), kv_cache) * prev
            return torch.cat([first, x[:, 1:] + gate * x[:, :-1]], dim=1)
        if prev is None:  # the first token of a sequence has no previous one
            return x
        gate = lam * gate_sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]), kv_cache)
        return x + gate * prev

    def embed_prev(self, prev_ids, dtype):
        """(B, 1) previous token ids (a packed prefill's: (1, chunks)) -> their embeddings as forward computes them,
        zeros where the id is -1 (no previous token: adding zeros leaves the smeared token as it is, exactly)."""
        x = norm(self.transformer.wte(prev_ids.clamp(min=0)).to(dtype))
        return x * (prev_ids >= 0).unsqueeze(-1).to(dtype)

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        cos_sin = self.rotary_tables(idx, kv_cache)
        backend = self.attn_choice
        x = self.transformer.wte(idx)
        x = norm(x.to(compute_dtype(x)))
        x = self.smear(x, kv_cache)
        x0 = x
        backout_layer, x_backout = self.config.n_layer // 2, None
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx).to(x.dtype) if str(i) in self.value_embeds else None
            x = block(x, ve, cos_sin, self.windows[i], kv_cache, backend)
            if i == backout_layer:
                x_backout = x
        x = x - self.backout_lambda.to(x.dtype) * x_backout  # low-level features of the middle layer taken out
        if targets is None and hasattr(kv_cache, "last"):  # a serving prefill reads the next token's logits only
            x = kv_cache.last(x)
        return self.head(x, self.lm_head.weight, self.config.vocab_size, targets, loss_reduction)


# The record Muon groups' hyperparameters besides params, lr and weight_decay: nanochat 92d63d4's Muon (momentum 0.95,
# scheduled by the training loop; 5 orthogonalisation steps) and the names nanochat/muon.py gives its options.
RECORD_MUON_GROUP = dict(kind="muon", momentum=0.95, nesterov=True, ns_steps=5, ns="polar_express", row_equilibrate=True,
                         renormalize=True, normuon=True, beta2=0.9, cautious_wd=True)
