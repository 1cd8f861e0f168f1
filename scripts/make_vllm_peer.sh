#!/usr/bin/env bash
# Builds an importable copy of vLLM's Triton LoRA ops (lora_shrink, lora_expand, LoRAKernelMeta) from vLLM's wheel,
# for the bench's `vllm` peer (lora_ops/bench/peers.py), without vLLM's dependencies: its five modules as they are,
# under small stand-ins for the vllm modules they import (envs at vLLM's defaults, the logger, the platform query,
# triton_utils, next_power_of_2, async_tensor_h2d and direct_register_custom_op, which registers the ops as
# torch.ops.vllm.* as vLLM does). Needs a package registry (pip download) or a wheel given as WHEEL; copy DEST to
# the GPU machine (the device tool's `carry`) and point LORA_OPS_VLLM_PEER at it (default: build/peers/vllm).
# Usage: bash scripts/make_vllm_peer.sh [DEST] (VLLM_VERSION=0.33.0, or WHEEL=path/to/vllm-*.whl without a download)
set -euo pipefail
# DEST and WHEEL as given, relative to where this is run; DEST is replaced whole, so a wheel is refused there
DEST=$(realpath -m "${1:-$(dirname "$0")/../build/peers/vllm}")
case "$DEST" in *.whl) echo "make_vllm_peer.sh: DEST $DEST is a wheel; give it as WHEEL=" >&2; exit 2 ;; esac
wheel=${WHEEL:+$(realpath "$WHEEL")}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$wheel" ]; then
  $PY -m pip download -q --no-deps --only-binary=:all: -d "$work" "vllm==${VLLM_VERSION:-0.33.0}"
  wheel=$(ls "$work"/vllm-*.whl)
fi
ops=vllm/lora/ops/triton_ops
rm -rf "$DEST"
mkdir -p "$DEST"
VERSION=$($PY - "$wheel" "$DEST" "$ops" <<'EOF'
import sys, zipfile
wheel, dest, ops = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for name in ("lora_shrink_op", "lora_expand_op", "kernel_utils", "lora_kernel_metadata", "utils"):
        z.extract(f"{ops}/{name}.py", dest)
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    print(next(line for line in meta.splitlines() if line.startswith("Version:")).split(":", 1)[1].strip())
EOF
)
write() { mkdir -p "$(dirname "$DEST/$1")"; cat > "$DEST/$1"; }
write vllm/__init__.py <<EOF
"""Stand-ins for the vllm modules that vLLM $VERSION's Triton LoRA ops import (scripts/make_vllm_peer.sh)."""
__version__ = "$VERSION"
EOF
write vllm/lora/__init__.py </dev/null
write vllm/lora/ops/__init__.py </dev/null
write $ops/__init__.py <<'EOF'
from vllm.lora.ops.triton_ops.lora_expand_op import lora_expand
from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
from vllm.lora.ops.triton_ops.lora_shrink_op import lora_shrink

__all__ = ["lora_expand", "lora_shrink", "LoRAKernelMeta"]
EOF
write vllm/envs.py <<'EOF'
# vLLM's defaults for the variables the LoRA ops read.
VLLM_LORA_ENABLE_DUAL_STREAM = False
VLLM_BATCH_INVARIANT = False
VLLM_TUNED_CONFIG_FOLDER = None
VLLM_LORA_DISABLE_PDL = False
EOF
write vllm/logger.py <<'EOF'
import functools
import logging


class _Logger(logging.LoggerAdapter):
    @functools.lru_cache(maxsize=None)
    def warning_once(self, msg):
        self.warning(msg)

    @functools.lru_cache(maxsize=None)
    def info_once(self, msg):
        self.info(msg)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
EOF
write vllm/platforms/__init__.py <<'EOF'
import torch


class _Platform:
    dispatch_key = "CUDA"

    def is_cuda(self):
        return torch.cuda.is_available() and torch.version.cuda is not None

    def _capability(self):
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor

    def is_device_capability(self, capability):
        return self.is_cuda() and self._capability() == capability

    def has_device_capability(self, capability):
        return self.is_cuda() and self._capability() >= capability


current_platform = _Platform()
EOF
write vllm/triton_utils/__init__.py <<'EOF'
import triton
import triton.language as tl

__all__ = ["tl", "triton"]
EOF
write vllm/utils/__init__.py </dev/null
write vllm/utils/math_utils.py <<'EOF'
def next_power_of_2(n):
    return 1 if n < 1 else 1 << (n - 1).bit_length()
EOF
write vllm/utils/torch_utils.py <<'EOF'
import torch

_lib = torch.library.Library("vllm", "FRAGMENT")


def async_tensor_h2d(data, dtype, device, pin_memory=True):
    return torch.tensor(data, dtype=dtype, pin_memory=pin_memory and torch.cuda.is_available()).to(
        device=device, non_blocking=True)


def direct_register_custom_op(op_name, op_func, mutates_args=(), fake_impl=None, target_lib=None,
                              dispatch_key=None, tags=()):
    """torch.ops.vllm.<op_name>, as vLLM registers it (on CUDA; on CPU too, for Triton's interpreter)."""
    lib = target_lib or _lib
    lib.define(op_name + torch.library.infer_schema(op_func, mutates_args=mutates_args), tags=tags)
    for key in ([dispatch_key] if dispatch_key else ["CUDA", "CPU"]):
        lib.impl(op_name, op_func, dispatch_key=key)
    if fake_impl is not None:
        lib._register_fake(op_name, fake_impl)
EOF
$PY - "$DEST" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink  # noqa: F401 (imports cleanly)
import vllm
print(f"vLLM {vllm.__version__} peer at {sys.argv[1]}: lora_shrink, lora_expand, LoRAKernelMeta")
EOF
