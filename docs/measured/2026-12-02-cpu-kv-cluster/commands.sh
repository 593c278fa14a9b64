#!/usr/bin/env bash
# The D split over a cluster (update_kv_state with tile_D < headdim) and programmatic dependent launch, 2026-12-02,
# on the CPU (no GPU was lent): the commands whose output is in this folder, run from the repository root in its venv.
set -euo pipefail

# The register kernel's PTX for the specialisations that existed before (the covering set as it was, one multi-token,
# rotary, stochastic and 8-bit form, the asynchronous copy twice, replay F = 4), hashed as in
# docs/measured/2026-12-01-cpu-pipeline/commands.sh (hash_sample.py there): ptx_hashes_after.txt, equal line for line
# to ../2026-12-01-cpu-pipeline/ptx_hashes_after.txt (the covering set's N32-D64-R4-tileD32-pool is now a kv form;
# its previous spec hashed alone, the last line, is unchanged).
python /tmp/hash_sample.py "$PWD" > ptx_hashes_after.txt

# The latency model with the D split and programmatic launch rows (latency_model.log)
python bench/latency_model.py

# The new forms' tests with the full matrix (new_forms_full_matrix.log: its one failure, the stale
# VERIFY_EXECUTED["today"], re-executed and updated after it; new_forms_compile_full_matrix.log)
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q -n 2 --full-matrix tests/ptx/test_ptx_cluster.py \
  tests/ptx/test_ptx_kv_cluster.py tests/ptx/test_ptx_griddep.py tests/ptx/test_ptx_programmatic.py \
  tests/tools/test_issue_model.py tests/tools/test_latency_model.py tests/tools/test_bench.py tests/serving/test_serving.py
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q -n 2 --full-matrix tests/kernel/test_kernel_compile.py \
  tests/kernel/test_pipeline_compile.py tests/ptx/test_ptx_pipeline.py tests/ptx/test_ptx_kernel.py \
  tests/ptx/test_ptx_multi_token.py -k "cluster or programmatic or split or tileD32 or unsupported_tiling or programmatically"

# The tests can fail: the kernel without its cluster arrival, then without its wait (edits to kernel/tokens.py,
# reverted): tests/ptx/test_ptx_kv_cluster.py -k flagship-tileD16 reports a deadlock, then a race
python -m pytest -q -n 0 tests/ptx/test_ptx_kv_cluster.py -k flagship-tileD16

# The suite on 2 workers (suite_working_tree_first.log), then CI in a fresh clone (ci_fresh_clone.log)
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q -n 2 --durations=30
# git clone /work/main /tmp/ci && cd /tmp/ci && CI=true bash .ci/run
