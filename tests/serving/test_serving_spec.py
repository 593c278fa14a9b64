"""CPU tests of speculative decoding in mamba3_step.serving.

* ``StatePool``'s speculative groups: ``alloc_spec`` / ``spec_indices`` / ``commit_accepted`` (rollback
  by index: no row is touched) / ``current_rows`` / ``free_spec``, their named errors (a failed call
  changes nothing) and their thread safety;
* ``decode_step`` with T tokens per lane: a verify step equals T one-token ``decode_step`` calls bit
  for bit (out, every row of every layer), with the kernel's B/x store and with the hook's own
  masked scatter (``tile_D < headdim``), padding lanes and padding tokens included;
* ``CudaGraphStepRunner`` with T tokens (its CPU path: the same static buffers and padding, no
  graphs): equal to eager ``decode_step``, padded lanes padding, each (bucket, form) its own
  buffers, and bad T-token input refused exactly as eagerly, changing nothing.

Letters: B lanes, T tokens per lane, K candidate source rows, P pool rows, H heads, D head dim,
N state size, R MIMO rank, L layers.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from helpers import YieldingHeapq, assert_bits_equal, fast_thread_switching, run_threads

from mamba3_step.contract import lane_is_live, source_rows
from mamba3_step.serving import (CudaGraphStepRunner, PoolExhaustedError, SlotError, StatePool, StepForm, decode_step, gather_scatter_step, kv_update_in_kernel)
from mamba3_step.serving import pool as pool_module
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, poison_pool, speculative_indices

H, D, N, R = 2, 32, 32, 2
ROWS = ("state", "Bstate", "Xstate")


def make_pool(L=2, P=24, seed=0, **kw):
    pool = StatePool(L, P, H, D, N, R, **kw)
    poison_pool(pool, torch.Generator().manual_seed(seed))
    return pool


def snapshot(pool):
    return [t.clone() for t in (pool._state, pool._Bstate, pool._Xstate)]


def assert_pool_equal(pool, snap, what=""):
    for name, a, b in zip(ROWS, (pool._state, pool._Bstate, pool._Xstate), snap):
        assert_bits_equal(a, b, f"{what} {name}")


def twin(pool):
    """A copy of ``pool`` (rows and allocator) to run the same steps another way."""
    other = StatePool(pool.num_layers, pool.num_slots, H, D, N, R, reserve_null_slot=pool.reserve_null_slot)
    for a, b in zip((other._state, other._Bstate, other._Xstate), (pool._state, pool._Bstate, pool._Xstate)):
        a.copy_(b)
    return other


def step_args(inp, w):
    """decode_step's positional A .. outproj and its z/zproj keywords from lane inputs and weights."""
    pos = (inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"], w["xproj"], w["outproj"])
    return pos, dict(z=inp["z"], zproj=w["zproj"])


def allocator_state(pool, groups):
    return (pool.num_free, pool.allocated_slots(), pool.current_rows(groups).tolist(),
            pool.spec_indices(groups).num_accepted_tokens.tolist())


# ---- StatePool: speculative groups --------------------------------------------------------------
def test_alloc_spec_hands_out_whole_groups_of_the_lowest_rows_and_free_spec_recycles_them():
    np = pytest.importorskip("numpy")
    pool = make_pool(L=2, P=12)
    plain = pool.alloc(1)
    groups = pool.alloc_spec(2, 4)
    assert groups.dtype == torch.int32 and groups.device.type == "cpu" and groups.shape == (2, 4)
    assert groups.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert pool.num_allocated == 9 and pool.num_free == 3
    assert pool.current_rows(groups).tolist() == [1, 5]  # a new group continues from its row 0
    idx = pool.spec_indices(groups)
    assert idx.state_batch_indices.tolist() == groups.tolist() == idx.dst_state_batch_indices.tolist()
    assert idx.num_accepted_tokens.tolist() == [1, 1] and idx.num_accepted_tokens.dtype == torch.int32
    assert idx.state_batch_indices.data_ptr() != idx.dst_state_batch_indices.data_ptr()
    pool.free_spec(groups[0])  # one request's (T,) rows
    assert pool.num_free == 7 and not any(pool.is_allocated(s) for s in (1, 2, 3, 4))
    again = pool.alloc_spec(np.int64(1), np.int32(3))  # numpy integers count as ints
    assert again.tolist() == [[1, 2, 3]] and pool.current_rows(again).tolist() == [1]
    pool.free_spec(groups[1:])  # an (n, T) stack
    pool.free_spec([[1, 2, 3]])  # nested lists work too
    pool.free(plain)
    assert pool.num_free == 12 and pool.alloc_spec(0, 4).shape == (0, 4)


def test_alloc_spec_zero_resets_exactly_the_group_rows_in_every_layer():
    pool = make_pool(L=3, P=10, seed=1)
    before = snapshot(pool)
    groups = pool.alloc_spec(2, 3, zero=True)
    rows = groups.reshape(-1).long()
    others = torch.ones(11, dtype=torch.bool)  # Bstate/Xstate have the hidden scratch row
    others[rows] = False
    for name, a, b in zip(ROWS, (pool._state, pool._Bstate, pool._Xstate), before):
        assert not a[:, rows].any(), name
        assert_bits_equal(a[:, others[: a.shape[1]]], b[:, others[: a.shape[1]]], f"{name} other rows")


def test_commit_accepted_remaps_by_index_and_touches_no_row():
    np = pytest.importorskip("numpy")
    pool = make_pool(L=2, P=16, seed=2)
    groups = pool.alloc_spec(3, 4)
    before = snapshot(pool)
    pool.commit_accepted(groups, torch.tensor([2, 4, 1], dtype=torch.int32))
    assert pool.current_rows(groups).tolist() == [groups[0, 1], groups[1, 3], groups[2, 0]]
    idx = pool.spec_indices(groups[[2, 0]])  # any subset, any order
    assert idx.num_accepted_tokens.tolist() == [1, 2]
    assert idx.state_batch_indices.tolist() == groups[[2, 0]].tolist()
    picked = source_rows(idx.state_batch_indices, idx.num_accepted_tokens)
    assert picked.tolist() == pool.current_rows(groups[[2, 0]]).tolist()  # the kernel reads the committed row
    pool.commit_accepted(groups[1:2], [3])  # a list, one group
    pool.commit_accepted(groups[0], np.array([4]))  # numpy counts, a (T,) group
    assert pool.current_rows(groups).tolist() == [groups[0, 3], groups[1, 2], groups[2, 0]]
    assert_pool_equal(pool, before, "after commits")  # index remapping: nothing copied
    assert pool.spec_indices(groups, device="cpu").num_accepted_tokens.tolist() == [4, 3, 1]


def _misuse_cases():
    """(id, setup(pool, groups) -> extra or None, call(pool, groups, plain_slot, extra), exception, message
    regex). ``groups`` is (3, 4), committed [2, 3, 1]; the pool has 16 rows and one plain slot, 12."""
    def free_second(p, g):
        p.free_spec(g[1])

    def mixed(p, g):
        p.free_spec(g[2])
        return p.alloc_spec(1, 2)[0]

    return [
        ("alloc-exhausted", None, lambda p, g, s, e: p.alloc_spec(1, 4), PoolExhaustedError,
         r"asked for 1 speculative group\(s\) of T=4 rows \(4 slots\), 3 free of 16"),
        ("alloc-T-zero", None, lambda p, g, s, e: p.alloc_spec(1, 0), ValueError, r"^T: expected an int in \[1, 16\]"),
        ("alloc-T-over", None, lambda p, g, s, e: p.alloc_spec(1, 17), ValueError, r"^T: .*got 17"),
        ("alloc-T-bool", None, lambda p, g, s, e: p.alloc_spec(1, True), ValueError, r"^T: .*got True"),
        ("alloc-n-negative", None, lambda p, g, s, e: p.alloc_spec(-1, 2), ValueError, r"^n: expected a non-negative"),
        ("free-group-row", None, lambda p, g, s, e: p.free(g[1, 2]), SlotError,
         r"^slots\[0\]: cannot free slot 6: it is a row of the speculative group \[4, 5, 6, 7\]; .*free_spec"),
        ("free-spec-partial", None, lambda p, g, s, e: p.free_spec(g[0, :2]), SlotError,
         r"^groups\[0\]: expected the rows of one speculative group.*got \[0, 1\]: they are rows of the group"),
        ("free-spec-reordered", None, lambda p, g, s, e: p.free_spec(g[0].flip(0)), SlotError, r"^groups\[0\]: "),
        ("free-spec-plain-slot", None, lambda p, g, s, e: p.free_spec([s]), SlotError,
         r"^groups\[0\]: .*slot 12 is a plain slot \(from alloc\), not a group row"),
        ("free-spec-twice-in-a-call", None, lambda p, g, s, e: p.free_spec(g[[0, 2, 0]]), SlotError,
         r"^groups\[2\]: the group \[0, 1, 2, 3\] is listed twice"),
        ("free-spec-double-free", free_second, lambda p, g, s, e: p.free_spec(g[[0, 1]]), SlotError,
         r"^groups\[1\]: .*slot 4 is not allocated \(double free\?\)"),
        ("free-spec-float", None, lambda p, g, s, e: p.free_spec(g.float()), TypeError,
         r"^groups: expected an integer tensor"),
        ("free-spec-3d", None, lambda p, g, s, e: p.free_spec(g[None]), ValueError, r"^groups: expected a \(T,\) or"),
        ("free-spec-empty-group", None, lambda p, g, s, e: p.free_spec(g[:, :0]), SlotError, r"an empty group"),
        ("free-spec-not-a-tensor", None, lambda p, g, s, e: p.free_spec(3.5), TypeError, r"^groups: expected"),
        ("commit-zero", None, lambda p, g, s, e: p.commit_accepted(g, [1, 0, 1]), ValueError,
         r"^num_accepted_tokens\[1\]: expected an accepted count in \[1, T=4\].*got 0"),
        ("commit-over", None, lambda p, g, s, e: p.commit_accepted(g, torch.tensor([5, 1, 1])), ValueError,
         r"^num_accepted_tokens\[0\]: .*got 5"),
        ("commit-length", None, lambda p, g, s, e: p.commit_accepted(g, [1, 1]), ValueError,
         r"^num_accepted_tokens: expected 3 counts \(one per group\), got 2"),
        ("commit-float", None, lambda p, g, s, e: p.commit_accepted(g, torch.ones(3)), TypeError,
         r"^num_accepted_tokens: expected an integer tensor of counts"),
        ("commit-2d-counts", None, lambda p, g, s, e: p.commit_accepted(g, torch.ones(3, 1, dtype=torch.int32)),
         ValueError, r"^num_accepted_tokens: expected a 0-d or 1-d tensor of counts"),
        ("commit-bad-group-last", None, lambda p, g, s, e: p.commit_accepted([g[0], g[1], [13, 14]], [4, 4, 1]),
         SlotError, r"^groups\[2\]: .*slot 13 is not allocated \(double free\?\)"),
        ("indices-mixed-T", mixed, lambda p, g, s, e: p.spec_indices([g[0], e]), ValueError,
         r"^groups: expected groups of one size T .* got sizes \[2, 4\]"),
        ("indices-bad-device", None, lambda p, g, s, e: p.spec_indices(g, device="nonsense"), ValueError,
         r"^device: expected a torch device"),
        ("current-rows-freed", free_second, lambda p, g, s, e: p.current_rows(g), SlotError,
         r"^groups\[1\]: .*slot 4 is not allocated \(double free\?\)"),
    ]


@pytest.mark.parametrize("case", _misuse_cases(), ids=lambda c: c[0])
def test_speculative_misuse_is_a_named_error_and_changes_nothing(case):
    _, setup, call, exc, message = case
    pool = make_pool(L=1, P=16, seed=3)
    groups = pool.alloc_spec(3, 4)
    plain = int(pool.alloc(1)[0])
    pool.commit_accepted(groups, [2, 3, 1])
    extra = setup(pool, groups) if setup else None
    live = groups[[g for g in range(3) if pool._groups.group_of(int(groups[g, 0])) == tuple(groups[g].tolist())]]
    before, bookkeeping = snapshot(pool), allocator_state(pool, live)
    with pytest.raises(exc, match=message):
        call(pool, groups, plain, extra)
    assert allocator_state(pool, live) == bookkeeping  # free list, allocated slots, committed rows and counts
    assert pool.is_allocated(plain)
    assert_pool_equal(pool, before)


def test_speculative_bookkeeping_is_thread_safe(monkeypatch):
    """Threads allocating, committing, reading and freeing groups at once never share a row or lose one."""
    monkeypatch.setattr(pool_module, "heapq", YieldingHeapq())
    pool = StatePool(1, 12, H, D, N, R)  # 6 threads want up to 24 rows at once: the pool runs out often
    errors, held, guard = [], set(), threading.Lock()
    start = threading.Barrier(6)

    def worker(k):
        start.wait()
        for i in range(150):
            try:
                g = pool.alloc_spec(1, 1 + (k + i) % 4)
            except PoolExhaustedError:
                continue
            rows = set(g.reshape(-1).tolist())
            with guard:
                if held & rows:
                    errors.append(f"rows {sorted(rows)} handed out twice")
                held.update(rows)
            try:
                pool.commit_accepted(g, [g.shape[1]])
                if pool.current_rows(g).tolist() != [int(g[0, -1])]:
                    errors.append("current_rows is not the committed row")
                if pool.spec_indices(g).num_accepted_tokens.tolist() != [g.shape[1]]:
                    errors.append("spec_indices lost the count")
                with guard:
                    held.difference_update(rows)
                pool.free_spec(g)
            except Exception as e:  # noqa: BLE001 - any error is the bug
                errors.append(repr(e))
                return

    run_threads([functools.partial(worker, k) for k in range(6)])
    assert not errors, errors[:5]
    assert pool.num_free == 12 and pool.num_allocated == 0 and not pool._groups._rows


def test_racing_frees_of_one_group_free_it_once(monkeypatch):
    """Four threads free the same group at once: exactly one succeeds, the others get SlotError, and
    no row lands in the free list twice."""
    monkeypatch.setattr(pool_module, "heapq", YieldingHeapq())
    pool = StatePool(1, 8, H, D, N, R)
    with fast_thread_switching():
        for _ in range(60):
            group = pool.alloc_spec(1, 4)
            results, start = [], threading.Barrier(4)

            def racer():
                start.wait()
                try:
                    pool.free_spec(group)
                    results.append("freed")
                except SlotError:
                    results.append("refused")
                except Exception as e:  # noqa: BLE001 - anything else is the bug
                    results.append(repr(e))

            run_threads([racer] * 4)
            assert sorted(results) == ["freed", "refused", "refused", "refused"], results
            assert pool.num_free == 8
    assert sorted(pool.alloc(8).tolist()) == list(range(8))


# ---- decode_step with T tokens ------------------------------------------------------------------
def _verify_batch(pool, T, seed):
    """Four requests' groups with random committed counts, then padding lanes (a padding source of
    each kind, a count of 0); returns (slots (B, T), nat (B,), dst (B, T), live (B,) bool)."""
    g = torch.Generator().manual_seed(seed)
    groups = pool.alloc_spec(4, T)
    pool.commit_accepted(groups, torch.randint(1, T + 1, (4,), generator=g))
    idx = pool.spec_indices(groups)
    P, pad = pool.num_slots, pool.pad_id
    pad_rows = torch.tensor([[pad] * T, [P] * T, [-(2**31)] * T], dtype=torch.int32)
    count_zero = groups[:1].clone()  # a real group whose count is 0: padding, must not be touched
    slots = torch.cat([idx.state_batch_indices, pad_rows, count_zero])
    nat = torch.cat([idx.num_accepted_tokens, torch.tensor([1, 1, 1, 0], dtype=torch.int32)])
    dst = torch.cat([idx.dst_state_batch_indices, groups[1:4], groups[:1]])  # padding lanes aim at live rows
    live = lane_is_live(source_rows(slots, nat), P, pool.null_slot_id)
    assert live.tolist() == [True] * 4 + [False] * 4
    return slots, nat, dst, live


@pytest.mark.parametrize("null_slot", [False, True])
@pytest.mark.parametrize("tile_D", [None, 16])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 8])
def test_t_token_decode_step_is_t_one_token_decode_steps(T, tile_D, null_slot):
    """The verify step (x (B, T, H, D), (B, T) sources with counts, (B, T) destinations) against T
    plain decode_step calls, token t reading the row token t - 1 wrote: out and every row of every
    layer bit for bit. tile_D=16 < D makes the hook store B/x itself (masked scatter per token)."""
    pool = make_pool(L=2, P=4 * T + 3, seed=T, reserve_null_slot=null_slot)
    slots, nat, dst, live = _verify_batch(pool, T, seed=10 + T)
    chain = twin(pool)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(T))
    inp = lane_inputs(8, H, D, N, R, tokens=T, generator=torch.Generator().manual_seed(20 + T))
    warps = 2 if tile_D else None
    untouched_layer = [t[0].clone() for t in (pool._state, pool._Bstate, pool._Xstate)]
    pos, kw = step_args(inp, w)
    out = decode_step(pool, 1, slots, *pos, **kw, dst_slots=dst, num_accepted_tokens=nat, tile_D=tile_D,
                      num_warps=warps)
    src = torch.where(live, source_rows(slots, nat), -1).to(torch.int32)
    for t in range(T):
        pos_t, kw_t = step_args({k: v[:, t] for k, v in inp.items()}, w)
        o = decode_step(chain, 1, src, *pos_t, **kw_t, dst_slots=dst[:, t].contiguous(), tile_D=tile_D,
                        num_warps=warps)
        assert_bits_equal(out[:, t], o, f"out of token {t}")
        src = torch.where(live, dst[:, t], -1).to(torch.int32)  # the next token reads this token's row
    assert not out[~live].any()
    assert_pool_equal(pool, snapshot(chain), "pool vs one-token chain")
    for a, b in zip((pool._state, pool._Bstate, pool._Xstate), untouched_layer):
        assert_bits_equal(a[0], b, "layer 0 (not stepped)")


