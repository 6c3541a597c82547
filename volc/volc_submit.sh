#!/usr/bin/env bash
# volc_submit.sh: write a Volcengine ML Platform job file (`volc ml_task` YAML) for a nanochat command and submit it.
#
#   NNODES=4 IMAGE=... QUEUE_ID=... FLAVOR=... bash volc/volc_submit.sh bash pretrain.sh --depth=32
#   bash volc/volc_submit.sh --dry-run --nnodes 2 bash pretrain.sh --depth=20     # write + print the YAML only
#
# Every worker of the task runs the same entrypoint, `cd CODE_DIR && [SETUP &&] exec COMMAND`; pretrain.sh then reads
# the platform's MLP_* variables to find its node rank and the master. `exec`: the command replaces the entrypoint's
# shell, so the platform's SIGTERM (sent to the container's first process) reaches pretrain.sh, which passes it on. Options come first, then the command (default:
# bash pretrain.sh); `--` may separate them. Each option also reads an environment variable (in brackets):
#   --task_name NAME     [TASK_NAME]   default nanochat[-dN]-nNNODES-YYYYmmdd-HHMMSS
#   --image URL          [IMAGE]       container image with nanochat's dependencies (required)
#   --queue ID           [QUEUE_ID]    resource queue ID, q-... (required, or --queue_name)
#   --queue_name NAME    [QUEUE_NAME]  resource queue by name instead of ID
#   --flavor NAME        [FLAVOR]      instance type per node, e.g. an 8-GPU ml.* flavor (required)
#   --nnodes N           [NNODES]      nodes (worker replicas), default 1
#   --framework NAME     [FRAMEWORK]   default PyTorchDDP (the platform then sets MLP_WORKER_0_HOST/PORT)
#   --code_dir DIR       [CODE_DIR]    where the code is inside the container, default /root/code/nanochat
#   --upload_dir DIR     [UPLOAD_DIR]  local directory uploaded to CODE_DIR, default this repository
#   --no_upload          [NO_UPLOAD=1] upload nothing: the code is already at CODE_DIR (in the image or on storage)
#   --storage SPEC       [STORAGES]    repeatable (env: space-separated): vepfs:ID:MOUNT[:SUBPATH] |
#                                      nas:ID:MOUNT | tos:BUCKET:MOUNT[:PREFIX]
#   --base_dir DIR       [NANOCHAT_BASE_DIR]  default MOUNT/nanochat on the first storage
#   --env NAME=VALUE     [ENVS]        repeatable (env: space-separated); names with KEY/TOKEN/SECRET/PASSWORD are private
#   --setup CMD          [SETUP_CMD]   run before the command, e.g. "pip install -e ."
#   --priority N         [PRIORITY]    --preemptible [PREEMPTIBLE=1]    --deadline SECONDS [DEADLINE], default 432000
#   --out FILE           [JOB_YAML]    default volc/jobs/TASK_NAME.yaml
#   --dry-run            [DRY_RUN=1]   write and print the YAML, do not submit; missing values become placeholders
set -euo pipefail

LIB_TAG=volc_submit.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/lib.sh" # log, die, usage, is_uint, quote_cmd

# YAML single-quoted scalar: only ' needs escaping ('' ), backslashes stay literal, so shell quoting survives as is.
yq() {
    case "$1" in
        *$'\n'* | *$'\r'*) die "value with a line break cannot go into the job file: $1" ;;
    esac
    printf "'%s'" "${1//\'/\'\'}"
}

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

