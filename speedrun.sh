#!/usr/bin/env bash
# The nanochat speedrun: a d20 chat model end to end on one 8xH100 node (~4 hours, ~$100 of on-demand GPU time).
#   bash speedrun.sh [--dry-run]            (or: WANDB_RUN=speedrun screen -L -Logfile speedrun.log bash speedrun.sh)
# Stages: setup -> shards + tokenizer -> base d20 -> CORE/bpb -> mid -> SFT -> chat evals -> report card (after the
# setup here, the pipeline is scripts/launch.py's, the same stages pretrain.sh runs).
#
# Setup works on a fresh Ubuntu GPU box and says what it does: a venv (python3 -m venv; without the python3-venv
# package, uv from PyPI instead), Rust through rustup when there is no cargo (to build the rustbpe extension), then
# `pip install -e .` unless nanochat is already installed in the venv. Before training it stops when nvidia-smi
# lists GPUs that torch cannot use (a CPU-only wheel, or one built for a newer CUDA than the driver), naming the fix:
# a GPU run never falls back to the CPU. Every training stage gets --device_type=cuda.
#
# Environment: DEPTH (default 20; run1000.sh sets 32), NPROC (GPUs, default 8), WANDB_RUN (default dummy = off),
#   NANOCHAT_BASE_DIR (default ~/.cache/nanochat), NANOCHAT_VENV (default .venv),
#   NUM_SHARDS, DEVICE_BATCH: override the depth preset (nanochat/presets.py, shared with pretrain.sh),
#   NANOCHAT_DRY_RUN=1 or --dry-run: print every command, setup included, and run none.
# Flags: --save_every=N (default 500) and --max_restarts=N (default 3): every training stage checkpoints every N
#   steps, starts from its latest complete checkpoint (--resume_from_step=auto) and is restarted by torchrun after a
#   crash; SIGTERM/SIGUSR1 make it save and stop (exit 128 + the signal): run the same command again to continue.
set -euo pipefail
cd "$(dirname "$0")"
LIB_TAG=speedrun.sh
source scripts/lib.sh
launch_flags python3 speedrun.sh "$@" # --help, --dry_run (= --dry-run); anything else is refused, nothing run
export OMP_NUM_THREADS=1
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
WANDB_RUN="${WANDB_RUN:-dummy}"
NPROC="${NPROC:-8}"
DEPTH="${DEPTH:-20}"
((DRY_RUN)) && log "dry run: printing the commands, running nothing"

# ---------------------------------------------------------------- setup
VENV="${NANOCHAT_VENV:-.venv}"
ensure_venv "$VENV"
ensure_installed "$VENV/bin/python"
PY="$VENV/bin/python"
check_gpus "$PY"

# ---------------------------------------------------------------- the pipeline
# data + tokenizer, then the torchrun stages base_train -> base_loss -> base_eval -> mid_train -> chat_eval -i mid ->
# chat_sft -> chat_eval -i sft, then the report (scripts/launch.py: run_speedrun, stages). `exec`: the launcher is the
# process that gets the stop signals and passes them on. In a dry run on a fresh machine the system python3 answers.
LAUNCH_PY="$PY"
[[ -x "$LAUNCH_PY" ]] || LAUNCH_PY=python3
export NANOCHAT_BASE_DIR WANDB_RUN NPROC DEPTH NANOCHAT_DRY_RUN="$DRY_RUN"
PYTHON="$PY" TORCHRUN="$VENV/bin/torchrun" exec "$LAUNCH_PY" -m scripts.launch run speedrun.sh "$@"