@pytest.mark.parametrize("tile_D", [None, 16])
@pytest.mark.parametrize("form", ["gaps", "final-dst", "no-dst"])
def test_t_token_decode_step_matches_gather_dense_scatter(form, tile_D):
    """Every padding kind in the sources and in single tokens' destinations (speculative_indices),
    and the (B,) final-destination and no-destination forms, against the baseline."""
    T, B, P = 4, 8, 40
    pool = make_pool(L=1, P=P, seed=5, reserve_null_slot=True)
    sbi, nat, dst, kinds = speculative_indices(B, P, T, null_slot_id=pool.null_slot_id, seed=6)
    assert {"live_gaps", "count_zero", "count_over", "negative", "oob", "null"} <= set(kinds)
    if form != "gaps":
        dst = None if form == "no-dst" else dst[:, -1].contiguous()
    base = snapshot(pool)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(7))
    inp = lane_inputs(B, H, D, N, R, tokens=T, generator=torch.Generator().manual_seed(8))
    pos, kw = step_args(inp, w)
    out = decode_step(pool, 0, sbi, *pos, **kw, dst_slots=dst, num_accepted_tokens=nat, tile_D=tile_D,
                      num_warps=2 if tile_D else None)
    st, bs, xs = (t[0, :P] for t in base)
    ref = gather_scatter_step(st, bs, xs, *pos, **kw, slots=sbi, dst_slots=dst, num_accepted_tokens=nat,
                              null_slot_id=pool.null_slot_id, update_kv_state=True, tile_D=tile_D,
                              num_warps=2 if tile_D else None)
    assert_bits_equal(out, ref, "out")
    for name, a, b in zip(ROWS, pool.layer_tensors(0), (st, bs, xs)):
        assert_bits_equal(a, b, name)
    assert_bits_equal(pool._Bstate[0, 0], base[1][0, 0], "the null row")


