#!/usr/bin/env bash
# pretrain.sh: launch nanochat training on one node or many, building the torchrun command itself.
#
#   bash pretrain.sh [--depth=20] [--posttrain | --fullrun] [--dry_run] [overrides] [base_train flags]
#
# Where it runs (picked from the environment, first match wins; NANOCHAT_LAUNCHER=volcengine|slurm|torchrun|single
# forces one, e.g. inside an `salloc` shell whose SLURM_* variables describe nodes you are not launching on):
#   volcengine  MLP_WORKER_NUM, MLP_ROLE_INDEX, MLP_WORKER_0_HOST, MLP_WORKER_0_PORT, MLP_WORKER_GPU
#   slurm       SLURM_NNODES, SLURM_NODEID, master = first host of SLURM_STEP_NODELIST or SLURM_JOB_NODELIST,
#               port = MASTER_PORT or 20000 + SLURM_JOB_ID % 10000; run once per node (srun --ntasks-per-node=1)
#   torchrun    NNODES>1, NODE_RANK, MASTER_ADDR, MASTER_PORT (default 29500): plain launchers started by hand
#   single      torchrun --standalone, one process per visible GPU (1 process on CPU)
# More than one node with the same value of everything above runs one job across them.
#
# Modes: pretrain (default): [data + tokenizer] -> base_train -> base_loss -> base_eval
#        --posttrain: mid_train -> chat_eval -i mid -> chat_sft -> chat_eval -i sft
#        --fullrun:   both
# Flags (--a_b=v, --a-b v, --a_b v all work):
#   --depth=N               preset: 20 22 26 32 40 44 48 56 64 (default 20, or $MODEL_DEPTH); the table is
#                           nanochat/presets.py (`python -m nanochat.presets --format markdown` prints it)
#   --num_shards=N          data shards to download (preset value by default)
#   --device_batch_size=N   per-GPU batch (preset value by default)
#   --use_fsdp=0|1          FSDP2 instead of DDP (on by default from d40)
#   --activation_checkpointing=none|full|selective   recompute block activations in the backward (preset: none at
#                           every depth); with --ac_every=K for selective. Passed to base_train, mid_train, chat_sft
#   --tp_size=N             tensor parallelism over N GPUs of a node (preset: 1); passed on only when N > 1
#   --model_tag=TAG         checkpoint tag (default: base_train's d{depth}); passed to every stage
#   --run=NAME              wandb run name (default $WANDB_RUN or "dummy" = wandb off)
#   --nproc_per_node=N      processes per node (default: see above; or $NPROC_PER_NODE)
#   --prepare=0             skip the data download and tokenizer step (data already in place, e.g. imported offline)
#   --dry_run               print the resolved settings and the commands, run nothing
#   any other --flag=value  passed through to scripts.base_train
# With GPUs visible every stage gets --device_type=cuda, after a check that torch can really use them
# (python -m nanochat.setup_check gpu): a GPU node never trains on the CPU by accident.
# Settings by environment:
#   NANOCHAT_BASE_DIR       data, tokenizer, checkpoints, report (default ~/.cache/nanochat)
#   NANOCHAT_SHARED_FS=1    (default) on several nodes the base dir is one shared filesystem: node 0 downloads the
#                           data and trains the tokenizer, the other nodes wait for its marker file. Set 0 when the
#                           base dir is local to each node: every node then prepares its own copy.
#   NANOCHAT_PREP_TIMEOUT   seconds the other nodes wait for node 0's preparation (default 14400)
#   NANOCHAT_PREP_POLL      seconds between checks for the marker (default 10)
#   NANOCHAT_MAX_SHARDS     shards the dataset has (default 1823, FineWeb-Edu-100B); larger requests are capped
#   NANOCHAT_RUN_ID         names the marker; defaults to SLURM_JOB_ID / MLP_TASK_ID / master address and port
#   TOK_MAX_CHARS           characters the tokenizer trains on (default 2000000000, as nanochat's speedrun)
#   PYTHON, TORCHRUN        interpreter and launcher (default: python, torchrun or python -m torch.distributed.run)
set -euo pipefail
LIB_TAG=pretrain.sh
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$REPO_DIR/scripts/lib.sh"

