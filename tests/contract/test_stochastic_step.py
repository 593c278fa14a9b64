"""Stochastic rounding through the step's entry points, on the CPU path (docs/contract.md,
"Stochastic rounding").

* named errors for every bad use, and a refused call changes nothing;
* the same seed and offset give the same bits, another offset other bits; the bits follow the
  row written, not the lane; T tokens equal T one-token steps at offsets offset + t;
* the stored state is unbiased: its mean over many offsets is the fp32 new state (a statistical
  test with a stated false-failure rate);
* the op and a plan run it like ``mamba3_step_fn``; without it nothing changes.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers import assert_refused_and_unchanged, check_pool_parity, clone_inputs

from mamba3_step import mamba3_step_fn, mamba3_step_op, plan_step
from mamba3_step.reference import step_math
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits, bits_equal, make_inputs, padded_indices, speculative_indices
from mamba3_step.validation import check_step_inputs

H, D, N, R = 2, 32, 32, 2
SEED = torch.tensor([987654321, 5], dtype=torch.int64)
IDX = torch.tensor([3, -1, 0], dtype=torch.int32)


def _inputs(state="bfloat16", B=3, P=5, seed=0, tokens=None):
    return make_inputs(B, P, H, D, N, R, dtypes=dict(state_dtype=state), tokens=tokens, seed=seed)


#: (what, changes to the call, exception, message start)
BAD = [
    ("fp32 state", dict(state_dtype="float32"), ValueError, "stochastic_rounding: expected a 16- or 8-bit state"),
    ("no rand_seed", dict(rand_seed=None), ValueError, "rand_seed: expected an int64 tensor"),
    ("rand_seed without the flag", dict(stochastic_rounding=False), ValueError,
     "rand_seed: expected None without stochastic_rounding"),
    ("rand_seed int32", dict(rand_seed=SEED.int()), TypeError, "rand_seed: expected dtype int64"),
    ("rand_seed (3,)", dict(rand_seed=torch.zeros(3, dtype=torch.int64)), ValueError, "rand_seed: expected shape"),
    ("rand_seed (1, 2)", dict(rand_seed=SEED.view(1, 2)), ValueError, "rand_seed"),
    ("flag not a bool", dict(stochastic_rounding=1), TypeError, "stochastic_rounding"),
    ("rand_rows in pool mode", dict(rand_rows=torch.zeros(3, dtype=torch.int32)), ValueError,
     "rand_rows: expected None except in dense mode"),
]


@pytest.mark.parametrize("entry", ["fn", "op"])
@pytest.mark.parametrize("what, change, exc, message", BAD, ids=[b[0] for b in BAD])
def test_bad_stochastic_rounding_is_refused_by_name_and_changes_nothing(what, change, exc, message, entry):
    change = dict(change)
    inputs = _inputs(change.pop("state_dtype", "bfloat16"))
    call = {**inputs, "rand_seed": SEED.clone(), "stochastic_rounding": True, **change}
    fn = mamba3_step_fn if entry == "fn" else mamba3_step_op
    assert_refused_and_unchanged(what, fn, call, inputs, exc, message, state_batch_indices=IDX)


def _step(inputs, seed=SEED, **kw):
    t = clone_inputs(inputs)
    out = mamba3_step_fn(**t, rand_seed=seed.clone(), stochastic_rounding=True, update_kv_state=True, **kw)
    return out, t


@pytest.mark.parametrize("state", ["bfloat16", "float16"])
def test_seed_offset_row_and_lane_rules(state):
    inputs = _inputs(state, seed=3)
    _, a = _step(inputs, state_batch_indices=IDX)
    _, b = _step(inputs, state_batch_indices=IDX)
    assert bits_equal(a["state"], b["state"]), "the same seed and offset must give the same bits"
    _, c = _step(inputs, seed=SEED + torch.tensor([0, 1]), state_batch_indices=IDX)
    _, d = _step(inputs, seed=SEED + torch.tensor([1, 0]), state_batch_indices=IDX)
    for other in (c, d):
        assert not bits_equal(other["state"][3], a["state"][3]), "another seed or offset drew the same bits"
    swapped = {k: (v.flip(0) if k in ("A", "B", "C", "x", "dt", "trap", "z") else v) for k, v in inputs.items()}
    _, e = _step(swapped, state_batch_indices=IDX.flip(0))
    for row in (0, 3):
        assert bits_equal(e["state"][row], a["state"][row]), f"row {row}'s bits depend on its lane"
    nearest = clone_inputs(inputs)
    mamba3_step_fn(**nearest, state_batch_indices=IDX, update_kv_state=True)
    assert not bits_equal(nearest["state"], a["state"])
    for row in (1, 2, 4):  # rows no lane writes keep their bits
        assert bits_equal(a["state"][row], inputs["state"][row])


@pytest.mark.parametrize("state", ["bfloat16", "float16", "int8", "float8_e4m3fn"])
def test_t_tokens_equal_t_one_token_steps_at_offset_plus_t(state):
    """For 8-bit states (docs/contract.md, "8-bit states") the codes and the scales."""
    T, B = 3, 2
    inputs = _inputs(state, B=B, P=B * T, seed=5, tokens=T)
    src = torch.arange(0, B * T, T, dtype=torch.int32)
    dst = (src[:, None] + torch.arange(T, dtype=torch.int32)).contiguous()
    out_t, together = _step(inputs, state_batch_indices=src, dst_state_batch_indices=dst)
    one, rows = clone_inputs(inputs), src
    for t in range(T):
        per_token = {k: (v[:, t] if k in ("A", "B", "C", "x", "dt", "trap", "z") else v) for k, v in one.items()}
        out_1 = mamba3_step_fn(**per_token, state_batch_indices=rows, dst_state_batch_indices=dst[:, t].contiguous(),
                               update_kv_state=True, stochastic_rounding=True,
                               rand_seed=SEED + torch.tensor([0, t]))
        assert bits_equal(out_1, out_t[:, t]), t
        rows = dst[:, t].contiguous()
    assert bits_equal(together["state"], one["state"])
    if "state_scale" in inputs:
        assert bits_equal(together["state_scale"], one["state_scale"])


@pytest.mark.parametrize("state", ["bfloat16", "float16"])
def test_the_stored_state_is_unbiased(state):
    """K draws (offsets 0..K-1) of one dense step: for every element the mean stored value is the
    fp32 new state within 5.5 standard errors of a two-point draw (sigma <= ulp / (2 sqrt(K))).
    False failures: at most 4e-8 per element, 1e-4 for the 2048 elements (D 32 x N 64) (Gaussian tails; the
    sum of K Bernoulli draws with K = 400 is close to normal)."""
    K = 400
    inputs = make_inputs(1, None, 1, 32, 64, 1, dtypes=dict(state_dtype=state), seed=11)
    t = StepTensors(**inputs)
    new, _ = step_math(t)
    lo = new.to(inputs["state"].dtype).float()  # a grid point next to each value
    total = torch.zeros_like(new, dtype=torch.float64)
    for k in range(K):
        s = clone_inputs(inputs)
        mamba3_step_fn(**s, stochastic_rounding=True, rand_seed=torch.tensor([77, k], dtype=torch.int64))
        total += s["state"].double()
    mean = total / K
    ulp = torch.finfo(inputs["state"].dtype).eps * torch.maximum(lo.abs(), new.abs()).double()
    bound = 5.5 * ulp / (2 * math.sqrt(K)) + 1e-30
    assert bool(((mean - new.double()).abs() <= bound).all()), float(((mean - new.double()).abs() / ulp).max())


@pytest.mark.parametrize("state", ["bfloat16", "float16", "int8", "float8_e4m3fn"])
def test_pool_mode_is_gather_dense_scatter_with_the_rows_drawn_for(state):
    inputs = dict(_inputs(state, B=8, P=12, seed=21), rand_seed=SEED.clone())
    src, dst, kinds = padded_indices(8, 12, null_slot_id=2, with_dst=True, layout="interleaved", seed=21)
    step = functools.partial(mamba3_step_fn, stochastic_rounding=True)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=2, update_kv_state=True, step_fn=step)
    T = 3
    inputs = dict(_inputs(state, B=5, P=20, seed=22, tokens=T), rand_seed=SEED.clone())
    src, nat, dst, kinds = speculative_indices(5, 20, T, null_slot_id=2, seed=22)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=2, update_kv_state=True, num_accepted_tokens=nat,
                      step_fn=step)


def test_dense_rand_rows_draw_for_the_rows_named():
    inputs = _inputs(B=3, P=None, seed=23)
    rows = torch.tensor([7, 0, 2], dtype=torch.int32)
    _, dense = _step(inputs, rand_rows=rows)
    pool = make_inputs(3, 8, H, D, N, R, dtypes=dict(state_dtype="bfloat16"), seed=23)
    pool["state"][rows.long()] = inputs["state"]
    pool["Bstate"][rows.long()] = inputs["Bstate"]
    pool["Xstate"][rows.long()] = inputs["Xstate"]
    rows_of_pool = {k: pool[k] for k in ("state", "Bstate", "Xstate")}
    _, pooled = _step(dict(inputs, **rows_of_pool), state_batch_indices=rows)
    assert bits_equal(dense["state"], pooled["state"][rows.long()])
    _, plain = _step(inputs)
    assert not bits_equal(plain["state"], dense["state"])


def test_op_and_plan_run_it_like_the_function_and_without_it_nothing_changes():
    inputs = _inputs(seed=9)
    want, ref = _step(inputs, state_batch_indices=IDX)
    t = clone_inputs(inputs)
    got = mamba3_step_op(**t, rand_seed=SEED.clone(), stochastic_rounding=True, update_kv_state=True,
                         state_batch_indices=IDX)
    assert bits_equal(got, want) and bits_equal(t["state"], ref["state"])
    t = clone_inputs(inputs)
    plan = plan_step(**t, rand_seed=SEED.clone(), stochastic_rounding=True, update_kv_state=True,
                     state_batch_indices=IDX)
    assert plan.spec.stochastic_rounding
    got = plan.run(**t, rand_seed=SEED.clone(), state_batch_indices=IDX)
    assert bits_equal(got, want) and bits_equal(t["state"], ref["state"])
    spec = check_step_inputs(StepTensors(**inputs, state_batch_indices=IDX), update_kv_state=True)
    assert spec == StepSpec(N, D, R, "bfloat16", pool=True, update_kv_state=True).with_default_tiling()
    assert "stochastic" not in spec.key()
    assert bits(ref["state"]).dtype == torch.int16


def test_decode_step_advances_the_offset_by_t():
    from mamba3_step.serving import StatePool, decode_step
    from mamba3_step.testing import lane_inputs, layer_weights
    pool = StatePool(1, 6, H, D, N, R, state_dtype="bfloat16")
    slots = pool.alloc(2).to(torch.int32)
    weights = layer_weights(H, D, R)
    seed = SEED.clone()
    for T, after in ((None, 6), (3, 9)):
        before = [t.clone() for t in pool.layer_tensors(0)]
        lanes = lane_inputs(2, H, D, N, R, tokens=T)
        want = [t.clone() for t in before]
        mamba3_step_fn(*want, **lanes, **weights, state_batch_indices=slots, update_kv_state=True,
                       stochastic_rounding=True, rand_seed=seed.clone())
        decode_step(pool, 0, slots, **lanes, **weights, stochastic_rounding=True, rand_seed=seed)
        assert seed.tolist() == [int(SEED[0]), after]
        assert bits_equal(pool.state(0), want[0])
    with pytest.raises(ValueError, match="tile_D"):  # refused: the offset stays
        decode_step(pool, 0, slots, **lane_inputs(2, H, D, N, R), **weights, stochastic_rounding=True,
                    rand_seed=seed, tile_D=7)
    assert seed.tolist() == [int(SEED[0]), 9]


def test_the_graph_runner_takes_the_seed_at_construction_and_advances_it():
    from mamba3_step.serving import CudaGraphStepRunner, StatePool
    from mamba3_step.testing import lane_inputs, layer_weights
    pool = StatePool(1, 6, H, D, N, R, state_dtype="float16")
    slots = pool.alloc(3).to(torch.int32)
    weights = layer_weights(H, D, R)
    seed = SEED.clone()
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), **weights, stochastic_rounding=True, rand_seed=seed)
    for step in range(2):
        lanes = lane_inputs(3, H, D, N, R)
        want = [t.clone() for t in pool.layer_tensors(0)]
        out_want = mamba3_step_fn(*want, **lanes, **weights, state_batch_indices=slots, update_kv_state=True,
                                  stochastic_rounding=True, rand_seed=seed.clone())
        out = runner.step(slots, **lanes)
        assert bits_equal(out, out_want) and bits_equal(pool.state(0), want[0]), step
    assert seed.tolist() == [int(SEED[0]), int(SEED[1]) + 2]
    with pytest.raises(ValueError, match="rand_seed: expected an int64 tensor"):
        CudaGraphStepRunner(pool, 0, buckets=(4,), **weights, stochastic_rounding=True).step(
            slots, **lane_inputs(3, H, D, N, R))
