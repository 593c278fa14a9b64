"""Replay's verify steps, executed: the kernel's PTX run on the CPU for the specialisations with
``replay_ring = K`` and ``tokens = T`` (``REPLAY_VERIFY`` in test_kernel_compile.py;
docs/contract.md, "Replay").

1. Speculative rounds over a decode that crosses at least two flushes of a row, with requests
   joining and leaving, lanes reshuffled, every padding kind in the batch and a random number of
   the previous round's drafts accepted (0: all rolled back): every draft's ``out`` is the executed
   stepwise T-token kernel's, bit for bit, on the state stepwise decoding holds after the accepted
   tokens (committed by the executed one-token stepwise kernel), so the state replayed from the
   checkpoint and the committed ring is that state (with ``replay_from_checkpoint``: within the
   accuracy rule of the float64 algebra from the checkpoint, and so is the CPU path's); after a
   flush the checkpoint, Bstate and Xstate equal it bit for bit; the ring equals the CPU path's bit
   for bit; rows no lane reads keep every bit of every pool and ring.
2. A live lane at committed count ``c`` (its ring length plus ``accepted``; drafts stepped or from
   the checkpoint) reads exactly its rows,
   ring entries ``[0, c)``, its length and its ``accepted``, and writes its three rows and entries
   ``[0, T)`` (a flush, ``c >= K``) or entries ``[c, c + T)``, and its length. Padding lanes, and
   lanes whose length or ``accepted`` is out of range, write +0.0 to every token's ``out`` and no
   byte of any pool or ring. No race between CTAs or threads.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, K flush length,
T draft tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_accurate
from test_kernel_compile import REPLAY_VERIFY, REPLAY_VERIFY_FULL, REPLAY_VERIFY_MIXED
from test_ptx_replay import (POOLS, RING_TENSORS, _heads, _is_positive_zero, _span, _touched, _within,
                             check_ring_and_other_rows, join_request, lane_with_rotary, ring_snapshot, rotary_arguments,
                             rotary_rows, rotary_weights)

from ptx_executor import analysis
from mamba3_step.tools.ptx_tier import run_step_ptx
from mamba3_step.replay import new_ring, replay_step
from mamba3_step.tools.replay_reference import draft_references
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, poison_, row_tensors

P, NULL = 9, 8
PADDING = (-1, P, -(2**31), 2**31 - 1, NULL)


def _spec(name: str) -> StepSpec:
    return {**REPLAY_VERIFY, **REPLAY_VERIFY_MIXED}[name].with_default_tiling()


def _stepwise(spec: StepSpec, tokens: int) -> StepSpec:
    """The stepwise specialisation with ``tokens`` per lane, no replay, its default tiling."""
    return spec.replace(replay_ring=0, num_accepted=False, replay_draft=0, tokens=tokens, tile_D=0,
                        num_warps=0).with_default_tiling()


class Layer:
    """The replay kernel's pools and ring, the CPU path's, and the stepwise pools (the state
    stepwise decoding holds after each round's accepted tokens). ``T`` is the current round's
    draft count; the rings have room for ``spec.tokens`` drafts."""

    def __init__(self, spec: StepSpec, seed: int):
        self.spec, self.H, self.T, self.K = spec, _heads(spec), spec.tokens, spec.replay_ring
        self.g = torch.Generator().manual_seed(seed)
        self.io = dict(kv_dtype=spec.kv_dtype, x_dtype=spec.x_dtype)
        rows = row_tensors(P, self.H, spec.headdim, spec.dstate, spec.mimo, state_dtype=spec.state_dtype,
                           generator=self.g, **self.io)
        rows.update(rotary_rows(spec, P, self.H, self.g))
        self.weights = layer_weights(self.H, spec.headdim, spec.mimo, proj_dtype=spec.proj_dtype, has_z=spec.has_z,
                                     has_outproj=spec.has_outproj, generator=self.g)
        self.weights.update(rotary_weights(spec, self.H, self.g))
        self.pools = {kind: {k: v.clone() for k, v in rows.items()} for kind in ("replay", "cpu", "stepwise")}
        self.flushed = tuple(k for k in POOLS if k in rows)  # the rows a flush writes
        shape = (P, self.K, spec.mimo, self.H, spec.dstate, spec.headdim)
        self.rings = {kind: new_ring(*shape, kv_dtype=rows["Bstate"].dtype, x_dtype=rows["Xstate"].dtype,
                                     draft=self.T, rope_angles=spec.rope_angles, stochastic=spec.stochastic_rounding)
                      for kind in ("replay", "cpu")}
        for ring in self.rings.values():  # entries past what a lane reads are never read
            for t in (ring.B, ring.x, ring.coef, ring.angle, ring.offset, ring.drawn_for):
                if t is not None:
                    poison_(t, seed=3)
        self.pending = {}  # row -> its last round's drafts (lane inputs with a token axis)

    def lane(self, B: int, tokens) -> dict:
        s = self.spec
        lane = lane_inputs(B, self.H, s.headdim, s.dstate, s.mimo, has_z=s.has_z, tokens=tokens, generator=self.g,
                           **self.io)
        return lane_with_rotary(s, lane, self.g)

    def call(self, pools: dict, lane: dict, index: torch.Tensor, out=None) -> StepTensors:
        w = self.weights
        return StepTensors(pools["state"], pools["Bstate"], pools["Xstate"], lane["A"], lane["B"], lane["C"], w["D"],
                           lane["x"], lane["dt"], lane["trap"], w["xproj"], outproj=w["outproj"], out=out,
                           z=lane["z"], zproj=w["zproj"], state_batch_indices=index, null_slot_id=NULL,
                           **rotary_arguments(pools, lane, w))

    def out(self, B: int) -> torch.Tensor:
        s = self.spec
        shape = (B, self.T) + ((self.H, s.headdim) if s.has_outproj else (s.mimo, self.H, s.headdim))
        return poison_(torch.empty(shape, dtype=self.pools["replay"]["Xstate"].dtype), seed=B)

    def join(self, row: int) -> None:
        join_request(self, row)
        self.pending.pop(row, None)

    def commit_stepwise(self, lanes: list, accepted: list) -> None:
        """The stepwise pools advance by each lane's accepted drafts of its last round: one-token
        steps of the executed stepwise kernel, token j for the lanes that accepted more than j."""
        B, one = len(lanes), _stepwise(self.spec, 1)
        for j in range(max(accepted, default=0)):
            index = [row if a > j else -1 for row, a in zip(lanes, accepted)]
            if all(i < 0 for i in index):
                return
            lane = self.lane(B, None)  # filler for the lanes that do not step
            for b, row in enumerate(index):
                if row >= 0:
                    for k, v in self.pending[row].items():
                        if k == "rand_seed":  # token j drew at its round's offset + j
                            lane[k] = v + torch.tensor([0, j])
                        elif v is not None:
                            lane[k][b] = v[j]
            out = torch.empty(self.out(B)[:, 0].shape, dtype=self.out(1).dtype)
            run_step_ptx(one, self.call(self.pools["stepwise"], lane, torch.tensor(index, dtype=torch.int32), out))

    def drafts_stepwise(self, lane: dict, index: torch.Tensor) -> torch.Tensor:
        """The drafts' outputs of the executed stepwise T-token kernel, from a copy of the stepwise pools."""
        scratch = {k: v.clone() for k, v in self.pools["stepwise"].items()}
        want = self.out(index.numel())
        run_step_ptx(_stepwise(self.spec, self.T),
                     self.call(scratch, lane, index, want[:, 0] if self.T == 1 else want))
        return want

    def snapshot(self) -> dict:
        held = {k: v.clone() for k, v in self.pools["replay"].items()}
        held.update(ring_snapshot(self.rings["replay"]))
        return held


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.full_matrix] if n in REPLAY_VERIFY_FULL else [])
                                  for n in REPLAY_VERIFY])
