"""The PyTorch reference: float64 against a loop-by-loop transcription of docs/contract.md, float32 against
float64, lane independence, and the in-place contract of dense and pool mode."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_bits_equal, clone_inputs, make_inputs, poison_

from mamba3_step import mamba3_step_fn
from mamba3_step.reference import mamba3_step_reference, step_math
from mamba3_step.tensors import StepTensors

MATH_KEYS = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj",
             "outproj", "z", "zproj")


def math_args(inputs: dict) -> dict:
    return {k: inputs[k] for k in MATH_KEYS}


def transcribe_spec(inp: dict):
    """docs/contract.md's math, written out loop by loop over plain Python floats (float64)."""

    def L(t):
        return None if t is None else t.double().tolist()

    state, Bs, Xs, A, Bm, Cm, Dv, x, dt, trap = (L(inp[k]) for k in (
        "state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap"))
    xproj, zproj, outproj, z = L(inp["xproj"]), L(inp["zproj"]), L(inp["outproj"]), L(inp["z"])
    nb, R, H, N = inp["B"].shape
    Dh = inp["x"].shape[2]
    new_state = [[[[0.0] * N for _ in range(Dh)] for _ in range(H)] for _ in range(nb)]
    out = []
    for b in range(nb):
        out_b = []
        for h in range(H):
            alpha = math.exp(A[b][h] * dt[b][h])
            beta = (1.0 - trap[b][h]) * dt[b][h] * alpha
            gamma = trap[b][h] * dt[b][h]
            xr = [[x[b][h][d] * xproj[r][h][d] for d in range(Dh)] for r in range(R)]
            xsr = [[Xs[b][h][d] * xproj[r][h][d] for d in range(Dh)] for r in range(R)]
            for d in range(Dh):
                for n in range(N):
                    acc = alpha * state[b][h][d][n]
                    for r in range(R):
                        acc += gamma * xr[r][d] * Bm[b][r][h][n]
                    for r in range(R):
                        acc += beta * xsr[r][d] * Bs[b][r][h][n]
                    new_state[b][h][d][n] = acc
            y = [[0.0] * Dh for _ in range(R)]
            for r in range(R):
                for d in range(Dh):
                    acc = 0.0
                    for n in range(N):
                        acc += new_state[b][h][d][n] * Cm[b][r][h][n]
                    y[r][d] = acc + Dv[h] * xr[r][d]
                    if z is not None:
                        v = z[b][h][d] * zproj[r][h][d]
                        y[r][d] *= v / (1.0 + math.exp(-v))
            if outproj is not None:
                out_b.append([sum(y[r][d] * outproj[r][h][d] for r in range(R)) for d in range(Dh)])
            else:
                out_b.append(y)  # [R][D] for this head
        out.append(out_b)
    ns = torch.tensor(new_state, dtype=torch.float64)
    o = torch.tensor(out, dtype=torch.float64)
    if outproj is None:
        o = o.permute(0, 2, 1, 3)  # (B, H, R, D) -> (B, R, H, D)
    return ns, o


