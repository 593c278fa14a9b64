#!/usr/bin/env bash
# Second machine of the 2026-11-28 H200 run, after the fix (CudaGraphStepRunner's capture warm-up no
# longer advances rand_seed): the failed 8-bit replay-pool tests and the new stepwise-pool runner test,
# then the int8 forms of the replay-states benchmark (cut by its limit on the first machine).
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res; mkdir -p "$o" "$r"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > "$o/gpu2.txt" 2>&1
el "tests"
timeout 120 python -m pytest -v -n 8 -p no:cacheprovider -rfE tests/gpu/test_gpu_replay_states.py tests/gpu/test_gpu_rounding.py \
  -k "8bit or graph_runner_draws" > "$o/gpu_rerun.log" 2>&1; echo "exit $?" >> "$o/gpu_rerun.log"
grep -E "PASSED|FAILED|ERROR" "$o/gpu_rerun.log" | tail -12; tail -2 "$o/gpu_rerun.log"
el "replay-states bench, int8"
timeout 95 python bench/gpu_replay_states_bench.py --forms int8,int8-K4 --batches 256 --out "$r" > "$o/states_bench_int8.log" 2>&1
echo "exit $?" >> "$o/states_bench_int8.log"; tail -10 "$o/states_bench_int8.log"
cp "$r"/gpu_replay_states_bench.json "$o/gpu_replay_states_bench_int8.json" 2>/dev/null
el "done"

# third call, same machine (states_bench_int8_k4.log, gpu_replay_states_bench_int8_k4.json): the int8 K = 4 form,
# which the limit above cut:
#   GPUKIT_LIMIT_S=120 bash .gpukit/on-device.sh run "timeout 115 python bench/gpu_replay_states_bench.py \
#     --forms int8-K4 --batches 256 --out /tmp/r3 > $OUT/states_bench_int8_k4.log 2>&1; ..."
