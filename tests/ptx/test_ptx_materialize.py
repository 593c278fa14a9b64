"""``materialize_fn``'s flush form, executed: the replay kernel's verify step with ``K = 1`` run from
its PTX on the CPU (``mamba3_step.materialize``; docs/contract.md, "Replay").

1. Over a decode of the replay kernel (rows joining at different steps, so their rings hold every
   length from 0 to K - 1), each step's current state of every live row and of an idle one, by the
   flush form, equals the executed stepwise kernel's rows bit for bit (state, Bstate, Xstate, and
   ``angle_state``/``state_scale`` where the pool has them); the pools and rings are not written;
   the launches are those ``flush_specs`` names and hold exactly the rows with committed entries.
2. A ring of 31 entries (K = 16, T = 16), rows holding 0, 1, 9, 16, 17 and 31 committed entries and
   poison after them: two launches (up to 16 entries at K = 1, more at K = 16), the state equal to
   the executed stepwise kernel stepping each row's entries one by one.
3. Refusals by name, on either route, before anything is read or written.

Letters: P pool rows, H heads, D head dim, N state size, R MIMO rank, K flush length, L ring entries.
"""

from __future__ import annotations

import pytest
import torch
from test_kernel_compile import REPLAY, REPLAY_DST
from test_ptx_replay import Layer

from mamba3_step import mamba3_step_fn, materialize_fn
from mamba3_step.materialize import flush_form
from mamba3_step.tools.ptx_tier import run_step_ptx
from mamba3_step.replay import materialize, new_ring
from mamba3_step.spec import StepSpec, flush_specs, replay_problem
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, poison_, row_tensors

#: the replay pools whose flush form runs: the flagship (fp32, what a pool gets by default), a
#: stochastically rounded bf16 state and a pairwise rotary one (their destinations left out); the
#: rotary and int8 flagships with --full-matrix
DECODES = {"flagship-replay-K4": False, "N32-D64-R2-bf16state-sr-replay-K3-dst-noz": False,
           "N64-D32-R1-siso-pairwise-rope1-replay-K3-dst": False, "flagship-rotary-replay-K4": True,
           "flagship-int8state-replay-K2": True}
#: the rows a decode materializes: three live ones and row 7, which no lane reads (its ring empty)
IDLE = 7
SEED = 0x5EED_0F_5EED


def _pool_tensors(layer: Layer) -> StepTensors:
    """The replay pools and the layer's weights, as ``materialize_fn`` reads them (no lane inputs)."""
    p, w, s = layer.pools["replay"], layer.weights, layer.spec
    return StepTensors(p["state"], p["Bstate"], p["Xstate"], None, None, None, w["D"], None, None, None, w["xproj"],
                       angle_state=p.get("angle_state"), B_bias=w.get("B_bias"), C_bias=w.get("C_bias"),
                       rand_seed=torch.tensor([SEED, 0]) if s.stochastic_rounding else None,
                       state_scale=p.get("state_scale"))


def _run(launches: list) -> None:
    for launch in launches:
        run_step_ptx(launch.spec, launch.tensors, ring=launch.ring)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.full_matrix] if full else [])
                                  for n, full in DECODES.items()])
def test_the_flush_form_is_the_executed_stepwise_kernels_state(name):
    spec = {**REPLAY, **REPLAY_DST}[name].replace(has_dst=False).with_default_tiling()
    K = spec.replay_ring
    layer = Layer(spec, seed=13)
    seen = set()
    for s in range(K + 1):
        lanes = [0, 1, 2][: 1 + s] + [-1]  # row r joins at step r: staggered ring positions
        layer.step(layer.lane(len(lanes)), torch.tensor(lanes, dtype=torch.int32))
        rows = [0, 1, 2, IDLE]
        length = layer.rings["replay"].length[rows, 0].tolist()
        seen.update(length)
        before = layer.snapshot()
        current, launches = flush_form(_pool_tensors(layer), layer.rings["replay"], rows,
                                       rotate_pairwise=spec.rotate_pairwise)
        assert [launch.spec for launch in launches] == flush_specs(spec, K - 1)[:len(launches)]
        held = sorted(int(i) for launch in launches for i in launch.tensors.state_batch_indices)
        assert held == [i for i, m in enumerate(length) if m > 0], f"{name} step {s}: launch rows {held}"
        _run(launches)
        for i, row in enumerate(rows):
            for k, v in current._asdict().items():
                if v is not None:
                    assert bits_equal(v[i], layer.pools["stepwise"][k][row]), \
                        f"{name} step {s}: row {row} (ring length {length[i]}) {k}"
        after = layer.snapshot()
        assert all(bits_equal(after[k], v) for k, v in before.items()), f"{name} step {s}: the pools were written"
    assert seen == set(range(K)), f"{name}: ring lengths seen {seen}"


