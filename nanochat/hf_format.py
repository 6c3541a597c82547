"""
The mapping between nanochat checkpoints and the Hugging Face `transformers` "NanoChat" format
(model_type "nanochat": NanoChatConfig / NanoChatForCausalLM, transformers >= 5). Used by scripts.export_hf and
scripts.import_hf; docs/hf.md has the table.

The two models compute the same function; only names and a few constants need translating:
- parameter names (c_q -> q_proj, c_fc -> fc1, ...); neither side has norm weights or biases
- rotary: both rotate the two halves of the head dim with the same signs (transformers' NanoChat `rotate_half` is
  cat(x2, -x1), which is our y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos), theta 10000, then QK-norm: no permutation
- RMSNorm eps: ours is F.rms_norm's default, the float32 machine epsilon; transformers takes it from rms_norm_eps
- vocab padding: our wte / lm_head have rows up to a multiple of 64 that no token uses; they are dropped on export
  (so transformers' logits have exactly one column per token) and zero-filled on import

The record recipe's model (nanochat/gpt.py RecordGPT) has modules transformers' NanoChat does not (hf_lacks): it is
refused on export, with what is missing, rather than written as a model that computes something else.

Nothing here imports transformers or safetensors: those are optional (the `hf` extra) and imported by the scripts.
The tokenizer helpers import `tokenizers` lazily, inside the functions that need it.
"""

import json
from dataclasses import asdict

import torch

from nanochat.gpt import GPTConfig
from nanochat.tokenizer import SPECIAL_TOKENS

RMS_NORM_EPS = torch.finfo(torch.float32).eps  # what F.rms_norm uses when eps=None (our norm()) on fp32 inputs
ROPE_THETA = 10000.0  # GPT._precompute_rotary_embeddings' base
SOFTCAP = 15.0  # GPT.forward's logit softcap
MLP_RATIO = 4  # MLP hidden width = 4 * n_embd

