#!/usr/bin/env bash
# The GPU rows of docs/benchmarks.md on one GPU, in parts that each fit a 10-minute slot:
#   bash bench/gpu_suite.sh train    # d20 bf16 + compile: sdpa vs fa3, batch 16 vs 32, DDP vs FSDP under torchrun
#   bash bench/gpu_suite.sh options  # d20 activation checkpointing rows
#   bash bench/gpu_suite.sh fp8      # d20 FP8 tensorwise and rowwise (each: a ~2-minute cold compile, then the steps)
#   bash bench/gpu_suite.sh fp8ac    # d20 FP8 tensorwise with full activation checkpointing
#   bash bench/gpu_suite.sh serve    # short real base_train (data, eval, checkpoint), Engine decode, chat_web + the
#                                    # openai client, then the largest device batch for d26/d32/d40
# Settings: PY (default python3), OUT (logs; default /tmp/gpu_suite), NANOCHAT_BASE_DIR (for `serve`: holds
# tokenizer/ and base_data/ shards, e.g. made by runcpu.sh's import step and scripts.tok_train --vocab_size=65536).
# Each command runs under `timeout` so one hang cannot eat the slot; a failure is logged and the next one runs.
# Needs torch with CUDA, and for `options`/`serve` torchao, fastapi, uvicorn and openai (pip install -e .[dev] has
# them all; on an offline GPU box, put their wheels on PYTHONPATH). FA3 rows need `kernels` or flash_attn_interface.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:?usage: bash bench/gpu_suite.sh train|options|fp8|fp8ac|serve}"
PY="${PY:-python3}"
OUT="${OUT:-/tmp/gpu_suite}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
FAILED=()

step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, keep going on failure
    local name="$1" limit="$2"; shift 2
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -E '^\||^error|Error|error:|MFU|tok/s|peak|round trip|^d[0-9]+ |^server|skipped|Traceback' | head -40
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    ((rc == 0)) || FAILED+=("$name")
}

D20="--depth=20 --max_seq_len=2048 --vocab_size=65536 --compile=1 --steps=8 --warmup=3"
case "$PART" in
train)
    { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
      "$PY" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
      "$PY" -c "import triton; print('triton', triton.__version__)"
      "$PY" -c "import torchao; print('torchao', torchao.__version__)"; } 2>&1 | tee "$OUT/env.log"
    step d20_b32_attn 300 "$PY" -m bench.train_bench $D20 --device_batch_size=32 --attn=sdpa,fa3
    step d20_b16 240 "$PY" -m bench.train_bench $D20 --device_batch_size=16 --attn=sdpa
    step d20_b32_ddp1 240 torchrun --standalone --nproc_per_node=1 -m bench.train_bench $D20 --device_batch_size=32 --attn=sdpa --use_fsdp=0
    step d20_b32_fsdp1 240 torchrun --standalone --nproc_per_node=1 -m bench.train_bench $D20 --device_batch_size=32 --attn=sdpa --use_fsdp=1
    ;;
options)
    step d20_ac_full 200 "$PY" -m bench.train_bench $D20 --device_batch_size=32 --attn=sdpa --activation_checkpointing=full
    step d20_ac_sel2 200 "$PY" -m bench.train_bench $D20 --device_batch_size=32 --attn=sdpa --activation_checkpointing=selective --ac_every=2
    ;;
fp8)
    step d20_fp8_tensorwise 285 "$PY" -m bench.train_bench $D20 --device_batch_size=32 --attn=sdpa --fp8=1
    step d20_fp8_rowwise 285 "$PY" -m bench.train_bench $D20 --device_batch_size=32 --attn=sdpa --fp8=1 --fp8_recipe=rowwise
    ;;
fp8ac)
    step d20_fp8_ac_full 330 "$PY" -m bench.train_bench $D20 --device_batch_size=32 --attn=sdpa --fp8=1 --activation_checkpointing=full
    ;;
serve)
    : "${NANOCHAT_BASE_DIR:?serve needs NANOCHAT_BASE_DIR with tokenizer/ and base_data/}"
    step base_train_d20 200 "$PY" -m scripts.base_train --device_type=cuda --depth=20 --device_batch_size=32 \
        --total_batch_size=65536 --num_iterations=20 --eval_every=10 --eval_tokens=131072 --core_metric_every=-1 \
        --sample_every=20 --compile=1 --attn=sdpa
    step engine_d20 110 "$PY" -m bench.infer_bench --device_type=cuda --depths=20 --tokenizer=base_dir --server_depth=20 \
        --server_max_tokens=64
    step chat_web_openai 100 "$PY" -m bench.gpu_openai_check -i base
    step memory_probe 140 "$PY" -m bench.memory_probe --depths=40,32,26 --batches=1,2,4,8,16 --json_out="$OUT/memory_probe.json"
    ;;
*) echo "unknown part $PART (train|options|fp8|fp8ac|serve)" >&2; exit 2 ;;
esac
if ((${#FAILED[@]})); then echo "FAILED: ${FAILED[*]}"; exit 1; fi
echo "all steps passed"
