"""CPU tests of mamba3_step.serving: StatePool + allocator, decode hook, bucket padding,
and a multi-step, multi-layer decode with joining/leaving requests vs gather -> dense -> scatter.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, L layers.
"""

from __future__ import annotations

import random
import re
import threading

import pytest
import torch
from helpers import YieldingHeapq, run_threads

from mamba3_step.reference import step_math
from mamba3_step.serving import (CudaGraphStepRunner, PoolExhaustedError, SlotError, StatePool, choose_bucket, decode_step, gather_scatter_step, kv_update_in_kernel, lane_is_live, pad_lanes, pad_slots)
from mamba3_step.serving import pool as pool_module
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, poison_, poison_pool

H, D, N, R = 2, 32, 32, 2


def make_pool(L=2, P=8, seed=0, **kw):
    pool = StatePool(L, P, H, D, N, R, **kw)
    poison_pool(pool, torch.Generator().manual_seed(seed))
    return pool


def poison_bits(pool, seed):
    """Random bit patterns (NaN, inf, denormals included) in every row of every layer."""
    g = torch.Generator().manual_seed(seed)
    for t in (pool._state, pool._Bstate, pool._Xstate):
        poison_(t, generator=g)


def snapshot(pool):
    return [tuple(t.clone() for t in pool.layer_tensors(l)) for l in range(pool.num_layers)]


# ---- allocator ------------------------------------------------------------------------------
def test_alloc_returns_lowest_free_int32_and_free_recycles():
    pool = StatePool(1, 6, H, D, N, R)
    a = pool.alloc(3)
    assert a.dtype == torch.int32 and a.device.type == "cpu"
    assert a.tolist() == [0, 1, 2]
    pool.free(a[1:2])
    assert pool.alloc(2).tolist() == [1, 3]
    assert pool.num_free == 2 and pool.num_allocated == 4
    assert pool.allocated_slots() == [0, 1, 2, 3]
    pool.free([0, 3])
    assert pool.alloc(0).tolist() == []
    assert pool.alloc(4).tolist() == [0, 3, 4, 5]
    assert pool.num_free == 0


def test_double_free_unknown_slot_and_exhaustion_raise_and_change_nothing():
    pool = StatePool(1, 4, H, D, N, R)
    s = pool.alloc(2)
    pool.free(s[:1])
    with pytest.raises(SlotError, match=r"slot 0: it is not allocated \(double free\?\)"):
        pool.free([0])
    # an unknown slot in a list frees nothing, not even the valid slot before it
    with pytest.raises(SlotError, match=r"slots\[1\]: cannot free unknown slot 4: expected a slot in \[0, 4\)"):
        pool.free([1, 4])
    with pytest.raises(SlotError, match="unknown slot -1"):
        pool.free(-1)
    assert pool.is_allocated(1)
    with pytest.raises(SlotError, match="listed twice"):
        pool.free([1, 1])
    assert pool.is_allocated(1)
    with pytest.raises(PoolExhaustedError, match=r"asked for 4 slot\(s\), 3 free of 4"):
        pool.alloc(4)
    assert pool.num_free == 3  # nothing was taken
    assert pool.alloc(3).tolist() == [0, 2, 3]
    with pytest.raises(PoolExhaustedError):
        pool.alloc(1)
    with pytest.raises(ValueError, match="n: expected a non-negative int, got -1"):
        pool.alloc(-1)
    with pytest.raises(TypeError, match="integer tensor"):
        pool.free(torch.tensor([1.0]))


def test_pool_constructor_errors():
    with pytest.raises(ValueError, match="num_slots: expected a positive int, got 0"):
        StatePool(1, 0, H, D, N, R)
    with pytest.raises(ValueError, match="reserve_null_slot=True needs at least 2"):
        StatePool(1, 1, H, D, N, R, reserve_null_slot=True)
    with pytest.raises(TypeError, match="state_dtype"):
        StatePool(1, 4, H, D, N, R, state_dtype=torch.int32)


