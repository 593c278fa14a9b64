"""The slab pipeline (``StepSpec.pipeline_ctas``) on a GPU (skipped without CUDA): the bits of the register kernel
users run by default, for the specialisations the PTX tier executes (tests/ptx/test_ptx_pipeline.py) at every
padding kind, with fewer persistent CTAs than slabs (each walks several) and with two per SM of the device; the
feature sets' other forms with ``--full-matrix``. The same check as the PTX tier's, where the copies really are
asynchronous."""

from __future__ import annotations

import pytest
import torch
from async_state_cases import assert_same_writes, case_params, case_spec, pipeline_spec, prepared_call, run_each


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name", case_params())
@pytest.mark.parametrize("B", [1, 37])
@pytest.mark.parametrize("per_sm", [0, 3], ids=["ctas5", "ctas3perSM"])
def test_the_pipeline_writes_the_register_kernels_bits_on_the_gpu(name, B, per_sm):
    spec = case_spec(name)
    ctas = per_sm * torch.cuda.get_device_properties(0).multi_processor_count if per_sm else 5
    tensors, _ = prepared_call(spec, B, seed=B, device="cuda")
    registers, piped = run_each(tensors, spec, pipeline_spec(spec, ctas))
    assert_same_writes(registers, piped, f"{name} B={B}, the register kernel and the slab pipeline ({ctas} CTAs)")
