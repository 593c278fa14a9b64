"""Stochastic rounding of 16-bit states, executed: the kernel's PTX run on the CPU (docs/ptx-tier.md).

For each of :data:`test_kernel_compile.STOCHASTIC` (bf16 and fp16 states; pool with every padding
kind and separate destinations; dense; a T = 4 speculative step):

1. given the same fp32 new state, the executed kernel stores the bits the CPU path stores, bit
   for bit, for the same seed and offset (``mamba3_step.rounding``'s rules: Philox4x32-10 bits
   per (row, head, d, 8 n), the rounding of the fp32 value). The inputs make every fp32 operation
   of the update exact or identically rounded in both (A = 0, so alpha = 1; trap = 1, so beta =
   0; a power-of-two dt; 16-bit B, x and projections, whose products are exact), so the fp32 new
   states agree and the stored bits must too. On general inputs the kernel's fp32 values can
   differ from the CPU path's in the last bit (exp, FMA contraction, order: as for nearest
   rounding), which flips a stochastic rounding with probability 2**-13 (fp16) or 2**-16 (bf16)
   per element: measured and bounded below;
2. the same with values that reach every branch of the rounding: fp16 subnormals and values
   below them, values next to the largest finite, signed zeros, inf and NaN;
3. another offset changes the stored bits; the bits follow the row, not the lane;
4. padding lanes read and write no state byte;
5. pool mode bit-identical to gather -> executed dense -> scatter, the dense steps drawing for the
   gathered rows (``rand_rows``).

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import PAD_KINDS, check_pool_parity, clone_inputs
from test_kernel_compile import STOCHASTIC

from mamba3_step import mamba3_step_fn
from mamba3_step.api import prepare_step
from ptx_executor import analysis
from mamba3_step.tools.ptx_tier import ptx_step_fn, run_step_ptx
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import inputs_for, padded_indices, speculative_indices, step_indices

NULL = 2
SEED = torch.tensor([0x0123456789ABCDEF, 2**40 + 17], dtype=torch.int64)


def sr_inputs(spec: StepSpec, B: int, P: int | None, seed: int) -> dict:
    """Fresh inputs for ``spec`` (H=2), without its ``rand_seed`` (the tests give ``SEED``)."""
    inputs = inputs_for(spec, B, P, seed=seed)
    inputs.pop("rand_seed")
    return inputs


def _indices(spec: StepSpec, B: int, P: int, seed: int) -> dict:
    """The spec's index arguments with every padding kind (testing.step_indices), none in dense mode."""
    return step_indices(spec, B, P, null_slot_id=NULL, seed=seed)[0] if spec.pool else {}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _run_both(spec: StepSpec, inputs: dict, kw: dict) -> tuple:
    cpu, run = clone_inputs(inputs), clone_inputs(inputs)
    options = dict(kw, update_kv_state=spec.update_kv_state, stochastic_rounding=True)
    out_cpu = mamba3_step_fn(**cpu, **options)
    out_ptx = ptx_step_fn(**run, **options)
    return (out_cpu, cpu), (out_ptx, run)


def exact_arithmetic_(inputs: dict, scale: float = 1.0) -> dict:
    """Make the update's fp32 arithmetic the same in the kernel and the CPU path (module
    docstring): alpha = 1, beta = 0, dt = 1/8; ``scale`` (a power of two) scales x."""
    inputs["A"].zero_()
    inputs["trap"].fill_(1.0)
    inputs["dt"].fill_(0.125)
    inputs["x"].mul_(scale)
    return inputs


def _assert_same(where: str, cpu: tuple, run: tuple, out: bool = True) -> None:
    (out_cpu, c), (out_ptx, r) = cpu, run
    if out:
        assert torch.equal(_bits(out_cpu), _bits(out_ptx)), f"{where}: out"
    for key in ("state", "Bstate", "Xstate"):
        same = _bits(c[key]) == _bits(r[key])
        assert bool(same.all()), f"{where}: {key}: {int((~same).sum())} elements differ in their bits"


