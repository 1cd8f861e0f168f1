#!/usr/bin/env bash
# Builds lora_ops/_C.so here, on a machine with no GPU, for the device machine's Python and torch (its image:
# Python 3.12, torch 2.11.0+cu130; DEVICE_PYTHON and DEVICE_TORCH to change them), sm_90a only, from the committed
# HEAD (or the revision given: bash scripts/device_prebuild.sh REV), into build/device/ (PREBUILT_OUT to change it;
# git-ignored: _C.so, _build_info.json, stamp.json; PREBUILT_XZ=1 keeps _C.so xz-compressed, 38 -> ~3 MB, so that
# several builds fit one carry: scripts/ab.sh prepare --prebuilt). gpu_run.sh puts it in place instead of
# building when its stamp matches the tree it runs on (scripts/extension_stamp.py use-prebuilt): each device call
# then saves the build's ~140-165 s of device time. Carry build/device beside .whl. Commit first: a build from
# uncommitted sources would not match the tree the device gets.
# Takes ~10 minutes on 2 cores the first time (incremental after: build/device-src keeps the objects); downloads
# torch's wheel once (~530 MB) into build/device-venv. That torch's CUDA 13 libraries and cuBLASLt's header (which
# setup.py needs for the CUDA backend) come from the project's .venv (scripts/install.sh; the same sonames), linked
# in rather than downloaded again. A build without the CUDA kernels or the sm_90a GEMMs is an error, not a prebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
DEVICE_TORCH=${DEVICE_TORCH:-2.11.0}
ROOT=$PWD
VENV=$ROOT/build/device-venv
SRC=$ROOT/build/device-src
OUT=${PREBUILT_OUT:-$ROOT/build/device}
REV=$(git rev-parse --verify "${1:-HEAD}^{commit}")

py=
for candidate in $(command -v "python$DEVICE_PYTHON") $(ls "$HOME"/.pyenv/versions/"$DEVICE_PYTHON"*/bin/python"$DEVICE_PYTHON" \
    2>/dev/null); do
  if "$candidate" -c pass 2>/dev/null; then py=$candidate; break; fi  # a pyenv shim may not run it
done
[ -n "$py" ] || { echo "device_prebuild: no python$DEVICE_PYTHON here"; exit 1; }
nvidia=$(ls -d .venv/lib/python3*/site-packages/nvidia 2>/dev/null | head -1)
[ -n "$nvidia" ] || { echo "device_prebuild: no .venv with torch's CUDA libraries (run bash scripts/install.sh)"; exit 1; }
export LD_LIBRARY_PATH=$(ls -d "$ROOT/$nvidia"/*/lib | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

[ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
ln -sfn "$ROOT/$nvidia" "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
if [ "$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)" != "$DEVICE_TORCH+cu130" ]; then
  echo "device_prebuild: torch==$DEVICE_TORCH into $VENV (no CUDA libraries: the .venv's serve)"
  "$VENV/bin/pip" install -q --no-deps "torch==$DEVICE_TORCH"
  "$VENV/bin/pip" install -q typing_extensions sympy networkx jinja2 fsspec filelock "setuptools>=64,<82" wheel ninja \
    numpy
fi
"$VENV/bin/pip" install -q --no-deps .whl/nvidia_cutlass-*.whl 2>/dev/null ||
  "$VENV/bin/pip" install -q --no-deps nvidia-cutlass==4.2.0

[ -d "$SRC/.git" ] || git clone -q "$ROOT" "$SRC"
git -C "$SRC" fetch -q "$ROOT" "$REV" && git -C "$SRC" checkout -q --detach FETCH_HEAD
sha=$(git -C "$SRC" rev-parse --short HEAD)
echo "device_prebuild: building $sha for Python $DEVICE_PYTHON, torch $DEVICE_TORCH, sm_90a ($(nproc) jobs)"
t0=$(date +%s)
(cd "$SRC" && CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=$(nproc) \
  "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .)
mkdir -p "$OUT"
# a build the stamp refuses (no CUDA kernels) must not keep an earlier one's stamp, nor an earlier compressed _C.so
rm -f "$OUT/stamp.json" "$OUT/_C.so.xz"
cp "$SRC/lora_ops/_C.so" "$SRC/lora_ops/_build_info.json" "$OUT"/
strip -g "$OUT/_C.so"  # the host code's debug sections (~14 MB): so that .whl, build/device and the tree fit the carry
(cd "$SRC" && "$VENV/bin/python" scripts/extension_stamp.py stamp-prebuilt "$OUT")  # refuses a build lacking kernels
[ "${PREBUILT_XZ:-0}" = 1 ] && xz -T0 -6 -f "$OUT/_C.so"
echo "device_prebuild: $OUT from $sha in $(( $(date +%s) - t0 )) s, $(cd "$OUT" && du -m _C.so* | awk '{print $2, $1, "MB"}')"