# ---- CudaGraphStepRunner with T tokens (CPU path) -----------------------------------------------
@pytest.mark.parametrize("null_slot", [False, True])
def test_runner_t_token_steps_equal_eager_and_pad_their_lanes(null_slot):
    T = 3
    pool = make_pool(L=1, P=20, seed=9, reserve_null_slot=null_slot)
    groups = pool.alloc_spec(5, T)
    pool.commit_accepted(groups, [3, 1, 2, 2, 1])
    eager = twin(pool)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(10))
    runner = CudaGraphStepRunner(pool, 0, buckets=(2, 4), with_dst=True, **w)
    form = StepForm.speculative(T)
    g = torch.Generator().manual_seed(11)
    for step, lanes in enumerate(([0, 1, 2, 3], [4, 2, 0], [1], [3, 0, 4, 2, 1])):  # 4, 3 (padded), 1 (padded), 5
        idx = pool.spec_indices(groups[lanes])
        inp = lane_inputs(len(lanes), H, D, N, R, tokens=T, generator=g)
        before = snapshot(pool)
        out = runner.step(idx.state_batch_indices, dst_slots=idx.dst_state_batch_indices,
                          num_accepted_tokens=idx.num_accepted_tokens, **inp)
        pos, kw = step_args(inp, w)
        ref = decode_step(eager, 0, idx.state_batch_indices, *pos, **kw, dst_slots=idx.dst_state_batch_indices,
                          num_accepted_tokens=idx.num_accepted_tokens)
        assert_bits_equal(out, ref, f"step {step} out")
        assert_pool_equal(pool, snapshot(eager), f"step {step}")
        written = groups[lanes].reshape(-1).long()
        others = torch.ones(pool.num_slots, dtype=torch.bool)
        others[written] = False
        for name, a, b in zip(ROWS, pool.layer_tensors(0), before):
            assert_bits_equal(a[others], b[0, : pool.num_slots][others], f"step {step} {name} other rows")
        pool.commit_accepted(groups[lanes], torch.randint(1, T + 1, (len(lanes),), generator=g))
    s = runner.buffers(4, form)
    assert s["slots"].shape == (4, T) and s["dst"].shape == (4, T) and s["x"].shape == (4, T, H, D)
    assert s["slots"][3].tolist() == [pool.pad_id] * T and s["dst"][3].tolist() == [pool.pad_id] * T
    assert s["nat"][3] == 1
    for name in ("A", "dt", "trap", "B", "C", "x", "z"):
        assert not s[name][3].any(), name
    assert not s["out"][3].any()
    small = runner.buffers(2, form)
    assert small["slots"][1].tolist() == [pool.pad_id] * T  # the one-lane step padded lane 1
    assert [k for k in runner.captured] == [(2, form), (4, form)]  # the 5-lane step ran eagerly
    assert runner.captured_buckets == ()  # no plain form captured


