"""GPU tests of the CUDA-graph step runner (skipped without CUDA).

For every bucket up to 64, graph replay of the decode hook must be byte-identical to the
eager hook (and to gather -> dense -> scatter), with the rows of padded lanes, of free slots
and of the null slot unchanged bit for bit.

Letters: B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from mamba3_step.demo import run_toy_decode  # noqa: E402
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, poison_pool  # noqa: E402
from mamba3_step.serving import (  # noqa: E402
    CudaGraphStepRunner,
    StatePool,
    choose_bucket,
    decode_step,
    gather_scatter_step,
)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
H, D, N, R = 4, 64, 128, 4  # the flagship's per-head shape, few heads
P = 80


def _pool(seed, null_slot):
    pool = StatePool(1, P, H, D, N, R, state_dtype=torch.float32, kv_dtype=torch.bfloat16, device="cuda",
                     reserve_null_slot=null_slot)
    poison_pool(pool, torch.Generator().manual_seed(seed))
    return pool


@pytest.mark.parametrize("null_slot", [False, True])
@pytest.mark.parametrize("tile_D", [None, 32])
def test_graph_replay_matches_eager_for_every_bucket(null_slot, tile_D):
    g = torch.Generator().manual_seed(100 + null_slot)
    rng = random.Random(5)
    graph_pool = _pool(1, null_slot)
    eager_pool = StatePool(1, P, H, D, N, R, device="cuda", reserve_null_slot=null_slot)
    for a, b in zip((eager_pool._state, eager_pool._Bstate, eager_pool._Xstate),
                    (graph_pool._state, graph_pool._Bstate, graph_pool._Xstate)):
        a.copy_(b)
    base = [t.clone() for t in graph_pool.layer_tensors(0)]
    w = {k: (v.cuda() if v is not None else None) for k, v in layer_weights(H, D, R, generator=g).items()}
    runner = CudaGraphStepRunner(graph_pool, 0, buckets=BUCKETS, with_dst=True, tile_D=tile_D,
                                 num_warps=4 if tile_D else None, **w)
    runner.capture()
    assert runner.captured_buckets == BUCKETS
    usable = list(range(1 if null_slot else 0, P - 8))  # the last 8 slots stay free all along
    seen = set()
    for bucket in BUCKETS:
        for n in sorted({bucket, max(1, bucket - 3), max(1, bucket // 2 + 1)}):
            seen.add(choose_bucket(n, BUCKETS))
            live = rng.sample(usable, n)
            slots = torch.tensor(live, dtype=torch.int32, device="cuda")
            # every other step, half the lanes read a prefix row and write their own row
            dst = slots.clone()
            if n >= 2 and bucket % 2 == 0:
                spare = [s for s in usable if s not in live][: n // 2]
                slots[: len(spare)] = torch.tensor(spare, dtype=torch.int32, device="cuda")
            inp = {k: v.cuda() for k, v in lane_inputs(n, H, D, N, R, generator=g).items()}
            before = [t.clone() for t in graph_pool.layer_tensors(0)]
            chosen = choose_bucket(n, BUCKETS)
            runner.buffers(chosen)["out"].fill_(float("nan"))  # the replay must write every lane
            out = runner.step(slots, dst_slots=dst, **inp)
            eager = decode_step(eager_pool, 0, slots, inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"],
                                inp["trap"], w["xproj"], w["outproj"], z=inp["z"], zproj=w["zproj"], dst_slots=dst,
                                tile_D=tile_D, num_warps=4 if tile_D else None)
            st, bs, xs = base
            ref = gather_scatter_step(st, bs, xs, inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"],
                                      inp["trap"], w["xproj"], w["outproj"], z=inp["z"], zproj=w["zproj"],
                                      slots=slots, dst_slots=dst, null_slot_id=graph_pool.null_slot_id,
                                      update_kv_state=True, tile_D=tile_D, num_warps=4 if tile_D else None)
            torch.cuda.synchronize()
            assert bits_equal(out, eager), (bucket, n)
            assert bits_equal(out, ref), (bucket, n)
            for a, b, c in zip(graph_pool.layer_tensors(0), eager_pool.layer_tensors(0), base):
                assert bits_equal(a, b), (bucket, n)
                assert bits_equal(a, c), (bucket, n)
            untouched = torch.ones(P, dtype=torch.bool, device="cuda")
            untouched[dst.long()] = False  # everything else: padded lanes' ids, free slots, null slot
            for a, b in zip(graph_pool.layer_tensors(0), before):
                assert bits_equal(a[untouched], b[untouched]), (bucket, n)
            # the padded part of the static out buffer is zeros
            assert not runner.buffers(chosen)["out"][n:].any()
    assert seen == set(BUCKETS)  # every bucket was replayed, padded and unpadded


def test_static_buffers_stay_put_across_steps():
    g = torch.Generator().manual_seed(7)
    pool = _pool(3, False)
    w = {k: (v.cuda() if v is not None else None) for k, v in layer_weights(H, D, R, generator=g).items()}
    runner = CudaGraphStepRunner(pool, 0, buckets=(8, 64), **w)
    runner.capture()
    slots = pool.alloc(40).cuda()
    inp = {k: v.cuda() for k, v in lane_inputs(40, H, D, N, R, generator=g).items()}
    ptrs = {k: v.data_ptr() for k, v in runner.buffers(64).items()}
    runner.step(slots, **inp)
    runner.step(slots[:5], **{k: v[:5] for k, v in inp.items()})
    assert {k: v.data_ptr() for k, v in runner.buffers(64).items()} == ptrs


def test_demo_decode_on_gpu_with_graphs():
    res = run_toy_decode(steps=6, layers=2, slots=24, max_batch=12, buckets=(1, 2, 4, 8, 16), H=4, D=64, N=128,
                         R=4, seed=3, device="cuda")
    assert res.graphs
    assert res.parity, res.failures
