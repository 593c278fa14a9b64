"""A replay pool (``ReplayStatePool(..., replay_ring=K)``): rings per layer, decode_step and the graph runner through
them, materialize, and the row operations (docs/contract.md, "Replay"; docs/integration.md, section 11).

Every check is against a stepwise pool driven with the same inputs: outputs bit for bit, and the
materialized current state equal to the stepwise pool's rows, over decodes that cross flushes while
requests join, leave and fork, with padding lanes. CPU tensors (the CPU path); tests/gpu/test_gpu_replay.py
runs the same on the kernel.

Letters: B lanes, P pool rows (slots), H heads, D head dim, N state size, R MIMO rank, K flush length.
"""

from __future__ import annotations

import pytest
import torch

from mamba3_step.serving import CudaGraphStepRunner, ReplayStatePool, StatePool, decode_step
from mamba3_step.testing import lane_inputs, layer_weights

H, D, N, R, P = 2, 32, 64, 2, 8


def _pools(K: int, **kw):
    return ReplayStatePool(2, P, H, D, N, R, replay_ring=K, **kw), StatePool(2, P, H, D, N, R, **kw)


def _seed_rows(pools, slots, g):
    for layer in range(2):
        fresh = torch.randn(len(slots), H, D, N, generator=g)
        for pool in pools:
            pool.state(layer)[slots.long()] = fresh


def _check_current(replay, stepwise, layer, slots, w):
    cur = replay.materialize(layer, slots, xproj=w["xproj"], D=w["D"], zproj=w["zproj"], outproj=w["outproj"])
    rows = slots.long()
    for name in ("state", "Bstate", "Xstate"):
        assert torch.equal(getattr(cur, name), getattr(stepwise, name)(layer)[rows]), name


@pytest.mark.parametrize("K", [2, 4])
def test_replay_pool_decodes_as_the_stepwise_pool(K):
    """Join, step, fork mid-ring, leave, step with padding lanes: every out equal bit for bit, every
    live row's materialized state equal to the stepwise pool's row, at every step and layer."""
    g = torch.Generator().manual_seed(K)
    replay, stepwise = _pools(K)
    w = layer_weights(H, D, R, generator=g)
    live = replay.alloc(3)
    assert torch.equal(live, stepwise.alloc(3))
    _seed_rows((replay, stepwise), live, g)
    for step in range(3 * K + 1):
        if step == K + 1:  # fork a request whose ring is part full
            forked = replay.fork(int(live[0]), 2)
            assert torch.equal(forked, stepwise.fork(int(live[0]), 2))
            assert replay.ring(0).length[forked.long(), 0].tolist() == [replay.ring(0).length[int(live[0]), 0]] * 2
            live = torch.cat([live, forked])
        if step == 2 * K:  # one leaves; a new one joins into a reset row
            for pool in (replay, stepwise):
                pool.free(live[1:2])
            live = torch.cat([live[:1], live[2:]])
            new = replay.alloc(1, zero=True)
            assert torch.equal(new, stepwise.alloc(1, zero=True))
            assert int(replay.ring(0).length[int(new), 0]) == 0
            live = torch.cat([live, new])
        slots = torch.cat([live, torch.tensor([replay.pad_id], dtype=torch.int32)])  # a padding lane last
        for layer in range(2):
            lane = lane_inputs(len(slots), H, D, N, R, generator=g)
            got = decode_step(replay, layer, slots, **lane, **w)
            want = decode_step(stepwise, layer, slots, **lane, **w)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (step, layer)
            assert got[-1].eq(0).all()
            _check_current(replay, stepwise, layer, live, w)
    assert replay.ring(0).length.max() > 0  # some rows ended mid-ring: not every check was a flush


def test_replay_pool_rows_rings_and_bytes():
    replay, stepwise = _pools(4)
    ring = replay.ring(1)
    assert stepwise.replay_ring == 0 and not hasattr(stepwise, "ring")
    assert tuple(ring.B.shape) == (P, 3, R, H, N) and tuple(ring.length.shape) == (P, H)
    assert ring.offset is None and ring.angle is None
    per_slot = 3 * (R * H * N * 2 + H * D * 2 + H * 3 * 4) + H * 4
    assert replay.bytes_per_slot_per_layer == stepwise.bytes_per_slot_per_layer + per_slot
    assert replay.total_bytes == stepwise.total_bytes + 2 * P * per_slot
    slots = replay.alloc(2)
    ring.length[slots.long()] = 2
    ring.x[slots.long()] = 1.5
    replay.copy(int(slots[0]), [int(slots[1])])  # a copy carries the ring
    ring.length[int(slots[0])] = 1
    assert ring.length[int(slots[1])].tolist() == [2] * H
    replay.reset(slots)
    assert ring.length[slots.long()].eq(0).all() and ring.x[slots.long()].eq(0).all()
    eight = ReplayStatePool(1, P, H, D, N, R, state_dtype=torch.int8, replay_ring=2)
    assert eight.ring(0).offset is not None  # an 8-bit state is rounded stochastically: its draws are kept
    rotary = ReplayStatePool(1, P, H, D, N, R, rope_angles=4, replay_ring=2)
    assert tuple(rotary.ring(0).angle.shape) == (P, 1, H, 4)


