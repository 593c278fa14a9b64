"""8-bit states with scales through the step's entry points, on the CPU path (docs/contract.md,
"8-bit states").

* named errors for every bad use, and a refused call changes nothing;
* the state is read as ``q * scale`` and stored by ``rounding.quantize_rows`` with the step's bits;
  untouched rows and padding keep every code and scale;
* T tokens equal T one-token steps at offsets offset + t (codes and scales, bit for bit:
  tests/contract/test_stochastic_step.py, with the 16-bit states);
* the stored state is unbiased: its mean over many offsets is the fp32 new state (a statistical
  test with a stated false-failure rate);
* the op and a plan run it like ``mamba3_step_fn`` (pool mode = gather -> dense -> scatter:
  tests/contract/test_stochastic_step.py, with the 16-bit states).

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_refused_and_unchanged, clone_inputs

from mamba3_step import mamba3_step_fn, mamba3_step_op, plan_step
from mamba3_step.reference import step_math
from mamba3_step.rounding import dequantize_rows, quantize_rows, state_bits
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, make_inputs

H, D, N, R = 2, 32, 32, 2
SEED = torch.tensor([987654321, 5], dtype=torch.int64)
IDX = torch.tensor([3, -1, 0], dtype=torch.int32)
FORMATS = ("int8", "float8_e4m3fn")


def _inputs(state="int8", B=3, P=5, seed=0, tokens=None):
    return make_inputs(B, P, H, D, N, R, dtypes=dict(state_dtype=state), tokens=tokens, seed=seed)


def _step(inputs, seed=SEED, **kw):
    t = clone_inputs(inputs)
    out = mamba3_step_fn(**t, rand_seed=seed.clone(), stochastic_rounding=True, update_kv_state=True, **kw)
    return out, t


#: (what, changes to the call, exception, message start)
BAD = [
    ("no state_scale", dict(state_scale=None), ValueError, "state_scale: expected a float32 tensor"),
    ("scale with a bf16 state", dict(state_dtype="bfloat16"), ValueError, "state_scale: expected None with a bfloat16"),
    ("without stochastic rounding", dict(stochastic_rounding=False, rand_seed=None), ValueError,
     "stochastic_rounding: expected True with a int8 state"),
    ("scale float64", dict(state_scale="float64"), TypeError, "state_scale: expected dtype float32"),
    ("scale (P, H)", dict(state_scale="short"), ValueError, "state_scale"),
    ("scale of other rows", dict(state_scale="rows"), ValueError, "state_scale"),
]


@pytest.mark.parametrize("entry", ["fn", "op"])
@pytest.mark.parametrize("what, change, exc, message", BAD, ids=[b[0] for b in BAD])
def test_bad_eight_bit_calls_are_refused_by_name_and_change_nothing(what, change, exc, message, entry):
    change = dict(change)
    inputs = _inputs("int8")
    if "state_dtype" in change:
        scale = inputs["state_scale"]
        inputs = dict(_inputs(change.pop("state_dtype")), state_scale=scale)
    kind = change.get("state_scale")
    if isinstance(kind, str):
        s = inputs["state_scale"]
        change["state_scale"] = {"float64": s.double(), "short": s[:, :, 0].contiguous(),
                                 "rows": s[:4].contiguous()}[kind]
    call = {**inputs, "rand_seed": SEED.clone(), "stochastic_rounding": True, **change}
    fn = mamba3_step_fn if entry == "fn" else mamba3_step_op
    assert_refused_and_unchanged(what, fn, call, inputs, exc, message, state_batch_indices=IDX)


def test_state_out_with_an_eight_bit_state_is_refused():
    inputs = _inputs("int8", P=None)
    out = torch.empty_like(inputs["state"])
    with pytest.raises(ValueError, match="state_out: expected None with a int8 state"):
        mamba3_step_fn(**inputs, state_out=out, rand_seed=SEED.clone(), stochastic_rounding=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_step_reads_q_times_scale_and_stores_quantize_rows(fmt):
    """The written rows are ``quantize_rows`` of the fp32 step on the dequantised rows, with the bits
    of the rows written; other rows keep every byte; out is the fp32 step's."""
    inputs = _inputs(fmt, seed=3)
    out, after = _step(inputs, state_batch_indices=IDX)
    live = torch.tensor([0, 2])
    rows = IDX[live].long()
    dense = StepTensors(**{k: v for k, v in inputs.items()})
    dense = dense.dense_lanes(live, rows)._replace(state=dequantize_rows(inputs["state"][rows],
                                                                        inputs["state_scale"][rows]))
    new, y = step_math(dense)
    bits = state_bits(int(SEED[0]), int(SEED[1]), rows, H, D, N)
    q, scale = quantize_rows(new, bits, fmt)
    assert bits_equal(after["state"][rows], q) and bits_equal(after["state_scale"][rows], scale)
    assert bits_equal(out[live], y.to(out.dtype)) and not bool(out[1].any())
    for row in (1, 2, 4):
        assert bits_equal(after["state"][row], inputs["state"][row])
        assert bits_equal(after["state_scale"][row], inputs["state_scale"][row])


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_stored_state_is_unbiased(fmt):
    """K draws (offsets 0..K-1) of one dense step: for every element the mean of ``q * scale`` is
    the fp32 new state within 5.5 standard errors of a two-point draw (a gap of at most one code
    step, ``scale`` for int8 and at most ``scale * 32`` for e4m3, whose steps near 448 are 32: sigma
    <= step / (2 sqrt(K))), plus the fp32 roundings of ``x * inv`` (a few 2**-24 relative). The
    scale is the same in every draw (it depends on the values alone). False failures: at most 4e-8
    per element, 1e-4 for the 2048 elements (Gaussian tails; K = 400)."""
    K = 400
    inputs = make_inputs(1, None, 1, 32, 64, 1, dtypes=dict(state_dtype=fmt), seed=11)
    t = StepTensors(**inputs)
    new, _ = step_math(t._replace(state=dequantize_rows(inputs["state"], inputs["state_scale"])))
    total = torch.zeros_like(new, dtype=torch.float64)
    for k in range(K):
        s = clone_inputs(inputs)
        mamba3_step_fn(**s, stochastic_rounding=True, rand_seed=torch.tensor([77, k], dtype=torch.int64))
        total += dequantize_rows(s["state"], s["state_scale"]).double()
    mean = total / K
    scale = s["state_scale"].double()[..., None]
    step = scale if fmt == "int8" else scale * torch.exp2(torch.floor(torch.log2((new.double() / scale).abs()
                                                                                    .clamp(min=2.0**-6))) - 3)
    bound = 5.5 * step / (2 * math.sqrt(K)) + 4 * 2.0**-24 * new.double().abs() + 1e-30
    assert bool(((mean - new.double()).abs() <= bound).all()), float(((mean - new.double()).abs() / step).max())


def test_op_and_plan_run_it_like_the_function():
    inputs = _inputs("float8_e4m3fn", seed=9)
    want, ref = _step(inputs, state_batch_indices=IDX)
    t = clone_inputs(inputs)
    got = mamba3_step_op(**t, rand_seed=SEED.clone(), stochastic_rounding=True, update_kv_state=True,
                         state_batch_indices=IDX)
    assert bits_equal(got, want) and bits_equal(t["state"], ref["state"])
    assert bits_equal(t["state_scale"], ref["state_scale"])
    t = clone_inputs(inputs)
    plan = plan_step(**t, rand_seed=SEED.clone(), stochastic_rounding=True, update_kv_state=True,
                     state_batch_indices=IDX)
    assert plan.spec.state_dtype == "float8_e4m3fn"
    got = plan.run(**t, rand_seed=SEED.clone(), state_batch_indices=IDX)
    assert bits_equal(got, want) and bits_equal(t["state_scale"], ref["state_scale"])
