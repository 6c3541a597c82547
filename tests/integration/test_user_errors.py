"""
Every edge a user touches: a table of typical mistakes (misspelled flags, wrong types, values out of range, invalid
combinations, missing checkpoints / steps / tokenizer / data / bundle, bad paths), each run through a real entry
point. For every one: exactly one line on stderr (`error: ...`, log lines aside), naming the flag or file; the exit
status (2 for a usage error); no traceback; and nothing written to the base directory.

Most rows run in this process through the script's own `__main__` path (nanochat.usage.run_main(main, argv)), which
is what `python -m scripts.X` runs; they stop before any model is built. A representative set runs as real
subprocesses (`python -m ...`), and the launchers (runcpu.sh, speedrun.sh, run1000.sh, pretrain.sh, volc_submit.sh)
always do. One torchrun row checks that a two-rank job prints the line once.
"""

import importlib
import importlib.util
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_torchrun, subprocess_env  # noqa: F401  (run_torchrun: the dist row's launcher)
from nanochat.usage import run_main

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d - [\w.]+ - (DEBUG|INFO|WARNING) - ")
NO_CUDA = not torch.cuda.is_available()
# no task data anywhere: an empty HF cache, offline, and downloads through a proxy that does not answer
NO_TASK_DATA = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": "{tmp}/hf_home",
                "HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}

# a user with no wandb login: no key in the environment, no netrc, no wandb settings
NO_WANDB_LOGIN = {"HOME": "{tmp}/home", "NETRC": None, "WANDB_API_KEY": None, "WANDB_MODE": None,
                  "WANDB_DISABLED": None, "WANDB_IDENTITY_TOKEN_FILE": None, "WANDB_CONFIG_DIR": "{tmp}/wandb_config",
                  "WANDB_DIR": "{tmp}"}
