#!/usr/bin/env bash
# The asynchronous state copy's first GPU run (issue 41, item 5), as one prepared call on an H200 after
# gpu-kit's two transfers:
#   call 1: bash .gpukit/on-device.sh stage                                    (carry .gpukit/a, .gpukit/on-device.sh)
#   call 2: GPUKIT_LIMIT_S=530 bash .gpukit/on-device.sh run "bash docs/measured/2026-11-28-h200-async/session.sh"
#           (carry .gpukit/b, .gpukit/on-device.sh, .peer)
# .peer (git-excluded, never committed) holds upstream's file mamba_ssm/ops/cute/mamba3/mamba3_step_fn.py
# of state-spaces/mamba e9594ce under .peer/mamba and the quack-kernels 0.6.5 wheel unpacked under
# .peer/site (upstream's file imports quack; the GPU image has triton, einops and cuda-bindings).
# Steps in priority order, each cut to the time left of BUDGET seconds; at most 8 files into $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res; mkdir -p "$o" "$r"
export PYTHONPATH=$PWD/.peer/site${PYTHONPATH:+:$PYTHONPATH}
export MAMBA3_STEP_CACHE_DIR=/tmp/m3cache; mkdir -p -m 700 "$MAMBA3_STEP_CACHE_DIR"
t0=$(date +%s); budget=${BUDGET:-490}
el() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$o/gpu.txt"; }
# cap WANT: WANT seconds, or what is left of the budget when less; 0 when nothing useful is left
cap() { local left=$(( budget - ($(date +%s) - t0) )); (( left < $1 )) && set -- "$left"; (( $1 < 10 )) && echo 0 || echo "$1"; }
step() { local c; c=$(cap "$1"); shift; if (( c == 0 )); then el "skipped (budget): $*"; return; fi
         el "start (limit ${c} s): $*"; timeout "$c" "$@"; el "exit $?: $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv; date -u
  python -c "import torch, cutlass; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cutlass-dsl', __import__('importlib.metadata').metadata.version('nvidia-cutlass-dsl'))"
  python -c "import quack; print('quack', quack.__version__)"; cat .peer/mamba/COMMIT
  command -v compute-sanitizer ncu; } >> "$o/gpu.txt" 2>&1

# 1. the GPU test: both kernels' bits, every default and full-matrix asynchronous form
step 120 python -m pytest -q -n 16 -p no:cacheprovider -rfE --full-matrix tests/gpu/test_gpu_async_state.py \
  > "$o/gpu_tests.log" 2>&1
tail -3 "$o/gpu_tests.log"

# 2. side by side: register kernel (pool), asynchronous copy, gather/dense/scatter, dense, upstream's step
# (a peer that cannot be loaded stops the benchmark with exit 2: then it runs again without the peer)
peer=(--upstream .peer/mamba)
for dtype in float32 bfloat16; do
  for attempt in 1 2; do
    step 120 python bench/gpu_bench.py --suite step --async-copy "${peer[@]}" --step-state-dtype "$dtype" \
      --batches 1,2,4,8,16,64,256,512 --target-ms 25 --no-plot --out "$r/$dtype" >> "$o/gpu_bench.log" 2>&1
    grep -q "gpu_bench.py: error: --upstream" "$o/gpu_bench.log" && (( ${#peer[@]} )) && { peer=(); continue; }
    break
  done
  cp "$r/$dtype/gpu_bench.json" "$o/gpu_bench_$dtype.json" 2>/dev/null
done
grep -E "^ *[0-9]+ +pool|upstream|FAIL|PEER|Error" "$o/gpu_bench.log" | head -60

# 3. compute-sanitizer on the asynchronous copy (racecheck, synccheck), fp32 and bf16 states
for tool in racecheck synccheck; do
  for dtype in float32 bfloat16; do
    echo "== $tool $dtype" >> "$o/sanitizer.log"
    step 45 compute-sanitizer --tool "$tool" --error-exitcode 9 python bench/gpu_async_probe.py --batch 4 --heads 4 \
      --kernels async --state-dtype "$dtype" >> "$o/sanitizer.log" 2>&1
  done
done
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|identical|DIFFER" "$o/sanitizer.log"

# 4. Nsight Compute on both kernels, fp32 flagship, B = 256 and 1
for batch in 256 1; do
  echo "== ncu B=$batch" >> "$o/ncu.log"
  step 70 ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python bench/gpu_async_probe.py --batch "$batch" >> "$o/ncu.log" 2>&1
done
grep -E "^== |profiled|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy" "$o/ncu.log"

# 5. with what is left: the register kernel's GPU tests on the restructured package
step 200 python -m pytest -q -n 16 -p no:cacheprovider -rfE tests/gpu/test_gpu_kernel.py > "$o/gpu_tests_kernel.log" 2>&1
tail -3 "$o/gpu_tests_kernel.log"
el "done"
