"""GPU suite for stochastic rounding of 16-bit states and for 8-bit states with scales (skipped
without CUDA; docs/contract.md, "Stochastic rounding", "8-bit states"). Passed on an H200
(2026-11-27).

* pool mode bit-identical to gather -> dense kernel -> scatter, the dense steps drawing for the
  pool rows (``rand_rows``), bf16, fp16, int8 and e4m3 (codes and scales), every padding kind,
  a speculative step;
* for inputs whose float32 arithmetic is exact in both, the kernel stores the CPU path's bits;
* a captured step replayed after advancing ``rand_seed[1]`` in place draws fresh bits, and equals
  the eager step at that offset.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import check_pool_parity, clone_inputs

from mamba3_step import mamba3_step_fn
from mamba3_step.testing import make_inputs, padded_indices, speculative_indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
NULL = 2
SHAPE = dict(H=3, D=64, N=128, R=4)


def _seed(offset=5):
    return torch.tensor([0x5EED, offset], dtype=torch.int64, device=DEV)


ROUNDED = ["bfloat16", "float16", "int8", "float8_e4m3fn"]


@pytest.mark.parametrize("B", [1, 9, 64, 256])
@pytest.mark.parametrize("state", ROUNDED)
def test_stochastic_pool_parity(state, B):
    P = B + 30
    inputs = dict(make_inputs(B, P, **SHAPE, dtypes=dict(state_dtype=state), seed=B, device=DEV), rand_seed=_seed())
    src, dst, kinds = padded_indices(B, P, null_slot_id=NULL, with_dst=B % 2 == 1, seed=B, device=DEV)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True,
                      step_fn=functools.partial(mamba3_step_fn, stochastic_rounding=True))


@pytest.mark.parametrize("state", ROUNDED)
def test_stochastic_speculative_parity(state):
    B, T = 9, 4
    P = B * T + 5
    inputs = dict(make_inputs(B, P, **SHAPE, dtypes=dict(state_dtype=state), tokens=T, seed=3, device=DEV),
                  rand_seed=_seed())
    src, nat, dst, kinds = speculative_indices(B, P, T, null_slot_id=NULL, seed=3, device=DEV)
    check_pool_parity(inputs, src, dst, kinds, null_slot_id=NULL, update_kv_state=True, num_accepted_tokens=nat,
                      step_fn=functools.partial(mamba3_step_fn, stochastic_rounding=True))


@pytest.mark.parametrize("scale", [1.0, 2.0**-20])
@pytest.mark.parametrize("state", ROUNDED)
def test_kernel_stores_the_cpu_paths_bits_for_exact_arithmetic(state, scale):
    """A = 0 (alpha = 1), trap = 1 (beta = 0), dt = 1/8, 16-bit B/x/projections: every float32
    operation of the update is exact or identically rounded on both executors."""
    inputs = make_inputs(16, 20, **SHAPE, dtypes=dict(state_dtype=state), seed=7)
    inputs["A"].zero_()
    inputs["trap"].fill_(1.0)
    inputs["dt"].fill_(0.125)
    inputs["x"].mul_(scale)
    inputs["state_scale" if "state_scale" in inputs else "state"].mul_(scale)
    src = torch.randperm(20)[:16].to(torch.int32)
    cpu = clone_inputs(inputs)
    mamba3_step_fn(**cpu, state_batch_indices=src, update_kv_state=True, stochastic_rounding=True,
                   rand_seed=_seed().cpu())
    gpu = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in clone_inputs(inputs).items()}
    mamba3_step_fn(**gpu, state_batch_indices=src.to(DEV), update_kv_state=True, stochastic_rounding=True,
                   rand_seed=_seed())
    torch.cuda.synchronize()
    width = {1: torch.int8, 2: torch.int16}[cpu["state"].element_size()]
    assert torch.equal(gpu["state"].cpu().view(width), cpu["state"].view(width))
    if "state_scale" in cpu:
        assert torch.equal(gpu["state_scale"].cpu().view(torch.int32), cpu["state_scale"].view(torch.int32))


def test_graph_replay_with_an_advanced_offset_draws_fresh_bits():
    B, P = 8, 16
    inputs = make_inputs(B, P, **SHAPE, dtypes=dict(state_dtype="bfloat16"), seed=11, device=DEV)
    seed = _seed(0)
    slots = torch.arange(B, dtype=torch.int32, device=DEV)
    start = {k: inputs[k].clone() for k in ("state", "Bstate", "Xstate")}

    def step():
        mamba3_step_fn(**inputs, state_batch_indices=slots, update_kv_state=True, stochastic_rounding=True,
                       rand_seed=seed)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    results = []
    for offset in (40, 41):
        for k, v in start.items():
            inputs[k].copy_(v)
        seed[1] = offset
        graph.replay()
        torch.cuda.synchronize()
        replayed = inputs["state"].clone()
        for k, v in start.items():
            inputs[k].copy_(v)
        eager = clone_inputs(inputs)
        mamba3_step_fn(**eager, state_batch_indices=slots, update_kv_state=True, stochastic_rounding=True,
                       rand_seed=_seed(offset))
        torch.cuda.synchronize()
        assert torch.equal(replayed.view(torch.int16), eager["state"].view(torch.int16)), offset
        results.append(replayed)
    assert not torch.equal(results[0].view(torch.int16), results[1].view(torch.int16))
