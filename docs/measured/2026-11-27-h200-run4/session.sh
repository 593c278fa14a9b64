#!/usr/bin/env bash
# Fourth H200 run: the GPU suite at replay's new tilings (REPLAY_MIN_WARPS, VERIFY_WARPS) with the replay
# plan's graph test, replay verify K = 2 and K = 4 timed side by side, and memcheck on the plan and the
# small-shape fewer-draft steps. At most 8 files in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res; mkdir -p "$o" "$r"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u; python -c "import torch;print(torch.__version__, torch.version.cuda)"; } > "$o/gpu.txt" 2>&1
el "tests"
timeout 250 python -m pytest -q -n 16 -p no:cacheprovider -rf tests/gpu > "$o/gpu_tests.log" 2>&1; echo "exit $?" >> "$o/gpu_tests.log"; tail -4 "$o/gpu_tests.log"
el "verify bench K=2,4"
timeout 100 python bench/gpu_replay_verify_bench.py --ks 2,4 --batches 64,256 --out "$r" > "$o/verify_bench_k24.log" 2>&1; echo "exit $?" >> "$o/verify_bench_k24.log"; tail -9 "$o/verify_bench_k24.log"
el "memcheck"
timeout 90 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 200 \
  python -m pytest -q -n0 -p no:cacheprovider tests/gpu/test_gpu_replay.py -k "replay_plan or (fewer_drafts and 1-4) or (fewer_drafts and 2-2)" > "$o/memcheck.log" 2>&1
echo "memcheck exit $?" >> "$o/memcheck.log"; tail -5 "$o/memcheck.log"
cat "$r"/*.json > "$o/bench_json.txt" 2>/dev/null
el "done"

# second machine (gpu2.txt, dense_rows_{1,2}.{log,json}): .gpukit/session5.sh
# Fourth H200 run, second machine: where pool mode's 4-6% over dense mode comes from. gpu_bench --dense-rows
# times pool mode with indices naming dense mode's rows in order beside pool (random rows) and dense, twice.
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; mkdir -p "$o"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > "$o/gpu2.txt" 2>&1
for i in 1 2; do
  el "gpu_bench --dense-rows, run $i"
  timeout 130 python bench/gpu_bench.py --dense-rows --batches 64,256,512 --no-plot --out /tmp/r$i > "$o/dense_rows_$i.log" 2>&1
  echo "exit $?" >> "$o/dense_rows_$i.log"; tail -16 "$o/dense_rows_$i.log"
  cp /tmp/r$i/gpu_bench.json "$o/dense_rows_$i.json" 2>/dev/null
done
el "done"

# third machine (gpu3.txt, checkpoint_warps.{log,json}): .gpukit/session6.sh
# Fourth H200 run, third machine: replay with outputs from the checkpoint at 4 warps a CTA (184 registers,
# 2 CTAs = 8 warps per SM on sm_90a) against its 8-warp default (149 registers, 1 CTA of 8 warps).
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; mkdir -p "$o"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > "$o/gpu3.txt" 2>&1
el "gpu_replay_bench --checkpoint-warps 4"
timeout 200 python bench/gpu_replay_bench.py --batches 64,256 --ks 2,4 --checkpoint-warps 4 --out /tmp/r6 > "$o/checkpoint_warps.log" 2>&1
echo "exit $?" >> "$o/checkpoint_warps.log"; tail -14 "$o/checkpoint_warps.log"
cp /tmp/r6/gpu_replay_bench.json "$o/checkpoint_warps.json" 2>/dev/null
el "done"

# fourth machine, tree 61e9d70 (gpu4.txt, gpu_tests_checkpoint.log, replay_k48.log): .gpukit/session7.sh
# Fourth H200 run, fourth machine: the tree with outputs from the checkpoint at 4 warps by default (61e9d70):
# the replay decode tests (both output forms, B = 1, 64, 256, K = 2, 4, 8; graph = eager), then replay at
# B = 256, K = 4 and 8, replayed also at 8 warps, from the checkpoint at its new default.
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; mkdir -p "$o"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > "$o/gpu4.txt" 2>&1
el "replay decode tests"
timeout 100 python -m pytest -q -n 16 -p no:cacheprovider -rf tests/gpu/test_gpu_replay.py -k "decode_matches or graph_equals_eager" > "$o/gpu_tests_checkpoint.log" 2>&1
echo "exit $?" >> "$o/gpu_tests_checkpoint.log"; tail -3 "$o/gpu_tests_checkpoint.log"
el "replay bench K = 4, 8 at B = 256"
timeout 80 python bench/gpu_replay_bench.py --batches 256 --ks 4,8 --replay-warps 8 --out /tmp/r7 > "$o/replay_k48.log" 2>&1
echo "exit $?" >> "$o/replay_k48.log"; tail -9 "$o/replay_k48.log"
cp /tmp/r7/gpu_replay_bench.json "$o/replay_k48.json" 2>/dev/null
el "done"
