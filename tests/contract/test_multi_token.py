"""Multi-token steps (speculative decoding's verify pass), on the CPU path: contract and refusals.

A T-token step is T one-token steps: token t's "previous B/x" is token t - 1's, the state carries
from token to token in its stored dtype, and the rows are written per token (a (B, T)
destination) or once at the end. Here the CPU path (the float32 reference) is held to T
one-token dense steps through ``mamba3_step.serving.gather_dense_scatter`` bit for bit, with
poisoned pools, every padding kind and both index layouts; the refusals of the new arguments
are named and change nothing; ``validate_indices`` finds races between lanes' per-token rows.
The executed kernel is held to the same definition in test_ptx_multi_token.py.

Letters: B lanes, T tokens, K candidate source rows, P pool rows, H heads, D head dim,
N state size, R MIMO rank.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_bits_equal, check_pool_parity, clone_inputs

from mamba3_step import mamba3_step_fn
from mamba3_step.spec import MAX_TOKENS
from mamba3_step.testing import bits_equal, make_inputs, padded_indices, speculative_indices

NULL = 3
SHAPE = dict(H=2, D=32, N=32, R=2)


def _spec_call(T: int, B: int = 7, *, layout: str = "shared", seed: int = 0) -> tuple[dict, dict, list]:
    P = B * 2 * T + 4
    inputs = make_inputs(B, P, **SHAPE, tokens=T, seed=seed)
    sbi, nat, dst, kinds = speculative_indices(B, P, T, null_slot_id=NULL, layout=layout, seed=seed)
    return inputs, dict(state_batch_indices=sbi, num_accepted_tokens=nat, dst_state_batch_indices=dst), kinds


@pytest.mark.parametrize("update_kv_state", [True, False])
@pytest.mark.parametrize("layout", ["shared", "separate"])
@pytest.mark.parametrize("T", range(1, 9))
def test_speculative_step_is_t_one_token_steps(T, layout, update_kv_state):
    inputs, idx, kinds = _spec_call(T, layout=layout, seed=T)
    check_pool_parity(inputs, idx["state_batch_indices"], idx["dst_state_batch_indices"], kinds,
                      num_accepted_tokens=idx["num_accepted_tokens"], null_slot_id=NULL,
                      update_kv_state=update_kv_state, seed=T)


@pytest.mark.parametrize("with_dst", [True, False])
def test_final_destination_step_is_t_one_token_steps(with_dst):
    """(B,) indices with a token axis: the state after the last token goes to dst (or src)."""
    B, P, T = 8, 20, 4
    inputs = make_inputs(B, P, **SHAPE, tokens=T, seed=11)
    src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, with_dst=with_dst, seed=2)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True, seed=4)


def test_dense_step_with_tokens_is_t_dense_steps():
    B, T = 3, 4
    inputs = make_inputs(B, None, **SHAPE, tokens=T, seed=5)
    got = clone_inputs(inputs)
    got["state_out"] = torch.empty_like(inputs["state"])
    out = mamba3_step_fn(**got)
    chained = clone_inputs(inputs)
    for t in range(T):
        token = {k: (v[:, t] if k in ("A", "B", "C", "x", "dt", "trap", "z") else v) for k, v in chained.items()}
        o = mamba3_step_fn(**token, update_kv_state=True)
        assert_bits_equal(out[:, t], o, f"out of token {t}")
    assert_bits_equal(got["state_out"], chained["state"], "state_out")
    for key in ("state", "Bstate", "Xstate"):  # state_out took the new state; nothing else is written
        assert_bits_equal(got[key], inputs[key], key)


def test_one_token_axis_is_the_plain_step_and_out_keeps_its_shape():
    B, P = 6, 12
    plain = make_inputs(B, P, **SHAPE, seed=8)
    sbi = torch.tensor([5, -1, 0, 9, NULL, 2], dtype=torch.int32)
    dst = torch.tensor([1, 4, 7, -1, 0, 11], dtype=torch.int32)
    a = clone_inputs(plain)
    out_a = mamba3_step_fn(**a, state_batch_indices=sbi, dst_state_batch_indices=dst, null_slot_id=NULL,
                           update_kv_state=True)
    b = clone_inputs(plain)
    for key in ("A", "B", "C", "x", "dt", "trap", "z"):
        b[key] = b[key].unsqueeze(1)
    out_b = mamba3_step_fn(**b, state_batch_indices=sbi, dst_state_batch_indices=dst.unsqueeze(1),
                           null_slot_id=NULL, update_kv_state=True)
    assert out_b.shape == (B, 1, SHAPE["H"], SHAPE["D"])
    assert_bits_equal(out_b[:, 0], out_a, "out")
    for key in ("state", "Bstate", "Xstate"):
        assert_bits_equal(b[key], a[key], key)


def test_accepted_count_picks_the_source_row():
    """Lane b continues from row state_batch_indices[b, num_accepted_tokens[b] - 1]: the same
    as a (B,) call on those rows."""
    B, P, T = 4, 30, 3
    inputs = make_inputs(B, P, **SHAPE, tokens=T, seed=12)
    sbi = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], dtype=torch.int32)
    nat = torch.tensor([3, 1, 2, 3], dtype=torch.int32)
    dst = torch.arange(12, 24, dtype=torch.int32).view(B, T)
    a = clone_inputs(inputs)
    out_a = mamba3_step_fn(**a, state_batch_indices=sbi, num_accepted_tokens=nat, dst_state_batch_indices=dst)
    b = clone_inputs(inputs)
    picked = sbi.gather(1, (nat.long() - 1).unsqueeze(1)).squeeze(1)
    out_b = mamba3_step_fn(**b, state_batch_indices=picked, dst_state_batch_indices=dst)
    assert bits_equal(out_a, out_b) and bits_equal(a["state"], b["state"])


# --------------------------------------------------------------------------- refusals
def _refusals():
    """(id, change to a valid T = 3 speculative call, exception, the argument the message names)."""
    def axis(t):
        return t[:, :1]

    return [
        ("x-5d", lambda kw: kw.update(x=kw["x"].unsqueeze(1)), ValueError, "x"),
        ("T-too-many", lambda kw: kw.update(
            **{k: torch.cat([kw[k]] * 6, 1) for k in ("A", "B", "C", "x", "dt", "trap", "z")}), ValueError, "x"),
        ("T-zero", lambda kw: kw.update(**{k: kw[k][:, :0] for k in ("A", "B", "C", "x", "dt", "trap", "z")}),
         ValueError, "x"),
        ("B-no-token-axis", lambda kw: kw.update(B=kw["B"][:, 0]), ValueError, "B"),
        ("C-other-T", lambda kw: kw.update(C=axis(kw["C"])), ValueError, "C"),
        ("dt-no-token-axis", lambda kw: kw.update(dt=kw["dt"][:, 0]), ValueError, "dt"),
        ("out-no-token-axis", lambda kw: kw.update(out=torch.empty(7, 2, 32, dtype=torch.bfloat16)), ValueError,
         "out"),
        ("dst-other-T", lambda kw: kw.update(dst_state_batch_indices=axis(kw["dst_state_batch_indices"])),
         ValueError, "dst_state_batch_indices"),
        ("nat-missing", lambda kw: kw.update(num_accepted_tokens=None), ValueError, "num_accepted_tokens"),
        ("nat-with-1d-src", lambda kw: kw.update(state_batch_indices=kw["state_batch_indices"][:, 0]), ValueError,
         "state_batch_indices"),
        ("nat-int64", lambda kw: kw.update(num_accepted_tokens=kw["num_accepted_tokens"].long()), TypeError,
         "num_accepted_tokens"),
        ("nat-2d", lambda kw: kw.update(num_accepted_tokens=kw["num_accepted_tokens"].unsqueeze(1)), ValueError,
         "num_accepted_tokens"),
        ("nat-other-B", lambda kw: kw.update(num_accepted_tokens=kw["num_accepted_tokens"][:3]), ValueError,
         "num_accepted_tokens"),
        ("K-zero", lambda kw: kw.update(state_batch_indices=kw["state_batch_indices"][:, :0]), ValueError,
         "state_batch_indices"),
        ("nat-dense", lambda kw: kw.update(state_batch_indices=None, dst_state_batch_indices=None, null_slot_id=None,
                                           state=kw["state"][:7], Bstate=kw["Bstate"][:7], Xstate=kw["Xstate"][:7]),
         ValueError, "num_accepted_tokens"),
        ("nat-not-a-tensor", lambda kw: kw.update(num_accepted_tokens=[1] * 7), TypeError, "num_accepted_tokens"),
        ("out-aliases-nat", lambda kw: kw.update(num_accepted_tokens=kw["out"].view(torch.int32).flatten()[:7]),
         ValueError, "out"),
    ]


@pytest.mark.parametrize("case", _refusals(), ids=lambda c: c[0])
def test_refusals_name_the_argument_and_change_nothing(case):
    _, change, exc, name = case
    inputs, idx, _ = _spec_call(3)
    kw = {**clone_inputs(inputs), **idx, "out": torch.zeros(7, 3, 2, 32, dtype=torch.bfloat16),
          "null_slot_id": NULL}
    mamba3_step_fn(**clone_inputs(kw), update_kv_state=True)  # the unchanged call is valid
    change(kw)
    before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc) as info:
        mamba3_step_fn(**kw, update_kv_state=True)
    assert str(info.value).startswith(f"{name}:") or f" {name}" in str(info.value), str(info.value)
    for key, value in before.items():
        assert bits_equal(kw[key], value), f"{key} changed by a refused call"


def test_token_count_limit_is_max_tokens():
    assert MAX_TOKENS == 16
    inputs, idx, _ = _spec_call(1)
    wide = {k: (torch.cat([v] * (MAX_TOKENS + 1), 1) if k in ("A", "B", "C", "x", "dt", "trap", "z") else v)
            for k, v in inputs.items()}
    with pytest.raises(ValueError, match=r"x: expected T .* in \[1, 16\], got T=17"):
        mamba3_step_fn(**wide)


# --------------------------------------------------------------------------- validate_indices
def _check(sbi, nat, dst, P=40):
    inputs = make_inputs(sbi.shape[0], P, **SHAPE, tokens=dst.shape[1] if dst is not None and dst.dim() == 2 else 2,
                         seed=1)
    return mamba3_step_fn(**inputs, state_batch_indices=sbi, num_accepted_tokens=nat, dst_state_batch_indices=dst,
                          validate_indices=True)


def _i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def test_validate_indices_accepts_the_shared_layout_and_one_lane_rewriting_a_row():
    inputs, idx, _ = _spec_call(4, layout="shared")
    P = inputs["state"].shape[0]
    sbi = idx["state_batch_indices"]
    ok = dict(idx, num_accepted_tokens=idx["num_accepted_tokens"].clamp(1, 4),  # count lanes: live, in [1, K]
              state_batch_indices=torch.where(sbi >= P, -1, sbi))  # oob lane: -1 (validate refuses >= P)
    mamba3_step_fn(**inputs, **ok, null_slot_id=NULL, validate_indices=True)
    # each lane writing its own source row (it reads before it writes)
    _check(_i32([[0, 1], [2, 3]]), _i32([2, 1]), _i32([[1, 4], [2, 3]]))


@pytest.mark.parametrize("dst,nat,what", [
    ([[4, 5], [6, 5]], [1, 1], "share a destination row"),  # two lanes write row 5 (different tokens)
    ([[4, 2], [6, 7]], [1, 1], "another live lane reads"),  # lane 0's token 1 writes lane 1's source
    ([[4, 4], [6, 7]], [1, 1], "write one row for two tokens"),
    ([[4, 5], [6, 7]], [3, 1], r"counts outside \[1, K=2\]"),
    ([[4, 5], [6, 7]], [1, 0], r"counts outside \[1, K=2\]"),
    ([[4, 5], [6, 7]], [1, -5], r"counts outside \[1, K=2\]"),
    ([[4, 40], [6, 7]], [1, 1], "indices >= P=40"),
])
def test_validate_indices_finds_races_between_lanes_tokens(dst, nat, what):
    with pytest.raises(ValueError, match=what):
        _check(_i32([[0, 1], [2, 3]]), _i32(nat), _i32(dst))


def test_validate_indices_ignores_the_destinations_of_padding_lanes():
    _check(_i32([[0, -1], [2, 3]]), _i32([2, 1]), _i32([[2, 2], [4, 5]]))  # lane 0 is padding: writes nothing
