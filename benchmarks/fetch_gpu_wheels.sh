#!/usr/bin/env bash
# Downloads, on a machine with pip access, the wheels benchmarks/run_gpu.sh installs on a GPU machine that has
# PyTorch but cannot download anything (Python 3.12, x86-64). Keep the folder out of git, e.g.
#   echo /.whl/ >> .git/info/exclude
# and carry it to the GPU machine with the working tree. Together the wheels are about 20 MB.
#
# Usage (repository root):  bash benchmarks/fetch_gpu_wheels.sh [folder, default .whl] [python version, default 3.12]
set -euo pipefail

DEST="${1:-.whl}"
PYVER="${2:-3.12}"
mkdir -p "$DEST"
# Only what the GPU image lacks (it has torch, accelerate, tokenizers, safetensors, huggingface-hub, pandas, pyarrow,
# psutil, xxhash, fsspec); datasets' own pure-Python needs come along.
for requirement in "trl==1.16.0" "transformers==5.24.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19"; do
    python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$requirement"
done
ls -la "$DEST"
