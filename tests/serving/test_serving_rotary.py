"""CPU tests of the serving layer carrying Mamba-3's rotary angle (``angle_state``).

* pool mode with angles is gather -> dense -> scatter bit for bit (``gather_dense_scatter``): every
  padding kind, separate destinations, with and without ``update_kv_state`` (the angle is written
  either way), the null slot, T = 4 tokens with per-token destinations and accepted counts;
* ``StatePool(rope_angles=S)``: the angle pool per layer, reset to 0, carried by copy/fork/reset like
  the state rows, refused calls changing nothing;
* ``decode_step`` and the CPU ``CudaGraphStepRunner`` with angles equal ``mamba3_step_fn`` on copies
  of the pool's rows, padding lanes leaving every angle row bit-identical.

Letters: B lanes, T tokens per lane, P pool rows, H heads, D head dim, N state size, R MIMO rank,
S rotary angles per head, L layers.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import COPIED_FROM, RESET_ROWS, assert_bits_equal, check_pool_parity, reset_copy_fork, written_rows

from mamba3_step import mamba3_step_fn
from mamba3_step.contract import lane_is_live, source_rows
from mamba3_step.serving import (CudaGraphStepRunner, SlotError, StatePool, StepForm, decode_step,
                                 gather_dense_scatter)
from mamba3_step.tensors import ROW_FIELDS, StepTensors
from mamba3_step.testing import (lane_inputs, layer_weights, make_inputs, padded_indices, poison_, poison_pool,
                                 speculative_indices, with_rotary)

H, D, N, R, S = 2, 32, 32, 2, 4
NULL = 3
#: (rotate_pairwise, biases, B/C shared by the heads)
VARIANTS = {"mimo-pairs": (False, True, False), "pairwise-shared-nobias": (True, False, True)}


# ---- pool mode == gather -> dense -> scatter ----------------------------------------------------
def _rotary_inputs(B, P, variant, seed, tokens=None):
    pairwise, bias, shared = VARIANTS[variant]
    inputs = make_inputs(B, P, H=H, D=D, N=N, R=R, tokens=tokens, seed=seed)
    return with_rotary(inputs, S, shared_bc=shared, bias=bias, seed=seed + 1), pairwise


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("null_slot", [None, NULL])
@pytest.mark.parametrize("update_kv_state", [False, True])
@pytest.mark.parametrize("with_dst", [False, True])
def test_rotary_pool_step_is_gather_dense_scatter(with_dst, update_kv_state, null_slot, variant):
    """Every padding kind (-1, INT32_MIN, P, INT32_MAX, the null slot), live lanes with a padding
    destination; poisoned rows nobody reads; out, state, B/x and angle rows bit for bit."""
    B, P = 9, 16
    inputs, pairwise = _rotary_inputs(B, P, variant, seed=100 + 2 * with_dst + update_kv_state)
    src, dst, kinds = padded_indices(B, P, null_slot_id=null_slot, with_dst=with_dst, seed=5)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=null_slot, update_kv_state=update_kv_state,
                      rotate_pairwise=pairwise, seed=7)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("form", ["per-token", "final", "none"])
@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_rotary_t_token_pool_step_is_gather_dense_scatter(layout, form, variant):
    """T = 4 with accepted counts and every speculative padding kind, the destinations per token
    (a padding entry skips that token), one final row, or the source row."""
    B, T = 6, 4
    P = B * 2 * T + 4
    inputs, pairwise = _rotary_inputs(B, P, variant, seed=200, tokens=T)
    src, nat, dst, kinds = speculative_indices(B, P, T, null_slot_id=NULL, layout=layout, seed=9)
    if form != "per-token":
        dst = None if form == "none" else dst[:, -1].contiguous()
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True, rotate_pairwise=pairwise,
                      num_accepted_tokens=nat, seed=11)


def test_baseline_writes_angle_rows_without_update_kv_state_and_keeps_the_rest():
    """Independent of any twin: the angle rows of live destinations change (B/x rows do not), and
    every other angle row, those of padding lanes' targets included, keeps its bits."""
    B, P = 9, 16
    inputs, pairwise = _rotary_inputs(B, P, "mimo-pairs", seed=300)
    src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, with_dst=True, seed=13)
    t = StepTensors(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()},
                    state_batch_indices=src, dst_state_batch_indices=dst, null_slot_id=NULL)
    gather_dense_scatter(t, update_kv_state=False, rotate_pairwise=pairwise)
    written = written_rows(src, dst, P, NULL)
    assert written and len(written) < P
    for row in range(P):
        same = torch.equal(t.angle_state[row], inputs["angle_state"][row])
        assert same == (row not in written), row
    assert_bits_equal(t.Bstate, inputs["Bstate"], "Bstate")
    assert_bits_equal(t.Xstate, inputs["Xstate"], "Xstate")


