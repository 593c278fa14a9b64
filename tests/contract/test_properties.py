"""Property-based parity (hypothesis): on every draw of shapes, dtypes, pool size, options and a
per-lane index pattern (live, live with a padding destination, and every kind of padding, in any
order), pool mode is bit-identical to gather -> dense -> scatter, padding lanes' out is zero and
every row no live lane writes is unchanged (``helpers.check_pool_parity``). The same for T-token
steps (T in 1..8): (B, K) sources with accepted counts or (B,) sources, (B, T), (B,) or no
destinations, every padding kind in the source and in single tokens' destinations."""

from __future__ import annotations

import torch
from helpers import LANE_KINDS, build_pool_indices, check_pool_parity, make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mamba3_step.contract import KV_DTYPES, PROJ_DTYPES, SCALED_STATE_DTYPES, STATE_DTYPES, X_DTYPES
from mamba3_step.contract import SUPPORTED_D, SUPPORTED_N, SUPPORTED_R, source_rows
from mamba3_step.testing import speculative_indices


def _dtypes(draw) -> dict:
    """Storage dtypes; 8-bit states (stochastic rounding and scales) have their own tests
    (tests/ptx/test_ptx_8bit.py, tests/contract/test_eight_bit_step.py)."""
    return {name: draw(st.sampled_from(group)) for name, group in (
        ("state_dtype", [d for d in STATE_DTYPES if d not in SCALED_STATE_DTYPES]), ("kv_dtype", KV_DTYPES), ("x_dtype", X_DTYPES), ("proj_dtype", PROJ_DTYPES))}


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
        dtypes=_dtypes(draw),
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
                         dtypes=case["dtypes"])
    src, dst, kinds = build_pool_indices(case["kinds"], case["P"], null_slot_id=case["null_slot_id"],
                                         with_dst=case["with_dst"], seed=case["seed"])
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=case["null_slot_id"],
                      update_kv_state=case["update_kv_state"], seed=case["seed"])


_TOKEN_KINDS = ("live", "live_gaps", "count_zero", "count_over", "negative", "oob", "null")


@st.composite
def token_cases(draw):
    T = draw(st.integers(1, 8))
    B = draw(st.integers(0, 6))
    layout = draw(st.sampled_from(["shared", "separate"]))
    K = T if layout == "shared" else draw(st.integers(1, 8))
    null_slot_id = draw(st.one_of(st.none(), st.just(0)))
    kinds = draw(st.lists(st.sampled_from(_TOKEN_KINDS), min_size=B, max_size=B))
    if null_slot_id is None:
        kinds = ["negative" if k == "null" else k for k in kinds]
    return dict(
        T=T, B=B, K=K, layout=layout, null_slot_id=null_slot_id, kinds=kinds,
        P=B * (T + K) + 1 + draw(st.integers(0, 4)),
        H=draw(st.integers(1, 2)),
        D=draw(st.sampled_from(SUPPORTED_D)),
        N=draw(st.sampled_from(SUPPORTED_N[:3])),
        R=draw(st.sampled_from(SUPPORTED_R)),
        dtypes=_dtypes(draw),
        has_z=draw(st.booleans()),
        has_outproj=draw(st.booleans()),
        update_kv_state=draw(st.booleans()),
        form=draw(st.sampled_from(["accepted+per-token", "accepted+final", "plain+per-token", "plain+final",
                                   "plain+in-place"])),
        seed=draw(st.integers(0, 2**20)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=token_cases())
def test_multi_token_parity_property(case):
    """A T-token step (any T in 1..8, any index form and lane pattern) is bit-identical to T
    one-token dense steps on the gathered rows (gather -> T dense steps -> scatter)."""
    T, B = case["T"], case["B"]
    inputs = make_inputs(B, case["P"], case["H"], case["D"], case["N"], case["R"], has_z=case["has_z"],
                         has_outproj=case["has_outproj"], tokens=T, seed=case["seed"], dtypes=case["dtypes"])
    sbi, nat, dst, kinds = speculative_indices(B, case["P"], T, null_slot_id=case["null_slot_id"],
                                               layout=case["layout"], kinds=case["kinds"], K=case["K"],
                                               seed=case["seed"])
    accepted, target = case["form"].split("+")
    if accepted == "plain":  # (B,) sources: the accepted entry (a count outside [1, K] becomes -1)
        sbi, nat = source_rows(sbi, nat).to(torch.int32), None
        kinds = ["negative" if k in ("count_zero", "count_over") else k for k in kinds]
    dst = {"per-token": dst, "final": dst[:, -1].contiguous(), "in-place": None}[target]
    check_pool_parity(inputs, sbi, dst, kinds, num_accepted_tokens=nat, null_slot_id=case["null_slot_id"],
                      update_kv_state=case["update_kv_state"], seed=case["seed"])
