"""The rotary angle through the step's entry points, on the CPU path (docs/contract.md, "Rotary angle").

* named errors for every bad rotary argument, and a refused call changes nothing;
* the fused step equals the unfused pipeline (gather rows, advance the angle, rotate B/C, dense
  step math, scatter) bit for bit, and T tokens equal T one-token steps;
* a stride-0 head axis of ``angle_proj`` and a head axis of 1 of ``B``/``C`` give the bits of
  their materialised forms, without a copy;
* without ``angle_state`` the specialisation and its key are what they were;
* the custom op and a plan run it like ``mamba3_step_fn``.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, S angles.
"""

from __future__ import annotations

import pytest
import torch
from helpers import clone_inputs

from mamba3_step import mamba3_step_fn, mamba3_step_op, plan_step
from mamba3_step.contract import lane_is_live
from mamba3_step.reference import step_math
from mamba3_step.rotary import advance_angle, angle_cos_sin, rotate_pairs
from mamba3_step.spec import StepSpec, flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, make_inputs, with_rotary
from mamba3_step.validation import check_step_inputs

H, D, N, R, S = 3, 32, 64, 2, 16


def _inputs(B=5, P=9, *, seed=0, tokens=None, shared_bc=False, bias=True, kv="bfloat16", state="float32"):
    inputs = make_inputs(B, P, H, D, N, R, dtypes=dict(kv_dtype=kv, x_dtype=kv, state_dtype=state), tokens=tokens,
                         seed=seed)
    return with_rotary(inputs, S, shared_bc=shared_bc, bias=bias, seed=seed + 100)


IDX = torch.tensor([4, -1, 0, 7, 2], dtype=torch.int32)
DST = torch.tensor([5, 3, 1, -1, 6], dtype=torch.int32)


def _bad(**changes):
    def build(inputs):
        return {**inputs, **{k: (v(inputs) if callable(v) else v) for k, v in changes.items()}}
    return build