def test_null_slot_is_never_allocated_and_is_the_pad_id():
    pool = StatePool(1, 5, H, D, N, R, reserve_null_slot=True)
    assert pool.null_slot_id == 0 and pool.pad_id == 0 and pool.capacity == 4
    got = pool.alloc(4)
    assert sorted(got.tolist()) == [1, 2, 3, 4]
    with pytest.raises(PoolExhaustedError, match="row 0 reserved as the null slot"):
        pool.alloc(1)
    with pytest.raises(SlotError, match="slot 0: it is the reserved null slot"):
        pool.free([0])
    with pytest.raises(SlotError, match="reserved null slot"):
        pool.reset([0])
    plain = StatePool(1, 5, H, D, N, R)
    assert plain.null_slot_id is None and plain.pad_id == -1 and plain.capacity == 5


def test_pool_layout_dtypes_and_bytes():
    pool = StatePool(3, 5, H, D, N, R, state_dtype=torch.float32, kv_dtype=torch.bfloat16)
    st, bs, xs = pool.layer_tensors(2)
    assert st.shape == (5, H, D, N) and st.dtype == torch.float32 and st.is_contiguous()
    assert bs.shape == (5, R, H, N) and bs.dtype == torch.bfloat16 and bs.is_contiguous()
    assert xs.shape == (5, H, D) and xs.dtype == torch.bfloat16 and xs.is_contiguous()
    per_layer = H * D * N * 4 + R * H * N * 2 + H * D * 2
    assert pool.bytes_per_slot_per_layer == per_layer == 8576
    assert pool.bytes_per_slot == 3 * per_layer
    scratch = 3 * (R * H * N * 2 + H * D * 2)
    assert pool.total_bytes == 5 * pool.bytes_per_slot + scratch
    assert pool.total_bytes == sum(t.numel() * t.element_size() for t in (pool._state, pool._Bstate, pool._Xstate))
    p16 = StatePool(1, 2, H, D, N, R, state_dtype="bfloat16", kv_dtype="float16", x_dtype="float32")
    assert p16.bytes_per_slot == H * D * N * 2 + R * H * N * 2 + H * D * 4
    assert p16.Xstate(0).dtype == torch.float32
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 3\), got 3"):
        pool.state(3)


def test_reset_zeroes_only_those_rows_in_every_layer():
    pool = make_pool(L=3, P=6)
    s = pool.alloc(4)
    before = snapshot(pool)
    pool.reset(s[[1, 3]])
    for l in range(3):
        for t, b in zip(pool.layer_tensors(l), before[l]):
            for row in range(6):
                if row in (1, 3):
                    assert not t[row].any(), (l, row)
                else:
                    assert bits_equal(t[row], b[row]), (l, row)
    with pytest.raises(SlotError, match="cannot reset slot 5: it is not allocated"):
        pool.reset([5])


def test_alloc_zero_resets_rows():
    pool = make_pool(L=2, P=4)
    s = pool.alloc(2, zero=True)
    for l in range(2):
        for t in pool.layer_tensors(l):
            assert not t[s.long()].any()
            assert t[2:].abs().sum() > 0  # poison left in the other rows


def test_copy_forks_rows_broadcast_and_permutation():
    pool = make_pool(L=2, P=8, seed=1)
    s = pool.alloc(6)
    before = snapshot(pool)
    pool.copy(s[0], s[3:6])  # parallel sampling: one parent, three children
    for l in range(2):
        for t, b in zip(pool.layer_tensors(l), before[l]):
            for row in (3, 4, 5):
                assert bits_equal(t[row], b[0])
            for row in (0, 1, 2, 6, 7):
                assert bits_equal(t[row], b[row])
    before = snapshot(pool)
    pool.copy([1, 2], [2, 1])  # beam reorder: overlapping src/dst swaps rows
    for l in range(2):
        for t, b in zip(pool.layer_tensors(l), before[l]):
            assert bits_equal(t[1], b[2]) and bits_equal(t[2], b[1])
            assert bits_equal(t[0], b[0]) and bits_equal(t[6:], b[6:])
    with pytest.raises(SlotError, match="cannot copy to slot 7: it is not allocated"):
        pool.copy([0], [7])
    with pytest.raises(SlotError, match="cannot copy from slot 6"):
        pool.copy([6], [1])
    with pytest.raises(SlotError, match="listed twice"):
        pool.copy([0, 1], [2, 2])
    with pytest.raises(ValueError, match=r"src: expected 1 or len\(dst\)=3 slots, got 2"):
        pool.copy([0, 1], [2, 3, 4])


