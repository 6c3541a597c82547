#!/usr/bin/env bash
# The one test command: create or reuse a venv, install nanochat with [dev] (this builds the rustbpe
# extension with maturin), then run the whole suite, multi-process tests included.
#   NANOCHAT_VENV=path   venv to create/reuse (default: .venv in the repo)
#   extra arguments are passed to pytest, e.g. `bash tests/run.sh -k tokenizer -x`
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${NANOCHAT_VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[tests/run.sh] creating venv at $VENV"
    "$PY" -m venv "$VENV"
fi
# Rust toolchain for the rustbpe extension (maturin calls cargo).
if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "[tests/run.sh] cargo not found: install Rust (https://rustup.rs) to build rustbpe" >&2
        exit 1
    fi
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
echo "[tests/run.sh] installing nanochat[dev] (builds rustbpe)"
"$VENV/bin/python" -m pip install -q -e ".[dev]"

# The web UI test drives Debian's chromium through Playwright (no browser download).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[tests/run.sh] installing chromium for the UI test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "[tests/run.sh] could not install chromium; the UI test will be skipped with a reason"
fi

export PYTHONUNBUFFERED=1
exec "$VENV/bin/python" -m pytest -q "$@"
