"""The multi-token kernel, executed: its PTX run on the CPU for the multi-token specialisations.

The same checks as the one-token kernel's (test_ptx_kernel.py), for T tokens per lane,
on the specialisations test_kernel_compile.py compiles (``MULTI_TOKEN``: per-token and final
destinations, accepted-token sources, dense with state_out, several CTAs per lane, each state
dtype, T from 2 to 8):

1. ``out`` (every token) and the written rows against the float64 reference: the error is at most
   twice PyTorch-float32's plus 1e-6 of the scale, and as close to the CPU path;
2. bit-identical to T *executed* one-token dense steps on the gathered rows (gather -> T dense
   steps -> scatter per token), pools poisoned, every padding kind in the source (counts 0 and
   K + 1, -1, INT32_MIN, P, INT32_MAX, the null slot) and in single tokens' destinations;
3. padding lanes: ``out`` exactly +0.0 for every token, not one pool byte read or written; live
   lanes read exactly their source row (each state byte once) and write exactly their live
   destination rows;
4. no race between CTAs or between the threads of a CTA, with each lane's destinations being its
   own candidate rows (the server's layout: a lane overwrites the row it read);
5. the bytes the executed kernel touched equal mamba3_step.tools.bytes_model's count.

Letters: B lanes, T tokens, K candidate rows, P pool rows, H heads, D head dim, N state size,
R MIMO rank.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import assert_accurate, check_pool_parity, clone_inputs
from test_kernel_compile import MULTI_TOKEN
from test_ptx_kernel import _f64, _options, _row_bytes, _shape, _tiling

from mamba3_step import mamba3_step_fn
from mamba3_step.api import prepare_step
from mamba3_step.tools.bytes_model import bytes_per_step
from mamba3_step.contract import lane_is_live, source_rows
from ptx_executor import analysis
from mamba3_step.tools.ptx_tier import ptx_step_fn, run_step_ptx
from mamba3_step.reference import mamba3_step_reference
from mamba3_step.spec import StepSpec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import SPECULATIVE_PAD_KINDS, make_inputs, poison_, step_indices

NULL = 3
POOL = [n for n, s in MULTI_TOKEN.items() if s.pool]


def _spec(name: str) -> StepSpec:
    return MULTI_TOKEN[name].with_default_tiling()


def _indices(spec: StepSpec, B: int, P: int, *, layout: str, seed: int) -> tuple[dict, list]:
    return step_indices(spec, B, P, null_slot_id=NULL, layout=layout, seed=seed)


def _pool_twin(spec: StepSpec) -> StepSpec:
    """A dense specialisation's pool-mode twin (speculative indices), for the parity checks."""
    if spec.pool:
        return spec
    return spec.replace(pool=True, has_dst=True, dst_per_token=True, num_accepted=True, has_state_out=False)


def _inputs(spec: StepSpec, B: int, P, seed: int) -> dict:
    return make_inputs(B, P, **_shape(spec), **_options(spec), tokens=spec.tokens, seed=seed)


@pytest.mark.parametrize("name", list(MULTI_TOKEN))
def test_executed_tokens_match_float64_and_the_cpu_path(name):
    spec = _spec(name)
    B = 7 if spec.pool else 3
    P = B * 2 * spec.tokens + 4 if spec.pool else None
    inputs = _inputs(spec, B, P, seed=31)
    kw = {}
    if spec.pool:
        kw, _ = _indices(spec, B, P, layout="separate", seed=5)
    if spec.has_state_out:
        inputs["state_out"] = poison_(torch.empty_like(inputs["state"]))
    ref = _f64(inputs)
    out64 = mamba3_step_reference(StepTensors(**ref, **kw), update_kv_state=spec.update_kv_state,
                                  compute_dtype=torch.float64)
    cpu = clone_inputs(inputs)
    out32 = mamba3_step_fn(**cpu, **kw, update_kv_state=spec.update_kv_state)
    run = clone_inputs(inputs)
    out = ptx_step_fn(**run, **kw, update_kv_state=spec.update_kv_state, **_tiling(spec))

    new_key = "state_out" if spec.has_state_out else "state"
    scale = max(out64.abs().max().item(), 1.0)
    for what, got, want, torch32 in (("out", out, out64, out32),
                                     (new_key, run[new_key], ref[new_key], cpu[new_key])):
        assert_accurate(f"{name}: {what}", got, want, torch32, scale, near_cpu=True)
    for key in ("Bstate", "Xstate"):  # stored copies of inputs: exact
        torch.testing.assert_close(run[key], cpu[key], rtol=0, atol=0)