def test_fork_allocates_copies():
    pool = make_pool(L=1, P=5, seed=2)
    parent = int(pool.alloc(1)[0])
    before = snapshot(pool)
    kids = pool.fork(parent, 2)
    assert kids.tolist() == [1, 2]
    for t, b in zip(pool.layer_tensors(0), before[0]):
        assert bits_equal(t[1], b[parent]) and bits_equal(t[2], b[parent])
        assert bits_equal(t[3:], b[3:])


@pytest.mark.parametrize("src,n", [([0, 1], 3), (torch.tensor([0, 1]), 1), ([], 2), ([0, 1], 2), (7, 1), (0, 9)])
def test_a_refused_fork_takes_no_slot_and_writes_no_row(src, n):
    """A source of the wrong length is refused before any slot is taken."""
    pool = make_pool(L=1, P=8, seed=3)
    pool.alloc(2)
    before, free = snapshot(pool), pool.num_free
    with pytest.raises((ValueError, PoolExhaustedError)):
        pool.fork(src, n)
    assert pool.num_free == free and pool.alloc(free).numel() == free  # every free slot is still free
    for t, b in zip(pool.layer_tensors(0), before[0]):
        assert bits_equal(t, b)


def test_fork_takes_one_source_slot_in_any_form():
    pool = make_pool(L=1, P=6, seed=4)
    parent = int(pool.alloc(1)[0])
    for src in (parent, [parent], torch.tensor([parent], dtype=torch.int32)):
        assert pool.fork(src, 1).numel() == 1


# ---- buckets and padding ------------------------------------------------------------------
def test_choose_bucket():
    buckets = (8, 1, 2, 4, 16)
    assert [choose_bucket(n, buckets) for n in (0, 1, 2, 3, 5, 8, 9, 16, 17)] == [1, 1, 2, 4, 8, 8, 16, 16, None]
    with pytest.raises(ValueError, match="n: expected a non-negative int"):
        choose_bucket(-1, buckets)


def test_pad_slots_and_lanes():
    s = torch.tensor([5, 2, 7], dtype=torch.int32)
    assert pad_slots(s, 8, -1).tolist() == [5, 2, 7, -1, -1, -1, -1, -1]
    assert pad_slots(s, 3, 0).tolist() == [5, 2, 7]
    assert pad_slots(s, 4, 0).dtype == torch.int32
    x = torch.randn(3, H, D).to(torch.bfloat16)
    px = pad_lanes(x, 4)
    assert px.shape == (4, H, D) and px.dtype == torch.bfloat16
    assert bits_equal(px[:3], x) and not px[3].any()
    with pytest.raises(ValueError, match="at most bucket=2"):
        pad_slots(s, 2, -1)


def test_lane_is_live_follows_spec_padding_rule():
    s = torch.tensor([-5, -1, 0, 3, 7, 8, 100], dtype=torch.int32)
    assert lane_is_live(s, 8, None).tolist() == [False, False, True, True, True, False, False]
    assert lane_is_live(s, 8, 0).tolist() == [False, False, False, True, True, False, False]


