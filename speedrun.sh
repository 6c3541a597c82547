#!/usr/bin/env bash
# The nanochat speedrun: a d20 chat model end to end on one 8xH100 node (~4 hours, ~$100 of on-demand GPU time).
#   bash speedrun.sh [--dry-run]            (or: WANDB_RUN=speedrun screen -L -Logfile speedrun.log bash speedrun.sh)
# Stages: setup -> shards + tokenizer -> base d20 -> CORE/bpb -> mid -> SFT -> chat evals -> report card.
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

# ---------------------------------------------------------------- the preset for this depth and GPU count
# (standard library only: in a dry run on a fresh machine the system python3 answers)
PRESET_PY="$PY"
[[ -x "$PRESET_PY" ]] || PRESET_PY=python3
Q=(--format=shell --depth="$DEPTH" --world_size="$NPROC" --mode=fullrun)
[[ -z "${NUM_SHARDS:-}" ]] || Q+=(--num_shards="$NUM_SHARDS")
[[ -z "${DEVICE_BATCH:-}" ]] || Q+=(--device_batch_size="$DEVICE_BATCH")
RESOLVED="$("$PRESET_PY" -m nanochat.presets "${Q[@]}")" || exit 2
eval "$RESOLVED"
for note in ${NOTES[@]+"${NOTES[@]}"}; do log "note: $note"; done
log "d$DEPTH on $NPROC GPUs: $NUM_SHARDS shards, device batch $DEVICE_BATCH_SIZE, grad accumulation $GRAD_ACCUM, FSDP $USE_FSDP"
FSDP=() # the preset's model-memory flags, each only when not the scripts' default: FSDP, AC, TP
((!USE_FSDP)) || FSDP=(--use_fsdp=1)
[[ "$ACTIVATION_CHECKPOINTING" == none ]] || FSDP+=(--activation_checkpointing="$ACTIVATION_CHECKPOINTING")
((TP_SIZE <= 1)) || FSDP+=(--tp_size="$TP_SIZE")
train() { # train MODULE ARGS...: one torchrun over the node's GPUs, on CUDA
    local module="$1"
    shift
    run_cmd "$VENV/bin/torchrun" --standalone --nproc_per_node="$NPROC" -m "$module" -- --device_type=cuda "$@"
}

# ---------------------------------------------------------------- data and tokenizer
((DRY_RUN)) || mkdir -p "$NANOCHAT_BASE_DIR"
run_cmd "$PY" -m nanochat.report reset
# tokenizer on ~2B characters of the first 8 shards, while the rest of the shards download
run_cmd "$PY" -m nanochat.dataset -n 8
echo "RUN (in the background): $(quote_cmd "$PY" -m nanochat.dataset -n "$NUM_SHARDS")"
DOWNLOAD_PID=""
if ((!DRY_RUN)); then
    "$PY" -m nanochat.dataset -n "$NUM_SHARDS" &
    DOWNLOAD_PID=$!
fi
run_cmd "$PY" -m scripts.tok_train --max_chars=2000000000 --vocab_size=65536
run_cmd "$PY" -m scripts.tok_eval
if [[ -n "$DOWNLOAD_PID" ]]; then
    echo "Waiting for the shard download..."
    wait "$DOWNLOAD_PID"
fi

# ---------------------------------------------------------------- base model (d20: 561M params, 20 tokens/param)
train scripts.base_train --depth="$DEPTH" --device_batch_size="$DEVICE_BATCH_SIZE" ${FSDP[@]+"${FSDP[@]}"} --run="$WANDB_RUN"
train scripts.base_loss --device_batch_size="$DEVICE_BATCH_SIZE"
train scripts.base_eval # downloads the CORE eval bundle into the base dir when missing

# identity conversations for mid-training (nanochat's file; left out when it cannot be fetched)
run_cmd curl -fsSL -o "$NANOCHAT_BASE_DIR/identity_conversations.jsonl" \
    https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl ||
    echo "could not download identity_conversations.jsonl; mid-training leaves it out"

# ---------------------------------------------------------------- mid-training, SFT, chat evals
train scripts.mid_train --device_batch_size="$DEVICE_BATCH_SIZE" ${FSDP[@]+"${FSDP[@]}"} --run="$WANDB_RUN"
train scripts.chat_eval -i mid
train scripts.chat_sft ${SFT_ARGS[@]+"${SFT_ARGS[@]}"} ${FSDP[@]+"${FSDP[@]}"} --run="$WANDB_RUN"
train scripts.chat_eval -i sft
# RL on GSM8K is optional in the speedrun (as in nanochat):
# train scripts.chat_rl --run="$WANDB_RUN" && train scripts.chat_eval -i rl -a GSM8K

run_cmd "$PY" -m nanochat.report generate
echo "Talk to it: $PY -m scripts.chat_web"