NO_WANDB_LOGIN_SHELL = {k: "" for k in NO_WANDB_LOGIN if k != "HOME"}  # the launchers' rows: empty is unset
# a GPU node whose torch cannot use the GPU (a CPU-only build; here any build, no driver): a fake nvidia-smi lists one
FAKE_GPU = {"PATH": "{tmp}/fake_gpu:{PATH}", "CUDA_VISIBLE_DEVICES": None}
FAKE_NVIDIA_SMI = """#!/bin/sh
case "$1" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)" ;;
  *) echo "550.54.15" ;;
esac
"""
# one process of a torchrun job of 2 (4) ranks, as torchrun's environment says, before any process group exists
TWO_RANKS = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
FOUR_RANKS = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# (module, argv, world, text the error line must contain). world: "empty" = a base dir with nothing in it; "full" =
# shards, a 512-token tokenizer and a base checkpoint d1 at step 7 (sequence_len 64); "chat" = "full" and mid and sft
# checkpoints d1 at step 7, and a base checkpoint "gqa" whose meta asks for 4 query heads over 3 key/value heads.
# Status 2 unless a row is a dict saying otherwise ("status"). Every row stops before a model or a process group is
# built and before the CORE bundle is fetched (test_mistake_is_one_line_and_changes_nothing fails the row if one is).
# {tmp}: the scratch dir; {busy_port}: a port something listens on; {PATH}: this process's PATH.
CASES = [
    # ---------------------------------------------------------------- base_train
    ("scripts.base_train", ["--dpeth=4"], "full", "Did you mean: --depth"),
    ("scripts.base_train", ["--depth=0"], "full", "--depth must be >= 1, got 0"),
    ("scripts.base_train", ["--depth=abc"], "full", "--depth expects an integer"),
    ("scripts.base_train", ["--depth"], "full", "--depth needs a value"),
    ("scripts.base_train", ["4"], "full", "unexpected argument '4'"),
    ("scripts.base_train", ["--device_batch_size=0"], "full", "--device_batch_size must be >= 1"),
    ("scripts.base_train", ["--device_batch_size=-1"], "full", "--device_batch_size must be >= 1"),
    ("scripts.base_train", ["--max_seq_len=0"], "full", "--max_seq_len must be >= 1"),
    ("scripts.base_train", ["--total_batch_size=0"], "full", "--total_batch_size must be >= 1"),
    ("scripts.base_train", ["--warmdown_ratio=1.5"], "full", "--warmdown_ratio must be between 0 and 1"),
    ("scripts.base_train", ["--warmup_ratio=-0.1"], "full", "--warmup_ratio must be between"),
    ("scripts.base_train", ["--warmup_ratio=0.5", "--warmdown_ratio=0.8"], "full",
     "--warmup_ratio + --warmdown_ratio must be <= 1"),
    ("scripts.base_train", ["--final_lr_frac=2"], "full", "--final_lr_frac must be between"),
    ("scripts.base_train", ["--matrix_lr=-1"], "full", "--matrix_lr must be >= 0"),
    ("scripts.base_train", ["--embedding_lr=fast"], "full", "--embedding_lr expects a number"),
    ("scripts.base_train", ["--weight_decay=-0.1"], "full", "--weight_decay must be >= 0"),
    ("scripts.base_train", ["--eval_tokens=0"], "full", "--eval_tokens must be >= 1"),
    ("scripts.base_train", ["--core_metric_max_per_task=-5"], "full", "--core_metric_max_per_task must be >= -1"),
    ("scripts.base_train", ["--resume_from_step=-2"], "full", "--resume_from_step must be a saved step number, auto"),
    ("scripts.base_train", ["--resume_from_step=99", "--depth=1"], "full", "checkpoint step 99 is incomplete or missing"),
    ("scripts.base_train", ["--resume_from_step=99"], "full", "checkpoint step 99 is incomplete or missing"),
    ("scripts.base_train", ["--resume_from_step=latest"], "full", "--resume_from_step expects an integer or auto"),
    ("scripts.base_train", ["--resume_from_step=3", "--model_tag=d9"], "full", "d9 does not exist"),
    ("scripts.base_train", ["--data_world_size=0"], "full", "--data_world_size must be >= 1"),
    ("scripts.base_train", ["--ac_every=0"], "full", "--ac_every must be >= 1"),
    ("scripts.base_train", ["--tp_size=0"], "full", "--tp_size must be >= 1"),
    ("scripts.base_train", ["--activation_checkpointing=some"], "full", "--activation_checkpointing must be one of"),
    ("scripts.base_train", ["--fp8_recipe=blockwise"], "full", "--fp8_recipe must be one of"),
    ("scripts.base_train", ["--device_type=tpu"], "full", "--device_type must be one of cuda|cpu|mps"),
    ("scripts.base_train", ["--init=xavier"], "full", "--init must be one of"),
    ("scripts.base_train", ["--dtype=fp16"], "full", "--dtype must be one of"),
    ("scripts.base_train", ["--use_muon=maybe"], "full", "--use_muon expects a boolean"),
    ("scripts.base_train", ["--compile=sometimes"], "full", "--compile"),
    ("scripts.base_train", ["--num_iterations=-1", "--target_flops=-1", "--target_param_data_ratio=-1"], "full",
     "set one of --num_iterations, --target_flops or --target_param_data_ratio"),
    ("scripts.base_train", ["--depth=1"], "empty", "no parquet shards in"),
    {"env": {"NANOCHAT_COMPILE": "maybe"}, "case": ("scripts.base_train", ["--device_type=cpu", "--depth=1"], "full",
                                                  "--compile must be auto, 1 or 0")},
    {"env": {"NANOCHAT_BASE_DIR": "{tmp}/broken_hf/config.json"},
     "case": ("scripts.chat_cli", ["-p", "hi"], "empty", "is a file, not a directory")},
    {"env": {"NANOCHAT_WEIGHTS_DTYPE": "fp16"},
     "case": ("scripts.chat_cli", ["-i", "base", "-p", "hi", "--device_type=cpu"], "full", "NANOCHAT_WEIGHTS_DTYPE")},
    ("scripts.base_train", ["--device_type=cpu", "--fp8=1"], "full", "--fp8=1 needs"),
    ("scripts.base_train", ["--device_type=cpu", "--attn=fa3"], "full", "--attn=fa3 needs a Hopper (9.x) GPU"),
    ("scripts.mid_train", ["--device_type=cpu", "--max_seq_len=64", "--attn=sdpa_cudnn"], "full",
     "--attn=sdpa_cudnn: torch has no cudnn attention kernel for CPU/MPS"),
    ("scripts.base_train", ["--device_type=cpu", "--tp_size=2"], "full", "--tp_size=2 does not divide the world size 1"),
    ("scripts.base_train", ["--device_type=cpu", "--use_fsdp=1"], "full", "--use_fsdp=1 needs torch.distributed"),
    ("scripts.base_train", ["--device_type=cpu", "--fsdp_defer_grad_sync=1"], "full",
     "--fsdp_defer_grad_sync=1 needs --use_fsdp=1"),
    ("scripts.base_train", ["--device_type=cpu", "--depth=1", "--max_seq_len=64", "--device_batch_size=3",
                            "--total_batch_size=1000"], "full", "--total_batch_size=1000 is not divisible"),
    pytest.param("scripts.base_train", ["--device_type=cuda"], "full", "--device_type=cuda",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="a machine with CUDA can run it")),
    # model shape and layout, before any process group or model: --depth, --tp_size vs the heads (at any world size)
    ("scripts.base_train", ["--depth=21"], "full", "--depth=21 gives n_embd=1344 which does not split into 11 heads"),
    {"env": FOUR_RANKS, "case": ("scripts.base_train", ["--device_type=cpu", "--tp_size=4", "--depth=20"], "full",
                                 "--tp_size=4 does not divide n_head=10 (each tp rank takes whole heads); use one of: 1, 2")},
    {"env": TWO_RANKS, "case": ("scripts.base_train", ["--device_type=cpu", "--tp_size=2", "--depth=1"], "full",
                                "--tp_size=2 does not divide n_head=1")},
    {"env": NO_WANDB_LOGIN, "case": ("scripts.base_train", ["--run=myrun", "--depth=1"], "full",
                                     "--run=myrun logs to wandb, but no wandb login found")},
    # ---------------------------------------------------------------- base_loss
    ("scripts.base_loss", ["--device_batch_size=-1"], "full", "--device_batch_size must be >= 1"),
    ("scripts.base_loss", ["--split_tokens=0"], "full", "--split_tokens must be >= 1"),
    ("scripts.base_loss", ["--max_seq_len=0"], "full", "--max_seq_len must be >= 1"),
    ("scripts.base_loss", ["--model_step=-1"], "full", "--model_step must be >= 0"),
    ("scripts.base_loss", ["--source=chat"], "full", "--source must be one of base|mid|sft|rl"),
    ("scripts.base_loss", ["--model_tag=d99"], "full", "no checkpoints for model tag 'd99'"),
    ("scripts.base_loss", ["--model_step=5"], "full", "checkpoint step 5 is incomplete or missing"),
    ("scripts.base_loss", [], "empty", "no base checkpoints"),
    ("scripts.base_loss", ["--num_samples_tokens=-1"], "full", "--num_samples_tokens must be >= 0"),
    ("scripts.base_loss", ["--max_seq_len=100000"], "full",
     "--max_seq_len=100000 is longer than the base model d1 can take: its rotary table covers 640 positions"),
    # ---------------------------------------------------------------- base_eval
    ("scripts.base_eval", ["--hf_path=/nonexistent"], "full", "--hf_path /nonexistent is not a directory"),
    ("scripts.base_eval", ["--hf_path=gpt2", "-g", "d1"], "full", "--hf_path evaluates that model"),
    ("scripts.base_eval", ["--max_per_task=0"], "full", "--max_per_task must be -1 (all) or a positive number"),
    ("scripts.base_eval", ["--max_per_task=-5"], "full", "--max_per_task must be >= -1"),
    ("scripts.base_eval", [], "empty", "no base checkpoints"),
    ("scripts.base_eval", ["-s", "3"], "full", "checkpoint step 3 is incomplete or missing"),
    ("scripts.base_eval", ["--device_type=cpu", "--bundle_dir=/nonexistent"], "full",
     "--bundle_dir /nonexistent is not a CORE eval bundle"),
    ("scripts.base_eval", ["--dtype=float16"], "full", "--dtype must be one of"),
    # ---------------------------------------------------------------- mid_train
    ("scripts.mid_train", ["--device_batch_size=0"], "full", "--device_batch_size must be >= 1"),
    ("scripts.mid_train", ["--init_lr_frac=0"], "full", "--init_lr_frac must be > 0 (got 0.0)"),
    ("scripts.mid_train", ["--max_seq_len=-1"], "full", "--max_seq_len must be >= 1"),
    ("scripts.mid_train", ["--total_batch_size=0"], "full", "--total_batch_size must be >= 1"),
    ("scripts.mid_train", ["--eval_tokens=-3"], "full", "--eval_tokens must be >= 1"),
    ("scripts.mid_train", ["--dry_run=maybe"], "full", "--dry_run expects a boolean"),
    ("scripts.mid_train", [], "empty", "cannot load the base model"),
    ("scripts.mid_train", ["--model_step=99"], "full", "checkpoint step 99 is incomplete or missing"),
    ("scripts.mid_train", ["--model_tag=d7"], "full", "no checkpoints for model tag 'd7'"),
    ("scripts.mid_train", ["--totl_batch_size=8"], "full", "Did you mean: --total_batch_size"),
    ("scripts.mid_train", ["--max_seq_len=64", "--resume_from_step=99"], "full", "checkpoint step 99 is incomplete"),
    ("scripts.mid_train", ["--max_seq_len=4096"], "full",
     "--max_seq_len=4096 is longer than the base model d1 can take: its rotary table covers 640 positions (10 x its "
     "sequence_len 64); use --max_seq_len <= 640"),
    ("scripts.mid_train", ["--model_tag=gqa"], "chat", "n_kv_head=3 must divide n_head=4"),
    {"env": TWO_RANKS, "case": ("scripts.mid_train", ["--device_type=cpu", "--tp_size=2", "--max_seq_len=64"], "full",
                                "--tp_size=2 does not divide n_head=1")},
    {"env": NO_WANDB_LOGIN, "case": ("scripts.mid_train", ["--run=myrun", "--max_seq_len=64"], "full",
                                     "no wandb login found")},
    {"env": NO_TASK_DATA,  # the task data: not local, not in an HF cache, no network; stops before the model loads
     "case": ("scripts.mid_train", ["--device_type=cpu", "--device_batch_size=4", "--max_seq_len=64",
                                    "--total_batch_size=256"], "full", "no data for the mid-training data")},
    # ---------------------------------------------------------------- chat_sft
    ("scripts.chat_sft", ["--target_examples_per_step=0"], "full", "--target_examples_per_step must be >= 1"),
    ("scripts.chat_sft", ["--device_batch_size=0"], "full", "--device_batch_size must be >= 1"),
    ("scripts.chat_sft", ["--num_epochs=0"], "full", "--num_epochs must be >= 1"),
    ("scripts.chat_sft", ["--eval_steps=0"], "full", "--eval_steps must be >= 1"),
    ("scripts.chat_sft", ["--source=sft"], "full", "--source must be one of base|mid"),
    ("scripts.chat_sft", ["--init_lr_frac=-1"], "full", "--init_lr_frac must be > 0 (got -1"),
    ("scripts.chat_sft", ["--eval_metrics_max_problems=0"], "full", "--eval_metrics_max_problems must be >= 1"),
    ("scripts.chat_sft", [], "empty", "cannot load the mid model"),
    {"env": NO_TASK_DATA,
     "case": ("scripts.chat_sft", ["--source=base", "--device_type=cpu", "--target_examples_per_step=8"], "full",
              "no data for the SFT data")},
    ("scripts.chat_sft", ["--source=base", "--device_type=cpu", "--device_batch_size=3"], "full",
     "--target_examples_per_step=32 is not divisible by device_batch_size * world_size = 3 * 1"),
    ("scripts.chat_sft", ["--source=base", "--model_step=8"], "full", "checkpoint step 8 is incomplete or missing"),
    ("scripts.chat_sft", ["--source=base", "--resume_from_step=99"], "full", "checkpoint step 99 is incomplete"),
    {"env": TWO_RANKS, "case": ("scripts.chat_sft", ["--device_type=cpu", "--tp_size=2"], "chat",
                                "--tp_size=2 does not divide n_head=1")},
    # ---------------------------------------------------------------- chat_rl
    ("scripts.chat_rl", ["--examples_per_step=0"], "full", "--examples_per_step must be >= 1"),
    ("scripts.chat_rl", ["--num_samples=0"], "full", "--num_samples must be >= 1"),
    ("scripts.chat_rl", ["--device_batch_size=0"], "full", "--device_batch_size must be >= 1"),
    ("scripts.chat_rl", ["--temperature=-1"], "full", "--temperature must be >= 0"),
    ("scripts.chat_rl", ["--top_k=-1"], "full", "--top_k must be >= 0"),
    ("scripts.chat_rl", ["--max_new_tokens=0"], "full", "--max_new_tokens must be >= 1"),
    ("scripts.chat_rl", ["--eval_examples=0"], "full", "--eval_examples must be >= 1"),
    ("scripts.chat_rl", ["--tp_size=2"], "full", "chat_rl samples on each rank alone, which --tp_size=2"),
    ("scripts.chat_rl", ["--source=base"], "full", "--source must be one of sft|mid"),
    ("scripts.chat_rl", [], "empty", "cannot load the sft model"),
    ("scripts.chat_rl", ["--resume_from_step=99"], "chat", "checkpoint step 99 is incomplete or missing"),
    {"env": TWO_RANKS, "case": ("scripts.chat_rl", ["--examples_per_step=3"], "chat",
                                "--examples_per_step=3 must be divisible by the 2 ranks")},
    # ---------------------------------------------------------------- chat_eval
    ("scripts.chat_eval", ["-i", "sft", "-b", "0"], "full", "--batch_size must be >= 1"),
    ("scripts.chat_eval", ["-i", "sft", "-a", "ARC-Easy", "--max_problems=-5"], "full", "--max_problems must be >= 1"),
    ("scripts.chat_eval", ["-i", "sft", "-x", "0"], "full", "--max_problems must be >= 1"),
    ("scripts.chat_eval", ["-i", "sft", "-a", "ARC-Hard"], "full", "-a/--task_name: unknown task(s) ARC-Hard"),
    ("scripts.chat_eval", ["-i", "sft", "-a", "ARC-Easy|Foo"], "full", "unknown task(s) Foo"),
    ("scripts.chat_eval", ["-i", "sft", "-n", "0"], "full", "--num_samples must be >= 1"),
    ("scripts.chat_eval", ["-i", "sft", "-m", "0"], "full", "--max_new_tokens must be >= 1"),
    ("scripts.chat_eval", ["-i", "sft", "-t", "-0.5"], "full", "--temperature must be >= 0"),
    ("scripts.chat_eval", ["-i", "sft", "-k", "-1"], "full", "--top_k must be >= 0"),
    ("scripts.chat_eval", ["-i", "chat"], "full", "--source must be one of base|mid|sft|rl"),
    ("scripts.chat_eval", ["-a", "ARC-Easy"], "full", "missing required --source"),
    ("scripts.chat_eval", ["-i", "sft", "-a", "ARC-Easy"], "empty", "no sft checkpoints"),
    ("scripts.chat_eval", ["-i", "base", "-g", "d9", "-a", "ARC-Easy"], "full", "no checkpoints for model tag 'd9'"),
    ("scripts.chat_eval", ["-i", "base", "-s", "99", "-a", "ARC-Easy"], "full", "checkpoint step 99"),
    ("scripts.chat_eval", ["-i", "sft", "-d", "float16"], "full", "--dtype must be one of"),
    ("scripts.chat_eval", ["-i", "sft", "--task-nme=GSM8K"], "full", "Did you mean: --task_name"),
    ("scripts.chat_eval", ["-i", "base", "-a", "ARC-Easy", "--data_dir=/nonexistent"], "full",
     "--data_dir /nonexistent is not a directory"),
    {"env": NO_TASK_DATA, "case": ("scripts.chat_eval", ["-i", "base", "-a", "ARC-Easy|GSM8K", "--data_dir={tmp}",
                                                         "--device_type=cpu"], "full",
                                   "no data for any task asked for (ARC-Easy, GSM8K)")},
    # ---------------------------------------------------------------- chat_cli
    ("scripts.chat_cli", ["-t", "-1"], "full", "--temperature must be >= 0"),
    ("scripts.chat_cli", ["-k", "-1"], "full", "--top_k must be >= 0"),
    ("scripts.chat_cli", ["-m", "0"], "full", "--max_tokens must be >= 1"),
    ("scripts.chat_cli", ["-p", "hi"], "empty", "no sft checkpoints"),
    ("scripts.chat_cli", ["-i", "base", "-s", "42", "-p", "hi"], "full", "checkpoint step 42"),
    ("scripts.chat_cli", ["--promt=hi"], "full", "Did you mean: --prompt"),
    ("scripts.chat_cli", ["-i", "base", "-s", "x"], "full", "--step expects an integer"),
    # ---------------------------------------------------------------- chat_web
    ("scripts.chat_web", ["--port=0"], "full", "--port must be in 1..65535"),
    ("scripts.chat_web", ["--num_gpus=0"], "full", "--num_gpus must be >= 1"),
    ("scripts.chat_web", ["--temperature=99"], "full", "--temperature must be in"),
    ("scripts.chat_web", ["-i", "base", "-s", "42", "--device_type=cpu"], "full", "checkpoint step 42"),
    ("scripts.chat_web", ["--api_key=a", "--api_key_file=b"], "full", "--api_key and --api_key_file both given"),
    ("scripts.chat_web", ["-i", "base", "--device_type=cpu", "--port={busy_port}"], "full",
     "cannot listen on 127.0.0.1:{busy_port} (another process listens there)"),
    # ---------------------------------------------------------------- export_hf / import_hf
    ("scripts.export_hf", ["-i", "base"], "full", "missing required --out"),
    ("scripts.export_hf", ["-i", "base", "--out", "{tmp}/hf", "--dtype=int8"], "full", "--dtype must be one of"),
    pytest.param("scripts.export_hf", ["-i", "base", "-o", "/proc/nanochat-export"], "full",
                 "--out /proc/nanochat-export: /proc does not take new directories",
                 marks=pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="export needs transformers")),
    ("scripts.import_hf", ["-i", "base"], "full", "missing required DIR"),
    ("scripts.import_hf", ["{tmp}/nonexistent", "-i", "base"], "full", "config.json does not exist"),
    ("scripts.import_hf", ["{tmp}/broken_hf", "-i", "base"], "full", "broken_hf/config.json is not valid JSON"),
    # ---------------------------------------------------------------- tok_train / tok_eval
    ("scripts.tok_train", ["--vocab_size=100"], "full", "--vocab_size must be >= 265"),
    ("scripts.tok_train", ["--max_chars=0"], "full", "--max_chars must be >= 1"),
    ("scripts.tok_train", ["--doc_cap=-1"], "full", "--doc_cap must be >= 1"),
    ("scripts.tok_train", ["--vocab-size=abc"], "full", "--vocab_size expects an integer"),
    ("scripts.tok_train", [], "full", "Pass --force to replace it"),
    ("scripts.tok_train", [], "empty", "which has 0 shard(s)"),
    ("scripts.tok_eval", ["--max_shard_chars=-1"], "full", "--max_shard_chars must be >= 0"),
    ("scripts.tok_eval", ["--reference_timeout=-1"], "full", "--reference_timeout must be >= 0"),
    ("scripts.tok_eval", [], "empty", "no tokenizer at"),
    # ---------------------------------------------------------------- data, presets, report
    ("nanochat.dataset", ["-n", "0"], "empty", "-n must be a positive number of shards"),
    ("nanochat.dataset", ["-w", "0"], "empty", "-w must be at least 1"),
    ("nanochat.dataset", ["--max_attempts=0"], "empty", "--max_attempts must be at least 1"),
    ("nanochat.dataset", ["--num-filez=3"], "empty", "Did you mean: --num_files"),
    ("nanochat.dataset", ["import"], "empty", "missing required PATHS"),
    ("nanochat.dataset", ["import", "a.txt", "--val_paths", "b.txt", "--val_docs", "2"], "empty",
     "give either --val_paths or --val_docs"),
    ("nanochat.presets", ["--depth=0"], "empty", "--depth must be >= 1"),
    ("nanochat.presets", ["--depth=20", "--format=yaml"], "empty", "--format must be one of"),
    ("nanochat.presets", ["--depth=21"], "empty", "--depth=21"),
    ("nanochat.presets", ["--depth=20", "--world_size=0"], "empty", "--world_size must be >= 1"),
]

