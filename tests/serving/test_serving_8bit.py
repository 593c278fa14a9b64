"""CPU tests of the serving layer with 8-bit states (int8, float8_e4m3fn) and their scale pool.

* ``StatePool(state_dtype=int8 | float8_e4m3fn)`` allocates a ``(L, P, H, D)`` fp32 scale pool beside
  the state; ``layer_rows`` hands it out as ``state_scale``; reset zeroes it (zero codes with scale 0
  read as exact zeros), copy/fork copy it with the state rows, its bytes count per slot; wrong dtypes
  are refused naming the argument;
* ``decode_step`` over several steps equals the same steps run by hand with ``mamba3_step_fn`` on
  copies of the pool's rows (the pool supplies ``state_scale``; ``rand_seed``'s offset advances by T);
* pool mode equals gather -> dense -> scatter (``serving.gather_dense_scatter``) bit for bit, state
  codes and scales, every padding kind touching no byte of either; one-token and T-token steps;
* the CPU ``CudaGraphStepRunner`` on an 8-bit pool equals ``decode_step``; steps without stochastic
  rounding or a seed are refused, changing nothing.

Letters: B lanes, T tokens per lane, P pool rows, H heads, D head dim, N state size, R MIMO rank,
L layers.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import COPIED_FROM, RESET_ROWS, assert_bits_equal, reset_copy_fork, written_rows

from mamba3_step import mamba3_step_fn
from mamba3_step.rounding import dequantize_rows
from mamba3_step.serving import CudaGraphStepRunner, SlotError, StatePool, decode_step, gather_dense_scatter
from mamba3_step.tensors import ROW_FIELDS, StepTensors
from mamba3_step.testing import lane_inputs, layer_weights, padded_indices, poison_pool, speculative_indices

H, D, N, R = 2, 32, 32, 2
FORMATS = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


def scaled_pool(fmt, L=2, P=10, seed=0, **kw) -> StatePool:
    pool = StatePool(L, P, H, D, N, R, state_dtype=fmt, **kw)
    poison_pool(pool, torch.Generator().manual_seed(seed))
    return pool


def snapshot(pool) -> list[dict]:
    return [{k: v.clone() for k, v in pool.layer_rows(l).items() if v is not None} for l in range(pool.num_layers)]


def assert_rows(pool, layer, rows, what):
    for name, t in pool.layer_rows(layer).items():
        if t is not None:
            assert_bits_equal(t, rows[name], f"{what} {name}")


def seed_tensor(seed=20250917, offset=11):
    return torch.tensor([seed, offset], dtype=torch.int64)


# ---- StatePool: the scale pool -----------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_pool_allocates_scale_rows_beside_an_8bit_state(fmt):
    for given in (fmt, FORMATS[fmt]):  # by name or as a torch dtype
        pool = StatePool(3, 5, H, D, N, R, state_dtype=given)
        assert pool.state_dtype == FORMATS[fmt]
        state, scale = pool.state(2), pool.state_scale(2)
        assert state.shape == (5, H, D, N) and state.dtype == FORMATS[fmt] and state.is_contiguous()
        assert scale.shape == (5, H, D) and scale.dtype == torch.float32 and scale.is_contiguous()
        assert pool._state_scale.shape == (3, 5, H, D) and scale.data_ptr() == pool._state_scale[2].data_ptr()
        assert not state.view(torch.uint8).any() and not scale.view(torch.int32).any()  # +0 bits
        rows = pool.layer_rows(2)
        assert tuple(rows) == ROW_FIELDS and rows["angle_state"] is None
        assert rows["state_scale"].data_ptr() == scale.data_ptr() and rows["state"].data_ptr() == state.data_ptr()
        per_layer = H * D * N * 1 + R * H * N * 2 + H * D * 2 + H * D * 4  # state, Bstate, Xstate, scales
        assert pool.bytes_per_slot_per_layer == per_layer and pool.bytes_per_slot == 3 * per_layer
        assert pool.total_bytes == 5 * 3 * per_layer + 3 * (R * H * N * 2 + H * D * 2)  # + the scratch rows
        assert f"state={FORMATS[fmt]} (state_scale=torch.float32)" in repr(pool)
    with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 3\)"):
        pool.state_scale(3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_other_states_have_no_scale_pool_and_pass_no_state_scale(dtype):
    pool = StatePool(2, 4, H, D, N, R, state_dtype=dtype)
    assert pool.state_scale(1) is None and pool._state_scale is None
    assert "state_scale" not in pool.layer_rows(1) and "state_scale" not in repr(pool)
    assert pool.bytes_per_slot_per_layer == H * D * N * pool.state_dtype.itemsize + R * H * N * 2 + H * D * 2


@pytest.mark.parametrize("kw,match", [
    (dict(state_dtype=torch.int32), r"^state_dtype: expected one of"),
    (dict(state_dtype="float8_e5m2"), r"^state_dtype: expected one of"),
    (dict(kv_dtype="int8"), r"^kv_dtype: expected one of torch.bfloat16, torch.float16, torch.float32, got torch.int8"),
    (dict(kv_dtype=torch.float8_e4m3fn), r"^kv_dtype: expected one of .*, got torch.float8_e4m3fn"),
    (dict(x_dtype="int8"), r"^x_dtype: expected one of torch.bfloat16, torch.float16, torch.float32, got torch.int8"),
    (dict(state_dtype="int8", kv_dtype="float8_e4m3fn"), r"^kv_dtype: expected one of"),
])
def test_wrong_dtypes_are_refused_naming_the_argument(kw, match):
    with pytest.raises(TypeError, match=match):
        StatePool(1, 4, H, D, N, R, **kw)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_poisoned_8bit_pool_holds_random_codes_and_positive_scales(fmt):
    pool = scaled_pool(fmt, seed=1)
    codes, scales = pool._state.view(torch.uint8), pool._state_scale
    assert bool((scales > 0).all()) and bool(torch.isfinite(scales).all()) and scales.unique().numel() > 100
    assert codes.unique().numel() > 100  # most of the format's codes
    assert bool(torch.isfinite(dequantize_rows(pool._state, pool._state_scale)).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reset_zeroes_codes_and_scales_to_exact_zeros(fmt):
    pool = scaled_pool(fmt, L=2, P=10, seed=2)
    s = pool.alloc(4)
    before = snapshot(pool)
    pool.reset(s[[1, 3]])
    a = pool.alloc(2, zero=True)
    groups = pool.alloc_spec(1, 2, zero=True)
    zeroed = s[[1, 3]].tolist() + a.tolist() + groups.reshape(-1).tolist()
    for l in range(2):
        state, scale = pool.state(l), pool.state_scale(l)
        assert not state[zeroed].view(torch.uint8).any() and not scale[zeroed].view(torch.int32).any()
        assert not dequantize_rows(state[zeroed], scale[zeroed]).view(torch.int32).any()  # +0.0, exactly
        for row in sorted(set(range(10)) - set(zeroed)):  # the rest keep their (nonzero) poison
            assert bool(scale[row].gt(0).all())
            assert_bits_equal(scale[row], before[l]["state_scale"][row], f"layer {l} scale row {row}")
            assert_bits_equal(state[row], before[l]["state"][row], f"layer {l} state row {row}")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_copy_and_fork_carry_the_scale_rows_bit_for_bit(fmt):
    pool = scaled_pool(fmt, L=2, P=10, seed=3)
    before = snapshot(pool)
    for l in range(2):  # every row's scales differ: a copy from the wrong row would show
        assert before[l]["state_scale"].reshape(10, -1).unique(dim=0).shape[0] == 10
    reset_copy_fork(pool)
    for l in range(2):
        for name, t in pool.layer_rows(l).items():
            if t is None:
                continue
            for row in range(10):
                if row in RESET_ROWS:
                    assert not t[row].view(torch.uint8).any(), (l, name, row)
                else:
                    assert_bits_equal(t[row], before[l][name][COPIED_FROM.get(row, row)], f"layer {l} {name} row {row}")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_refused_row_operations_change_no_scale(fmt):
    pool = scaled_pool(fmt, L=1, P=8, seed=4)
    pool.alloc(3)
    before, free = snapshot(pool), pool.num_free
    for call in (lambda: pool.reset([0, 5]), lambda: pool.copy([0], [1, 9]), lambda: pool.fork(0, 9)):
        with pytest.raises((SlotError, ValueError, RuntimeError)):
            call()
    assert pool.num_free == free
    assert_rows(pool, 0, before[0], "after refusals")


# ---- decode_step == mamba3_step_fn by hand -----------------------------------------------------
def lanes_and_weights(n, seed, tokens=None):
    g = torch.Generator().manual_seed(seed)
    return lane_inputs(n, H, D, N, R, tokens=tokens, generator=g), layer_weights(H, D, R, generator=g)


def test_decode_step_takes_no_state_scale_the_pool_supplies_it():
    assert "state_scale" not in inspect.signature(decode_step).parameters
    assert "state_scale" not in inspect.signature(CudaGraphStepRunner.step).parameters
    pool = scaled_pool("int8", L=1, P=4)
    lanes, w = lanes_and_weights(1, seed=5)
    with pytest.raises(TypeError, match="state_scale"):
        decode_step(pool, 0, torch.tensor([1], dtype=torch.int32), **lanes, **w, state_scale=pool.state_scale(0),
                    stochastic_rounding=True, rand_seed=seed_tensor())


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("tile_D", [None, 16])  # 16: the hook stores B/x itself, after the step
@pytest.mark.parametrize("null_slot", [False, True])
def test_decode_step_equals_mamba3_step_fn_on_the_pools_rows(fmt, tile_D, null_slot):
    """Three steps on layer 1 of a two-layer pool: out, every row (codes, scales, B/x) and the seed
    bit for bit; padding lanes and layer 0 keep every byte."""
    pool = scaled_pool(fmt, L=2, P=8, seed=6, reserve_null_slot=null_slot)
    slots = torch.tensor([5, pool.pad_id, 2, 7, -3], dtype=torch.int32)
    layer0 = snapshot(pool)[0]
    twin = {k: v.clone() for k, v in pool.layer_rows(1).items() if v is not None}
    seed, twin_seed = seed_tensor(), seed_tensor()
    for step in range(3):
        lanes, w = lanes_and_weights(len(slots), seed=10 + step)
        before = {k: v.clone() for k, v in twin.items()}
        out = decode_step(pool, 1, slots, **lanes, **w, stochastic_rounding=True, rand_seed=seed, tile_D=tile_D)
        want = mamba3_step_fn(**twin, **lanes, **w, state_batch_indices=slots, null_slot_id=pool.null_slot_id,
                              update_kv_state=True, stochastic_rounding=True, rand_seed=twin_seed)
        twin_seed[1] += 1  # decode_step advances the offset by T = 1
        assert_bits_equal(out, want, f"step {step} out")
        assert_rows(pool, 1, twin, f"step {step}")
        assert seed.tolist() == twin_seed.tolist() == [20250917, 12 + step]
        assert not out[1].view(torch.int16).any() and not out[4].view(torch.int16).any()  # padding: +0.0
        for row in (5, 2, 7):  # written: new codes and new scales
            assert not torch.equal(twin["state_scale"][row], before["state_scale"][row]), (step, row)
        for row in sorted(set(range(8)) - {5, 2, 7}):  # unwritten, the null row too
            for name in ("state", "state_scale", "Bstate", "Xstate"):
                assert_bits_equal(pool.layer_rows(1)[name][row], before[name][row], f"step {step} {name} row {row}")
    assert_rows(pool, 0, layer0, "layer 0")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_speculative_decode_step_on_an_8bit_pool_equals_mamba3_step_fn(fmt):
    """A verify step of T = 3 tokens over groups (spec_indices), then a commit and a second step."""
    T = 3
    pool = scaled_pool(fmt, L=1, P=12, seed=7)
    groups = pool.alloc_spec(3, T)
    twin = {k: v.clone() for k, v in pool.layer_rows(0).items() if v is not None}
    seed, twin_seed = seed_tensor(offset=40), seed_tensor(offset=40)
    for step, accepted in enumerate(([2, 3, 1], [1, 1, 3])):
        idx = pool.spec_indices(groups)
        lanes, w = lanes_and_weights(3, seed=30 + step, tokens=T)
        kw = dict(num_accepted_tokens=idx.num_accepted_tokens)
        out = decode_step(pool, 0, idx.state_batch_indices, **lanes, **w, dst_slots=idx.dst_state_batch_indices,
                          stochastic_rounding=True, rand_seed=seed, **kw)
        want = mamba3_step_fn(**twin, **lanes, **w, state_batch_indices=idx.state_batch_indices,
                              dst_state_batch_indices=idx.dst_state_batch_indices, update_kv_state=True,
                              stochastic_rounding=True, rand_seed=twin_seed, **kw)
        twin_seed[1] += T
        assert_bits_equal(out, want, f"step {step} out")
        assert_rows(pool, 0, twin, f"step {step}")
        assert seed.tolist() == twin_seed.tolist()
        pool.commit_accepted(groups, accepted)
    assert seed.tolist() == [20250917, 40 + 2 * T]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_8bit_decode_step_without_stochastic_rounding_or_seed_is_refused_changing_nothing(fmt):
    pool = scaled_pool(fmt, L=1, P=4, seed=8)
    before = snapshot(pool)
    lanes, w = lanes_and_weights(2, seed=9)
    slots = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^stochastic_rounding: expected True with a {fmt} state"):
        decode_step(pool, 0, slots, **lanes, **w)
    with pytest.raises(ValueError, match=r"^rand_seed: expected an int64 tensor"):
        decode_step(pool, 0, slots, **lanes, **w, stochastic_rounding=True)
    assert_rows(pool, 0, before[0], "refused")


# ---- pool mode == gather -> dense -> scatter ---------------------------------------------------
def check_baseline_parity(pool, layer, slots, dst, lanes, w, nat=None, tile_D=None):
    """decode_step on ``pool`` vs ``gather_dense_scatter`` on copies of its rows, bit for bit: out, state
    codes, scales, B/x; rows no live lane writes keep every byte (padding lanes touch nothing)."""
    before = {k: v.clone() for k, v in pool.layer_rows(layer).items() if v is not None}
    twin = {k: v.clone() for k, v in before.items()}
    seed, twin_seed = seed_tensor(offset=7), seed_tensor(offset=7)
    idx = dict(state_batch_indices=slots, dst_state_batch_indices=dst, num_accepted_tokens=nat)
    want = gather_dense_scatter(StepTensors(**twin, **lanes, **w, **idx, null_slot_id=pool.null_slot_id,
                                            rand_seed=twin_seed), update_kv_state=True, tile_D=tile_D)
    out = decode_step(pool, layer, slots, **lanes, **w, dst_slots=dst, num_accepted_tokens=nat, tile_D=tile_D,
                      stochastic_rounding=True, rand_seed=seed)
    assert_bits_equal(out, want, "out")
    assert_rows(pool, layer, twin, "pool vs baseline")
    T = lanes["x"].shape[1] if lanes["x"].dim() == 4 else 1
    assert seed.tolist() == [20250917, 7 + T] and twin_seed.tolist() == [20250917, 7]
    written = written_rows(slots, dst, pool.num_slots, pool.null_slot_id, nat)
    assert written, "no live lane"
    for row in range(pool.num_slots):
        kept = all(torch.equal(pool.layer_rows(layer)[k][row].view(torch.uint8), v[row].view(torch.uint8))
                   for k, v in before.items() if k in ("state", "state_scale"))
        assert kept == (row not in written), row  # written rows get new codes and scales; the rest none


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("with_dst", [False, True])
@pytest.mark.parametrize("null_slot", [False, True])
def test_8bit_pool_step_is_gather_dense_scatter(fmt, with_dst, null_slot):
    """Every padding kind (-1, INT32_MIN, P, INT32_MAX, the null slot), live lanes with a padding
    destination; a poisoned pool of random codes and scales."""
    B, P = 9, 16
    pool = scaled_pool(fmt, L=2, P=P, seed=11 + with_dst, reserve_null_slot=null_slot)
    src, dst, kinds = padded_indices(B, P, null_slot_id=pool.null_slot_id, with_dst=with_dst, seed=5)
    assert {"negative", "oob"} <= set(kinds) and ("null" in kinds) == null_slot
    lanes, w = lanes_and_weights(B, seed=12)
    check_baseline_parity(pool, 1, src, dst, lanes, w)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_8bit_pool_step_with_hook_stored_kv_is_gather_dense_scatter(fmt):
    pool = scaled_pool(fmt, L=1, P=12, seed=13)
    src, dst, _ = padded_indices(7, 12, with_dst=True, seed=6)
    lanes, w = lanes_and_weights(7, seed=14)
    check_baseline_parity(pool, 0, src, dst, lanes, w, tile_D=16)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_8bit_speculative_step_is_gather_dense_scatter(fmt, layout):
    """T = 3 tokens, per-token destinations, accepted counts, every speculative padding kind."""
    B, P, T = 7, 48, 3
    pool = scaled_pool(fmt, L=1, P=P, seed=15, reserve_null_slot=True)
    sbi, nat, dst, kinds = speculative_indices(B, P, T, null_slot_id=pool.null_slot_id, layout=layout, seed=8)
    assert "live" in kinds and len(set(kinds)) > 3
    lanes, w = lanes_and_weights(B, seed=16, tokens=T)
    check_baseline_parity(pool, 0, sbi, dst, lanes, w, nat=nat)


# ---- the graph runner (CPU: static buffers and padding, no graphs) -------------------------------
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_runner_on_an_8bit_pool_equals_decode_step(fmt):
    pool = scaled_pool(fmt, L=2, P=10, seed=17, reserve_null_slot=True)
    twin = scaled_pool(fmt, L=2, P=10, seed=17, reserve_null_slot=True)
    _, w = lanes_and_weights(1, seed=18)
    seed, twin_seed = seed_tensor(), seed_tensor()
    runner = CudaGraphStepRunner(pool, 1, buckets=(4, 8), **w, stochastic_rounding=True, rand_seed=seed)
    for step, slots in enumerate(([3, 7], [1, 2, 9, 5, 4], [6, 8, 3])):  # padded into buckets 4, 8, 4
        slots = torch.tensor(slots, dtype=torch.int32)
        lanes, _ = lanes_and_weights(len(slots), seed=19 + step)
        out = runner.step(slots, **lanes)
        want = decode_step(twin, 1, slots, **lanes, **w, stochastic_rounding=True, rand_seed=twin_seed)
        assert_bits_equal(out, want, f"step {step} out")
        assert seed.tolist() == twin_seed.tolist() == [20250917, 12 + step]
        for l in range(2):  # the padded lanes (the null slot) touched nothing: the twin ran unpadded
            assert_rows(pool, l, {k: v for k, v in twin.layer_rows(l).items() if v is not None}, f"step {step}")
    assert runner.captured_buckets == (4, 8)


def test_a_capture_warm_up_leaves_the_seed_and_the_rows():
    """A capture runs one warm-up step (every lane padding) before the graph; with stochastic
    rounding it must leave ``rand_seed``'s offset where it was, or every captured step draws one
    offset ahead of ``decode_step`` (found on an H200, 2026-11-28; on CPU the runner captures
    nothing, so the warm-up is called here directly)."""
    pool = scaled_pool("int8", L=1, P=6, seed=23, reserve_null_slot=True)
    before = snapshot(pool)
    _, w = lanes_and_weights(1, seed=24)
    seed = seed_tensor()
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), **w, stochastic_rounding=True, rand_seed=seed)
    runner.capture()
    kept = seed.clone()
    runner._warm_up(runner.buffers(4))
    assert seed.tolist() == kept.tolist()
    assert_rows(pool, 0, before[0], "warm-up")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_runner_on_an_8bit_pool_refuses_a_step_without_stochastic_rounding(fmt):
    pool = scaled_pool(fmt, L=1, P=6, seed=20)
    before = snapshot(pool)
    _, w = lanes_and_weights(1, seed=21)
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), **w)
    lanes, _ = lanes_and_weights(2, seed=22)
    with pytest.raises(ValueError, match=r"^stochastic_rounding: expected True"):
        runner.step(torch.tensor([1, 4], dtype=torch.int32), **lanes)
    with pytest.raises(TypeError, match="state_scale"):
        runner.step(torch.tensor([1, 4], dtype=torch.int32), **lanes, state_scale=pool.state_scale(0))
    assert_rows(pool, 0, before[0], "refused")
