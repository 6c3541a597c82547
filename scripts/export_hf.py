"""
Export a nanochat checkpoint as a Hugging Face transformers model directory (model_type "nanochat"), loadable with
no custom code by AutoModelForCausalLM / AutoTokenizer, `vllm serve DIR` and lm-eval's `--model hf`.

    python -m scripts.export_hf -i sft --out hf/d20                      # the largest sft model, its last step
    python -m scripts.export_hf -i base -g d20 -s 21400 --out hf/d20-base --dtype bfloat16

The directory: config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json (loads in
transformers 4.x too), chat_template.jinja, README.md (a model card for the Hub: license, base model, data sets, the
training commands and evaluation from the checkpoints' metas and the report, usage for the stage). Needs the `hf`
extra (pip install -e '.[hf]'). Mapping and limitations: docs/hf.md.
"""

import json
import os
import shutil
import tempfile

import torch

from nanochat.atomic import fsync_dir
from nanochat.checkpoint_manager import checkpoint_flags
from nanochat.configurator import Flag, Flags
from nanochat.hf_format import CHAT_TEMPLATE, hf_config_dict, hf_lacks, state_dict_to_hf, tokenizer_config_dict, tokenizer_json
from nanochat.usage import BadValue, CannotRun, run_main

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


FLAGS = Flags(
    checkpoint_flags("sft"),
    Flag("out", None, "output directory (must not exist, or be empty)", type=str, short="o", required=True),
    Flag("dtype", "float32", "dtype of the saved weights", choices=list(DTYPES)),
    Flag("license", "mit", "the model card's license (a Hub license id; nanochat's code is MIT, check your data's terms)"),
    Flag("base_model", None, "Hub id of the model a mid/sft/rl checkpoint was trained from, for the card's base_model; "
         "auto = none (the card names the local checkpoint it came from)", type=str),
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
    """--out, before a model loads: a new or empty directory, in a place this process can write (the export is
    written beside it and renamed into place)."""
    if os.path.isfile(out_dir):
        raise FileExistsError(f"--out {out_dir} is a file; pass a directory path")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"--out {out_dir} exists and is not empty; pass a new directory (or remove this one)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent):  # the directories to be made: the nearest one that exists must take them
        parent = os.path.dirname(parent)
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".nanochat-write-test-"))
    except OSError as e:
        raise CannotRun(f"--out {out_dir}: {parent} does not take new directories (mkdir there says: "
                        f"{e.strerror or e}); pass a path in a directory you can write to") from None


# What each stage is, the script that trains it, its section of the report, and the report sections that evaluate it
STAGES = {
    "base": ("a pretrained base model: it continues plain text", "base_train", "Base model training",
             ["Base model loss", "Base model evaluation"]),
    "mid": ("a mid-trained model: nanochat's chat format, multiple choice and the python tool", "mid_train",
            "Midtraining", ["Chat evaluation mid"]),
    "sft": ("a chat model: supervised fine-tuning on conversations", "chat_sft", "Chat SFT", ["Chat evaluation sft"]),
    "rl": ("a chat model: reinforcement learning on GSM8K", "chat_rl", "Chat RL", ["Chat evaluation rl"]),
}
# The Hub data sets behind the training tasks the stages log ("Training tasks" in their report section; tasks/*.py
# load them under these names). Tasks made here (SpellingBee's word list, identity conversations) have no Hub id.
TASK_DATASETS = {"SmolTalk": "HuggingFaceTB/smol-smoltalk", "MMLU": "cais/mmlu", "GSM8K": "openai/gsm8k",
                 "ARC": "allenai/ai2_arc", "HumanEval": "openai/openai_humaneval"}
RL_TASKS = ["GSM8K"]  # chat_rl trains on GSM8K's train split only
PRETRAINING_DATASET = "karpathy/fineweb-edu-100b-shuffle"  # nanochat.data.download's shards (FineWeb-Edu, reshuffled)


def checkpoint_lineage(source, model_tag, step, meta):
    """[(source, model_tag, step, meta)], base model first, ending with this checkpoint: each meta's "source" (written
    by mid_train, chat_sft and chat_rl) names the checkpoint the stage started from. Where that checkpoint is gone
    the chain starts at it with meta None."""
    from nanochat.checkpoint_manager import checkpoint_root, find_largest_model, find_last_step, load_checkpoint

    chain = [(source, model_tag, step, meta)]
    while isinstance(meta, dict) and isinstance(meta.get("source"), dict) and len(chain) < len(STAGES):
        parent = meta["source"]
        phase, tag, parent_step, meta = parent.get("phase"), parent.get("model_tag"), parent.get("step"), None
        if phase not in STAGES:
            break
        try:
            root = checkpoint_root(phase)
            tag = tag or find_largest_model(root)
            parent_step = parent_step if parent_step is not None else find_last_step(os.path.join(root, tag))
            _, _, meta = load_checkpoint(os.path.join(root, tag), parent_step, "cpu")  # the weights stay unread (mmap)
        except (FileNotFoundError, ValueError):
            pass
        chain.append((phase, tag, parent_step, meta))
    return chain[::-1]


