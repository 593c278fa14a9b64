"""GPU suite for the replay kernel (skipped without CUDA; docs/contract.md, "Replay").

Passed on an H200 (2026-11-27). The checks the PTX tier makes on the CPU
(tests/ptx/test_ptx_replay.py), on the real kernel and at batch sizes the tier cannot afford:

* a decode crossing several flushes, rows at staggered ring positions, every padding kind:
  ``mamba3_step_fn``'s replay mode bit-identical to the stepwise kernel (``mamba3_step_fn``, pool mode with
  update_kv_state): every ``out`` (with ``from_checkpoint`` a flush's; an append's within the
  step's accuracy rule of the float64 recurrence) and every row at its flush; rows no lane reads
  keep their bits; likewise an 8-bit state (int8, e4m3) with outputs from the checkpoint, and 32
  rotary angles per head, replayed and from the checkpoint (passed on an H200, 2026-11-28);
* a replay step captured in a CUDA graph and replayed with new inputs equals eager, ring included
  (the ring lengths move on the device);
* a replay ``StatePool`` (``replay_ring=K``; run on an H200, 2026-11-27): ``decode_step`` and the CUDA-graph
  runner give the stepwise pool's outs bit for bit, ``materialize`` its rows (PyTorch's math then,
  within float32 rounding; bit for bit with the kernel's flush form since, passed on an H200 2026-11-28);
* verify rounds on a replay pool (``replay_draft=T``; run on an H200, 2026-11-27): the drafts' outs are the
  stepwise T-token kernel's bit for bit, the accepted tokens committed by ``num_accepted_tokens``;
* verify steps with the drafts' outputs from the checkpoint (written 2026-11-28, not yet run on a GPU):
  rows and ring bit-identical to the replayed verify step's, the outs within the accuracy rule.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, K flush length.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_accurate, assert_append_accurate, replay_call, replay_fn

from mamba3_step import mamba3_step_fn, new_ring, plan_step
from mamba3_step.tools.replay_reference import draft_references
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import (bits_equal, lane_inputs, layer_weights, rotary_angles, rotary_biases, rotary_rates,
                                 row_tensors)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
H, D, N, R = 4, 64, 128, 4
EIGHT_BIT = ("int8", "float8_e4m3fn")
PADDING = (-1, -(2**31), 2**31 - 1)


class Layer:
    """One layer's pools for the replay kernel and the stepwise kernel; ``S > 0``: with S rotary angles
    per head (per-head B/C, biases)."""

    def __init__(self, P: int, K: int, seed: int, state_dtype: str = "float32", S: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        rows = row_tensors(P, H, D, N, R, state_dtype=state_dtype, generator=self.g, device=DEV)
        self.w = layer_weights(H, D, R, generator=self.g, device=DEV)
        if S:
            rows["angle_state"] = rotary_angles(P, H, S, generator=self.g, device=DEV)
            self.w.update(rotary_biases(R, H, N, generator=self.g, device=DEV))
        self.replay = {k: v.clone() for k, v in rows.items()}
        self.stepwise = {k: v.clone() for k, v in rows.items()}
        self.rounded = state_dtype in EIGHT_BIT  # an 8-bit state is always rounded stochastically
        self.ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, device=DEV,
                             stochastic=self.rounded, rope_angles=S)
        self.P, self.K, self.S = P, K, S

    def call(self, pools: dict, lane: dict, index: torch.Tensor, out=None, rand_seed=None) -> StepTensors:
        w = self.w
        return StepTensors(pools["state"], pools["Bstate"], pools["Xstate"], lane["A"], lane["B"], lane["C"], w["D"],
                           lane["x"], lane["dt"], lane["trap"], w["xproj"], outproj=w["outproj"], out=out, z=lane["z"],
                           zproj=w["zproj"], state_batch_indices=index, state_scale=pools.get("state_scale"),
                           rand_seed=rand_seed, angle_state=pools.get("angle_state"),
                           angle_proj=lane.get("angle_proj"), B_bias=w.get("B_bias"), C_bias=w.get("C_bias"))

    def lane(self, B: int) -> dict:
        lane = lane_inputs(B, H, D, N, R, generator=self.g, device=DEV)
        if self.S:
            lane["angle_proj"] = rotary_rates((B,), H, self.S, generator=self.g, device=DEV)
        return lane


def _index(B: int, P: int, step: int) -> torch.Tensor:
    """Lane b reads row b, but a few lanes (moving with the step) are padding of every kind."""
    rows = list(range(B))
    for b in range(step % 3, B, 7):  # a few padding lanes, moving
        rows[b] = PADDING[b % len(PADDING)]
    return torch.tensor(rows, dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("from_checkpoint", [False, True])
@pytest.mark.parametrize("K", [2, 4, 8])
@pytest.mark.parametrize("B", [1, 64, 256])
def test_replay_decode_matches_the_stepwise_kernel(B, K, from_checkpoint):
    _decode(B, K, from_checkpoint)


@pytest.mark.parametrize("B", [1, 256])
def test_replay_decode_at_8_warps_matches_the_stepwise_kernel(B):
    """K = 4 replayed at 8 warps a CTA (what gpu_bench.py --suite replay --replay-warps 8 times)."""
    _decode(B, 4, False, num_warps=8)


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("state_dtype", EIGHT_BIT)
def test_8bit_replay_from_checkpoint_matches_the_stepwise_kernel(state_dtype, K):
    """An 8-bit state with outputs from the checkpoint: appends within the contract (the scaled
    checkpoint contracted), flushes and their rows (scales included) bit for bit the stepwise
    kernel's, each replayed entry rounding with its step's draws."""
    _decode(64, K, True, state_dtype=state_dtype)


@pytest.mark.parametrize("from_checkpoint", [False, True])
@pytest.mark.parametrize("K", [2, 4])
def test_rotary_replay_matches_the_stepwise_kernel(K, from_checkpoint):
    """With 32 rotary angles per head (per-head B/C, biases): replayed outputs bit for bit, appends
    from the checkpoint within the contract (evaluated with the angles the kernel stored), flushed
    rows (the angle included) bit for bit."""
    _decode(64, K, from_checkpoint, S=32)


def _decode(B: int, K: int, from_checkpoint: bool, num_warps=None, state_dtype: str = "float32", S: int = 0):
    P = B + 3
    layer = Layer(P, K, seed=B * 10 + K, state_dtype=state_dtype, S=S)
    # every ring starts empty; the moving padding lanes skip rows' steps, so their positions stagger
    for step in range(2 * K + 1):
        index = _index(B, P, step)
        lane = layer.lane(B)
        before = {k: v.clone() for k, v in layer.replay.items()}
        ring = {f: getattr(layer.ring, f).clone() for f in ("B", "x", "coef", "length", "angle")
                if getattr(layer.ring, f) is not None}
        seed = torch.tensor([20261128, 2**62 + 977 * step], dtype=torch.int64, device=DEV) if layer.rounded else None
        got = replay_fn(layer.call(layer.replay, lane, index, rand_seed=seed), layer.ring, K,
                             replay_from_checkpoint=from_checkpoint, num_warps=num_warps)
        want = mamba3_step_fn(**layer.call(layer.stepwise, lane, index, rand_seed=seed)._asdict(),
                              update_kv_state=True, stochastic_rounding=layer.rounded)
        for b, row in enumerate(index.tolist()):
            if not 0 <= row < P:
                assert torch.equal(got[b], torch.zeros_like(got[b])), f"padding lane {b}"
                continue
            if not from_checkpoint or int(ring["length"][row, 0]) == K - 1:
                assert bits_equal(got[b], want[b]), f"step {step} lane {b}"
            else:
                assert_append_accurate(f"step {step} lane {b}", got[b], layer.call(layer.replay, lane, index), before,
                                       ring, row, b, layer.ring.angle)
            if int(layer.ring.length[row, 0]) == 0:
                for k in layer.replay:
                    assert bits_equal(layer.replay[k][row], layer.stepwise[k][row]), f"step {step} row {row} {k}"
        for row in range(B, P):  # rows no lane reads
            for k in layer.replay:
                assert bits_equal(layer.replay[k][row], before[k][row]), f"row {row} of {k} written"


def _run(plan, call: StepTensors, ring):
    return plan.run(**call._replace(replay_ring=ring)._asdict())


def test_a_replay_plan_equals_the_replay_mode_and_captures_in_a_graph():
    """``plan_step`` of the replay mode once, ``run`` every step with new lane tensors, eager and captured
    in a CUDA graph: outs, rows and rings bit for bit ``mamba3_step_fn``'s over a decode crossing flushes."""

    B, P, K = 16, 20, 4
    fn, planned, graphed = Layer(P, K, seed=9), Layer(P, K, seed=9), Layer(P, K, seed=9)
    index = _index(B, P, 2)
    static = graphed.lane(B)
    out, eager_out = (torch.empty(B, H, D, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    planned_call, options = replay_call(planned.call(planned.replay, static, index, out), planned.ring, K)
    plan = plan_step(**planned_call._asdict(), **options._asdict())  # one plan for both
    scratch = Layer(P, K, seed=10)  # warms up outside the capture, on other pools
    _run(plan, scratch.call(scratch.replay, static, index, out), scratch.ring)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(plan, graphed.call(graphed.replay, static, index, out), graphed.ring)
    for step in range(2 * K + 1):
        lane = fn.lane(B)
        want = replay_fn(fn.call(fn.replay, lane, index), fn.ring, K)
        got = _run(plan, planned.call(planned.replay, lane, index, eager_out), planned.ring)
        for k, v in lane.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        assert got is eager_out and bits_equal(got, want) and bits_equal(out, want), f"step {step}: out"
        for layer in (planned, graphed):
            assert all(bits_equal(layer.replay[k], fn.replay[k]) for k in fn.replay), f"step {step}: rows"
            assert all(bits_equal(a, b) for a, b in zip(layer.ring[:4], fn.ring[:4])), f"step {step}: ring"


@pytest.mark.parametrize("from_checkpoint", [False, True])
def test_replay_graph_equals_eager(from_checkpoint):
    B, P, K = 16, 20, 4
    eager, graphed = Layer(P, K, seed=7), Layer(P, K, seed=7)
    index = _index(B, P, 1)
    static = graphed.lane(B)
    out = torch.empty(B, H, D, dtype=torch.bfloat16, device=DEV)
    scratch = Layer(P, K, seed=8)  # compiles and warms up outside the capture, on other pools
    replay_fn(scratch.call(scratch.replay, static, index, out), scratch.ring, K, replay_from_checkpoint=from_checkpoint)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay_fn(graphed.call(graphed.replay, static, index, out), graphed.ring, K,
                       replay_from_checkpoint=from_checkpoint)
    for step in range(2 * K + 1):
        lane = eager.lane(B)
        for k, v in lane.items():
            static[k].copy_(v)
        graph.replay()
        want = replay_fn(eager.call(eager.replay, lane, index), eager.ring, K, replay_from_checkpoint=from_checkpoint)
        torch.cuda.synchronize()
        assert bits_equal(out, want), f"step {step}: out"
        for k in eager.replay:
            assert bits_equal(graphed.replay[k], eager.replay[k]), f"step {step}: {k}"
        for a, b in zip(graphed.ring[:4], eager.ring[:4]):
            assert bits_equal(a, b), f"step {step}: ring"


@pytest.mark.parametrize("K", [2, 4])
def test_replay_pool_decode_and_graph_runner_match_the_stepwise_pool(K):
    """A replay StatePool on the GPU: decode_step (eager) and the CUDA-graph runner give the stepwise
    pool's outs bit for bit over 2K + 1 steps with a padding lane; materialize gives its rows."""
    from mamba3_step.serving import CudaGraphStepRunner, ReplayStatePool, StatePool, decode_step

    g = torch.Generator().manual_seed(K)
    pools = [ReplayStatePool(1, 12, H, D, N, R, replay_ring=K, device=DEV) for _ in range(2)]
    stepwise = StatePool(1, 12, H, D, N, R, device=DEV)
    w = layer_weights(H, D, R, generator=g, device=DEV)
    slots = stepwise.alloc(5)
    assert all(torch.equal(pool.alloc(5), slots) for pool in pools)
    fresh = torch.randn(5, H, D, N, generator=g).to(DEV)
    for pool in (*pools, stepwise):
        pool.state(0)[slots.long().to(DEV)] = fresh
    runner = CudaGraphStepRunner(pools[1], 0, buckets=(8,), **w)
    padded = torch.cat([slots, torch.tensor([-1], dtype=torch.int32)]).to(DEV)
    for step in range(2 * K + 1):
        lane = lane_inputs(6, H, D, N, R, generator=g, device=DEV)
        want = decode_step(stepwise, 0, padded, **lane, **w)
        eager = decode_step(pools[0], 0, padded, **lane, **w)
        graphed = runner.step(padded, **lane)
        torch.cuda.synchronize()
        assert bits_equal(eager, want) and bits_equal(graphed, want), f"step {step}"
        _check_materialized(pools[0], stepwise, slots, w, f"step {step}")


def _check_materialized(replay, stepwise, slots: torch.Tensor, w: dict, where: str) -> None:
    """``materialize`` (the replay kernel's flush form, ``materialize_fn``) against the stepwise kernel's
    rows: state, Bstate and Xstate bit for bit, whatever the ring holds."""
    cur = replay.materialize(0, slots, xproj=w["xproj"], D=w["D"], zproj=w["zproj"], outproj=w["outproj"])
    rows = slots.long().to(DEV)
    want = stepwise.layer_rows(0)
    for k in ("state", "Bstate", "Xstate"):
        assert bits_equal(getattr(cur, k), want[k][rows]), f"{where}: materialized {k}"


class Speculative:
    """A replay pool made for ``draft`` drafts (and ``twins`` more like it), a stepwise pool that steps only
    the accepted tokens, one by one, and a scratch pool for the stepwise outs; five live slots and a
    padding lane."""

    def __init__(self, K: int, draft: int, seed: int, twins: int = 0):
        from mamba3_step.serving import ReplayStatePool, StatePool

        self.g = torch.Generator().manual_seed(seed)
        self.replays = [ReplayStatePool(1, 12, H, D, N, R, replay_ring=K, replay_draft=draft, device=DEV)
                        for _ in range(1 + twins)]
        self.stepwise, self.scratch = (StatePool(1, 12, H, D, N, R, device=DEV) for _ in range(2))
        self.w = layer_weights(H, D, R, generator=self.g, device=DEV)
        self.slots = self.stepwise.alloc(5)
        for pool in self.replays:
            assert torch.equal(pool.alloc(5), self.slots)
        fresh = torch.randn(5, H, D, N, generator=self.g).to(DEV)
        for pool in (*self.replays, self.stepwise):
            pool.state(0)[self.slots.long().to(DEV)] = fresh
        self.padded = torch.cat([self.slots, torch.tensor([-1], dtype=torch.int32)]).to(DEV)

    def commit(self, pending: dict, accepted: torch.Tensor) -> None:
        """The stepwise pool steps each lane's first ``accepted`` tokens of ``pending`` (B, T, ...)."""
        from mamba3_step.serving import decode_step

        for j in range(pending["x"].shape[1]):
            go = torch.where(accepted > j, self.padded, torch.full_like(self.padded, -1))
            decode_step(self.stepwise, 0, go, **{k: v[:, j] for k, v in pending.items()}, **self.w)

    def stepwise_outs(self, lane: dict) -> torch.Tensor:
        """The stepwise kernel's outs for ``lane`` from the stepwise pool's rows (on a scratch copy)."""
        from mamba3_step.serving import decode_step

        for mine, theirs in zip(self.scratch._pools(), self.stepwise._pools()):
            mine.copy_(theirs)
        return decode_step(self.scratch, 0, self.padded, **lane, **self.w)

    def committed(self, accepted: torch.Tensor) -> torch.Tensor:
        """Each live slot's committed count once ``accepted`` is taken."""
        return self.replays[0].ring(0).length[self.slots.long().to(DEV), 0] + accepted[:-1]


@pytest.mark.parametrize("K, T", [(4, 4), (8, 4), (2, 2)])
def test_verify_rounds_on_a_replay_pool_match_the_stepwise_kernel(K, T):
    """Speculative rounds on a replay pool (``replay_draft=T``) through decode_step and, on a twin pool,
    the CUDA-graph runner: every draft's out is the stepwise T-token kernel's on a copy of a stepwise pool
    that steps only the accepted tokens (one by one), bit for bit; every flushed row equals it bit for bit,
    the others within float32 rounding."""
    from mamba3_step.serving import CudaGraphStepRunner, decode_step

    pools = Speculative(K, T, seed=10 * K + T, twins=1)
    replay, twin = pools.replays
    runner = CudaGraphStepRunner(twin, 0, buckets=(8,), **pools.w)
    pending, flushed = None, 0
    for step in range(3 * K):
        accepted = torch.randint(0, T + 1, (6,), generator=pools.g, dtype=torch.int32).to(DEV) if step else None
        if accepted is not None:
            pools.commit(pending, accepted)
            flushed += int((pools.committed(accepted) >= K).sum())
        lane = lane_inputs(6, H, D, N, R, tokens=T, generator=pools.g, device=DEV)
        got = decode_step(replay, 0, pools.padded, **lane, **pools.w, num_accepted_tokens=accepted)
        graphed = runner.step(pools.padded, **lane, num_accepted_tokens=accepted)
        want = pools.stepwise_outs(lane)
        torch.cuda.synchronize()
        assert bits_equal(got, want) and bits_equal(graphed, want), f"step {step}: drafts"
        assert got[-1].eq(0).all(), f"step {step}: the padding lane"
        _check_materialized(replay, pools.stepwise, pools.slots, pools.w, f"step {step}")
        pending = lane
    assert flushed >= 2, flushed


@pytest.mark.parametrize("K", [4, 8])
def test_verify_drafts_from_the_checkpoint(K):
    """Verify steps with ``replay_from_checkpoint=True`` (no draft stepped) against the replayed verify step on
    a twin layer (stepwise decoding's drafts, bit for bit: the tests above), random drafts accepted,
    padding lanes of every kind: every row and the whole ring bit-identical between the two (a flush
    replays the same), every draft's ``out`` within the accuracy rule of the float64 algebra (on the
    CPU) from the checkpoint it read: the flush's, or the row's and its committed ring tokens."""
    T, P, B = 4, 24, 20
    layer, twin = Layer(P, K, seed=40 + K), Layer(P, K, seed=40 + K)
    rings = [new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, draft=T, device=DEV)
             for _ in range(2)]
    g = torch.Generator().manual_seed(K)
    flushes = appends = 0
    for step in range(2 * K + 2):
        lane = lane_inputs(B, H, D, N, R, tokens=T, generator=g, device=DEV)
        index = _index(B, P, step)
        acc = torch.randint(0, T + 1, (B,), generator=g, dtype=torch.int32).to(DEV) if step else None
        before = {k: v.cpu().clone() for k, v in (*layer.replay.items(), *((f"ring.{f}", getattr(rings[0], f))
                                                                              for f in ("B", "x", "coef", "length")))}
        got = replay_fn(layer.call(layer.replay, lane, index), rings[0], K, num_accepted_tokens=acc, replay_from_checkpoint=True)
        want = replay_fn(twin.call(twin.replay, lane, index), rings[1], K, num_accepted_tokens=acc)
        torch.cuda.synchronize()
        for k in layer.replay:
            assert bits_equal(layer.replay[k], twin.replay[k]), f"step {step}: {k}"
        for f in ("B", "x", "coef", "length"):
            assert bits_equal(getattr(rings[0], f), getattr(rings[1], f)), f"step {step}: ring.{f}"
        cpu = layer.call({k: v.cpu() for k, v in layer.replay.items()}, {k: v.cpu() for k, v in lane.items()},
                         index.cpu())._replace(**{k: v.cpu() for k, v in layer.w.items()})
        for b, row in enumerate(index.tolist()):
            if not 0 <= row < P:
                assert got[b].eq(0).all(), f"step {step}: padding lane {b}"
                continue
            count = int(before["ring.length"][row, 0]) + (int(acc[b]) if acc is not None else 0)
            flushed = count >= K
            flushes, appends = flushes + flushed, appends + (not flushed and count > 0)
            pools = {k: v.cpu() for k, v in layer.replay.items()} if flushed else before
            base = tuple(pools[k] for k in ("state", "Bstate", "Xstate"))
            ring = {f: before[f"ring.{f}"] for f in ("B", "x", "coef")}
            want64, torch32 = (draft_references(cpu, base, ring, 0 if flushed else count, row, b, cd)
                               for cd in (torch.float64, torch.float32))
            assert_accurate(f"step {step} lane {b}", got[b].cpu(), want64, torch32.to(got.dtype),
                            want64.abs().max().item())
        assert not bits_equal(got, want), "the drafts from the checkpoint equal the stepped ones bit for bit"
    assert flushes >= 4 and appends >= 4, (flushes, appends)


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("small", [2, 1])
def test_steps_with_fewer_drafts_than_the_pool_holds(K, small):
    """A pool made for 3 drafts (``replay_draft=3``), steps of 3, 3 and ``small`` drafts in turn (2
    drafts, or one token: x without a token axis, its token committed), every draft accepted by a
    ``small`` step: that step commits up to K - 1 + 3 entries, more than its own need (the kernel
    specialised on the ring's entries, ``StepSpec.replay_draft``). Outs bit for bit the stepwise
    kernel's, rows as in the test above."""
    from mamba3_step.serving import decode_step

    pools = Speculative(K, 3, seed=70 + K + small)
    replay = pools.replays[0]
    pending, beyond = None, 0
    for step in range(4 * K):
        T = (3, 3, small)[step % 3]  # two 3-draft steps let the ring hold committed tokens before `small`
        accepted = None
        if pending is not None:
            tp = pending["x"].shape[1]
            accepted = (torch.full((6,), tp, dtype=torch.int32) if T < 3 else
                        torch.randint(0, tp + 1, (6,), generator=pools.g, dtype=torch.int32)).to(DEV)
            pools.commit(pending, accepted)
            beyond += int((pools.committed(accepted) > K - 1 + (T if T > 1 else 0)).sum())
        lane = lane_inputs(6, H, D, N, R, tokens=T if T > 1 else None, generator=pools.g, device=DEV)
        got = decode_step(replay, 0, pools.padded, **lane, **pools.w, num_accepted_tokens=accepted)
        want = pools.stepwise_outs(lane)
        assert bits_equal(got, want), f"step {step} (T = {T}): outs"
        assert got[-1].eq(0).all(), f"step {step}: the padding lane"
        pending = lane
        if T == 1:  # the token is committed: the stepwise pool steps it too
            decode_step(pools.stepwise, 0, pools.padded, **lane, **pools.w)
            pending = None
        _check_materialized(replay, pools.stepwise, pools.slots, pools.w, f"step {step}")
    assert beyond > 0, "no step committed more than its own need"


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("B", [1, 64])
def test_replay_destinations_flush_into_another_row(B, K):
    """One-token replay steps with ``dst_state_batch_indices``: every other step a third of the lanes
    move to the free rows (their state flushed there, bit for bit the stepwise kernel's row with the
    same destinations; the destination's ring emptied; the source row and ring untouched), one lane
    at most has a padding destination (nothing written), the rest write back to their own row."""
    P = 2 * B + 3
    layer = Layer(P, K, seed=B * 10 + K + 5)
    rows, free = list(range(B)), list(range(B, P))
    for step in range(2 * K + 2):
        dst = list(rows)
        if step % 2:
            moving = rows[::3]
            for b in range(0, B, 3):
                dst[b] = free.pop(0)
            free += moving
        if step == 3 and B > 1:
            dst[1] = -1
        index, dst_t = (torch.tensor(v, dtype=torch.int32, device=DEV) for v in (rows, dst))
        lane = layer.lane(B)
        before = {k: v.clone() for k, v in layer.replay.items()}
        ring = {f: getattr(layer.ring, f).clone() for f in ("B", "x", "coef", "length", "angle")
                if getattr(layer.ring, f) is not None}
        got = replay_fn(layer.call(layer.replay, lane, index)._replace(dst_state_batch_indices=dst_t),
                             layer.ring, K)
        want = mamba3_step_fn(**layer.call(layer.stepwise, lane, index)._replace(
            dst_state_batch_indices=dst_t)._asdict(), update_kv_state=True)
        torch.cuda.synchronize()
        assert bits_equal(got, want), f"step {step}: outs"
        for b, (row, to) in enumerate(zip(rows, dst)):
            if to == -1:
                assert all(bits_equal(layer.replay[k][row], before[k][row]) for k in before), f"step {step}: lane {b}"
                assert bits_equal(layer.ring.length[row], ring["length"][row]), f"step {step}: lane {b}'s ring"
            elif to != row:
                assert int(layer.ring.length[to, 0]) == 0, f"step {step}: row {to}'s ring"
                assert all(bits_equal(layer.replay[k][to], layer.stepwise[k][to]) for k in before), f"step {step}"
                assert all(bits_equal(layer.replay[k][row], before[k][row]) for k in before), f"step {step}: source"
                assert bits_equal(layer.ring.length[row], ring["length"][row]), f"step {step}: source ring"
            elif int(layer.ring.length[row, 0]) == 0:
                assert all(bits_equal(layer.replay[k][row], layer.stepwise[k][row]) for k in before), f"step {step}"
        rows = [to if to >= 0 else row for row, to in zip(rows, dst)]
