"""The rotary specialisations, executed: their PTX run on the CPU (docs/ptx-tier.md).

For each of :data:`test_kernel_compile.ROTARY` (the flagship with upstream's layer rotary: MIMO
pairs, rope fraction 0.5, biases, B/C shared by the heads, pool, update_kv_state; SISO R=1 with
pairwise pairs and rope fraction 1.0; a 16-bit state in dense mode; a T=4 speculative step with
per-token destinations; fp16 state with separate destinations):

1. ``out``, the new state, the angle and B~ against the float64 reference (the error at most
   twice PyTorch float32's, plus 1e-6 of the scale) and against the CPU path;
2. pool mode bit-identical to gather -> executed dense kernel -> scatter (angle rows included),
   with every padding kind, destinations, the null slot;
3. padding lanes read and write no byte of any angle row; live lanes read exactly the angle row
   of their source and write exactly that of their destination;
4. a T-token step equals T one-token steps bit for bit, each at its own default tiling.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, S angles.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import PAD_KINDS, assert_accurate, check_pool_parity, clone_inputs
from test_kernel_compile import ROTARY

from mamba3_step import mamba3_step_fn
from mamba3_step.api import prepare_step
from ptx_executor import analysis
from mamba3_step.tools.ptx_tier import ptx_step_fn, run_step_ptx
from mamba3_step.reference import mamba3_step_reference
from mamba3_step.rotary import ANGLE_UNIT_RADIANS
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import inputs_for, padded_indices, poison_, speculative_indices, step_indices

NULL = 2


def rotary_inputs(spec: StepSpec, B: int, P: int | None, seed: int) -> dict:
    """Fresh inputs for ``spec`` (H=2) with its rotary tensors (and its token axis)."""
    return inputs_for(spec, B, P, seed=seed)


def _f64(inputs: dict) -> dict:
    """Copies of ``inputs``, floating-point tensors in float64."""
    return {k: (v.double() if v.is_floating_point() else v.clone()) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}


def _angle_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference of two fixed-point angle tensors, in radians (modulo a turn)."""
    return float((got - want).abs().max()) * ANGLE_UNIT_RADIANS  # int64 wrap: the short way round


def _indices(spec: StepSpec, B: int, P: int, seed: int) -> dict:
    """The spec's index arguments with every padding kind (testing.step_indices), none in dense mode."""
    return step_indices(spec, B, P, null_slot_id=NULL, seed=seed)[0] if spec.pool else {}


@pytest.mark.parametrize("name", list(ROTARY))
def test_executed_rotary_kernel_matches_float64_and_the_cpu_path(name):
    spec = ROTARY[name].with_default_tiling()
    B = 6
    P = 4 * B * spec.tokens if spec.pool else None
    inputs = rotary_inputs(spec, B, P, seed=11)
    kw = dict(_indices(spec, B, P, seed=3), update_kv_state=spec.update_kv_state,
              rotate_pairwise=spec.rotate_pairwise)
    ref = _f64(inputs)
    out64 = mamba3_step_reference(StepTensors(**ref, **{k: v for k, v in kw.items() if k in StepTensors._fields}),
                                  update_kv_state=spec.update_kv_state, rotate_pairwise=spec.rotate_pairwise,
                                  compute_dtype=torch.float64)
    cpu, run = clone_inputs(inputs), clone_inputs(inputs)
    out32 = mamba3_step_fn(**cpu, **kw)
    out = ptx_step_fn(**run, **kw)

    scale = max(out64.abs().max().item(), 1.0)
    assert_accurate(f"{name}: out", out, out64, out32, scale, near_cpu=True)
    assert_accurate(f"{name}: state", run["state"], ref["state"], cpu["state"], scale, near_cpu=True)
    assert _angle_error(run["angle_state"], ref["angle_state"]) < 1e-6, name
    assert _angle_error(run["angle_state"], cpu["angle_state"]) < 1e-6, name
    assert not torch.equal(run["angle_state"], inputs["angle_state"]), f"{name}: no angle was written"
    if spec.update_kv_state:
        # B~ rounded to Bstate's dtype: at most one unit of it away from the CPU path's
        ulp = torch.finfo(run["Bstate"].dtype).eps * 4
        assert (run["Bstate"].double() - cpu["Bstate"].double()).abs().max() <= ulp * ref["Bstate"].abs().max()
        assert torch.equal(run["Xstate"], cpu["Xstate"])