TASK_NAME="${TASK_NAME:-}"
IMAGE="${IMAGE:-}"
QUEUE_ID="${QUEUE_ID:-}"
QUEUE_NAME="${QUEUE_NAME:-}"
FLAVOR="${FLAVOR:-}"
NNODES_="${NNODES:-1}"
FRAMEWORK="${FRAMEWORK:-PyTorchDDP}"
CODE_DIR="${CODE_DIR:-/root/code/nanochat}"
UPLOAD_DIR="${UPLOAD_DIR:-$REPO_DIR}"
NO_UPLOAD="${NO_UPLOAD:-0}"
BASE_DIR="${NANOCHAT_BASE_DIR:-}"
SETUP_CMD="${SETUP_CMD:-}"
PRIORITY="${PRIORITY:-}"
PREEMPTIBLE="${PREEMPTIBLE:-0}"
DEADLINE="${DEADLINE:-432000}"
OUT="${JOB_YAML:-}"
DRY="${DRY_RUN:-0}"
read -r -a STORAGE_SPECS <<<"${STORAGES:-}"
read -r -a ENV_SPECS <<<"${ENVS:-}"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --) shift; break ;;
        -h | --help) usage "${BASH_SOURCE[0]}"; exit 0 ;;
        --*) ;;
        *) break ;; # the command starts here
    esac
    opt="${1#--}"
    shift
    val=""
    has_val=0
    if [[ "$opt" == *=* ]]; then
        val="${opt#*=}"
        opt="${opt%%=*}"
        has_val=1
    fi
    opt="$(echo "$opt" | tr '-' '_')"
    case "$opt" in
        dry_run | no_upload | preemptible | task_name | image | queue | queue_id | queue_name | flavor | nnodes | \
            framework | code_dir | upload_dir | storage | base_dir | env | setup | priority | deadline | out) ;;
        *) die "unknown option --$opt.$(suggest_flag "$opt" dry_run no_upload preemptible task_name image queue \
            queue_name flavor nnodes framework code_dir upload_dir storage base_dir env setup priority deadline out) \
The command to run goes after the options (see --help)" ;;
    esac
    case "$opt" in
        dry_run) DRY=1; continue ;;
        no_upload) NO_UPLOAD=1; continue ;;
        preemptible) PREEMPTIBLE=1; continue ;;
    esac
    if ((!has_val)); then
        [[ $# -gt 0 ]] || die "option --$opt needs a value"
        val="$1"
        shift
    fi
    case "$opt" in
        task_name) TASK_NAME="$val" ;;
        image) IMAGE="$val" ;;
        queue | queue_id) QUEUE_ID="$val" ;;
        queue_name) QUEUE_NAME="$val" ;;
        flavor) FLAVOR="$val" ;;
        nnodes) NNODES_="$val" ;;
        framework) FRAMEWORK="$val" ;;
        code_dir) CODE_DIR="$val" ;;
        upload_dir) UPLOAD_DIR="$val" ;;
        storage) STORAGE_SPECS+=("$val") ;;
        base_dir) BASE_DIR="$val" ;;
        env) ENV_SPECS+=("$val") ;;
        setup) SETUP_CMD="$val" ;;
        priority) PRIORITY="$val" ;;
        deadline) DEADLINE="$val" ;;
        out) OUT="$val" ;;
    esac
