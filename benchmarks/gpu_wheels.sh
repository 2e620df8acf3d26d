#!/usr/bin/env bash
# The wheels a lent CUDA machine without network needs beside its image, for benchmarks/gpu_check.sh.
# This project's H200 image (2026-12) has Python 3.12, torch 2.11+cu130, lightning, an older transformers
# (5.17) and huggingface_hub (1.33), and no datasets or FlashInfer. This writes into DIR (~23 MB):
#   - the versions that ran there on 2026-12-04: datasets, dill, multiprocess, transformers,
#     huggingface_hub and what they import (kernels, httpx2, httpcore2, truststore, tomlkit);
#   - FlashInfer 0.2.14.post1 built here from its sdist (py3-none-any, 5.4 MB, kernels compiled on the GPU
#     at first use). PyPI's FlashInfer 0.7 wheel is 101 MB: over the 64 MiB a device call carries.
#
#   bash benchmarks/gpu_wheels.sh .whl          # here (pip reaches PyPI); .gitignore ignores /.whl/
# then, on the lent machine (the device tool carries .whl):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash benchmarks/gpu_check.sh --python python3 --out /tmp/gc
set -euo pipefail
DIR=${1:?usage: gpu_wheels.sh DIR (where the wheels go)}
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
mkdir -p "$DIR"
PINS=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.25.0 huggingface_hub==2.4.0
      kernels==0.19.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 tomlkit==0.15.3)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" "${PINS[@]}"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
"$PY" -m pip download -q --no-deps -d "$src" flashinfer-python==0.2.14.post1
"$PY" -m pip wheel -q --no-deps -w "$DIR" "$src"/flashinfer_python-0.2.14.post1.tar.gz
ls -la "$DIR"
