#!/usr/bin/env bash
# This session's GPU run: everything since the first H200 run (packed state rows, verify steps in
# the replay kernel, the replay custom op) on the GPU. Writes at most 8 files into $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res; mkdir -p "$o" "$r"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u; python -c "import torch;print(torch.__version__, torch.version.cuda)"; } > "$o/gpu.txt" 2>&1
el "tests"
timeout 250 python -m pytest -q -n 16 -p no:cacheprovider -rf tests/gpu > "$o/gpu_tests.log" 2>&1; echo "exit $?" >> "$o/gpu_tests.log"; tail -3 "$o/gpu_tests.log"
el "verify bench"
timeout 110 python bench/gpu_replay_verify_bench.py --batches 1,64,256 --out "$r" > "$o/verify_bench.log" 2>&1; echo "exit $?" >> "$o/verify_bench.log"; tail -12 "$o/verify_bench.log"
el "replay bench"
timeout 70 python bench/gpu_replay_bench.py --batches 64,256 --ks 2,4 --out "$r" > "$o/replay_bench.log" 2>&1; echo "exit $?" >> "$o/replay_bench.log"; tail -8 "$o/replay_bench.log"
el "stepwise bench"
timeout 45 python bench/gpu_bench.py --batches 1,64,256,512 --no-plot --out "$r" > "$o/gpu_bench.log" 2>&1; echo "exit $?" >> "$o/gpu_bench.log"; tail -8 "$o/gpu_bench.log"
el "memcheck"
sel='no_access_outside or (replay_decode and 64-4) or verify'
timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 200 \
  python -m pytest -q -n0 -p no:cacheprovider tests/gpu/test_gpu_replay.py tests/gpu/test_gpu_kernel.py -k "$sel" > "$o/memcheck.log" 2>&1
echo "memcheck exit $?" >> "$o/memcheck.log"; tail -4 "$o/memcheck.log"
cat "$r"/*.json > "$o/bench_json.txt" 2>/dev/null
el "done"

# second machine, after the fix (gpu_rerun.log, memcheck.log):
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "rerun of the failed tests"
timeout 110 python -m pytest -q -n 8 -p no:cacheprovider -rf tests/gpu/test_gpu_replay.py -k "replay_pool_decode or verify_rounds" > "$o/gpu_rerun.log" 2>&1; echo "exit $?" >> "$o/gpu_rerun.log"; tail -4 "$o/gpu_rerun.log"
el "memcheck"
timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 200 \
  python -m pytest -q -n0 -p no:cacheprovider tests/gpu/test_gpu_replay.py tests/gpu/test_gpu_kernel.py -k "verify_rounds and 4-4 or no_access_outside" > "$o/memcheck.log" 2>&1
echo "memcheck exit $?" >> "$o/memcheck.log"; tail -5 "$o/memcheck.log"
el "done"

# third call, same machine (memcheck_more.log):
timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 200 python -m pytest -q -n0 -p no:cacheprovider tests/gpu -k "(replay_decode and 64-4) or (stochastic_pool_parity and 9) or (rotary_pool_parity and 7) or (multi_token_parity_against_t_dense_steps and 4-accepted) or (parity_against_gather and P37-B16-)"
