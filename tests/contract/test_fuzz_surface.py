"""One fuzz harness for the public surface: every entry point fed odd tensors and odd
scalars survives, refuses with a named TypeError/ValueError, and a refused call changes no byte
of the pool and nothing in its allocator.

The harness runs in a subprocess (``tests/fuzz_surface_worker.py``; a crash there is a failure
here, not the end of the test run), once for the stepwise surface and once for replay's
(``tests/fuzz_replay_surface.py``: ``mamba3_step_fn``'s replay mode, ``check_replay_inputs``, a replay plan's ``run``,
``decode_step`` and ``materialize`` on a replay pool), and once for the helpers'
(``tests/fuzz_helper_surface.py``: ``new_ring``, ``fork_row``, a replay pool's ``alloc``/``alloc_spec``,
the graph runner's ``capture``/``step`` and stochastic ``decode_step``, each refusal compared byte for byte
on every tensor reachable from the arguments). The default budget is 400 examples each;
``--fuzz-long`` runs 20,000 (docs/measured/ keeps the long runs' logs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/: the worker and its surfaces


@pytest.mark.parametrize("surface", ["step", "replay", "helpers"])
def test_the_public_surface_survives_odd_input_and_refuses_it_by_name(fuzz_examples, surface):
    r = subprocess.run([sys.executable, str(HERE / "fuzz_surface_worker.py"), str(fuzz_examples), "20261124", surface],
                       cwd=HERE.parent, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, f"the harness died (exit {r.returncode}):\n{r.stderr[-4000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert result["examples"] >= fuzz_examples
    assert not result["failures"], "\n".join(result["failures"])
