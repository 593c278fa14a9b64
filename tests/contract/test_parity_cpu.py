"""Pool mode is byte-identical to gather -> dense -> scatter, on the CPU path (docs/contract.md, "Parity").

Every case uses fresh random data, pools whose rows no live lane reads are poisoned with random
bits (NaN/inf included), and an ``out`` poisoned before the call; ``helpers.check_pool_parity``
then checks bit for bit:

* ``out`` equals the dense step's ``out`` for live lanes and is exactly +0.0 for padding lanes;
* every pool row a live lane writes equals the scattered dense result (state, and with
  ``update_kv_state`` the B/x rows);
* every other row of ``state``, ``Bstate`` and ``Xstate`` is unchanged, and so are the inputs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import (PAD_KINDS, POOL_STATE_KEYS, assert_bits_equal, check_pool_parity, clone_inputs, gather_dense_scatter, make_inputs, make_pool_indices)

from mamba3_step import mamba3_step_fn

# Regime edges:
#   B=1   a single lane (the smallest launch);       B=5   odd, below any vector/warp width;
#   B=32  exactly one warp's worth of lanes;          B=257 one past a typical 256-lane graph bucket.
#   P=37  a small prime pool, smaller than B=257: most of that batch must be padding and live
#         lanes use up the pool;   P=1000 a pool much larger than any batch (sparse rows).
BATCHES = (1, 5, 32, 257)
POOLS = (37, 1000)
# Dtype configurations cycled over the cases: the flagship (fp32 state, bf16 B/x/z/proj),
# all-fp32, and half states with mixed fp16/bf16 groups (every group's cast path).
DTYPE_CONFIGS = (
    dict(state_dtype="float32", kv_dtype="bfloat16", x_dtype="bfloat16", proj_dtype="bfloat16"),
    dict(state_dtype="float32", kv_dtype="float32", x_dtype="float32", proj_dtype="float32"),
    dict(state_dtype="bfloat16", kv_dtype="float16", x_dtype="float16", proj_dtype="float32"),
    dict(state_dtype="float16", kv_dtype="bfloat16", x_dtype="float32", proj_dtype="float16"),
)


def run_parity_case(
    B, P, *, update_kv_state, with_dst, layout, pad_kinds, null_slot_id, n_pad, seed,
    H=2, D=32, N=32, R=2, has_z=True, has_outproj=True, dtypes=DTYPE_CONFIGS[0],
):
    """Build inputs and indices for one case and assert bitwise parity (see check_pool_parity)."""
    inputs = make_inputs(B, P, H, D, N, R, has_z=has_z, has_outproj=has_outproj, seed=seed, dtypes=dtypes)
    src, dst, kinds = make_pool_indices(
        B, P, n_pad=n_pad, layout=layout, pad_kinds=pad_kinds, null_slot_id=null_slot_id,
        with_dst=with_dst, seed=seed,
    )
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=null_slot_id,
                      update_kv_state=update_kv_state, seed=seed)
    return kinds


_CASES = list(itertools.product(BATCHES, POOLS, (False, True), (False, True), ("trailing", "interleaved")))


@pytest.mark.parametrize("B,P,update_kv_state,with_dst,layout", _CASES)
def test_pool_matches_gather_dense_scatter(B, P, update_kv_state, with_dst, layout):
    # All three padding kinds mixed in one batch; null slot 0 (the common null-block convention).
    # About a third of the lanes are padding, at least one of each kind from B=5 on
    # (B=1: none; see the all-padding test below).
    case = _CASES.index((B, P, update_kv_state, with_dst, layout))
    seed = 1000 + case
    dtypes = DTYPE_CONFIGS[case % len(DTYPE_CONFIGS)]
    kinds = run_parity_case(
        B, P, update_kv_state=update_kv_state, with_dst=with_dst, layout=layout,
        pad_kinds=PAD_KINDS, null_slot_id=0, n_pad=0 if B == 1 else max(3, B // 3), seed=seed, dtypes=dtypes,
    )
    assert any(k in ("live", "live_nodst") for k in kinds)
    if B >= 5:
        assert set(PAD_KINDS) <= set(kinds)


@pytest.mark.parametrize("pad_kind", PAD_KINDS)
@pytest.mark.parametrize("layout", ("trailing", "interleaved"))
@pytest.mark.parametrize("B,P", [(5, 37), (32, 1000), (257, 37)])
def test_each_padding_kind_alone(pad_kind, layout, B, P):
    # One padding kind at a time, so a bug special to one kind cannot hide behind another.
    # The null slot is a middle row here (not 0) to show it is just a value.
    null_slot_id = 17 if pad_kind == "null" else None
    run_parity_case(
        B, P, update_kv_state=True, with_dst=True, layout=layout, pad_kinds=(pad_kind,),
        null_slot_id=null_slot_id, n_pad=max(1, B // 2), seed=B * 31 + P,
    )


@pytest.mark.parametrize("B", BATCHES)
def test_all_lanes_padding(B):
    # Edge: nothing is live. out is all zeros and no pool row changes.
    kinds = run_parity_case(
        B, 37, update_kv_state=True, with_dst=True, layout="interleaved", pad_kinds=PAD_KINDS,
        null_slot_id=5, n_pad=B, seed=B,
    )
    assert all(k in PAD_KINDS for k in kinds)


@pytest.mark.parametrize("has_z,has_outproj", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("N,D,R", [(32, 32, 1), (64, 64, 4), (256, 32, 8), (128, 128, 2)])
def test_parity_across_shapes_and_optional_inputs(has_z, has_outproj, N, D, R):
    # Without z / outproj (out is then (B, R, H, D)), and at the supported N/D/R extremes.
    run_parity_case(
        9, 23, update_kv_state=True, with_dst=True, layout="interleaved", pad_kinds=PAD_KINDS,
        null_slot_id=3, n_pad=3, seed=N + D + R, H=3, D=D, N=N, R=R, has_z=has_z,
        has_outproj=has_outproj, dtypes=DTYPE_CONFIGS[R % len(DTYPE_CONFIGS)],
    )


def test_pool_rows_shared_by_readers():
    # Prefix caching fan-out: several live lanes read one cached row and write their own rows.
    inputs = make_inputs(4, 8, seed=11)
    src = torch.tensor([2, 2, 2, -1], dtype=torch.int32)
    dst = torch.tensor([5, 6, 7, 2], dtype=torch.int32)
    expected = gather_dense_scatter(inputs, src, dst, update_kv_state=True)
    pooled = clone_inputs(inputs)
    out = mamba3_step_fn(**pooled, state_batch_indices=src, dst_state_batch_indices=dst,
                         update_kv_state=True, validate_indices=True)
    assert_bits_equal(out, expected["out"], "out")
    for key in POOL_STATE_KEYS:
        assert_bits_equal(pooled[key], expected[key], key)
    # The three readers of one row got different outputs only through their own per-lane inputs:
    # rows 5, 6, 7 now differ from each other and row 2 (read, not written) is unchanged.
    assert_bits_equal(pooled["state"][2], inputs["state"][2], "shared source row")
    assert not torch.equal(pooled["state"][5], pooled["state"][6])
