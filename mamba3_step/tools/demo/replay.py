"""The demo's replay round (docs/design/replay.md), on the CPU path, so that it runs on any
machine (the replay kernel's plain and verify steps are checked against the executed stepwise kernel
by the PTX tier: tests/ptx/test_ptx_replay.py, tests/ptx/test_ptx_replay_verify.py).

One layer's pool is decoded twice from the same rows: stepwise (the pool-mode CPU path with
``update_kv_state``) and with replay (:mod:`mamba3_step.replay`: a checkpoint and a ring of F - 1
tokens, the state written every F tokens). A request leaves and a new one joins half-way, then
verify steps of T tokens take a random number of them (the rest rolled back by the ring's
cursor). After every plain step each request's materialised state must equal the stepwise pool's
row bit for bit.

Letters: B requests, P pool rows, H heads, D head dim, N state size, R MIMO rank, T draft tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...reference import mamba3_step_reference
from ...replay import materialize, new_ring, replay_step
from ...tensors import StepTensors
from ...testing import lane_inputs, layer_weights, row_tensors

__all__ = ["ReplayResult", "run_replay_decode"]


class ReplayResult(NamedTuple):
    steps: int  # plain steps
    rounds: int  # verify steps
    flushes: int  # lane-steps that wrote the state
    appends: int  # lane-steps that only appended to the ring
    verified: int  # draft tokens verified
    accepted: int  # of them accepted
    max_out_diff: float  # max |replay out - stepwise out| over the plain steps (append outs round differently)
    failures: list  # what differed, if anything


class _Pools:
    """The layer's weights and the two copies of its pool rows."""

    def __init__(self, P: int, sizes: tuple, g: torch.Generator):
        H, D, N, R = sizes
        rows = row_tensors(P, H, D, N, R, x_dtype="float32", generator=g)  # fp32 out: the append rounding shows
        self.weights = layer_weights(H, D, R, generator=g)
        self.stepwise = {k: v.clone() for k, v in rows.items()}
        self.replay = {k: v.clone() for k, v in rows.items()}

    def step(self, pools: dict, lane: dict, rows: torch.Tensor) -> StepTensors:
        w = self.weights
        return StepTensors(pools["state"], pools["Bstate"], pools["Xstate"], lane["A"], lane["B"], lane["C"], w["D"],
                           lane["x"], lane["dt"], lane["trap"], w["xproj"], outproj=w["outproj"], z=lane["z"],
                           zproj=w["zproj"], state_batch_indices=rows)

    def advance_stepwise(self, lane: dict, rows: list, accepted: list) -> None:
        """The stepwise rows after each request's first ``accepted[b]`` draft tokens (a dense step of
        that many tokens: T tokens equal T one-token steps)."""
        for b, (row, a) in enumerate(zip(rows, accepted)):
            if a == 0:
                continue
            p = {k: v[row:row + 1].clone() for k, v in self.stepwise.items()}
            drafts = {k: v[b:b + 1, :a] for k, v in lane.items() if v is not None}
            t = self.step(p, drafts, None)
            mamba3_step_reference(t, update_kv_state=True)
            for k in self.stepwise:
                self.stepwise[k][row] = getattr(t, k)[0]


def run_replay_decode(*, steps: int = 10, rounds: int = 3, flush_length: int = 4, T: int = 3, slots: int = 8,
                      requests: int = 3, seed: int = 0) -> ReplayResult:
    """Decode ``steps`` plain steps, then ``rounds`` verify steps of ``T`` tokens each followed by a
    plain step, stepwise and with replay; check every plain step (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    sizes = (2, 32, 32, 2)  # H, D, N, R: small, the CPU path runs it
    pools = _Pools(slots, sizes, g)
    ring = new_ring(slots, flush_length, sizes[3], sizes[0], sizes[2], sizes[1], kv_dtype=torch.bfloat16,
                    x_dtype=torch.float32, draft=T)
    rows = list(range(1, requests + 1))
    counts = dict(flushes=0, appends=0, verified=0, accepted=0)
    failures, max_diff, pending = [], 0.0, None
    for s in range(steps + 2 * rounds):
        if s == steps // 2:  # a request leaves, a new one joins in a free row: zero state, empty ring
            rows[0] = slots - 1
            for p in (pools.stepwise, pools.replay):
                for v in p.values():
                    v[rows[0]] = 0
            ring.length[rows[0]] = 0
        index = torch.tensor(rows, dtype=torch.int32)
        verify = s >= steps and (s - steps) % 2 == 0
        lane = lane_inputs(len(rows), *sizes, tokens=T if verify else None, x_dtype="float32", generator=g)
        committed = ring.length[index, 0].long() + (0 if pending is None else pending.long())
        got = replay_step(pools.step(pools.replay, lane, index), ring, flush_length, num_accepted_tokens=pending)
        if verify:
            accepted = [int(v) for v in torch.randint(0, T + 1, (len(rows),), generator=g)]
            pools.advance_stepwise(lane, rows, accepted)
            counts["verified"] += T * len(rows)
            counts["accepted"] += sum(accepted)
            pending = torch.tensor(accepted, dtype=torch.int32)
            continue
        pending = None
        flushed = int((committed >= flush_length - 1).sum())
        counts["flushes"] += flushed
        counts["appends"] += len(rows) - flushed
        want = mamba3_step_reference(pools.step(pools.stepwise, lane, index), update_kv_state=True)
        max_diff = max(max_diff, (got.float() - want.float()).abs().max().item())
        current = materialize(pools.step(pools.replay, lane, index), ring, rows)._asdict()
        for k, v in pools.stepwise.items():
            if not torch.equal(current[k], v[index.long()]):
                failures.append(f"step {s}: the materialised {k} differs from stepwise decoding")
    return ReplayResult(steps + rounds, rounds, counts["flushes"], counts["appends"], counts["verified"],
                        counts["accepted"], max_diff, failures)
