#!/usr/bin/env bash
# The slab pipeline at three CTAs per SM (stages by a 64 KiB budget, skewed coefficient rows, operand columns a
# lane's vectors apart), 2026-12-02, on the CPU (no GPU was lent): the commands whose output is in this folder, run
# from the repository root in its venv.
set -euo pipefail

# The register kernel's PTX unchanged: the 14 specialisations of ../2026-12-01-cpu-pipeline/commands.sh
# (hash_sample.py there), hashed at the tree; equal to ../2026-12-01-cpu-pipeline/ptx_hashes_before.txt
python /tmp/hash_sample.py "$PWD" | diff - docs/measured/2026-12-01-cpu-pipeline/ptx_hashes_before.txt

# Shared-memory bank conflicts of the pipeline, executed (two slabs of the flagship, fp32 and bf16):
# bank_probe.log at the tree; bank_probe_register_layouts.log with the register kernel's layouts
# (Mamba3StepKernel.coefficient_rows edited to return the padded rows, which also turns operand_columns off)
python docs/measured/2026-12-02-cpu-pipeline-stages/bank_probe.py

# The pipeline's tests with the full matrix (pipeline_full_matrix.log)
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q -n 2 --full-matrix tests/ptx/test_ptx_pipeline.py \
    tests/kernel/test_pipeline_compile.py tests/tools/test_issue_model.py -k "pipeline or vector_load or coefficient"

# The latency model with the pipeline's rows (latency_model.log)
python bench/latency_model.py

# The suite (suite_working_tree.log), then CI in a fresh clone (ci_fresh_clone.log)
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q
# git clone /work/main /tmp/ci && cd /tmp/ci && CI=true bash .ci/run
