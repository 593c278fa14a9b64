#!/usr/bin/env bash
# The register kernel with its first token's loads pinned above their first use by a barrier (tiling.pinned_loads:
# 2 dependent round trips at 3 CTAs per SM, read from the SASS) on the H200: its bits against the previous layouts
# (StepSpec.unpinned_loads, 3 trips; with StepSpec.late_epilogue, 4) over the full matrix of the PTX tier's
# cases, then side by side with both and upstream's step for fp32 and bf16 states at B = 1 .. 512, then the bf16
# state with stochastic rounding at B = 64 and 256 (suite replay-states: its stepwise row is the default kernel).
#   call 1: bash .gpukit/on-device.sh stage                 (carry .gpukit/a, .gpukit/on-device.sh)
#   call 2: GPUKIT_LIMIT_S=420 bash .gpukit/on-device.sh run "bash docs/measured/2026-11-28-h200-pinned/session.sh"
#           (carry .gpukit/b, .gpukit/on-device.sh, .peer)
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res; mkdir -p "$o" "$r"
export MAMBA3_STEP_CACHE_DIR=/tmp/m3cache; mkdir -p -m 700 "$MAMBA3_STEP_CACHE_DIR"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "GPU tests: load layouts, full matrix"
timeout 100 python -m pytest -q -n 16 -p no:cacheprovider -rfE --full-matrix tests/gpu/test_gpu_load_layouts.py > "$o/gpu_tests.log" 2>&1
el "exit $?"; tail -2 "$o/gpu_tests.log"
for dtype in float32 bfloat16; do
  el "bench $dtype"
  timeout 110 python bench/gpu_bench.py --suite step --unpinned-loads --late-epilogue --upstream .peer/mamba \
    --step-state-dtype "$dtype" --batches 1,2,4,8,16,64,256,512 --target-ms 25 --out "$r/$dtype" >> "$o/bench.log" 2>&1
  el "exit $?"; cp "$r/$dtype/gpu_bench.json" "$o/bench_$dtype.json" 2>/dev/null
  cp "$r/$dtype/gpu_bench.png" "$o/bench_$dtype.png" 2>/dev/null
done
grep -E "^ *[0-9]+ +pool|FAIL|differs|error|Error" "$o/bench.log" | head -60
el "bf16 state, stochastic rounding"
timeout 100 python bench/gpu_bench.py --suite replay-states --forms bf16-sr --batches 64,256 --target-ms 25 \
  --no-plot --out "$r/sr" > "$o/sr_bench.log" 2>&1
el "exit $?"; cp "$r/sr/gpu_bench.json" "$o/sr_bench.json" 2>/dev/null; tail -8 "$o/sr_bench.log"
el "done"