# our name (with {i} the layer) -> transformers' name
_LAYER_NAMES = {
    "transformer.h.{i}.attn.c_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "transformer.h.{i}.attn.c_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "transformer.h.{i}.attn.c_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "transformer.h.{i}.attn.c_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "transformer.h.{i}.mlp.c_fc.weight": "model.layers.{i}.mlp.fc1.weight",
    "transformer.h.{i}.mlp.c_proj.weight": "model.layers.{i}.mlp.fc2.weight",
}
_VOCAB_NAMES = {"transformer.wte.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def param_name_map(n_layer):
    """{our parameter name: transformers' parameter name} for a model of n_layer blocks."""
    names = dict(_VOCAB_NAMES)
    for i in range(n_layer):
        names.update({ours.format(i=i): theirs.format(i=i) for ours, theirs in _LAYER_NAMES.items()})
    return names


def padded_vocab_size(vocab_size):
    return ((vocab_size + 63) // 64) * 64  # as GPT.__init__


# -----------------------------------------------------------------------------
# config


def hf_lacks(config):
    """What transformers' NanoChat model cannot express of a model with this config, as one phrase; None when it
    expresses all of it (the December GPT)."""
    if getattr(config, "window_pattern", None) is None:
        return None
    return ("sliding-window attention, value embeddings, smear, backout, the per-layer residual and x0 scalars and "
            "the 1.2 QK-norm scale of the record recipe's model")


def hf_config_dict(config, bos_token_id, eos_token_id, dtype="float32"):
    """NanoChatConfig keyword arguments for our GPTConfig (transformers checks and completes them)."""
    return dict(
        architectures=["NanoChatForCausalLM"],
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=MLP_RATIO * config.n_embd,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_kv_head,
        # the length the model was trained at; our rotary table reaches 10x that, but quality is only known up to here
        max_position_embeddings=config.sequence_len,
        hidden_act="relu2",
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        final_logit_softcapping=SOFTCAP,
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        # no pad id in the model: transformers' Embedding would stop training that row (padding_idx). Generation and
        # the tokenizer get <|assistant_end|> as their pad token instead (see generation_config / tokenizer_config).
        pad_token_id=None,
        dtype=dtype,
    )


def gpt_config_from_hf(hf, vocab_size=None):
    """Our GPTConfig for a transformers NanoChat config (a dict, e.g. config.json). Refuses what our GPT cannot
    compute exactly; returns (config, notes) where notes are harmless differences worth printing.
    vocab_size: use this many tokens (the tokenizer's) when the model has extra padding rows."""

    def get(key, default=None):
        return hf.get(key, default)

    if get("model_type") != "nanochat":
        raise ValueError(f"config.json has model_type {get('model_type')!r}; only transformers' 'nanochat' models can be imported")
    notes = []
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or hidden // heads
    rope = get("rope_parameters") or {}
    theta = rope.get("rope_theta", get("rope_theta", ROPE_THETA))
    problems = []
    if hidden % heads != 0 or head_dim != hidden // heads:
        problems.append(f"head_dim={head_dim} with hidden_size={hidden} and {heads} heads (ours is hidden_size / heads)")
    if get("intermediate_size") != MLP_RATIO * hidden:
        problems.append(f"intermediate_size={get('intermediate_size')} (ours is {MLP_RATIO} x hidden_size = {MLP_RATIO * hidden})")
    if get("hidden_act", "relu2") != "relu2":
        problems.append(f"hidden_act={get('hidden_act')!r} (ours is relu2)")
    if get("attention_bias", False):
        problems.append("attention_bias=true (ours has no biases)")
    if rope.get("rope_type", "default") != "default" or float(theta) != ROPE_THETA or get("rope_scaling"):
        problems.append(f"rope {rope or {'rope_theta': theta, 'rope_scaling': get('rope_scaling')}} (ours is the default rope with theta {ROPE_THETA:g})")
    if get("final_logit_softcapping", SOFTCAP) != SOFTCAP:
        problems.append(f"final_logit_softcapping={get('final_logit_softcapping')} (ours is {SOFTCAP:g})")
    if problems:
        raise ValueError("this NanoChat model differs from nanochat's GPT: " + "; ".join(problems))
    eps = get("rms_norm_eps", 1e-6)
    if eps != RMS_NORM_EPS:
        notes.append(f"rms_norm_eps={eps:g} in config.json, ours is {RMS_NORM_EPS:g}: logits move by ~eps relative, no more")
    hf_vocab = get("vocab_size")
    if vocab_size is None:
        vocab_size = hf_vocab
    elif vocab_size > hf_vocab:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but the model only {hf_vocab} embedding rows")
    elif vocab_size < hf_vocab:
        notes.append(f"the model has {hf_vocab} embedding rows for {vocab_size} tokens: the extra rows are padding")
    config = GPTConfig(
        sequence_len=get("max_position_embeddings"),
        vocab_size=vocab_size,
        n_layer=get("num_hidden_layers"),
        n_head=heads,
        n_kv_head=kv_heads,
        n_embd=hidden,
    )
    return config, notes


# -----------------------------------------------------------------------------
# weights


def state_dict_to_hf(state_dict, config, dtype=torch.float32):
    """Our GPT state dict -> transformers' tensors (padding rows dropped, contiguous, in `dtype`)."""
    names = param_name_map(config.n_layer)
    missing = sorted(set(names) - set(state_dict))
    extra = sorted(set(state_dict) - set(names))
    if missing or extra:
        raise ValueError(f"not a nanochat GPT state dict for {config}: missing {missing[:4]}, unexpected {extra[:4]}")
    out = {}
    for ours, theirs in names.items():
        t = state_dict[ours]
        if ours in _VOCAB_NAMES:
            t = t[: config.vocab_size]
        out[theirs] = t.detach().to(dtype).contiguous()
    return out


def state_dict_from_hf(tensors, config, tied=False):
    """transformers' tensors -> our GPT state dict (fp32; vocab rows cut to config.vocab_size then zero-padded).
    tied: the model ties lm_head to the embedding (tie_word_embeddings), so the file may hold the embedding only;
    our lm_head is untied and gets a copy."""
    tensors = dict(tensors)
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        if not tied:
            raise ValueError("the checkpoint has no lm_head.weight and config.json does not tie it to the embedding")
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    names = param_name_map(config.n_layer)
    missing = sorted(set(names.values()) - set(tensors))
    extra = sorted(set(tensors) - set(names.values()))
    if missing or extra:
        raise ValueError(f"not a NanoChat checkpoint of {config.n_layer} layers: missing {missing[:4]}, unexpected {extra[:4]}")
    padded = padded_vocab_size(config.vocab_size)
    out = {}
    for ours, theirs in names.items():
        t = tensors[theirs].to(torch.float32)
        if ours in _VOCAB_NAMES:
            if t.size(0) < config.vocab_size:
                raise ValueError(f"{theirs} has {t.size(0)} rows for a vocabulary of {config.vocab_size}")
            rows = torch.zeros(padded, t.size(1), dtype=torch.float32)
            rows[: config.vocab_size] = t[: config.vocab_size]
            t = rows
        out[ours] = t.contiguous()
    return out


def model_meta(config, **extra):
    """The meta json of a checkpoint made by import (what checkpoint_manager.build_model needs, plus provenance)."""
    return {"model_config": asdict(config), **extra}


# -----------------------------------------------------------------------------
# tokenizer: tiktoken ranks <-> a byte-level BPE tokenizer.json


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies (tokenizer.json
    stores tokens as strings): printable Latin-1 bytes stand for themselves, the others get code points from 256 up."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _token_str(token_bytes, table):
    return "".join(table[b] for b in token_bytes)


def bpe_vocab_and_merges(mergeable_ranks):
    """(vocab, merges) for a byte-level BPE that tokenizes like tiktoken with these ranks.

    tiktoken merges, in a pre-token, the adjacent pair whose concatenation has the lowest rank. So every way of
    splitting a token into two tokens is a merge, ranked by the token it makes; the splits of one token follow each
    other (ordered by the parts' ranks, the usual choice). With ignore_merges=True (a pre-token that is itself a
    token is taken whole, as tiktoken does) this gives tiktoken's ids; the one corner where the two rules could part
    (two different splits of one token adjacent at once) is discussed in docs/hf.md."""
    table = bytes_to_unicode()
    by_rank = sorted(mergeable_ranks.items(), key=lambda kv: kv[1])
    vocab = {_token_str(tok, table): rank for tok, rank in by_rank}
    merges = []
    for tok, rank in by_rank:
        if len(tok) < 2:
            continue
        splits = []
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in mergeable_ranks and right in mergeable_ranks:
                splits.append((mergeable_ranks[left], mergeable_ranks[right], left, right))
        if not splits:
            raise ValueError(f"token {tok!r} (id {rank}) cannot be made from two other tokens; not a BPE vocabulary")
        for _, _, left, right in sorted(splits):
            merges.append((_token_str(left, table), _token_str(right, table)))
    return vocab, merges


def build_hf_tokenizer(enc):
    """A `tokenizers.Tokenizer` equal to our tiktoken Encoding: the split regex, byte-level BPE, our special tokens
    (same ids), <|bos|> prepended when add_special_tokens=True (as every document starts in training)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    ranks = enc._mergeable_ranks
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("the tokenizer's ranks are not 0..n-1; cannot lay them out as token ids")
    vocab, merges = bpe_vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    specials = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
    if [name for name, _ in specials] != SPECIAL_TOKENS or specials[0][1] != len(ranks):
        raise ValueError(f"expected the special tokens {SPECIAL_TOKENS} right after the {len(ranks)} merges, got {specials}")
    # add_special_tokens gives ids from vocab_size up, in order: the same ids as ours (checked below)
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False, lstrip=False, rstrip=False) for name, _ in specials])
    for name, i in specials:
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")
    bos = "<|bos|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, enc._special_tokens[bos])]
    )
    return tok


def tokenizer_json(enc):
    """tokenizer.json of an export: build_hf_tokenizer(enc) with its merges as "left right" strings, the form every
    `tokenizers` release reads (0.20+ writes pairs, which 0.19 and so transformers <= 4.44 cannot load). Byte-level
    tokens never hold a space (it is written as "Ġ"), so the strings are unambiguous."""
    data = json.loads(build_hf_tokenizer(enc).to_str())
    merges = data["model"]["merges"]
    assert all(" " not in part for pair in merges for part in pair)
    data["model"]["merges"] = [f"{left} {right}" for left, right in merges]
    return json.dumps(data, ensure_ascii=False, indent=2)


def tokenizer_config_dict(model_max_length):
    """tokenizer_config.json of an export, written by hand rather than by transformers' save_pretrained, so that
    transformers 4.x loads it as well as 5.x: 5.x would write tokenizer_class "TokenizersBackend" (a class 4.x does
    not have) and the extra special tokens as a list under "extra_special_tokens" (a dict of named tokens in 4.x).
    PreTrainedTokenizerFast is the class both know (5.x's alias of TokenizersBackend), and additional_special_tokens
    the key both read, so all_special_tokens lists our nine. The chat template is also here for the 4.x releases
    that predate chat_template.jinja (where both exist, every version takes the .jinja file; the two are equal)."""
    bos, eos = "<|bos|>", "<|assistant_end|>"
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,  # no pad token of our own: our SFT loader pads with <|assistant_end|> too
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (bos, eos)],
        "clean_up_tokenization_spaces": False,  # " ." must decode to " ."
        "model_max_length": model_max_length,
        "model_input_names": ["input_ids", "attention_mask"],  # no token_type_ids (4.x's default would add them)
        "chat_template": CHAT_TEMPLATE,
    }


# Text that exercises the corners of the split pattern and byte-level BPE: contractions, digit runs, whitespace runs,
# tabs and CR/LF, accents, CJK, emoji (4-byte UTF-8, ZWJ sequences, flags), combining marks, right-to-left scripts.
# Import checks a tokenizer.json against tiktoken on it; the tests use it too.
VARIED_TEXT = [
    "Hello world! It's a test; we'll see what they've done (I'd say: DON'T).",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1e10 2,000,000 $19.99 100% 0x1F 192.168.0.1",
    "Whitespace:  two   three    four\ttab\t\tdouble\n\nnewlines\r\nCRLF   \n  trailing   ",
    "Café naïve résumé Ærøskøbing Straße İstanbul ǅ ﬁ",
    "中文的句子，还有标点。日本語のテキスト、カタカナ。한국어 문장입니다.",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🧑‍💻 and ⭐⭐⭐ in a row",
    "Combining: e\u0301 a\u0308 \u200b zero-width \ufeff BOM; Ω≈ç√∫˜µ≤≥÷",
    "עברית ו-العربية مع أرقام ١٢٣ and Ελληνικά, русский язык.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code\n",
    "    leading spaces, <|not special|> <|bos|> text that looks special",
    "",
    " ",
    "\n",
    "a" * 50 + " " + "ab" * 40 + " " + "1" * 33,
]


def encoding_from_hf_tokenizer(tokenizer_json):
    """Our tiktoken Encoding from a tokenizer.json dict (byte-level BPE, ids = ranks, our special tokens after the
    merges), as written by export or by the transformers ports of nanochat. Raises when it is not that shape."""
    import tiktoken

    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json has a {model.get('type')!r} model; only byte-level BPE can become a nanochat tokenizer")
    pattern = _split_pattern(tokenizer_json.get("pre_tokenizer"))
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {}
    for token, i in model["vocab"].items():
        try:
            ranks[bytes(inverse[c] for c in token)] = i
        except KeyError:
            raise ValueError(f"token {token!r} is not in byte-level form; only byte-level BPE can be imported") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("tokenizer.json's BPE ids are not 0..n-1")
    added = {t["content"]: t["id"] for t in tokenizer_json.get("added_tokens", [])}
    missing = [s for s in SPECIAL_TOKENS if s not in added]
    if missing:
        raise ValueError(f"tokenizer.json lacks nanochat's special tokens {missing}")
    specials = {s: added[s] for s in SPECIAL_TOKENS}
    if sorted(specials.values()) != list(range(len(ranks), len(ranks) + len(specials))):
        raise ValueError(f"nanochat's special tokens must follow the {len(ranks)} BPE tokens, got {specials}")
    return tiktoken.Encoding(name="rustbpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def _split_pattern(pre_tokenizer):
    """The split regex of a tokenizer.json pre_tokenizer: Sequence[Split(Regex), ByteLevel(use_regex=false)]."""
    steps = (pre_tokenizer or {}).get("pretokenizers") if (pre_tokenizer or {}).get("type") == "Sequence" else [pre_tokenizer]
    steps = [s for s in steps or [] if s]
    kinds = [s.get("type") for s in steps]
    if kinds != ["Split", "ByteLevel"] or steps[1].get("use_regex") or "Regex" not in (steps[0].get("pattern") or {}):
        raise ValueError(f"tokenizer.json pre-tokenizer is {kinds}; expected a regex Split then ByteLevel without its own regex")
    if steps[0].get("behavior") != "Isolated" or steps[0].get("invert"):
        raise ValueError("tokenizer.json's Split must isolate matches (behavior Isolated, invert false)")
    return steps[0]["pattern"]["Regex"]


# -----------------------------------------------------------------------------
# chat template: renders exactly RustBPETokenizer.render_for_completion / render_conversation

# What the template does with each role (docs/hf.md repeats this; the template's errors say it too):
# - system (or developer, OpenAI's newer name for it): only as the first message, merged into the first user message
#   as system + "\n\n" + user, as render_conversation does
# - user, assistant: must alternate, user first
# - tool, function, anything else: an error. Our chat format has no tool messages: the python tool's call and its
#   output are parts of the assistant message ({"type": "python"} / {"type": "python_output"}); nor does it take tool
#   definitions (tools=...) or OpenAI tool_calls.
# Content is a string or a list of parts. OpenAI's list form ([{"type": "text", "text": ...}, ...]) is accepted for
# every role; several text parts are concatenated, as our chat server does (nanochat/serving/schema.py), so the ids are
# those of render_conversation with the parts joined into one string. Assistant lists may also hold our python /
# python_output parts; any other part type (image_url, input_audio, refusal, ...) is an error naming it.
CHAT_TEMPLATE = r"""{#- nanochat's chat format (nanochat/tokenizer.py render_conversation; roles and content: docs/hf.md).
    Every tag trims the whitespace around it, so only the special tokens and the message texts are output. -#}
{%- macro text_of(message, index) -%}
    {%- set content = message['content'] if message is mapping and 'content' in message else none -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is sequence and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part['type'] == 'text' and part['text'] is string -%}
                {{- part['text'] -}}
            {%- else -%}
                {{- raise_exception('message ' ~ index ~ ' (' ~ message['role'] ~ "): only parts {'type': 'text', 'text': str} are supported here, got " ~ ("a '" ~ part['type'] ~ "' part" if part is mapping else 'a part that is not an object')) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('message ' ~ index ~ ' (' ~ message['role'] ~ '): content must be a string or a list of text parts, got ' ~ content) -}}
    {%- endif -%}
{%- endmacro -%}
{%- if tools -%}
    {{- raise_exception("nanochat models take no tool definitions (tools=...): their only tool is the python calculator, written as {'type': 'python'} / {'type': 'python_output'} parts of an assistant message") -}}
{%- endif -%}
{%- set ns = namespace(offset=0, system='') -%}
{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}
    {%- if messages|length < 2 or messages[1]['role'] != 'user' -%}
        {{- raise_exception('a system message must be followed by a user message (it is merged into it)') -}}
    {%- endif -%}
    {%- set ns.offset = 1 -%}
    {%- set ns.system = text_of(messages[0], 0) + '\n\n' -%}
{%- endif -%}
<|bos|>
{%- for message in messages[ns.offset:] -%}
    {%- set index = loop.index0 + ns.offset -%}
    {%- set role = message['role'] -%}
    {%- if role in ['system', 'developer'] -%}
        {{- raise_exception('message ' ~ index ~ ': a system message is only supported as the first message (it is merged into the first user message)') -}}
    {%- elif role not in ['user', 'assistant'] -%}
        {{- raise_exception('message ' ~ index ~ ": role '" ~ role ~ "' is not supported: nanochat's chat format has system (first), user and assistant messages only; the python tool's call and output go in the assistant message as {'type': 'python'} / {'type': 'python_output'} parts") -}}
    {%- endif -%}
    {%- set expected = 'user' if loop.index0 % 2 == 0 else 'assistant' -%}
    {%- if role != expected -%}
        {{- raise_exception('messages must alternate user, assistant, user, ... (an optional system message first); got '
                            ~ role ~ ' where ' ~ expected ~ ' was expected') -}}
    {%- endif -%}
    {%- if message['tool_calls'] -%}
        {{- raise_exception('message ' ~ index ~ ": tool_calls are not supported: write the python tool's call as a {'type': 'python'} part of the content") -}}
    {%- endif -%}
    {%- if role == 'user' -%}
        <|user_start|>{{- (ns.system if loop.first else '') + text_of(message, index) -}}<|user_end|>
    {%- else -%}
        <|assistant_start|>
        {%- if message['content'] is string or message['content'] is not sequence or message['content'] is mapping -%}
            {{- text_of(message, index) -}}
        {%- else -%}
            {%- for part in message['content'] -%}
                {%- set kind = part['type'] if part is mapping else part -%}
                {%- if kind in ['text', 'python', 'python_output'] and part['text'] is not string -%}
                    {{- raise_exception('message ' ~ index ~ ': a ' ~ kind ~ " part needs a string 'text'") -}}
                {%- elif kind == 'text' -%}
                    {{- part['text'] -}}
                {%- elif kind == 'python' -%}
                    <|python_start|>{{- part['text'] -}}<|python_end|>
                {%- elif kind == 'python_output' -%}
                    <|output_start|>{{- part['text'] -}}<|output_end|>
                {%- else -%}
                    {{- raise_exception('message ' ~ index ~ ': unknown part type ' ~ kind ~ " (use 'text', 'python' or 'python_output')") -}}
                {%- endif -%}
            {%- endfor -%}
        {%- endif -%}
        <|assistant_end|>
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant_start|>
{%- endif -%}
"""
