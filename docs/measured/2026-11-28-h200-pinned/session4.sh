#!/usr/bin/env bash
# Fifth call on the same machine: the GPU suite's default set again (session3.sh's 210 s limit had stopped it),
# passed inline as:
#   export MAMBA3_STEP_CACHE_DIR=/tmp/m3cache; GPUKIT_LIMIT_S=230 bash .gpukit/on-device.sh run \
#     "timeout 220 python -m pytest -q -n 16 -p no:cacheprovider -rfE tests/gpu > \$OUT/gpu_suite_rerun.log 2>&1; ..."
#   (carry .gpukit/on-device.sh)
# It stopped at its limit at the same point: 1,001 of 1,030 tests had reported, none failed.
set -uo pipefail
o=${OUT:-/tmp/out}; mkdir -p "$o"
timeout 220 python -m pytest -q -n 16 -p no:cacheprovider -rfE tests/gpu > "$o/gpu_suite_rerun.log" 2>&1
echo "exit $?"; tail -n 3 "$o/gpu_suite_rerun.log"
