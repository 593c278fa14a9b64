"""The replay kernel, executed: its PTX run on the CPU for the replay specialisations
(``StepSpec.replay_ring``; docs/contract.md, "Replay"; ``REPLAY`` in test_kernel_compile.py).

1. Over a decode that crosses several flushes, with requests joining (a reset row: a new
   checkpoint, an empty ring, stale entries poisoned) and leaving, lanes reshuffled every step and
   every padding kind in the batch, the replay kernel is bit-identical to the executed stepwise
   kernel (the same specialisation without replay, which users run by default): every step's
   ``out`` (with ``replay_from_checkpoint`` a flush's; an append's is within twice PyTorch-float32's
   error of the float64 recurrence from the stored checkpoint), and after each flush the row's
   state, Bstate and Xstate. Its ring (entries and lengths) equals the CPU path's bit for bit; rows
   no lane reads keep their bits in every pool and ring.
2. Padding lanes, and lanes whose ring length is out of range, write +0.0 to ``out`` and no byte
   of any pool or ring (an out-of-range lane reads only its lengths); a live lane at ring position
   ``c`` reads exactly its state, Bstate and Xstate rows, ring entries ``[0, c)`` and its lengths,
   and writes exactly its three rows (a flush) or entry ``c`` (an append), and its lengths. No
   race between CTAs or threads.
3. The bytes the executed kernel touches equal ``bytes_model.replay_bytes`` at every ring position.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, K flush length.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_append_accurate
from test_kernel_compile import LAUNCH_BOUND, LAUNCH_BOUND_FULL, REPLAY, REPLAY_DST, REPLAY_FULL

from mamba3_step.tools.bytes_model import replay_bytes
from ptx_executor import analysis
from mamba3_step.tools.ptx_tier import run_step_ptx
from mamba3_step.replay import new_ring, replay_step
from mamba3_step.rotary import ANGLE_UNIT_RADIANS
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import (bits_equal, lane_inputs, layer_weights, poison_, rotary_angles, rotary_biases,
                                 rotary_rates, row_tensors)

P, NULL = 8, 7
#: padding values of every kind (negative, out of range, the null slot)
PADDING = (-1, P, -(2**31), 2**31 - 1, NULL)
RING_TENSORS = {"ring_B": "B", "ring_x": "x", "ring_coef": "coef", "ring_length": "length"}
#: a ring's fields, the angles with rotary
RING_FIELDS = ("B", "x", "coef", "length", "angle", "offset", "drawn_for")
#: the pools a flush writes (angle_state with rotary, state_scale with an 8-bit state)
POOLS = ("state", "Bstate", "Xstate", "angle_state", "state_scale")
#: stochastic rounding's seed (each step draws a random offset)
SEED = 0x5EED_0F_5EED


def _spec(name: str) -> StepSpec:
    return {**REPLAY, **REPLAY_DST, **LAUNCH_BOUND}[name].with_default_tiling()


def _stepwise(spec: StepSpec) -> StepSpec:
    """The stepwise specialisation a server runs without replay: the same flags, its default tiling."""
    return spec.replace(replay_ring=0, tile_D=0, num_warps=0, min_ctas_per_sm=0).with_default_tiling()


def _heads(spec: StepSpec) -> int:
    return 1 if spec.dstate * spec.headdim * spec.mimo >= 128 * 64 * 4 else 2


def rotary_rows(spec: StepSpec, rows: int, H: int, g: torch.Generator) -> dict:
    """With rotary, ``angle_state`` (rows, H, S); else nothing."""
    return {"angle_state": rotary_angles(rows, H, spec.rope_angles, generator=g)} if spec.rope_angles else {}


def rotary_weights(spec: StepSpec, H: int, g: torch.Generator) -> dict:
    """With B/C biases, ``B_bias``/``C_bias`` (R, H, N); else nothing."""
    return rotary_biases(spec.mimo, H, spec.dstate, generator=g) if spec.has_bc_bias else {}


def lane_with_rotary(spec: StepSpec, lane: dict, g: torch.Generator) -> dict:
    """``lane`` with rotary's ``angle_proj`` (B, [T,] H, S), with stochastic rounding a ``rand_seed``
    at a random offset (near the int64 wrap now and then), and, with B/C shared by the heads, B and C
    of one head."""
    if spec.stochastic_rounding:
        offset = int(torch.randint(-(2**62), 2**62, (), generator=g)) * 2 + int(torch.randint(0, 2, (), generator=g))
        lane["rand_seed"] = torch.tensor([SEED, offset], dtype=torch.int64)
    if spec.rope_angles:
        lane["angle_proj"] = rotary_rates(lane["x"].shape[:-2], lane["x"].shape[-2], spec.rope_angles, generator=g)
    if spec.shared_bc:
        lane["B"], lane["C"] = lane["B"][..., :1, :].contiguous(), lane["C"][..., :1, :].contiguous()
    return lane


def rotary_arguments(pools: dict, lane: dict, weights: dict) -> dict:
    """The rotary and rounding arguments of a test layer's call (None without them)."""
    return dict(angle_state=pools.get("angle_state"), angle_proj=lane.get("angle_proj"),
                B_bias=weights.get("B_bias"), C_bias=weights.get("C_bias"), rand_seed=lane.get("rand_seed"),
                state_scale=pools.get("state_scale"))