# ----------------------------------------------------------------------------------------------------------------
# Slurm host lists: "gpu[01-04,07],cpu3" -> gpu01 gpu02 gpu03 gpu04 gpu07 cpu3, one per line.
# Written out in bash because scontrol is only on Slurm nodes; when it exists, resolve_hosts prefers it.

expand_host_pattern() { # one item without top-level commas, e.g. rack[1-2]-n[01-02]
    local pat="$1"
    if [[ "$pat" =~ ^([^][]*)\[([^][]*)\](.*)$ ]]; then
        local prefix="${BASH_REMATCH[1]}" ranges="${BASH_REMATCH[2]}" suffix="${BASH_REMATCH[3]}"
        local part lo hi width n
        local -a parts
        IFS=, read -r -a parts <<<"$ranges"
        [[ ${#parts[@]} -gt 0 ]] || die "empty brackets in Slurm node list item '$pat'"
        for part in "${parts[@]}"; do
            if [[ "$part" =~ ^([0-9]+)-([0-9]+)$ ]]; then
                lo="${BASH_REMATCH[1]}"
                hi="${BASH_REMATCH[2]}"
                # zero padding follows the lower bound, as Slurm writes it: [08-10] -> 08 09 10
                width=${#lo}
                ((10#$lo <= 10#$hi)) || die "descending range '$part' in Slurm node list item '$pat'"
                for ((n = 10#$lo; n <= 10#$hi; n++)); do
                    expand_host_pattern "$prefix$(printf "%0${width}d" "$n")$suffix"
                done
            elif [[ "$part" =~ ^[0-9]+$ ]]; then
                expand_host_pattern "$prefix$part$suffix"
            else
                die "cannot read '$part' in Slurm node list item '$pat' (expected N or N-M)"
            fi
        done
    elif [[ "$pat" == *[][]* ]]; then
        die "unbalanced brackets in Slurm node list item '$pat'"
    else
        echo "$pat"
    fi
}

expand_nodelist() {
    local list="$1" item="" ch depth=0 i
    for ((i = 0; i < ${#list}; i++)); do
        ch="${list:i:1}"
        case "$ch" in
            "[") depth=$((depth + 1)) item+="$ch" ;;
            "]") depth=$((depth - 1)) item+="$ch" ;;
            ",")
                if ((depth == 0)); then
                    [[ -n "$item" ]] && expand_host_pattern "$item"
                    item=""
                else
                    item+="$ch"
                fi
                ;;
            *) item+="$ch" ;;
        esac
    done
    [[ -n "$item" ]] && expand_host_pattern "$item"
    return 0
}

resolve_hosts() { # prints the hosts of a Slurm node list, one per line
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$1"
    else
        expand_nodelist "$1"
    fi
}

# ----------------------------------------------------------------------------------------------------------------

count_visible_gpus() {
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        # set but empty (or -1) hides every GPU from CUDA
        if [[ -z "$CUDA_VISIBLE_DEVICES" || "$CUDA_VISIBLE_DEVICES" == -* ]]; then
            echo 0
        else
            local -a ids
            IFS=, read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
            echo "${#ids[@]}"
        fi
    elif command -v nvidia-smi >/dev/null 2>&1; then
        { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU ' || true
    else
        echo 0
    fi
}

# ----------------------------------------------------------------------------------------------------------------
# main's steps, in order. They share the settings as globals of this script.

# A flag pretrain.sh does not know itself goes on to base_train: first base_train checks every flag against its
# declarations and pretrain.sh's names (NANOCHAT_CHECK_FLAGS: parse, then exit; a misspelling gets "Did you mean", a
# value out of range its limits), so a command that is going to fail stops here, before any download or torchrun.
check_pass_through() {
    local arg name
    for arg in "$@"; do
        [[ "$arg" == --* ]] || continue
        name="${arg#--}" name="${name%%=*}" name="${name//-/_}"
        case "$name" in
            help | dry_run | posttrain | fullrun | depth | num_shards | device_batch_size | use_fsdp | \
                activation_checkpointing | ac_every | tp_size | model_tag | run | nproc_per_node | prepare) ;;
            *)
                local -a py=(python)
                [[ -z "${PYTHON:-}" ]] || read -r -a py <<<"$PYTHON"
                (cd "$REPO_DIR" && NANOCHAT_CHECK_FLAGS="dry_run:bool posttrain:bool fullrun:bool num_shards:int \
nproc_per_node:int prepare:bool" "${py[@]}" -m scripts.base_train "$@" >/dev/null) || exit 2
                return 0
                ;;
        esac
    done
}

parse_flags() {
    check_pass_through "$@"
    DEPTH="${MODEL_DEPTH:-20}" NUM_SHARDS="" DBS="" USE_FSDP="" MODEL_TAG="" RUN_NAME="${WANDB_RUN:-dummy}"
    AC="" AC_EVERY="" TP=""
    NPROC="${NPROC_PER_NODE:-}" PREPARE=1 MODE_POST=0 MODE_FULL=0 DRY_RUN=0
    PASS=()
    local arg name value has_value
    while [[ $# -gt 0 ]]; do
        arg="$1"
        shift
        case "$arg" in
            -h | --help) usage "${BASH_SOURCE[0]}"; exit 0 ;;
            --*) ;;
            *) die "unexpected argument '$arg': flags look like --name=value or --name value (see --help)" ;;
        esac
        name="${arg#--}" has_value=0 value=""
        if [[ "$name" == *=* ]]; then
            value="${name#*=}" name="${name%%=*}" has_value=1
        fi
        name="$(echo "$name" | tr '-' '_')"
        [[ -n "$name" ]] || die "empty flag name in '$arg'"
        case "$name" in
            dry_run | posttrain | fullrun) # switches: --dry_run alone, or --dry_run=0/1
                if ((has_value)); then value="$(to_bool01 "$name" "$value")"; else value=1; fi
                case "$name" in
                    dry_run) DRY_RUN=$value ;;
                    posttrain) MODE_POST=$value ;;
                    fullrun) MODE_FULL=$value ;;
                esac
                continue
                ;;
        esac
        if ((!has_value)); then
            [[ $# -gt 0 && "$1" != --* ]] || die "flag --$name needs a value (--$name=VALUE)"
            value="$1"
            shift
        fi
        case "$name" in
            depth) DEPTH="$value" ;;
            num_shards) NUM_SHARDS="$value" ;;
            device_batch_size) DBS="$value" ;;
            use_fsdp) USE_FSDP="$(to_bool01 use_fsdp "$value")" ;;
            activation_checkpointing) AC="$value" ;;
            ac_every) AC_EVERY="$value" ;;
            tp_size) TP="$value" ;;
            model_tag) MODEL_TAG="$value" ;;
            run) RUN_NAME="$value" ;;
            nproc_per_node) NPROC="$value" ;;
            prepare) PREPARE="$(to_bool01 prepare "$value")" ;;
            *) PASS+=("--$name=$value") ;;
        esac
    done
    MODE=pretrain
    if ((MODE_FULL)); then MODE=fullrun; elif ((MODE_POST)); then MODE=posttrain; fi
}

