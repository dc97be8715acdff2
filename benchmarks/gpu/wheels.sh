#!/usr/bin/env bash
# Download the pure-Python wheels `make gpu` needs beyond a CUDA machine's usual PyTorch stack
# (torch, opt-einsum, networkx, sympy, numpy, rich, transformers) into ./.whl (it ignores itself
# with its own .gitignore: never committed). On the GPU machine, from the repository root, install them with one line:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# cotengra + autoray: tncomp's path search for networks above its exact-search limit (the d=3
#   layers of `make gpu` do not reach it; brought so any layer plans).
# galore-torch: the GaLore baseline; its __init__ imports bitsandbytes (large, CUDA-specific),
#   which the benchmark does not need: benchmarks/gpu/galore.py loads GaLoreAdamW without it.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
echo '*' > "$DEST/.gitignore"  # the folder ignores itself: never committed, still carried
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation py --platform any -d "$DEST" \
    cotengra==0.8.3 autoray==0.11.0 galore-torch==1.0
ls -l "$DEST"