def ring_snapshot(ring) -> dict:
    """Copies of a ring's fields (:data:`RING_FIELDS`, those it has) as ``ring.<field>``."""
    return {f"ring.{f}": getattr(ring, f).clone() for f in RING_FIELDS if getattr(ring, f) is not None}


def join_request(layer, row: int) -> None:
    """A new request in ``row`` of a test layer (``spec``, ``H``, ``g``, ``io``, ``pools`` and ``rings``
    by kind): a fresh checkpoint in every copy of the pools, an empty ring in every ring."""
    s = layer.spec
    fresh = row_tensors(1, layer.H, s.headdim, s.dstate, s.mimo, state_dtype=s.state_dtype, generator=layer.g,
                        **layer.io)
    fresh.update(rotary_rows(s, 1, layer.H, layer.g))
    for pools in layer.pools.values():
        for k, v in fresh.items():
            pools[k][row] = v[0]
    for ring in layer.rings.values():
        ring.length[row] = 0


class Layer:
    """Three copies of one layer's pools: the replay kernel's (with its ring), the stepwise kernel's,
    and the CPU path's (with its ring)."""

    def __init__(self, spec: StepSpec, seed: int):
        self.spec, self.H = spec, _heads(spec)
        self.g = torch.Generator().manual_seed(seed)
        self.io = dict(kv_dtype=spec.kv_dtype, x_dtype=spec.x_dtype)
        rows = row_tensors(P, self.H, spec.headdim, spec.dstate, spec.mimo, state_dtype=spec.state_dtype,
                           generator=self.g, **self.io)
        rows.update(rotary_rows(spec, P, self.H, self.g))
        self.weights = layer_weights(self.H, spec.headdim, spec.mimo, proj_dtype=spec.proj_dtype, has_z=spec.has_z,
                                     has_outproj=spec.has_outproj, generator=self.g)
        self.weights.update(rotary_weights(spec, self.H, self.g))
        self.pools = {kind: {k: v.clone() for k, v in rows.items()} for kind in ("replay", "stepwise", "cpu")}
        self.flushed = tuple(k for k in POOLS if k in rows)  # the rows a flush writes
        kv, xt = rows["Bstate"].dtype, rows["Xstate"].dtype
        shape = (P, spec.replay_ring, spec.mimo, self.H, spec.dstate, spec.headdim)
        self.rings = {kind: new_ring(*shape, kv_dtype=kv, x_dtype=xt, rope_angles=spec.rope_angles,
                                     stochastic=spec.stochastic_rounding) for kind in ("replay", "cpu")}
        for ring in self.rings.values():  # entries past a row's length are never read
            for t in (ring.B, ring.x, ring.coef, ring.angle, ring.offset, ring.drawn_for):
                if t is not None:
                    poison_(t, seed=3)

    def lane(self, B: int) -> dict:
        s = self.spec
        lane = lane_inputs(B, self.H, s.headdim, s.dstate, s.mimo, has_z=s.has_z, generator=self.g, **self.io)
        return lane_with_rotary(s, lane, self.g)

    def call(self, kind: str, lane: dict, index: torch.Tensor, out=None, dst=None) -> StepTensors:
        p, w = self.pools[kind], self.weights
        return StepTensors(p["state"], p["Bstate"], p["Xstate"], lane["A"], lane["B"], lane["C"], w["D"], lane["x"],
                           lane["dt"], lane["trap"], w["xproj"], outproj=w["outproj"], out=out, z=lane["z"],
                           zproj=w["zproj"], state_batch_indices=index, dst_state_batch_indices=dst, null_slot_id=NULL,
                           **rotary_arguments(p, lane, w))

    def out(self, B: int) -> torch.Tensor:
        s, x_dtype = self.spec, self.pools["replay"]["Xstate"].dtype
        shape = (B, self.H, s.headdim) if s.has_outproj else (B, s.mimo, self.H, s.headdim)
        return poison_(torch.empty(shape, dtype=x_dtype), seed=B)

    def join(self, row: int) -> None:
        join_request(self, row)

    def step(self, lane: dict, index: torch.Tensor, dst=None) -> tuple:
        """One step in each copy: ``(replay out, stepwise out)``, both executed from PTX."""
        B = index.numel()
        got, want = self.out(B), self.out(B)
        run_step_ptx(self.spec, self.call("replay", lane, index, got, dst), ring=self.rings["replay"])
        run_step_ptx(_stepwise(self.spec), self.call("stepwise", lane, index, want, dst))
        replay_step(self.call("cpu", lane, index, None, dst), self.rings["cpu"], self.spec.replay_ring,
                    exact_outputs=not self.spec.replay_from_checkpoint, rotate_pairwise=self.spec.rotate_pairwise)
        return got, want

    def snapshot(self) -> dict:
        held = {f"{k}": v.clone() for k, v in self.pools["replay"].items()}
        held.update(ring_snapshot(self.rings["replay"]))
        return held


