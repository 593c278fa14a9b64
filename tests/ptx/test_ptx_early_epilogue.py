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
import torch
from async_state_cases import ASYNC_DEFAULT as DEFAULT, ASYNC_FULL as FULL, prepared_call
from test_kernel_compile import COVERING

from mamba3_step.kernel.step import Mamba3StepKernel
from mamba3_step.spec import StepSpec, flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal
from mamba3_step.tiling import EARLY_EPILOGUE_WARPS
from mamba3_step.tools.ptx_tier import run_step_ptx

#: the tensors a step may write, compared bit for bit between the two layouts
WRITTEN = ("out", "state", "state_out", "Bstate", "Xstate", "angle_state", "state_scale")

CASES = [pytest.param(name, id=name) for name in DEFAULT] + [
    pytest.param(name, id=name, marks=pytest.mark.full_matrix) for name in FULL]


def _spec(name: str) -> StepSpec:
    return {**DEFAULT, **FULL}[name].with_default_tiling()


def _clone(tensors: StepTensors) -> StepTensors:
    return StepTensors(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors._asdict().items()})


@pytest.mark.parametrize("name", CASES)
def test_the_early_epilogue_writes_the_late_layouts_bits(name):
    spec = _spec(name)
    tensors, _ = prepared_call(spec, B=6, seed=23)
    default, late = _clone(tensors), _clone(tensors)
    run_step_ptx(spec, default, record=False)
    run_step_ptx(spec.replace(late_epilogue=True), late, record=False)
    compared = 0
    for key in WRITTEN:
        a, b = getattr(default, key, None), getattr(late, key, None)
        if a is None:
            continue
        assert bits_equal(a, b), f"{name}: {key} differs between the early and the late epilogue"
        compared += 1
    assert compared >= 2
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
