#!/usr/bin/env bash
# What an offline GPU machine lacks, prepared here into .whl/ (git-ignored) to travel with the working tree.
# The lent H100/H200 image (Python 3.12, torch 2.11+cu130, Triton, numpy, pytest, transformers, httpx, ...) has
# neither torchao (FP8 rows), nor the server's fastapi / uvicorn / pydantic (the `serve` part: without them its
# servers do not start), nor this repo's Rust tokenizer built for its Python; nothing can be downloaded there.
#   bash bench/gpu_wheels.sh [PYTHON3.12]      # default: python3.12 on PATH (a pyenv 3.12 works)
# then on the GPU machine, from the repo root, before bench/gpu_suite.sh (run's carry: [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/.whl/site
# Used on 2026-11-27 (docs/benchmarks.md): torchao 0.17.0 matches the image's torch 2.11 (0.18 wants torch 2.15).
set -euo pipefail
cd "$(dirname "$0")/.."
PY312="${1:-python3.12}"
TORCHAO="${TORCHAO_VERSION:-0.17.0}"
mkdir -p .whl/site
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d .whl "torchao==$TORCHAO"
# the chat server's and the serving benchmark's packages, with what they need, for CPython 3.12 (used 2026-11-27 on
# an H100: fastapi 0.165, uvicorn 0.54, pydantic 2.14 beside the image's own packages)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl fastapi uvicorn httpx
# rustbpe for CPython 3.12: build this package's wheel with that interpreter and keep only the extension
tmp=$(mktemp -d)
"$PY312" -m pip wheel -q --no-deps -w "$tmp" .
python3 -m zipfile -e "$tmp"/nanochat-*.whl "$tmp/unpacked"
rm -rf .whl/site/rustbpe && cp -r "$tmp/unpacked/rustbpe" .whl/site/
rm -rf "$tmp"
ls -la .whl .whl/site/rustbpe
