"""The asynchronous state copy (``StepSpec.async_state_copy``) on a GPU (skipped without CUDA): the
bits of the register kernel users run by default, for the specialisations the PTX tier executes
(tests/ptx/test_ptx_async_state.py) at every padding kind, the feature sets' other forms with
``--full-matrix``. The same check as the PTX tier's, where the copies really are asynchronous."""

from __future__ import annotations

import pytest
import torch
from async_state_cases import assert_same_writes, case_params, case_spec, prepared_call, run_each


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name", case_params())
@pytest.mark.parametrize("B", [1, 37])
def test_the_asynchronous_copy_writes_the_register_kernels_bits_on_the_gpu(name, B):
    spec = case_spec(name)
    tensors, _ = prepared_call(spec, B, seed=B, device="cuda")
    registers, copied = run_each(tensors, spec, spec.replace(async_state_copy=True))
    assert_same_writes(registers, copied, f"{name} B={B}, the register and the asynchronous-copy kernel")