@pytest.mark.parametrize("has_z,has_outproj", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("R", [1, 3])
def test_float64_matches_spec_transcription(has_z, has_outproj, R):
    # Tiny, odd sizes (step_math does not need supported shapes); R=1 has no sum over ranks.
    inp = make_inputs(3, None, H=2, D=5, N=7, R=R, has_z=has_z, has_outproj=has_outproj,
                      dtypes=dict(state_dtype="float32", kv_dtype="float32", x_dtype="float32",
                                  proj_dtype="float32"), seed=5 + R)
    ns, out = step_math(StepTensors(**math_args(inp)), compute_dtype=torch.float64)
    ns_ref, out_ref = transcribe_spec(inp)
    assert ns.dtype == out.dtype == torch.float64
    torch.testing.assert_close(ns, ns_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)


def _abs_inputs(inp: dict) -> dict:
    """Inputs whose every term in the math is >= the magnitude of the original's term.

    alpha, beta, gamma are already >= 0 (dt > 0, 0 <= trap < 1) and silu(|v|) >= |silu(v)|, so
    step_math on these gives an upper bound S of the sum of |terms| behind every output element.
    """
    return {k: (v if v is None or k in ("A", "dt", "trap") else v.double().abs())
            for k, v in math_args(inp).items()}


@pytest.mark.parametrize(
    "dtypes",
    [
        dict(state_dtype="float32", kv_dtype="bfloat16", x_dtype="bfloat16", proj_dtype="bfloat16"),
        dict(state_dtype="float32", kv_dtype="float32", x_dtype="float32", proj_dtype="float32"),
        dict(state_dtype="float16", kv_dtype="float16", x_dtype="float16", proj_dtype="float16"),
    ],
)
@pytest.mark.parametrize("N,D,R,has_z,has_outproj", [(128, 64, 4, True, True), (256, 32, 8, False, False),
                                                    (32, 128, 1, True, False)])
def test_float32_within_float32_rounding_of_float64(dtypes, N, D, R, has_z, has_outproj):
    # Same inputs, two compute dtypes. Error bound: k * eps32 * S elementwise, where S is the
    # sum of magnitudes of the terms (condition scale) and k covers the longest chain of
    # rounded operations (N products summed, 2R state updates, R output terms, exp/silu).
    inp = make_inputs(4, None, H=3, D=D, N=N, R=R, has_z=has_z, has_outproj=has_outproj, seed=N + R,
                      dtypes=dtypes)
    ns32, out32 = step_math(StepTensors(**math_args(inp)), compute_dtype=torch.float32)
    ns64, out64 = step_math(StepTensors(**math_args(inp)), compute_dtype=torch.float64)
    s_ns, s_out = step_math(StepTensors(**_abs_inputs(inp)), compute_dtype=torch.float64)
    eps = torch.finfo(torch.float32).eps
    k = N + 3 * R + 16
    assert ns32.dtype == out32.dtype == torch.float32
    err_ns = (ns32.double() - ns64).abs()
    err_out = (out32.double() - out64).abs()
    assert bool((err_ns <= k * eps * s_ns).all()), f"state error {float((err_ns / s_ns).max()):.3g} x S"
    assert bool((err_out <= k * eps * s_out).all()), f"out error {float((err_out / s_out).max()):.3g} x S"
    # ... and the bound is not vacuous: the float32 path really is float32, not float64.
    assert float(err_out.max()) > 0
    assert float((err_out / s_out).max()) < 4 * eps


def test_results_do_not_depend_on_batch_composition():
    # Each lane's bits depend only on its own inputs: alone, in a big batch, or permuted.
    # (Parity tests rely on it; H=17 mixes vectorised bodies and scalar tails in every op.)
    inp = make_inputs(41, None, H=17, D=32, N=64, R=2, seed=3)
    args = math_args(inp)
    per_lane = ("state", "Bstate", "Xstate", "A", "B", "C", "x", "dt", "trap", "z")
    ns, out = step_math(StepTensors(**args))
    perm = torch.randperm(41, generator=torch.Generator().manual_seed(0))
    ns_p, out_p = step_math(StepTensors(**{k: (v[perm] if k in per_lane else v) for k, v in args.items()}))
    assert_bits_equal(ns_p, ns[perm], "permuted state")
    assert_bits_equal(out_p, out[perm], "permuted out")
    for b in (0, 7, 40):
        ns1, out1 = step_math(StepTensors(**{k: (v[b:b + 1] if k in per_lane else v) for k, v in args.items()}))
        assert_bits_equal(ns1[0], ns[b], f"lane {b} alone: state")
        assert_bits_equal(out1[0], out[b], f"lane {b} alone: out")


@pytest.mark.parametrize("update_kv_state", [False, True])
@pytest.mark.parametrize("use_state_out", [False, True])
def test_dense_mode_in_place_contract(update_kv_state, use_state_out):
    inp = make_inputs(6, None, H=2, D=32, N=64, R=4, seed=21, dtypes=dict(state_dtype="bfloat16"))
    before = clone_inputs(inp)
    ns, y = step_math(StepTensors(**math_args(inp)))
    state_out = poison_(torch.empty_like(inp["state"])) if use_state_out else None
    out = poison_(torch.empty(6, 2, 32, dtype=inp["x"].dtype))
    ret = mamba3_step_fn(**inp, out=out, state_out=state_out, update_kv_state=update_kv_state)
    assert ret is out
    assert_bits_equal(out, y.to(out.dtype), "out")
    written = state_out if use_state_out else inp["state"]
    assert_bits_equal(written, ns.to(torch.bfloat16), "new state")
    if use_state_out:
        assert_bits_equal(inp["state"], before["state"], "state (state_out given)")
    if update_kv_state:
        assert_bits_equal(inp["Bstate"], before["B"], "Bstate <- B")
        assert_bits_equal(inp["Xstate"], before["x"], "Xstate <- x")
    else:
        assert_bits_equal(inp["Bstate"], before["Bstate"], "Bstate untouched")
        assert_bits_equal(inp["Xstate"], before["Xstate"], "Xstate untouched")


def test_update_kv_state_casts_into_the_state_dtype():
    # B/x in fp32, Bstate/Xstate must be the same dtype as B/x (validation) -- in dense mode the
    # stored rows are the inputs' bits; the step itself read the *old* Bstate/Xstate.
    inp = make_inputs(3, None, H=2, D=32, N=32, R=2, seed=8,
                      dtypes=dict(kv_dtype="float32", x_dtype="float32"))
    old = clone_inputs(inp)
    ns_old, y_old = step_math(StepTensors(**math_args(old)))
    out = mamba3_step_fn(**inp, update_kv_state=True)
    assert_bits_equal(out, y_old.to(out.dtype), "out computed from the old Bstate/Xstate")
    assert_bits_equal(inp["Bstate"], old["B"], "Bstate")
    assert_bits_equal(inp["Xstate"], old["x"], "Xstate")


def test_pool_mode_per_lane_semantics_float64():
    # Pool semantics checked lane by lane against step_math on single rows (not against the
    # reference's own gather), in float64, with every lane kind in one batch:
    # lane 0 live in place, 1 live with a separate dst, 2 negative padding, 3 null slot,
    # 4 >= P, 5 live whose dst is padding, 6 live reading a row nobody writes.
    P, null = 9, 4
    inp = make_inputs(7, P, H=2, D=32, N=32, R=2, seed=13,
                      dtypes=dict(state_dtype="float32", kv_dtype="float32", x_dtype="float32",
                                  proj_dtype="float32"))
    src = torch.tensor([1, 2, -1, null, P, 7, 8], dtype=torch.int32)
    dst = torch.tensor([1, 3, 0, 0, 5, -1, 6], dtype=torch.int32)
    pool = {k: inp[k].double() for k in ("state", "Bstate", "Xstate")}
    lane = {k: (None if inp[k] is None else inp[k].double()) for k in MATH_KEYS if k not in pool}
    before = {k: v.clone() for k, v in pool.items()}
    out = poison_(torch.empty(7, 2, 32, dtype=torch.float64))
    args = {**lane, **pool}
    mamba3_step_reference(StepTensors(**args, out=out, state_batch_indices=src, dst_state_batch_indices=dst,
                                      null_slot_id=null), update_kv_state=True, compute_dtype=torch.float64)
    per_lane = ("A", "B", "C", "x", "dt", "trap", "z")
    touched = set()
    for b in range(7):
        s, d = int(src[b]), int(dst[b])
        if b in (2, 3, 4):
            assert_bits_equal(out[b], torch.zeros_like(out[b]), f"lane {b} out")
            continue
        single = {k: (v[b:b + 1] if k in per_lane else v) for k, v in lane.items()}
        ns, y = step_math(StepTensors(**single, **{k: before[k][s:s + 1] for k in pool}), compute_dtype=torch.float64)
        assert_bits_equal(out[b], y[0], f"lane {b} out")
        if b == 5:
            continue
        touched.add(d)
        assert_bits_equal(pool["state"][d], ns[0], f"lane {b} state row {d}")
        assert_bits_equal(pool["Bstate"][d], lane["B"][b], f"lane {b} Bstate row {d}")
        assert_bits_equal(pool["Xstate"][d], lane["x"][b], f"lane {b} Xstate row {d}")
    for r in sorted(set(range(P)) - touched):
        for k in pool:
            assert_bits_equal(pool[k][r], before[k][r], f"{k} row {r} untouched")


def test_batch_zero_returns_without_touching_anything():
    inp = make_inputs(0, 5, seed=2)
    before = clone_inputs(inp)
    out = poison_(torch.empty(0, 2, 32, dtype=torch.bfloat16))
    ret = mamba3_step_fn(**inp, out=out, state_batch_indices=torch.empty(0, dtype=torch.int32),
                         update_kv_state=True)
    assert ret is out
    for k in ("state", "Bstate", "Xstate"):
        assert_bits_equal(inp[k], before[k], k)
    # Allocated out for B == 0 has the documented shape and dtype.
    ret = mamba3_step_fn(**make_inputs(0, None, seed=2, has_outproj=False))
    assert ret.shape == (0, 2, 2, 32) and ret.dtype == torch.bfloat16


def test_make_inputs_takes_a_dtypes_mapping_and_a_generator_as_seed():
    # The input factory the tests above rely on: a generator draws what its seed would, missing
    # dtypes take the defaults, an unknown dtype name is refused.
    a = make_inputs(2, 3, dtypes=dict(kv_dtype="float32"), seed=4)
    b = make_inputs(2, 3, dtypes=dict(kv_dtype="float32"), seed=torch.Generator().manual_seed(4))
    for k, v in a.items():
        if v is not None:
            assert_bits_equal(b[k], v, k)
    assert (a["state"].dtype, a["B"].dtype, a["x"].dtype, a["xproj"].dtype) == (
        torch.float32, torch.float32, torch.bfloat16, torch.bfloat16)
    with pytest.raises(TypeError, match="dtypes"):
        make_inputs(2, dtypes=dict(kvdtype="float32"))