# Where we run: sets LAUNCHER NNODES NODE_RANK MASTER_ADDR_ MASTER_PORT_ NPROC NPROC_SRC HOSTS JOB_KEY NGPU.
detect_launcher() {
    # the plain-torchrun launcher reads NNODES/NODE_RANK from the environment: take them before they are reassigned
    local env_nnodes="${NNODES:-}" env_node_rank="${NODE_RANK:-}"
    LAUNCHER="${NANOCHAT_LAUNCHER:-auto}" NNODES=1 NODE_RANK=0 MASTER_ADDR_="" MASTER_PORT_="" NPROC_SRC="" HOSTS="" JOB_KEY=""
    if [[ "$LAUNCHER" == auto ]]; then
        if [[ -n "${MLP_WORKER_NUM:-}" ]]; then
            LAUNCHER=volcengine
        elif [[ -n "${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}" ]]; then
            LAUNCHER=slurm
        elif is_uint "$env_nnodes" && ((env_nnodes > 1)); then
            LAUNCHER=torchrun
        else
            LAUNCHER=single
        fi
    fi
    case "$LAUNCHER" in
        volcengine)
            NNODES="${MLP_WORKER_NUM:-}"
            is_uint "$NNODES" && ((NNODES >= 1)) || die "MLP_WORKER_NUM must be a whole number >= 1, got '${MLP_WORKER_NUM:-}'"
            if ((NNODES > 1)); then
                NODE_RANK="${MLP_ROLE_INDEX:-}" MASTER_ADDR_="${MLP_WORKER_0_HOST:-}" MASTER_PORT_="${MLP_WORKER_0_PORT:-}"
                [[ -n "$MASTER_ADDR_" ]] || die "MLP_WORKER_0_HOST is not set: the Volcengine platform sets it for multi-node tasks (Framework PyTorchDDP)"
                [[ -n "$MASTER_PORT_" ]] || die "MLP_WORKER_0_PORT is not set: the Volcengine platform sets it for multi-node tasks (Framework PyTorchDDP)"
            fi
            if [[ -z "$NPROC" && -n "${MLP_WORKER_GPU:-}" ]]; then NPROC="$MLP_WORKER_GPU" NPROC_SRC="MLP_WORKER_GPU"; fi
            JOB_KEY="${MLP_TASK_ID:-}"
            ;;
        slurm)
            NNODES="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}"
            is_uint "$NNODES" && ((NNODES >= 1)) || die "SLURM_NNODES must be a whole number >= 1, got '$NNODES'"
            if [[ -n "${SLURM_STEP_NUM_TASKS:-}" && -n "${SLURM_STEP_NUM_NODES:-}" ]] &&
                ((SLURM_STEP_NUM_TASKS > SLURM_STEP_NUM_NODES)); then
                die "this srun step starts $SLURM_STEP_NUM_TASKS tasks on $SLURM_STEP_NUM_NODES nodes; pretrain.sh must run once per node (srun --ntasks-per-node=1): torchrun starts the per-GPU processes"
            fi
            if ((NNODES > 1)); then
                NODE_RANK="${SLURM_NODEID:-}"
                local nodelist="${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}}" nhosts
                [[ -n "$nodelist" ]] || die "SLURM_JOB_NODELIST is not set: cannot find the master node"
                HOSTS="$(resolve_hosts "$nodelist")"
                MASTER_ADDR_="$(echo "$HOSTS" | sed -n 1p)"
                [[ -n "$MASTER_ADDR_" ]] || die "no host in Slurm node list '$nodelist'"
                nhosts="$(echo "$HOSTS" | grep -c . || true)"
                ((nhosts == NNODES)) || die "Slurm node list '$nodelist' has $nhosts hosts but SLURM_NNODES=$NNODES"
                if [[ -n "${MASTER_PORT:-}" ]]; then
                    MASTER_PORT_="$MASTER_PORT"
                elif [[ -n "${SLURM_JOB_ID:-}" ]] && is_uint "$SLURM_JOB_ID"; then
                    MASTER_PORT_=$((20000 + SLURM_JOB_ID % 10000)) # per-job port: two jobs sharing a first node do not collide
                else
                    MASTER_PORT_=29500
                fi
            fi
            if [[ -z "$NPROC" && -n "${SLURM_GPUS_ON_NODE:-}" ]]; then NPROC="$SLURM_GPUS_ON_NODE" NPROC_SRC="SLURM_GPUS_ON_NODE"; fi
            JOB_KEY="${SLURM_JOB_ID:-}"
            ;;
        torchrun)
            NNODES="$env_nnodes"
            is_uint "$NNODES" && ((NNODES >= 1)) || die "NNODES must be a whole number >= 1, got '$NNODES'"
            if ((NNODES > 1)); then
                NODE_RANK="$env_node_rank" MASTER_ADDR_="${MASTER_ADDR:-}" MASTER_PORT_="${MASTER_PORT:-29500}"
                [[ -n "$MASTER_ADDR_" ]] || die "NNODES=$NNODES needs MASTER_ADDR (the address of node 0, reachable from every node)"
            fi
            ;;
        single) ;;
        *) die "NANOCHAT_LAUNCHER must be auto, volcengine, slurm, torchrun or single; got '$LAUNCHER'" ;;
    esac
    if ((NNODES > 1)); then
        is_uint "$NODE_RANK" || die "the node rank must be a whole number, got '$NODE_RANK' (launcher $LAUNCHER)"
        ((NODE_RANK < NNODES)) || die "node rank $NODE_RANK is out of range for $NNODES nodes"
        is_uint "$MASTER_PORT_" && ((MASTER_PORT_ > 0 && MASTER_PORT_ < 65536)) || die "master port must be 1..65535, got '$MASTER_PORT_'"
    else
        NODE_RANK=0
    fi
    NGPU="$(count_visible_gpus)"
    if [[ -n "$NPROC" ]]; then
        NPROC_SRC="${NPROC_SRC:-flag or NPROC_PER_NODE}"
    elif ((NGPU > 0)); then
        NPROC="$NGPU" NPROC_SRC="visible GPUs"
    else
        NPROC=1 NPROC_SRC="no GPU: 1 process on CPU"
    fi
    is_uint "$NPROC" && ((NPROC >= 1)) || die "processes per node must be a whole number >= 1, got '$NPROC'"
}

