#!/usr/bin/env bash
# The GPU job on the H200 (through the device tool): build with all cores, then the stages asked for:
#   tests      ctest + the GPU pytest suite (-m gpu: the CPU-only tests run in CI)
#   sanitizer  compute-sanitizer memcheck over the garbage-metadata GPU tests and a short CUDA fuzz run
#   demo       python -m lora_ops.demo
#   probes     the session's open questions that need no bench run: benchmarks/piece_probe.cu (a y stream's
#              bandwidth by chunk shape, staged, in registers and with the expand kernels' combine pass and w, against
#              the elementwise stream: what keeps grouped_gemm's LoRA expand and the prefill sgmv's expand near
#              75-80% of the copy rate; NOTES.md, grouped_gemm, sessions 48-49); seconds, not in the default
#   bench      python -m lora_ops.bench --ops, then --decode-step --models all (two processes), merged into
#              benchmarks/results/<date>-<gpu>.*, and, without extra bench arguments, the op table it measures
#              (lora_ops/op_tables/<gpu>.json)
#   routes     python -m lora_ops.bench --decode-step --routes, once per model shape: issue 12's rows, then every
#              route at every regime and adapter mix, and the serving layer's route table of the three shapes from
#              them for this GPU's model (lora_ops/route_tables/<gpu>.json; 562 s with the build at 68dc283, and
#              since the sweep splits regimes (session 51) up to ~9 steps more a shape: two device calls; not in the
#              default). ROUTES_MODELS="a b" sweeps those shapes only (the sweep in two device calls), each shape's
#              records to $OUT; the table is then merged where all three are,
#              e.g. here: python -m lora_ops.bench.report <the three records> --out <name> --routes
#              lora_ops/route_tables/<gpu>.json
#   mutate     scripts/mutate.py --gpu --fast --in-place: the GPU-only planted bugs (minutes; not in the default)
#   envab      an A/B of one environment variable on the decode step, each arm its own process, arms interleaved
#              in rounds (a ratio between runs minutes apart carries their drift): AB_VAR, AB_VALUES (space-separated;
#              "unset": the variable unset), AB_STEPS (--steps), AB_ROUNDS (default 2), AB_IMPLS (default
#              fold-cuda), AB_ARGS (more bench arguments, e.g. --between-modules); every arm's output to
#              $OUT/envab.log (not in the default; revisions: scripts/ab.sh)
# Default: tests sanitizer demo bench. Logs and results are copied to $OUT when set (the device tool's return
# folder). The bench times vLLM's LoRA ops beside ours where build/peers/vllm is carried (scripts/make_vllm_peer.sh,
# run where a registry is reachable).
# Usage: LORA_OPS_GIT_SHA=<sha> bash scripts/gpu_run.sh [tests] [sanitizer] [demo] [probes] [bench] [routes] [mutate]
#        [-- bench args]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" benchmarks/results
export PYTHONUNBUFFERED=1
stages=()
bench_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; bench_args=("$@"); break; fi
  stages+=("$1"); shift