# ---- StatePool: the angle pool ---------------------------------------------------------------
def rotary_pool(L=2, P=10, seed=0, **kw):
    pool = StatePool(L, P, H, D, N, R, rope_angles=S, **kw)
    poison_pool(pool, torch.Generator().manual_seed(seed))
    poison_(pool._angle_state, seed=seed + 1)  # any int64 is an angle
    return pool


def rows_snapshot(pool):
    return [{k: v.clone() for k, v in pool.layer_rows(l).items()} for l in range(pool.num_layers)]


def test_pool_angle_layout_bytes_and_constructor_checks():
    pool = StatePool(3, 5, H, D, N, R, rope_angles=S)
    ang = pool.angle_state(2)
    assert ang.shape == (5, H, S) and ang.dtype == torch.int64 and ang.is_contiguous() and not ang.any()
    rows = pool.layer_rows(2)
    no_scales = tuple(f for f in ROW_FIELDS if f != "state_scale")  # scale rows: an 8-bit state's only
    assert tuple(rows) == no_scales and rows["angle_state"].data_ptr() == ang.data_ptr()
    for a, b in zip(pool.layer_tensors(2), list(rows.values())[:3]):  # the same views
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    plain = StatePool(3, 5, H, D, N, R)
    assert plain.angle_state(0) is None and plain.layer_rows(0)["angle_state"] is None
    assert pool.bytes_per_slot_per_layer == plain.bytes_per_slot_per_layer + H * S * 8
    assert pool.total_bytes == plain.total_bytes + 3 * 5 * H * S * 8
    assert "S=4" in repr(pool)
    for bad in (-1, N // 2 + 1, True, 1.5, "4"):
        with pytest.raises(ValueError, match=r"^rope_angles: expected an int in \[0, dstate/2 = 16\]"):
            StatePool(1, 4, H, D, N, R, rope_angles=bad)
    with pytest.raises(ValueError, match=r"^layer: expected an int in \[0, 3\)"):
        pool.angle_state(3)


def test_reset_copy_fork_carry_the_angle_rows_like_the_state_rows():
    pool = rotary_pool(L=2, P=10, seed=1)
    before = rows_snapshot(pool)
    reset_copy_fork(pool)
    for l in range(2):
        for name, t in pool.layer_rows(l).items():
            b = before[l][name]
            for row in range(10):
                if row in RESET_ROWS:
                    assert not t[row].any(), (l, name, row)
                else:
                    assert_bits_equal(t[row], b[COPIED_FROM.get(row, row)], f"layer {l} {name} row {row}")


def test_alloc_zero_and_alloc_spec_zero_reset_the_angles():
    pool = rotary_pool(L=2, P=10, seed=2)
    a = pool.alloc(2, zero=True)
    groups = pool.alloc_spec(2, 3, zero=True)
    zeroed = a.tolist() + groups.reshape(-1).tolist()
    for l in range(2):
        ang = pool.angle_state(l)
        assert not ang[zeroed].any()
        assert ang[8:].ne(0).any()  # the rest keeps its poison


@pytest.mark.parametrize("call", ["reset-unallocated", "copy-unknown", "copy-twice", "fork-wrong-n", "fork-two"])
def test_refused_row_operations_change_no_angle(call):
    pool = rotary_pool(L=1, P=8, seed=3)
    pool.alloc(3)
    before, free = rows_snapshot(pool), pool.num_free
    with pytest.raises((SlotError, ValueError, RuntimeError)):
        {"reset-unallocated": lambda: pool.reset([0, 5]), "copy-unknown": lambda: pool.copy([0], [1, 9]),
         "copy-twice": lambda: pool.copy([0], [1, 1]), "fork-wrong-n": lambda: pool.fork(0, 9),
         "fork-two": lambda: pool.fork([0, 1], 1)}[call]()
    assert pool.num_free == free
    for name, t in pool.layer_rows(0).items():
        assert_bits_equal(t, before[0][name], name)


# ---- decode_step and the runner with angles == mamba3_step_fn ---------------------------------
def rotary_lanes(n, seed, tokens=None, shared_bc=False):
    g = torch.Generator().manual_seed(seed)
    inp = lane_inputs(n, H, D, N, R, tokens=tokens, generator=g)
    inp["angle_proj"] = torch.randn(*inp["A"].shape, S, generator=g) * 1.5
    if shared_bc:
        inp["B"], inp["C"] = inp["B"][..., :1, :].clone(), inp["C"][..., :1, :].clone()
    return inp


def rotary_weights(seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    w = layer_weights(H, D, R, generator=g)
    w["B_bias"] = 1 + 0.3 * torch.randn(R, H, N, generator=g) if bias else None
    w["C_bias"] = 1 + 0.3 * torch.randn(R, H, N, generator=g) if bias else None
    return w


def expected(pool, layer, slots, inp, w, pairwise, **idx):
    """``mamba3_step_fn`` on copies of the layer's rows (update_kv_state, as decode_step runs it)."""
    rows = {k: v.clone() for k, v in pool.layer_rows(layer).items()}
    out = mamba3_step_fn(**rows, **inp, **w, state_batch_indices=slots, null_slot_id=pool.null_slot_id,
                         update_kv_state=True, rotate_pairwise=pairwise, **idx)
    return out, rows


def assert_rows(pool, layer, rows, what):
    for name, t in pool.layer_rows(layer).items():
        assert_bits_equal(t, rows[name], f"{what} {name}")


def assert_angles_kept(pool, before, layer, written, what):
    """Every angle row outside ``written`` keeps its bits (padding lanes touch none); the written changed."""
    ang, old = pool.angle_state(layer), before[layer]["angle_state"]
    for row in range(pool.num_slots):
        assert torch.equal(ang[row], old[row]) == (row not in written), f"{what}: angle row {row}"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("null_slot", [False, True])
@pytest.mark.parametrize("with_dst", [False, True])
def test_decode_step_with_angles_is_mamba3_step_fn(with_dst, null_slot, variant):
    pairwise, bias, shared = VARIANTS[variant]
    pool = rotary_pool(L=2, P=12, seed=4, reserve_null_slot=null_slot)
    pool.alloc(pool.capacity)
    P, pad = pool.num_slots, pool.pad_id
    slots = torch.tensor([7, pad, 3, 12, 5, -3, 1, 9, -(2**31)], dtype=torch.int32)
    dst = torch.tensor([2, 4, 3, 4, 5, 6, pad, 8, 10], dtype=torch.int32) if with_dst else None
    inp, w = rotary_lanes(9, seed=5, shared_bc=shared), rotary_weights(6, bias)
    before = rows_snapshot(pool)
    want, rows = expected(pool, 1, slots, inp, w, pairwise, dst_state_batch_indices=dst)
    out = decode_step(pool, 1, slots, **inp, **w, dst_slots=dst, rotate_pairwise=pairwise)
    assert_bits_equal(out, want, "out")
    assert_rows(pool, 1, rows, "layer 1")
    assert_rows(pool, 0, before[0], "layer 0 (not stepped)")
    live = lane_is_live(slots, P, pool.null_slot_id)
    assert not out[~live].any()
    assert_angles_kept(pool, before, 1, written_rows(slots, dst, P, pool.null_slot_id), "decode_step")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_t_token_decode_step_with_angles_is_mamba3_step_fn(variant):
    """A verify step over the pool's groups (per-token destinations, accepted counts), plus padding
    lanes aiming at live rows; then the groups' committed rows carry the angle on."""
    pairwise, bias, shared = VARIANTS[variant]
    T = 4
    pool = rotary_pool(L=1, P=24, seed=7, reserve_null_slot=True)
    groups = pool.alloc_spec(4, T)
    pool.commit_accepted(groups, [4, 1, 2, 3])
    idx = pool.spec_indices(groups)
    slots = torch.cat([idx.state_batch_indices, torch.tensor([[0] * T, [24] * T], dtype=torch.int32)])
    nat = torch.cat([idx.num_accepted_tokens, torch.tensor([1, 1], dtype=torch.int32)])
    dst = torch.cat([idx.dst_state_batch_indices, groups[:2]])  # padding lanes aim at live rows
    dst[0, 1] = -1  # a padding token: skips that write
    inp, w = rotary_lanes(6, seed=8, tokens=T, shared_bc=shared), rotary_weights(9, bias)
    before = rows_snapshot(pool)
    want, rows = expected(pool, 0, slots, inp, w, pairwise, dst_state_batch_indices=dst, num_accepted_tokens=nat)
    out = decode_step(pool, 0, slots, **inp, **w, dst_slots=dst, num_accepted_tokens=nat, rotate_pairwise=pairwise)
    assert_bits_equal(out, want, "out")
    assert_rows(pool, 0, rows, "pool")
    assert not out[4:].any()
    written = written_rows(slots, dst, pool.num_slots, pool.null_slot_id, nat)
    assert_angles_kept(pool, before, 0, written, "verify step")


def test_decode_step_refuses_angle_mismatches_and_changes_nothing():
    pool, plain = rotary_pool(L=1, P=8, seed=10), StatePool(1, 8, H, D, N, R)
    slots = pool.alloc(3)
    plain.alloc(3)
    inp, w = rotary_lanes(3, seed=11), rotary_weights(12)
    before = rows_snapshot(pool)
    no_angle = {k: v for k, v in inp.items() if k != "angle_proj"}
    cases = [
        (pool, dict(no_angle, **w), r"^angle_proj: expected a tensor because angle_state is given"),
        (pool, dict(inp, **w, tile_D=16, num_warps=2), r"^tile_D: angle_state needs tile_D >= headdim"),
        (pool, dict(inp, **w, angle_proj=inp["angle_proj"][..., :2]), r"^angle_proj: expected"),
        (plain, dict(inp, **w), r"^angle_state: expected a tensor because angle_proj is given"),
        (pool, dict(inp, **w, rotate_pairwise=1), r"^rotate_pairwise: expected a bool"),
    ]
    for p, kw, match in cases:
        with pytest.raises((TypeError, ValueError), match=match):
            decode_step(p, 0, slots, **kw)
    assert_rows(pool, 0, before[0], "after refused steps")


def test_runner_with_angles_is_mamba3_step_fn_and_pads_its_lanes():
    """Steps of 4, 3 (padded), 1 (padded) and 5 (eager) lanes: each equals mamba3_step_fn on copies
    of the rows; padded lanes' angle_proj is zero and no row outside the live lanes' changes."""
    pool = rotary_pool(L=1, P=12, seed=13, reserve_null_slot=True)
    w = rotary_weights(14)
    runner = CudaGraphStepRunner(pool, 0, buckets=(2, 4), rotate_pairwise=True, **w)
    slots_all = pool.alloc(6)
    for step, lanes in enumerate(([0, 1, 2, 3], [4, 2, 0], [5], [3, 0, 4, 2, 1])):
        slots = slots_all[lanes]
        inp = rotary_lanes(len(lanes), seed=20 + step)
        before = rows_snapshot(pool)
        want, rows = expected(pool, 0, slots, inp, w, True)
        out = runner.step(slots, **inp)
        assert_bits_equal(out, want, f"step {step} out")
        assert_rows(pool, 0, rows, f"step {step}")
        assert_angles_kept(pool, before, 0, set(slots.tolist()), f"step {step}")
    s = runner.buffers(4)
    assert s["angle_proj"].shape == (4, H, S) and s["angle_proj"].dtype == torch.float32
    assert s["slots"][3] == pool.pad_id and not s["angle_proj"][3].any()
    assert runner.captured_buckets == (2, 4)


def test_runner_t_token_verify_step_with_angles_equals_eager_decode_step():
    T = 3
    pool, twin = rotary_pool(L=1, P=20, seed=15), rotary_pool(L=1, P=20, seed=15)
    groups = pool.alloc_spec(3, T)
    assert torch.equal(twin.alloc_spec(3, T), groups)
    w = rotary_weights(16, bias=False)
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), with_dst=True, shared_bc=True, **w)
    for step in range(2):
        idx = pool.spec_indices(groups)
        inp = rotary_lanes(3, seed=30 + step, tokens=T, shared_bc=True)
        before = rows_snapshot(pool)
        out = runner.step(idx.state_batch_indices, dst_slots=idx.dst_state_batch_indices,
                          num_accepted_tokens=idx.num_accepted_tokens, **inp)
        ref = decode_step(twin, 0, idx.state_batch_indices, **inp, **w, dst_slots=idx.dst_state_batch_indices,
                          num_accepted_tokens=idx.num_accepted_tokens)
        assert_bits_equal(out, ref, f"step {step} out")
        assert_rows(pool, 0, twin.layer_rows(0), f"step {step}")
        assert_angles_kept(pool, before, 0, set(groups.reshape(-1).tolist()), f"step {step}")
        for g in (pool, twin):
            g.commit_accepted(groups, [3, 1, 2])
    s = runner.buffers(4, StepForm.speculative(T))
    assert s["B"].shape == (4, T, R, 1, N) and s["angle_proj"].shape == (4, T, H, S)
    assert not s["angle_proj"][3].any() and s["slots"][3].tolist() == [pool.pad_id] * T


