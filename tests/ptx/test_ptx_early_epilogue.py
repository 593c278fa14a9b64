"""The epilogue's operands loaded early (the default of a 4- or 8-warp register kernel's stepwise tokens,
``tiling.early_epilogue``), executed: its PTX run on the CPU beside the layout that loads them after the
update (``StepSpec.late_epilogue``).

Loading D, z, zproj and outproj at the token's start instead of after the update changes when they
are read, not what is computed, so for each specialisation both layouts run on the same fresh random
inputs (poisoned ``out``, every padding kind in the batch) and everything they write must be the same
bits. The covering set, one multi-token, one rotary, one stochastic-rounding and one 8-bit
specialisation run by default; every multi-token, rotary, stochastic and 8-bit one with
``--full-matrix`` (among them tilings whose epilogue rows do not fill the block, and two rows a thread).
"""

from __future__ import annotations

import pytest
from async_state_cases import assert_same_writes, case_params, case_spec, prepared_call, run_each
from test_kernel_compile import COVERING

from mamba3_step.kernel.step import Mamba3StepKernel
from mamba3_step.spec import flagship_spec
from mamba3_step.testing import bits_equal
from mamba3_step.tiling import EARLY_EPILOGUE_WARPS
from mamba3_step.tools.ptx_tier import run_step_ptx


@pytest.mark.parametrize("name", case_params())
def test_the_early_epilogue_writes_the_late_layouts_bits(name):
    spec = case_spec(name)
    tensors, _ = prepared_call(spec, B=6, seed=23)
    default, late = run_each(tensors, lambda t: run_step_ptx(spec, t, record=False),
                             lambda t: run_step_ptx(spec.replace(late_epilogue=True), t, record=False))
    assert assert_same_writes(default, late, f"{name}, the early and the late epilogue") >= 2
    assert not bits_equal(default.out, tensors.out), f"{name}: the step wrote nothing to out"


def test_which_kernels_load_the_epilogue_early():
    """The register kernel's stepwise tokens at 4 or 8 warps; not a replay step, not the asynchronous copy,
    not other warp counts (where the registers cost CTAs), not under late_epilogue."""
    flagship = flagship_spec()
    assert flagship.num_warps in EARLY_EPILOGUE_WARPS and Mamba3StepKernel(flagship).early_epilogue
    assert Mamba3StepKernel(flagship_spec(tokens=4, dst_per_token=True).with_default_tiling()).early_epilogue
    assert COVERING["N32-D64-R4-tileD32-pool"].with_default_tiling().num_warps == 2
    for spec in (flagship.replace(late_epilogue=True), flagship_spec(replay_ring=2), flagship.replace(async_state_copy=True),
                 COVERING["N32-D64-R4-tileD32-pool"].with_default_tiling()):
        assert not Mamba3StepKernel(spec).early_epilogue, spec