# REPLAY_FULL (test_kernel_compile.py says which and why) with --full-matrix only
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.full_matrix] if n in REPLAY_FULL | LAUNCH_BOUND_FULL
                                                else []) for n in {**REPLAY, **LAUNCH_BOUND}])
def test_replay_decode_is_bit_identical_to_the_executed_stepwise_kernel(name):
    spec = _spec(name)
    K = spec.replay_ring
    layer = Layer(spec, seed=11)
    rng = np.random.default_rng(5)
    active = [0, 1, 2]
    schedule = {2: (1, 4), K + 1: (0, 5), 2 * K: (2, 6)}  # step -> (row that leaves, row that joins)
    flushes = {}
    for s in range(3 * K + 1):
        if s in schedule:
            leave, join = schedule[s]
            active[active.index(leave)] = join
            layer.join(join)
        lanes = list(active) + list(rng.choice(PADDING, size=2, replace=False))
        rng.shuffle(lanes)
        index = torch.tensor(lanes, dtype=torch.int32)
        before = layer.snapshot()
        lane = layer.lane(len(lanes))
        got, want = layer.step(lane, index)
        for b, row in enumerate(lanes):
            if row not in active:
                assert torch.equal(got[b], torch.zeros_like(got[b])) and not got[b].float().signbit().any(), \
                    f"{name} step {s}: padding lane {b} out"
            elif not spec.replay_from_checkpoint or int(before["ring.length"][row, 0]) == K - 1:
                assert bits_equal(got[b], want[b]), f"{name} step {s}: lane {b} out differs from the stepwise kernel's"
            else:
                check_append(layer, before, lane, index, b, row, got[b], f"{name} step {s} lane {b}")
        replay, stepwise = layer.pools["replay"], layer.pools["stepwise"]
        for row in active:
            if int(layer.rings["replay"].length[row, 0]) == 0:  # flushed: the checkpoint is the current state
                flushes[row] = flushes.get(row, 0) + 1
                for k in layer.flushed:
                    assert bits_equal(replay[k][row], stepwise[k][row]), f"{name} step {s}: row {row} {k} at a flush"
        check_ring_and_other_rows(layer, before, layer.snapshot(), set(active), f"{name} step {s}")
    assert max(flushes.values()) >= 2, f"{name}: the decode crossed fewer than two flushes of one row"