@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_executed_stochastic_rounding_equals_the_cpu_path_bit_for_bit(name):
    spec = STOCHASTIC[name].with_default_tiling()
    B = 6
    P = 4 * B * spec.tokens if spec.pool else None
    inputs = dict(exact_arithmetic_(sr_inputs(spec, B, P, seed=13)), rand_seed=SEED.clone())
    cpu, run = _run_both(spec, inputs, _indices(spec, B, P, seed=3))
    _assert_same(name, cpu, run, out=False)  # out: the skip and gate terms use exp (approximate)
    nearest = clone_inputs(inputs)
    nearest.pop("rand_seed")
    mamba3_step_fn(**nearest, **_indices(spec, B, P, seed=3), update_kv_state=spec.update_kv_state)
    assert not torch.equal(_bits(nearest["state"]), _bits(cpu[1]["state"])), f"{name}: no element rounded up"


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """fp32 values reaching every branch of the rounding to ``dtype``."""
    if dtype == torch.float16:
        v = [2.0**-24 * 0.3, 2.0**-24 * 0.99, 2.0**-24 * 1.5, 2.0**-20 * 1.37, 2.0**-14 * 0.999, 2.0**-14,
             2.0**-14 * 1.0001, 1e-30, 65503.0, 65519.0, 65535.0, 65536.0, 1e6, 0.1, 1.0 / 3]
    else:
        v = [1e-39, 1e-42, 2.0**-126 * 1.5, 3.3895e38, 3.4e38, 0.1, 1.0 / 3, 1e-30, 7.0]
    v = v + [-x for x in v] + [0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    return torch.tensor(v, dtype=torch.float32)


@pytest.mark.parametrize("name", ["flagship-bf16state-sr", "flagship-fp16state-sr"])
def test_executed_rounding_of_special_values_equals_the_cpu_path(name):
    """With x = Xstate = 0 and A = 0 (alpha = 1 exactly) the new state is the old one: the state
    dtype's own values (the edge values as that dtype holds them: subnormals, the largest finite,
    signed zeros, inf, NaN) must come back with the bits the CPU path gives them."""
    spec = STOCHASTIC[name].with_default_tiling()
    B, P = 2, 3
    inputs = dict(sr_inputs(spec, B, P, seed=17), rand_seed=SEED.clone())
    inputs["x"].zero_()
    inputs["Xstate"].zero_()
    inputs["A"].zero_()
    edge = _edge_values(inputs["state"].dtype)
    flat = inputs["state"].view(-1)
    reps = -(-flat.numel() // edge.numel())
    picked = edge.repeat(reps)[: flat.numel()]
    inputs["state"].copy_(picked.view_as(inputs["state"]).to(inputs["state"].dtype))
    kw = dict(state_batch_indices=torch.tensor([0, 2], dtype=torch.int32))
    cpu, run = _run_both(spec, inputs, kw)
    _assert_same(name, cpu, run, out=False)  # out is NaN (the state holds NaN), in the executor's own bits


@pytest.mark.parametrize("scale", [1.0, 2.0**-20, 2.0**10])
@pytest.mark.parametrize("name", ["flagship-bf16state-sr", "flagship-fp16state-sr"])
def test_executed_rounding_across_the_range_equals_the_cpu_path(name, scale):
    """Exact arithmetic with x scaled by ``scale``: new values between grid points everywhere;
    2**-20 puts fp16's into its subnormal range (and below it), 2**10 near its largest finite."""
    spec = STOCHASTIC[name].with_default_tiling()
    inputs = exact_arithmetic_(sr_inputs(spec, 2, 2, seed=19), scale)
    inputs["state"].mul_(scale)
    inputs["rand_seed"] = SEED.clone()
    cpu, run = _run_both(spec, inputs, dict(state_batch_indices=torch.tensor([1, 0], dtype=torch.int32)))
    _assert_same(f"{name} x{scale}", cpu, run, out=False)
    assert not torch.equal(_bits(inputs["state"]), _bits(cpu[1]["state"]))


@pytest.mark.parametrize("name", ["flagship-bf16state-sr", "flagship-fp16state-sr"])
def test_on_general_inputs_the_kernel_and_the_cpu_path_rarely_differ(name):
    """General inputs: the fp32 new states differ in last bits between executors, so a few
    roundings go the other way; at most 2**-10 of the elements (expected: 2**-13 fp16, 2**-16
    bf16), and each by one unit of the state dtype."""
    spec = STOCHASTIC[name].with_default_tiling()
    inputs = dict(sr_inputs(spec, 6, 24, seed=13), rand_seed=SEED.clone())
    (_, c), (_, r) = _run_both(spec, inputs, _indices(spec, 6, 24, seed=3))
    differ = _bits(c["state"]) != _bits(r["state"])
    assert int(differ.sum()) <= c["state"].numel() // 1024, int(differ.sum())
    gap = (c["state"].float() - r["state"].float()).abs()[differ]
    ulp = torch.finfo(c["state"].dtype).eps * c["state"].float().abs()[differ]
    assert bool((gap <= 2 * ulp).all())


def test_another_offset_changes_the_bits_and_the_bits_follow_the_row():
    spec = STOCHASTIC["flagship-bf16state-sr"].with_default_tiling()
    B, P = 2, 4
    inputs = dict(sr_inputs(spec, B, P, seed=23), rand_seed=SEED.clone())
    rows = torch.tensor([3, 1], dtype=torch.int32)
    _, (_, first) = _run_both(spec, inputs, dict(state_batch_indices=rows))
    moved = dict(inputs, rand_seed=SEED + torch.tensor([0, 1]))
    _, (_, second) = _run_both(spec, moved, dict(state_batch_indices=rows))
    assert not torch.equal(_bits(first["state"][3]), _bits(second["state"][3])), "offset + 1 drew the same bits"
    swapped = {k: (v.flip(0) if k in ("A", "B", "C", "x", "dt", "trap", "z") else v) for k, v in inputs.items()}
    _, (_, third) = _run_both(spec, swapped, dict(state_batch_indices=rows.flip(0)))
    for row in (1, 3):
        assert torch.equal(_bits(first["state"][row]), _bits(third["state"][row])), f"row {row} depends on its lane"


def test_padding_lanes_touch_no_state_byte_with_stochastic_rounding():
    spec = STOCHASTIC["flagship-bf16state-sr"].with_default_tiling()
    B, P = 8, 10
    inputs = dict(sr_inputs(spec, B, P, seed=29), rand_seed=SEED.clone())
    src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, layout="interleaved", seed=29)
    s, tensors, _ = prepare_step(StepTensors(**inputs, state_batch_indices=src, null_slot_id=NULL),
                                 update_kv_state=True, stochastic_rounding=True)
    assert s == spec
    res = run_step_ptx(spec, tensors)
    log = res.log.arrays()
    lane = analysis.cta_of(res, log["thread"]) % res.grid[0]
    state = tensors.state
    lo, hi = state.data_ptr(), state.data_ptr() + state.numel() * state.element_size()
    addr = log["addr"].astype(np.int64)
    in_state = (addr + log["width"] > lo) & (addr < hi)
    for b, kind in enumerate(kinds):
        touched = int((in_state & (lane == b)).sum())
        assert (touched == 0) == (kind in PAD_KINDS), (b, kind, touched)


@pytest.mark.parametrize("name", [n for n, s in STOCHASTIC.items() if s.pool])
def test_stochastic_pool_mode_is_gather_executed_dense_scatter(name):
    """The dense steps of the baseline draw the pool step's bits: ``rand_rows`` (each gathered
    lane's destination row) and ``offset + t`` (serving.gather_dense_scatter)."""
    spec = STOCHASTIC[name].with_default_tiling()
    B = 7
    P = B * spec.tokens + 6
    inputs = dict(sr_inputs(spec, B, P, seed=37), rand_seed=SEED.clone())
    step = functools.partial(ptx_step_fn, stochastic_rounding=True)
    if spec.num_accepted:
        src, nat, dst, kinds = speculative_indices(B, P, spec.tokens, null_slot_id=NULL, seed=37)
        check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True, step_fn=step,
                          num_accepted_tokens=nat)
    else:
        src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, with_dst=spec.has_dst, layout="interleaved", seed=37)
        check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=spec.update_kv_state,
                          step_fn=step)
