#!/usr/bin/env bash
# A kernel that moves the state asynchronously, on a GPU machine, in one prepared run (docs/design/kernel.md):
# `async` (default) the asynchronous state copy, `pipeline` the slab pipeline (at 2 and 3 persistent CTAs per SM),
# `small` the small-batch forms (the D split over a cluster, programmatic launch).
# Its GPU test, the step suite side by side with the register kernel (fp32 and bf16 states, and upstream's dense
# step when MAMBA_CHECKOUT names a state-spaces/mamba checkout), compute-sanitizer racecheck and synccheck on it,
# and Nsight Compute on it and the register kernel at B = 1 and 256 (each when its tool is on PATH).
# Usage (from the repo root, after installing the package):  bash bench/gpu_async.sh [async|pipeline|small]
# Writes logs under bench/results/<kernel>/.
set -uo pipefail
cd "$(dirname "$0")/.."
kernel="${1:-async}"
case "$kernel" in
  async) test=tests/gpu/test_gpu_async_state.py; variant=(--async-copy) ;;
  pipeline) test=tests/gpu/test_gpu_pipeline.py; variant=(--pipeline-per-sm 2,3) ;;
  small) test=tests/gpu/test_gpu_small_batch.py; variant=(--small-batch --pipeline-per-sm 3)
         kernel=split4,programmatic,split4_programmatic ;;
  *) echo "usage: bash bench/gpu_async.sh [async|pipeline|small], got $kernel" >&2; exit 2 ;;
esac
out=bench/results/${1:-async}
mkdir -p "$out"
python - <<'PY' || { echo "no CUDA device: nothing to run"; exit 1; }
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PY
rc=0
python -m pytest -q "$test" 2>&1 | tee "$out/gpu_tests.log" || rc=1
peer=()
if [ -n "${MAMBA_CHECKOUT:-}" ]; then peer=(--upstream "$MAMBA_CHECKOUT"); fi
for dtype in float32 bfloat16; do
  python bench/gpu_bench.py --suite step "${variant[@]}" "${peer[@]}" --step-state-dtype "$dtype" \
    --batches 1,2,4,8,16,64,256,512 --out "$out/$dtype" 2>&1 | tee "$out/gpu_bench_$dtype.log" || rc=1
done
if command -v compute-sanitizer >/dev/null; then
  for tool in racecheck synccheck; do
    compute-sanitizer --tool "$tool" python bench/gpu_async_probe.py --batch 4 --heads 4 --kernels "$kernel" \
      2>&1 | tee "$out/sanitizer_$tool.log" || rc=1
  done
fi
if command -v ncu >/dev/null; then
  for batch in 1 256; do
    ncu --profile-from-start off --set full python bench/gpu_async_probe.py --batch "$batch" --kernels "registers,$kernel" \
      2>&1 | tee "$out/ncu_B$batch.log" || rc=1
  done
fi
exit $rc
