"""GPU suite for replay with Mamba-3's other per-request states: the rotary angle and 8-bit states
with scales (skipped without CUDA; docs/contract.md, "Replay").

Passed on an H200 (2026-11-28), after the run found that the graph runner's capture warm-up advanced
``rand_seed`` (fixed in ``CudaGraphStepRunner.capture``); the PTX tier executes the same kernel code on the CPU
(tests/ptx/test_ptx_replay.py and test_ptx_replay_verify.py: the rotary, stochastically rounded and
8-bit specialisations). On the real kernel, against the stepwise pool of the same kind:

* a replay pool of the flagship rotary layer (S = 32 angles, B/C biases, B/C shared by the heads):
  ``decode_step`` and the CUDA-graph runner over 2K + 1 steps with a padding lane, every ``out`` bit
  for bit, and each flushed row's state, Bstate, Xstate and angle, and ``materialize`` of every row
  (the replay kernel's flush form) at every step; verify rounds (``replay_draft =
  T``, a random number of each round's drafts accepted by the next): the drafts' outs are the
  stepwise T-token kernel's bit for bit on the state after the accepted tokens;
* an 8-bit replay pool (int8 and e4m3, stochastic rounding, ``rand_seed`` advancing every step):
  ``decode_step`` and the graph runner, every ``out`` and each flushed row (its scales included) bit
  for bit: each replayed token rounds with the draws its step made; ``materialize`` likewise.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, S angles, K flush
length, T draft tokens.
"""

from __future__ import annotations

import pytest
import torch

from mamba3_step.testing import (bits_equal, lane_inputs, layer_weights, rotary_angles, rotary_biases, rotary_rates,
                                 row_tensors)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
H, D, N, R, S = 4, 64, 128, 4, 32
ROWS = ("state", "Bstate", "Xstate", "angle_state", "state_scale")


def _weights(g: torch.Generator) -> dict:
    return {**layer_weights(H, D, R, generator=g, device=DEV), **rotary_biases(R, H, N, generator=g, device=DEV)}


def _lane(g: torch.Generator, n: int, tokens=None) -> dict:
    """Lane inputs with B/C shared by the heads and angle_proj ``(n, [T,] H, S)``."""
    lane = lane_inputs(n, H, D, N, R, tokens=tokens, generator=g, device=DEV)
    lane["B"], lane["C"] = lane["B"][..., :1, :].contiguous(), lane["C"][..., :1, :].contiguous()
    lane["angle_proj"] = rotary_rates((n,) if tokens is None else (n, tokens), H, S, generator=g, device=DEV)
    return lane


def _pools(g: torch.Generator, replays: int, **replay):
    """``replays`` replay pools and a stepwise one, five live slots with the same fresh rows and angles,
    and the slots with a padding lane."""
    from mamba3_step.serving import ReplayStatePool, StatePool

    pools = [ReplayStatePool(1, 12, H, D, N, R, rope_angles=S, device=DEV, **replay) for _ in range(replays)]
    stepwise = StatePool(1, 12, H, D, N, R, rope_angles=S, device=DEV)
    slots = stepwise.alloc(5)
    rows = slots.long().to(DEV)
    fresh = torch.randn(5, H, D, N, generator=g).to(DEV)
    angles = rotary_angles(5, H, S, generator=g, device=DEV)
    for pool in (*pools, stepwise):
        if pool is not stepwise:
            assert torch.equal(pool.alloc(5), slots)
        pool.state(0)[rows] = fresh
        pool.angle_state(0)[rows] = angles
    return pools, stepwise, slots, torch.cat([slots, torch.tensor([-1], dtype=torch.int32)]).to(DEV)


def _check_flushed(replay, stepwise, slots: torch.Tensor, where: str) -> None:
    for row in slots.tolist():
        if int(replay.ring(0).length[row, 0]) == 0:
            for k in ROWS:
                if getattr(replay, k)(0) is not None:
                    assert bits_equal(getattr(replay, k)(0)[row], getattr(stepwise, k)(0)[row]), f"{where}: row {row} {k}"


def _check_materialized(replay, stepwise, slots: torch.Tensor, w: dict, where: str, rand_seed=None) -> None:
    """``materialize`` (the replay kernel's flush form) of every live slot, mid-ring or not: each of
    the row's pools bit for bit the stepwise pool's (its angle and scales included)."""
    weights = {k: w.get(k) for k in ("xproj", "D", "zproj", "outproj", "B_bias", "C_bias")}
    cur = replay.materialize(0, slots, **weights, rand_seed=rand_seed)._asdict()
    rows = slots.long().to(DEV)
    for k in ROWS:
        if getattr(stepwise, k)(0) is not None:
            assert bits_equal(cur[k], getattr(stepwise, k)(0)[rows]), f"{where}: materialized {k}"


