"""The step kernel, executed: its PTX run on the CPU for every specialisation of the covering set.

Nothing here needs a GPU. Each specialisation the compile tests compile is compiled again
with ``--keep-ptx`` and its PTX executed over CPU tensors by ptx_executor (whole grid,
barriers, shuffles, shared memory, the real parameter structs), with every global access
bounds-checked and recorded. Per specialisation:

1. ``out`` and the new state against the float64 reference: the error is at most twice
   that of the same computation done by PyTorch in float32 (which rounds to the same
   storage dtypes) plus 1e-6 of the output's scale; and against the CPU path likewise;
2. pool mode bit-identical to gather -> *executed* dense kernel -> scatter, pools poisoned,
   every padding kind (-1, INT32_MIN, P, INT32_MAX, null_slot_id), separate destinations
   with padded ones, update_kv_state, trailing and interleaved padding;
3. padding lanes: ``out`` exactly +0.0 and not one byte of any pool row read or written by
   their CTAs (from the recorded addresses); live lanes read exactly their src rows, each
   byte once, and write exactly their dst rows;
4. every tensor inside poisoned guard zones that stay untouched, with adversarial indices;
   no race between CTAs, none between threads of a CTA between barriers;
5. the bytes the executed kernel touched equal mamba3_step.tools.bytes_model's count.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import assert_accurate, PAD_KINDS, check_pool_parity, clone_inputs
from test_kernel_compile import COVERING

from mamba3_step import mamba3_step_fn
from mamba3_step.api import prepare_step
from mamba3_step.tools.bytes_model import bytes_per_step
from ptx_executor import analysis
from mamba3_step.tools.ptx_tier import ptx_kernel, ptx_step_fn, run_step_ptx
from mamba3_step.reference import mamba3_step_reference
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import make_inputs, padded_indices, poison_

NULL = 2


def _shape(spec: StepSpec) -> dict:
    big = spec.dstate * spec.headdim * spec.mimo >= 256 * 32 * 8
    return dict(H=1 if big else 2, D=spec.headdim, N=spec.dstate, R=spec.mimo)


def _options(spec: StepSpec) -> dict:
    """``make_inputs`` keywords for the specialisation's dtypes and optional tensors."""
    return dict(dtypes=dict(state_dtype=spec.state_dtype, kv_dtype=spec.kv_dtype, x_dtype=spec.x_dtype,
                            proj_dtype=spec.proj_dtype), has_z=spec.has_z, has_outproj=spec.has_outproj)


def _tiling(spec: StepSpec) -> dict:
    default = StepSpec(spec.dstate, spec.headdim, spec.mimo, spec.state_dtype).with_default_tiling()
    s = spec.with_default_tiling()
    if (s.tile_D, s.num_warps) == (default.tile_D, default.num_warps):
        return {}
    return dict(tile_D=s.tile_D, num_warps=s.num_warps)


def _pool_spec(spec: StepSpec) -> StepSpec:
    """The pool-mode twin of a covering spec (dense specs get one, with dst and update_kv)."""
    if spec.pool:
        return spec
    return spec.replace(pool=True, has_dst=True, has_state_out=False,
                        update_kv_state=spec.with_default_tiling().tile_D >= spec.headdim)


def adversarial_indices(B: int, P: int, *, with_dst: bool, layout: str, seed: int):
    """Indices whose padding lanes hold every padding kind (mamba3_step.testing.padded_indices)."""
    return padded_indices(B, P, null_slot_id=NULL, with_dst=with_dst, layout=layout, seed=seed)


def _f64(inputs: dict) -> dict:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