def test_runner_bucket_buffers_and_padding_on_cpu():
    pool = make_pool(L=1, P=8, reserve_null_slot=True)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(3))
    runner = CudaGraphStepRunner(pool, 0, buckets=(4, 2), **w)
    assert runner.buckets == (2, 4) and not runner.use_cuda_graph
    four = pool.alloc(4)
    full = lane_inputs(4, H, D, N, R, generator=torch.Generator().manual_seed(40))
    runner.step(four, **full)  # fills every lane of bucket 4 with live data
    slots = four[:3]
    inp = lane_inputs(3, H, D, N, R, generator=torch.Generator().manual_seed(4))
    runner.step(slots, **inp)  # the same bucket again: lane 3 must be re-padded
    s = runner.buffers(4)
    assert s["slots"].tolist() == slots.tolist() + [0]  # padded with the null slot (pad id 0)
    for name in ("A", "dt", "trap", "B", "C", "x", "z"):
        assert bits_equal(s[name][:3], inp[name]) and not s[name][3].any(), name
    assert not s["out"][3].any()
    # a smaller step reuses the buffers: stale lanes are re-padded
    inp2 = lane_inputs(1, H, D, N, R, generator=torch.Generator().manual_seed(5))
    runner.step(slots[:1], **inp2)
    assert runner.buffers(2)["slots"].tolist() == [int(slots[0]), 0]
    with pytest.raises(ValueError, match=r"x: expected 3 lanes \(len\(slots\)\)"):
        runner.step(slots, **{**inp, "x": inp["x"][:2]})
    with pytest.raises(TypeError, match="slots: expected dtype torch.int32, got torch.int64"):
        runner.step(slots.long(), **inp)
    with pytest.raises(ValueError, match="z: expected"):
        runner.step(slots, **{**inp, "z": None})
    with pytest.raises(ValueError, match="with_dst=False"):
        runner.step(slots, dst_slots=slots, **inp)
    with pytest.raises(ValueError, match="use_cuda_graph: CUDA graphs need a CUDA pool"):
        CudaGraphStepRunner(pool, 0, use_cuda_graph=True, **w)
    with pytest.raises(ValueError, match="buckets: expected positive ints"):
        CudaGraphStepRunner(pool, 0, buckets=(0, 2), **w)


# ---- the decode hook -------------------------------------------------------------------------
def _hook_vs_baseline(tile_D, num_warps, null_slot, with_dst, seed):
    P = 10
    g = torch.Generator().manual_seed(seed)
    pool = make_pool(L=2, P=P, seed=seed, reserve_null_slot=null_slot)
    pool.alloc(P - (1 if null_slot else 0))
    base = snapshot(pool)
    before = snapshot(pool)
    w = layer_weights(H, D, R, generator=g)
    pad = 0 if null_slot else -1
    # lanes: live rows in shuffled order, plus padding ids of every kind
    src = [7, pad, 3, 12, 5, -3, 1, 9]
    dst = [2, pad, 3, 4, 5, 0, pad, 8] if with_dst else None
    n = len(src)
    s = torch.tensor(src, dtype=torch.int32)
    d = None if dst is None else torch.tensor(dst, dtype=torch.int32)
    inp = lane_inputs(n, H, D, N, R, generator=g)
    out_buf = torch.full((n, H, D), float("nan"), dtype=torch.bfloat16)  # poisoned: every lane must be written
    out = decode_step(pool, 1, s, inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"],
                      w["xproj"], w["outproj"], z=inp["z"], zproj=w["zproj"], dst_slots=d,
                      tile_D=tile_D, num_warps=num_warps, out=out_buf)
    assert out is out_buf
    st, bs, xs = base[1]
    ref = gather_scatter_step(st, bs, xs, inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"],
                              w["xproj"], w["outproj"], z=inp["z"], zproj=w["zproj"], slots=s, dst_slots=d,
                              null_slot_id=pool.null_slot_id, update_kv_state=True, tile_D=tile_D,
                              num_warps=num_warps)
    assert bits_equal(out, ref)
    live = lane_is_live(s, P, pool.null_slot_id)
    assert not out[~live].any()  # padding lanes give zero out
    for a, b in zip(pool.layer_tensors(1), base[1]):
        assert bits_equal(a, b)
    for a, b in zip(pool.layer_tensors(0), before[0]):  # the other layer is untouched
        assert bits_equal(a, b)
    # written rows: exactly the dst of live lanes whose dst is live
    tgt = s if d is None else d
    written = set(tgt[live & lane_is_live(tgt, P, pool.null_slot_id)].tolist())
    for a, b in zip(pool.layer_tensors(1), before[1]):
        for row in range(P):
            assert bits_equal(a[row], b[row]) == (row not in written), row
    # and the hidden scratch rows never reach a visible row
    return out, s, inp, w, before


