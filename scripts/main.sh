#!/usr/bin/env bash
# The README's main command: install + build (only what changed, scripts/install.sh), then the multi-LoRA demo
# (lora_ops vs PEFT; arguments go to `python -m lora_ops.demo`) on whatever device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh "$@"
source scripts/common.sh
select_python
"$PY" -m lora_ops.demo "$@"