# A GPU node whose torch cannot use its GPUs: every entry point that picks the device itself refuses with
# nanochat.setup_check's message (status 1, as `python -m nanochat.setup_check gpu`), before any model loads
AUTODETECT_CASES = [
    ("scripts.base_train", ["--depth=1"], "full"),
    ("scripts.mid_train", ["--max_seq_len=64"], "full"),
    ("scripts.chat_sft", ["--source=base"], "full"),
    ("scripts.chat_rl", [], "chat"),
    ("scripts.base_loss", [], "full"),
    ("scripts.base_eval", [], "full"),
    ("scripts.chat_eval", ["-i", "base", "-a", "ARC-Easy"], "full"),
    ("scripts.chat_cli", ["-i", "base", "-p", "hi"], "full"),
    ("scripts.chat_web", ["-i", "base"], "full"),
]
CASES += [{"env": FAKE_GPU, "status": 1, "case": (module, argv, world, f"but torch {torch.__version__} cannot use them")}
          for module, argv, world in AUTODETECT_CASES]


def _row(row):
    """A CASES row as pytest.param(module, argv, world, needle, env, status): env holds environment variables to set
    (None: to unset)."""
    env, marks, status = {}, (), 2
    if isinstance(row, dict):
        env, status, row = row["env"], row.get("status", 2), row["case"]
    elif hasattr(row, "values"):  # a pytest.param with marks
        row, marks = row.values, row.marks
    module, argv, world, needle = row
    name = f"{module.split('.')[-1]} {' '.join(argv)} [{world}]" + "".join(f" {k}={v}" for k, v in env.items())
    return pytest.param(module, argv, world, needle, env, status, marks=marks, id=name)