@pytest.mark.parametrize("null_slot", [False, True])
@pytest.mark.parametrize("with_dst", [False, True])
def test_decode_hook_matches_gather_scatter(null_slot, with_dst):
    _hook_vs_baseline(None, None, null_slot, with_dst, seed=10 + 2 * null_slot + with_dst)


def test_decode_hook_small_tile_stores_kv_in_the_kernel_up_to_a_cluster_and_scatters_beyond(monkeypatch):
    assert kv_update_in_kernel(D, N, R, torch.float32, None)
    assert kv_update_in_kernel(D, N, R, torch.float32, D)
    assert kv_update_in_kernel(D, N, R, torch.float32, 16)  # 2 D-tiles: one cluster
    _hook_vs_baseline(16, 2, False, True, seed=20)
    _hook_vs_baseline(16, 2, True, False, seed=21)
    # 16 D-tiles of 8 (D = 128) are more than a cluster: the hook scatters B/x itself
    monkeypatch.setitem(globals(), "D", 128)
    assert not kv_update_in_kernel(128, N, R, torch.float32, 8)
    _hook_vs_baseline(8, 1, False, True, seed=22)
    _hook_vs_baseline(8, 1, True, False, seed=23)


@pytest.mark.parametrize("tile_D", [None, 16])
def test_decode_hook_with_b_c_shared_by_the_heads_matches_gather_scatter(tile_D):
    """B/C with a head axis of 1: the B rows stored (by the kernel, or by the hook's masked scatter
    with tile_D < headdim, which used to fail on the head axis after the step had written the state)
    hold the shared B in every head."""
    pool = make_pool(L=1, P=8, seed=31)
    slots = torch.tensor([5, -1, 2, 0, 8], dtype=torch.int32)
    base = snapshot(pool)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(32))
    inp = lane_inputs(5, H, D, N, R, generator=torch.Generator().manual_seed(33))
    inp["B"], inp["C"] = inp["B"][:, :, :1].clone(), inp["C"][:, :, :1].clone()
    warps = 2 if tile_D else None
    out = decode_step(pool, 0, slots, **inp, **w, tile_D=tile_D, num_warps=warps)
    st, bs, xs = base[0]
    ref = gather_scatter_step(st, bs, xs, **inp, **w, slots=slots, update_kv_state=True, tile_D=tile_D,
                              num_warps=warps)
    assert bits_equal(out, ref)
    for a, b in zip(pool.layer_tensors(0), base[0]):
        assert bits_equal(a, b)
    Bstate = pool.Bstate(0)
    for row, lane in ((5, 0), (2, 2), (0, 3)):
        assert bits_equal(Bstate[row], inp["B"][lane].expand(R, H, N))


def test_decode_hook_against_float64_reference():
    out, s, inp, w, before = _hook_vs_baseline(None, None, False, False, seed=30)
    live = lane_is_live(s, 10, None)
    rows = s[live].long()
    st, bs, xs = before[1]
    sel = lambda t: t[live]  # noqa: E731
    _, y64 = step_math(StepTensors(st[rows], bs[rows], xs[rows], sel(inp["A"]), sel(inp["B"]), sel(inp["C"]),
                                   w["D"], sel(inp["x"]), sel(inp["dt"]), sel(inp["trap"]), w["xproj"], w["outproj"],
                                   z=sel(inp["z"]), zproj=w["zproj"]), compute_dtype=torch.float64)
    err = (out[live].double() - y64).abs()
    # bf16 output: one rounding of the output dtype relative to the value, plus fp32 noise
    assert (err <= 2 ** -8 * y64.abs() + 1e-4).all(), err.max()