@pytest.mark.parametrize("name", list(REPLAY_DST))
def test_replay_destinations_flush_into_another_row(name):
    """One-token steps with ``dst_state_batch_indices``: a lane whose destination is another row (a
    request moving to a new slot, as prefix caching does at a block boundary) flushes into it, bit
    for bit the executed stepwise kernel's new state there, the destination's ring emptied, the
    source row and its ring untouched; a padding destination computes ``out`` and writes nothing;
    a destination equal to the source is an ordinary replay step. Every flushing lane's ``out``
    (with ``replay_from_checkpoint``, every lane's out at a flush or a move; an append's within
    the accuracy rule) is the stepwise kernel's bit for bit; the ring equals the CPU path's."""
    spec = _spec(name)
    K = spec.replay_ring
    layer = Layer(spec, seed=23)
    rng = np.random.default_rng(9)
    active, free = [0, 1, 2], [3, 4, 5, 6]
    moved = padded = 0
    for s in range(3 * K + 2):
        lanes = list(active) + [int(rng.choice(PADDING))]
        rng.shuffle(lanes)
        dst, left = list(lanes), []
        for b, row in enumerate(lanes):
            if row in active and s % 2 == 1 and rng.random() < 0.6:  # this request moves to a free row
                dst[b] = free.pop(int(rng.integers(len(free))))
                left.append(row)  # free after this step: no row is one lane's source and another's destination
        free += left
        if s == 4:  # one live lane with a padding destination
            b = next(b for b, row in enumerate(lanes) if row in active and dst[b] == row)
            dst[b], padded = -1, padded + 1
        index, dst_t = torch.tensor(lanes, dtype=torch.int32), torch.tensor(dst, dtype=torch.int32)
        before = layer.snapshot()
        lane = layer.lane(len(lanes))
        got, want = layer.step(lane, index, dst_t)
        after = layer.snapshot()
        for b, (row, to) in enumerate(zip(lanes, dst)):
            if row not in active:
                assert _is_positive_zero(got[b]), f"{name} step {s}: padding lane {b} out"
                continue
            flush = to != row or int(before["ring.length"][row, 0]) == K - 1
            if flush or not spec.replay_from_checkpoint:
                assert bits_equal(got[b], want[b]), f"{name} step {s}: lane {b} out differs from the stepwise kernel's"
            else:
                check_append(layer, before, lane, index, b, row, got[b], f"{name} step {s} lane {b}")
            if to == -1:
                for k, v in before.items():
                    assert bits_equal(after[k][row], v[row]), f"{name} step {s}: padding destination wrote {k}"
            elif to != row:
                moved += 1
                assert int(after["ring.length"][to, 0]) == 0, f"{name} step {s}: row {to}'s ring not emptied"
                for k in layer.flushed:
                    assert bits_equal(after[k][to], layer.pools["stepwise"][k][to]), f"{name} step {s}: row {to} {k}"
                for k, v in before.items():
                    assert bits_equal(after[k][row], v[row]), f"{name} step {s}: source row {row} of {k} written"
            elif int(after["ring.length"][row, 0]) == 0:
                for k in layer.flushed:
                    assert bits_equal(after[k][row], layer.pools["stepwise"][k][row]), f"{name} step {s}: {k} flush"
        named = {r for row, to in zip(lanes, dst) if row in active for r in (row, to)}
        check_ring_and_other_rows(layer, before, after, named, f"{name} step {s}")
        active = [to if to >= 0 else row for row, to in zip(lanes, dst) if row in active]
    assert moved >= 3 and padded == 1, (moved, padded)


