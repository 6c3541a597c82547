#!/usr/bin/env bash
# The nanochat speedrun: a d20 chat model end to end on one 8xH100 node (~4 hours, ~$100 of on-demand GPU time).
#   bash speedrun.sh [--dry-run]            (or: WANDB_RUN=speedrun screen -L -Logfile speedrun.log bash speedrun.sh)
# Stages: setup -> shards + tokenizer -> base d20 -> CORE/bpb -> mid -> SFT -> chat evals -> report card (the
# pipeline pretrain.sh runs too: nanochat/launch/pipeline.py, its speedrun profile).
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
#   --recipe=record: nanochat's record run instead of the December recipe: d24 (16 rows per GPU, 170 shards),
#   base_train --recipe=record --target_param_data_ratio=8, and --fp8=1 on GPUs with FP8 (compute capability 8.9+).
set -euo pipefail
# The launcher is Python, standard library only, so the system's python3 runs it before the venv exists
# (scripts/launch.py reads the flags and the environment). `exec`: it is the process that gets the stop signals and
# passes them on.
cd "$(dirname "${BASH_SOURCE[0]}")"
exec python3 -m scripts.launch run speedrun.sh "$@"
