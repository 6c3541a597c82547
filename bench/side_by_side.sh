#!/usr/bin/env bash
# CPU speed of this project's training and Engine, optionally side by side with a nanochat checkout.
#
#   bash bench/side_by_side.sh                      # ours vs ../shared/bench/nanochat-bc51da8.tar.gz if present
#   NANOCHAT_REF=/path/to/nanochat bash bench/side_by_side.sh
#   NANOCHAT_REF=none bash bench/side_by_side.sh    # ours only: tok/s of configs (a) and (b) and decode tok/s
#
# Configs (issue 13): (a) --depth=4 --max_seq_len=256 --device_batch_size=8 --total_batch_size=2048
#                     (b) --depth=6 --max_seq_len=512 --device_batch_size=4 --total_batch_size=2048
# Training figure: median per-step tok/sec of steps >= SKIP (default 12: compilation and warm-up), STEPS steps
# (default 40); the two programs alternate (order swapped each round) over ROUNDS rounds (default 2) and the
# median over rounds is reported. Decode: bench/decode_driver.py on config (a)'s final checkpoint (written by our
# run), loaded by each tree's own checkpoint_manager and Engine, batch 1 and 8, temperature 0 and 1.
#
# The nanochat copy is prepared in a scratch dir as ../shared/bench/README.md describes: empty __init__.py in its
# scripts/ and tasks/ (so its packages win over this project's editable install), and its Newton-Schulz switched to
# fp32 off CUDA (bf16 matmuls are ~10x slower on CPUs without native bf16). Both run with this venv, the same
# shards and tokenizer (prepared once in BENCH_DIR from WikiText-2 in ../shared/data if absent).
#
# Environment: NANOCHAT_VENV (default .venv), BENCH_DIR (default /tmp/nanochat-bench), ROUNDS, STEPS, SKIP,
#              CONFIGS (default "a b"; empty: decode only, on an earlier d4 checkpoint),
#              OURS_FLAGS / REF_FLAGS (extra base_train flags), DECODE_FLAGS (decode_driver.py flags), SKIP_DECODE=1.
# Measure on a quiet machine: the load average is printed before and after; report it with the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="$REPO/${NANOCHAT_VENV:-.venv}/bin/python"
[ -x "$PY" ] || PY="${NANOCHAT_VENV:-.venv}/bin/python"
[ -x "$PY" ] || { echo "no python at $PY: run 'bash tests/run.sh' (or set NANOCHAT_VENV) first" >&2; exit 1; }
BENCH_DIR="${BENCH_DIR:-/tmp/nanochat-bench}"
ROUNDS="${ROUNDS:-2}"; STEPS="${STEPS:-40}"; SKIP="${SKIP:-12}"; CONFIGS="${CONFIGS-a b}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
for c in $CONFIGS; do
    case "$c" in a|b) ;; *) echo "CONFIGS must list a and/or b (got '$c')" >&2; exit 1 ;; esac
done
mkdir -p "$BENCH_DIR"
log() { printf '[side_by_side] %s\n' "$*" >&2; }

# ---------------------------------------------------------------- the reference tree
REF="${NANOCHAT_REF:-}"
if [ -z "$REF" ] && [ -f ../shared/bench/nanochat-bc51da8.tar.gz ]; then
    REF="$BENCH_DIR/nanochat-bc51da8.src"
    if [ ! -d "$REF" ]; then
        mkdir -p "$REF.tmp" && tar xzf ../shared/bench/nanochat-bc51da8.tar.gz -C "$REF.tmp"
        mv "$REF.tmp"/nanochat-bc51da8 "$REF" && rmdir "$REF.tmp"
    fi