#: (name, layout) pairs run with --full-matrix only: the largest shape (25 s an execution) in one layout
#: by default
FULL_LAYOUTS = {("N256-D128-R8-fp32-T2-dense", "shared")}


@pytest.mark.parametrize("name, layout", [
    pytest.param(n, lay, marks=[pytest.mark.full_matrix] if (n, lay) in FULL_LAYOUTS else [])
    for lay in ("shared", "separate") for n in MULTI_TOKEN])
def test_executed_tokens_are_t_executed_one_token_steps(name, layout):
    spec = _pool_twin(_spec(name))
    B = 7
    P = B * 2 * spec.tokens + 4
    inputs = _inputs(spec, B, P, seed=41)
    kw, kinds = _indices(spec, B, P, layout=layout, seed=7)
    step = functools.partial(ptx_step_fn, **_tiling(spec))
    check_pool_parity(inputs, kw["state_batch_indices"], kw["dst_state_batch_indices"], kinds,
                      num_accepted_tokens=kw["num_accepted_tokens"], null_slot_id=NULL,
                      update_kv_state=spec.update_kv_state, step_fn=step)


def _run_recorded(spec: StepSpec, B: int, *, layout: str, seed: int, record_shared: bool = False):
    P = B * 2 * spec.tokens + 4
    inputs = _inputs(spec, B, P, seed=seed)
    kw, kinds = _indices(spec, B, P, layout=layout, seed=seed)
    s, tensors, _ = prepare_step(StepTensors(**inputs, **kw), update_kv_state=spec.update_kv_state, **_tiling(spec))
    assert s == spec
    return run_step_ptx(spec, tensors, record_shared=record_shared), tensors, kinds


def _lane_bytes(res, b: int) -> dict:
    """Per direction (False: read, True: written): the byte addresses lane ``b``'s CTAs touched,
    as a set and as a list (repeats kept)."""
    log = res.log.arrays()
    mine = analysis.cta_of(res, log["thread"]) % res.grid[0] == b
    touched = {}
    for write in (False, True):
        sel = mine & (log["write"] == write)
        every = [a + k for a, w in zip(log["addr"][sel].astype(np.int64).tolist(), log["width"][sel].tolist())
                 for k in range(w)]
        touched[write] = (set(every), every)
    return touched


@pytest.mark.parametrize("name", POOL)
def test_padding_lanes_touch_no_pool_byte_and_live_lanes_touch_exactly_their_rows(name):
    spec = _spec(name)
    res, t, kinds = _run_recorded(spec, 7, layout="separate", seed=3)
    P = t.state.shape[0]
    src = source_rows(t.state_batch_indices, t.num_accepted_tokens)
    dst = t.dst_state_batch_indices
    for b, kind in enumerate(kinds):
        touched = _lane_bytes(res, b)
        if kind in SPECULATIVE_PAD_KINDS:
            assert not lane_is_live(int(src[b]), P, NULL)
            out = t.out[b]
            assert torch.equal(out, torch.zeros_like(out)) and not torch.signbit(out.float()).any(), \
                f"{name}: padding lane {b} ({kind}) out"
        targets = [] if kind in SPECULATIVE_PAD_KINDS else (
            [int(src[b])] if dst is None else [int(r) for r in dst[b].view(-1).tolist()])
        targets = [r for r in targets if lane_is_live(r, P, NULL)]
        for key in ("state", "Bstate", "Xstate"):
            pool = getattr(t, key)
            start, end = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
            read = {a for a in touched[False][0] if start <= a < end}
            written = {a for a in touched[True][0] if start <= a < end}
            if kind in SPECULATIVE_PAD_KINDS:
                assert not read and not written, f"{name}: padding lane {b} ({kind}) touched {key}"
                continue
            assert read == _row_bytes(pool, int(src[b])), f"{name}: lane {b} reads exactly its source row of {key}"
            want = set().union(*(_row_bytes(pool, r) for r in targets)) if (
                key == "state" or spec.update_kv_state) else set()
            assert written == want, f"{name}: lane {b} ({kind}) writes exactly its live destination rows of {key}"
            if key == "state":
                reads = [a for a in touched[False][1] if start <= a < end]
                assert len(reads) == len(read), f"{name}: lane {b} reads a state byte twice"
                writes = [a for a in touched[True][1] if start <= a < end]
                assert len(writes) == len(targets) * pool[0].numel() * pool.element_size(), \
                    f"{name}: lane {b} writes each destination's state bytes once per token"