# ---- a multi-step, multi-layer decode with joining and leaving requests --------------------
@pytest.mark.parametrize("null_slot", [False, True])
def test_multistep_multilayer_decode_matches_baseline(null_slot):
    L, P, max_batch = 3, 12, 6
    rng = random.Random(7 + null_slot)
    g = torch.Generator().manual_seed(7 + null_slot)
    pool = make_pool(L=L, P=P, seed=7, reserve_null_slot=null_slot)
    poison_bits(pool, 70)  # every request starts from reset rows, so NaN/inf poison is never read
    assert any(torch.isnan(t.float()).any() for t in (pool._state, pool._Bstate, pool._Xstate))
    base = snapshot(pool)
    weights = [layer_weights(H, D, R, generator=g) for _ in range(L)]
    runners = [CudaGraphStepRunner(pool, l, buckets=(1, 2, 4, 8), **weights[l]) for l in range(L)]
    live: list[int] = []
    seen_padding = seen_join = seen_leave = 0
    for step in range(8):
        for s in list(live):
            if len(live) > 1 and rng.random() < 0.35:
                live.remove(s)
                pool.free([s])
                seen_leave += 1
        k = min(rng.randint(1, 3), max_batch - len(live))
        if k > 0:
            new = pool.alloc(k, zero=True)
            for l in range(L):
                for t in base[l]:
                    t[new.long()] = 0
            live += new.tolist()
            seen_join += k
        rng.shuffle(live)
        slots = torch.tensor(live, dtype=torch.int32)
        n = len(live)
        seen_padding += choose_bucket(n, runners[0].buckets) - n
        x = x_base = None
        for l in range(L):
            before = [t.clone() for t in pool.layer_tensors(l)]
            inp = lane_inputs(n, H, D, N, R, generator=g)
            if l:
                inp["x"] = x
            out = runners[l].step(slots, **inp)
            st, bs, xs = base[l]
            ref = gather_scatter_step(st, bs, xs, inp["A"], inp["B"], inp["C"], weights[l]["D"],
                                      inp["x"] if l == 0 else x_base, inp["dt"], inp["trap"], weights[l]["xproj"],
                                      weights[l]["outproj"], z=inp["z"], zproj=weights[l]["zproj"], slots=slots,
                                      null_slot_id=pool.null_slot_id, update_kv_state=True)
            assert bits_equal(out, ref), (step, l)
            for a, b in zip(pool.layer_tensors(l), base[l]):
                assert bits_equal(a, b), (step, l)
            untouched = torch.ones(P, dtype=torch.bool)
            untouched[slots.long()] = False
            for a, b in zip(pool.layer_tensors(l), before):
                assert bits_equal(a[untouched], b[untouched]), (step, l)
                assert not bits_equal(a[slots.long()], b[slots.long()])  # live rows did change
            x, x_base = out, ref
    assert seen_padding > 0 and seen_join > 0 and seen_leave > 0


def test_runner_larger_than_every_bucket_runs_eagerly():
    pool = make_pool(L=1, P=8)
    base = snapshot(pool)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(8))
    runner = CudaGraphStepRunner(pool, 0, buckets=(1, 2), **w)
    slots = pool.alloc(5)
    inp = lane_inputs(5, H, D, N, R, generator=torch.Generator().manual_seed(9))
    out = runner.step(slots, **inp)
    assert runner.captured == ()
    st, bs, xs = base[0]
    ref = gather_scatter_step(st, bs, xs, inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"],
                              w["xproj"], w["outproj"], z=inp["z"], zproj=w["zproj"], slots=slots, update_kv_state=True)
    assert bits_equal(out, ref)
    for a, b in zip(pool.layer_tensors(0), base[0]):
        assert bits_equal(a, b)


