#!/usr/bin/env bash
# Fourth machine: the register kernel with the epilogue's operands loaded early (StepSpec.early_epilogue: one
# dependent round trip fewer, 166 registers, still 3 CTAs per SM), its GPU test, then side by side with the
# register kernel for fp32 and bf16 states at B = 1 .. 512.
#   call 1: bash .gpukit/on-device.sh stage                 (carry .gpukit/a, .gpukit/on-device.sh)
#   call 2: GPUKIT_LIMIT_S=200 bash .gpukit/on-device.sh run "bash docs/measured/2026-11-28-h200-async/session4.sh"
#           (carry .gpukit/b, .gpukit/on-device.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res4; mkdir -p "$o" "$r"
export MAMBA3_STEP_CACHE_DIR=/tmp/m3cache; mkdir -p -m 700 "$MAMBA3_STEP_CACHE_DIR"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "GPU test"
timeout 60 python -m pytest -q -n 16 -p no:cacheprovider -rfE tests/gpu/test_gpu_early_epilogue.py > "$o/early_tests.log" 2>&1
el "exit $?"; tail -2 "$o/early_tests.log"
for dtype in float32 bfloat16; do
  el "bench $dtype"
  timeout 60 python bench/gpu_bench.py --suite step --early-epilogue --step-state-dtype "$dtype" \
    --batches 1,2,4,8,16,64,256,512 --target-ms 25 --no-plot --out "$r/$dtype" >> "$o/early_bench.log" 2>&1
  el "exit $?"; cp "$r/$dtype/gpu_bench.json" "$o/early_bench_$dtype.json" 2>/dev/null
done
grep -E "^ *[0-9]+ +pool|FAIL|differs|error" "$o/early_bench.log"
el "done"
