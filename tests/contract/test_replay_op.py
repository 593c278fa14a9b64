"""The replay mode through the one custom op, torch.ops.mamba3_step.step: its schema (the mutated
tensors, the ring's included), its fake implementation on a replay call (opcheck), eager parity with
mamba3_step_fn's replay mode, and the replay mode under torch.compile(fullgraph=True) on CPU: one op
call per step, the same bytes as eager, ring included, over steps that append, flush and verify drafts.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, K the flush length
(``replay_flush_length``), T drafts.
"""

from __future__ import annotations

import pytest
import torch

from helpers import replay_call, replay_fn

from mamba3_step import mamba3_step_fn, new_ring
from mamba3_step.api import step_through_op
from mamba3_step.replay import Ring
from mamba3_step.signature import OP_ORDER, OP_RING_ARGS, op_values
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

H, D, N, R, P, K, T = 2, 32, 32, 2, 6, 2, 2


def _layer(seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = row_tensors(P, H, D, N, R, generator=g)
    w = layer_weights(H, D, R, generator=g)
    ring = new_ring(P, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, draft=T)
    return g, rows, w, ring


def _call(rows: dict, lane: dict, w: dict, slots: torch.Tensor) -> StepTensors:
    return StepTensors(rows["state"], rows["Bstate"], rows["Xstate"], lane["A"], lane["B"], lane["C"], w["D"],
                       lane["x"], lane["dt"], lane["trap"], w["xproj"], outproj=w["outproj"], z=lane["z"],
                       zproj=w["zproj"], state_batch_indices=slots)


def _twin(rows: dict, ring: Ring):
    return {k: v.clone() for k, v in rows.items()}, Ring(*(None if t is None else t.clone() for t in ring))


def test_schema_declares_the_ring_and_the_rows_mutated_and_returns_nothing():
    schema = torch.ops.mamba3_step.step.default._schema
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == {"state", "Bstate", "Xstate", "state_out", "out", "angle_state", "state_scale", "replay_ring_B",
                       "replay_ring_x", "replay_ring_coef", "replay_ring_length", "replay_ring_offset",
                       "replay_ring_drawn_for", "replay_ring_angle"}
    assert len(schema.returns) == 0
    assert tuple(a.name for a in schema.arguments) == OP_ORDER
    arguments = {a.name: a for a in schema.arguments}
    assert str(arguments["replay_flush_length"].type) == "Optional[number]"  # Scalar: validation sees a bool
    assert str(arguments["replay_from_checkpoint"].type) == "number"


def test_op_matches_the_replay_mode_bytes():
    """Plain steps (append, then a flush), then verify steps committing drafts: op and function agree."""
    g, rows, w, ring = _layer(1)
    mine, their_ring = _twin(rows, ring)
    slots = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    accepted = None
    for step in range(5):
        tokens = None if step < 2 else T
        lane = lane_inputs(4, H, D, N, R, tokens=tokens, generator=g)
        want = replay_fn(_call(rows, lane, w, slots), ring, K, num_accepted_tokens=accepted)
        got = step_through_op(*replay_call(_call(mine, lane, w, slots), their_ring, K, num_accepted_tokens=accepted))
        assert bits_equal(got, want), step
        accepted = torch.tensor([2, 0, 1, 2], dtype=torch.int32) if step >= 2 else None
    assert all(bits_equal(rows[k], mine[k]) for k in rows)
    assert all(bits_equal(a, b) for a, b in zip(ring, their_ring) if a is not None)


def test_opcheck_schema_and_fake():
    g, rows, w, ring = _layer(2)
    slots = torch.tensor([3, 0, -1], dtype=torch.int32)
    lane = lane_inputs(3, H, D, N, R, tokens=T, generator=g)
    tensors, options = replay_call(_call(rows, lane, w, slots).with_out(), ring, K,
                                   num_accepted_tokens=torch.tensor([0, 0, 0], dtype=torch.int32))
    call = op_values(tensors, options)
    assert [call[name] for name in OP_RING_ARGS] == list(ring)
    args = tuple(call[name] for name in OP_ORDER)
    torch.library.opcheck(torch.ops.mamba3_step.step.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("bad, message", [(dict(replay_flush_length=True), "^replay_flush_length: expected an int or None, got bool"),
                                          (dict(num_accepted_tokens=torch.zeros(3)),
                                           "num_accepted_tokens: expected dtype int32")])
def test_the_op_refuses_what_the_replay_mode_refuses_and_writes_nothing(bad, message):
    g, rows, w, ring = _layer(3)
    lane = lane_inputs(3, H, D, N, R, tokens=T, generator=g)
    t = _call(rows, lane, w, torch.tensor([3, 0, 1], dtype=torch.int32))
    before = [v.clone() for v in (*rows.values(), *(r for r in ring if r is not None))]
    with pytest.raises((ValueError, TypeError), match=message):
        step_through_op(*replay_call(t, ring, K, **bad))
    after = [*rows.values(), *(r for r in ring if r is not None)]
    assert all(bits_equal(a, b) for a, b in zip(after, before))


def _decode(rows, ring, w, slots, lanes, accepted):
    """Three replay steps (two plain, one verify committing nothing yet, one verify committing)."""
    outs = []
    for i, lane in enumerate(lanes):
        outs.append(mamba3_step_fn(rows["state"], rows["Bstate"], rows["Xstate"], lane["A"], lane["B"], lane["C"],
                                   w["D"], lane["x"], lane["dt"], lane["trap"], w["xproj"], w["outproj"], z=lane["z"],
                                   zproj=w["zproj"], state_batch_indices=slots, replay_ring=ring,
                                   num_accepted_tokens=accepted if i == len(lanes) - 1 else None,
                                   update_kv_state=True, replay_flush_length=K))
    return outs


def test_the_replay_mode_compiles_fullgraph_to_one_op_call_a_step_with_the_same_bytes_as_eager():
    torch._dynamo.reset()
    g, rows, w, ring = _layer(4)
    mine, their_ring = _twin(rows, ring)
    slots = torch.tensor([5, 1, -1, 3], dtype=torch.int32)
    lanes = [lane_inputs(4, H, D, N, R, generator=g), lane_inputs(4, H, D, N, R, generator=g),
             lane_inputs(4, H, D, N, R, tokens=T, generator=g), lane_inputs(4, H, D, N, R, tokens=T, generator=g)]
    accepted = torch.tensor([1, 2, 0, 2], dtype=torch.int32)
    want = _decode(rows, ring, w, slots, lanes, accepted)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    compiled = torch.compile(_decode, fullgraph=True, backend=backend)
    got = compiled(mine, their_ring, w, slots, lanes, accepted)
    ops = [node for gm in graphs for node in gm.graph.nodes if node.op == "call_function"
           and "mamba3_step" in str(node.target)]
    assert len(graphs) == 1 and len(ops) == len(lanes), [str(n.target) for n in ops]
    assert all("mamba3_step.step" in str(node.target) for node in ops)
    assert all(bits_equal(a, b) for a, b in zip(got, want))
    assert all(bits_equal(rows[k], mine[k]) for k in rows)
    assert all(bits_equal(a, b) for a, b in zip(ring, their_ring) if a is not None)
    assert int(ring.length[5, 0]) != 0 or bool(ring.length.any())  # the rings moved
