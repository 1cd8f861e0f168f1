#!/usr/bin/env bash
# The README's test command: install + build (only what changed, scripts/install.sh), then the C++ unit tests
# (ctest) and the Python tests (pytest, which gets this script's arguments). Without a GPU the GPU tests skip and
# the Triton kernels run under TRITON_INTERPRET=1. LORA_OPS_VERBOSE=1 or -v shows every tool's output.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh "$@"
source scripts/common.sh
select_python

# The C++ tests: configured once per Python and torch, then built incrementally (they link lora_ops/_C.so).
read_stamp='import json; stamp = json.load(open("build/extension-stamp.json")); print(stamp["python"], stamp["torch"])'
configured_for=$("$PY" -c "$read_stamp")
if [ "$(cat build/cpp-tests/configured-for 2>/dev/null)" != "$configured_for" ]; then
  say "configuring the C++ tests (cmake, build/cpp-tests) for $configured_for"
  quietly cmake -S . -B build/cpp-tests -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PY"
  echo "$configured_for" >build/cpp-tests/configured-for
fi
quietly cmake --build build/cpp-tests -j "$(nproc)"
if [ "$LORA_OPS_VERBOSE" = 1 ]; then
  (cd build/cpp-tests && ctest --output-on-failure)
elif (cd build/cpp-tests && ctest --output-on-failure >ctest.log 2>&1); then
  echo "ctest: $(grep -E 'tests passed' build/cpp-tests/ctest.log)"
else
  cat build/cpp-tests/ctest.log
  exit 1
fi

"$PY" -m pytest tests "$@"
