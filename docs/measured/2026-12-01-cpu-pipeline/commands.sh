#!/usr/bin/env bash
# The slab pipeline and the PTX tier's mbarriers and bulk copies, 2026-12-01, on the CPU (no GPU was lent):
# the commands whose output is in this folder, run from the repository root in its venv.
set -euo pipefail

# The register kernel's PTX before and after the change (14 specialisations: the covering set, one multi-token,
# rotary, stochastic and 8-bit form, the asynchronous copy twice, replay F = 4), hashed with the entry name
# normalised (tests/ptx_hashes.py's normalised_ptx); "before" from a worktree of c9b39b7, "after" from the tree.
#   python hash_sample.py <tree>  >  ptx_hashes_{before,after}.txt      (hash_sample.py below)
cat > /tmp/hash_sample.py <<'PY'
import hashlib, sys, tempfile
sys.path[:0] = [sys.argv[1] + "/tests", sys.argv[1] + "/tests/kernel", sys.argv[1]]
from ptx_hashes import normalised_ptx
from mamba3_step.build import compile_kernel
from test_kernel_compile import COVERING, MULTI_TOKEN, ROTARY, STOCHASTIC, EIGHT_BIT
from mamba3_step.spec import flagship_spec
specs = dict(COVERING)
specs.update({"T4": MULTI_TOKEN["flagship-T4-spec"], "rot": ROTARY["flagship-rotary"],
              "sr": STOCHASTIC["flagship-bf16state-sr"], "i8": EIGHT_BIT["flagship-int8state"],
              "async": flagship_spec(async_state_copy=True),
              "async-i8": EIGHT_BIT["flagship-int8state"].replace(async_state_copy=True),
              "replay": flagship_spec(replay_ring=4)})
for name, spec in specs.items():
    c = compile_kernel(spec.with_default_tiling(), "sm_90a", extra_options=f"--keep-ptx --dump-dir {tempfile.mkdtemp()}")
    print(hashlib.sha256(normalised_ptx(c.__ptx__).encode()).hexdigest()[:16], name, "sm_90a", flush=True)
PY

# The pipeline's tests with the full matrix (pipeline_full_matrix.log)
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q -n 1 tests/ptx/test_ptx_pipeline.py tests/kernel/test_pipeline_compile.py --full-matrix

# The latency model with the pipeline's rows (latency_model.log)
python bench/latency_model.py

# The suite (suite_working_tree.log), then CI in a fresh clone (ci_fresh_clone.log)
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q --durations=30
# git clone /work/main /tmp/ci && cd /tmp/ci && CI=true bash .ci/run