def test_verify_rounds_are_bit_identical_to_the_executed_stepwise_kernel(name):
    spec = _spec(name)
    rounds = 7 if spec.replay_ring <= spec.tokens else 9
    flushes, _ = _verify_rounds(name, Layer(spec, seed=17), [spec] * rounds, all_accepted=())
    assert flushes and max(flushes.values()) >= 2, f"{name}: fewer than two flushes of one row ({flushes})"


def test_verify_steps_with_fewer_drafts_than_the_ring_holds():
    """A ring made for T = 3 drafts, steps alternating T = 3 and T = 2 (StepSpec.replay_draft = 3),
    every draft of a T = 3 round accepted by the T = 2 round after it: a T = 2 step then commits up
    to K - 1 + 3 entries, above its own K - 1 + T (the lane was padding before replay_draft)."""
    big = _spec("N32-D64-R2-bf16state-replay-K2-verify-T3-noz")
    small = _spec("N32-D64-R2-bf16state-replay-K2-verify-T2-draft3-noz")
    assert small.replay_draft == big.tokens == 3 and small.ring_entries == big.ring_entries
    specs = [big if s % 2 == 0 else small for s in range(8)]
    flushes, beyond = _verify_rounds("mixed", Layer(big, seed=29), specs, all_accepted=range(1, 8, 2))
    assert flushes and max(flushes.values()) >= 2, f"fewer than two flushes of one row ({flushes})"
    assert beyond, "no T = 2 step committed more than K - 1 + 2 entries"


