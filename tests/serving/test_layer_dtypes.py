"""Mamba3DecodeLayer's dtypes: what it cannot decode with is refused at construction, by name.

An 8-bit state needs a scale row per (slot, head, d) and a seed for its stochastic rounding; the
layer's pools (:class:`LayerPools`) and :meth:`Mamba3DecodeLayer.decode` carry neither, so such a
layer could never decode: it is refused when built, not at every decode.
"""

from __future__ import annotations

import pytest
import torch

from mamba3_step.layer import LayerDtypes, Mamba3DecodeLayer

SMALL = dict(d_model=64, d_state=32, headdim=32, mimo_rank=2)


@pytest.mark.parametrize("state", ["int8", "float8_e4m3fn"])
def test_an_eight_bit_state_is_refused_at_construction(state):
    with pytest.raises(TypeError, match=r"dtypes\.state: expected one of torch\.float32, torch\.bfloat16, "
                                        rf"torch\.float16 .*got torch\.{state}"):
        Mamba3DecodeLayer(**SMALL, dtypes=LayerDtypes.of(state=state))


@pytest.mark.parametrize("field, value", [("kv", torch.int8), ("x", torch.float64), ("proj", torch.int32)])
def test_other_dtypes_outside_the_steps_groups_are_refused_by_field(field, value):
    with pytest.raises(TypeError, match=rf"dtypes\.{field}: expected one of .*got {value}"):
        Mamba3DecodeLayer(**SMALL, dtypes=LayerDtypes()._replace(**{field: value}))


@pytest.mark.parametrize("bad", [("float32",) * 4, {"state": torch.float32}, "bf16"])
def test_dtypes_must_be_a_layer_dtypes(bad):
    with pytest.raises(TypeError, match="dtypes: expected a LayerDtypes"):
        Mamba3DecodeLayer(**SMALL, dtypes=bad)


@pytest.mark.parametrize("state", ["float32", "bfloat16", "float16"])
def test_every_accepted_state_dtype_decodes(state):
    """What construction accepts, decode runs: one token for two lanes and a padding lane."""
    layer = Mamba3DecodeLayer(**SMALL, dtypes=LayerDtypes.of(state=state)).randomize_()
    pools = layer.new_pools(3)
    hidden = torch.randn(3, SMALL["d_model"], generator=torch.Generator().manual_seed(1))
    out = layer.decode(hidden, pools, torch.tensor([0, 2, -1], dtype=torch.int32))
    assert out.shape == (3, SMALL["d_model"]) and bool(torch.isfinite(out).all())
    assert bool((out[2] == 0).all()) and bool((out[:2] != 0).any())