@pytest.mark.parametrize("name", POOL)
def test_nothing_races_when_lanes_overwrite_the_rows_they_read(name):
    spec = _spec(name)
    res, *_ = _run_recorded(spec, 6, layout="shared", seed=4, record_shared=True)
    assert analysis.cta_races(res) == [], f"{name}: bytes shared between CTAs with a write"
    assert analysis.intra_cta_races(res) == [], f"{name}: a global race inside a CTA"
    assert analysis.intra_cta_races(res, shared=True) == [], f"{name}: a shared-memory race inside a CTA"


@pytest.mark.parametrize("name", ["flagship-T2-spec", "flagship-T3-final-dst", "N32-D128-R1-fp16state-T6-spec-noz-noout"])
def test_executed_bytes_equal_the_bytes_model(name):
    """Unique bytes read + written per tensor equal the model's count (all lanes live, a row each
    per token: no destination written twice)."""
    spec = _spec(name)
    B, H, T = 4, _shape(spec)["H"], spec.tokens
    P = B * (T + 1)
    inputs = _inputs(spec, B, P, seed=2)
    rows = torch.arange(P, dtype=torch.int32).view(B, T + 1)
    kw = dict(state_batch_indices=rows[:, :T] if spec.num_accepted else rows[:, 0].contiguous(),
              num_accepted_tokens=torch.tensor([1, T, 2, 1], dtype=torch.int32) if spec.num_accepted else None,
              dst_state_batch_indices=rows[:, 1:].contiguous() if spec.dst_per_token else rows[:, T].contiguous())
    s, tensors, _ = prepare_step(StepTensors(**inputs, **kw), update_kv_state=spec.update_kv_state, **_tiling(spec))
    res = run_step_ptx(s, tensors)
    touched = analysis.bytes_touched(res, res.extra["memory"])
    model = bytes_per_step(s, B, H)
    assert set(touched) <= set(model)
    for key, n in touched.items():
        assert n["read"] + n["written"] == model[key], f"{name}: {key} executed {n}, model {model[key]}"


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [2, 4, 8])
def test_t_tokens_equal_one_token_steps_each_at_its_default_tiling(T, x_dtype):
    """What a user gets: a T-token step at its default tiling (more warps than one token's) against
    T one-token steps at theirs, both executed, bit for bit. The tilings split ``out``'s sum over
    the ranks across different numbers of lanes; the sum's order must not depend on that."""
    spec = StepSpec(dstate=128, headdim=64, mimo=4, x_dtype=x_dtype, pool=True, has_dst=True, dst_per_token=True,
                    num_accepted=True, update_kv_state=True, tokens=T)
    one = spec.replace(tokens=1, dst_per_token=False, num_accepted=False).with_default_tiling()
    assert spec.with_default_tiling().num_warps != one.num_warps  # the two defaults do differ
    B = 3
    P = B * 2 * T + 4
    inputs = make_inputs(B, P, H=2, D=64, N=128, R=4, dtypes=dict(x_dtype=x_dtype), tokens=T, seed=T)
    kw, kinds = _indices(spec, B, P, layout="separate", seed=T)
    check_pool_parity(inputs, kw["state_batch_indices"], kw["dst_state_batch_indices"], kinds,
                      num_accepted_tokens=kw["num_accepted_tokens"], null_slot_id=NULL, update_kv_state=True,
                      step_fn=ptx_step_fn)  # no tiling given: each call gets its default


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
def test_out_does_not_depend_on_the_tiling(x_dtype):
    """The same one-token call executed at five tilings (2 or 4 lanes sharing an epilogue row, one
    or two CTAs per lane, 2 to 16 warps): ``out`` and the new state bit for bit the same."""
    B, P = 3, 8
    inputs = make_inputs(B, P, H=2, D=64, N=128, R=4, dtypes=dict(x_dtype=x_dtype), seed=9)
    src = torch.tensor([5, -1, 2], dtype=torch.int32)
    runs = []
    for tile_D, num_warps in ((64, 4), (64, 8), (64, 16), (32, 2), (32, 8)):
        run = clone_inputs(inputs)
        out = ptx_step_fn(**run, state_batch_indices=src, tile_D=tile_D, num_warps=num_warps)
        runs.append((out, run["state"]))
    for out, state in runs[1:]:
        assert torch.equal(out.view(torch.int16 if out.element_size() == 2 else torch.int32),
                           runs[0][0].view(torch.int16 if out.element_size() == 2 else torch.int32))
        assert torch.equal(state.view(torch.int32), runs[0][1].view(torch.int32))
