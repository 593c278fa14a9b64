#!/bin/sh
# The latency model with its issue side on the SASS a live slab issues (no GPU; CPU, 2 cores).
set -e
python bench/latency_model.py > docs/measured/2026-12-02-cpu-issued-sass/latency_model.log 2>&1
for t in float32 bfloat16; do
  python bench/latency_model.py --no-compile --out /tmp/lmo \
    --measured docs/measured/2026-11-28-h200-pinned/bench_$t.json \
    > docs/measured/2026-12-02-cpu-issued-sass/latency_model_measured_$t.log 2>&1
done
# the counts ISSUED_SASS holds, from the sm_90a cubins, and the synthetic walk
python -m pytest -q tests/kernel/test_issued_sass.py --full-matrix -n 2 > docs/measured/2026-12-02-cpu-issued-sass/test_issued_sass.log 2>&1
