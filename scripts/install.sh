#!/usr/bin/env bash
# Installs what lora_ops needs and builds it, doing only what is missing or changed, one line per action:
#   - system packages g++, cmake, libgtest-dev, python3.X-dev (apt-get), when absent;
#   - Python packages (pip: torch==2.14.1 unless a torch is there, the build tools, pytest, the [hf] extras),
#     when one is missing; nvidia-cutlass==4.2.0 (CUTLASS headers, --no-deps) unless LORA_OPS_NO_CUDA=1;
#   - torch_npu==2.14.0's headers (build/torch_npu), out of its wheel, for the Ascend host code's type check;
#   - lora_ops/_C.so (`pip install --no-build-isolation --no-deps -e .`: CPU kernels, and the CUDA kernels when
#     torch has CUDA and nvcc is found), when scripts/extension_stamp.py finds a reason, which it prints; the
#     compiler then recompiles only the changed files.
# Which Python and how verbose: scripts/common.sh (the active virtualenv, else .venv; LORA_OPS_VERBOSE=1 or -v).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
select_python

missing=()
command -v c++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
[ -e /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
# torch.compile on CPU (inductor) compiles C++ that includes Python.h.
"$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' ||
  missing+=("python$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev")
[ ${#missing[@]} = 0 ] || apt_install "${missing[@]}"

PACKAGES="ninja pytest numpy setuptools>=64 wheel transformers peft safetensors tqdm"
to_install=$("$PY" - $PACKAGES <<'PYCODE'
import importlib.metadata, importlib.util, sys
wanted = ["torch==2.14.1"] + sys.argv[1:]
def present(requirement):
    name, _, minimum = requirement.partition(">=")
    name = name.partition("==")[0]
    if importlib.util.find_spec(name) is None:
        return False
    return not minimum or int(importlib.metadata.version(name).split(".")[0]) >= int(minimum)
print(" ".join(r for r in wanted if not present(r)))
PYCODE
)
if [ -n "$to_install" ]; then
  say "installing Python packages into $("$PY" -c 'import sys; print(sys.prefix)'): $to_install"
  quietly "$PY" -m pip install $to_install
fi

# CUTLASS's headers for the sm_90a grouped_gemm (csrc/cuda/grouped_gemm_sm90.cu; setup.py finds them through
# cutlass_library). Headers only, so --no-deps: its dependencies (cuda-python) would replace the cuda-bindings that
# torch brought. The CPU-only build does not need it.
CUTLASS_PIN=4.2.0
if [ "${LORA_OPS_NO_CUDA:-}" != 1 ] && ! "$PY" - "$CUTLASS_PIN" 2>/dev/null <<'PYCODE'
import importlib.metadata, sys
have = importlib.metadata.version("nvidia-cutlass").split(".")
sys.exit(have[:3] != sys.argv[1].split(".") or any(part != "0" for part in have[3:]))
PYCODE
then
  say "installing nvidia-cutlass==$CUTLASS_PIN (headers for the sm_90a grouped_gemm; --no-deps)"
  quietly "$PY" -m pip install --no-deps "nvidia-cutlass==$CUTLASS_PIN"
fi

# torch_npu's headers (its c10_npu streams and its copy of ACL's headers), for the type check of the Ascend host code
# against them (tests/test_ascend_headers.py): headers only, out of the wheel, since torch_npu itself needs CANN to
# import. The wheel matching the pinned torch; any Python's and platform's wheel holds the same headers.
TORCH_NPU_PIN=2.14.0
if [ "$(cat build/torch_npu/version 2>/dev/null)" != "$TORCH_NPU_PIN" ]; then
  say "fetching torch_npu==$TORCH_NPU_PIN's headers into build/torch_npu (the Ascend host code's type check)"
  rm -rf build/torch_npu
  quietly "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d build/torch_npu/wheel "torch-npu==$TORCH_NPU_PIN"
  "$PY" - build/torch_npu <<'PYCODE'
import pathlib, shutil, sys, zipfile
out = pathlib.Path(sys.argv[1])
(wheel,) = (out / "wheel").glob("*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(out, [n for n in z.namelist() if n.startswith("torch_npu/include/")])
(out / "torch_npu" / "include").rename(out / "include")
shutil.rmtree(out / "torch_npu")
shutil.rmtree(out / "wheel")
PYCODE
  echo "$TORCH_NPU_PIN" >build/torch_npu/version
fi

if line=$("$PY" scripts/extension_stamp.py check); then
  say "$line"
else
  say "$line"
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  quietly "$PY" -m pip install --no-build-isolation --no-deps -e .
  "$PY" scripts/extension_stamp.py record
  if [ "$LORA_OPS_VERBOSE" = 1 ]; then "$PY" -m lora_ops.info; fi
fi
