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


@pytest.mark.parametrize("state", ["bfloat16", "int8"])
def test_graph_runner_draws_what_decode_step_draws(state):
    """The runner's first capture runs a warm-up step: it must leave ``rand_seed``'s offset where it
    was, or every captured step draws other bits than ``decode_step`` with the same seed (found on an
    H200, 2026-11-28: the 8-bit replay pool's runner one offset ahead from the first capture)."""
    from mamba3_step.serving import CudaGraphStepRunner, StatePool, decode_step
    from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors

    H, D, N, R = SHAPE["H"], SHAPE["D"], SHAPE["N"], SHAPE["R"]
    g = torch.Generator().manual_seed(70)
    w = layer_weights(H, D, R, generator=g, device=DEV)
    pools = [StatePool(1, 12, H, D, N, R, state_dtype=getattr(torch, state), device=DEV) for _ in range(2)]
    slots = pools[0].alloc(5)
    fresh = row_tensors(5, H, D, N, R, state_dtype=state, generator=g, device=DEV)
    for pool in pools:
        if pool is not pools[0]:
            assert torch.equal(pool.alloc(5), slots)
        for k in ("state", "state_scale"):
            if getattr(pool, k)(0) is not None:
                getattr(pool, k)(0)[slots.long().to(DEV)] = fresh[k]
    seeds = [_seed(7) for _ in range(2)]
    runner = CudaGraphStepRunner(pools[1], 0, buckets=(8,), **w, stochastic_rounding=True, rand_seed=seeds[1])
    padded = torch.cat([slots, torch.tensor([-1], dtype=torch.int32)]).to(DEV)
    for step in range(3):
        lane = lane_inputs(6, H, D, N, R, generator=g, device=DEV)
        want = decode_step(pools[0], 0, padded, **lane, **w, stochastic_rounding=True, rand_seed=seeds[0])
        got = runner.step(padded, **lane)
        torch.cuda.synchronize()
        assert torch.equal(seeds[0], seeds[1]), f"step {step}: the offsets parted"
        assert bits_equal(got, want), f"step {step}: out"
        for k in ("state", "state_scale"):
            if getattr(pools[0], k)(0) is not None:
                assert bits_equal(getattr(pools[1], k)(0), getattr(pools[0], k)(0)), f"step {step}: {k}"