def check_append(layer, before: dict, lane: dict, index: torch.Tensor, b: int, row: int, got: torch.Tensor,
                 where: str) -> None:
    """Lane ``b``'s ``out`` of an append from the checkpoint (row ``row``; ``before``: the snapshot before
    the step) within the contract's accuracy (helpers.assert_append_accurate)."""
    ring = {f: before[f"ring.{f}"] for f in ("B", "x", "coef", "length", "angle") if f"ring.{f}" in before}
    assert_append_accurate(where, got, layer.call("replay", lane, index), before, ring, row, b,
                           layer.rings["replay"].angle, layer.spec.rotate_pairwise)


def ring_tensors(ring) -> dict:
    """A ring's tensors by kernel argument name (``ring_angle`` with rotary)."""
    named = {k: getattr(ring, f) for k, f in RING_TENSORS.items()}
    if ring.angle is not None:
        named["ring_angle"] = ring.angle
    return named


def check_ring_and_other_rows(layer, before: dict, after: dict, named: set, where: str) -> None:
    """The replay ring equals the CPU path's bit for bit, and every row outside ``named`` keeps every bit
    of every pool and ring (``before``/``after``: :meth:`Layer.snapshot`)."""
    for f in RING_FIELDS:
        got, cpu = getattr(layer.rings["replay"], f), getattr(layer.rings["cpu"], f)
        if f == "angle" and got is not None:  # tanh: the kernel's and PyTorch's differ in the last bits
            assert float((got - cpu).abs().max()) * ANGLE_UNIT_RADIANS < 1e-5, f"{where}: ring.angle (radians)"
        elif got is not None:
            assert bits_equal(got, cpu), f"{where}: ring.{f} differs from the CPU path's"
    for row in set(range(before["state"].shape[0])) - named:
        for k, v in before.items():
            assert bits_equal(after[k][row], v[row]), f"{where}: row {row} of {k} written"


def _is_positive_zero(t: torch.Tensor) -> bool:
    return torch.equal(t, torch.zeros_like(t)) and not t.float().signbit().any()


def _touched(res, lane: int) -> dict:
    """The bytes lane ``lane``'s CTAs read and wrote: ``{False: set, True: set}``."""
    log = res.log.arrays()
    mine = analysis.cta_of(res, log["thread"]) % res.grid[0] == lane
    touched = {}
    for write in (False, True):
        sel = mine & (log["write"] == write)
        touched[write] = {a + k for a, w in zip(log["addr"][sel].astype(np.int64).tolist(), log["width"][sel].tolist())
                          for k in range(w)}
    return touched


def _span(t: torch.Tensor) -> set:
    base = t.data_ptr()
    return set(range(base, base + t.numel() * t.element_size()))


def _within(addrs: set, t: torch.Tensor) -> set:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return {a for a in addrs if start <= a < end}


#: the touched-bytes test's --full-matrix names beyond REPLAY_FULL: R = 8 from the checkpoint (its code's
#: lanes and entries are the flagship's from-checkpoint form's, which runs by default)
TOUCHED_FULL = REPLAY_FULL | {"N32-D64-R8-replay-K3-bf16state-from-checkpoint-noout"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.full_matrix] if n in TOUCHED_FULL else [])
                                  for n in REPLAY])