@pytest.mark.parametrize("name", list(COVERING))
def test_executed_kernel_matches_float64_and_the_cpu_path(name):
    spec = COVERING[name].with_default_tiling()
    B = 5
    P = 9 if spec.pool else None
    inputs = make_inputs(B, P, **_shape(spec), **_options(spec), seed=31)
    kw = {}
    if spec.pool:
        src, dst, _ = adversarial_indices(B + 3, P, with_dst=spec.has_dst, layout="interleaved", seed=5)
        inputs = make_inputs(B + 3, P, **_shape(spec), **_options(spec), seed=31)
        kw = dict(state_batch_indices=src, dst_state_batch_indices=dst if spec.has_dst else None,
                  null_slot_id=NULL)
    kw.update(update_kv_state=spec.update_kv_state, **_tiling(spec))
    if spec.has_state_out:
        inputs["state_out"] = poison_(torch.empty_like(inputs["state"]))

    ref = _f64(inputs)
    ref_kw = {k: v for k, v in kw.items() if k not in ("tile_D", "num_warps")}
    pool_kw = {k: v for k, v in ref_kw.items() if k != "update_kv_state"}
    out64 = mamba3_step_reference(StepTensors(**ref, **pool_kw), update_kv_state=spec.update_kv_state,
                                  compute_dtype=torch.float64)
    cpu = clone_inputs(inputs)
    out32 = mamba3_step_fn(**{k: v for k, v in cpu.items()}, **ref_kw)
    run = clone_inputs(inputs)
    out = ptx_step_fn(**run, **kw)

    new_key = "state_out" if spec.has_state_out else "state"
    scale = max(out64.abs().max().item(), 1.0)
    for what, got, want, torch32 in (("out", out, out64, out32),
                                     (new_key, run[new_key], ref[new_key], cpu[new_key])):
        assert_accurate(f"{name}: {what}", got, want, torch32, scale, near_cpu=True)
    if spec.update_kv_state:
        for key in ("Bstate", "Xstate"):
            torch.testing.assert_close(run[key], cpu[key], rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["trailing", "interleaved"])
@pytest.mark.parametrize("name", list(COVERING))
def test_pool_mode_is_gather_executed_dense_scatter(name, layout):
    spec = _pool_spec(COVERING[name].with_default_tiling())
    B, P = 9, 12
    inputs = make_inputs(B, P, **_shape(spec), **_options(spec), seed=41)
    src, dst, kinds = adversarial_indices(B, P, with_dst=spec.has_dst, layout=layout, seed=7)
    step = functools.partial(ptx_step_fn, **_tiling(spec))
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=spec.update_kv_state,
                      step_fn=step)


def _run_recorded(spec, B, P, seed, *, record_shared=False):
    inputs = make_inputs(B, P, **_shape(spec), **_options(spec), seed=seed)
    src, dst, kinds = adversarial_indices(B, P, with_dst=spec.has_dst, layout="interleaved", seed=seed)
    x = inputs["x"]
    out = poison_(torch.empty((B, x.shape[1], x.shape[2]) if spec.has_outproj else
                              (B, spec.mimo, x.shape[1], x.shape[2]), dtype=x.dtype))
    s, tensors, _ = prepare_step(StepTensors(**inputs, out=out, state_batch_indices=src,
                                             dst_state_batch_indices=dst if spec.has_dst else None,
                                             null_slot_id=NULL),
                                 update_kv_state=spec.update_kv_state, **_tiling(spec))
    assert s == spec
    res = run_step_ptx(spec, tensors, record_shared=record_shared)
    return res, tensors, src, dst, kinds


def _row_bytes(t: torch.Tensor, row: int) -> set:
    r = t[row]
    base = r.data_ptr()
    return set(range(base, base + r.numel() * r.element_size()))


@pytest.mark.parametrize("name", [n for n, s in COVERING.items() if s.pool])
def test_padding_lanes_touch_no_pool_byte_and_live_lanes_touch_exactly_their_rows(name):
    spec = COVERING[name].with_default_tiling()
    B, P = 8, 10
    res, tensors, src, dst, kinds = _run_recorded(spec, B, P, seed=3)
    t = tensors._asdict()
    log = res.log.arrays()
    lane = analysis.cta_of(res, log["thread"]) % res.grid[0]
    for b, kind in enumerate(kinds):
        mine = lane == b
        touched, counted = {}, {}
        for write in (False, True):
            sel = mine & (log["write"] == write)
            addrs = log["addr"][sel].astype(np.int64)
            widths = log["width"][sel]
            every = [a + k for a, w in zip(addrs.tolist(), widths.tolist()) for k in range(w)]
            touched[write], counted[write] = set(every), every
        for key in ("state", "Bstate", "Xstate"):
            pool = t[key]
            start = pool.data_ptr()
            end = start + pool.numel() * pool.element_size()
            read = {a for a in touched[False] if start <= a < end}
            written = {a for a in touched[True] if start <= a < end}
            if kind in PAD_KINDS:
                assert not read and not written, f"{name}: padding lane {b} ({kind}) touched {key}"
                continue
            assert read == _row_bytes(pool, int(src[b])), f"{name}: lane {b} reads exactly row src of {key}"
            d = int(src[b] if dst is None else dst[b])
            writes_row = kind == "live" and (key == "state" or spec.update_kv_state)
            assert written == (_row_bytes(pool, d) if writes_row else set()), f"{name}: lane {b} {key} writes"
            if key == "state":  # the slab is a bijection onto the threads' 16-byte vectors
                reads = [a for a in counted[False] if start <= a < end]
                assert len(reads) == len(read), f"{name}: lane {b} reads a state byte twice"
                writes = [a for a in counted[True] if start <= a < end]
                assert len(writes) == len(written), f"{name}: lane {b} writes a state byte twice"
        if kind in PAD_KINDS:
            assert torch.equal(t["out"][b], torch.zeros_like(t["out"][b])), f"{name}: padding lane {b} out"
            assert not torch.signbit(t["out"][b].float()).any()


