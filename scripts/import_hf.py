"""
Import a Hugging Face transformers NanoChat model directory (model_type "nanochat": one written by scripts.export_hf,
a transformers port of a nanochat checkpoint such as karpathy/nanochat-d32 downloaded from the Hub, or any
NanoChatForCausalLM.save_pretrained) as a nanochat checkpoint that chat_cli, chat_web, chat_eval, mid_train,
chat_sft and chat_rl load.

    python -m scripts.import_hf hf/d20 --source sft                      # -> chatsft_checkpoints/d20/model_000000.pt
    python -m scripts.import_hf ~/nanochat-d32 --source base --model_tag d32 --step 0

The tokenizer: when DIR has a tokenizer.json it becomes base_dir/tokenizer (written if there is none; if there is
one it must be the same tokenizer). When DIR has none, base_dir/tokenizer must already hold the model's tokenizer.
Needs the `hf` extra (pip install -e '.[hf]'). Mapping and limitations: docs/hf.md.
"""

import json
import os

import torch

from nanochat.checkpoint.steps import is_step_complete
from nanochat.checkpoint_manager import PHASE_DIRS, checkpoint_root, save_checkpoint
from nanochat.common import get_base_dir
from nanochat.configurator import Flag, Flags
from nanochat.hf_format import VARIED_TEXT, encoding_from_hf_tokenizer, gpt_config_from_hf, model_meta, state_dict_from_hf
from nanochat.tokenizer import RustBPETokenizer, compute_token_bytes, save_token_bytes
from nanochat.usage import BadValue, CannotRun, run_main


FLAGS = Flags(
    Flag("dir", None, "the transformers model directory (config.json, model.safetensors, ...)", type=str,
         positional=True, required=True),
    Flag("source", None, "which stage's checkpoints to write", type=str, choices=list(PHASE_DIRS), short="i",
         required=True),
    Flag("model_tag", None, "model tag; auto = d<number of layers>", type=str, short="g"),
    Flag("step", 0, "step number of the written checkpoint", short="s"),
    description=__doc__,
)


def build_arg_parser():
    return FLAGS


def _read_json(path):
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadValue(f"{path} is not valid JSON ({e}): copy the model directory again") from None


def load_safetensors(hf_dir):
    """All tensors of DIR/model.safetensors, or of the shards listed in model.safetensors.index.json."""
    from safetensors.torch import load_file

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        return load_file(single)
    if os.path.exists(index):
        tensors = {}
        for shard in sorted(set(_read_json(index)["weight_map"].values())):
            tensors.update(load_file(os.path.join(hf_dir, shard)))
        return tensors
    raise FileNotFoundError(f"{hf_dir} has no model.safetensors (nor model.safetensors.index.json); only safetensors weights are read")


def same_encoding(a, b):
    return a._mergeable_ranks == b._mergeable_ranks and a._special_tokens == b._special_tokens and a._pat_str == b._pat_str


def tokenizer_from_hf_dir(hf_dir):
    """Our tokenizer built from DIR/tokenizer.json, checked to encode like transformers' tokenizer (None if absent)."""
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    tokenizer = RustBPETokenizer(encoding_from_hf_tokenizer(_read_json(path)), "<|bos|>")
    reference = Tokenizer.from_file(path)
    reference.encode_special_tokens = True  # ours encodes special-token strings inside text as text
    for text in VARIED_TEXT:
        theirs = reference.encode(text, add_special_tokens=False).ids
        if theirs != tokenizer.encode(text):
            raise ValueError(f"{path}: its merges do not tokenize like its ranks (e.g. {text[:40]!r}); it cannot become a nanochat tokenizer")
    return tokenizer


def install_tokenizer(tokenizer, tokenizer_dir):
    """Write the tokenizer to base_dir/tokenizer, or check it equals the one there."""
    if os.path.exists(os.path.join(tokenizer_dir, "tokenizer.pkl")):
        existing = RustBPETokenizer.from_directory(tokenizer_dir)
        if not same_encoding(existing.enc, tokenizer.enc):
            raise ValueError(
                f"{tokenizer_dir} holds a different tokenizer than the model's; import into a fresh base dir "
                "(NANOCHAT_BASE_DIR=...) so the existing models keep theirs"
            )
        return False
    tokenizer.save(tokenizer_dir)
    save_token_bytes(compute_token_bytes(tokenizer), tokenizer_dir)
    return True


def import_model(hf_dir, source, model_tag=None, step=0):
    """Convert hf_dir into checkpoint_root(source)/model_tag/model_{step}.pt + meta. Returns (checkpoint_dir, config)."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} does not exist: pass a transformers model directory")
    hf_config = _read_json(config_path)
    tokenizer_dir = os.path.join(get_base_dir(), "tokenizer")
    tokenizer = tokenizer_from_hf_dir(hf_dir)
    if tokenizer is None:
        if not os.path.exists(os.path.join(tokenizer_dir, "tokenizer.pkl")):
            raise FileNotFoundError(f"{hf_dir} has no tokenizer.json and {tokenizer_dir} has no tokenizer; one of them must hold the model's")
        vocab_size = RustBPETokenizer.from_directory(tokenizer_dir).get_vocab_size()
        print(f"{hf_dir} has no tokenizer.json: using the tokenizer in {tokenizer_dir} ({vocab_size} tokens)")
    else:
        vocab_size = tokenizer.get_vocab_size()
    config, notes = gpt_config_from_hf(hf_config, vocab_size=vocab_size)
    for note in notes:
        print(f"note: {note}")
    state_dict = state_dict_from_hf(load_safetensors(hf_dir), config, tied=bool(hf_config.get("tie_word_embeddings")))

    # check the tensors fit our GPT before writing anything
    from nanochat.gpt import GPT

    with torch.device("meta"):
        model = GPT(config, attn="sdpa")
    model.load_state_dict(state_dict, strict=True, assign=True)

    model_tag = model_tag or f"d{config.n_layer}"
    checkpoint_dir = os.path.join(checkpoint_root(source), model_tag)
    if is_step_complete(checkpoint_dir, step):
        raise FileExistsError(f"{checkpoint_dir} already has step {step}; pass another --model_tag or --step")
    if tokenizer is not None and install_tokenizer(tokenizer, tokenizer_dir):
        print(f"Wrote the tokenizer ({vocab_size} tokens) to {tokenizer_dir}")
    meta = model_meta(config, step=step, imported_from={"dir": os.path.abspath(hf_dir), "transformers_version": hf_config.get("transformers_version")})
    save_checkpoint(checkpoint_dir, step, state_dict, None, meta)
    return checkpoint_dir, config


def main(argv=None):
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        import safetensors  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise CannotRun(f"import needs safetensors and tokenizers ({e}); install them with: pip install -e '.[hf]'") from None
    try:
        checkpoint_dir, config = import_model(args.dir, args.source, args.model_tag, args.step)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        parser.error(str(e))  # usage + the reason, exit status 2
    print(f"Imported {args.dir} ({config}) as {checkpoint_dir} step {args.step}")
    print(f"Try it: python -m scripts.chat_cli -i {args.source} -g {os.path.basename(checkpoint_dir)} -s {args.step}")


if __name__ == "__main__":
    run_main(main)