@pytest.mark.parametrize("K", [2, 4])
def test_rotary_replay_pool_decode_and_graph_runner_match_the_stepwise_pool(K):
    from mamba3_step.serving import CudaGraphStepRunner, decode_step

    g = torch.Generator().manual_seed(40 + K)
    w = _weights(g)
    (eager, graphed), stepwise, slots, padded = _pools(g, 2, replay_ring=K)
    runner = CudaGraphStepRunner(graphed, 0, buckets=(8,), shared_bc=True, **w)
    flushed = 0
    for step in range(2 * K + 1):
        lane = _lane(g, 6)
        want = decode_step(stepwise, 0, padded, **lane, **w)
        got = decode_step(eager, 0, padded, **lane, **w)
        got_graph = runner.step(padded, **lane)
        torch.cuda.synchronize()
        assert bits_equal(got, want) and bits_equal(got_graph, want), f"step {step}"
        flushed += int((eager.ring(0).length[slots.long().to(DEV), 0] == 0).sum())
        _check_flushed(eager, stepwise, slots, f"step {step}")
        _check_flushed(graphed, stepwise, slots, f"step {step} (graph)")
        _check_materialized(eager, stepwise, slots, w, f"step {step}")
    assert flushed >= 2 * 5, "fewer than two flushes a row"


@pytest.mark.parametrize("K, T", [(4, 4), (2, 2)])
def test_rotary_verify_rounds_match_the_stepwise_kernel(K, T):
    from mamba3_step.serving import StatePool, decode_step

    g = torch.Generator().manual_seed(50 + K)
    w = _weights(g)
    (replay,), stepwise, slots, padded = _pools(g, 1, replay_ring=K, replay_draft=T)
    scratch = StatePool(1, 12, H, D, N, R, rope_angles=S, device=DEV)
    pending, accepted = None, torch.zeros(6, dtype=torch.int32, device=DEV)
    for round_ in range(6):
        if pending is not None:  # the stepwise pool steps each lane's accepted drafts, one token at a time
            accepted = torch.randint(0, T + 1, (6,), generator=g, dtype=torch.int32).to(DEV)
            accepted[-1] = 0
            for j in range(T):
                go = torch.where(accepted > j, padded, torch.full_like(padded, -1))
                decode_step(stepwise, 0, go, **{k: v[:, j] for k, v in pending.items()}, **w)
        lane = _lane(g, 6, tokens=T)
        for mine, theirs in zip(scratch._pools(), stepwise._pools()):
            mine.copy_(theirs)
        want = decode_step(scratch, 0, padded, **lane, **w)
        got = decode_step(replay, 0, padded, **lane, **w, num_accepted_tokens=accepted)
        torch.cuda.synchronize()
        assert bits_equal(got, want), f"round {round_}: the drafts' outs"
        _check_flushed(replay, stepwise, slots, f"round {round_}")
        _check_materialized(replay, stepwise, slots, w, f"round {round_}")
        pending = lane


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("fmt", [torch.int8, torch.float8_e4m3fn])
def test_8bit_replay_pool_decode_and_graph_runner_match_the_stepwise_pool(fmt, K):
    from mamba3_step.serving import CudaGraphStepRunner, ReplayStatePool, StatePool, decode_step

    g = torch.Generator().manual_seed(60 + K)
    w = layer_weights(H, D, R, generator=g, device=DEV)
    pools = [ReplayStatePool(1, 12, H, D, N, R, state_dtype=fmt, replay_ring=K, device=DEV) for _ in range(2)]
    stepwise = StatePool(1, 12, H, D, N, R, state_dtype=fmt, device=DEV)
    slots = stepwise.alloc(5)
    fresh = row_tensors(5, H, D, N, R, state_dtype=str(fmt).split(".")[1], generator=g, device=DEV)
    for pool in (*pools, stepwise):
        if pool is not stepwise:
            assert torch.equal(pool.alloc(5), slots)
        pool.state(0)[slots.long().to(DEV)] = fresh["state"]
        pool.state_scale(0)[slots.long().to(DEV)] = fresh["state_scale"]
    seeds = [torch.tensor([20261127, 2**63 - 3], dtype=torch.int64, device=DEV) for _ in range(3)]  # wraps
    runner = CudaGraphStepRunner(pools[1], 0, buckets=(8,), **w, stochastic_rounding=True, rand_seed=seeds[2])
    padded = torch.cat([slots, torch.tensor([-1], dtype=torch.int32)]).to(DEV)
    for step in range(2 * K + 1):
        lane = lane_inputs(6, H, D, N, R, generator=g, device=DEV)
        want = decode_step(stepwise, 0, padded, **lane, **w, stochastic_rounding=True, rand_seed=seeds[0])
        got = decode_step(pools[0], 0, padded, **lane, **w, stochastic_rounding=True, rand_seed=seeds[1])
        got_graph = runner.step(padded, **lane)
        torch.cuda.synchronize()
        assert bits_equal(got, want) and bits_equal(got_graph, want), f"step {step}"
        _check_flushed(pools[0], stepwise, slots, f"step {step}")
        _check_flushed(pools[1], stepwise, slots, f"step {step} (graph)")
        _check_materialized(pools[0], stepwise, slots, w, f"step {step}", rand_seed=seeds[1])
