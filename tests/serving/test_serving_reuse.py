"""A reused slot of a replay pool starts clean: an empty ring and zero rows in every layer, whatever the
caller writes next (docs/contract.md, "Replay").

The check is against a stepwise pool given the same prefill: the first out after the reuse equal bit
for bit, and the slot's ring and rows (scales and angles too) zero before the prefill is written.
"""

from __future__ import annotations

import pytest
import torch

from mamba3_step.serving import ReplayStatePool, StatePool, decode_step
from mamba3_step.testing import lane_inputs, layer_weights

H, D, N, R, P, L, S = 2, 32, 64, 2, 4, 2, 2


def _lane(B, g):
    lane = lane_inputs(B, H, D, N, R, generator=g)
    lane["angle_proj"] = torch.randn(B, H, S, generator=g) * 1.5
    return lane


def _weights(g):
    w = layer_weights(H, D, R, generator=g)
    w["B_bias"], w["C_bias"] = (1 + 0.3 * torch.randn(R, H, N, generator=g) for _ in range(2))
    return w


def _fill_rows(pool, slot: int, g) -> None:
    """What a server's prefill writes: every layer's state, Bstate and Xstate row (not the ring)."""
    for layer in range(L):
        pool.state(layer)[slot] = torch.randn(H, D, N, generator=g)
        pool.Bstate(layer)[slot] = torch.randn(R, H, N, generator=g).to(pool.kv_dtype)
        pool.Xstate(layer)[slot] = torch.randn(H, D, generator=g).to(pool.x_dtype)


@pytest.mark.parametrize("how", ["alloc", "alloc_spec"])
def test_a_reused_replay_slot_starts_with_an_empty_ring(how):
    g = torch.Generator().manual_seed(3)
    replay = ReplayStatePool(L, P, H, D, N, R, replay_ring=4, rope_angles=S)
    w = _weights(g)
    old = replay.alloc(2)
    for _ in range(2):  # the old request leaves tokens in its ring (K = 4: no flush yet)
        for layer in range(L):
            decode_step(replay, layer, old, **_lane(2, g), **w)
    assert int(replay.ring(0).length[int(old[0]), 0]) == 2
    replay.free(old[:1])
    slot = {"alloc": lambda: replay.alloc(1), "alloc_spec": lambda: replay.alloc_spec(1, 1)[0]}[how]()
    assert int(slot) == int(old[0])
    for layer in range(L):  # every ring field and row of the slot is zero
        for field in replay.ring(layer):
            if field is not None:
                assert not bool(field[int(slot)].any())
        for name, rows in replay.layer_rows(layer).items():
            assert rows is None or not bool(rows[int(slot)].any()), name
    stepwise = StatePool(L, P, H, D, N, R, rope_angles=S)
    stepwise.alloc(P)
    seed = torch.Generator().manual_seed(11)
    _fill_rows(replay, int(slot), seed)
    _fill_rows(stepwise, int(slot), torch.Generator().manual_seed(11))
    slots = slot.reshape(1).to(torch.int32)
    for layer in range(L):
        lane = _lane(1, g)
        got, want = decode_step(replay, layer, slots, **lane, **w), decode_step(stepwise, layer, slots, **lane, **w)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), layer


def test_fork_into_a_reused_slot_carries_the_source_ring_only():
    """fork allocates (a reset) and then copies the source's rows and ring: the reused slot's old ring is gone."""
    g = torch.Generator().manual_seed(4)
    replay = ReplayStatePool(L, P, H, D, N, R, replay_ring=4)
    w = layer_weights(H, D, R, generator=g)
    rows = replay.alloc(2)
    for steps, lane_rows in ((2, rows), (1, rows[1:])):
        for _ in range(steps):
            decode_step(replay, 0, lane_rows, **lane_inputs(len(lane_rows), H, D, N, R, generator=g), **w)
    replay.free(rows[:1])
    forked = replay.fork(int(rows[1]), 1)
    assert int(forked) == int(rows[0])
    for field in replay.ring(0):
        if field is not None:
            assert torch.equal(field[int(forked)], field[int(rows[1])])
