"""The DSL's own pipeline, executed: a kernel built from ``cutlass.pipeline.PipelineTmaAsync``,
``cpasync.CopyBulkG2SOp`` and ``cpasync.CopyBulkS2GOp`` (tests/ptx/bulk_dsl_kernel.py) compiled on the
CPU for sm_90a and its PTX run by the executor with the mbarrier and bulk-copy model on
(docs/ptx-tier.md, "mbarriers and bulk copies").

``out[b] = 2 * pool[idx[b]]`` for every live lane, bit for bit against torch; padding lanes (negative
indices) issue no copy and leave ``out[b]`` untouched; each live row is read exactly once, by one
256-byte bulk copy, no other pool row at all. The consumer group declared with its thread count
instead of its warp count deadlocks, and the executor says so.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bulk_dsl_kernel import W, compile_gather, run_gather

import ptx_executor as ptx

IDX = [3, -1, 7, 0, 9, -5, 4, 2, -1, 8]  # distinct live rows, padding between and at the end


def _inputs(seed=3):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(12, W, generator=g)
    idx = torch.tensor(IDX, dtype=torch.int32)
    return pool, idx, torch.full((len(IDX), W), -7.0)


def _expected(pool, idx):
    want = torch.full((len(IDX), W), -7.0)
    live = idx >= 0
    want[live] = pool[idx[live].long()] * 2
    return want


def test_the_dsl_emits_the_forms_the_tier_models():
    text = compile_gather()[0]
    for form in ("mbarrier.init.shared.b64", "mbarrier.try_wait.parity.shared.b64", "mbarrier.arrive.expect_tx",
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "mapa.shared::cluster.u32",
                 "cp.async.bulk.global.shared::cta.bulk_group", "cp.async.bulk.wait_group.read",
                 "fence.proxy.async.shared::cta", "fence.mbarrier_init.release.cluster", "elect.sync",
                 "bar.sync 1, 64"):
        assert form in " ".join(text.split()), form


@pytest.mark.parametrize("mode", ["modelled", "immediate"])
def test_a_gather_through_the_pipeline_is_exact_and_reads_each_live_row_once(mode):
    pool, idx, out = _inputs()
    res = run_gather(pool, idx, out, async_copies=mode)
    want = _expected(pool, idx)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    log = res.log.arrays()
    start, end = pool.data_ptr(), pool.data_ptr() + pool.numel() * 4
    on_pool = (log["addr"] >= start) & (log["addr"] < end)
    assert not log["write"][on_pool].any() and (log["width"][on_pool] == 4 * W).all()
    rows = sorted(((log["addr"][on_pool] - start) // (4 * W)).tolist())
    assert rows == sorted(i for i in IDX if i >= 0), "each live row once, padding and unused rows never"
    written = log["write"] & (log["addr"] >= out.data_ptr()) & (log["addr"] < out.data_ptr() + out.numel() * 4)
    lanes = sorted(((log["addr"][written] - out.data_ptr()) // (4 * W)).tolist())
    assert lanes == [b for b, i in enumerate(IDX) if i >= 0]


def test_a_two_stage_ring():
    pool, idx, out = _inputs(seed=5)
    run_gather(pool, idx, out, stages=2, consumer_warps=2)
    assert torch.equal(out, _expected(pool, idx))


def test_a_consumer_group_counted_in_threads_deadlocks():
    pool, idx, out = _inputs()
    with pytest.raises(ptx.BarrierError, match="deadlock") as e:
        run_gather(pool, idx, out, consumer_arrivals=64)
    assert "62 of 64 arrivals pending" in str(e.value) and "try_wait" in e.value.instruction
    assert np.array_equal(out[0].numpy(), (pool[3] * 2).numpy()), "the first round of the ring still ran"