@pytest.mark.parametrize("name", [n for n, s in COVERING.items() if s.pool])
def test_guard_zones_stay_untouched_and_nothing_races(name):
    """Every tensor lives inside a poisoned allocation; the executor registers only the views,
    so an access to a guard byte would fault, and the guard bytes must keep their bits."""
    spec = COVERING[name].with_default_tiling()
    B, P = 8, 10
    inputs = make_inputs(B, P, **_shape(spec), **_options(spec), seed=9)
    src, dst, kinds = adversarial_indices(B, P, with_dst=spec.has_dst, layout="trailing", seed=9)
    guarded, backing = {}, {}
    for key, v in inputs.items():
        if v is None:
            continue
        pad = 64 // v.element_size()
        buf = poison_(torch.empty(v.numel() + 2 * pad, dtype=v.dtype), seed=len(key))
        view = buf[pad:pad + v.numel()].view(v.shape)
        view.copy_(v)
        guarded[key], backing[key] = view, buf
    before = {k: b.clone() for k, b in backing.items()}
    out = ptx_step_fn(**guarded, state_batch_indices=src, dst_state_batch_indices=dst, null_slot_id=NULL,
                      update_kv_state=spec.update_kv_state, **_tiling(spec))
    for key, buf in backing.items():
        pad = 64 // buf.element_size()
        for zone in (slice(0, pad), slice(buf.numel() - pad, buf.numel())):
            assert torch.equal(_bits(buf[zone]), _bits(before[key][zone])), f"{name}: guard zone of {key} changed"
    assert out.shape[0] == B
    res, *_ = _run_recorded(spec, B, P, seed=4, record_shared=True)
    assert analysis.cta_races(res) == [], f"{name}: bytes shared between CTAs with a write"
    assert analysis.intra_cta_races(res) == [], f"{name}: a global race inside a CTA"
    assert analysis.intra_cta_races(res, shared=True) == [], f"{name}: a shared-memory race inside a CTA"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("name", ["flagship-pool-kv", "N64-D128-R2-fp16state-pool-dst-kv-noout"])
def test_executed_bytes_equal_the_bytes_model(name):
    """Unique bytes read + written per tensor, from the executed accesses, equal the model's
    count (all lanes live, distinct source and destination rows)."""
    spec = COVERING[name].with_default_tiling()
    B, H = 6, _shape(spec)["H"]
    P = 2 * B + 2
    inputs = make_inputs(B, P, **_shape(spec), **_options(spec), seed=2)
    src = torch.tensor([4, 0, 13, 2, 8, 5], dtype=torch.int32)
    dst = torch.tensor([1, 3, 6, 7, 9, 12], dtype=torch.int32) if spec.has_dst else None
    s, tensors, _ = prepare_step(StepTensors(**inputs, state_batch_indices=src, dst_state_batch_indices=dst),
                                 update_kv_state=spec.update_kv_state)
    res = run_step_ptx(s, tensors)
    touched = analysis.bytes_touched(res, res.extra["memory"])
    model = bytes_per_step(s, B, H)
    assert set(touched) <= set(model)
    for key, n in touched.items():
        assert n["read"] + n["written"] == model[key], f"{name}: {key} executed {n}, model {model[key]}"


def test_sm100a_ptx_is_the_sm90a_ptx():
    """The compiler emits the same PTX for both targets (only ``.target`` differs), so the
    executed sm_90a PTX stands for sm_100a too; if this ever fails, execute both."""
    spec = COVERING["flagship-pool-kv"].with_default_tiling()
    a = ptx_kernel(spec, "sm_90a").ptx_text.replace(".target sm_90a", "")
    b = ptx_kernel(spec, "sm_100a").ptx_text.replace(".target sm_100a", "")
    assert a == b
