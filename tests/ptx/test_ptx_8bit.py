"""8-bit states with scales, executed: the kernel's PTX run on the CPU (docs/ptx-tier.md).

For each of :data:`test_kernel_compile.EIGHT_BIT` (int8 and float8_e4m3fn states; pool with every
padding kind and separate destinations; dense with and without ``rand_rows``; R = 8; a T = 4
speculative step):

1. given the same fp32 new state, the executed kernel stores the codes and scales the CPU path
   stores, bit for bit, for the same seed and offset (docs/contract.md, "8-bit states"). The
   inputs make the update's fp32 arithmetic the same in both (as tests/ptx/test_ptx_rounding.py:
   A = 0, trap = 1, a power-of-two dt, bf16 operands); the old state ``q * scale`` is a general
   fp32 value, so the absmax, the two IEEE divisions and the product ``new * inv`` are exercised
   on arbitrary values;
2. the odd rows: all-zero rows (scale 0), rows below 2**-100, rows holding a NaN or an inf
   (zeros and scale NaN);
3. another offset changes the codes; the codes follow the row, not the lane;
4. padding lanes read and write no state or scale byte;
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
from test_kernel_compile import EIGHT_BIT

from mamba3_step import mamba3_step_fn
from mamba3_step.api import prepare_step
from mamba3_step.tools.bytes_model import bytes_per_step
from ptx_executor import analysis
from mamba3_step.tools.ptx_tier import ptx_step_fn, run_step_ptx
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import inputs_for, padded_indices, speculative_indices, step_indices

NULL = 2
SEED = torch.tensor([0x0123456789ABCDEF, 2**40 + 17], dtype=torch.int64)
ROW_KEYS = ("state", "state_scale", "Bstate", "Xstate")


def eight_bit_inputs(spec: StepSpec, B: int, P: int | None, seed: int, exact: bool = True) -> dict:
    """Fresh inputs for ``spec`` (H = 2) with ``SEED``; ``exact``: the update's arithmetic exact."""
    inputs = dict(inputs_for(spec, B, P, seed=seed), rand_seed=SEED.clone())
    if exact:
        inputs["A"].zero_()
        inputs["trap"].fill_(1.0)
        inputs["dt"].fill_(0.125)
    return inputs


def _indices(spec: StepSpec, B: int, P: int, seed: int) -> dict:
    return step_indices(spec, B, P, null_slot_id=NULL, seed=seed)[0] if spec.pool else {}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _run_both(spec: StepSpec, inputs: dict, kw: dict) -> tuple:
    cpu, run = clone_inputs(inputs), clone_inputs(inputs)
    options = dict(kw, update_kv_state=spec.update_kv_state, stochastic_rounding=True)
    mamba3_step_fn(**cpu, **options)
    ptx_step_fn(**run, **options)
    return cpu, run


def _assert_same(where: str, cpu: dict, run: dict) -> None:
    for key in ROW_KEYS:
        same = _bits(cpu[key]) == _bits(run[key])
        assert bool(same.all()), f"{where}: {key}: {int((~same).sum())} elements differ in their bits"


@pytest.mark.parametrize("name", list(EIGHT_BIT))
def test_executed_eight_bit_store_equals_the_cpu_path_bit_for_bit(name):
    spec = EIGHT_BIT[name].with_default_tiling()
    B = 6
    P = 4 * B * spec.tokens if spec.pool else None
    inputs = eight_bit_inputs(spec, B, P, seed=13)
    kw = _indices(spec, B, P, seed=3)
    cpu, run = _run_both(spec, inputs, kw)
    _assert_same(name, cpu, run)
    written = ~torch.eq(_bits(cpu["state"]), _bits(inputs["state"])).flatten(1).all(1)
    assert int(written.sum()) >= 1, f"{name}: no row was written"
    # every code of a written row is within one step of its scaled new value: scales are absmax / Q
    again = clone_inputs(inputs)
    mamba3_step_fn(**again, **kw, update_kv_state=spec.update_kv_state, stochastic_rounding=True)
    assert torch.equal(_bits(again["state"]), _bits(cpu["state"])), f"{name}: the CPU path is not deterministic"


def _odd_row_inputs(spec: StepSpec) -> dict:
    """Four rows, one per case: zeros; below 2**-100; a NaN; an inf (head 0, d 0 of each row, via
    the old state's scale, with x = Xstate = 0 and A = 0 so the new state is the old one)."""
    inputs = eight_bit_inputs(spec, 4, 4, seed=17)
    inputs["x"].zero_()
    inputs["Xstate"].zero_()
    scale = inputs["state_scale"]
    scale[0, 0, 0] = 0.0
    scale[1, 0, 0] = 2.0**-110
    scale[2, 0, 0] = float("nan")
    scale[3, 0, 0] = float("inf")
    inputs["state"][3, 0, 0, 0] = torch.tensor(1.0).to(inputs["state"].dtype)  # inf * 1 = inf
    return inputs