@pytest.mark.parametrize("bad", [0, 1, 17, -2, 2.0, True, "4"])
def test_replay_ring_is_checked(bad):
    with pytest.raises(ValueError, match=r"^replay_ring: expected an int F in \[2, 16\]"):
        ReplayStatePool(1, P, H, D, N, R, replay_ring=bad)


def test_replay_pool_refusals_change_nothing():
    g = torch.Generator().manual_seed(5)
    replay, _ = _pools(4)
    bf16, _ = _pools(2, state_dtype=torch.bfloat16)
    drafts = ReplayStatePool(2, P, H, D, N, R, replay_ring=2, replay_draft=2)
    w = layer_weights(H, D, R, generator=g)
    slots = replay.alloc(2)
    bf16.alloc(2)
    drafts.alloc(2)
    lane = lane_inputs(2, H, D, N, R, generator=g)
    cases = [
        (drafts, dict(lane_inputs(2, H, D, N, R, tokens=2, generator=g), dst_slots=slots),
         r"^dst_slots: expected None with a replay pool's verify step \(replay_ring=2\)"),
        (replay, dict(lane_inputs(2, H, D, N, R, tokens=2, generator=g)),
         r"^x: a verify step of 2 tokens needs a ring with room for them \(ReplayStatePool\(\.\.\., replay_draft >= 2\)\)"),
        (drafts, dict(lane_inputs(2, H, D, N, R, tokens=2, generator=g), validate_indices=True,
                      num_accepted_tokens=torch.tensor([1, 3], dtype=torch.int32)),
         r"^num_accepted_tokens: expected counts in \[0, replay_draft=2\] with a replay pool, got \[3\] at lanes \[1\]"),
        (drafts, dict(lane_inputs(2, H, D, N, R, tokens=2, generator=g), num_accepted_tokens=torch.ones(2)),
         r"^num_accepted_tokens: expected dtype int32, got float32"),
        (replay, dict(stochastic_rounding=True), r"^stochastic_rounding: expected False with no rand_seed"),
        (bf16, dict(stochastic_rounding=True, rand_seed=torch.tensor([1, 0])),
         r"^stochastic_rounding: a replay pool with a bfloat16 state takes no stochastic rounding"),
        (replay, dict(B=lane["B"].float()), r"^B"),
    ]
    for pool, change, message in cases:
        before = [t.clone() for t in pool._pools()]
        call = dict(lane, **w, slots=slots)
        call.update(change)
        with pytest.raises((ValueError, TypeError), match=message):
            decode_step(pool, 0, **call)
        assert all(torch.equal(a, b) for a, b in zip(before, pool._pools())), message
    with pytest.raises(ValueError, match=r"^xproj: expected a tensor of shape \(2, 2, 32\)"):
        replay.materialize(0, slots, xproj=w["xproj"][:1], D=w["D"])
    with pytest.raises(Exception, match="materialize"):
        replay.materialize(0, [P - 1], xproj=w["xproj"], D=w["D"])  # not allocated


@pytest.mark.parametrize("K, T", [(2, 2), (4, 3)])
def test_verify_rounds_on_a_replay_pool_equal_stepwise_decoding(K, T):
    """Speculative rounds on a replay pool (``replay_draft=T``): each round's drafts through one decode_step,
    the next round's ``num_accepted_tokens`` committing some (0: a rollback). Against a stepwise pool that
    steps the accepted tokens one by one: every draft's out bit for bit (the stepwise T-token step on a
    copy of the stepwise pool), every live row's materialized state equal, and flushes crossed."""
    g = torch.Generator().manual_seed(10 * K + T)
    replay = ReplayStatePool(2, P, H, D, N, R, replay_ring=K, replay_draft=T)
    stepwise, scratch = StatePool(2, P, H, D, N, R), StatePool(2, P, H, D, N, R)
    w = layer_weights(H, D, R, generator=g)
    live = replay.alloc(3)
    stepwise.alloc(3)
    _seed_rows((replay, stepwise), live, g)
    slots = torch.cat([live, torch.tensor([replay.pad_id], dtype=torch.int32)])  # a padding lane last
    pending, flushed = [None, None], 0
    for step in range(6):
        accepted = torch.tensor([int(v) for v in torch.randint(0, T + 1, (len(slots),), generator=g)],
                                dtype=torch.int32) if step else None
        for layer in range(2):
            if accepted is not None:  # the stepwise pool steps the accepted drafts of the last round
                for j in range(T):
                    go = torch.where(accepted > j, slots, torch.full_like(slots, replay.pad_id))
                    decode_step(stepwise, layer, go, **{k: v[:, j] for k, v in pending[layer].items()}, **w)
            lengths = replay.ring(layer).length[live.long(), 0] + (0 if accepted is None else accepted[:-1])
            flushed += int((lengths >= K).sum())
            lane = lane_inputs(len(slots), H, D, N, R, tokens=T, generator=g)
            got = decode_step(replay, layer, slots, **lane, **w, num_accepted_tokens=accepted)
            for mine, theirs in zip(scratch._pools(), stepwise._pools()):
                mine.copy_(theirs)
            want = decode_step(scratch, layer, slots, **lane, **w)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (step, layer)
            assert got[-1].eq(0).all()
            _check_current(replay, stepwise, layer, live, w)
            pending[layer] = lane
    assert flushed >= 4, flushed