done
[ ${#stages[@]} -gt 0 ] || stages=(tests sanitizer demo bench)
want() { [[ " ${stages[*]} " == *" $1 "* ]]; }
status=0
step() { echo; echo "=== $* ($(date +%T)) ==="; }

step build
# A planted bug a killed mutate run left in this tree goes back first, dated now: the copy of the tree this call
# brought is older than the objects built from the bug, which the build below would otherwise keep.
$PY scripts/mutate.py --restore
# Wheels carried to a machine without a registry (.whl/, git-ignored), e.g. nvidia-cutlass for the sm_90a build.
if compgen -G ".whl/*.whl" >/dev/null; then $PY -m pip install -q --no-deps .whl/*.whl || exit 1; fi
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=$(nproc)
t0=$(date +%s)
# An extension prebuilt for this machine's Python and torch (scripts/device_prebuild.sh; carry build/device) where it
# was built from this tree: no build, and lora_ops imported from this checkout. Not for the mutate stage, whose C++
# bugs recompile one file against the build's objects.
if ! want mutate && $PY scripts/extension_stamp.py use-prebuilt build/device; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  $PY -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5 || exit 1
fi
echo "build took $(( $(date +%s) - t0 )) s"
# The prebuilt brings _C.so only: the Ascend CPU model's library (13 MB, past the carry's room) is absent, so its
# test file, CPU tests only (CI runs them), is left out of the GPU runs, and so are the ascend-model cases of the GPU
# test files (their fixture fails loudly where the library is missing: CI must build it).
no_ascend_model=()
not_ascend_model=
if ! compgen -G "lora_ops/_ascend_model*.so" >/dev/null; then
  no_ascend_model=(--ignore=tests/test_ascend_model.py)
  not_ascend_model="not ascend-model"
fi
# A -k expression with the ascend-model cases left out where their library is absent.
k_without_ascend_model() { local k="${1:+($1)}"; [ -z "$not_ascend_model" ] || k="${k:+$k and }$not_ascend_model"; echo "$k"; }
$PY -m lora_ops.info | tee "$OUT/info.log"
# The GPU model's word ("NVIDIA H100 80GB HBM3": h100, "NVIDIA H200": h200), not the name's last word: the name of
# the bench's records (benchmarks/results/<date>-<gpu>) and of the GPU's op table (lora_ops/op_tables/<gpu>.json).
gpu=$($PY -c "import torch; from lora_ops import op_table
print(op_table.gpu_word(torch.cuda.get_device_name()))")
[ -n "$gpu" ] || { echo "gpu_run: no GPU model word"; exit 1; }
results_base="benchmarks/results/$(date +%F)-$gpu"

if want tests; then
  step ctest
  cmake -S . -B build/cpp-tests -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v $PY)" >/dev/null \
    && cmake --build build/cpp-tests -j "$(nproc)" >/dev/null \
    && (cd build/cpp-tests && ctest --output-on-failure 2>&1 | tail -15) || status=1
  step pytest
  # --durations: the suite must fit one device call (600 s); the slowest tests say where its time goes.
  # PYTEST_K (a -k expression, e.g. "serving or routes") narrows it; PYTEST_ARGS adds plain arguments (split on
  # spaces: no quoting inside; a -k there loses to PYTEST_K's, pytest keeping the last).
  pytest_k=$(k_without_ascend_model "${PYTEST_K:-}")
  $PY -m pytest tests -q -p no:cacheprovider -m gpu -n ${PYTEST_WORKERS:-$(nproc)} --durations=40 ${PYTEST_ARGS:-} \
    "${no_ascend_model[@]}" \
    ${pytest_k:+-k "$pytest_k"} \
    -p no:benchmark 2>&1 | tee "$OUT/pytest.log" | tail -70
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if want sanitizer; then
  step compute-sanitizer memcheck
  edge="garbage or bad_slots or no_lora_rows or skewed or empty_batch or build_segments or decode_one_row or overlap"
  # LORA_OPS_UNDER_SANITIZER: the profiler sees nothing under the sanitizer, so a selected test that checks which
  # kernel ran skips that check (tests/conftest.py cuda_kernel_names); without it such a test fails.
  memcheck=(env LORA_OPS_UNDER_SANITIZER=1 compute-sanitizer --tool memcheck --error-exitcode 9)
  "${memcheck[@]}" $PY -m pytest tests -q -p no:cacheprovider -m gpu "${no_ascend_model[@]}" \
    -k "$(k_without_ascend_model "$edge or sorted_rows_ or many_slots or segments_kernel")" \
    2>&1 | tee "$OUT/sanitizer.log" | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  if [ -d tests/fuzz ]; then
    "${memcheck[@]}" --target-processes all $PY -m tests.fuzz --device cuda \
      --seconds ${FUZZ_SECONDS:-120} --timeout 900 --batch 100 2>&1 | tee "$OUT/fuzz-sanitizer.log" | tail -8
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
fi

if want demo; then
  step demo
  $PY -m lora_ops.demo 2>&1 | grep -v -i "warn\|it/s\]" | tee "$OUT/demo.log" | tail -6
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if want probes; then
  step probes
  nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/piece_probe.cu -o build/piece_probe \
    && build/piece_probe 2>&1 | tee "$OUT/piece-probe.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if want bench; then
  step bench
  name=$results_base
  # The op bench and the decode-step bench run as two processes, so that one's results survive the other's crash
  # or timeout (each part is copied to $OUT when done); then merged into <name>.json, and the op table is written
  # from the merged file, only from a full run: none with extra bench arguments (e.g. --quick).
  parts=()
  for part in ops decode; do
    args=(--ops); [ $part = ops ] || args=(--decode-step --models all)
    $PY -m lora_ops.bench "${args[@]}" --out "$name-$part" "${bench_args[@]}" 2>&1 | tee "$OUT/bench-$part.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    [ -f "$name-$part.json" ] && parts+=("$name-$part.json") && cp "$name-$part.json" "$OUT"/
  done
  if [ ${#parts[@]} -gt 0 ]; then
    # The merged .json holds every record; its .csv and .png are rebuilt from it anywhere (bench.report --out), so
    # only the .json travels, and the parts' copies go once it is written.
    $PY -m lora_ops.bench.report "${parts[@]}" --out "$name" >/dev/null \
      && cp "$name.json" "$OUT"/ && for f in "${parts[@]}"; do rm -f "$OUT/$(basename "$f")"; done || status=1
    rm -f "${parts[@]}" "${parts[@]/%.json/.csv}" "${parts[@]/%.json/.png}"
    if [ ${#bench_args[@]} -eq 0 ]; then
      $PY -m lora_ops.bench.report "$name.json" --op-table "lora_ops/op_tables/$gpu.json" \
        && cp "lora_ops/op_tables/$gpu.json" "$OUT"/ || status=1
    fi
  fi
fi
if want routes; then
  step routes
  to_out() { [ "$OUT" = benchmarks/results ] || cp "$@" "$OUT"/; }  # a local run's $OUT is where they are
  # One process per model shape (issue 12's rows, then every route at every regime and mix: ~2.5 minutes each),
  # each copied to $OUT when done; then the serving layer's table of the three shapes from their merged records.
  name=$results_base-routes
  runs=()
  for model in ${ROUTES_MODELS:-llama3-8b qwen2-7b llama3-70b-tp8}; do
    # without the vllm peer (its compile and eager steps): the stage runs near the call's limit
    LORA_OPS_VLLM_PEER=off $PY -m lora_ops.bench --decode-step --models $model --routes "$name-$model-table.json" \
      --out "$name-$model" 2>&1 \
      | tee "$OUT/routes-$model.log" | grep -E "^(llama3|qwen2)|serving default|wrote"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    rm -f "$name-$model-table.json" "$name-$model.csv" "$name-$model.png"
    [ -f "$name-$model.json" ] && runs+=("$name-$model.json") && to_out "$name-$model.json"
  done
  table=lora_ops/route_tables/$gpu.json  # this GPU's (the serving layer's on GPUs of its model)
  if [ -n "${ROUTES_MODELS:-}" ]; then
    echo "swept ${#runs[@]} shape(s) of ROUTES_MODELS; merge the three shapes' records into $table" \
      "with python -m lora_ops.bench.report ... --routes $table"
    [ ${#runs[@]} -eq "$(echo $ROUTES_MODELS | wc -w)" ] || status=1
  elif [ ${#runs[@]} -eq 3 ] && $PY -m lora_ops.bench.report "${runs[@]}" --out "$name" --routes "$table"; then
    to_out "$name.json"
    [ "$OUT" = benchmarks/results ] || cp "$table" "$OUT/route-table-$gpu.json"  # beside the op table's $gpu.json
    rm -f "${runs[@]}" "$name.csv" "$name.png"
    [ "$OUT" = benchmarks/results ] || for f in "${runs[@]}"; do rm -f "$OUT/$(basename "$f")"; done
  else
    status=1
  fi
fi
if want mutate; then
  step mutate
  # MUTATE_ONLY="id ..." runs only those planted bugs. In place (this machine's tree is a copy): a C++ bug
  # recompiles its one file with the build's objects, where a scratch copy would first compile the whole extension.
  # Each verdict reaches $OUT/mutate-progress.log as it is printed, so a run cut off by the call's time limit still
  # says what it caught (mutate-gpu.log, the report, is written at the end).
  # --timeout: a planted bug that hangs a kernel counts as caught after MUTATE_TIMEOUT seconds (default 300: a GPU
  # test file takes 60-120 s), well inside a device call's 600, so the bugs after it still run.
  $PY scripts/mutate.py --gpu --fast --in-place --workers "${PYTEST_WORKERS:-8}" --log "$OUT/mutate-gpu.log" \
    --timeout "${MUTATE_TIMEOUT:-300}" ${MUTATE_ONLY:+--only $MUTATE_ONLY} 2>&1 \
    | grep --line-buffered -v "^not run" | tee "$OUT/mutate-progress.log" | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if want envab; then
  step "envab ${AB_VAR:?AB_VAR names the variable}"
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for value in ${AB_VALUES:?AB_VALUES lists its values}; do
      echo "=== $AB_VAR=$value, round $round" | tee -a "$OUT/envab.log"
      arm=(env "$AB_VAR=$value"); [ "$value" = unset ] && arm=(env -u "$AB_VAR")
      "${arm[@]}" $PY -m lora_ops.bench --decode-step --impls "${AB_IMPLS:-fold-cuda}" \
        --steps "${AB_STEPS:?AB_STEPS: T/ADAPTERS/RANK,...}" ${AB_ARGS:-} 2>&1 | tee -a "$OUT/envab.log" \
        | grep -E "^[a-z0-9-]+ T=|  [a-z]+-|rror"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
  done
fi
# The device tool brings back at most 8 files from $OUT (it drops the rest): past that the logs travel as one
# archive.
if [ "$OUT" != benchmarks/results ] && [ "$(ls -1 "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf logs.tar.gz ./*.log && rm -f ./*.log)
fi
echo "gpu_run status: $status"
exit $status
