# scripts/lib.sh: the shell helpers of the two shell scripts that are still shell (sourced, never run on its own):
# volc/volc_submit.sh (writes a job file) and tests/run.sh (the test command). The launchers (pretrain.sh, speedrun.sh,
# run1000.sh, runcpu.sh) are Python: scripts/launch.py and nanochat/launch/, its fresh-machine setup included
# (nanochat/launch/bootstrap.py, which tests/run.sh runs too).
# Callers set LIB_TAG (the log prefix).

log() { echo "[${LIB_TAG:-nanochat}] $*"; }
die() {
    echo "[${LIB_TAG:-nanochat}] error: $*" >&2
    exit 2
}
# --help: the script's header comment, from line 2 down to `set -euo pipefail`
usage() { sed -n '2,/^set -euo pipefail/p' "$1" | sed -e '$d' -e 's/^# \{0,1\}//'; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# suggest_flag NAME KNOWN...: " Did you mean: --x?" for an unknown option (nanochat.configurator.suggest, the hint
# every script gives), or nothing when no python3 is at hand.
suggest_flag() {
    PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" python3 -m scripts.launch suggest "$@" 2>/dev/null || true
}

quote_cmd() {
    local out="" w
    for w in "$@"; do out+=" $(printf '%q' "$w")"; done
    echo "${out# }"
}

# Print a shell pipeline, then run it.
run_sh() {
    echo "RUN: $1"
    bash -c "$1"
}
