#!/usr/bin/env bash
# A GPU machine's second look, after bench/gpu_all.sh: the kernels under compute-sanitizer, the
# flagship's stepwise kernel (pool mode, then dense mode: why pool mode measured 4-5% slower than
# dense from the second H200 run on) and replay kernels under Nsight Compute (K = 2 first: since
# the state's D stride is static it compiles to the stepwise step's 168 registers on sm_90a; does
# it reach the stepwise step's DRAM throughput?), and the GPU parity cross product.
# Usage (repo root, package importable): bash bench/gpu_diagnose.sh
# Logs go to $OUT when set (the device tool), else bench/results/. Each part has its own time limit
# (MEMCHECK_S, NCU_S, MATRIX_S seconds) so that a slow part leaves the others their time.
# Seen on an H200 (2026-11-27, docs/measured/2026-11-27-h200/): the 24 memcheck tests need more
# than 100 s (12 ran), ncu with six sections takes about 30 s a kernel (20 passes each), the
# cross product about 120 s on 8 workers (452 of 544 ran in 95 s). The defaults below fit that.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# memcheck: out-of-bounds and misaligned accesses on every kind of index (padding, null slot,
# out-of-range), pools smaller than the batch, multi-token, replay, rotary, stochastic and 8-bit
sel='no_access_outside or (parity_against_gather and (P37-B5- or P37-B16- or P37-B64-))'
sel="$sel or (replay_decode and 64-4) or (stochastic_pool_parity and 9) or (rotary_pool_parity and 7)"
sel="$sel or (multi_token_parity_against_t_dense_steps and 4-accepted)"
sel="$sel or (replay_destinations and 64-2) or (fewer_drafts and 1-2)"  # replay's destinations, one-token commits
# On the H200 run the sanitizer printed 20 API errors (cuGetProcAddress_v2 answering
# CUDA_ERROR_INVALID_VALUE to cuda-python's driver binding), which filled --print-limit 20, and the
# run was stopped before its summary: that run says nothing about the kernels' accesses. API errors
# are not reported here (--report-api-errors no; the second H200 run used it and got a clean ERROR
# SUMMARY over two tests in 48 s, docs/measured/2026-11-27-h200-run2/), so they cannot fill the
# limit; a run counts only when its log ends with the sanitizer's "ERROR SUMMARY" line.
timeout "${MEMCHECK_S:-200}" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
  --print-limit 1000 \
  python -m pytest -q -n0 -p no:cacheprovider tests/gpu -k "$sel" 2>&1 | tee "$out/memcheck.log"
echo "memcheck exit ${PIPESTATUS[0]}" | tee -a "$out/memcheck.log"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout "${NCU_S:-200}" "$ncu" --profile-from-start off --target-processes all \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  python bench/gpu_replay_probe.py --batch 256 --ks "${NCU_KS:-2,4}" --replay-warps "${NCU_WARPS:-8}" 2>&1 \
  | tee "$out/ncu_replay.log"
echo "ncu exit ${PIPESTATUS[0]}" | tee -a "$out/ncu_replay.log"
timeout "${MATRIX_S:-120}" python -m pytest -q tests/gpu/test_gpu_kernel.py --full-matrix -k full_cross_product \
  2>&1 | tee "$out/gpu_full_matrix.log"
echo "full matrix exit ${PIPESTATUS[0]}" | tee -a "$out/gpu_full_matrix.log"
