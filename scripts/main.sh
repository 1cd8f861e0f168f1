#!/usr/bin/env bash
# The README's main command: install + build, then the multi-LoRA demo (lora_ops vs PEFT) on whatever device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
$PY -m lora_ops.demo "$@"
