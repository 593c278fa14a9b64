"""Hand-written PTX of a bulk-copy ring for the executor's self-tests (test_ptx_bulk*.py).

Warp 0's lane 0 is the producer: for each row ``i`` it waits on stage ``s = i % S``'s *empty*
mbarrier (parity ``(i / S & 1) ^ 1``: the first round passes at once), arms the stage's *full*
mbarrier with ``arrive.expect_tx`` of the row's 256 bytes and issues a bulk copy of row ``i`` of
``src`` into the stage. Warps 1 and 2 are the consumers (64 threads, one float each): they wait
on the full mbarrier (parity ``i / S & 1``), read their float, pass a named barrier of the 64
consumer threads, release the stage with one arrive per warp (the empty mbarriers count 2), and
write ``2 * x`` to row ``i`` of ``out``: by ``st.global``, or (``s2g``) through a shared row that
every consumer writes, fences with ``fence.proxy.async`` and the first consumer stores with a bulk
copy, waiting on its bulk group before the consumers may write the row again.

The instruction lines are spelled as the DSL emits them; tests plant mistakes by replacing the
named fragments below.
"""

from __future__ import annotations

import torch
from ptx_harness import kernel_ptx, ptr_param

import ptx_executor as ptx

ROW = 64  # floats per row (256 bytes)

FULL_WAIT = """CWAIT:
  mbarrier.try_wait.parity.shared::cta.b64 %p3, [%r15], %r13, 10000000;
  @!%p3 bra CWAIT;
"""
EMPTY_WAIT = """PWAIT:
  mbarrier.try_wait.parity.shared::cta.b64 %p3, [%r16], %r13;
  @!%p3 bra.uni PWAIT;
"""
RELEASE = "  mbarrier.arrive.release.cta.shared::cta.b64 _, [%r16];\n"
FENCE = "  fence.proxy.async.shared::cta;\n"
STORE = "  cp.async.bulk.global.shared::cta.bulk_group [%rd5], [%r25], 256;\n"
COMMIT = "  cp.async.bulk.commit_group;\n"
WAIT_READ = "  cp.async.bulk.wait_group.read 0;\n"
ST_RESULT = "  st.shared.b32 [%r24], %r23;\n"


def _init(stages: int, empty_count: int) -> str:
    lines = [f"  mbarrier.init.shared::cta.b64 [%r1+{8 * s}], 1;\n" for s in range(stages)]
    lines += [f"  mbarrier.init.shared.b64 [%r1+{8 * (stages + s)}], {empty_count};\n" for s in range(stages)]
    return "".join(lines)


def _stage(stages: int) -> str:
    """%r11 = s, %r12 = round, %r15 = full[s], %r16 = empty[s], %r18 = the stage's shared row."""
    return f"""  rem.u32 %r11, %r10, {stages};
  div.u32 %r12, %r10, {stages};
  shl.b32 %r14, %r11, 3;
  add.u32 %r15, %r1, %r14;
  add.u32 %r16, %r15, {8 * stages};
  shl.b32 %r17, %r11, 8;
  add.u32 %r18, %r2, %r17;
"""


def _consume(s2g: bool) -> str:
    if not s2g:
        return """  mul.lo.u32 %r26, %r10, 64;
  add.u32 %r26, %r26, %r20;
  mul.wide.u32 %rd4, %r26, 4;
  add.s64 %rd4, %rd40, %rd4;
  st.global.b32 [%rd4], %r23;
"""
    return ("  mov.u32 %r25, res;\n  shl.b32 %r24, %r20, 2;\n  add.u32 %r24, %r25, %r24;\n" + ST_RESULT + FENCE
            + "  bar.sync 1, 64;\n  setp.ne.u32 %p6, %r20, 0;\n  @%p6 bra SKIP;\n"
            + "  mul.wide.u32 %rd5, %r10, 256;\n  add.s64 %rd5, %rd40, %rd5;\n"
            + STORE + COMMIT + WAIT_READ + "SKIP:\n  bar.sync 1, 64;\n")


def ring_body(stages: int = 2, rows: int = 5, *, s2g: bool = False, empty_count: int = 2) -> str:
    return f"""  mov.u32 %r0, %tid.x;
  mov.u32 %r1, bars;
  mov.u32 %r2, ring;
  setp.ne.u32 %p1, %r0, 0;
  @%p1 bra INITED;
{_init(stages, empty_count)}INITED:
  fence.mbarrier_init.release.cluster;
  bar.sync 0;
  setp.ge.u32 %p2, %r0, 32;
  @%p2 bra CONSUMER;
  @%p1 bra DONE;
  mov.u32 %r10, 0;
PLOOP:
{_stage(stages)}  and.b32 %r13, %r12, 1;
  xor.b32 %r13, %r13, 1;
{EMPTY_WAIT}  mbarrier.arrive.expect_tx.shared::cta.b64 %rd9, [%r15], 256;
  mul.wide.u32 %rd2, %r10, 256;
  add.s64 %rd3, %rd41, %rd2;
  cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r18], [%rd3], 256, [%r15];
  add.u32 %r10, %r10, 1;
  setp.lt.u32 %p4, %r10, {rows};
  @%p4 bra PLOOP;
  bra.uni DONE;
CONSUMER:
  sub.u32 %r20, %r0, 32;
  and.b32 %r21, %r0, 31;
  mov.u32 %r10, 0;
CLOOP:
{_stage(stages)}  and.b32 %r13, %r12, 1;
{FULL_WAIT}  shl.b32 %r19, %r20, 2;
  add.u32 %r19, %r18, %r19;
  ld.shared.b32 %r22, [%r19];
  add.f32 %r23, %r22, %r22;
  bar.sync 1, 64;
  setp.ne.u32 %p5, %r21, 0;
  @%p5 bra NOARRIVE;
{RELEASE}NOARRIVE:
{_consume(s2g)}  add.u32 %r10, %r10, 1;
  setp.lt.u32 %p4, %r10, {rows};
  @%p4 bra CLOOP;
DONE:
  ret;
"""


def decls(stages: int) -> str:
    return (f".shared .align 16 .b8 ring[{256 * stages}];\n.shared .align 8 .b8 bars[{16 * stages}];\n"
            ".shared .align 16 .b8 res[256];\n")


def run_ring(body: str, stages: int, rows: int, *, async_copies: str = "modelled", src=None):
    """``(out, src, result)`` of one CTA of 96 threads running ``body``."""
    src = torch.randn(rows, ROW) if src is None else src
    out = torch.full((rows, ROW), -7.0)
    mem = ptx.GlobalMemory()
    mem.add("out", out)
    mem.add("src", src, writable=False)
    res = ptx.run(kernel_ptx(body, ("out", "src"), decls(stages)), grid=(1, 1, 1), block=(96, 1, 1),
                  params=[ptr_param(out), ptr_param(src)], memory=mem, async_copies=async_copies)
    return out, src, res