def test_runner_takes_the_rotary_weights_and_refuses_what_fits_no_buffer():
    params = inspect.signature(CudaGraphStepRunner).parameters
    for name in ("D", "xproj", "zproj", "outproj", "B_bias", "C_bias", "rotate_pairwise", "shared_bc"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    with pytest.raises(TypeError, match=r"^CudaGraphStepRunner\(\) got an unexpected keyword argument 'angle_state'"):
        CudaGraphStepRunner(StatePool(1, 4, H, D, N, R), 0, angle_state=None, **rotary_weights(0))
    pool, plain = rotary_pool(L=1, P=8, seed=17), StatePool(1, 8, H, D, N, R)
    w = rotary_weights(18)
    with pytest.raises((TypeError, ValueError), match=r"^rotate_pairwise: expected a bool"):
        CudaGraphStepRunner(pool, 0, rotate_pairwise=1, **w)
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), **w)
    plain_runner = CudaGraphStepRunner(plain, 0, buckets=(4,), **{k: v for k, v in w.items() if "bias" not in k})
    slots = pool.alloc(3)
    plain.alloc(3)
    inp = rotary_lanes(3, seed=19)
    before = rows_snapshot(pool)
    no_angle = {k: v for k, v in inp.items() if k != "angle_proj"}
    with pytest.raises(ValueError, match=r"^angle_proj: expected a \(n, H, 4\) fp32 tensor because"):
        runner.step(slots, **no_angle)
    with pytest.raises(ValueError, match=r"^angle_proj: this runner's pool has no rotary angles"):
        plain_runner.step(slots, **inp)
    shared = rotary_lanes(3, seed=19, shared_bc=True)
    with pytest.raises(ValueError, match=r"^B: expected a head axis of 2 \(this runner was built with shared_bc=False"):
        runner.step(slots, **shared)
    with pytest.raises(ValueError, match=r"^angle_proj: expected 3 lanes"):
        runner.step(slots, **dict(inp, angle_proj=inp["angle_proj"][:2]))
    with pytest.raises(ValueError, match=r"^angle_proj: expected"):  # validation: S of the pool's angles
        runner.step(slots, **dict(inp, angle_proj=inp["angle_proj"][..., :2].contiguous()))
    assert_rows(pool, 0, before[0], "after refused steps")
    assert runner.buffers(4) is None or not runner.buffers(4)["out"].any()
