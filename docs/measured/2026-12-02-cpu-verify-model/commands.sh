#!/bin/sh
# The verify forms in the latency model, the slab pipeline's bytes in flight (no GPU; CPU, 2 cores).
set -e
D=docs/measured/2026-12-02-cpu-verify-model
# the suite's durations at 94a33ba (before this change), on a machine with nothing else running
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q -n 2 --durations=0 -p no:cacheprovider > $D/durations_94a33ba.log 2>&1
# the model, compiling its kernels (reports stale stated facts, if any)
python bench/latency_model.py > $D/latency_model.log 2>&1
# the verify forms' facts, the pipeline's bytes in flight, ISSUED_SASS, against the cubins
python -m pytest -q -n 2 --full-matrix tests/kernel/test_issued_sass.py tests/kernel/test_pipeline_compile.py \
  tests/kernel/test_kernel_compile.py -k "verify_forms or issued or pipeline or littles" > $D/compile_facts.log 2>&1
