#!/usr/bin/env bash
# The one test command: create or reuse a venv, install nanochat with [dev] (this builds the rustbpe
# extension with maturin), then run the suite, multi-process tests included. Arguments go to pytest:
#   bash tests/run.sh -k tokenizer -x
#   bash tests/run.sh -m "not slow and not dist"
# Settings:
#   NANOCHAT_VENV=path            venv to create/reuse (default: .venv in the repo)
#   NANOCHAT_TEST_WORKERS=N       test worker processes (default 2; 0 = run in this process, for pdb or -s)
#   NANOCHAT_INSTALL_CHROMIUM=1   install Debian's chromium with apt-get (as root) for the web UI test. Off by
#                                 default: this script changes nothing outside the repo and its venv unless asked;
#                                 without chromium the UI test is skipped with a reason. (CI sets it: .ci/run.)
set -euo pipefail
cd "$(dirname "$0")/.."
LIB_TAG=tests/run.sh
source scripts/lib.sh
VENV="${NANOCHAT_VENV:-.venv}"

# The venv and `pip install -e .[dev]` every time, as runcpu.sh and speedrun.sh set up theirs (nanochat/launch/
# bootstrap.py, standard library only). A missing or broken cargo is named with its fix: installing Rust is
# speedrun.sh's business, not this.
python3 -m nanochat.launch.bootstrap install "$VENV" --extras=dev --reinstall --install_rust=0 --tag=tests/run.sh

# The web UI test drives Debian's chromium through Playwright (no browser download).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if [[ "${NANOCHAT_INSTALL_CHROMIUM:-0}" == 1 ]]; then
        [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1 ||
            die "NANOCHAT_INSTALL_CHROMIUM=1 needs root and apt-get; otherwise install chromium yourself"
        log "NANOCHAT_INSTALL_CHROMIUM=1: installing chromium with apt-get for the UI test"
        run_sh "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null" ||
            log "could not install chromium; the UI test will be skipped with a reason"
    else
        log "no chromium: the web UI test will be skipped (NANOCHAT_INSTALL_CHROMIUM=1 installs it with apt-get, as root)"
    fi
fi

export PYTHONUNBUFFERED=1
# Two test files at a time (pytest-xdist; a file's tests stay in one worker, so its module fixtures are built once):
# the whole suite in about half the time on two cores. The files go out longest first (tests/conftest.py orders them;
# --no-loadscope-reorder keeps that order instead of xdist's most-tests-first), so no minutes-long file of torchrun
# runs is left for the end while the other worker idles. NANOCHAT_TEST_WORKERS=0 runs in this process (for pdb, -s).
WORKERS="${NANOCHAT_TEST_WORKERS:-2}"
if [[ "$WORKERS" == 0 ]]; then
    exec "$VENV/bin/python" -m pytest -q "$@"
fi
exec "$VENV/bin/python" -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
