"""The register kernel's load layouts, executed: the default's PTX (the first token's loads pinned above their
first use by a barrier, ``tiling.pinned_loads``; the epilogue's operands loaded at the token's start,
``tiling.early_epilogue``) run on the CPU beside the previous layouts': the loads in the compiler's order
(``StepSpec.unpinned_loads``) and, with that, the epilogue's operands loaded after the update
(``StepSpec.late_epilogue``).

A barrier and the place of a load change when values are read, not what is computed, so for each
specialisation the layouts run on the same fresh random inputs (poisoned ``out``, every padding kind in the
batch) and everything they write must be the same bits. The default against the late epilogue (both changes
at once) runs for the covering set, one multi-token, one rotary, one stochastic-rounding and one 8-bit
specialisation; with ``--full-matrix`` every multi-token, rotary, stochastic and 8-bit one, and the unpinned
layout beside them (among them tilings whose epilogue rows do not fill the block, and two rows a thread).
"""

from __future__ import annotations

import pytest
from async_state_cases import assert_same_writes, case_params, case_spec, prepared_call, run_each
from test_kernel_compile import COVERING

from mamba3_step.kernel.step import Mamba3StepKernel
from mamba3_step.spec import PREVIOUS_LOAD_LAYOUTS, flagship_spec
from mamba3_step.testing import bits_equal
from mamba3_step.tiling import EARLY_EPILOGUE_WARPS


@pytest.mark.parametrize("name", case_params())
def test_the_default_layout_writes_the_previous_layouts_bits(name, full_matrix):
    spec = case_spec(name)
    previous = {k: v for k, v in PREVIOUS_LOAD_LAYOUTS.items() if full_matrix or k == "late-epilogue"}
    tensors, _ = prepared_call(spec, B=6, seed=23)
    default, *others = run_each(tensors, spec, *(spec.replace(**f) for f in previous.values()))
    for layout, other in zip(previous, others):
        assert assert_same_writes(default, other, f"{name}, the default and the {layout} layout") >= 2
    assert not bits_equal(default.out, tensors.out), f"{name}: the step wrote nothing to out"


def test_which_kernels_pin_their_loads_and_load_the_epilogue_early():
    """Pinned: the register kernel's stepwise tokens whose slab is loaded up front, not a replay step, not the
    asynchronous copy, not under unpinned_loads. Early epilogue: those at 4 or 8 warps (at other warp counts
    the registers cost CTAs), not under late_epilogue."""
    flagship = flagship_spec()
    kernel = Mamba3StepKernel(flagship)
    assert flagship.num_warps in EARLY_EPILOGUE_WARPS and kernel.early_epilogue and kernel.pinned_loads
    multi = Mamba3StepKernel(flagship_spec(tokens=4, dst_per_token=True).with_default_tiling())
    assert multi.early_epilogue and multi.pinned_loads
    assert COVERING["N32-D64-R4-tileD32-pool-kv"].with_default_tiling().num_warps == 2
    for spec in (flagship.replace(late_epilogue=True), flagship_spec(replay_ring=2), flagship.replace(async_state_copy=True),
                 COVERING["N32-D64-R4-tileD32-pool-kv"].with_default_tiling()):
        assert not Mamba3StepKernel(spec).early_epilogue, spec
    assert Mamba3StepKernel(flagship.replace(late_epilogue=True)).pinned_loads
    for spec in (flagship.replace(unpinned_loads=True), flagship_spec(replay_ring=2), flagship.replace(async_state_copy=True)):
        assert not Mamba3StepKernel(spec).pinned_loads, spec
