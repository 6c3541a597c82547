"""
Evaluate a base model on the CORE metric (DCLM's 22 in-context-learning tasks, centered accuracy).

    python -m scripts.base_eval                                   # latest base checkpoint, full CORE
    torchrun --nproc_per_node=8 -m scripts.base_eval              # same, examples split over 8 GPUs
    python -m scripts.base_eval --max_per_task=100 --device_type=cpu --bundle_dir=../shared/data/core_eval
    python -m scripts.base_eval --hf_path=openai-community/gpt2    # a Hugging Face causal LM and its tokenizer

Data: --bundle_dir, else $NANOCHAT_DATA_DIR/core_eval, else <base_dir>/eval_bundle, else it downloads nanochat's
eval_bundle.zip there. Writes <base_dir>/base_eval/<model>.csv and the "Base model evaluation" report section.

--hf_path (nanochat's --hf-path): a model id on the Hub or a local directory that transformers' AutoModelForCausalLM
and AutoTokenizer load (the optional `hf` extra: pip install -e '.[hf]'), scored the same way: every prompt starts with
the tokenizer's BOS token (its EOS when it has none, as GPT-2's <|endoftext|>); a model with learned positions (GPT-2)
sees at most that many tokens (`context_length`). A nanochat model exported with scripts.export_hf gets the same CORE
as its checkpoint.
"""

import contextlib
import csv
import io
import os

import torch

from nanochat.atomic import atomic_write
from nanochat.attention import attn_flag
from nanochat.checkpoint_manager import weights_dtype_flag
from nanochat.common import (
    autodetect_device_type, compute_cleanup, compute_init, device_type_flag, get_base_dir, print0
)
from nanochat.configurator import Flag, Flags
from nanochat.core_eval import evaluate_model, get_bundle_dir
from nanochat.distributed.dist import process_data_ranks
from nanochat.usage import BadValue, CannotRun, Missing, run_main


