#!/usr/bin/env bash
# Third call: the GPU suite's default set with the pinned loads the default kernel, then Nsight Compute's raw page
# of the default kernel at B = 256 (fp32 and bf16 states: the stall reasons per issued instruction, DRAM bytes,
# executed instructions), as docs/measured/2026-11-28-h200-async/session2.sh read the previous kernel's.
#   (fresh machine: bash .gpukit/on-device.sh stage, carrying .gpukit/a and .gpukit/on-device.sh, first)
#   GPUKIT_LIMIT_S=420 bash .gpukit/on-device.sh run "bash docs/measured/2026-11-28-h200-pinned/session3.sh"
#   (carry .gpukit/b, .gpukit/on-device.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}; mkdir -p "$o"
export MAMBA3_STEP_CACHE_DIR=/tmp/m3cache; mkdir -p -m 700 "$MAMBA3_STEP_CACHE_DIR"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "GPU suite, default set"
timeout 210 python -m pytest -q -n 16 -p no:cacheprovider -rfE tests/gpu > "$o/gpu_suite.log" 2>&1
el "exit $?"; tail -n 3 "$o/gpu_suite.log"
for dtype in float32 bfloat16; do
  el "ncu raw, B=256, $dtype"
  timeout 90 ncu --profile-from-start off --page raw --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis_Tables --section LaunchStats --section Occupancy --section SpeedOfLight \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__inst_executed.sum,lts__t_bytes.sum \
    python bench/gpu_async_probe.py --batch 256 --state-dtype "$dtype" --kernels registers > "$o/ncu_raw_$dtype.log" 2>&1
  el "exit $?"
  grep -E "profiled|dram__bytes_(read|write).sum |smsp__inst_executed.sum |gpu__time_duration.sum|issue_stalled_(long_scoreboard|lg_throttle|mio_throttle|short_scoreboard|barrier|wait|math_pipe|not_selected|drain|dispatch|no_instruction|membar|tex_throttle|selected)_per_issue_active|registers_per_thread|warps_active.avg.per_cycle_active " "$o/ncu_raw_$dtype.log"
done
el "done"
