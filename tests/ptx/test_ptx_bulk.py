"""PTX executor self-tests, mbarriers and bulk copies (ptx_executor/isa_mbar.py, isa_bulk.py; docs/ptx-tier.md
"mbarriers and bulk copies").

The kernels are hand-written rings (tests/ptx/bulk_ring_ptx.py): a producer lane filling stages by
bulk copies signalled through mbarriers, consumer warps reading them and writing ``2 * x`` out.
Correct rings give exact values; each planted mistake raises with the asynchrony model and, where
the model is what finds it, runs without an error with ``async_copies="immediate"``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from bulk_ring_ptx import (COMMIT, EMPTY_WAIT, FENCE, FULL_WAIT, ROW, STORE, WAIT_READ, decls, ring_body,
                           run_ring)
from ptx_harness import kernel_ptx, ptr_param

import ptx_executor as ptx
from ptx_executor import isa_bulk, isa_mbar


def _both_modes(run, match):
    """``run(mode)`` raises BulkCopyError matching ``match`` with the model, and nothing without it."""
    with pytest.raises(ptx.BulkCopyError, match=re.escape(match)) as e:
        run("modelled")
    run("immediate")
    return e.value


# ------------------------------------------------------------------------------ correct rings

@pytest.mark.parametrize("stages,rows,s2g", [(2, 5, False), (3, 7, False), (2, 5, True), (3, 4, True)])
@pytest.mark.parametrize("mode", ["modelled", "immediate"])
def test_a_ring_gives_exact_values(stages, rows, s2g, mode):
    out, src, _ = run_ring(ring_body(stages, rows, s2g=s2g), stages, rows, async_copies=mode)
    assert torch.equal(out, src * 2)


def test_each_row_is_read_once_by_one_bulk_copy_and_written_once():
    stages, rows = 3, 7
    out, src, res = run_ring(ring_body(stages, rows, s2g=True), stages, rows)
    log = res.log.arrays()
    copy = {i.line for i in res.entry.instructions if i.opcode.startswith("cp.async.bulk.shared")}
    store = {i.line for i in res.entry.instructions if i.opcode.startswith("cp.async.bulk.global")}
    reads = np.isin(log["instr"], list(copy))
    assert (log["width"][reads] == 256).all() and not log["write"][reads].any()
    assert sorted(log["addr"][reads].tolist()) == [src.data_ptr() + 256 * i for i in range(rows)]
    writes = np.isin(log["instr"], list(store))
    assert sorted(log["addr"][writes].tolist()) == [out.data_ptr() + 256 * i for i in range(rows)]
    assert log["write"][writes].all() and (log["thread"][writes] == 32).all()
    assert not (log["write"] & ~writes).any(), "nothing but the bulk stores writes global memory"


# ------------------------------------------------------------------------------ planted mistakes

def test_reading_a_stage_before_waiting_on_its_full_barrier():
    body = ring_body(2, 5).replace(FULL_WAIT, "")
    err = _both_modes(lambda m: run_ring(body, 2, 5, async_copies=m), isa_bulk.READ_BEFORE_LANDED)
    assert err.instruction.startswith("ld.shared.b32") and err.thread == (32, 0, 0)
    assert "by thread (0, 0, 0)" in str(err) and err.address == 1024


def test_refilling_a_stage_without_waiting_on_its_empty_barrier():
    """The third row's copy into stage 0 while the first is still unread (not even landed). Without
    the model the full barrier runs a phase ahead of the consumers: they hang."""
    body = ring_body(2, 3).replace(EMPTY_WAIT, "")
    with pytest.raises(ptx.BulkCopyError, match=re.escape(isa_bulk.WRITE_WHILE_FILLING)) as e:
        run_ring(body, 2, 3)
    assert e.value.instruction.startswith("cp.async.bulk.shared::cluster") and e.value.thread == (0, 0, 0)
    with pytest.raises(ptx.BarrierError, match="deadlock"):
        run_ring(body, 2, 3, async_copies="immediate")


def test_writing_the_bulk_stores_source_before_its_wait_group_read():
    body = ring_body(2, 3, s2g=True).replace(COMMIT, COMMIT + "  st.shared.b32 [%r25+8], %r0;\n")
    err = _both_modes(lambda m: run_ring(body, 2, 3, async_copies=m), isa_bulk.WRITE_WHILE_READING)
    assert err.instruction.startswith("st.shared.b32") and err.address == 1024 + 512 + 32 + 8


def test_keeping_one_bulk_group_lets_the_next_row_overwrite_the_source():
    body = ring_body(2, 3, s2g=True).replace(WAIT_READ, "  cp.async.bulk.wait_group.read 1;\n")
    err = _both_modes(lambda m: run_ring(body, 2, 3, async_copies=m), isa_bulk.WRITE_WHILE_READING)
    assert err.thread == (32, 0, 0) and "cp.async.bulk.global" in str(err)


def test_a_bulk_store_of_generic_writes_without_fence_proxy_async():
    body = ring_body(2, 3, s2g=True).replace(FENCE, "")
    err = _both_modes(lambda m: run_ring(body, 2, 3, async_copies=m), isa_bulk.MISSING_FENCE)
    assert err.instruction.startswith("cp.async.bulk.global") and "by thread (32, 0, 0)" in str(err)
    out, src, _ = run_ring(body, 2, 3, async_copies="immediate")
    assert torch.equal(out, src * 2), "without the model the mistake is invisible"
    # a fence of the global proxy only does not cover shared memory
    glob = ring_body(2, 3, s2g=True).replace(FENCE, "  fence.proxy.async.global;\n")
    _both_modes(lambda m: run_ring(glob, 2, 3, async_copies=m), isa_bulk.MISSING_FENCE)
    plain = ring_body(2, 3, s2g=True).replace(FENCE, "  fence.proxy.async;\n")
    out, src, _ = run_ring(plain, 2, 3)
    assert torch.equal(out, src * 2)


def test_an_uninitialised_mbarrier_is_a_finding_in_both_modes():
    body = ring_body(2, 3).replace("  mbarrier.init.shared::cta.b64 [%r1+8], 1;\n", "")
    for mode in ("modelled", "immediate"):
        with pytest.raises(ptx.BulkCopyError, match=re.escape(isa_mbar.UNINITIALISED)) as e:
            run_ring(body, 2, 3, async_copies=mode)
        assert e.value.instruction.startswith("mbarrier.arrive.expect_tx") and e.value.address == 1024 + 512 + 8


def test_a_wrong_arrival_count_deadlocks_and_is_reported():
    """The empty barriers expecting 64 arrivals (the consumer threads) where the consumers arrive once
    per warp: the producer's third row waits forever; every live thread is parked."""
    body = ring_body(2, 5, empty_count=64)
    for mode in ("modelled", "immediate"):
        with pytest.raises(ptx.BarrierError, match="deadlock") as e:
            run_ring(body, 2, 5, async_copies=mode)
        msg = str(e.value)
        assert "mbarrier at shared address 0x610" in msg and "62 of 64 arrivals pending" in msg
        assert e.value.thread == (0, 0, 0) and "try_wait" in e.value.instruction
        assert "64 waiting on other mbarriers, 31 exited" in msg