def report_section(title):
    """(text, {key: value}, file name) of one section of this base dir's report; text None when no stage logged it."""
    from nanochat.common import get_base_dir
    from nanochat.report import extract_metrics, slugify

    name = slugify(title) + ".md"
    path = os.path.join(get_base_dir(), "report", name)
    if not os.path.isfile(path):
        return None, {}, name
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return text, extract_metrics(text), name


def training_command(script, user_config, world_size):
    """The command line that reproduces a run: every flag it ran with (auto ones left out), as recorded in its meta."""
    import shlex

    from nanochat.configurator import format_value

    launcher = (f"torchrun --standalone --nproc_per_node={world_size} -m scripts.{script}" if world_size > 1
                else f"python -m scripts.{script}")
    flags = [shlex.quote(f"--{k}={format_value(v)}") for k, v in user_config.items()
             if v is not None and isinstance(v, (bool, int, float, str))]
    return " \\\n    ".join([launcher, *flags])


def stage_data(source):
    """(names of what the stage trained on, their Hub data set ids) for the card."""
    if source == "base":
        from nanochat.dataset import IMPORT_INFO, base_data_dir

        info = os.path.join(base_data_dir(), IMPORT_INFO)
        if os.path.exists(info):
            return [f"a local corpus imported with `python -m nanochat.dataset import` (its sources: base_data/{IMPORT_INFO})"], []
        return [f"FineWeb-Edu ({PRETRAINING_DATASET})"], [PRETRAINING_DATASET]
    if source == "rl":
        names = RL_TASKS
    else:
        _, fields, _ = report_section(STAGES[source][2])
        names = [n.strip() for n in fields.get("Training tasks", "").split(",") if n.strip()]
    hub = [TASK_DATASETS[key] for key in TASK_DATASETS if any(n.split()[0].startswith(key) for n in names)]
    return names, hub


def _checkpoint_metrics(meta):
    """The evaluation numbers a training script stored in its checkpoint's meta."""
    from nanochat.chat_eval import TASK_NAMES

    out = {k: meta[k] for k in ("val_bpb", "min_val_bpb", "val_loss", *TASK_NAMES) if isinstance(meta.get(k), (int, float))}
    for k, p in enumerate(meta.get("pass_at_k") or []):
        out[f"GSM8K pass@{k + 1}"] = p
    return out


def _other_checkpoint(fields, model_tag, step):
    """What an evaluation section of the report says it evaluated, when that is not this checkpoint (else None).
    chat_eval records its -g/-s flags (None: the largest model, its last step); base_eval the model's step."""
    tag_s, step_s, model = fields.get("model_tag"), fields.get("step"), fields.get("Model", "")
    if tag_s not in (None, "None", model_tag):
        return f"model {tag_s}"
    if step_s not in (None, "None", str(step)):
        return f"step {step_s}"
    if model.startswith("base_model_") and model != f"base_model_{step:06d}":
        return f"{model} (step {int(model.rsplit('_', 1)[1])})"
    return None