def write_results_csv(path, out):
    """Task, Accuracy, Centered per task (missing tasks with empty values and a note), then the CORE row."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["Task", "Accuracy", "Centered", "Note"])
    for label, acc in out["results"].items():
        w.writerow([label, f"{acc:.6f}", f"{out['centered_results'][label]:.6f}", ""])
    for label in out["missing"]:
        w.writerow([label, "", "", "missing data file"])
    note = f"partial: {out['num_tasks']}/{out['num_tasks_total']} tasks" if out["partial"] else ""
    w.writerow(["CORE", "", f"{out['core_metric']:.6f}", note])
    atomic_write(path, lambda f: f.write(buf.getvalue().encode("utf-8")))


def context_length(config):
    """
    The longest input CORE gives a transformers model (longer prompts lose their start, as for our GPT). A learned
    position table (GPT-2's 1024) is a hard limit. Rotary models have none (nanochat crops only GPT-2), except a
    nanochat export, which keeps our GPT's rotary table of 10 x sequence_len so it scores as its checkpoint.
    """
    positions = getattr(config, "max_position_embeddings", None)
    if config.model_type == "nanochat":
        return 10 * positions
    if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None):
        return None
    return positions


class HFCausalLM:
    """A transformers causal LM as core_eval calls a model: ids (B, T) -> logits (B, T, V), and its context length."""

    def __init__(self, model):
        self.model = model
        self.max_seq_len = context_length(model.config)

    @property
    def training(self):
        return self.model.training

    def eval(self):
        self.model.eval()
        return self

    def train(self, mode=True):
        self.model.train(mode)
        return self

    def __call__(self, input_ids):
        return self.model(input_ids=input_ids).logits


class HFTokenizer:
    """A transformers tokenizer as core_eval calls one: tokenizer(texts, prepend=bos_id), no special tokens added."""

    def __init__(self, tokenizer, name):
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if self.bos is None:
            raise ValueError(f"the tokenizer of {name} has neither a BOS nor an EOS token: CORE starts every prompt "
                             f"with one (nanochat's <|bos|>, GPT-2's <|endoftext|>)")

    def get_bos_token_id(self):
        return self.bos

    def __call__(self, texts, prepend=None):
        head = [] if prepend is None else [prepend]
        return [head + self.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def load_hf_model(hf_path, device):
    """(model, tokenizer, name for the csv/report) for a Hub id or local directory, in float32 on `device`."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise CannotRun(f"--hf_path needs transformers ({e}): pip install -e '.[hf]'") from None
    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    name = os.path.normpath(hf_path).strip(os.sep).replace(os.sep, "-")  # openai-community/gpt2 -> openai-community-gpt2
    return HFCausalLM(model), HFTokenizer(tokenizer, hf_path), name


FLAGS = Flags(
    Flag("hf_path", None, "a Hugging Face causal LM (Hub id or local dir) to evaluate instead of a nanochat "
         "checkpoint (needs the hf extra); auto = none, the base checkpoint", type=str),
    Flag("model_tag", None, "base checkpoint tag, e.g. d20; auto = the largest model", type=str, short="g"),
    Flag("step", None, "checkpoint step; auto = the last", type=int, short="s"),
    Flag("max_per_task", -1, "examples per task, -1 = all (fewer for quick checks)", min=-1),
    Flag("bundle_dir", None, "a local eval bundle dir (core.yaml, eval_data/...); auto = $NANOCHAT_DATA_DIR/core_eval, "
         "else <base_dir>/eval_bundle, else nanochat's eval_bundle.zip is downloaded there", type=str),
    device_type_flag(),
    Flag("dtype", "bfloat16", "autocast dtype on CUDA (CPU always runs float32)", choices=["bfloat16", "float32"]),
    weights_dtype_flag(),
    attn_flag(),
    description=__doc__,
)


def main(argv=None):
    args = FLAGS.parse_args(argv)
    if args.hf_path is not None and (args.model_tag is not None or args.step is not None):
        raise BadValue("--hf_path evaluates that model: leave out --model_tag/--step (they pick a nanochat checkpoint)")
    if args.max_per_task == 0:
        raise BadValue("--max_per_task must be -1 (all) or a positive number of examples, got 0")

    from nanochat.checkpoint_manager import load_model, resolve_checkpoint

    # start-up checks, before anything loads: the model (a local --hf_path directory, or the checkpoint and its
    # tokenizer), then the eval bundle (found, or downloaded now)
    if args.hf_path is not None:
        if args.hf_path.startswith((os.sep, ".", "~")) and not os.path.isdir(os.path.expanduser(args.hf_path)):
            raise Missing(f"--hf_path {args.hf_path} is not a directory (a local path; a Hub id looks like org/name)")
    else:
        model_tag, step = resolve_checkpoint("base", args.model_tag, args.step)
    device_type = args.device_type or autodetect_device_type()
    ddp, rank, local_rank, world_size, device = compute_init(device_type)
    bundle_dir = get_bundle_dir(args.bundle_dir)  # none anywhere: a usage error naming where it looked
    if args.hf_path is not None:
        model, tokenizer, model_name = load_hf_model(args.hf_path, device)
    else:
        model, tokenizer, meta = load_model("base", device, phase="eval", model_tag=model_tag, step=step,
                                            weights_dtype=args.weights_dtype)
        model_name = f"base_model_{meta['step']:06d}" if "step" in meta else "base_model"
        print0(f"attention: {model.set_attn(args.attn).describe()}")
    autocast = (torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
                if device_type == "cuda" and args.dtype == "bfloat16" else contextlib.nullcontext())
    with autocast:
        out = evaluate_model(model, tokenizer, device, max_per_task=args.max_per_task, bundle_dir=bundle_dir,
                             ranks=process_data_ranks())  # no tensor parallelism here: the process group's ranks

    if rank == 0:
        print0("=" * 70)
        print0(f"{'Task':<36}{'Accuracy':>10}{'Centered':>12}")
        for label, acc in out["results"].items():
            print0(f"{label:<36}{acc:>10.4f}{out['centered_results'][label]:>12.4f}")
        for label in out["missing"]:
            print0(f"{label:<36}{'missing':>10}{'-':>12}")
        core = f"{out['core_metric']:.4f}"
        if out["partial"]:
            core += f" (partial: {out['num_tasks']}/{out['num_tasks_total']} tasks)"
            print0(f"CORE metric: {core}; missing: {', '.join(out['missing'])}")
        else:
            print0(f"CORE metric: {core}")

        out_dir = os.path.join(get_base_dir(), "base_eval")
        os.makedirs(out_dir, exist_ok=True)
        csv_path = os.path.join(out_dir, f"{model_name}.csv")
        write_results_csv(csv_path, out)
        print0(f"Results written to {csv_path}")

        from nanochat.report import get_report

        summary = {"Model": model_name, "CORE metric": core, "max_per_task": args.max_per_task,
                   "Eval bundle": out["bundle_dir"]}
        if out["partial"]:
            summary["Missing tasks"] = list(out["missing"])
        get_report().log(section="Base model evaluation", data=[summary, out["centered_results"]])
    compute_cleanup()
    return out


if __name__ == "__main__":
    run_main(main)  # a usage error: one line, exit 2 (nanochat/usage.py); a bug keeps its traceback