ROWS = [_row(row) for row in CASES]


def files_under(root):
    """{path: (size, mtime)} of every file under root, following the shards' symlink: what a command may not change."""
    out = {}
    for d, _, names in os.walk(root, followlinks=True):
        for n in names:
            p = os.path.join(d, n)
            st = os.stat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def worlds(tiny_base_dir, tmp_path_factory):
    """The two base dirs of the table, and a scratch dir ({tmp} in argv) with a broken transformers directory."""
    from chat_fixtures import tiny_model
    from nanochat.checkpoint_manager import save_checkpoint
    from nanochat.tokenizer import RustBPETokenizer

    root = tmp_path_factory.mktemp("user_errors")
    empty = root / "empty"
    empty.mkdir()
    full = root / "full"
    full.mkdir()
    os.symlink(tiny_base_dir / "base_data", full / "base_data")
    os.symlink(tiny_base_dir / "tokenizer", full / "tokenizer")
    vocab = RustBPETokenizer.from_directory(str(tiny_base_dir / "tokenizer")).get_vocab_size()
    meta = {"model_config": {"sequence_len": 64, "vocab_size": vocab, "n_layer": 1, "n_head": 1, "n_kv_head": 1,
                             "n_embd": 64}, "step": 7}
    model = tiny_model(vocab, depth=1, sequence_len=64)
    save_checkpoint(str(full / "base_checkpoints" / "d1"), 7, model.state_dict(), None, meta)
    chat = root / "chat"
    chat.mkdir()
    for name in ("base_data", "tokenizer"):
        os.symlink(tiny_base_dir / name, chat / name)
    for stage in ("base_checkpoints", "mid_checkpoints", "chatsft_checkpoints"):
        save_checkpoint(str(chat / stage / "d1"), 7, model.state_dict(), None, meta)
    gqa = {**meta, "model_config": {**meta["model_config"], "n_head": 4, "n_kv_head": 3}}  # a hand-edited meta
    save_checkpoint(str(chat / "base_checkpoints" / "gqa"), 7, model.state_dict(), None, gqa)
    scratch = root / "scratch"
    (scratch / "broken_hf").mkdir(parents=True)
    (scratch / "broken_hf" / "config.json").write_text('{"model_type": "nanochat", oops}')
    fake_gpu = scratch / "fake_gpu"
    fake_gpu.mkdir()
    fake_smi = fake_gpu / "nvidia-smi"
    fake_smi.write_text(FAKE_NVIDIA_SMI)
    fake_smi.chmod(0o755)
    busy = socket.create_server(("127.0.0.1", 0))  # listening for the whole module: chat_web's --port is taken
    yield {"empty": empty, "full": full, "chat": chat, "tmp": scratch, "busy_port": str(busy.getsockname()[1])}
    busy.close()