def test_runner_keeps_a_bucket_per_form_and_the_plain_form_unchanged():
    """One bucket in four forms: plain (T-less), T tokens with (n,) indices, a verify step with the
    default and with per-token destinations; each has its own buffers, every step equals eager
    decode_step, and the plain form still works after the others."""
    pool = make_pool(L=1, P=20, seed=12)
    plain_slots = pool.alloc(3)
    groups = pool.alloc_spec(3, 2)
    eager = twin(pool)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(13))
    runner = CudaGraphStepRunner(pool, 0, buckets=(4,), with_dst=True, **w)
    g = torch.Generator().manual_seed(14)
    pool.commit_accepted(groups, [2, 1, 2])  # sources off column 0: the default destination must follow them
    idx = pool.spec_indices(groups)
    nat = dict(num_accepted_tokens=idx.num_accepted_tokens)
    calls = [
        ("plain", plain_slots, {}, None),  # (n,) slots, T-less inputs
        ("tokens", plain_slots, {}, 2),  # T tokens, (n,) sources, default (n,) destination: the source
        ("verify", groups, nat, 2),  # (n, T) sources, default (n,) destination: the source row
        ("verify-dst", groups, dict(nat, dst_slots=idx.dst_state_batch_indices), 2),
        ("plain-again", plain_slots, {}, None),
    ]
    for what, slots, extra, T in calls:
        inp = lane_inputs(3, H, D, N, R, tokens=T, generator=g)
        out = runner.step(slots, **inp, **extra)
        pos, kw = step_args(inp, w)
        ref = decode_step(eager, 0, slots, *pos, **kw, **extra)
        assert_bits_equal(out, ref, what)
        assert_pool_equal(pool, snapshot(eager), what)
    forms = [f for _, f in runner.captured]
    assert set(forms) == {StepForm(), StepForm(2), StepForm(2, 2), StepForm(2, 2, True)}
    assert runner.captured_buckets == (4,)
    assert runner.buffers(4)["x"].shape == (4, H, D) and runner.buffers(4, StepForm(2))["x"].shape == (4, 2, H, D)
    # the verify form's default destination is each lane's source row
    assert runner.buffers(4, StepForm(2, 2))["dst"][:3].tolist() == pool.current_rows(groups).tolist()


