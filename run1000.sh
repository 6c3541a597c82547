#!/usr/bin/env bash
# The ~$1000 tier, as nanochat's run1000.sh: a d32 chat model (1.9B params) end to end on one 8xH100 node (~33 hours).
#   bash run1000.sh          (or: WANDB_RUN=d32 screen -L -Logfile run1000.log bash run1000.sh)
# Same pipeline as speedrun.sh with d32 settings: 800 shards for ~20 tokens/param, and smaller per-GPU batches to fit
# 80 GB at sequence length 2048 (gradient accumulation keeps the 0.5M-token optimizer batch).
set -euo pipefail
cd "$(dirname "$0")"
export DEPTH=32 NUM_SHARDS=800 DEVICE_BATCH=8 MID_DEVICE_BATCH=8 SFT_DEVICE_BATCH=4
exec bash speedrun.sh "$@"
