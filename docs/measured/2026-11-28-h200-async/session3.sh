#!/usr/bin/env bash
# Third machine of the asynchronous state copy's GPU run: is occupancy the lever? Both kernels of pool mode
# under launch bounds (StepSpec.min_ctas_per_sm: the compiler keeps registers for that many CTAs per SM,
# spilling if it must), each checked bit for bit against pool mode, then timed beside it.
#   call 1: bash .gpukit/on-device.sh stage                 (carry .gpukit/a, .gpukit/on-device.sh)
#   call 2: GPUKIT_LIMIT_S=250 bash .gpukit/on-device.sh run "bash docs/measured/2026-11-28-h200-async/session3.sh"
#           (carry .gpukit/b, .gpukit/on-device.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res3; mkdir -p "$o" "$r"
export MAMBA3_STEP_CACHE_DIR=/tmp/m3cache; mkdir -p -m 700 "$MAMBA3_STEP_CACHE_DIR"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "fp32: bounds 4 and 5"
timeout 120 python bench/gpu_bench.py --suite step --async-copy --min-ctas 4,5 --step-state-dtype float32 \
  --batches 1,16,64,256 --target-ms 25 --no-plot --out "$r/float32" > "$o/bounds_bench.log" 2>&1
el "exit $?"; cp "$r/float32/gpu_bench.json" "$o/bounds_bench_float32.json" 2>/dev/null
el "bf16: bounds 4 and 8"
timeout 90 python bench/gpu_bench.py --suite step --async-copy --min-ctas 4,8 --step-state-dtype bfloat16 \
  --batches 64,256 --target-ms 25 --no-plot --out "$r/bfloat16" >> "$o/bounds_bench.log" 2>&1
el "exit $?"; cp "$r/bfloat16/gpu_bench.json" "$o/bounds_bench_bfloat16.json" 2>/dev/null
grep -E "^ *[0-9]+ +pool|FAIL|differs|error" "$o/bounds_bench.log"
el "done"