def _bad_t_token_calls(n, T):
    """(named argument, change to a valid verify call) pairs, each one defect."""
    def dropped(key):
        return lambda kw: kw.pop(key)

    return [
        ("num_accepted_tokens", dropped("num_accepted_tokens")),
        ("num_accepted_tokens", lambda kw: kw.update(num_accepted_tokens=kw["num_accepted_tokens"].long())),
        ("num_accepted_tokens", lambda kw: kw.update(num_accepted_tokens=kw["num_accepted_tokens"][:-1])),
        ("num_accepted_tokens", lambda kw: kw.update(num_accepted_tokens=kw["num_accepted_tokens"].tolist())),
        ("dst_state_batch_indices", lambda kw: kw.update(dst_slots=kw["dst_slots"][:, :-1].contiguous())),
        ("dst_state_batch_indices", lambda kw: kw.update(dst_slots=kw["dst_slots"].long())),
        ("state_batch_indices", lambda kw: kw.update(slots=kw["slots"][:, :0])),
        ("B", lambda kw: kw.update(B=kw["B"][:, :1])),  # T = 1 tokens of B against T of x: no broadcast
        ("dt", lambda kw: kw.update(dt=kw["dt"][:, 0])),  # no token axis
        ("x", lambda kw: kw.update(**{k: torch.cat([kw[k]] * 6, 1) for k in ("A", "B", "C", "x", "dt", "trap", "z")})),
        ("dst_state_batch_indices", lambda kw: kw.update(**{k: kw[k][:, 0] for k in ("A", "B", "C", "x", "dt", "trap",
                                                                                     "z")})),
    ]


