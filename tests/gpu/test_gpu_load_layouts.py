"""The register kernel's load layouts on a GPU (skipped without CUDA): the default (the first token's loads
pinned above their first use, the epilogue's operands loaded at the token's start) writes the bits of the
loads in the compiler's order (``StepSpec.unpinned_loads``) and of those with the epilogue's operands loaded
after the update (``StepSpec.late_epilogue``), for the specialisations the PTX tier executes
(tests/ptx/test_ptx_load_layouts.py) at every padding kind, the feature sets' other forms with
``--full-matrix``."""

from __future__ import annotations

import pytest
import torch
from async_state_cases import assert_same_writes, case_params, case_spec, prepared_call, run_each

from mamba3_step.spec import PREVIOUS_LOAD_LAYOUTS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name", case_params())
@pytest.mark.parametrize("B", [1, 37])
def test_the_default_layout_writes_the_previous_layouts_bits_on_the_gpu(name, B):
    spec = case_spec(name)
    tensors, _ = prepared_call(spec, B, seed=B + 3, device="cuda")
    default, *previous = run_each(tensors, spec, *(spec.replace(**fields) for fields in PREVIOUS_LOAD_LAYOUTS.values()))
    for layout, other in zip(PREVIOUS_LOAD_LAYOUTS, previous):
        assert_same_writes(default, other, f"{name} B={B}, the default and the {layout} layout")
