"""Property-based parity (hypothesis): on every draw of shapes, dtypes, pool size, options and a
per-lane index pattern (live, live with a padding destination, and every kind of padding, in any
order), pool mode is bit-identical to gather -> dense -> scatter, padding lanes' out is zero and
every row no live lane writes is unchanged (``helpers.check_pool_parity``)."""

from __future__ import annotations

from helpers import LANE_KINDS, build_pool_indices, check_pool_parity, make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mamba3_step.contract import KV_DTYPES, PROJ_DTYPES, STATE_DTYPES, X_DTYPES
from mamba3_step.contract import SUPPORTED_D, SUPPORTED_N, SUPPORTED_R


@st.composite
def pool_cases(draw):
    P = draw(st.integers(1, 48))
    B = draw(st.integers(0, 40))
    null_slot_id = draw(st.one_of(st.none(), st.integers(0, P - 1), st.sampled_from([-1, P])))
    kinds = draw(st.lists(st.sampled_from(LANE_KINDS), min_size=B, max_size=B))
    if null_slot_id is None:
        kinds = ["negative" if k == "null" else k for k in kinds]
    return dict(
        B=B,
        P=P,
        H=draw(st.integers(1, 3)),
        D=draw(st.sampled_from(SUPPORTED_D)),
        N=draw(st.sampled_from(SUPPORTED_N)),
        R=draw(st.sampled_from(SUPPORTED_R)),
        dtypes=dict(
            state_dtype=draw(st.sampled_from(STATE_DTYPES)),
            kv_dtype=draw(st.sampled_from(KV_DTYPES)),
            x_dtype=draw(st.sampled_from(X_DTYPES)),
            proj_dtype=draw(st.sampled_from(PROJ_DTYPES)),
        ),
        has_z=draw(st.booleans()),
        has_outproj=draw(st.booleans()),
        update_kv_state=draw(st.booleans()),
        with_dst=draw(st.booleans()),
        null_slot_id=null_slot_id,
        kinds=kinds,
        seed=draw(st.integers(0, 2**20)),
    )


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=pool_cases())
def test_pool_parity_property(case):
    inputs = make_inputs(case["B"], case["P"], case["H"], case["D"], case["N"], case["R"],
                         has_z=case["has_z"], has_outproj=case["has_outproj"], seed=case["seed"],
                         **case["dtypes"])
    src, dst, kinds = build_pool_indices(case["kinds"], case["P"], null_slot_id=case["null_slot_id"],
                                         with_dst=case["with_dst"], seed=case["seed"])
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=case["null_slot_id"],
                      update_kv_state=case["update_kv_state"], seed=case["seed"])