def test_one_token_steps_that_commit_drafts():
    """A one-token step with ``accepted`` (StepSpec num_accepted, tokens = 1) after verify steps of 3
    drafts: it commits the accepted drafts, steps its own token (committed, not a draft) and
    flushes once the count reaches K - 1, every draft accepted in some rounds so that the count
    passes K - 1 (a flush of more than K tokens). Its out is the executed stepwise one-token
    kernel's after the accepted drafts, bit for bit; rows at a flush equal stepwise decoding's."""
    big = _spec("N32-D64-R2-bf16state-replay-K2-verify-T3-noz")
    one = _spec("N32-D64-R2-bf16state-replay-K2-T1-accepted-noz")
    assert (one.tokens, one.num_accepted, one.replay_draft, one.ring_entries) == (1, True, 3, big.ring_entries)
    specs = [big if s % 2 == 0 else one for s in range(8)]
    flushes, beyond = _verify_rounds("one-token", Layer(big, seed=31), specs, all_accepted=range(1, 8, 4))
    assert flushes and max(flushes.values()) >= 2, f"fewer than two flushes of one row ({flushes})"
    assert beyond, "no one-token step committed more than K - 1 entries"


def _verify_rounds(name: str, layer: Layer, specs: list, all_accepted) -> tuple:
    """Speculative rounds, round ``s`` a verify step of ``specs[s]`` (see the module docstring),
    every pending draft accepted in the rounds ``all_accepted``; a one-token round's token is
    committed (the stepwise pools step it at once). Returns the flushes per row and how many live
    lanes committed more than the step's own ``K - 1 + T`` (one-token: ``K - 1``) entries."""
    K = layer.K
    rng = np.random.default_rng(7)
    active = [0, 1, 2]
    schedule = {2: (1, 4), 5: (0, 5)}  # round -> (row that leaves, row that joins)
    flushes, beyond = {}, 0
    for s, spec in enumerate(specs):
        T = layer.T = spec.tokens
        one = T == 1
        if s in schedule:
            leave, join = schedule[s]
            active[active.index(leave)] = join
            layer.join(join)
        lanes = list(active) + [int(v) for v in rng.choice(PADDING, size=2, replace=False)]
        rng.shuffle(lanes)
        pending = [layer.pending[row]["x"].shape[0] if row in layer.pending else 0 for row in lanes]
        accepted = [tp if s in all_accepted else int(rng.integers(1 if s % 3 else 0, tp + 1)) if tp else 0
                    for tp in pending]
        index = torch.tensor(lanes, dtype=torch.int32)
        counts = {row: int(layer.rings["replay"].length[row, 0]) + a for row, a in zip(lanes, accepted)
                  if row in active}
        beyond += sum(c > K - 1 + spec.draft_need for c in counts.values())
        layer.commit_stepwise(lanes, accepted)
        before = layer.snapshot()
        lane = layer.lane(len(lanes), None if one else T)
        got = layer.out(len(lanes))
        acc = torch.tensor(accepted, dtype=torch.int32)
        run_step_ptx(spec, layer.call(layer.pools["replay"], lane, index, got[:, 0] if one else got)
                     ._replace(num_accepted_tokens=acc), ring=layer.rings["replay"])
        cpu = replay_step(layer.call(layer.pools["cpu"], lane, index), layer.rings["cpu"], K, num_accepted_tokens=acc,
                          exact_outputs=not spec.replay_from_checkpoint, rotate_pairwise=spec.rotate_pairwise)
        want = layer.drafts_stepwise(lane, index)
        for b, row in enumerate(lanes):
            if row not in active:
                assert _is_positive_zero(got[b]), f"{name} round {s}: padding lane {b} out"
                continue
            if spec.replay_from_checkpoint and not one:
                check_drafts(layer, before, lane, index, b, row, counts[row], got[b], cpu[b],
                             f"{name} round {s} lane {b}")
            else:
                assert bits_equal(got[b], want[b]), f"{name} round {s}: lane {b}'s drafts differ from the stepwise's"
            layer.pending[row] = {k: (None if v is None else v.clone() if k == "rand_seed" else
                                      (v[b][None] if one else v[b]).clone()) for k, v in lane.items()}
        if one:  # the token is committed: stepwise decoding steps it now
            layer.commit_stepwise(lanes, [1 if row in active else 0 for row in lanes])
            for row in active:
                layer.pending.pop(row)
        replay, stepwise = layer.pools["replay"], layer.pools["stepwise"]
        for row in active:
            if counts[row] >= (K - 1 if one else K):
                flushes[row] = flushes.get(row, 0) + 1
                assert int(layer.rings["replay"].length[row, 0]) == 0, f"{name} round {s}: row {row} not flushed"
                for k in layer.flushed:
                    assert bits_equal(replay[k][row], stepwise[k][row]), f"{name} round {s}: row {row} {k} at a flush"
        check_ring_and_other_rows(layer, before, layer.snapshot(), set(active), f"{name} round {s}")
    return flushes, beyond


