"""Programmatic dependent launch in the PTX executor: ``griddepcontrol.wait`` / ``launch_dependents`` and
:func:`ptx_executor.analysis.pre_wait_accesses`, the accesses a kernel makes before its wait.

A kernel launched with programmatic serialization may touch, before ``griddepcontrol.wait``, only
what the previous kernel of the stream does not write (the step: its indices and state rows).
Each mistake is planted in a small kernel (an input read before the wait, a write before it, no
wait at all) and the analysis must name the region; the executor's values are the same with or
without the mistake (it runs one kernel, nothing else writes), so only the analysis can tell.
"""

from __future__ import annotations

import pytest
import torch
from ptx_harness import TID_ADDR, run_kernel

import ptx_executor as ptx
from ptx_executor import analysis

# %rd1 = &idx[tid] (param 0), %rd3 = &x[tid] (param 1), %rd4 = &out[tid] (param 2)
_ADDRS = TID_ADDR + """  add.s64 %rd3, %rd41, %rd0;
  add.s64 %rd4, %rd42, %rd0;
"""
_READ_IDX = "  ld.global.b32 %r1, [%rd1];\n"
_READ_X = "  ld.global.b32 %r2, [%rd3];\n"
_WAIT = "  griddepcontrol.wait;\n  griddepcontrol.launch_dependents;\n"
_WRITE = "  add.u32 %r3, %r1, %r2;\n  st.global.b32 [%rd4], %r3;\n  ret;\n"


def _run(body):
    idx = torch.arange(32, dtype=torch.int32)
    x = torch.arange(100, 132, dtype=torch.int32)
    out = torch.full((32,), -7, dtype=torch.int32)
    mem = {"idx": idx, "x": x, "out": out}
    res = run_kernel(body, mem, readonly=("idx", "x"))
    memory = ptx.GlobalMemory()
    for name, t in mem.items():
        memory.add(name, t)
    assert torch.equal(out, idx + x), "one kernel alone: the same values whatever the order"
    return analysis.pre_wait_accesses(res, memory)


def test_only_the_index_is_read_before_the_wait():
    assert _run(_ADDRS + _READ_IDX + _WAIT + _READ_X + _WRITE) == {"idx": {"read": 128, "written": 0}}


@pytest.mark.parametrize("mistake, body, region", [
    ("an input read before the wait", _ADDRS + _READ_IDX + _READ_X + _WAIT + _WRITE, "x"),
    ("a write before the wait", _ADDRS + _READ_IDX + _READ_X + _WRITE.replace("  ret;\n", "") + _WAIT + "  ret;\n",
     "out"),
    ("no wait at all", _ADDRS + _READ_IDX + _READ_X + _WRITE, "x"),
])
def test_an_access_before_the_wait_is_named(mistake, body, region):
    before = _run(body)
    assert region in before, (mistake, before)
    assert before["idx"]["read"] == 128


def test_griddepcontrol_takes_only_its_two_forms():
    with pytest.raises(ptx.UnsupportedInstruction, match="griddepcontrol"):
        _run(_ADDRS + _READ_IDX + "  griddepcontrol.wait.sync;\n" + _READ_X + _WRITE)
