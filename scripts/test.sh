#!/usr/bin/env bash
# The README's test command: install + build, then the C++ unit tests (ctest) and the Python tests (pytest).
# Without a GPU the GPU tests skip and the Triton kernels run under TRITON_INTERPRET=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh

cmake -S . -B build/cpp-tests -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v $PY)" >/dev/null
cmake --build build/cpp-tests -j "$(nproc)"
(cd build/cpp-tests && ctest --output-on-failure)

$PY -m pytest tests "$@"