def check_one_error_line(err, needle, where):
    lines = [line for line in err.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert "Traceback" not in err, f"{where}: a traceback\n{err}"
    assert len(lines) == 1, f"{where}: expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("error: ") and needle in lines[0], f"{where}: {lines[0]!r} lacks {needle!r}"


def fill(text, worlds):
    """A row's text with {tmp}, {busy_port} and {PATH} filled in."""
    return (text.replace("{tmp}", str(worlds["tmp"])).replace("{busy_port}", worlds["busy_port"])
            .replace("{PATH}", os.environ.get("PATH", "")))


def refuse(what):
    def built(*args, **kwargs):
        raise AssertionError(f"{what} before the error: a start-up check comes too late")
    return built


@pytest.mark.parametrize("module,argv,world,needle,env,status", ROWS)
def test_mistake_is_one_line_and_changes_nothing(module, argv, world, needle, env, status, worlds, monkeypatch, capfd):
    import nanochat.core_eval
    import nanochat.gpt

    base = worlds[world]
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, fill(v, worlds))
    # nothing is built before a mistake is found: no model, no process group, no eval bundle download
    monkeypatch.setattr(nanochat.gpt.GPT, "__init__", refuse("a model was built"))
    monkeypatch.setattr(torch.distributed, "init_process_group", refuse("a process group was made"))
    monkeypatch.setattr(nanochat.core_eval, "download_eval_bundle", refuse("the CORE bundle was downloaded"))
    if env.get("HF_HUB_OFFLINE") == "1":
        # huggingface_hub and datasets read their offline switches when first imported: a process started with
        # them set (what the row stands for) is offline, but in this process an earlier test may have imported them
        # online, and then every lookup retries the dead proxy for a minute or more
        for hf_module, names in (("huggingface_hub.constants", ["HF_HUB_OFFLINE"]),
                                 ("datasets.config", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])):
            if hf_module in sys.modules:
                for name in names:
                    monkeypatch.setattr(sys.modules[hf_module], name, True)
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr("nanochat.core_eval.EVAL_BUNDLE_URL", "http://127.0.0.1:9/eval_bundle.zip")
    argv = [fill(a, worlds) for a in argv]
    before = files_under(base)
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        run_main(main, argv)
    err = capfd.readouterr().err
    assert e.value.code == status, f"exit status {e.value.code}\n{err}"
    check_one_error_line(err, fill(needle, worlds), f"{module} {argv}")
    assert files_under(base) == before, f"{module} {argv} wrote into the base dir"
    assert not (worlds["tmp"] / "hf").exists()


