"""bench/bench_host.py's plumbing (no timing is asserted): every timed step of the eager and the
planned path reaches the stand-in kernel exactly once, and a bench whose steps do not launch
refuses to report; the table and the JSON carry every case for every batch size.

Letters (docs/contract.md): B lanes, H heads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from mamba3_step import api, compile_cache, launch
from mamba3_step import plan as plan_module

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def _load():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location("bench_bench_host", os.path.join(BENCH, "bench_host.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def bench(monkeypatch):
    """The bench module; whatever it replaces is put back afterwards."""
    for module, name in ((api, "runs_kernel"), (plan_module, "runs_kernel"), (launch, "device_arch")):
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(launch, "_ARCH_BY_INDEX", {})
    yield _load()
    compile_cache.set_builder(None)


def test_every_timed_step_launches_and_the_report_has_every_case(bench, tmp_path, capsys):
    assert bench.main(["--batches", "1,3", "--calls", "40", "--rounds", "2", "--out", str(tmp_path),
                       "--no-plot"]) == 0
    payload = json.loads((tmp_path / "bench_host.json").read_text())
    rows = payload["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["heads"] == bench.H == 48
        for case in bench.CASES + (bench.FULL, bench.MISS):
            assert isinstance(r[case], float) and r[case] > 0, (case, r[case])
    assert payload["calls_per_round"] == 40 and payload["rounds"] == 2
    printed = capsys.readouterr().out
    assert "plan.run out=None" in printed and "as multiples of torch.add" in printed


def test_a_bench_whose_steps_do_not_reach_the_kernel_refuses_to_report(bench, monkeypatch):
    kernel = bench.install_noop_launch()
    monkeypatch.setattr(api, "runs_kernel", lambda x: x.is_cuda)  # CPU steps take the PyTorch path
    with pytest.raises(AssertionError, match="eager .*: 0 launches for 5 calls"):
        bench.measure_batch(1, kernel, calls_per_round=5, rounds=1, overhead=0)


def test_the_calls_are_the_flagship_in_pool_mode_with_fresh_addresses(bench):
    calls = bench.calls_for(4)
    assert len(calls) == bench.SETS
    args, kwargs = calls[0]
    assert tuple(args[0].shape) == (5, 48, 64, 128) and tuple(args[7].shape) == (4, 48, 64)  # state (P, ...), x
    assert kwargs["null_slot_id"] == 0 and kwargs["state_batch_indices"].tolist() == [1, 2, 3, 4]
    pointers = [tuple(a.data_ptr() for a in c[0] if a is not None) for c in calls]
    assert len(set(pointers)) == len(pointers), "two sets share every address"
    assert calls[0][0][0] is calls[2][0][0] and calls[0][0][0] is not calls[1][0][0]  # two layers, alternating
