#!/usr/bin/env bash
# The 2026-11-28 H200 run: everything since the fourth H200 run on the GPU for the first time (replay
# with rotary, stochastic rounding and 8-bit states, replayed and from the checkpoint; materialize on the
# kernel; the replay-states GPU suite), then the replay-states benchmark, then memcheck on the new
# from-checkpoint forms. Writes at most 8 files into $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; r=/tmp/res; mkdir -p "$o" "$r"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; date -u; python -c "import torch;print(torch.__version__, torch.version.cuda)"; } > "$o/gpu.txt" 2>&1
el "tests"
timeout 290 python -m pytest -v -n 16 -p no:cacheprovider -rfE tests/gpu > "$o/gpu_tests.log" 2>&1; echo "exit $?" >> "$o/gpu_tests.log"
grep -E "FAILED|ERROR" "$o/gpu_tests.log" | head -20; tail -3 "$o/gpu_tests.log"
el "replay-states bench"
timeout 150 python bench/gpu_replay_states_bench.py --batches 256 --out "$r" > "$o/states_bench.log" 2>&1; echo "exit $?" >> "$o/states_bench.log"; tail -16 "$o/states_bench.log"
cp "$r"/gpu_replay_states_bench.json "$o/" 2>/dev/null
el "memcheck"
timeout 75 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 200 \
  python -m pytest -q -n0 -p no:cacheprovider tests/gpu/test_gpu_replay.py -k "(8bit_replay_from_checkpoint and int8-2) or (rotary_replay_matches and 2-True)" > "$o/memcheck.log" 2>&1
echo "memcheck exit $?" >> "$o/memcheck.log"; tail -4 "$o/memcheck.log"
el "done"
