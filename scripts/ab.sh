#!/usr/bin/env bash
# A/B of git revisions on the GPU machine in one device call: the same bench, same run, on the working tree and on
# each prepared revision.
#   Here:  bash scripts/ab.sh prepare [--prebuilt] REV...   exports each revision's tracked files to build/ab/<REV>
#          (git-ignored: give the device tool carry=["build/ab"]); with --prebuilt also builds each one's extension
#          here (scripts/device_prebuild.sh REV, xz-compressed, ~3 MB: build/ab/<REV>/prebuilt), ~2 minutes a
#          revision after the first, so that the call spends no device time building them.
#   There: bash scripts/ab.sh run [-- BENCH ARGS]   puts each tree's prebuilt extension in place where it matches the
#          tree (the working tree's: build/device, carried beside build/ab), and builds the others for sm_90a in
#          parallel (with the CUTLASS kernels when the nvidia-cutlass wheel is carried in .whl/, as for
#          gpu_run.sh: carry=["build/ab", ".whl"]), then runs `python3 -m lora_ops.bench BENCH ARGS`
#          in each, one tree after the other (default: --ops --op-kinds lora_expand --impls cuda), and prints the
#          graph-replay and decode-step lines side by side. Logs go to $OUT when set (the device tool's folder).
#          AB_TESTS="pytest -k expression" also runs those GPU tests in each prepared revision after its bench.
#          AB_CMD="shell command" runs that in each tree instead of the bench (e.g. ncu of benchmarks/profile_case.py,
#          with PYTHONPATH=.; a probe revision that gives wrong results on purpose fails the bench's oracle check).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}; shift || true
case "$mode" in
  prepare)
    prebuilt=0; [ "${1:-}" = --prebuilt ] && { prebuilt=1; shift; }
    [ $# -gt 0 ] || { echo "usage: $0 prepare [--prebuilt] REV..." >&2; exit 2; }
    rm -rf build/ab  # only the revisions named now
    for rev in "$@"; do
      dir="build/ab/$(echo "$rev" | tr '/' '_')"
      # without the recorded results (~10 MB of logs a tree: the carry holds 64 MiB with the working tree)
      mkdir -p "$dir" && git archive "$rev" -- . ':(exclude)benchmarks/results' | tar -x -C "$dir" || exit 1
      echo "$rev -> $dir ($(git rev-parse --short "$rev"))"
      if [ $prebuilt = 1 ]; then
        PREBUILT_OUT=$PWD/$dir/prebuilt PREBUILT_XZ=1 bash scripts/device_prebuild.sh "$rev" | tail -1 || exit 1
      fi
    done
    ;;
  run)
    [ "${1:-}" = "--" ] && shift
    args=("$@"); [ ${#args[@]} -gt 0 ] || args=(--ops --op-kinds lora_expand --impls cuda)
    out=${OUT:-build/ab-logs}; mkdir -p "$out"
    trees=(.); for d in build/ab/*/; do [ -d "$d" ] && trees+=("${d%/}"); done
    jobs=$(( $(nproc) / ${#trees[@]} )); [ $jobs -gt 0 ] || jobs=1
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} PYTHONUNBUFFERED=1
    if compgen -G ".whl/*.whl" >/dev/null; then python3 -m pip install -q --no-deps .whl/*.whl || exit 1; fi
    name() { [ "$1" = . ] && echo worktree || basename "$1"; }  # not "main": a prepared main is build/ab/main
    t0=$(date +%s)
    for t in "${trees[@]}"; do
      pre=$t/prebuilt; [ "$t" = . ] && pre=build/device
      python3 scripts/extension_stamp.py use-prebuilt "$pre" "$t" > "$out/build-$(name "$t").log" 2>&1 && continue
      (cd "$t" && MAX_JOBS=$jobs python3 setup.py build_ext --inplace -q >> "$out/build-$(name "$t").log" 2>&1) &
    done
    wait
    echo "builds: $(( $(date +%s) - t0 )) s"
    for t in "${trees[@]}"; do
      (cd "$t" && python3 -c "import lora_ops" 2>/dev/null) \
        || { echo "$(name "$t"): build failed"; tail -20 "$out/build-$(name "$t").log"; exit 1; }
    done
    for t in "${trees[@]}"; do
      if [ -n "${AB_CMD:-}" ]; then
        (cd "$t" && PYTHONPATH=. bash -c "$AB_CMD" > "$out/bench-$(name "$t").log" 2>&1) || echo "$(name "$t"): exit $?"
      else
        (cd "$t" && python3 -m lora_ops.bench "${args[@]}" > "$out/bench-$(name "$t").log" 2>&1) \
          || echo "$(name "$t"): bench exit $?"
      fi
      if [ -n "${AB_TESTS:-}" ] && [ "$t" != . ]; then
        (cd "$t" && python3 -m pytest tests -q -p no:cacheprovider -m gpu -n 8 -k "$AB_TESTS" 2>&1 | tail -2)
      fi
    done
    # One column per tree: case headers, graph-replay timings and decode-step routes.
    pick='^[a-z_]+ T=|^[a-z0-9-]+ T=|^probe |graph |overhead|Duration|Executed Instructions  |Registers Per'
    cols=()
    for t in "${trees[@]}"; do
      grep -E "$pick" "$out/bench-$(name "$t").log" | sed -E 's/ +eager.*//; s/ \(pool rank [0-9]+\)//' \
        > "$out/ab-$(name "$t").txt"
      cols+=("$out/ab-$(name "$t").txt")
    done
    echo "columns: $(for t in "${trees[@]}"; do printf '%s ' "$(name "$t")"; done)"
    paste "${cols[@]}" | expand -t 60
    ;;
  *)
    echo "usage: $0 prepare REV... | run [-- BENCH ARGS]" >&2; exit 2 ;;
esac