fi
[ "$REF" = "none" ] && REF=""
if [ -n "$REF" ]; then
    [ -f "$REF/scripts/base_train.py" ] || { echo "NANOCHAT_REF=$REF is not a nanochat checkout (no scripts/base_train.py)" >&2; exit 1; }
    SCRATCH="$BENCH_DIR/ref"
    rm -rf "$SCRATCH" && cp -r "$REF" "$SCRATCH"
    touch "$SCRATCH/scripts/__init__.py" "$SCRATCH/tasks/__init__.py"
    if grep -q 'X = G.bfloat16()$' "$SCRATCH/nanochat/muon.py"; then
        sed -i 's/X = G.bfloat16()$/X = G.bfloat16() if G.is_cuda else G.float()/' "$SCRATCH/nanochat/muon.py"
        log "nanochat copy: Newton-Schulz in fp32 off CUDA"
    else
        log "nanochat copy: no 'X = G.bfloat16()' line in nanochat/muon.py; left as is"
    fi
fi

# ---------------------------------------------------------------- data and tokenizer (shared by both)
DATA_BASE="$BENCH_DIR/data"
if ! ls "$DATA_BASE"/base_data/shard_*.parquet >/dev/null 2>&1 || [ ! -f "$DATA_BASE/tokenizer/tokenizer.pkl" ]; then
    WT=../shared/data/pretrain/wikitext-2
    [ -f "$WT/train.txt" ] || { echo "need $WT/train.txt (or prepare $DATA_BASE with base_data/ and tokenizer/)" >&2; exit 1; }
    log "preparing shards and a 4096-token tokenizer in $DATA_BASE"
    NANOCHAT_BASE_DIR="$DATA_BASE" "$PY" -m nanochat.dataset import "$WT/train.txt" --val_paths "$WT/valid.txt" --overwrite >&2
    NANOCHAT_BASE_DIR="$DATA_BASE" "$PY" -m scripts.tok_train --max_chars=20000000 --vocab_size=4096 >&2
fi
# each program gets its own base dir (checkpoints, report) over the same shards and tokenizer
for who in ours ref; do
    mkdir -p "$BENCH_DIR/$who-base"
    ln -sfn "$DATA_BASE/base_data" "$BENCH_DIR/$who-base/base_data"
    ln -sfn "$DATA_BASE/tokenizer" "$BENCH_DIR/$who-base/tokenizer"
done

flags_for() {  # config -> base_train flags both programs accept
    local common="--device_type=cpu --total_batch_size=2048 --num_iterations=$STEPS --eval_every=100000 \
--eval_tokens=2048 --core_metric_every=-1 --sample_every=100000 --save_every=-1"
    case "$1" in
        a) echo "$common --depth=4 --max_seq_len=256 --device_batch_size=8" ;;
        b) echo "$common --depth=6 --max_seq_len=512 --device_batch_size=4" ;;
        *) echo "unknown config $1 (a or b)" >&2; exit 1 ;;
    esac
}

median_toks() {  # log file -> median tok/sec of steps >= SKIP
    "$PY" - "$1" "$SKIP" <<'EOF'
import re, statistics, sys
vals = []
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"step (\d+)/\d+ .*tok/sec: ([\d,]+)", line)
    if m and int(m.group(1)) >= int(sys.argv[2]):
        vals.append(float(m.group(2).replace(",", "")))
print(f"{statistics.median(vals):.0f}" if vals else "nan")
EOF
}