def test_demo_style_decode_detects_a_stray_write():
    """The whole-pool comparison the decode tests rely on does catch one wrong row."""
    pool = make_pool(L=1, P=6)
    base = snapshot(pool)
    pool.state(0)[4, 1, 3, 5] += 1.0
    assert not bits_equal(pool.state(0), base[0][0])


# ---- misuse of the serving pieces -------------------------------------------------------------
def _bad_lane_inputs(n):
    """(named argument, inputs) pairs, each one defect that copy_ would broadcast or cast away."""
    good = lane_inputs(n, H, D, N, R, generator=torch.Generator().manual_seed(50))
    return [
        ("A", dict(good, A=good["A"][:, :1])),  # (n, 1): broadcast over the heads
        ("B", dict(good, B=good["B"][:, :, :1])),  # (n, R, 1, N): shared B into a runner built for H heads
        ("C", dict(good, C=good["C"][:, :, :1])),  # C shared while B is not: head 0's C for every head
        ("B", dict(good, B=good["B"].double())),  # float64: cast
        ("Bstate", dict(good, B=good["B"].float())),  # float32 into a bf16 pool: cast (B sets the group)
        ("x", dict(good, x=(good["x"] * 4).to(torch.int32))),  # integer x: cast
        ("dt", dict(good, dt=good["dt"][:1].expand(n, H).contiguous()[:, :1])),
        ("z", dict(good, z=good["z"][:, :, :1])),
    ]


@pytest.mark.parametrize("case", range(8))
def test_runner_validates_bucketed_steps_exactly_like_eager_ones(case):
    """The bucketed path used to copy_ the inputs into its buffers, broadcasting and casting."""
    pool = make_pool(L=1, P=8)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(51))
    bucketed = CudaGraphStepRunner(pool, 0, buckets=(4,), **w)
    eager = CudaGraphStepRunner(pool, 0, buckets=(1,), **w)
    slots = pool.alloc(3)
    name, inp = _bad_lane_inputs(3)[case]
    base = snapshot(pool)
    errors = []
    for runner in (bucketed, eager):
        with pytest.raises((TypeError, ValueError)) as info:
            runner.step(slots, **inp)
        errors.append((type(info.value), str(info.value)))
        assert str(info.value).startswith(f"{name}: expected"), str(info.value)
    assert errors[0] == errors[1]
    for a, b in zip(pool.layer_tensors(0), base[0]):  # nothing written
        assert bits_equal(a, b)
    assert bucketed.buffers(4) is None or not bucketed.buffers(4)["out"].any()


def test_runner_still_takes_cpu_slots_for_its_static_buffer():
    pool = make_pool(L=1, P=8)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(52))
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), **w)
    slots = pool.alloc(3)
    inp = lane_inputs(3, H, D, N, R, generator=torch.Generator().manual_seed(53))
    base = snapshot(pool)
    out = runner.step(slots, **inp)
    st, bs, xs = base[0]
    ref = gather_scatter_step(st, bs, xs, inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"],
                              w["xproj"], w["outproj"], z=inp["z"], zproj=w["zproj"], slots=slots,
                              update_kv_state=True)
    assert bits_equal(out, ref)


def test_allocator_is_thread_safe(monkeypatch):
    """8 threads doing free(alloc(3)) on 16 slots used to raise IndexError and lose slots."""
    monkeypatch.setattr(pool_module, "heapq", YieldingHeapq())
    pool = StatePool(1, 16, H, D, N, R)
    errors, held, guard = [], set(), threading.Lock()
    start = threading.Barrier(8)

    def worker():
        start.wait()
        for _ in range(400):
            try:
                got = pool.alloc(3).tolist()
            except PoolExhaustedError:
                continue
            except Exception as e:  # noqa: BLE001 - any other error is the bug
                errors.append(repr(e))
                return
            with guard:
                if held & set(got) or len(set(got)) != 3:
                    errors.append(f"slots {got} handed out twice")
                held.update(got)
            with guard:
                held.difference_update(got)
            try:
                pool.free(got)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    run_threads([worker] * 8)
    assert not errors, errors[:5]
    assert pool.num_free == 16 and pool.num_allocated == 0
    assert sorted(pool.alloc(16).tolist()) == list(range(16))