@pytest.mark.parametrize("name", [n for n, s in ROTARY.items() if s.pool and not s.num_accepted])
def test_rotary_pool_mode_is_gather_executed_dense_scatter(name):
    spec = ROTARY[name].with_default_tiling()
    B, P = 8, 12
    inputs = rotary_inputs(spec, B, P, seed=21)
    src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, with_dst=spec.has_dst, layout="interleaved", seed=7)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=spec.update_kv_state,
                      step_fn=ptx_step_fn, rotate_pairwise=spec.rotate_pairwise)


def test_rotary_speculative_step_is_gather_executed_dense_scatter():
    spec = ROTARY["flagship-rotary-T4-spec"].with_default_tiling()
    B, T = 6, spec.tokens
    P = B * T + 4
    inputs = rotary_inputs(spec, B, P, seed=23)
    src, nat, dst, kinds = speculative_indices(B, P, T, null_slot_id=NULL, seed=5)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True, step_fn=ptx_step_fn,
                      num_accepted_tokens=nat)


def _lane_bytes(res, pool: torch.Tensor, lanes: int) -> dict:
    """Per lane: the bytes of ``pool`` its CTAs read and wrote, from the recorded accesses."""
    log = res.log.arrays()
    lane = analysis.cta_of(res, log["thread"]) % res.grid[0]
    start, end = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
    out = {}
    for b in range(lanes):
        for write in (False, True):
            sel = (lane == b) & (log["write"] == write)
            every = {a + k for a, w in zip(log["addr"][sel].astype(np.int64).tolist(), log["width"][sel].tolist())
                     for k in range(w)}
            out[b, write] = {a for a in every if start <= a < end}
    return out


def _row_bytes(t: torch.Tensor, row: int) -> set:
    base = t[row].data_ptr()
    return set(range(base, base + t[row].numel() * t.element_size()))


@pytest.mark.parametrize("name", [n for n, s in ROTARY.items() if s.pool and not s.num_accepted])
def test_padding_lanes_touch_no_angle_byte(name):
    spec = ROTARY[name].with_default_tiling()
    B, P = 8, 12
    inputs = rotary_inputs(spec, B, P, seed=31)
    src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, with_dst=spec.has_dst, layout="interleaved", seed=9)
    x = inputs["x"]
    out = poison_(torch.empty((B, x.shape[1], x.shape[2]), dtype=x.dtype))
    s, tensors, _ = prepare_step(StepTensors(**inputs, out=out, state_batch_indices=src, dst_state_batch_indices=dst,
                                             null_slot_id=NULL),
                                 update_kv_state=spec.update_kv_state, rotate_pairwise=spec.rotate_pairwise)
    assert s == spec
    before = inputs["angle_state"].clone()
    res = run_step_ptx(spec, tensors)
    touched = _lane_bytes(res, tensors.angle_state, B)
    for b, kind in enumerate(kinds):
        if kind in PAD_KINDS:
            assert not touched[b, False] and not touched[b, True], f"{name}: padding lane {b} ({kind}) touched angles"
            continue
        assert touched[b, False] == _row_bytes(tensors.angle_state, int(src[b])), f"{name}: lane {b} angle reads"
        d = int(src[b] if dst is None else dst[b])
        want = _row_bytes(tensors.angle_state, d) if kind == "live" else set()
        assert touched[b, True] == want, f"{name}: lane {b} angle writes"
    written = {int(src[b] if dst is None else dst[b]) for b, k in enumerate(kinds) if k == "live"}
    for row in set(range(P)) - written:
        assert torch.equal(tensors.angle_state[row], before[row]), f"{name}: angle row {row} changed"


def test_rotary_t_tokens_equal_t_one_token_steps_bit_for_bit():
    """The T=4 speculative rotary step against four executed one-token steps, each at its
    default tiling (T > 1 and one token compile with different warp counts)."""
    spec = ROTARY["flagship-rotary-T4-spec"].with_default_tiling()
    B, T = 3, spec.tokens
    P = B * T
    inputs = rotary_inputs(spec, B, P, seed=41)
    src = torch.arange(0, P, T, dtype=torch.int32)
    dst = (src[:, None] + torch.arange(T, dtype=torch.int32)[None]).contiguous()
    together = clone_inputs(inputs)
    out_t = ptx_step_fn(**together, state_batch_indices=src, dst_state_batch_indices=dst, update_kv_state=True)
    one = clone_inputs(inputs)
    rows = src.clone()
    for t in range(T):
        per_token = {k: (v[:, t] if k in ("A", "B", "C", "x", "dt", "trap", "z", "angle_proj") else v)
                     for k, v in one.items()}
        out_1 = ptx_step_fn(**per_token, state_batch_indices=rows, dst_state_batch_indices=dst[:, t].contiguous(),
                            update_kv_state=True)
        assert torch.equal(out_1.view(torch.int16), out_t[:, t].view(torch.int16)), f"out of token {t}"
        rows = dst[:, t].contiguous()
    for key in ("state", "Bstate", "Xstate", "angle_state"):
        assert torch.equal(together[key], one[key]), key


