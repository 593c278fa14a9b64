"""The epilogue's operands loaded early (the default of a 4- or 8-warp register kernel's stepwise tokens) on
a GPU (skipped without CUDA): the bits of the layout that loads them after the update
(``StepSpec.late_epilogue``), for the specialisations the PTX tier executes
(tests/ptx/test_ptx_early_epilogue.py) at every padding kind, the feature sets' other forms with
``--full-matrix``."""

from __future__ import annotations

import pytest
import torch
from async_state_cases import ASYNC_DEFAULT, ASYNC_FULL, prepared_call

from mamba3_step.launch import kernel_for
from mamba3_step.tensors import StepTensors, kernel_arguments
from mamba3_step.testing import bits_equal

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WRITTEN = ("out", "state", "state_out", "Bstate", "Xstate", "angle_state", "state_scale")
CASES = {**ASYNC_DEFAULT, **ASYNC_FULL}


@pytest.mark.parametrize("name", [*ASYNC_DEFAULT, *(pytest.param(n, marks=pytest.mark.full_matrix) for n in ASYNC_FULL)])
@pytest.mark.parametrize("B", [1, 37])
def test_the_early_epilogue_writes_the_late_layouts_bits_on_the_gpu(name, B):
    spec = CASES[name].with_default_tiling()
    tensors, _ = prepared_call(spec, B, seed=B + 3, device="cuda")
    runs = []
    for late in (False, True):
        t = StepTensors(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors._asdict().items()})
        kernel_for(spec.replace(late_epilogue=late), t.x)(*kernel_arguments(t))
        runs.append(t)
    torch.cuda.synchronize()
    for key in WRITTEN:
        a, b = (getattr(r, key, None) for r in runs)
        if a is not None:
            assert bits_equal(a, b), f"{name} B={B}: {key} differs between the early and the late epilogue"
