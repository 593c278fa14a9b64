"""GPU tests of the CUDA-graph step runner (skipped without CUDA).

For every bucket up to 64, graph replay of the decode hook must be byte-identical to the
eager hook (and to gather -> dense -> scatter), with the rows of padded lanes, of free slots
and of the null slot unchanged bit for bit. The same for T-token verify steps (speculative
decoding: the form ``StepForm.speculative(T)``, groups from ``StatePool.alloc_spec``), and the
demo's speculative round with graphs (the T-token kernel against one-token kernel steps).

Letters: B lanes, T tokens per lane, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from mamba3_step.tools.demo.decode import run_speculative_decode, run_toy_decode  # noqa: E402
from mamba3_step.testing import LayerShape, bits_equal, lane_inputs, layer_weights, poison_pool  # noqa: E402
from mamba3_step.serving import (CudaGraphStepRunner, StatePool, StepForm, choose_bucket, decode_step, gather_scatter_step)

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
    res = run_toy_decode(steps=6, layers=2, slots=24, max_batch=12, buckets=(1, 2, 4, 8, 16),
                         shape=LayerShape(H=4, D=64, N=128, R=4), seed=3, device="cuda")
    assert res.graphs
    assert res.parity, res.failures


def _twin(pool):
    other = StatePool(1, pool.num_slots, H, D, N, R, device="cuda", reserve_null_slot=pool.reserve_null_slot)
    for a, b in zip((other._state, other._Bstate, other._Xstate), (pool._state, pool._Bstate, pool._Xstate)):
        a.copy_(b)
    return other


@pytest.mark.parametrize("null_slot", [False, True])
@pytest.mark.parametrize("tile_D", [None, 32])
@pytest.mark.parametrize("T", [2, 4])
def test_t_token_graph_replay_matches_eager_for_every_bucket(T, tile_D, null_slot):
    """Verify steps replayed from the (bucket, StepForm.speculative(T)) graphs: out and every pool row
    equal the eager hook and gather -> dense -> scatter (T one-token dense steps), rows outside the
    step's groups unchanged, the padded lanes' out zeros; counts committed between steps."""
    g = torch.Generator().manual_seed(300 + T)
    rng = random.Random(T)
    Ps = 64 * T + 8 + null_slot
    graph_pool = StatePool(1, Ps, H, D, N, R, device="cuda", reserve_null_slot=null_slot)
    poison_pool(graph_pool, torch.Generator().manual_seed(T))
    eager_pool = _twin(graph_pool)
    base = [t.clone() for t in graph_pool.layer_tensors(0)]
    groups = graph_pool.alloc_spec(64, T)  # 8 rows stay free all along
    w = {k: (v.cuda() if v is not None else None) for k, v in layer_weights(H, D, R, generator=g).items()}
    warps = 4 if tile_D else None
    runner = CudaGraphStepRunner(graph_pool, 0, buckets=BUCKETS, with_dst=True, tile_D=tile_D, num_warps=warps, **w)
    form = StepForm.speculative(T)
    runner.capture(form=form)
    assert runner.captured == tuple((b, form) for b in BUCKETS)
    for bucket in BUCKETS:
        for n in sorted({bucket, max(1, bucket - 3), max(1, bucket // 2 + 1)}):
            sel = groups[rng.sample(range(64), n)]
            idx = graph_pool.spec_indices(sel)
            inp = {k: v.cuda() for k, v in lane_inputs(n, H, D, N, R, tokens=T, generator=g).items()}
            before = [t.clone() for t in graph_pool.layer_tensors(0)]
            chosen = choose_bucket(n, BUCKETS)
            runner.buffers(chosen, form)["out"].fill_(float("nan"))
            kw_idx = dict(dst_slots=idx.dst_state_batch_indices, num_accepted_tokens=idx.num_accepted_tokens)
            out = runner.step(idx.state_batch_indices, **inp, **kw_idx)
            args = (inp["A"], inp["B"], inp["C"], w["D"], inp["x"], inp["dt"], inp["trap"], w["xproj"], w["outproj"])
            eager = decode_step(eager_pool, 0, idx.state_batch_indices, *args, z=inp["z"], zproj=w["zproj"],
                                tile_D=tile_D, num_warps=warps, **kw_idx)
            st, bs, xs = base
            ref = gather_scatter_step(st, bs, xs, *args, z=inp["z"], zproj=w["zproj"], slots=idx.state_batch_indices,
                                      dst_slots=idx.dst_state_batch_indices, null_slot_id=graph_pool.null_slot_id,
                                      num_accepted_tokens=idx.num_accepted_tokens, update_kv_state=True,
                                      tile_D=tile_D, num_warps=warps)
            torch.cuda.synchronize()
            assert bits_equal(out, eager), (bucket, n)
            assert bits_equal(out, ref), (bucket, n)
            for a, b, c in zip(graph_pool.layer_tensors(0), eager_pool.layer_tensors(0), base):
                assert bits_equal(a, b) and bits_equal(a, c), (bucket, n)
            untouched = torch.ones(Ps, dtype=torch.bool, device="cuda")
            untouched[sel.reshape(-1).long().cuda()] = False
            for a, b in zip(graph_pool.layer_tensors(0), before):
                assert bits_equal(a[untouched], b[untouched]), (bucket, n)
            assert not runner.buffers(chosen, form)["out"][n:].any()
            graph_pool.commit_accepted(sel, [rng.randint(1, T) for _ in range(n)])


def test_demo_speculative_round_on_gpu_with_graphs():
    res = run_speculative_decode(rounds=4, tokens=4, requests=6, layers=2, buckets=(1, 2, 4, 8),
                                 shape=LayerShape(H=4, D=64, N=128, R=4), seed=3, device="cuda")
    assert res.graphs
    assert res.parity, res.failures
