#!/usr/bin/env bash
# The ~$1000 tier, as nanochat's run1000.sh: a d32 chat model (1.9B params) end to end on one 8xH100 node (~33 hours).
#   bash run1000.sh [--dry-run]        (or: WANDB_RUN=d32 screen -L -Logfile run1000.log bash run1000.sh)
# Same pipeline as speedrun.sh at depth 32; the shards (800, ~20 tokens/param) and the per-GPU batch (8 rows of 2048
# tokens; gradient accumulation keeps the 0.5M-token optimizer batch) come from the d32 preset in nanochat/presets.py.
set -euo pipefail
cd "$(dirname "$0")"
export DEPTH=32
exec bash speedrun.sh "$@"
