"""The epilogue's operands loaded early (``StepSpec.early_epilogue``), executed: its PTX run on the CPU
beside the register kernel users get by default.

Loading D, z, zproj and outproj at the token's start instead of after the update changes when they
are read, not what is computed, so for each specialisation both kernels run on the same fresh random
inputs (poisoned ``out``, every padding kind in the batch) and everything they write must be the same
bits. The covering set, one multi-token, one rotary, one stochastic-rounding and one 8-bit
specialisation run by default; every multi-token, rotary, stochastic and 8-bit one with
``--full-matrix`` (among them tilings whose epilogue rows do not fill the block, and two rows a thread).
"""

from __future__ import annotations

import pytest
import torch
from async_state_cases import ASYNC_DEFAULT as DEFAULT, ASYNC_FULL as FULL, prepared_call

from mamba3_step.spec import StepSpec, flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal
from mamba3_step.tools.ptx_tier import run_step_ptx

#: the tensors a step may write, compared bit for bit between the two kernels
WRITTEN = ("out", "state", "state_out", "Bstate", "Xstate", "angle_state", "state_scale")

CASES = [pytest.param(name, id=name) for name in DEFAULT] + [
    pytest.param(name, id=name, marks=pytest.mark.full_matrix) for name in FULL]


def _spec(name: str) -> StepSpec:
    return {**DEFAULT, **FULL}[name].with_default_tiling()


def _clone(tensors: StepTensors) -> StepTensors:
    return StepTensors(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors._asdict().items()})


@pytest.mark.parametrize("name", CASES)
def test_the_early_epilogue_writes_the_register_kernels_bits(name):
    spec = _spec(name)
    tensors, _ = prepared_call(spec, B=6, seed=23)
    default, early = _clone(tensors), _clone(tensors)
    run_step_ptx(spec, default, record=False)
    run_step_ptx(spec.replace(early_epilogue=True), early, record=False)
    compared = 0
    for key in WRITTEN:
        a, b = getattr(default, key, None), getattr(early, key, None)
        if a is None:
            continue
        assert bits_equal(a, b), f"{name}: {key} differs between the register kernel and its early epilogue"
        compared += 1
    assert compared >= 2
    assert not bits_equal(default.out, tensors.out), f"{name}: the step wrote nothing to out"


def test_a_replay_step_ignores_the_early_epilogue():
    """A replay step's epilogue is not the token loop's: the knob leaves its kernel as it is."""
    from mamba3_step.kernel.step import Mamba3StepKernel

    spec = flagship_spec(replay_ring=2)
    assert Mamba3StepKernel(spec.replace(early_epilogue=True)).early_epilogue is False
    assert Mamba3StepKernel(flagship_spec(early_epilogue=True)).early_epilogue is True
