"""GPU suite for the rotary specialisations (skipped without CUDA; docs/contract.md, "Rotary angle").

Passed on an H200 (2026-11-27). The same checks the PTX tier makes on the CPU
(tests/ptx/test_ptx_rotary.py), on the real kernel and at batch sizes the tier cannot afford:

* pool mode bit-identical to gather -> dense kernel -> scatter (angle rows included) for the
  layer's flagship rotary, SISO pairwise with rope fraction 1.0, fp16 per-head B/C, every padding
  kind, destinations, the null slot; a T=4 speculative step likewise;
* accuracy against float64 (out, state, angle) for each of them;
* a rotary step captured in a CUDA graph and replayed with new indices and inputs equals eager.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank, S angles.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_accurate, check_pool_parity, clone_inputs

from mamba3_step import mamba3_step_fn
from mamba3_step.reference import mamba3_step_reference
from mamba3_step.rotary import ANGLE_UNIT_RADIANS
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import make_inputs, padded_indices, speculative_indices, with_rotary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
NULL = 2
#: (N, D, R, S, rotate_pairwise, shared_bc, bias, dtypes)
CASES = {
    "flagship-rotary": (128, 64, 4, 32, False, True, True, {}),
    "siso-pairwise-rope1": (64, 32, 1, 32, True, False, True, {}),
    "fp16-per-head": (128, 64, 4, 64, False, False, False,
                      dict(state_dtype="float16", kv_dtype="float16", x_dtype="float16", proj_dtype="float16")),
}


def _inputs(name, B, P, seed, tokens=None):
    N, D, R, S, _, shared, bias, dtypes = CASES[name]
    inputs = make_inputs(B, P, H=3, D=D, N=N, R=R, dtypes=dtypes, tokens=tokens, seed=seed, device=DEV)
    return with_rotary(inputs, S, shared_bc=shared, bias=bias, seed=seed + 1)


@pytest.mark.parametrize("B", [1, 7, 64, 256])
@pytest.mark.parametrize("name", list(CASES))
def test_rotary_pool_parity(name, B):
    P = B + 40
    inputs = _inputs(name, B, P, seed=B)
    src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, with_dst=B % 2 == 1, layout="interleaved", seed=B,
                                     device=DEV)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True,
                      rotate_pairwise=CASES[name][4])


@pytest.mark.parametrize("name", list(CASES))
def test_rotary_speculative_parity(name):
    B, T = 9, 4
    P = B * T + 5
    inputs = _inputs(name, B, P, seed=3, tokens=T)
    src, nat, dst, kinds = speculative_indices(B, P, T, null_slot_id=NULL, seed=3, device=DEV)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True, num_accepted_tokens=nat,
                      rotate_pairwise=CASES[name][4])


@pytest.mark.parametrize("name", list(CASES))
def test_rotary_accuracy(name):
    B, P = 17, 40
    pairwise = CASES[name][4]
    inputs = _inputs(name, B, P, seed=11)
    src = torch.randperm(P, device=DEV)[:B].to(torch.int32)
    ref = {k: (v.double() if v.is_floating_point() else v.clone()) if isinstance(v, torch.Tensor) else v
           for k, v in inputs.items()}
    out64 = mamba3_step_reference(StepTensors(**ref, state_batch_indices=src), update_kv_state=True,
                                  rotate_pairwise=pairwise, compute_dtype=torch.float64)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in clone_inputs(inputs).items()}
    out32 = mamba3_step_fn(**cpu, state_batch_indices=src.cpu(), update_kv_state=True, rotate_pairwise=pairwise)
    run = clone_inputs(inputs)
    out = mamba3_step_fn(**run, state_batch_indices=src, update_kv_state=True, rotate_pairwise=pairwise)
    torch.cuda.synchronize()
    scale = max(out64.abs().max().item(), 1.0)
    assert_accurate(f"{name}: out", out.cpu(), out64.cpu(), out32, scale, near_cpu=True)
    assert_accurate(f"{name}: state", run["state"].cpu(), ref["state"].cpu(), cpu["state"], scale, near_cpu=True)
    angle_err = float((run["angle_state"] - ref["angle_state"]).abs().max()) * ANGLE_UNIT_RADIANS
    assert angle_err < 1e-6, f"{name}: angle off by {angle_err:.3g} rad"


def test_rotary_cuda_graph_replay_equals_eager():
    name = "flagship-rotary"
    B, P = 16, 48
    static = _inputs(name, B, P, seed=5)
    slots = torch.full((B,), -1, dtype=torch.int32, device=DEV)
    pools = {k: static[k] for k in ("state", "Bstate", "Xstate", "angle_state")}
    lanes = {k: v for k, v in static.items() if k not in pools}
    out = torch.empty((B, 3, 64), dtype=torch.bfloat16, device=DEV)

    def step():
        mamba3_step_fn(**pools, **lanes, out=out, state_batch_indices=slots, null_slot_id=NULL, update_kv_state=True)

    step()  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for it in range(3):
        fresh = _inputs(name, B, P, seed=50 + it)
        for k, v in lanes.items():
            if isinstance(v, torch.Tensor):
                v.copy_(fresh[k])
        slots.copy_(torch.randperm(P, device=DEV)[:B].to(torch.int32))
        slots[B - 3:] = -1
        eager = {k: v.clone() for k, v in pools.items()}
        want = mamba3_step_fn(**eager, **lanes, state_batch_indices=slots.clone(), null_slot_id=NULL,
                              update_kv_state=True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), it
        for k in pools:
            assert torch.equal(pools[k], eager[k]), (it, k)
