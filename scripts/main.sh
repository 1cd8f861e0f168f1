#!/usr/bin/env bash
# The README's main command: install + build, then benchmark every backend on whatever device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
$PY -m lora_ops.bench "$@"
