#!/usr/bin/env bash
# Second machine of the asynchronous state copy's GPU run: why it is not faster. Nsight Compute's raw page
# (every metric its sections collect: the stall reasons per issued instruction, L1/shared and L2 traffic)
# plus the DRAM bytes and executed instructions, for both kernels at B = 256, fp32 and bf16 states.
#   call 1: bash .gpukit/on-device.sh stage                 (carry .gpukit/a, .gpukit/on-device.sh)
#   call 2: GPUKIT_LIMIT_S=300 bash .gpukit/on-device.sh run "bash docs/measured/2026-11-28-h200-async/session2.sh"
#           (carry .gpukit/b, .gpukit/on-device.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; mkdir -p "$o"
export MAMBA3_STEP_CACHE_DIR=/tmp/m3cache; mkdir -p -m 700 "$MAMBA3_STEP_CACHE_DIR"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
for dtype in float32 bfloat16; do
  el "ncu raw, B=256, $dtype"
  timeout 110 ncu --profile-from-start off --page raw --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis_Tables --section LaunchStats --section Occupancy --section SpeedOfLight \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum,lts__t_bytes.sum \
    python bench/gpu_async_probe.py --batch 256 --state-dtype "$dtype" > "$o/ncu_raw_$dtype.log" 2>&1
  el "exit $?"
  grep -E "profiled|dram__bytes_(read|write).sum |smsp__inst_executed.sum |gpu__time_duration.sum|issue_stalled_(long_scoreboard|lg_throttle|mio_throttle|short_scoreboard|barrier|wait|math_pipe|not_selected|drain|dispatch|no_instruction|membar|tex_throttle|selected)_per_issue_active" "$o/ncu_raw_$dtype.log"
done
el "done"
