set -uo pipefail
export LORA_OPS_GIT_SHA=13c1f33 PYTHONUNBUFFERED=1
bash scripts/gpu_run.sh none 2>&1 | tail -5
echo "=== routes $(date +%T)"
timeout 300 python3 -m lora_ops.bench --decode-step --models llama3-8b --routes lora_ops/routes.json > $OUT/routes.log 2>&1; echo "routes rc $?"
cp lora_ops/routes.json $OUT/
tail -30 $OUT/routes.log
echo "=== tests $(date +%T)"
python3 -m pytest tests -q -p no:cacheprovider -m gpu -n 8 -k "fold_linear or serving or routes or readme" 2>&1 | tail -4
echo "=== sanitizer $(date +%T)"
compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/test_fold_linear.py -q -p no:cacheprovider -k "deterministic or gradient_on_cuda or opcheck or compiles" 2>&1 | tail -4
echo "=== end $(date +%T)"
