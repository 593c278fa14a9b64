# The asynchronous state copy (StepSpec.async_state_copy), 2026-11-28, no GPU: the commands behind this folder's logs.
# Run from the repository root in the project's venv; nvdisasm from nvidia-cuda-nvdisasm on PATH for SASS facts.

# async_full_matrix_run1.log: the executed parity (both kernels' bits) and compile facts, --full-matrix. Its 4
# failures: 3 test inputs lacking rotate_pairwise / rand_rows (fixed in the test), and the rotary flagship's
# 32 spill bytes on sm_100a (listed exactly: KNOWN_SPILLS)
python -m pytest -q -p no:cacheprovider -n 1 --full-matrix tests/ptx/test_ptx_async_state.py tests/kernel/test_async_state_compile.py
# async_compile_full_matrix.log: the compile facts alone, --full-matrix
python -m pytest -q -p no:cacheprovider -n 0 --full-matrix tests/kernel/test_async_state_compile.py
# async_full_matrix_run2.log: the executed parity after the row groups of 1 row (16-bit stochastic, 8-bit): one
# element of N64-D32-R2-bf16state-dense-sr one unit away from the register kernel's -> those forms keep 2 rows
python -m pytest -q -p no:cacheprovider -n 2 --full-matrix tests/ptx/test_ptx_async_state.py
# async_stochastic_8bit_rerun.log: the stochastic and 8-bit forms again at 2 rows
python -m pytest -q -p no:cacheprovider -n 2 --full-matrix tests/ptx/test_ptx_async_state.py -k "sr or int8 or fp8 or 8bit or stochastic"
# executed_facts.txt: warp-instructions per CTA by class (mamba3_step.tools.verify.step.executed_facts, B = 4,
# H = 2, all lanes live), bytes_agree, shared wavefronts and their minimum, of the flagship's forms on the
# asynchronous state copy: fp32, bf16 (row groups of 2), bf16 stochastic at 1 row (11,560), then at 2 rows
# (the last line, 11,512: the kept layout). The register kernel's: 6152, 6788, 11508 (the same function with
# async_state_copy=False)
python -c "from mamba3_step.spec import flagship_spec; from mamba3_step.tools.verify.step import executed_facts; print(executed_facts(flagship_spec(async_state_copy=True))['warp_instructions_per_cta'])"
# latency_model.json: the latency model with the asynchronous state copy's rows (compiles for sm_90a/sm_100a)
python bench/latency_model.py
# suite_working_tree.log: the default suite at the working tree (2 cores)
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q -p no:cacheprovider
# async_compile_full_matrix_final.log: the compile facts, --full-matrix, after the row groups (76 passed)
python -m pytest -q -p no:cacheprovider -n 1 --full-matrix tests/kernel/test_async_state_compile.py
# ci_fresh_clone.log: CI on a fresh clone of main at eb4af21
git clone /work/main /work/ci_clone3 && (cd /work/ci_clone3 && CI=true bash .ci/run)
# ci_fresh_clone_final.log: CI on a fresh clone at 4955689 (the hash runs shared the 2 cores for most of it)
cd /work/ci_clone3 && git pull && CI=true bash .ci/run
# readme_first_command_fresh_venv.log: the README's first command in a fresh venv, on the fresh clone
python3 -m venv /work/fresh_venv && . /work/fresh_venv/bin/activate && \
  pip install torch==2.13.0 && pip install -e '.[test]' && python -m mamba3_step demo
