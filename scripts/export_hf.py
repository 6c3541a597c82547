"""
Export a nanochat checkpoint as a Hugging Face transformers model directory (model_type "nanochat"), loadable with
no custom code by AutoModelForCausalLM / AutoTokenizer, `vllm serve DIR` and lm-eval's `--model hf`.

    python -m scripts.export_hf -i sft --out hf/d20                      # the largest sft model, its last step
    python -m scripts.export_hf -i base -g d20 -s 21400 --out hf/d20-base --dtype bfloat16

The directory: config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
chat_template.jinja, README.md (a model card for the Hub). Needs the `hf` extra (pip install -e '.[hf]'). Mapping and limitations: docs/hf.md.
"""

import os
import shutil
import tempfile

import torch

from nanochat.atomic import fsync_dir
from nanochat.checkpoint_manager import checkpoint_flags
from nanochat.configurator import Flag, Flags
from nanochat.hf_format import CHAT_TEMPLATE, build_hf_tokenizer, hf_config_dict, state_dict_to_hf
from nanochat.usage import CannotRun, run_main

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


FLAGS = Flags(
    checkpoint_flags("sft"),
    Flag("out", None, "output directory (must not exist, or be empty)", type=str, short="o", required=True),
    Flag("dtype", "float32", "dtype of the saved weights", choices=list(DTYPES)),
    description=__doc__,
)


def build_arg_parser():
    return FLAGS


def _require_hf():
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as e:
        raise CannotRun(f"export needs transformers>=5 and safetensors ({e}); install them with: pip install -e '.[hf]'") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise CannotRun(f"transformers {transformers.__version__} has no NanoChat model; install transformers>=5")


def _check_out_dir(out_dir):
    if os.path.isfile(out_dir):
        raise FileExistsError(f"--out {out_dir} is a file; pass a directory path")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"--out {out_dir} exists and is not empty; pass a new directory (or remove this one)")


def model_card(config, n_params, source, model_tag, step, meta, dtype):
    """README.md for the directory: the Hub reads its front matter (library, pipeline) and shows the rest."""
    metrics = {k: meta[k] for k in ("val_bpb", "val_loss") if isinstance(meta.get(k), (int, float))}
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags:",
        "- nanochat",
        "---",
        f"# nanochat {model_tag} ({source})",
        "",
        f"A nanochat model: checkpoint `{source}` / `{model_tag}` / step {step}, exported with `python -m scripts.export_hf`",
        f"to transformers' built-in NanoChat architecture ({dtype} weights). No custom code is needed.",
        "",
        "| layers | width | query heads | kv heads | vocab | context | parameters |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {config.n_layer} | {config.n_embd} | {config.n_head} | {config.n_kv_head} | {config.vocab_size} | {config.sequence_len} | {n_params:,} |",
        "",
    ]
    if metrics:
        lines += [", ".join(f"{k}: {v:.4f}" for k, v in metrics.items()), ""]
    lines += [
        "```python",
        "from transformers import pipeline",
        'chat = pipeline("text-generation", "<this directory or repo id>")',
        'print(chat([{"role": "user", "content": "Why is the sky blue?"}], max_new_tokens=64)[0]["generated_text"][-1]["content"])',
        "```",
        "",
        "The chat template renders nanochat's format (<|user_start|> ... <|assistant_start|>); generation stops at",
        "<|assistant_end|> or <|bos|>. Plain-text calls start with <|bos|>, as the model saw every document in training.",
        "",
    ]
    return "\n".join(lines)


def export_model(model, tokenizer, out_dir, dtype="float32", card=None):
    """Write `model` (our GPT) and `tokenizer` (RustBPETokenizer) to out_dir in the transformers NanoChat format,
    plus `card` as README.md when given. Everything is written to a temporary sibling directory first and renamed
    into place at the end, so out_dir is either complete or absent. Returns out_dir."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, NanoChatConfig, PreTrainedTokenizerFast

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config = model.config
    if tokenizer.get_vocab_size() != config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model {config.vocab_size}")
    out_dir = os.path.abspath(out_dir)
    _check_out_dir(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    bos = tokenizer.get_bos_token_id()
    assistant_end = tokenizer.encode_special("<|assistant_end|>")

    staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.tmp-")
    try:
        hf_config = NanoChatConfig(**hf_config_dict(config, bos_token_id=bos, eos_token_id=assistant_end, dtype=dtype))
        hf_config.save_pretrained(staging)
        # stop where our Engine stops: at the end of the assistant's turn, or at <|bos|> (a base model ends a document
        # with the next document's <|bos|>)
        GenerationConfig(bos_token_id=bos, eos_token_id=[assistant_end, bos], pad_token_id=assistant_end).save_pretrained(staging)
        tensors = state_dict_to_hf(model.state_dict(), config, DTYPES[dtype])
        save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        hf_tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=build_hf_tokenizer(tokenizer.enc),
            bos_token="<|bos|>",
            eos_token="<|assistant_end|>",
            pad_token="<|assistant_end|>",
            clean_up_tokenization_spaces=False,  # " ." must decode to " ."
            model_max_length=config.sequence_len,
            chat_template=CHAT_TEMPLATE,
        )
        hf_tokenizer.save_pretrained(staging)
        if card is not None:
            with open(os.path.join(staging, "README.md"), "w", encoding="utf-8") as f:
                f.write(card)
        umask = os.umask(0)
        os.umask(umask)
        for name in os.listdir(staging):
            path = os.path.join(staging, name)
            os.chmod(path, 0o666 & ~umask)  # mkdtemp and some writers make private files; give the usual ones
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(staging, 0o777 & ~umask)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above); rename needs the name free
        os.rename(staging, out_dir)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def main(argv=None):
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    _require_hf()
    from nanochat.checkpoint_manager import checkpoint_root, find_largest_model, find_last_step, load_model

    try:
        _check_out_dir(args.out)  # before loading a large model
        root = checkpoint_root(args.source)
        tag = args.model_tag or find_largest_model(root)
        step = args.step if args.step is not None else find_last_step(os.path.join(root, tag))
        model, tokenizer, meta = load_model(args.source, "cpu", phase="eval", model_tag=tag, step=step)
        padding_rows = model.padded_vocab_size - model.config.vocab_size  # in wte and lm_head, dropped on export
        n = sum(p.numel() for p in model.parameters()) - 2 * padding_rows * model.config.n_embd
        card = model_card(model.config, n, args.source, tag, step, meta, args.dtype)
        out = export_model(model, tokenizer, args.out, dtype=args.dtype, card=card)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        parser.error(str(e))  # usage + the reason, exit status 2
    print(f"Exported the {args.source} model {tag} step {step} ({n:,} parameters, {args.dtype}) to {out}")
    print(f"Try it: python -c \"from transformers import pipeline; print(pipeline('text-generation', '{out}')('The capital of France is'))\"")


if __name__ == "__main__":
    run_main(main)
