#!/usr/bin/env bash
# Installs everything lora_ops needs on a fresh Debian/Ubuntu machine (CPU or GPU) and builds the package:
# torch, build tools, gtest, then `pip install --no-build-isolation -e .` (CUDA kernels when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.14.1"
fi
$PY -m pip install -q ninja pytest numpy "setuptools>=64" wheel transformers peft safetensors tqdm

if [ ! -e /usr/include/gtest/gtest.h ] || ! command -v cmake >/dev/null; then
  if command -v apt-get >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgtest-dev cmake >/dev/null
  fi
fi

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
$PY -m pip install -q --no-build-isolation -e .
$PY -m lora_ops.info