def test_a_ring_longer_than_16_entries_flushes_in_two_launches():
    H, D, N, R, L = 1, 32, 32, 2, 31
    stepwise = StepSpec(N, D, R, "float32", pool=True, update_kv_state=True, has_z=False,
                        has_outproj=False).with_default_tiling()
    g = torch.Generator().manual_seed(41)
    counts = [0, 1, 9, 16, 17, 31]
    P = len(counts)
    rows = row_tensors(P, H, D, N, R, generator=g)
    w = layer_weights(H, D, R, has_z=False, has_outproj=False, generator=g)
    ring = new_ring(P, 16, R, H, N, D, kv_dtype=rows["Bstate"].dtype, x_dtype=rows["Xstate"].dtype, draft=16)
    for t in (ring.B, ring.x, ring.coef):
        poison_(t, seed=5)  # the entries after a row's count are never read
    tokens = lane_inputs(P, H, D, N, R, has_z=False, tokens=L, generator=g)
    for p, m in enumerate(counts):
        ring.B[p, :m], ring.x[p, :m] = tokens["B"][p, :m], tokens["x"][p, :m]
        ring.coef[p, :m] = torch.stack([tokens[f][p, :m] for f in ("A", "dt", "trap")], -1)
        ring.length[p] = m
    want = {k: v.clone() for k, v in rows.items()}
    for j in range(L):  # the stepwise kernel steps each row's entries in order
        index = torch.tensor([p if m > j else -1 for p, m in enumerate(counts)], dtype=torch.int32)
        step = {k: v[:, j].contiguous() for k, v in tokens.items() if v is not None}
        run_step_ptx(stepwise, StepTensors(want["state"], want["Bstate"], want["Xstate"], step["A"], step["B"],
                                           step["C"], w["D"], step["x"], step["dt"], step["trap"], w["xproj"],
                                           state_batch_indices=index).with_out())
    t = StepTensors(rows["state"], rows["Bstate"], rows["Xstate"], None, None, None, w["D"], None, None, None,
                    w["xproj"])
    current, launches = flush_form(t, ring, list(range(P)))
    assert [(launch.spec.replay_ring, launch.tensors.state_batch_indices.tolist()) for launch in launches] == \
        [(1, [1, 2, 3]), (16, [4, 5])]
    assert [launch.spec for launch in launches] == flush_specs(stepwise, L)
    _run(launches)
    for k in ("state", "Bstate", "Xstate"):
        for p, m in enumerate(counts):
            assert bits_equal(getattr(current, k)[p], want[k][p]), f"row {p} ({m} entries): {k}"


def _small_pool(stochastic: bool = False):
    H, D, N, R = 2, 32, 32, 2
    g = torch.Generator().manual_seed(3)
    rows = row_tensors(5, H, D, N, R, generator=g)
    w = layer_weights(H, D, R, has_z=False, has_outproj=False, generator=g)
    ring = new_ring(5, 3, R, H, N, D, kv_dtype=rows["Bstate"].dtype, x_dtype=rows["Xstate"].dtype,
                    stochastic=stochastic)
    t = StepTensors(rows["state"], rows["Bstate"], rows["Xstate"], None, None, None, w["D"], None, None, None,
                    w["xproj"])
    return t, ring


def _bad_ring_length(t, ring):
    ring.length[1, 0] = 1
    return t, ring, [0, 1]