pick_interpreter() { # PY and TR (torchrun) as arrays, TR_ARGS for this node
    if [[ -n "${PYTHON:-}" ]]; then
        read -r -a PY <<<"$PYTHON"
    elif command -v python >/dev/null 2>&1; then
        PY=(python)
    else
        PY=(python3)
    fi
    if [[ -n "${TORCHRUN:-}" ]]; then
        read -r -a TR <<<"$TORCHRUN"
    elif command -v torchrun >/dev/null 2>&1; then
        TR=(torchrun)
    else
        TR=("${PY[@]}" -m torch.distributed.run)
    fi
    if ((NNODES > 1)); then
        TR_ARGS=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC"
            --master_addr="$MASTER_ADDR_" --master_port="$MASTER_PORT_")
    else
        TR_ARGS=(--standalone --nproc_per_node="$NPROC")
    fi
}

# The launcher's own questions to Python (presets, GPU check) find this checkout's nanochat from any directory.
repo_python() { PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" "${PY[@]}" "$@"; }

# The preset and the batch arithmetic, by nanochat.presets (the training's own arithmetic): sets NUM_SHARDS,
# DEVICE_BATCH_SIZE, USE_FSDP, ACTIVATION_CHECKPOINTING, TP_SIZE, GRAD_ACCUM, EST_GB, SFT_ARGS and NOTES, or stops
# with its message before any work.
resolve_presets() {
    local -a q=(--format=shell --depth="$DEPTH" --world_size=$((NNODES * NPROC)) --mode="$MODE")
    [[ -z "$NUM_SHARDS" ]] || q+=(--num_shards="$NUM_SHARDS")
    [[ -z "$DBS" ]] || q+=(--device_batch_size="$DBS")
    [[ -z "$USE_FSDP" ]] || q+=(--use_fsdp="$USE_FSDP")
    [[ -z "$AC" ]] || q+=(--activation_checkpointing="$AC")
    [[ -z "$TP" ]] || q+=(--tp_size="$TP")
    local -a train=(${PASS[@]+"${PASS[@]}"})
    [[ -z "$AC_EVERY" ]] || train+=(--ac_every="$AC_EVERY")
    local resolved
    resolved="$(repo_python -m nanochat.presets "${q[@]}" -- ${train[@]+"${train[@]}"})" || exit 2
    eval "$resolved"
}

print_settings() {
    log "resolved settings:"
    echo "launcher=$LAUNCHER"
    echo "nnodes=$NNODES"
    echo "node_rank=$NODE_RANK"
    echo "nproc_per_node=$NPROC ($NPROC_SRC)"
    echo "world_size=$((NNODES * NPROC))"
    echo "master_addr=${MASTER_ADDR_:-(standalone)}"
    echo "master_port=${MASTER_PORT_:-(standalone)}"
    [[ -z "$HOSTS" ]] || echo "hosts=$(echo "$HOSTS" | tr '\n' ' ' | sed 's/ $//')"
    echo "mode=$MODE"
    echo "depth=$DEPTH"
    echo "num_shards=$NUM_SHARDS"
    echo "device_batch_size=$DEVICE_BATCH_SIZE"
    echo "grad_accum=$GRAD_ACCUM"
    echo "use_fsdp=$USE_FSDP"
    echo "activation_checkpointing=$ACTIVATION_CHECKPOINTING${AC_EVERY:+ (ac_every=$AC_EVERY)}"
    echo "tp_size=$TP_SIZE"
    echo "est_gb_per_gpu=$EST_GB (upper bound; nanochat.presets)"
    if ((NGPU > 0)); then echo "device_type=cuda"; else echo "device_type=auto"; fi
    echo "model_tag=${MODEL_TAG:-(default: d$DEPTH)}"
    echo "run=$RUN_NAME"
    echo "base_dir=$BASE_DIR"
    echo "shared_fs=$SHARED_FS"
    echo "prepare=$PREPARE"
    local note
    for note in ${NOTES[@]+"${NOTES[@]}"}; do log "note: $note"; done
    if ((DRY_RUN)); then log "dry run: printing the commands, running nothing"; fi
}

# --- rank-0-only work: data shards and tokenizer, done before any torchrun ------------------------------------
tokenizer_ready() { [[ -f "$TOK_DIR/tokenizer.pkl" && -f "$TOK_DIR/token_bytes.pt" ]]; }
prepare_here() {
    run_cmd "${PY[@]}" -m nanochat.dataset -n "$NUM_SHARDS"
    if tokenizer_ready; then
        log "tokenizer found in $TOK_DIR: not training one"
    else
        run_cmd "${PY[@]}" -m scripts.tok_train --max_chars="${TOK_MAX_CHARS:-2000000000}"
    fi
}
write_marker() {
    echo "WRITE: $MARKER (num_shards=$NUM_SHARDS): the other nodes may proceed"
    if ((DRY_RUN)); then return 0; fi
    mkdir -p "$(dirname "$MARKER")"
    local tmp="$MARKER.tmp.$$"
    echo "num_shards=$NUM_SHARDS" >"$tmp"
    sync "$tmp" 2>/dev/null || sync
    mv -f "$tmp" "$MARKER"
}
wait_for_marker() {
    echo "WAIT: for $MARKER (num_shards=$NUM_SHARDS) from node 0, up to ${PREP_TIMEOUT}s"
    if ((DRY_RUN)); then return 0; fi
    local start=$SECONDS
    until [[ -f "$MARKER" && "$(cat "$MARKER" 2>/dev/null)" == "num_shards=$NUM_SHARDS" ]]; do
        if ((SECONDS - start >= PREP_TIMEOUT)); then
            die "node $NODE_RANK waited ${PREP_TIMEOUT}s for node 0 to download the data and train the tokenizer
  (marker $MARKER never appeared). Check node 0's log. If $BASE_DIR is not one filesystem shared by all
  nodes, set NANOCHAT_SHARED_FS=0 so every node prepares its own copy; for a slow download raise NANOCHAT_PREP_TIMEOUT."
        fi
        sleep "$PREP_POLL"
    done
    tokenizer_ready || die "node 0 marked the preparation done but $TOK_DIR has no tokenizer.pkl/token_bytes.pt here:
  is $BASE_DIR really shared between the nodes? If not, set NANOCHAT_SHARED_FS=0."
    log "node 0 finished the preparation after $((SECONDS - start))s"
}
prepare() {
    if [[ "$MODE" == posttrain ]] || ((!PREPARE)); then return 0; fi
    if ((NNODES > 1 && SHARED_FS)); then
        if ((NODE_RANK == 0)); then
            # a marker from an earlier run with this key must not release the other nodes early
            ((DRY_RUN)) || rm -f "$MARKER"
            prepare_here
            write_marker
        else
            wait_for_marker
        fi
    else
        prepare_here # one node, or node-local base dirs: each node prepares for itself
    fi
}

# --- the torchrun stages ----------------------------------------------------------------------------------------
stage() { # stage MODULE ARGS...: one torchrun over all nodes
    local module="$1"
    shift
    local -a args=(${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"} "$@")
    # "--" keeps the script's flags away from torchrun's own option parsing (--run would be ambiguous there)
    if [[ ${#args[@]} -gt 0 ]]; then
        run_cmd "${TR[@]}" "${TR_ARGS[@]}" -m "$module" -- "${args[@]}"
    else
        run_cmd "${TR[@]}" "${TR_ARGS[@]}" -m "$module"
    fi
}
run_stages() {
    local -a tag=() ev=()
    [[ -z "$MODEL_TAG" ]] || tag=(--model_tag="$MODEL_TAG") ev=(-g "$MODEL_TAG")
    # the model-memory settings every training stage gets, each only when it is not the scripts' default (none, 1,
    # DDP; tests/test_launch.py checks those defaults): FSDP, activation checkpointing, tensor parallelism
    local -a model_args=()
    [[ "$ACTIVATION_CHECKPOINTING" == none ]] || model_args+=(--activation_checkpointing="$ACTIVATION_CHECKPOINTING")
    [[ -z "$AC_EVERY" ]] || model_args+=(--ac_every="$AC_EVERY")
    ((TP_SIZE <= 1)) || model_args+=(--tp_size="$TP_SIZE")
    ((!USE_FSDP)) || model_args+=(--use_fsdp=1)
    if [[ "$MODE" != posttrain ]]; then
        if ((NODE_RANK == 0)); then run_cmd "${PY[@]}" -m nanochat.report reset; fi
        stage scripts.base_train --depth="$DEPTH" --device_batch_size="$DEVICE_BATCH_SIZE" ${model_args[@]+"${model_args[@]}"} \
            ${tag[@]+"${tag[@]}"} --run="$RUN_NAME" ${PASS[@]+"${PASS[@]}"}
        stage scripts.base_loss --device_batch_size="$DEVICE_BATCH_SIZE" ${tag[@]+"${tag[@]}"}
        stage scripts.base_eval ${tag[@]+"${tag[@]}"}
    fi
    if [[ "$MODE" != pretrain ]]; then
        stage scripts.mid_train --run="$RUN_NAME" --device_batch_size="$DEVICE_BATCH_SIZE" ${model_args[@]+"${model_args[@]}"} ${tag[@]+"${tag[@]}"}
        stage scripts.chat_eval -i mid ${ev[@]+"${ev[@]}"}
        stage scripts.chat_sft --run="$RUN_NAME" ${SFT_ARGS[@]+"${SFT_ARGS[@]}"} ${model_args[@]+"${model_args[@]}"} ${tag[@]+"${tag[@]}"}
        stage scripts.chat_eval -i sft ${ev[@]+"${ev[@]}"}
    fi
    if ((NODE_RANK == 0)); then run_cmd "${PY[@]}" -m nanochat.report generate; fi
}

main() {
    # Some platforms (Kubeflow-style PyTorchDDP jobs) export RANK/WORLD_SIZE per node. torchrun sets the per-process
    # values for its children; the plain python steps here (download, tokenizer, report) must not see the node's.
    unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK
    parse_flags "$@"
    is_uint "$DEPTH" || die "--depth expects a whole number, got '$DEPTH'"
    detect_launcher
    pick_interpreter
    resolve_presets
    # GPUs visible: every stage runs on CUDA, once torch is known to see them
    DEVICE_ARGS=()
    ((NGPU == 0)) || DEVICE_ARGS=(--device_type=cuda)

    BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
    export NANOCHAT_BASE_DIR="$BASE_DIR"
    SHARED_FS="$(to_bool01 NANOCHAT_SHARED_FS "${NANOCHAT_SHARED_FS:-1}")"
    PREP_TIMEOUT="${NANOCHAT_PREP_TIMEOUT:-14400}" PREP_POLL="${NANOCHAT_PREP_POLL:-10}"
    is_uint "$PREP_TIMEOUT" || die "NANOCHAT_PREP_TIMEOUT expects whole seconds, got '$PREP_TIMEOUT'"
    JOB_KEY="${NANOCHAT_RUN_ID:-${JOB_KEY:-${MASTER_ADDR_}-${MASTER_PORT_}}}"
    JOB_KEY="$(printf '%s' "$JOB_KEY" | tr -c 'A-Za-z0-9._-' '_')"
    MARKER="$BASE_DIR/.nanochat_ready/prep-$JOB_KEY"
    TOK_DIR="$BASE_DIR/tokenizer"

    print_settings
    if ((NGPU > 0)); then (export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" && check_gpus "${PY[@]}") || exit 1; fi
    ((DRY_RUN)) || mkdir -p "$BASE_DIR" # every node makes its own base dir (node-local or not)
    prepare
    run_stages
    log "done ($MODE)"
}

# Sourcing the file (tests do) defines the functions without running anything.
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    main "$@"
fi
