# scripts/lib.sh: the shell helpers the launch scripts share (sourced, never run on its own).
#   runcpu.sh, speedrun.sh (and run1000.sh through it), tests/run.sh, volc/volc_submit.sh (pretrain.sh is
#   scripts/launch.py, which speedrun.sh also hands its pipeline to after the setup)
# Callers set LIB_TAG (the log prefix) and DRY_RUN (1: print commands instead of running them) before using these.
# Logic that can be tested in Python lives in Python (scripts/launch.py, nanochat/setup_check.py, nanochat/presets.py);
# this file only holds what has to be shell: logging, quoting, running commands, and bootstrapping a fresh machine.

log() { echo "[${LIB_TAG:-nanochat}] $*"; }
banner() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
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
    PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" python3 -c \
        'import sys; from nanochat.configurator import suggest; print(suggest(sys.argv[1], sys.argv[2:]), end="")' \
        "$@" 2>/dev/null || true
}

# launch_flags PYTHON LAUNCHER ARGS...: the launcher's flags parsed by scripts/launch.py (nanochat's Flags: --help,
# "Did you mean", value checks, exit 2 on a mistake) before anything runs; sets DRY_RUN. Run from the repo root.
launch_flags() {
    local py="$1" a out
    shift
    for a in "${@:2}"; do
        case "$a" in -h | --help) "$py" -m scripts.launch "$@"; exit 0 ;; esac
    done
    out="$("$py" -m scripts.launch "$@")" || exit $?
    eval "$out"
}

quote_cmd() {
    local out="" w
    for w in "$@"; do out+=" $(printf '%q' "$w")"; done
    echo "${out# }"
}

# Print every command before running it; in a dry run, only print.
run_cmd() {
    echo "RUN: $(quote_cmd "$@")"
    if ((${DRY_RUN:-0})); then return 0; fi
    "$@"
}

# The same for a shell pipeline, printed as written.
run_sh() {
    echo "RUN: $1"
    if ((${DRY_RUN:-0})); then return 0; fi
    bash -c "$1"
}

# ---------------------------------------------------------------------------------------------------------------------
# A fresh machine: venv, Rust, the nanochat install. Each step checks first and says what it does; in a dry run the
# checks still run (they change nothing) and the actions are only printed.

# ensure_venv DIR: a virtual environment with pip. Ubuntu ships python3 without the venv module (package
# python3.X-venv): then fall back to uv (https://docs.astral.sh/uv/), installed from PyPI with pip if needed.
ensure_venv() {
    local venv="$1" uv=""
    if [[ -x "$venv/bin/python" ]]; then return 0; fi
    log "creating the virtual environment $venv"
    if ((${DRY_RUN:-0})) && python3 -c "import ensurepip, venv" 2>/dev/null; then
        run_cmd python3 -m venv "$venv"
        return 0
    fi
    if ((!${DRY_RUN:-0})) && python3 -m venv "$venv" 2>/dev/null; then return 0; fi
    ((${DRY_RUN:-0})) || rm -rf "$venv" # a failed `python3 -m venv` leaves a venv without pip behind
    local pkg
    pkg="$(python3 -c 'import sys; print(f"python3.{sys.version_info.minor}-venv")' 2>/dev/null || echo python3-venv)"
    log "python3 -m venv does not work here (Debian/Ubuntu: the $pkg package is missing); trying uv instead"
    if ((${DRY_RUN:-0})); then
        command -v uv >/dev/null 2>&1 || run_cmd python3 -m pip install --user --quiet uv
        run_cmd uv venv --seed --python "$(command -v python3)" "$venv"
        return 0
    fi
    uv="$(command -v uv || true)"
    if [[ -z "$uv" && -x "$HOME/.local/bin/uv" ]]; then uv="$HOME/.local/bin/uv"; fi
    if [[ -z "$uv" ]] && python3 -m pip --version >/dev/null 2>&1; then
        run_cmd python3 -m pip install --user --quiet uv ||
            run_cmd python3 -m pip install --user --quiet --break-system-packages uv || true
        if [[ -x "$HOME/.local/bin/uv" ]]; then uv="$HOME/.local/bin/uv"; fi
    fi
    [[ -n "$uv" ]] || die "cannot create a virtual environment: install $pkg (sudo apt-get install $pkg) or uv (https://docs.astral.sh/uv/), then run again"
    # --seed puts pip into the venv: the rest of the setup runs `python -m pip`
    run_cmd "$uv" venv --seed --python "$(command -v python3)" "$venv"
}

# have_cargo: a cargo that runs, on PATH or in ~/.cargo/bin (then put on PATH); no install. A rustup proxy with no
# default toolchain is on PATH but cannot build anything: that is not a cargo (cargo_problem says what to do).
have_cargo() {
    if ! command -v cargo >/dev/null 2>&1; then
        [[ -x "$HOME/.cargo/bin/cargo" ]] || return 1
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    cargo --version >/dev/null 2>&1
}

# cargo_problem: why have_cargo failed, with the fix, for a die message.
cargo_problem() {
    if command -v cargo >/dev/null 2>&1; then
        echo "cargo is on PATH ($(command -v cargo)) but does not run ('cargo --version' fails: $(cargo --version 2>&1 | head -n 1)); with rustup, 'rustup default stable' sets a toolchain"
    else
        echo "cargo not found: install Rust (https://rustup.rs, or: curl https://sh.rustup.rs -sSf | sh -s -- -y)"
    fi
}

# ensure_rust: cargo on PATH, installing Rust with rustup (as nanochat's speedrun does) when there is none.
# maturin needs it to build the rustbpe extension.
ensure_rust() {
    have_cargo && return 0
    command -v cargo >/dev/null 2>&1 && die "$(cargo_problem) to build the rustbpe tokenizer"
    log "cargo not found: installing Rust with rustup into $HOME/.cargo (needed to build the rustbpe tokenizer)"
    run_sh "curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y"
    export PATH="$HOME/.cargo/bin:$PATH"
}

# ensure_installed PYTHON: nanochat installed into that interpreter, decided from the installed distribution
# (python -m nanochat.setup_check), never from what imports from the repository root.
ensure_installed() {
    local py="$1"
    if [[ -x "$py" ]] && "$py" -m nanochat.setup_check installed; then return 0; fi
    ensure_rust
    log "installing nanochat into $(dirname "$(dirname "$py")") (pip install -e .; builds the rustbpe extension)"
    run_cmd "$py" -m pip install -q --upgrade pip
    run_cmd "$py" -m pip install -q -e .
    if ((${DRY_RUN:-0})); then return 0; fi
    "$py" -m nanochat.setup_check installed >/dev/null || die "the install finished but nanochat is still not usable (see above)"
}

# check_gpus PYTHON...: stop unless torch can use the GPUs (never train on the CPU by accident).
check_gpus() {
    if ((${DRY_RUN:-0})); then
        echo "CHECK: $(quote_cmd "$@" -m nanochat.setup_check gpu)"
        return 0
    fi
    "$@" -m nanochat.setup_check gpu || exit 1
}