# -------------------------------------------------------------------------------------------------------------------
# the same path as real processes: `python -m`, the shell launchers, torchrun

SUBPROCESS_CASES = [
    (["-m", "scripts.base_train", "--warmdown_ratio=1.5"], "full", 2, "--warmdown_ratio must be between"),
    (["-m", "scripts.base_loss", "--device_batch_size=-1"], "full", 2, "--device_batch_size must be >= 1"),
    (["-m", "scripts.chat_eval", "-i", "sft", "-b", "0"], "full", 2, "--batch_size must be >= 1"),
    (["-m", "scripts.chat_sft"], "empty", 2, "cannot load the mid model"),
    (["-m", "scripts.tok_train"], "full", 2, "Pass --force"),
    (["-m", "scripts.import_hf", "{tmp}/broken_hf", "-i", "base"], "full", 2, "config.json is not valid JSON"),
    (["-m", "scripts.base_eval", "--hf_path=/nonexistent"], "full", 2, "--hf_path /nonexistent"),
    (["-m", "nanochat.report", "frobnicate"], "empty", 2, "unknown command 'frobnicate'"),
    (["-m", "scripts.launch", "runcpu.sh", "--dryrun"], "empty", 2, "Did you mean: --dry_run"),
]


def run(cmd, base, **env):
    e = subprocess_env(base, **env)
    e.pop("NANOCHAT_DATA_DIR", None)
    return subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a python process each (2-4 s): the same path as the in-process rows, end to end
@pytest.mark.parametrize("argv,world,status,needle", SUBPROCESS_CASES, ids=[" ".join(c[0][1:]) for c in SUBPROCESS_CASES])
def test_entry_point_process(argv, world, status, needle, worlds):
    base = worlds[world]
    before = files_under(base)
    argv = [a.replace("{tmp}", str(worlds["tmp"])) for a in argv]
    p = run([sys.executable, *argv], base)
    assert p.returncode == status, p.stderr
    check_one_error_line(p.stderr, needle, " ".join(argv))
    assert files_under(base) == before