@pytest.mark.parametrize("case", range(11))
def test_runner_refuses_bad_t_token_input_exactly_like_eager(case):
    """Bucketed (after the bucket's buffers exist), unbucketed and plain decode_step refuse each defect
    with the same exception and message, naming the argument; nothing is written."""
    T, n = 3, 3
    pool = make_pool(L=1, P=16, seed=15)
    groups = pool.alloc_spec(n, T)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(16))
    bucketed = CudaGraphStepRunner(pool, 0, buckets=(4,), with_dst=True, **w)
    unbucketed = CudaGraphStepRunner(pool, 0, buckets=(1,), with_dst=True, **w)
    idx = pool.spec_indices(groups)
    good = dict(slots=idx.state_batch_indices, dst_slots=idx.dst_state_batch_indices,
                num_accepted_tokens=idx.num_accepted_tokens,
                **lane_inputs(n, H, D, N, R, tokens=T, generator=torch.Generator().manual_seed(17)))
    bucketed.step(**good)  # the bucket's verify-form buffers exist now
    name, change = _bad_t_token_calls(n, T)[case]
    bad = dict(good)
    change(bad)
    before, buffers = snapshot(pool), {k: v.clone() for k, v in bucketed.buffers(4, StepForm.speculative(T)).items()}
    errors = []
    for runner in (bucketed, unbucketed):
        with pytest.raises((TypeError, ValueError)) as info:
            runner.step(**bad)
        errors.append((type(info.value), str(info.value)))
    inp = {k: bad.get(k) for k in ("A", "B", "C", "x", "dt", "trap", "z")}
    pos, kw = step_args(inp, w)
    with pytest.raises((TypeError, ValueError)) as info:
        decode_step(pool, 0, bad["slots"], *pos, **kw, dst_slots=bad.get("dst_slots"),
                    num_accepted_tokens=bad.get("num_accepted_tokens"))
    errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1] == errors[2], errors
    assert errors[0][1].startswith(f"{name}:"), errors[0][1]
    assert_pool_equal(pool, before, "after a refused step")
    for key, value in bucketed.buffers(4, StepForm.speculative(T)).items():
        assert_bits_equal(value, buffers[key], f"static {key}")