def test_re_initialising_an_mbarrier_mid_phase():
    arm = "  mbarrier.arrive.expect_tx.shared::cta.b64 %rd9, [%r15], 256;\n"
    body = ring_body(2, 3).replace(arm, arm + "  mbarrier.init.shared::cta.b64 [%r15], 1;\n")
    with pytest.raises(ptx.BulkCopyError, match=re.escape(isa_mbar.REINIT_PENDING)):
        run_ring(body, 2, 3)


# ------------------------------------------------------------------------------ single-thread kernels

ONE = """  mov.u32 %r1, bars;
  mov.u32 %r2, ring;
  mbarrier.init.shared::cta.b64 [%r1], 1;
"""


def _one(body, rows=1, mode="modelled"):
    src = torch.arange(rows * ROW, dtype=torch.float32).reshape(rows, ROW)
    out = torch.full((rows, ROW), -7.0)
    mem = ptx.GlobalMemory()
    mem.add("out", out)
    mem.add("src", src, writable=False)
    ptx.run(kernel_ptx(ONE + body, ("out", "src"), decls(2)), grid=(1, 1, 1), block=(1, 1, 1),
            params=[ptr_param(out), ptr_param(src)], memory=mem, async_copies=mode)
    return out, src


def test_exiting_with_a_bulk_store_in_flight():
    body = "  st.shared.v4.b32 [%r2], {%r1, %r1, %r1, %r1};\n" + FENCE + \
        STORE.replace("%rd5", "%rd40").replace("%r25", "%r2") + COMMIT + "  ret;\n"
    _both_modes(lambda m: _one(body, mode=m), isa_bulk.EXIT_IN_FLIGHT)
    out, _ = _one(body.replace("  ret;\n", WAIT_READ + "  ret;\n"))
    assert out[0, :4].view(torch.int32).tolist() == [1024 + 512] * 4 and out[0, 4:].tolist() == [0.0] * 60