run_train() {  # who config round -> prints median tok/s
    local who="$1" cfg="$2" round="$3" out="$BENCH_DIR/train-$1-$2-$3.log" dir extra
    if [ "$who" = ours ]; then dir="$REPO"; extra="${OURS_FLAGS:-}"; else dir="$SCRATCH"; extra="${REF_FLAGS:-}"; fi
    # shellcheck disable=SC2046
    (cd "$dir" && NANOCHAT_BASE_DIR="$BENCH_DIR/$who-base" WANDB_MODE=disabled \
        "$PY" -m scripts.base_train $(flags_for "$cfg") $extra) >"$out" 2>&1 \
        || { log "$who config $cfg failed: see $out"; tail -5 "$out" >&2; echo nan; return; }
    median_toks "$out"
}

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)   cores: $(nproc)   torch: $("$PY" -c 'import torch; print(torch.__version__)')"
declare -A RES
for cfg in $CONFIGS; do
    for ((r = 1; r <= ROUNDS; r++)); do
        order="ours ref"; (( r % 2 == 0 )) && order="ref ours"
        for who in $order; do
            [ "$who" = ref ] && [ -z "$REF" ] && continue
            v=$(run_train "$who" "$cfg" "$r")
            log "config $cfg round $r $who: $v tok/s"
            RES[$who-$cfg]="${RES[$who-$cfg]:-} $v"
        done
    done
done

med() { "$PY" -c 'import statistics,sys; v=[float(x) for x in sys.argv[1:] if x!="nan"]; print(f"{statistics.median(v):.0f}" if v else "nan")' "$@"; }
ratio() { "$PY" -c 'import sys; a,b=map(float,sys.argv[1:]); print(f"{a/b:.2f}x" if a==a and b==b and b>0 else "n/a")' "$1" "$2"; }

echo
echo "| config | ours tok/s (rounds) | nanochat tok/s (rounds) | ours / nanochat |"
echo "|---|---|---|---|"
for cfg in $CONFIGS; do
    o=$(med ${RES[ours-$cfg]}); n="-"; rt="-"
    if [ -n "$REF" ]; then n=$(med ${RES[ref-$cfg]}); rt=$(ratio "$o" "$n"); fi
    echo "| ($cfg) $(flags_for "$cfg" | grep -o -- '--depth=[0-9]* --max_seq_len=[0-9]* --device_batch_size=[0-9]*') | $o (${RES[ours-$cfg]# }) | $n (${RES[ref-$cfg]:- }) | $rt |"
done

if [ "${SKIP_DECODE:-0}" != 1 ]; then
    CK="$BENCH_DIR/ours-base/base_checkpoints/d4"
    if [ -d "$CK" ]; then
        if [ -n "$REF" ]; then mkdir -p "$BENCH_DIR/ref-base/base_checkpoints" && rm -rf "$BENCH_DIR/ref-base/base_checkpoints/d4" && cp -r "$CK" "$BENCH_DIR/ref-base/base_checkpoints/d4"; fi
        echo
        echo "| decode (d4, 32-token prompt, 128 steps) | ours tok/s | nanochat tok/s | ours / nanochat |"
        echo "|---|---|---|---|"
        declare -A DEC
        for ((r = 1; r <= ROUNDS; r++)); do
            for who in ours ref; do
                [ "$who" = ref ] && [ -z "$REF" ] && continue
                dir="$REPO"; [ "$who" = ref ] && dir="$SCRATCH"
                while read -r key val; do
                    DEC[$who-$key]="${DEC[$who-$key]:-} $val"
                done < <(cd "$dir" && NANOCHAT_BASE_DIR="$BENCH_DIR/$who-base" "$PY" "$REPO/bench/decode_driver.py" --model_tag=d4 ${DECODE_FLAGS:-} 2>"$BENCH_DIR/decode-$who-$r.err" \
                         | "$PY" -c 'import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        d = json.loads(line); print("b%d-t%g" % (d["batch"], d["temperature"]), d["decode_tok_s"])')
            done
        done
        for key in b1-t0 b1-t1 b8-t0 b8-t1; do
            o=$(med ${DEC[ours-$key]:-nan}); n="-"; rt="-"
            if [ -n "$REF" ]; then n=$(med ${DEC[ref-$key]:-nan}); rt=$(ratio "$o" "$n"); fi
            b=${key%%-*}; t=${key#*-t}
            echo "| batch ${b#b}, temperature $t | $o | $n | $rt |"
        done
    else
        log "no d4 checkpoint at $CK (config a not run?): decode skipped"
    fi
fi
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