def model_card(config, n_params, source, model_tag, step, meta, dtype, license="mit", base_model=None, path="hf/model"):
    """README.md for the directory: Hub front matter (license, base_model, datasets, tags) and the model's story:
    the stage, what it was trained from and on, the commands that trained it, its evaluation results from the
    checkpoint and the report, and a usage example for that stage (path: where the user will load it from)."""
    if base_model is not None and source == "base":
        raise ValueError("--base_model names the model a mid/sft/rl checkpoint was trained from; a base model has none")
    chain = checkpoint_lineage(source, model_tag, step, meta)
    data = {s: stage_data(s) for s, *_ in chain if s is not None}
    datasets = list(dict.fromkeys(d for _, hub in data.values() for d in hub))
    what, _, _, eval_sections = STAGES[source]
    chat = source != "base"

    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation", f"license: {license}"]
    if base_model:
        lines += [f"base_model: {base_model}", "base_model_relation: finetune"]
    if datasets:
        lines += ["datasets:", *(f"- {d}" for d in datasets)]
    lines += ["tags:", "- nanochat", f"- {source}", "---", f"# nanochat {model_tag} ({source})", ""]
    lines += [
        f"**Stage: {source}**, {what}. Checkpoint `{source}` / `{model_tag}` / step {step}, exported with",
        f"`python -m scripts.export_hf` to transformers' built-in NanoChat architecture ({dtype} weights, no custom code).",
        "",
    ]
    if chat:
        parents = [f"`{s}` / `{t}` / step {st}" + ("" if m is not None else " (not found in this base dir)")
                   for s, t, st, m in chain[:-1]]
        lines += [f"Trained from: {' ← '.join(parents[::-1]) if parents else 'not recorded in the checkpoint (no source in its meta)'}"
                  + (f"; on the Hub: [{base_model}](https://huggingface.co/{base_model})" if base_model else "") + ".", ""]
    lines += [
        "| layers | width | query heads | kv heads | vocab | context | parameters |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {config.n_layer} | {config.n_embd} | {config.n_head} | {config.n_kv_head} | {config.vocab_size} | {config.sequence_len} | {n_params:,} |",
        "",
        "## Training",
        "",
    ]
    for s, t, st, m in chain:
        names, _ = data[s]
        lines += [f"**{s}** (`{t}` step {st}): trained on {', '.join(names) if names else 'tasks not recorded (no report section)'}.", ""]
        user_config = (m or {}).get("user_config")
        if isinstance(user_config, dict):
            _, fields, _ = report_section(STAGES[s][2])
            world = (m or {}).get("world_size") or int(fields.get("DDP world size", "1") or 1)
            lines += ["```bash", training_command(STAGES[s][1], user_config, world), "```", ""]
        else:
            lines += ["(no training command: the checkpoint's meta records no flags)", ""]
    lines += ["## Evaluation", ""]
    metrics = _checkpoint_metrics(meta)
    if metrics:
        lines += ["Stored with the checkpoint: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + ".", ""]
    found = False
    for title in eval_sections:
        text, fields, name = report_section(title)
        if text is None:
            continue
        found = True
        other = _other_checkpoint(fields, model_tag, step)
        if other:
            lines += [f"### {title}", "", f"Not shown: `report/{name}` evaluated {other}, not this checkpoint.", ""]
            continue
        body = text.splitlines()
        stamp = body[1] if len(body) > 1 and body[1].startswith("timestamp:") else ""
        body = [ln for ln in body[1:] if not ln.startswith("timestamp:")]
        lines += [f"### {title}", "", f"From the training report (`report/{name}`, {stamp or 'no timestamp'}):",
                  *body, ""]
    if not found:
        lines += [f"The report of this run has no {' / '.join(eval_sections)} section (run `python -m scripts."
                  + ("base_eval" if not chat else f"chat_eval -i {source}") + "` before exporting to include it).", ""]
    lines += ["## Usage", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f"path = {json.dumps(path)}  # or the Hub repo id", "tokenizer = AutoTokenizer.from_pretrained(path)",
              "model = AutoModelForCausalLM.from_pretrained(path)"]
    if chat:
        lines += [
            'messages = [{"role": "user", "content": "Why is the sky blue?"}]',
            'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)',
            "output = model.generate(**inputs, max_new_tokens=64, do_sample=False)",
            'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
            "```", "",
            "The chat template renders nanochat's format (<|user_start|> ... <|assistant_start|>) and takes string or",
            "OpenAI-style list content; generation stops at <|assistant_end|>. Roles: system (first only), user, assistant;",
            "the python tool's calls are parts of the assistant message, not `tool` messages.",
        ]
    else:
        lines += [
            'inputs = tokenizer("The capital of France is", return_tensors="pt")  # starts with <|bos|>, as in training',
            "output = model.generate(**inputs, max_new_tokens=32, do_sample=False)",
            "print(tokenizer.decode(output[0], skip_special_tokens=True))",
            "```", "",
            "A base model continues text; it has no chat format yet. Generation stops at <|bos|> (the next document).",
        ]
    return "\n".join(lines) + "\n"


def check_exportable(config):
    """BadValue (a usage error: one line, exit 2) for a model transformers' NanoChat class cannot hold."""
    if hf_lacks(config):
        raise BadValue(f"transformers' NanoChat model has no {hf_lacks(config)}: only December-recipe models export "
                       f"(this checkpoint's model_config has window_pattern={config.window_pattern!r})")


def export_model(model, tokenizer, out_dir, dtype="float32", card=None):
    """Write `model` (our GPT) and `tokenizer` (RustBPETokenizer) to out_dir in the transformers NanoChat format,
    plus `card` as README.md when given. Everything is written to a temporary sibling directory first and renamed
    into place at the end, so out_dir is either complete or absent. Returns out_dir."""
    check_exportable(model.config)
    from safetensors.torch import save_file
    from transformers import GenerationConfig, NanoChatConfig

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
        # the tokenizer files are written directly (not by transformers' save_pretrained): see tokenizer_config_dict
        with open(os.path.join(staging, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer_json(tokenizer.enc))
        with open(os.path.join(staging, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(tokenizer_config_dict(config.sequence_len), f, indent=2, ensure_ascii=False)
        with open(os.path.join(staging, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(CHAT_TEMPLATE)
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
        model, tokenizer, meta = load_model(args.source, "cpu", phase="eval", model_tag=tag, step=step,
                                           weights_dtype=args.weights_dtype)
        check_exportable(model.config)
        padding_rows = model.padded_vocab_size - model.config.vocab_size  # in wte and lm_head, dropped on export
        n = sum(p.numel() for p in model.parameters()) - 2 * padding_rows * model.config.n_embd
        card = model_card(model.config, n, args.source, tag, step, meta, args.dtype, license=args.license,
                          base_model=args.base_model, path=args.out)
        out = export_model(model, tokenizer, args.out, dtype=args.dtype, card=card)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        parser.error(str(e))  # usage + the reason, exit status 2
    print(f"Exported the {args.source} model {tag} step {step} ({n:,} parameters, {args.dtype}) to {out}")
    print(f"Try it: python -c \"from transformers import pipeline; print(pipeline('text-generation', '{out}')('The capital of France is'))\"")


if __name__ == "__main__":
    run_main(main)