@pytest.mark.slow  # a training step in this process (~10 s on 2 busy cores); the refusals above are in the fast lane
def test_cpu_on_a_gpu_node_is_asked_for_not_fallen_into(base_dir, worlds, monkeypatch):
    """Where nvidia-smi lists a GPU that this torch cannot use, the refusal (AUTODETECT_CASES) is for autodetection:
    --device_type=cpu still trains, and GPUs hidden on purpose (CUDA_VISIBLE_DEVICES="") autodetect the CPU."""
    from nanochat.common import autodetect_device_type
    from scripts import base_train

    monkeypatch.setenv("PATH", fill(FAKE_GPU["PATH"], worlds))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = base_train.main(["--depth=1", "--max_seq_len=32", "--device_batch_size=2", "--total_batch_size=64",
                           "--num_iterations=1", "--eval_every=-1", "--core_metric_every=-1", "--sample_every=-1",
                           "--device_type=cpu", "--model_tag=asked"])
    assert out["step"] == 1 and (base_dir / "base_checkpoints" / "asked" / "model_000001.pt").exists()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert autodetect_device_type() == "cpu"


def test_a_bug_keeps_its_traceback(tmp_path):
    """run_main turns only known mistakes into one line: anything else is a bug and keeps its traceback."""
    code = ("from nanochat.usage import run_main\n"
            "def main(argv):\n    return {}['no such key']\n"
            "run_main(main)\n")
    p = run([sys.executable, "-c", code], tmp_path)
    assert p.returncode == 1 and "Traceback" in p.stderr and "KeyError" in p.stderr


# launchers: (script, args, status, text on stderr (or stdout for --help)[, environment]); pretrain.sh's checks import
# torch (base_train checks the flags it passes on), a couple of seconds each
LAUNCHER_CASES = [
    ("runcpu.sh", ["--help"], 0, "usage: bash runcpu.sh"),
    ("runcpu.sh", ["-h"], 0, "--dry_run"),
    ("runcpu.sh", ["--dryrun"], 2, "Did you mean: --dry_run"),
    ("runcpu.sh", ["--dry_run=2"], 2, "--dry_run expects a boolean"),
    ("runcpu.sh", ["extra"], 2, "unexpected argument 'extra'"),
    ("runcpu.sh", ["--dry-run", "--depth=4"], 2, "unknown flag --depth"),
    ("speedrun.sh", ["--help"], 0, "usage: bash speedrun.sh"),
    ("speedrun.sh", ["--dryrun"], 2, "Did you mean: --dry_run"),
    ("speedrun.sh", ["--dry-run", "--depth=32"], 2, "unknown flag --depth"),  # not ignored after the first argument
    ("run1000.sh", ["--foo"], 2, "unknown flag --foo"),
    ("pretrain.sh", ["--help"], 0, "pretrain.sh: launch nanochat training"),
    pytest.param("pretrain.sh", ["--dpeth=4", "--dry_run"], 2, "Did you mean: --depth", marks=pytest.mark.slow),
    pytest.param("pretrain.sh", ["--dryrun"], 2, "Did you mean: --dry_run", marks=pytest.mark.slow),
    pytest.param("pretrain.sh", ["--warmdown_ratio=1.5", "--dry_run"], 2, "--warmdown_ratio must be between",
                 marks=pytest.mark.slow),
    pytest.param("pretrain.sh", ["--dry_run", "--warmup_ratio=0.6", "--warmdown_ratio=0.6"], 2,
                 "--warmup_ratio + --warmdown_ratio must be <= 1", marks=pytest.mark.slow),
    pytest.param("pretrain.sh", ["--dry_run", "--matrix_lr=abc"], 2, "--matrix_lr expects a number",
                 marks=pytest.mark.slow),
    # settings from the environment and modes that exclude each other: checked before anything is set up
    ("runcpu.sh", ["--dry-run"], 2, "RUNCPU_BASE_STEPS must be a whole number >= 1, got 'abc'", {"RUNCPU_BASE_STEPS": "abc"}),
    ("runcpu.sh", [], 2, "NANOCHAT_DRY_RUN expects 0 or 1, got 'maybe'", {"NANOCHAT_DRY_RUN": "maybe"}),
    ("speedrun.sh", ["--dry-run"], 2, "NPROC must be a whole number >= 1, got 'eight'", {"NPROC": "eight"}),
    ("speedrun.sh", ["--dry-run"], 2, "DEVICE_BATCH must be a whole number >= 0, got '-4'", {"DEVICE_BATCH": "-4"}),
    ("speedrun.sh", ["--dry-run"], 2, "--depth=21", {"DEPTH": "21"}),
    ("pretrain.sh", ["--posttrain", "--fullrun"], 2, "--posttrain and --fullrun are two different modes: pass one"),
    ("pretrain.sh", ["--run=myrun", "--dry_run"], 2, "--run=myrun logs to wandb, but no wandb login found",
     NO_WANDB_LOGIN_SHELL),
    ("speedrun.sh", ["--dry-run"], 2, "WANDB_RUN=myrun logs to wandb, but no wandb login found",
     {**NO_WANDB_LOGIN_SHELL, "WANDB_RUN": "myrun"}),
    # a fresh GPU box: the python pretrain.sh finds has no torch (-S: this interpreter without its site-packages)
    ("pretrain.sh", ["--dry_run"], 2, "cannot run nanochat: torch is not installed. Install it into that interpreter",
     {"PYTHON": f"{sys.executable} -S"}),
    ("volc/volc_submit.sh", ["--dryrun"], 2, "Did you mean: --dry_run"),
    ("volc/volc_submit.sh", ["--help"], 0, "volc_submit.sh: write a Volcengine"),
]


def _launcher_case(case):
    """A LAUNCHER_CASES row as pytest.param(script, args, status, needle, env)."""
    values, marks = (case.values, case.marks) if hasattr(case, "values") else (case, ())
    script, args, status, needle, env = (*values, {}) if len(values) == 4 else values
    name = f"{script} {' '.join(args)}" + "".join(f" {k}={v}" for k, v in env.items())
    return pytest.param(script, args, status, needle, env, marks=marks, id=name)


