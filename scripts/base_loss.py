"""
Bits per byte of a saved base model on the train and val shards, plus a few greedy samples.

    python -m scripts.base_loss                      # largest base model, last step
    torchrun --nproc_per_node=8 -m scripts.base_loss --model_tag=d20 --split_tokens=20971520
"""

from nanochat.attention import attn_flag
from nanochat.checkpoint_manager import PHASE_DIRS, checkpoint_model_config, load_model, resolve_checkpoint, weights_dtype_flag
from nanochat.common import compute_cleanup, compute_init, device_type_flag, print0
from nanochat.configurator import Flag, Flags, parse_flags_or_exit
from nanochat.dataloader import tokenizing_distributed_data_loader
from nanochat.dataset import split_parquet_files
from nanochat.loss_eval import evaluate_bpb
from nanochat.report import get_report
from nanochat.tokenizer import get_token_bytes
from nanochat.training import (
    CPU_EVAL_STEPS, DEFAULT_EVAL_TOKENS, autocast_ctx, check_sequence_length, dtype_flag, eval_steps_for, resolve_dtype,
    source_flags
)
from nanochat.usage import run_main

FLAGS = Flags(
    device_type_flag(),
    dtype_flag(),
    attn_flag(),
    source_flags("base", list(PHASE_DIRS)),
    weights_dtype_flag(),
    Flag("device_batch_size", 32, "rows per forward pass on each GPU", min=1),
    Flag("split_tokens", None, f"tokens evaluated per split; auto = {DEFAULT_EVAL_TOKENS:,} ({CPU_EVAL_STEPS} batches "
         f"on CPU, where that would take hours)", type=int, min=1),
    Flag("max_seq_len", None, "tokens per row; auto = the model's sequence_len", type=int, min=1),
    Flag("num_samples_tokens", 16, "tokens of each greedy sample", min=0),
)
DEFAULTS = FLAGS.defaults()

PROMPTS = [
    "The capital of France is",
    "The chemical symbol of gold is",
    "If yesterday was Friday, then tomorrow will be",
    "The opposite of hot is",
    "The planets of the solar system are:",
    "My favorite color is",
    "If 5*x + 3 = 13, then x is",
]


def main(argv=None):
    config = parse_flags_or_exit(FLAGS, argv, description=__doc__)
    # start-up checks, before the model loads: the checkpoint and tokenizer, then the shards it is measured on
    model_tag, step = resolve_checkpoint(config["source"], config["model_tag"], config["model_step"])
    model_config = checkpoint_model_config(config["source"], model_tag, step)
    check_sequence_length("--max_seq_len", config["max_seq_len"], model_config, f"the {config['source']} model {model_tag}")
    split_parquet_files("train"), split_parquet_files("val")
    ddp, rank, local_rank, world_size, device = compute_init(config["device_type"] or None)
    dtype = resolve_dtype(config["dtype"], device.type)
    model, tokenizer, meta = load_model(config["source"], device, phase="eval", model_tag=model_tag, step=step,
                                       weights_dtype=config["weights_dtype"])
    print0(f"attention: {model.set_attn(config['attn']).describe()}")
    T = config["max_seq_len"] or model.config.sequence_len  # auto: the model's
    B = config["device_batch_size"]
    steps = eval_steps_for(config["split_tokens"], B * T * world_size, device.type, flag="split_tokens")
    token_bytes = get_token_bytes(device=device)
    results = {}
    for split in ("train", "val"):
        loader = tokenizing_distributed_data_loader(B, T, split, device=device.type, tokenizer=tokenizer)
        with autocast_ctx(device.type, dtype):
            bpb = evaluate_bpb(model, loader, steps, token_bytes)
        results[f"{split} bpb"] = bpb
        print0(f"{split} bpb: {bpb:.4f} ({steps} batches of {B}x{T} per rank)")
    samples = []
    if rank == 0:
        for prompt in PROMPTS:
            tokens = tokenizer(prompt, prepend="<|bos|>")
            with autocast_ctx(device.type, dtype):
                out = list(model.generate(tokens, max_tokens=config["num_samples_tokens"], temperature=0))
            text = prompt + tokenizer.decode(out)
            samples.append(text)
            print0(repr(text))
        get_report().log(section="Base model loss", data=[results, {"samples": samples}])
    compute_cleanup()
    return results


if __name__ == "__main__":
    run_main(main)  # a usage error: one line, exit 2 (nanochat/usage.py); a bug keeps its traceback
