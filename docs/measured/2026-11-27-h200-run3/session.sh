#!/usr/bin/env bash
# Third H200 run: the replay kernel's destinations, one-token commits and fewer-draft steps, the
# refactored GPU tests, and gpu_bench --padded-rows (the pool-mode slowdown). At most 8 files in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res; mkdir -p "$o" "$r"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u; python -c "import torch;print(torch.__version__, torch.version.cuda)"; } > "$o/gpu.txt" 2>&1
el "tests"
timeout 250 python -m pytest -q -n 16 -p no:cacheprovider -rf tests/gpu > "$o/gpu_tests.log" 2>&1; echo "exit $?" >> "$o/gpu_tests.log"; tail -4 "$o/gpu_tests.log"
el "stepwise bench, padded rows"
timeout 70 python bench/gpu_bench.py --padded-rows --batches 1,64,256,512 --no-plot --out "$r" > "$o/gpu_bench.log" 2>&1; echo "exit $?" >> "$o/gpu_bench.log"; tail -14 "$o/gpu_bench.log"
el "memcheck"
timeout 110 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 200 \
  python -m pytest -q -n0 -p no:cacheprovider tests/gpu/test_gpu_replay.py -k "(fewer_drafts and 1-4) or (destinations_flush and 64-4)" > "$o/memcheck.log" 2>&1
echo "memcheck exit $?" >> "$o/memcheck.log"; tail -5 "$o/memcheck.log"
cat "$r"/*.json > "$o/bench_json.txt" 2>/dev/null
el "done"

# second call, same machine (verify_bench_k2.log, replay_bench_512.log, memcheck2.log):
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res2; mkdir -p "$o" "$r"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "verify bench K=2"
timeout 90 python bench/gpu_replay_verify_bench.py --ks 2 --batches 1,64,256 --out "$r" > "$o/verify_bench_k2.log" 2>&1; echo "exit $?" >> "$o/verify_bench_k2.log"; tail -8 "$o/verify_bench_k2.log"
el "replay bench B=512"
timeout 70 python bench/gpu_replay_bench.py --batches 512 --ks 2,4 --out "$r" > "$o/replay_bench_512.log" 2>&1; echo "exit $?" >> "$o/replay_bench_512.log"; tail -8 "$o/replay_bench_512.log"
el "memcheck"
timeout 130 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 200 python -m pytest -q -n0 -p no:cacheprovider tests/gpu -k "(replay_decode and 64-4) or (stochastic_pool_parity and 9) or (rotary_pool_parity and 7) or (fewer_drafts and 2-2) or (destinations_flush and 1-2)" > "$o/memcheck2.log" 2>&1
echo "memcheck exit $?" >> "$o/memcheck2.log"; tail -5 "$o/memcheck2.log"
cat "$r"/*.json > "$o/bench_json2.txt" 2>/dev/null
el "done"

# third call, a second machine (ncu_pool_dense.log; the probe's dense variant added for it):
timeout 140 ncu --profile-from-start off --target-processes all \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  python bench/gpu_replay_probe.py --batch 256 --ks 2
