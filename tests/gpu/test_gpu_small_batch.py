"""The register kernel's small-batch forms on a GPU (skipped without CUDA): update_kv_state with the D split over a
cluster of 2 and 4 CTAs a (lane, head) (tile_D 32 and 16: ``tiling.launch_cluster``) and programmatic dependent
launch (``StepSpec.programmatic_launch``), alone and with the split, write the bits of the whole-head kernel users
run by default, for the flagship's state forms at every padding kind (tests/ptx/test_ptx_kv_cluster.py and
test_ptx_programmatic.py execute the same forms' PTX on the CPU)."""

from __future__ import annotations

import pytest
import torch
from async_state_cases import STATE_FORMS, assert_same_writes, prepared_call, run_each

from mamba3_step.spec import flagship_spec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("form", list(STATE_FORMS))
@pytest.mark.parametrize("B", [1, 5])
@pytest.mark.parametrize("tile_D, programmatic", [(32, False), (16, False), (64, True), (16, True)],
                         ids=["split2", "split4", "programmatic", "split4-programmatic"])
def test_the_small_batch_forms_write_the_whole_heads_bits_on_the_gpu(form, B, tile_D, programmatic):
    spec = flagship_spec(**STATE_FORMS[form]).with_default_tiling()
    tensors, _ = prepared_call(spec, B, seed=B + tile_D, device="cuda")
    small = spec.replace(tile_D=tile_D, programmatic_launch=programmatic)
    whole, other = run_each(tensors, spec, small)
    assert assert_same_writes(whole, other, f"{form} B={B}: tile_D={tile_D}, programmatic={programmatic}") >= 4