done
CMD=("$@")
[[ ${#CMD[@]} -gt 0 ]] || CMD=(bash pretrain.sh)

is_uint "$NNODES_" && ((NNODES_ >= 1)) || die "--nnodes / NNODES must be a whole number >= 1, got '$NNODES_'"
is_uint "$DEADLINE" || die "--deadline expects whole seconds, got '$DEADLINE'"
[[ -z "$PRIORITY" ]] || is_uint "$PRIORITY" || die "--priority expects a whole number, got '$PRIORITY'"
case "$FRAMEWORK" in
    PyTorchDDP | Custom | MPI | TensorFlowPS | BytePS | MXNet) ;;
    *) die "--framework must be one of PyTorchDDP Custom MPI TensorFlowPS BytePS MXNet, got '$FRAMEWORK'" ;;
esac
case "$CODE_DIR" in /*) ;; *) die "--code_dir must be an absolute path inside the container, got '$CODE_DIR'" ;; esac

# --- required values: an error, or placeholders in a dry run -----------------------------------------------------
PLACEHOLDERS=()
missing() { # name, hint
    if ((DRY)); then
        PLACEHOLDERS+=("$1")
    else
        die "$2"
    fi
}
[[ -n "$IMAGE" ]] || { missing image "no image: pass --image URL or set IMAGE (copy it from the platform's image registry page)"; IMAGE="<IMAGE_URL>"; }
if [[ -z "$QUEUE_ID" && -z "$QUEUE_NAME" ]]; then
    missing queue "no resource queue: pass --queue q-... or set QUEUE_ID (or --queue_name / QUEUE_NAME)"
    QUEUE_ID="<RESOURCE_QUEUE_ID>"
fi
[[ -n "$FLAVOR" ]] || { missing flavor "no instance flavor: pass --flavor or set FLAVOR (e.g. the 8-GPU flavor of your queue)"; FLAVOR="<FLAVOR>"; }

# --- task name and output file ------------------------------------------------------------------------------------
if [[ -z "$TASK_NAME" ]]; then
    depth=""
    for ((i = 0; i < ${#CMD[@]}; i++)); do
        case "${CMD[i]}" in
            --depth=*) depth="${CMD[i]#--depth=}" ;;
            --depth) ((i + 1 < ${#CMD[@]})) && depth="${CMD[i + 1]}" ;;
        esac
    done
    TASK_NAME="nanochat${depth:+-d$depth}-n$NNODES_-$(date +%Y%m%d-%H%M%S)"
fi
[[ "$TASK_NAME" =~ ^[A-Za-z0-9._-]+$ ]] || die "--task_name may use letters, digits, '.', '_' and '-' only, got '$TASK_NAME'"
OUT="${OUT:-$REPO_DIR/volc/jobs/$TASK_NAME.yaml}"

# --- storages ------------------------------------------------------------------------------------------------------
STORAGE_YAML=""
FIRST_MOUNT=""
for spec in ${STORAGE_SPECS[@]+"${STORAGE_SPECS[@]}"}; do
    IFS=: read -r kind sid mount sub extra <<<"$spec"
    [[ -z "${extra:-}" && -n "${mount:-}" && "$mount" == /* ]] ||
        die "cannot read --storage '$spec': expected vepfs:ID:MOUNT[:SUBPATH], nas:ID:MOUNT or tos:BUCKET:MOUNT[:PREFIX] with an absolute MOUNT"
    case "$(echo "$kind" | tr '[:upper:]' '[:lower:]')" in
        vepfs)
            STORAGE_YAML+="  - Type: 'Vepfs'"$'\n'
            [[ -n "$sid" ]] && STORAGE_YAML+="    VepfsId: $(yq "$sid")"$'\n'
            STORAGE_YAML+="    MountPath: $(yq "$mount")"$'\n'
            [[ -n "${sub:-}" ]] && STORAGE_YAML+="    SubPath: $(yq "$sub")"$'\n'
            ;;
        nas)
            [[ -n "$sid" && -z "${sub:-}" ]] || die "--storage '$spec': NAS takes nas:NAS_ID:MOUNT"
            STORAGE_YAML+="  - Type: 'Nas'"$'\n'"    NasId: $(yq "$sid")"$'\n'"    MountPath: $(yq "$mount")"$'\n'
            ;;
        tos)
            [[ -n "$sid" ]] || die "--storage '$spec': TOS needs a bucket, tos:BUCKET:MOUNT[:PREFIX]"
            STORAGE_YAML+="  - Type: 'Tos'"$'\n'"    Bucket: $(yq "$sid")"$'\n'"    MountPath: $(yq "$mount")"$'\n'
            [[ -n "${sub:-}" ]] && STORAGE_YAML+="    Prefix: $(yq "$sub")"$'\n'
            ;;
        *) die "--storage '$spec': type must be vepfs, nas or tos" ;;
    esac
    FIRST_MOUNT="${FIRST_MOUNT:-$mount}"
done

# --- environment of the task -------------------------------------------------------------------------------------
SHARED_FS=1
if [[ -z "$BASE_DIR" && -n "$FIRST_MOUNT" ]]; then
    BASE_DIR="${FIRST_MOUNT%/}/nanochat"
fi
if [[ -z "$BASE_DIR" ]]; then
    # no storage: the base dir lives inside each container, so each node prepares its own data
    SHARED_FS=0
    log "warning: no --storage/--base_dir: data and checkpoints stay inside the containers and are lost when the task ends"
fi
ENV_YAML=""
add_env() { # name value
    local private=false
    case "$(echo "$1" | tr '[:lower:]' '[:upper:]')" in *KEY* | *TOKEN* | *SECRET* | *PASSWORD*) private=true ;; esac
    ENV_YAML+="  - Name: $(yq "$1")"$'\n'"    Value: $(yq "$2")"$'\n'"    IsPrivate: $private"$'\n'
}
add_env PYTHONUNBUFFERED 1 # stream the training log instead of flushing it in blocks
[[ -n "$BASE_DIR" ]] && add_env NANOCHAT_BASE_DIR "$BASE_DIR"
add_env NANOCHAT_SHARED_FS "$SHARED_FS"
for spec in ${ENV_SPECS[@]+"${ENV_SPECS[@]}"}; do
    [[ "$spec" == *=* && "${spec%%=*}" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "--env expects NAME=VALUE, got '$spec'"
    add_env "${spec%%=*}" "${spec#*=}"
done

ENTRY="cd $(printf '%q' "$CODE_DIR") && "
[[ -n "$SETUP_CMD" ]] && ENTRY+="$SETUP_CMD && "
ENTRY+="exec $(quote_cmd "${CMD[@]}")"

if ((!NO_UPLOAD)); then
    [[ -d "$UPLOAD_DIR" ]] || die "--upload_dir '$UPLOAD_DIR' is not a directory"
    UPLOAD_DIR="$(cd "$UPLOAD_DIR" && pwd)/" # trailing '/': upload the contents into CODE_DIR, not a subfolder
    for big in .venv rustbpe/target; do
        [[ -e "$UPLOAD_DIR$big" ]] && log "note: $UPLOAD_DIR$big will be uploaded too; to skip it upload a clean copy (--upload_dir) or use --no_upload"
    done
fi

# --- the job file --------------------------------------------------------------------------------------------------
mkdir -p "$(dirname "$OUT")"
TMP="$OUT.tmp.$$"
umask 077 # the file may hold private env values
{
    echo "# volc ml_task job for nanochat, written by volc/volc_submit.sh on $(date '+%Y-%m-%d %H:%M:%S')"
    echo "# submit: volc ml_task submit --conf $OUT"
    echo "TaskName: $(yq "$TASK_NAME")"
    echo "Description: $(yq "nanochat: $(quote_cmd "${CMD[@]}") on $NNODES_ node(s)")"
    echo "Entrypoint: $(yq "$ENTRY")"
    echo "ImageUrl: $(yq "$IMAGE")"
    if [[ -n "$QUEUE_NAME" ]]; then
        echo "ResourceQueueName: $(yq "$QUEUE_NAME")"
    else
        echo "ResourceQueueID: $(yq "$QUEUE_ID")"
    fi
    echo "Framework: $(yq "$FRAMEWORK")"
    echo "TaskRoleSpecs:"
    echo "  - RoleName: 'worker'"
    echo "    RoleReplicas: $NNODES_"
    echo "    Flavor: $(yq "$FLAVOR")"
    echo "ActiveDeadlineSeconds: $DEADLINE"
    echo "DelayExitTimeSeconds: 0"
    if ((PREEMPTIBLE)); then echo "Preemptible: true"; else echo "Preemptible: false"; fi
    [[ -n "$PRIORITY" ]] && echo "Priority: $PRIORITY"
    if ((!NO_UPLOAD)); then
        echo "UserCodePath: $(yq "$UPLOAD_DIR")"
        echo "RemoteMountCodePath: $(yq "$CODE_DIR")"
    fi
    echo "Envs:"
    printf '%s' "$ENV_YAML"
    if [[ -n "$STORAGE_YAML" ]]; then
        echo "Storages:"
        printf '%s' "$STORAGE_YAML"
    else
        echo "Storages: []"
    fi
} >"$TMP"
sync "$TMP" 2>/dev/null || true
mv -f "$TMP" "$OUT"

log "wrote $OUT (task $TASK_NAME, $NNODES_ x $FLAVOR)"
if ((DRY)); then
    cat "$OUT"
    if [[ ${#PLACEHOLDERS[@]} -gt 0 ]]; then
        log "placeholders for: ${PLACEHOLDERS[*]} (the file will not submit until they are filled in)"
    fi
    log "dry run: would run: volc ml_task submit --conf $OUT"
    exit 0
fi

VOLC="${VOLC:-}"
if [[ -z "$VOLC" ]]; then
    if command -v volc >/dev/null 2>&1; then
        VOLC=volc
    elif [[ -x "$HOME/.volc/bin/volc" ]]; then
        VOLC="$HOME/.volc/bin/volc"
    else
        die "the volc CLI is not installed: see the Volcengine ML Platform CLI docs (installs to ~/.volc/bin), run 'volc configure', or use --dry-run to only write $OUT"
    fi
fi
echo "RUN: $VOLC ml_task submit --conf $OUT"
exec "$VOLC" ml_task submit --conf "$OUT"
