"""The epilogue's operands loaded early (the default of a 4- or 8-warp register kernel's stepwise tokens) on
a GPU (skipped without CUDA): the bits of the layout that loads them after the update
(``StepSpec.late_epilogue``), for the specialisations the PTX tier executes
(tests/ptx/test_ptx_early_epilogue.py) at every padding kind, the feature sets' other forms with
``--full-matrix``."""

from __future__ import annotations

import pytest
import torch
from async_state_cases import assert_same_writes, case_params, case_spec, prepared_call, run_each

from mamba3_step.launch import kernel_for
from mamba3_step.tensors import kernel_arguments

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name", case_params())
@pytest.mark.parametrize("B", [1, 37])
def test_the_early_epilogue_writes_the_late_layouts_bits_on_the_gpu(name, B):
    spec = case_spec(name)
    tensors, _ = prepared_call(spec, B, seed=B + 3, device="cuda")
    early, late = run_each(tensors, *(lambda t, s=s: kernel_for(s, t.x)(*kernel_arguments(t))
                                      for s in (spec, spec.replace(late_epilogue=True))))
    torch.cuda.synchronize()
    assert_same_writes(early, late, f"{name} B={B}, the early and the late epilogue")
