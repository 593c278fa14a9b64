# The commands of this folder's logs (2026-11-28, the development machine: 2 shared cores, no GPU).
# fuzz_long_*.log: the public-surface fuzz at 20,000 examples a surface (what `pytest --fuzz-long` runs),
# run directly, one worker per surface, from the repository root:
time python tests/fuzz_surface_worker.py 20000 20261124 step                                  # fuzz_long_step.log
time python tests/fuzz_surface_worker.py 20000 20261124 replay; \
  time python tests/fuzz_surface_worker.py 20000 20261124 helpers                             # fuzz_long_replay_helpers.log
time python tests/fuzz_surface_worker.py 20000 20261124 replay                                # fuzz_long_replay_rerun.log
# suite_working_tree.log: the README's test command in the working tree (the C check required)
MAMBA3_STEP_REQUIRE_NATIVE=1 python -m pytest -q
# ci_fresh_clone.log: CI in a fresh clone and venv
git clone /work/main /work/ci_clone && cd /work/ci_clone && time CI=true bash .ci/run
# ptx_hashes_*.txt: the PTX hash lists of the kernel restructure (a partial list: the run order puts the
# default run's 92 first, then spreads over the code paths), from the tree before it and from the tree after
git worktree add /tmp/base a28a094 --detach && cp tests/ptx_hashes.py /tmp/base/tests/ && \
  (cd /tmp/base && PYTHONPATH=$PWD python tests/ptx_hashes.py --full-matrix --resume --out ptx_hashes_before.txt)
mkdir -p /tmp/after && git archive 58148d1 | tar -x -C /tmp/after && \
  (cd /tmp/after && PYTHONPATH=$PWD python tests/ptx_hashes.py --full-matrix --resume --out ptx_hashes_after.txt)
python tests/ptx_hashes.py --compare ptx_hashes_before.txt ptx_hashes_after.txt   # "only before" lines: not yet hashed after
