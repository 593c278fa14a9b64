#!/usr/bin/env bash
# Second call on the same machine (session.sh's benchmark stopped: the peer's quack was not on the path): the
# register kernel with its loads pinned side by side with the previous layouts (--unpinned-loads: 3 round trips;
# --late-epilogue: 4) and upstream's step, fp32 and bf16 states, B = 1 .. 512.
#   GPUKIT_LIMIT_S=300 bash .gpukit/on-device.sh run "bash docs/measured/2026-11-28-h200-pinned/session2.sh"
#   (carry .gpukit/on-device.sh, .peer)
# .peer (git-excluded, never committed) holds upstream's file mamba_ssm/ops/cute/mamba3/mamba3_step_fn.py of
# state-spaces/mamba e9594ce under .peer/mamba and the quack-kernels 0.6.5 wheel unpacked under .peer/site.
set -uo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/.peer/site${PYTHONPATH:+:$PYTHONPATH}
o=${OUT:-/tmp/out}; r=/tmp/res2; mkdir -p "$o" "$r"
export MAMBA3_STEP_CACHE_DIR=/tmp/m3cache; mkdir -p -m 700 "$MAMBA3_STEP_CACHE_DIR"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for dtype in float32 bfloat16; do
  el "bench $dtype"
  timeout 120 python bench/gpu_bench.py --suite step --unpinned-loads --late-epilogue --upstream .peer/mamba \
    --step-state-dtype "$dtype" --batches 1,2,4,8,16,64,256,512 --target-ms 25 --out "$r/$dtype" >> "$o/bench.log" 2>&1
  el "exit $?"; cp "$r/$dtype/gpu_bench.json" "$o/bench_$dtype.json" 2>/dev/null
  cp "$r/$dtype/gpu_bench.png" "$o/bench_$dtype.png" 2>/dev/null
done
grep -E "^ *[0-9]+ +(pool|upstream)|FAIL|differs|error|Error" "$o/bench.log" | head -80
el "done"