def test_runner_capture_refuses_impossible_forms():
    pool = make_pool(L=1, P=8)
    w = layer_weights(H, D, R, generator=torch.Generator().manual_seed(18))
    with_dst = CudaGraphStepRunner(pool, 0, buckets=(2,), with_dst=True, **w)
    without = CudaGraphStepRunner(pool, 0, buckets=(2,), **w)
    with pytest.raises(ValueError, match=r"^form: dst_per_token needs tokens .* with_dst=True"):
        without.capture(form=StepForm.speculative(2))
    with pytest.raises(ValueError, match=r"^form: dst_per_token needs tokens"):
        with_dst.capture(form=StepForm(None, 2, True))
    with pytest.raises(ValueError, match=r"^form: tokens must be None or an int in \[1, 16\], got 17"):
        with_dst.capture(form=StepForm(17))
    with pytest.raises(ValueError, match=r"^form: candidates must be None or a positive int, got 0"):
        with_dst.capture(form=StepForm(2, 0))
    with pytest.raises(TypeError, match=r"^form: expected a StepForm or None, got tuple"):
        with_dst.capture(form=(2, 2, True))
    assert with_dst.captured == () and without.captured == ()
    with_dst.capture(form=StepForm.speculative(2))
    assert with_dst.captured == ((2, StepForm(2, 2, True)),)
    s = with_dst.buffers(2, StepForm.speculative(2))
    assert s["slots"].tolist() == [[-1, -1]] * 2 and s["nat"].tolist() == [1, 1]  # captured all padding