def check_drafts(layer: Layer, before: dict, lane: dict, index: torch.Tensor, b: int, row: int, count: int,
                 got: torch.Tensor, cpu: torch.Tensor, where: str) -> None:
    """Lane ``b``'s drafts' ``out`` of a verify step with outputs from the checkpoint (row ``row``,
    ``count`` committed tokens; ``before``: the snapshot before the step) within the contract's
    accuracy of the float64 algebra, and the CPU path's too: from the row's checkpoint and its
    ``count`` ring tokens, or after a flush from the state stepwise decoding holds after them (the
    stepwise pools, before the drafts), which the flush wrote."""
    flushed = count >= layer.K
    pools, since = (layer.pools["stepwise"], 0) if flushed else (before, count)
    base = tuple(pools[k] for k in ("state", "Bstate", "Xstate", "state_scale") if k in pools)
    ring = {f: before[f"ring.{f}"] for f in ("B", "x", "coef")}
    call = layer.call(layer.pools["stepwise"], lane, index)
    want64, torch32 = (draft_references(call, base, ring, since, row, b, cd) for cd in (torch.float64, torch.float32))
    assert_accurate(where, got, want64, torch32.to(got.dtype), want64.abs().max().item())
    assert_accurate(where + " (CPU path)", cpu, want64, torch32.to(got.dtype), want64.abs().max().item())


@pytest.mark.parametrize("name", ["flagship-replay-K4-verify-T4", "flagship-replay-K4-verify-T4-from-checkpoint"])
def test_verify_lanes_touch_exactly_their_rows_and_ring_entries(name):
    spec = _spec(name)
    layer = Layer(spec, seed=5)
    K, T = layer.K, layer.T
    ring = layer.rings["replay"]
    # row -> (ring length, accepted): appends, flushes (up to the largest count), then out of range
    cases = {0: (0, 0), 1: (1, 2), 2: (2, 3), 3: (K - 1, T), 4: (-1, 1), 5: (2, -1), 6: (K - 1, T + 1)}
    lanes = [2, -1, 0, 5, 3, P, 1, NULL, 6, 4, -(2**31)]
    for row, (c, _) in cases.items():
        ring.length[row] = c
    accepted = torch.tensor([cases.get(row, (0, 7))[1] for row in lanes], dtype=torch.int32)
    index = torch.tensor(lanes, dtype=torch.int32)
    out = layer.out(len(lanes))
    tensors = layer.call(layer.pools["replay"], layer.lane(len(lanes), T), index, out)
    res = run_step_ptx(spec, tensors._replace(num_accepted_tokens=accepted), ring=ring, record_shared=True)
    rows = {k: getattr(tensors, k) for k in layer.flushed}
    rings = {k: getattr(ring, f) for k, f in RING_TENSORS.items()}
    for b, row in enumerate(lanes):
        touched = _touched(res, b)
        length, a = cases.get(row, (None, None))
        c = None if length is None else length + a
        if c is None or length < 0 or a < 0 or c > K - 1 + T:  # padding, or out of range: nothing written
            assert _is_positive_zero(out[b]), (b, row)
            for t in (*rows.values(), *rings.values()):
                assert not _within(touched[True], t), f"lane {b} (row {row}) wrote"
                if t is not ring.length or length is None:
                    assert not _within(touched[False], t), f"lane {b} (row {row}) read"
            assert _within(touched[False], accepted) == (set() if length is None else _span(accepted[b])), (b, row)
            continue
        flush = c >= K
        first = 0 if flush else c
        assert _within(touched[False], accepted) == _span(accepted[b]), f"lane {b} reads of accepted"
        for k, t in rows.items():
            assert _within(touched[False], t) == _span(t[row]), f"lane {b} reads row {row} of {k}"
            assert _within(touched[True], t) == (_span(t[row]) if flush else set()), f"lane {b} writes {k}"
        for k, t in rings.items():
            if k == "ring_length":
                want_read = want_written = _span(t[row])
            else:
                want_read = _span(t[row, :c]) if c else set()
                want_written = _span(t[row, first:first + T])
            assert _within(touched[False], t) == want_read, f"lane {b} (count {c}) reads of {k}"
            assert _within(touched[True], t) == want_written, f"lane {b} (count {c}) writes of {k}"
    assert analysis.cta_races(res) == [], "bytes shared between CTAs with a write"
    assert analysis.intra_cta_races(res) == [], "a global race inside a CTA"
    assert analysis.intra_cta_races(res, shared=True) == [], "a shared-memory race inside a CTA"