REFUSALS = {
    "rows out of range": (lambda t, ring: (t, ring, [0, 5]), ValueError, "rows must be in [0, 5)"),
    "a row's heads disagree": (_bad_ring_length, ValueError, "ring.length must hold one value per row"),
    "a ring of another N": (lambda t, ring: (t, ring._replace(B=torch.zeros(5, 2, 2, 2, 16, dtype=ring.B.dtype)),
                                             [0]), ValueError, "ring.B must be"),
    "xproj of another head count": (lambda t, ring: (t._replace(xproj=t.xproj[:, :1]), ring, [0]), ValueError,
                                    "xproj"),
    "no state tensor": (lambda t, ring: (t._replace(state=[1.0]), ring, [0]), TypeError, "state"),
    "no Ring": (lambda t, ring: (t, tuple(ring), [0]), TypeError, "ring must be a mamba3_step.Ring"),
    "rows of floats": (lambda t, ring: (t, ring, torch.tensor([0.0, 1.0])), TypeError, "rows: expected an integer"),
    "rows of another kind": (lambda t, ring: (t, ring, "0, 1"), TypeError, "rows: expected an int"),
    "an angle_state of no angle axis": (lambda t, ring: (t._replace(angle_state=torch.zeros(5, 2, dtype=torch.int64)),
                                                         ring, [0]), ValueError, "angle_state"),
    "a quantized Xstate": (lambda t, ring: (t._replace(Xstate=torch.quantize_per_tensor(t.Xstate.float(), 0.1, 0,
                                                                                        torch.qint8)), ring, [0]),
                           TypeError, "Xstate"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
@pytest.mark.parametrize("entry", ["materialize_fn", "flush_form"])
def test_refusals_are_named_and_change_nothing(case, entry):
    make, error, words = REFUSALS[case]
    t, ring = _small_pool()
    t, ring, rows = make(t, ring)
    held = [v.clone() for v in (*t[:3], *ring) if isinstance(v, torch.Tensor)]
    fn = materialize_fn if entry == "materialize_fn" else flush_form
    with pytest.raises(error) as caught:
        fn(t, ring, rows)
    assert words in str(caught.value), str(caught.value)
    now = [v for v in (*t[:3], *ring) if isinstance(v, torch.Tensor)]
    assert len(now) == len(held) and all(bits_equal(a, b) for a, b in zip(held, now))


def test_a_ring_with_offsets_needs_rand_seed():
    t, ring = _small_pool(stochastic=True)
    with pytest.raises(ValueError, match="rand_seed"):
        materialize_fn(t, ring, [0])


def test_on_cpu_tensors_it_is_the_cpu_path():
    t, ring = _small_pool()
    g = torch.Generator().manual_seed(9)
    tokens = lane_inputs(5, 2, 32, 32, 2, has_z=False, tokens=2, generator=g)
    ring.B[:, :2], ring.x[:, :2] = tokens["B"], tokens["x"]
    ring.coef[:, :2] = torch.stack([tokens[f] for f in ("A", "dt", "trap")], -1)
    ring.length[:] = torch.tensor([0, 1, 2, 2, 1], dtype=torch.int32)[:, None]
    got, want = materialize_fn(t, ring, [4, 0, 2]), materialize(t, ring, [4, 0, 2])
    assert all(bits_equal(a, b) for a, b in zip(got, want) if a is not None)
    assert not bits_equal(got.state[0], t.state[4])  # a row with entries moved from its checkpoint


def test_k1_is_a_verify_steps_flush_form_only():
    flagship = StepSpec(128, 64, 4, pool=True, update_kv_state=True)
    assert replay_problem(flagship.replace(replay_ring=1, tokens=2)) is None
    assert "1 with a verify step" in replay_problem(flagship.replace(replay_ring=1))
    t, ring = _small_pool()
    with pytest.raises(ValueError, match=r"replay_flush_length must be an int in \[2, 16\]"):
        mamba3_step_fn(**t._replace(replay_ring=ring)._asdict(), update_kv_state=True, replay_flush_length=1)