@pytest.mark.parametrize("script,args,status,needle,env", [_launcher_case(c) for c in LAUNCHER_CASES])
def test_launcher(script, args, status, needle, env, tmp_path):
    """Each launcher checks its flags and settings before anything runs: nothing is created, reset or downloaded."""
    base = tmp_path / "base"
    venv = tmp_path / "venv"
    p = run(["bash", str(REPO / script), *args], base, **{"NANOCHAT_VENV": venv, "PYTHON": sys.executable,
                                                           "CUDA_VISIBLE_DEVICES": "", "HOME": tmp_path / "home", **env})
    assert p.returncode == status, p.stdout + p.stderr
    if status == 0:
        assert needle in p.stdout and p.stderr == ""
    else:
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "error: " in lines[0] and needle in lines[0], p.stderr
        assert "RUN:" not in p.stdout
    assert not base.exists() and not venv.exists() and not (tmp_path / "home").exists()


def test_docs_show_the_launchers_help():
    """docs/flags.md shows what `bash runcpu.sh --help` prints (the flags part), so the two cannot drift apart."""
    p = run(["bash", str(REPO / "runcpu.sh"), "--help"], REPO / "nonexistent-base")
    flags_part = p.stdout[p.stdout.index("Flags:"):].strip()
    assert flags_part in (REPO / "docs" / "flags.md").read_text()


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_job_prints_the_line_once(worlds):
    """Two ranks meet the same mistake; rank 0 alone prints it, both exit 2, and no rank prints a traceback. torchrun's
    own failure summary follows: its root cause is rank 0's line (from its error file), rank 1 only an exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", "scripts.base_train", "--", "--device_type=cpu", "--tp_size=3"]
    p = run(cmd, worlds["full"])
    out = p.stdout + p.stderr
    assert p.returncode != 0
    line = "error: --tp_size=3 does not divide the world size 2"
    assert [x for x in out.splitlines() if x.startswith(line)] == [line + "; use one of: 1, 2"], out
    summary = out[out.index("Root Cause (first observed failure)"):]
    assert "rank      : 0" in summary and line in summary, summary
    assert "exitcode  : 2" in out and "scripts/base_train.py" not in out and "Traceback" not in summary, out


def test_tok_train_keeps_the_tokenizer_checkpoints_use_unless_forced(base_dir, capfd):
    """A tokenizer that a checkpoint was trained with is not replaced silently: the refusal names the checkpoint dir
    and --force; with --force the new tokenizer is written (and the checkpoint then no longer loads, as it said)."""
    from chat_fixtures import tiny_model
    from nanochat.checkpoint_manager import resolve_checkpoint, save_checkpoint
    from nanochat.tokenizer import RustBPETokenizer
    from scripts import tok_train

    tok_dir = base_dir / "tokenizer"
    vocab = RustBPETokenizer.from_directory(str(tok_dir)).get_vocab_size()
    meta = {"model_config": {"sequence_len": 64, "vocab_size": vocab, "n_layer": 1, "n_head": 1, "n_kv_head": 1,
                             "n_embd": 64}}
    ckpt = base_dir / "mid_checkpoints" / "d1"
    save_checkpoint(str(ckpt), 3, tiny_model(vocab, depth=1, sequence_len=64).state_dict(), None, meta)
    before = (tok_dir / "tokenizer.pkl").read_bytes()
    with pytest.raises(SystemExit) as e:
        run_main(tok_train.main, ["--vocab_size=300", "--max_chars=20000"])
    err = capfd.readouterr().err
    assert e.value.code == 2
    check_one_error_line(err, f"1 checkpoint dir(s) were trained with ({ckpt})", "tok_train")
    assert "--force" in err and (tok_dir / "tokenizer.pkl").read_bytes() == before
    assert resolve_checkpoint("mid") == ("d1", 3)

    # a pipeline run again (runcpu.sh, speedrun.sh after a crash) keeps the tokenizer of the same size, and only that
    tok_train.main([f"--vocab_size={vocab}", "--max_chars=20000", "--keep_existing"])
    assert (tok_dir / "tokenizer.pkl").read_bytes() == before and "kept (--keep_existing" in capfd.readouterr().out
    with pytest.raises(SystemExit) as e:
        run_main(tok_train.main, ["--vocab_size=300", "--max_chars=20000", "--keep_existing"])
    assert e.value.code == 2 and (tok_dir / "tokenizer.pkl").read_bytes() == before

    tok_train.main(["--vocab_size=300", "--max_chars=20000", "--force"])
    assert RustBPETokenizer.from_directory(str(tok_dir)).get_vocab_size() == 300
    with pytest.raises(ValueError, match=f"tokenizer vocab 300 != model vocab {vocab}"):
        resolve_checkpoint("mid")


@pytest.mark.slow  # seven interpreter start-ups per launcher: seconds
@pytest.mark.parametrize("launcher", ["runcpu.sh", "speedrun.sh"])
def test_launcher_dry_run_spellings(launcher, tmp_path):
    """What runcpu.sh/speedrun.sh eval: every spelling of the dry run turns it on, NANOCHAT_DRY_RUN still works, and
    the flag wins over the environment."""
    for args, env, want in [([], "", 0), (["--dry_run"], "", 1), (["--dry-run"], "", 1), (["--dry_run=1"], "", 1),
                            (["--dry-run", "yes"], "", 1), ([], "1", 1), (["--dry_run=0"], "1", 0)]:
        p = run(["python3", "-m", "scripts.launch", launcher, *args], tmp_path / "base", NANOCHAT_DRY_RUN=env)
        assert (p.returncode, p.stdout) == (0, f"DRY_RUN={want}\n"), (args, env, p.stderr)