LOAD = """  mbarrier.arrive.expect_tx.shared::cta.b64 %rd9, [%r1], 256;
  cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%r2], [%rd41], 256, [%r1];
"""


def test_test_wait_with_the_arrive_state_and_a_global_write_to_a_copys_source():
    body = LOAD + """W:
  mbarrier.test_wait.shared::cta.b64 %p1, [%r1], %rd9;
  @!%p1 bra W;
  ld.shared.v4.b32 {%r4, %r5, %r6, %r7}, [%r2+16];
  st.global.v4.b32 [%rd40], {%r4, %r5, %r6, %r7};
  ret;
"""
    out, src = _one(body)
    assert torch.equal(out[0, :4], src[0, 4:8])
    racy = LOAD + "  st.global.b32 [%rd41], %r1;\n  ret;\n"
    src = torch.zeros(1, ROW)
    mem = ptx.GlobalMemory()
    mem.add("src", src)
    with pytest.raises(ptx.BulkCopyError, match=re.escape(isa_bulk.SOURCE_OVERWRITTEN)):
        ptx.run(kernel_ptx(ONE + racy, ("src2", "src"), decls(2)), grid=(1, 1, 1), block=(1, 1, 1),
                params=[ptr_param(src), ptr_param(src)], memory=mem)


@pytest.mark.parametrize("line,error,match", [
    ("  cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%r2], [%rd41], 24, [%r1];\n",
     ptx.BulkCopyError, "not a positive multiple of 16"),
    ("  cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%r2], [%rd41+8], 256, [%r1];\n",
     ptx.MemoryFault, "16-byte alignment"),
    ("  cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%r2], [%rd41+16], 256, [%r1];\n",
     ptx.MemoryFault, "outside every tensor"),
    ("  cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%r2+8], [%rd41], 256, [%r1];\n",
     ptx.MemoryFault, "not 16-byte aligned"),
    ("  cp.async.bulk.global.shared::cta.bulk_group [%rd41], [%r2], 256;\n", ptx.MemoryFault, "read-only"),
    ("  mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%r1], 256;\n"
     "  mbarrier.arrive.shared::cta.b64 %rd9, [%r1], 2;\n",
     ptx.BulkCopyError, isa_mbar.OVER_ARRIVAL),
    ("  mbarrier.arrive.expect_tx.shared::cta.b64 %rd9, [%r1], 16;\n"
     "  mbarrier.complete_tx.shared::cta.b64 [%r1], 32;\n",
     ptx.BulkCopyError, isa_mbar.OVER_COMPLETE),
    ("  mbarrier.arrive.shared::cta.b64 %rd9, [%r1+4];\n", ptx.MemoryFault, "mbarrier"),
    ("  mapa.shared::cluster.u32 %r3, %r2, 1;\n", ptx.MemoryFault, "cluster of one CTA"),
])
def test_bad_operands_fault(line, error, match):
    with pytest.raises(error, match=re.escape(match)):
        _one(line + "  ret;\n")


@pytest.mark.parametrize("line,why", [
    ("cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%r2], [%rd41], [%r1];",
     "tensor-map"),
    ("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%r2], [%r2], 16, [%r1];",
     "between CTAs"),
    ("cp.async.bulk.prefetch.L2.global [%rd41], 256;", "prefetch"),
    ("mbarrier.pending_count.b64 %r3, %rd9;", "pending_count"),
    ("mbarrier.arrive.noComplete.shared.b64 %rd9, [%r1], 1;", "noComplete"),
    ("bar.arrive 1, 64;", "bar.sync"),
    ("bar.sync 1, 48;", "multiple of 32"),
    ("fence.proxy.async.shared::cta.global;", "fence.proxy.async"),
])
def test_unsupported_forms_are_refused_by_name(line, why):
    with pytest.raises(ptx.UnsupportedInstruction, match=re.escape(why)):
        _one("  " + line + "\n  ret;\n")