def test_lanes_touch_exactly_their_rows_and_ring_entries(name):
    spec = _spec(name)
    K = spec.replay_ring
    layer = Layer(spec, seed=3)
    ring = layer.rings["replay"]
    counts = {0: 0, 1: K - 1, 2: K // 2, 3: K, 4: -1}  # row -> ring length (3 and 4 out of range)
    for row, c in counts.items():
        ring.length[row] = c
    lanes = [2, -1, 0, 3, P, 1, NULL, 4, -(2**31)]
    index = torch.tensor(lanes, dtype=torch.int32)
    out = layer.out(len(lanes))
    tensors = layer.call("replay", layer.lane(len(lanes)), index, out)
    res = run_step_ptx(spec, tensors, ring=ring, record_shared=True)
    rows = {k: tensors._asdict()[k] for k in layer.flushed}
    rings = ring_tensors(ring)
    for b, row in enumerate(lanes):
        touched = _touched(res, b)
        c = counts.get(row)
        live = c is not None and 0 <= c < K
        if not live:  # padding, or a ring length out of range: out is +0.0, no byte written
            assert torch.equal(out[b], torch.zeros_like(out[b])) and not out[b].float().signbit().any(), (name, b)
            for t in (*rows.values(), *rings.values()):
                assert not _within(touched[True], t), f"{name}: lane {b} (row {row}) wrote"
                if t is not ring.length or c is None:
                    assert not _within(touched[False], t), f"{name}: lane {b} (row {row}) read"
            if c is not None:
                assert _within(touched[False], ring.length) == _span(ring.length[row]), (name, b)
            continue
        flush = c == K - 1
        for k, t in rows.items():
            read = _span(t[row]) if k != "angle_state" or c == 0 else set()  # else the last entry's angle
            assert _within(touched[False], t) == read, f"{name}: lane {b} reads row {row} of {k}"
            assert _within(touched[True], t) == (_span(t[row]) if flush else set()), f"{name}: lane {b} writes {k}"
        for k, t in rings.items():
            if k == "ring_length":
                want_read = want_written = _span(t[row])
            else:
                want_read = _span(t[row, :c]) if c else set()
                want_written = set() if flush else _span(t[row, c])
            assert _within(touched[False], t) == want_read, f"{name}: lane {b} (position {c}) reads of {k}"
            assert _within(touched[True], t) == want_written, f"{name}: lane {b} (position {c}) writes of {k}"
    assert analysis.cta_races(res) == [], f"{name}: bytes shared between CTAs with a write"
    assert analysis.intra_cta_races(res) == [], f"{name}: a global race inside a CTA"
    assert analysis.intra_cta_races(res, shared=True) == [], f"{name}: a shared-memory race inside a CTA"


@pytest.mark.parametrize("name", ["flagship-replay-K4", pytest.param("N32-D64-R8-replay-K3-fp32io-noout",
                                                                     marks=pytest.mark.full_matrix)])
def test_executed_bytes_equal_the_bytes_model_at_every_ring_position(name):
    spec = _spec(name)
    K, B = spec.replay_ring, 3
    layer = Layer(spec, seed=8)
    ring = layer.rings["replay"]
    index = torch.tensor([4, 0, 6], dtype=torch.int32)
    for position in range(K):
        ring.length[index.long()] = position
        tensors = layer.call("replay", layer.lane(B), index, layer.out(B))
        res = run_step_ptx(spec, tensors, ring=ring)
        touched = analysis.bytes_touched(res, res.extra["memory"])
        executed = {k: n["read"] + n["written"] for k, n in touched.items()}
        model = replay_bytes(spec.replace(replay_ring=0), K, B, layer.H, position)
        executed["ring"] = sum(executed.pop(k) for k in ("ring_B", "ring_x", "ring_coef"))
        executed["ring.length"] = executed.pop("ring_length")
        for key, n in executed.items():
            assert n == model[key], f"{name} position {position}: {key} executed {n}, model {model[key]}"
        assert sum(executed.values()) == model["total"], f"{name} position {position}: total"


@pytest.mark.parametrize("from_checkpoint", [False, True], ids=["replayed", "from-checkpoint"])
def test_the_outputs_bits_do_not_depend_on_the_warps(from_checkpoint):
    """docs/contract.md: the warps do not change a row's reduction order. The flagship at K = 4,
    executed at 4 warps (its default) and at 8 (the from-checkpoint form's default until 2026-11-27)
    on the same inputs and ring, at every ring position: the same ``out`` and the same flushed rows,
    bit for bit (and the outputs are not trivial: non-zero, and the flush writes the state)."""
    from mamba3_step.spec import flagship_spec
    from mamba3_step.tools.verify.step import _inputs

    K = 4
    base = flagship_spec(replay_ring=K, replay_from_checkpoint=from_checkpoint)
    tensors, _ = _inputs(base.replace(replay_ring=0, replay_from_checkpoint=False), 2, 2, 3, live_only=True)
    rows, heads, D, N = tensors.state.shape
    results = {}
    for warps in (4, 8):
        spec = base.replace(num_warps=warps)
        ring = new_ring(rows, K, spec.mimo, heads, N, D, kv_dtype=tensors.Bstate.dtype, x_dtype=tensors.Xstate.dtype)
        g = torch.Generator().manual_seed(5)
        ring.B.copy_(torch.randn(ring.B.shape, generator=g).to(ring.B.dtype))
        ring.x.copy_(torch.randn(ring.x.shape, generator=g).to(ring.x.dtype))
        ring.coef.copy_(torch.rand(ring.coef.shape, generator=g) * 0.5)
        for position in range(K):
            ring.length.fill_(position)
            t = tensors._replace(state=tensors.state.clone(), Bstate=tensors.Bstate.clone(),
                                 Xstate=tensors.Xstate.clone(), out=None).with_out()
            run_step_ptx(spec, t, record=False, ring=ring)
            results[warps, position] = (t.out, t.state)
    for position in range(K):
        (out4, state4), (out8, state8) = results[4, position], results[8, position]
        assert bits_equal(out4, out8) and bits_equal(state4, state8), f"position {position}"
        assert out4.abs().max() > 0
        assert (position == K - 1) != bits_equal(state4, tensors.state), f"position {position}: the flush"


def test_the_one_entry_point_packs_the_ring_for_the_kernel():
    """``ptx_step_fn`` (``mamba3_step_fn``'s arguments, the kernel's PTX executed) in the replay mode:
    the ring travels as ``replay_ring``, the call is validated by the one check every device runs and
    the kernel's arguments are packed from the call. Over appends and a flush, each step's ring
    entries and lengths, and the flushed rows, equal ``mamba3_step_fn``'s CPU path bit for bit, and
    every ``out`` agrees with it within bf16 rounding."""
    from mamba3_step import mamba3_step_fn
    from mamba3_step.tools.ptx_tier import ptx_step_fn

    H, D, N, R, K, B = 2, 32, 32, 1, 2, 2
    g = torch.Generator().manual_seed(41)
    rows, w = row_tensors(4, H, D, N, R, generator=g), layer_weights(H, D, R, generator=g)
    pools = {kind: {k: v.clone() for k, v in rows.items()} for kind in ("ptx", "cpu")}
    rings = {kind: new_ring(4, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16) for kind in pools}
    index = torch.tensor([2, 0], dtype=torch.int32)
    for step in range(K + 1):
        lane = lane_inputs(B, H, D, N, R, generator=g)
        outs = {}
        for kind, fn in (("ptx", ptx_step_fn), ("cpu", mamba3_step_fn)):
            outs[kind] = fn(**pools[kind], **lane, **w, state_batch_indices=index, replay_ring=rings[kind],
                            update_kv_state=True, replay_flush_length=K)
        assert torch.allclose(outs["ptx"].float(), outs["cpu"].float(), rtol=2e-2, atol=2e-2), f"step {step}: out"
        for field in ("B", "x", "coef", "length"):
            assert bits_equal(getattr(rings["ptx"], field), getattr(rings["cpu"], field)), f"step {step}: {field}"
        if step == K - 1:  # the flush: Bstate/Xstate are this token's, bit for bit
            for k in ("Bstate", "Xstate"):
                assert bits_equal(pools["ptx"][k], pools["cpu"][k]), f"step {step}: {k}"
    assert int(rings["ptx"].length[2, 0]) == 1  # appended, flushed, appended