def test_graph_runner_steps_a_replay_pool_as_decode_step():
    """The bucketed runner (no CUDA graph on the CPU) on a replay pool: its outs are decode_step's on a
    twin pool, the padded bucket lanes touch nothing."""
    g = torch.Generator().manual_seed(9)
    a, _ = _pools(2)
    b, _ = _pools(2)
    w = layer_weights(H, D, R, generator=g)
    slots = a.alloc(3)
    b.alloc(3)
    _seed_rows((a, b), slots, g)
    runner = CudaGraphStepRunner(a, 0, buckets=(4,), **w)
    for step in range(3):
        lane = lane_inputs(3, H, D, N, R, generator=g)
        got = runner.step(slots, **lane)
        want = decode_step(b, 0, slots, **lane, **w)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), step
    for kind_a, kind_b in zip(a._pools(), b._pools()):
        assert torch.equal(kind_a, kind_b)


def test_graph_runner_steps_verify_rounds_of_a_replay_pool_as_decode_step():
    """Verify steps through the runner: ``num_accepted_tokens`` (n,) beside (n,) slots is its own form
    (a buffer for it; never dropped), and every out and pool byte equals decode_step's on a twin pool."""
    from mamba3_step.serving import StepForm

    g = torch.Generator().manual_seed(12)
    a, b = (ReplayStatePool(2, P, H, D, N, R, replay_ring=2, replay_draft=2) for _ in range(2))
    w = layer_weights(H, D, R, generator=g)
    slots = a.alloc(3)
    b.alloc(3)
    _seed_rows((a, b), slots, g)
    runner = CudaGraphStepRunner(a, 0, buckets=(4,), **w)
    accepted = None
    for step in range(5):
        lane = lane_inputs(3, H, D, N, R, tokens=2, generator=g)
        got = runner.step(slots, **lane, num_accepted_tokens=accepted)
        want = decode_step(b, 0, slots, **lane, **w, num_accepted_tokens=accepted)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), step
        accepted = torch.randint(0, 3, (3,), generator=g, dtype=torch.int32)
    for kind_a, kind_b in zip(a._pools(), b._pools()):
        assert torch.equal(kind_a, kind_b)
    assert {form for _, form in runner.captured} == {StepForm(2), StepForm(2, accepted=True)}
    assert runner.buffers(4, StepForm(2, accepted=True))["nat"].shape == (4,)


@pytest.mark.parametrize("K", [2, 4])
def test_replay_pool_moves_requests_with_dst_slots_as_the_stepwise_pool(K):
    """One-token steps with ``dst_slots``: every other step the first request moves to a fresh slot
    (prefix caching's block boundary); the replay pool flushes it there, outs bit for bit the stepwise
    pool's, every live slot's materialized state equal to the stepwise pool's row, the slot left
    behind untouched (its checkpoint and ring as they were). The graph runner (``with_dst``) on a twin
    replay pool gives the same outs."""
    g = torch.Generator().manual_seed(40 + K)
    replay, stepwise = _pools(K)
    twin = ReplayStatePool(2, P, H, D, N, R, replay_ring=K)
    w = layer_weights(H, D, R, generator=g)
    live = replay.alloc(3)
    assert torch.equal(live, stepwise.alloc(3)) and torch.equal(live, twin.alloc(3))
    _seed_rows((replay, stepwise, twin), live, g)
    runner = CudaGraphStepRunner(twin, 0, buckets=(4,), with_dst=True, **w)
    for step in range(2 * K + 2):
        dst = live.clone()
        if step % 2:
            dst[0] = replay.alloc(1)[0]
            assert int(stepwise.alloc(1)[0]) == int(dst[0]) == int(twin.alloc(1)[0])
        left = int(live[0])
        held = (replay.state(0)[left].clone(), replay.ring(0).length[left].clone())
        for layer in range(2):
            lane = lane_inputs(3, H, D, N, R, generator=g)
            got = decode_step(replay, layer, live, **lane, **w, dst_slots=dst)
            want = decode_step(stepwise, layer, live, **lane, **w, dst_slots=dst)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (step, layer)
            if layer == 0:
                graphed = runner.step(live, **lane, dst_slots=dst)
                assert torch.equal(graphed.view(torch.int16), want.view(torch.int16)), (step, "runner")
            _check_current(replay, stepwise, layer, dst, w)
        if step % 2:
            assert int(replay.ring(0).length[int(dst[0]), 0]) == 0
            assert torch.equal(replay.state(0)[left], held[0]) and torch.equal(replay.ring(0).length[left], held[1])
            for pool in (replay, stepwise, twin):
                pool.free(live[:1])
        live = dst
