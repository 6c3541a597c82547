#!/usr/bin/env bash
# The nanochat speedrun: a d20 chat model end to end on one 8xH100 node (~4 hours, ~$100 of on-demand GPU time).
#   bash speedrun.sh                        (or: WANDB_RUN=speedrun screen -L -Logfile speedrun.log bash speedrun.sh)
# Stages: shards + tokenizer -> base d20 -> CORE/bpb -> mid -> SFT -> chat evals -> report card.
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
mkdir -p "$NANOCHAT_BASE_DIR"
WANDB_RUN="${WANDB_RUN:-dummy}"
NPROC="${NPROC:-8}"
# the model size and its batch settings (run1000.sh sets these for d32)
DEPTH="${DEPTH:-20}"
NUM_SHARDS="${NUM_SHARDS:-240}"       # ~20 tokens per parameter for d20 (each shard ~250M chars)
DEVICE_BATCH="${DEVICE_BATCH:-32}"    # per-GPU sequences of 2048 tokens; lower it if you run out of memory
MID_DEVICE_BATCH="${MID_DEVICE_BATCH:-32}"
SFT_DEVICE_BATCH="${SFT_DEVICE_BATCH:-4}"

VENV="${NANOCHAT_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
command -v cargo >/dev/null 2>&1 || export PATH="$HOME/.cargo/bin:$PATH"
"$VENV/bin/python" -c "import rustbpe, nanochat" 2>/dev/null || "$VENV/bin/python" -m pip install -q -e .
PY="$VENV/bin/python"
TORCHRUN="$VENV/bin/torchrun --standalone --nproc_per_node=$NPROC"

"$PY" -m nanochat.report reset

# tokenizer on ~2B characters of the first 8 shards, while the rest of the shards download
"$PY" -m nanochat.dataset -n 8
"$PY" -m nanochat.dataset -n "$NUM_SHARDS" &
DOWNLOAD_PID=$!
"$PY" -m scripts.tok_train --max_chars=2000000000 --vocab_size=65536
"$PY" -m scripts.tok_eval

# eval bundle for CORE (downloaded once into the base dir by base_eval itself when missing)
echo "Waiting for the shard download..."
wait $DOWNLOAD_PID

# base model (d20: 561M params), Chinchilla 20 tokens/param
$TORCHRUN -m scripts.base_train -- --depth="$DEPTH" --device_batch_size="$DEVICE_BATCH" --run="$WANDB_RUN"
$TORCHRUN -m scripts.base_loss
$TORCHRUN -m scripts.base_eval

# identity conversations for mid-training (nanochat's file; skip quietly if it cannot be fetched)
curl -fsSL -o "$NANOCHAT_BASE_DIR/identity_conversations.jsonl" \
    https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl || \
    echo "could not download identity_conversations.jsonl; mid-training leaves it out"

$TORCHRUN -m scripts.mid_train -- --device_batch_size="$MID_DEVICE_BATCH" --run="$WANDB_RUN"
$TORCHRUN -m scripts.chat_eval -- -i mid
$TORCHRUN -m scripts.chat_sft -- --device_batch_size="$SFT_DEVICE_BATCH" --run="$WANDB_RUN"
$TORCHRUN -m scripts.chat_eval -- -i sft
# RL on GSM8K is optional in the speedrun (as in nanochat):
# $TORCHRUN -m scripts.chat_rl -- --run="$WANDB_RUN" && $TORCHRUN -m scripts.chat_eval -- -i rl -a GSM8K

"$PY" -m nanochat.report generate
echo "Talk to it: $PY -m scripts.chat_web"