def test_pool_refuses_unsupported_sizes_at_construction():
    """headdim 48 / dstate 48 / mimo 3 are refused at construction, not at the first step."""
    from mamba3_step.contract import SUPPORTED_D, SUPPORTED_N, SUPPORTED_R

    for name, kw, listing in (("headdim", dict(headdim=48), SUPPORTED_D), ("dstate", dict(dstate=48), SUPPORTED_N),
                              ("mimo", dict(mimo=3), SUPPORTED_R)):
        args = dict(num_layers=1, num_slots=4, nheads=H, headdim=D, dstate=N, mimo=R)
        args.update(kw)
        with pytest.raises(ValueError, match=rf"^{name}: expected one of {re.escape(str(listing))}.*got"):
            StatePool(**args)


@pytest.mark.parametrize("value", ["no", 1, None])
def test_pool_reserve_null_slot_must_be_a_bool(value):
    """'no' used to reserve the null slot."""
    with pytest.raises(TypeError, match=r"^reserve_null_slot: expected a bool"):
        StatePool(1, 4, H, D, N, R, reserve_null_slot=value)


def test_pool_on_cuda_without_cuda_is_a_clear_error(monkeypatch):
    """Used to raise torch's AssertionError ('Torch not compiled with CUDA enabled')."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device: expected .*got 'cuda'.*CUDA is not available"):
        StatePool(1, 4, H, D, N, R, device="cuda")
    with pytest.raises(ValueError, match=r"^device: expected"):
        StatePool(1, 4, H, D, N, R, device="nonsense")


def test_a_cuda_pool_names_its_device_with_the_index_its_tensors_carry(monkeypatch):
    """Found on the H200 (2026-11-27): a pool made on "cuda" kept torch.device("cuda"), which is not
    equal to the "cuda:0" of the tensors made there, so ReplayStatePool.materialize refused the
    layer's own weights. checked_device resolves the index, as tensor construction does."""
    from mamba3_step.serving.pool_args import checked_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert checked_device("cuda") == torch.device("cuda", 1)
    assert checked_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert checked_device("cuda:0") == torch.device("cuda", 0)
    assert checked_device("cpu") == torch.device("cpu")


def test_pool_takes_numpy_integers_where_it_takes_ints():
    np = pytest.importorskip("numpy")
    pool = StatePool(np.int64(1), np.int32(6), np.int64(H), np.int64(D), np.int64(N), np.int64(R))
    got = pool.alloc(np.int64(3))
    assert got.tolist() == [0, 1, 2]
    pool.free(np.int64(1))
    pool.free([np.int32(0)])
    pool.free(np.array([2]))
    assert pool.num_free == 6
    pool.alloc(np.int64(2), zero=True)
    assert pool.state(np.int64(0)).shape == (6, H, D, N)
    with pytest.raises(ValueError, match="n: expected a non-negative int, got True"):
        pool.alloc(True)


def test_runner_refuses_a_declared_argument_it_has_no_buffer_for():
    """``rand_rows`` is a declared argument the runner does not capture: refused by name, nothing
    changed (it was silently ignored); ``rand_seed`` is the runner's, fixed at construction."""
    pool = StatePool(1, 6, 2, 32, 32, 2, state_dtype="bfloat16")
    slots = pool.alloc(3).to(torch.int32)
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), **layer_weights(2, 32, 2))
    lanes = lane_inputs(3, 2, 32, 32, 2)
    before = [t.clone() for t in pool.layer_tensors(0)]
    with pytest.raises(ValueError, match="rand_rows: a CudaGraphStepRunner does not take rand_rows"):
        runner.step(slots, **lanes, rand_rows=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="rand_seed"):
        runner.step(slots, **lanes, rand_seed=torch.tensor([1, 2]))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, pool.layer_tensors(0)))