#: (what, change, options, exception, message start)
BAD = [
    ("angle_state float32", _bad(angle_state=lambda i: i["angle_state"].float()), {}, TypeError,
     "angle_state: expected dtype int64"),
    ("angle_state int32", _bad(angle_state=lambda i: i["angle_state"].int()), {}, TypeError,
     "angle_state: expected dtype int64"),
    ("angle_proj float16", _bad(angle_proj=lambda i: i["angle_proj"].half()), {}, TypeError,
     "angle_proj: expected dtype float32"),
    ("B_bias bfloat16", _bad(B_bias=lambda i: i["B_bias"].bfloat16()), {}, TypeError, "B_bias: expected dtype float32"),
    ("angle rows not the pool's", _bad(angle_state=lambda i: i["angle_state"][:-1]), {}, ValueError,
     "angle_state: expected shape"),
    ("angle heads", _bad(angle_state=lambda i: i["angle_state"][:, :-1]), {}, ValueError,
     "angle_state: expected shape"),
    ("angle_proj S", _bad(angle_proj=lambda i: i["angle_proj"][..., :-1]), {}, ValueError,
     "angle_proj: expected shape"),
    ("S > N/2", _bad(angle_state=lambda i: torch.zeros(i["state"].shape[:2] + (N // 2 + 1,), dtype=torch.int64),
                     angle_proj=lambda i: torch.zeros(i["x"].shape[:-1] + (N // 2 + 1,))), {}, ValueError,
     "angle_state: expected S"),
    ("S = 0", _bad(angle_state=lambda i: torch.zeros(i["state"].shape[:2] + (0,), dtype=torch.int64),
                   angle_proj=lambda i: torch.zeros(i["x"].shape[:-1] + (0,))), {}, ValueError,
     "angle_state: expected S"),
    ("angle_proj without angle_state", _bad(angle_state=None), {}, ValueError, "angle_state: expected a tensor"),
    ("angle_state without angle_proj", _bad(angle_proj=None), {}, ValueError, "angle_proj: expected a tensor"),
    ("B_bias without C_bias", _bad(C_bias=None), {}, ValueError, "C_bias: expected a tensor"),
    ("biases without angle_state", _bad(angle_state=None, angle_proj=None), {}, ValueError,
     "B_bias: expected None without angle_state"),
    ("rotate_pairwise without angle_state", _bad(angle_state=None, angle_proj=None, B_bias=None, C_bias=None),
     {"rotate_pairwise": True}, ValueError, "rotate_pairwise: expected False"),
    ("rotate_pairwise not a bool", _bad(), {"rotate_pairwise": 1}, TypeError, "rotate_pairwise"),
    ("tile_D < D", _bad(), {"tile_D": D // 2}, ValueError, "tile_D: angle_state needs tile_D >= headdim"),
    ("B head axis 2", _bad(B=lambda i: i["B"][:, :, :2].clone()), {}, ValueError, "B: expected shape"),
    ("C shared, B not", _bad(C=lambda i: i["C"][:, :, :1].clone()), {}, ValueError, "C: expected shape"),
    ("angle_state overlaps state", _bad(angle_state=lambda i: i["state"].view(torch.int64)[:, :, 0, :S]),
     {}, ValueError, "angle_state"),
    ("angle_state broadcast", _bad(angle_state=lambda i: i["angle_state"][:1].expand(9, -1, -1)), {}, ValueError,
     "angle_state"),
]


@pytest.mark.parametrize("entry", ["fn", "op"])
@pytest.mark.parametrize("what, change, options, exc, message", BAD, ids=[b[0] for b in BAD])
def test_bad_rotary_arguments_are_refused_by_name_and_change_nothing(what, change, options, exc, message, entry):
    inputs = change(_inputs())
    before = clone_inputs(inputs)
    fn = mamba3_step_fn if entry == "fn" else mamba3_step_op
    with pytest.raises(exc, match=message.replace("(", r"\(")):
        fn(**inputs, state_batch_indices=IDX, **options)
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            assert bits_equal(value, before[key]), f"{what}: {key} changed"


def _unfused(inputs: dict, src, dst, pairwise: bool, kv_dtype) -> tuple:
    """Gather the live lanes' rows, advance their angles, rotate B/C, run the dense step math,
    scatter: built from the pieces, not from mamba3_step_reference."""
    P = inputs["state"].shape[0]
    live = lane_is_live(src, P, None).nonzero().squeeze(1)
    rows = src[live].long()
    angle = advance_angle(inputs["angle_state"][rows], inputs["angle_proj"][live], inputs["dt"][live])
    cos, sin = angle_cos_sin(angle)
    rot = {}
    for name, bias in (("B", "B_bias"), ("C", "C_bias")):
        v = inputs[name][live].float().expand(-1, -1, H, -1) + inputs[bias]
        rot[name] = rotate_pairs(v, cos[:, None], sin[:, None], pairwise)
    dense = StepTensors(state=inputs["state"][rows], Bstate=inputs["Bstate"][rows], Xstate=inputs["Xstate"][rows],
                        A=inputs["A"][live], B=rot["B"], C=rot["C"], D=inputs["D"], x=inputs["x"][live],
                        dt=inputs["dt"][live], trap=inputs["trap"][live], xproj=inputs["xproj"],
                        outproj=inputs["outproj"], z=inputs["z"][live], zproj=inputs["zproj"])
    new_state, y = step_math(dense)
    out = torch.zeros((src.shape[0], H, D), dtype=inputs["x"].dtype)
    out[live] = y.to(out.dtype)
    pools = {k: inputs[k].clone() for k in ("state", "Bstate", "Xstate", "angle_state")}
    targets = dst[live].long()
    keep = lane_is_live(targets, P, None)
    t = targets[keep]
    pools["state"][t] = new_state[keep].to(pools["state"].dtype)
    pools["Bstate"][t] = rot["B"][keep].to(kv_dtype)
    pools["Xstate"][t] = inputs["x"][live][keep]
    pools["angle_state"][t] = angle[keep]
    return out, pools


@pytest.mark.parametrize("pairwise", [False, True])
@pytest.mark.parametrize("shared_bc", [False, True])
def test_fused_step_equals_gather_rotate_dense_scatter_bit_for_bit(pairwise, shared_bc):
    inputs = _inputs(seed=3, shared_bc=shared_bc)
    want_out, want = _unfused(inputs, IDX, DST, pairwise, torch.bfloat16)
    got = clone_inputs(inputs)
    out = mamba3_step_fn(**got, state_batch_indices=IDX, dst_state_batch_indices=DST, update_kv_state=True,
                         rotate_pairwise=pairwise)
    assert bits_equal(out, want_out)
    for key, value in want.items():
        assert bits_equal(got[key], value), key
    assert not bits_equal(got["angle_state"], inputs["angle_state"])


@pytest.mark.parametrize("kv, state", [("bfloat16", "float32"), ("float16", "bfloat16"), ("float32", "float32")])
def test_t_tokens_equal_t_one_token_steps_with_rotary(kv, state):
    T, B = 3, 4
    inputs = _inputs(B, P=B * T, seed=5, tokens=T, kv=kv, state=state, shared_bc=True)
    src = torch.arange(0, B * T, T, dtype=torch.int32)
    dst = (src[:, None] + torch.arange(T, dtype=torch.int32)).contiguous()
    together = clone_inputs(inputs)
    out_t = mamba3_step_fn(**together, state_batch_indices=src, dst_state_batch_indices=dst, update_kv_state=True)
    one = clone_inputs(inputs)
    rows = src
    for t in range(T):
        per_token = {k: (v[:, t] if k in ("A", "B", "C", "x", "dt", "trap", "z", "angle_proj") else v)
                     for k, v in one.items()}
        out_1 = mamba3_step_fn(**per_token, state_batch_indices=rows, dst_state_batch_indices=dst[:, t].contiguous(),
                               update_kv_state=True)
        assert bits_equal(out_1, out_t[:, t]), t
        rows = dst[:, t].contiguous()
    for key in ("state", "Bstate", "Xstate", "angle_state"):
        assert bits_equal(together[key], one[key]), key


def test_broadcast_forms_give_the_bits_of_their_materialised_forms():
    """``angle_proj`` with a stride-0 head axis (one (S,) vector per lane, as the layer makes it)
    and ``B``/``C`` with a head axis of 1, against their contiguous (B, H, S) / (B, R, H, N) forms."""
    inputs = _inputs(seed=9, shared_bc=True)
    per_lane = inputs["angle_proj"][:, 0]
    broadcast = dict(inputs, angle_proj=per_lane[:, None, :].expand(-1, H, -1))
    assert broadcast["angle_proj"].stride(1) == 0
    materialised = dict(inputs, angle_proj=broadcast["angle_proj"].contiguous(),
                        B=inputs["B"].expand(-1, -1, H, -1).contiguous(), C=inputs["C"].expand(-1, -1, H, -1).contiguous())
    a, b = clone_inputs(broadcast), clone_inputs(materialised)
    out_a = mamba3_step_fn(**a, state_batch_indices=IDX, update_kv_state=True)
    out_b = mamba3_step_fn(**b, state_batch_indices=IDX, update_kv_state=True)
    assert bits_equal(out_a, out_b)
    for key in ("state", "Bstate", "Xstate", "angle_state"):
        assert bits_equal(a[key], b[key]), key


def test_shared_bc_without_rotary_equals_expanded_bc():
    inputs = make_inputs(5, 9, H, D, N, R, seed=13)
    shared = dict(inputs, B=inputs["B"][:, :, :1].clone(), C=inputs["C"][:, :, :1].clone())
    expanded = dict(shared, B=shared["B"].expand(-1, -1, H, -1).contiguous(),
                    C=shared["C"].expand(-1, -1, H, -1).contiguous())
    a, b = clone_inputs(shared), clone_inputs(expanded)
    assert bits_equal(mamba3_step_fn(**a, state_batch_indices=IDX, update_kv_state=True),
                      mamba3_step_fn(**b, state_batch_indices=IDX, update_kv_state=True))
    for key in ("state", "Bstate", "Xstate"):
        assert bits_equal(a[key], b[key]), key


def test_without_angle_state_the_spec_and_its_key_are_unchanged():
    inputs = make_inputs(5, 9, H, D, N, R, seed=1)
    spec = check_step_inputs(StepTensors(**inputs, state_batch_indices=IDX), update_kv_state=True)
    assert spec == StepSpec(N, D, R, pool=True, update_kv_state=True).with_default_tiling()
    assert "rope" not in spec.key() and "shared_bc" not in spec.key() and "bias" not in spec.key()
    assert flagship_spec().key().endswith("num_accepted=0")
    rotary = check_step_inputs(StepTensors(**_inputs(), state_batch_indices=IDX), rotate_pairwise=True)
    assert (rotary.rope_angles, rotary.rotate_pairwise, rotary.has_bc_bias, rotary.shared_bc) == (S, True, True, False)
    assert rotary.key().endswith("rope_angles=16-rotate_pairwise=1-has_bc_bias=1")


def test_padding_lanes_leave_angle_rows_and_dense_mode_updates_in_place():
    inputs = _inputs(seed=17)
    got = clone_inputs(inputs)
    mamba3_step_fn(**got, state_batch_indices=IDX)
    read = {int(i) for i in IDX if i >= 0}
    for row in range(9):
        same = bits_equal(got["angle_state"][row], inputs["angle_state"][row])
        assert same == (row not in read), row
    dense = _inputs(B=3, P=None, seed=19)
    d = clone_inputs(dense)
    mamba3_step_fn(**d)
    want = advance_angle(dense["angle_state"], dense["angle_proj"], dense["dt"])
    assert torch.equal(d["angle_state"], want)


def test_op_and_plan_run_the_rotary_step_like_the_function():
    inputs = _inputs(seed=23, shared_bc=True)
    results = []
    for run in ("fn", "op", "plan"):
        t = clone_inputs(inputs)
        kw = dict(state_batch_indices=IDX, dst_state_batch_indices=DST, update_kv_state=True, rotate_pairwise=True)
        if run == "fn":
            out = mamba3_step_fn(**t, **kw)
        elif run == "op":
            out = mamba3_step_op(**t, **kw)
        else:
            plan = plan_step(**t, **kw)
            assert plan.spec.rope_angles == S and plan.spec.rotate_pairwise
            out = plan.run(**t, state_batch_indices=IDX, dst_state_batch_indices=DST)
        results.append((out, t))
    for out, t in results[1:]:
        assert bits_equal(out, results[0][0])
        for key in ("state", "Bstate", "Xstate", "angle_state"):
            assert bits_equal(t[key], results[0][1][key]), key


def test_meta_tensors_are_validated_and_compute_nothing():
    inputs = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in _inputs().items()}
    out = mamba3_step_fn(**inputs, state_batch_indices=IDX.to("meta"))
    assert out.is_meta and out.shape == (5, H, D)
    bad = dict(inputs, angle_state=inputs["angle_state"].float())
    with pytest.raises(TypeError, match="angle_state: expected dtype int64"):
        mamba3_step_fn(**bad, state_batch_indices=IDX.to("meta"))