def test_decode_step_stores_b_x_itself_when_no_whole_head_tiling_keeps_t_tokens():
    """N=256 D=128 R=8 fp32 has no whole-head tiling for T > 1 (its default halves tile_D), so
    update_kv_state cannot run in the kernel: decode_step stores B/x itself, and the T-token step
    still equals T one-token steps."""
    assert kv_update_in_kernel(128, 256, 8, torch.float32, None, tokens=1)
    assert not kv_update_in_kernel(128, 256, 8, torch.float32, None, tokens=2)
    T, n = 2, 2
    pool, twin = (StatePool(1, 16, 1, 128, 256, 8, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16) for _ in "ab")
    poison_pool(pool)
    for a, b in zip(pool.layer_tensors(0), twin.layer_tensors(0)):
        b.copy_(a)
    groups = pool.alloc_spec(n, T)
    assert torch.equal(twin.alloc_spec(n, T), groups)
    idx = pool.spec_indices(groups)
    w = layer_weights(1, 128, 8, generator=torch.Generator().manual_seed(3))
    inp = lane_inputs(n, 1, 128, 256, 8, tokens=T, generator=torch.Generator().manual_seed(4))
    out = decode_step(pool, 0, idx.state_batch_indices, inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"],
                      inp["trap"], w["xproj"], w["outproj"], z=inp["z"], zproj=w["zproj"],
                      num_accepted_tokens=idx.num_accepted_tokens, dst_slots=idx.dst_state_batch_indices)
    rows = groups[:, 0].clone()
    for t in range(T):
        tok = {k: (v[:, t] if v is not None else None) for k, v in inp.items()}
        o = decode_step(twin, 0, rows, tok["A"], tok["B"], tok["C"], w["D"], tok["x"], tok["dt"], tok["trap"],
                        w["xproj"], w["outproj"], z=tok["z"], zproj=w["zproj"], dst_slots=groups[:, t].contiguous())
        rows = groups[:, t].contiguous()
        assert bits_equal(out[:, t], o)
    for a, b in zip(pool.layer_tensors(0), twin.layer_tensors(0)):
        assert bits_equal(a, b)