def test_rotary_with_a_smaller_tile_is_refused():
    """tile_D < D with angle_state is refused (one CTA owns a (lane, head) angle row)."""
    spec = ROTARY["flagship-rotary"]
    inputs = rotary_inputs(spec, 2, 4, seed=3)
    step = functools.partial(ptx_step_fn, tile_D=32, update_kv_state=False)
    with pytest.raises(ValueError, match="tile_D: angle_state needs tile_D >= headdim"):
        step(**inputs, state_batch_indices=torch.tensor([0, 1], dtype=torch.int32))


EDGE_ANGLES = [-(2**63), 2**63 - 1, 2**62, -(2**62), 2**61, -(2**61), 2**61 - 1, -(2**61) - 1, 2**61 + 1,
               3 * 2**61, -3 * 2**61, 0, 1, -1, 2**40, -(2**40)]


def test_executed_cos_sin_at_quadrant_edges():
    """With ``angle_proj`` 0 the angle stays put, so the stored B~ (fp32 Bstate) is B rotated by the
    given angles: every quadrant boundary and both ends of the int64 range, against float64."""
    spec = StepSpec(64, 32, 1, "float32", "float32", "float32", "float32", pool=True, update_kv_state=True,
                    rope_angles=16).with_default_tiling()
    B, P = 2, 2
    inputs = rotary_inputs(spec, B, P, seed=51)
    inputs["angle_state"] = torch.tensor(EDGE_ANGLES * 2, dtype=torch.int64).view(P, 1, 16).expand(P, 2, 16).clone()
    inputs["angle_proj"] = torch.zeros_like(inputs["angle_proj"])
    src = torch.arange(B, dtype=torch.int32)
    run = clone_inputs(inputs)
    ptx_step_fn(**run, state_batch_indices=src, update_kv_state=True)
    assert torch.equal(run["angle_state"], inputs["angle_state"])
    theta = inputs["angle_state"].double() * ANGLE_UNIT_RADIANS  # (P, H, S)
    for b in range(B):
        v = inputs["B"][b].double()  # (R, H, N)
        a, c = v[..., :16], v[..., 32:48]
        cos, sin = torch.cos(theta[b]), torch.sin(theta[b])
        want = v.clone()
        want[..., :16], want[..., 32:48] = a * cos - c * sin, a * sin + c * cos
        err = (run["Bstate"][b].double() - want).abs().max().item()
        assert err <= 4e-7 * max(1.0, v.abs().max().item()), f"lane {b}: B~ off by {err:.3g}"


def test_executed_layer_forms_equal_their_materialised_forms():
    """The layer's forms on the executed kernel: ``angle_proj`` with a stride-0 head axis and B/C
    with a head axis of 1, against contiguous (B, H, S) and the B/C expanded to every head (a
    per-head specialisation), bit for bit."""
    spec = ROTARY["flagship-rotary"].with_default_tiling()
    B, P = 4, 6
    inputs = rotary_inputs(spec, B, P, seed=61)
    inputs["angle_proj"] = inputs["angle_proj"][:, :1].expand(-1, 2, -1)
    assert inputs["angle_proj"].stride(1) == 0 and inputs["B"].shape[2] == 1
    src = torch.tensor([3, 0, -1, 5], dtype=torch.int32)
    shared = clone_inputs(inputs)
    out_shared = ptx_step_fn(**shared, state_batch_indices=src, update_kv_state=True)
    full = clone_inputs(inputs)
    full.update(angle_proj=inputs["angle_proj"].contiguous(), B=inputs["B"].expand(-1, -1, 2, -1).contiguous(),
                C=inputs["C"].expand(-1, -1, 2, -1).contiguous())
    out_full = ptx_step_fn(**full, state_batch_indices=src, update_kv_state=True)
    assert torch.equal(out_shared.view(torch.int16), out_full.view(torch.int16))
    for key in ("state", "Bstate", "Xstate", "angle_state"):
        assert torch.equal(shared[key], full[key]), key