@pytest.mark.parametrize("name", ["flagship-int8state", "flagship-fp8state"])
def test_executed_odd_rows_store_zeros_with_scale_zero_or_nan(name):
    spec = EIGHT_BIT[name].with_default_tiling()
    inputs = _odd_row_inputs(spec)
    cpu, run = _run_both(spec, inputs, dict(state_batch_indices=torch.arange(4, dtype=torch.int32)))
    _assert_same(name, cpu, run)
    scale = run["state_scale"][:, 0, 0]
    assert scale[0].item() == 0.0 and scale[1].item() == 0.0
    assert bool(torch.isnan(scale[2])) and bool(torch.isnan(scale[3]))
    assert not bool(run["state"][:, 0, 0].float().any()), "an odd row stored non-zero codes"
    assert bool(torch.isfinite(run["state_scale"][:, 1:]).all())


def test_another_offset_changes_the_codes_and_the_codes_follow_the_row():
    spec = EIGHT_BIT["flagship-int8state"].with_default_tiling()
    B, P = 2, 4
    inputs = eight_bit_inputs(spec, B, P, seed=23, exact=False)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    _, first = _run_both(spec, inputs, dict(state_batch_indices=rows))
    moved = dict(inputs, rand_seed=SEED + torch.tensor([0, 1]))
    _, second = _run_both(spec, moved, dict(state_batch_indices=rows))
    assert not torch.equal(_bits(first["state"][3]), _bits(second["state"][3])), "offset + 1 drew the same bits"
    assert torch.equal(first["state_scale"][3], second["state_scale"][3]), "the scale depends on the bits"
    swapped = {k: (v.flip(0) if k in ("A", "B", "C", "x", "dt", "trap", "z") else v) for k, v in inputs.items()}
    _, third = _run_both(spec, swapped, dict(state_batch_indices=rows.flip(0)))
    for row in (1, 3):
        for key in ("state", "state_scale"):
            assert torch.equal(_bits(first[key][row]), _bits(third[key][row])), f"row {row}: {key} depends on its lane"


@pytest.mark.parametrize("name", ["flagship-int8state", "flagship-fp8state"])
def test_padding_lanes_touch_no_state_or_scale_byte(name):
    spec = EIGHT_BIT[name].with_default_tiling()
    B, P = 8, 10
    inputs = eight_bit_inputs(spec, B, P, seed=29, exact=False)
    src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, layout="interleaved", seed=29)
    s, tensors, _ = prepare_step(StepTensors(**inputs, state_batch_indices=src, null_slot_id=NULL),
                                 update_kv_state=True, stochastic_rounding=True)
    assert s == spec
    res = run_step_ptx(spec, tensors)
    log = res.log.arrays()
    lane = analysis.cta_of(res, log["thread"]) % res.grid[0]
    addr = log["addr"].astype(np.int64)
    for key in ("state", "state_scale"):
        t = getattr(tensors, key)
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        inside = (addr + log["width"] > lo) & (addr < hi)
        for b, kind in enumerate(kinds):
            touched = int((inside & (lane == b)).sum())
            assert (touched == 0) == (kind in PAD_KINDS), (key, b, kind, touched)


@pytest.mark.parametrize("name", [n for n, s in EIGHT_BIT.items() if s.pool])
def test_eight_bit_pool_mode_is_gather_executed_dense_scatter(name):
    """The dense steps of the baseline gather the scale rows with the state rows and draw the pool
    step's bits (``rand_rows``, ``offset + t``: serving.gather_dense_scatter)."""
    spec = EIGHT_BIT[name].with_default_tiling()
    B = 7
    P = B * spec.tokens + 6
    inputs = eight_bit_inputs(spec, B, P, seed=37, exact=False)
    step = functools.partial(ptx_step_fn, stochastic_rounding=True)
    if spec.num_accepted:
        src, nat, dst, kinds = speculative_indices(B, P, spec.tokens, null_slot_id=NULL, seed=37)
        check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True, step_fn=step,
                          num_accepted_tokens=nat)
    else:
        src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, with_dst=spec.has_dst, layout="interleaved", seed=37)
        check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=spec.update_kv_state,
                          step_fn=step)


@pytest.mark.parametrize("name", ["flagship-int8state", "flagship-fp8state"])
def test_executed_bytes_equal_the_bytes_model(name):
    """Unique bytes read + written per tensor, from the executed accesses, equal the model's count
    (all lanes live, distinct rows): the state at one byte an element, its scales at four per
    (row, head, d), the seed once."""
    spec = EIGHT_BIT[name].with_default_tiling()
    B, H = 4, 2
    inputs = eight_bit_inputs(spec, B, 2 * B + 2, seed=2, exact=False)
    src = torch.tensor([4, 0, 9, 2], dtype=torch.int32)
    s, tensors, _ = prepare_step(StepTensors(**inputs, state_batch_indices=src), update_kv_state=True,
                                 stochastic_rounding=True)
    res = run_step_ptx(s, tensors)
    touched = analysis.bytes_touched(res, res.extra["memory"])
    model = bytes_per_step(s, B, H)
    assert model["state_scale"] == 2 * B * H * spec.headdim * 4 and model["rand_seed"] == 16
    assert set(touched) <= set(model)
    for key, n in touched.items():
        assert n["read"] + n["written"] == model[key], f"{name}: {key} executed {n}, model {model[key]}"
