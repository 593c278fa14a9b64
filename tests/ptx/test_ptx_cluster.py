"""The cluster barrier in the PTX executor: ``barrier.cluster.arrive`` / ``wait`` over the CTAs of a cluster,
its deadlocks, its special registers, and the race detector that knows what it orders.

The kernels are the step's pattern at its smallest: the CTAs of one cluster each read a shared row
(Bstate's part) and use it, and CTA 0 then overwrites the row. Each mistake a kernel can make with the
barrier is planted once and the executor must report it. The executor runs the CTAs of a chunk in
lockstep, so a racy kernel's *values* still come out right here (the reads run before the write for every
CTA): only the race detector, which knows what the barrier orders, catches it, and the tests check both.
"""

from __future__ import annotations

import pytest
import torch
from ptx_harness import run_kernel

import ptx_executor as ptx
from ptx_executor import analysis

CTAS = 4
WORDS = 32  # one word of the row per thread

# %r0 tid, %r1 ctaid.z; %rd1 = &row[tid]; %rd3 = &out[ctaid.z * 32 + tid]
_ADDRESSES = """  mov.u32 %r0, %tid.x;
  mov.u32 %r1, %ctaid.z;
  mul.wide.u32 %rd0, %r0, 4;
  add.s64 %rd1, %rd40, %rd0;
  mad.lo.u32 %r2, %r1, 32, %r0;
  mul.wide.u32 %rd2, %r2, 4;
  add.s64 %rd3, %rd41, %rd2;
"""
_READ = """  ld.global.b32 %r3, [%rd1];
  add.u32 %r4, %r3, %r1;
  st.global.b32 [%rd3], %r4;
"""
_WRITE_BY_CTA0 = """  setp.ne.u32 %p1, %r1, 0;
  @%p1 bra DONE;
  add.u32 %r5, %r3, 100;
  st.global.b32 [%rd1], %r5;
DONE:
  ret;
"""
ORDERED = _ADDRESSES + _READ + "  barrier.cluster.arrive;\n  barrier.cluster.wait;\n" + _WRITE_BY_CTA0


def _run(body, cluster=(1, 1, CTAS), grid=(1, 1, CTAS)):
    row = torch.arange(1000, 1000 + WORDS, dtype=torch.int32)
    out = torch.full((grid[2] * WORDS,), -7, dtype=torch.int32)
    res = run_kernel(body, {"row": row, "out": out}, grid=grid, cluster=cluster)
    return res, row, out


def _expected_out(ctas=CTAS):
    return torch.tensor([1000 + t + z for z in range(ctas) for t in range(WORDS)], dtype=torch.int32)


def test_the_barrier_orders_every_ctas_read_before_the_overwrite():
    res, row, out = _run(ORDERED)
    assert torch.equal(out, _expected_out())
    assert torch.equal(row, torch.arange(1100, 1100 + WORDS, dtype=torch.int32))
    assert analysis.cta_races(res) == []


def test_the_arrival_may_come_long_before_the_wait():
    body = _ADDRESSES + _READ + "  barrier.cluster.arrive.release.aligned;\n  add.u32 %r9, %r4, 1;\n" \
        "  barrier.cluster.wait.acquire.aligned;\n" + _WRITE_BY_CTA0
    res, _, out = _run(body)
    assert torch.equal(out, _expected_out()) and analysis.cta_races(res) == []


@pytest.mark.parametrize("mistake, body", [
    ("no barrier", _ADDRESSES + _READ + _WRITE_BY_CTA0),
    ("a relaxed arrival orders nothing", ORDERED.replace("barrier.cluster.arrive;", "barrier.cluster.arrive.relaxed;")),
    ("the read after the arrival", _ADDRESSES + "  barrier.cluster.arrive;\n" + _READ + "  barrier.cluster.wait;\n"
     + _WRITE_BY_CTA0),
])
def test_a_write_the_barrier_does_not_order_is_a_race(mistake, body):
    res, _, out = _run(body)
    assert torch.equal(out, _expected_out()), "lockstep execution: the values alone cannot show the race"
    races = analysis.cta_races(res)
    assert races, mistake
    assert {r[1] for r in races} == {"write/read"} and all(0 in r[2] for r in races), races


def test_ctas_of_different_clusters_are_never_ordered_by_it():
    # clusters of 2: CTA 0's write is ordered after CTA 1's read, not after CTA 2's or 3's
    races = analysis.cta_races(_run(ORDERED, cluster=(1, 1, 2))[0])
    assert races and {r[2] for r in races} <= {(0, 2), (0, 3), (2, 0), (3, 0)}, races


def test_a_cta_that_never_arrives_deadlocks():
    body = ORDERED.replace("  barrier.cluster.arrive;\n", "  setp.eq.u32 %p2, %r1, 2;\n  @%p2 bra SKIP;\n"
                           "  barrier.cluster.arrive;\nSKIP:\n")
    with pytest.raises(ptx.BarrierError, match="barrier.cluster .*never arrive"):
        _run(body)


def test_exited_threads_do_not_hold_the_barrier_up():
    # CTA 3 leaves before it reads: the others' waits still complete, and nothing of it races
    body = ORDERED.replace(_READ, "  setp.eq.u32 %p2, %r1, 3;\n  @%p2 bra DONE;\n" + _READ)
    res, row, out = _run(body)
    assert torch.equal(row, torch.arange(1100, 1100 + WORDS, dtype=torch.int32))
    assert torch.equal(out[:3 * WORDS], _expected_out(3)) and (out[3 * WORDS:] == -7).all()
    assert analysis.cta_races(res) == []
    # leaving after the read but before the arrival: that read is ordered before nothing
    body = ORDERED.replace("  barrier.cluster.arrive;\n", "  setp.eq.u32 %p2, %r1, 3;\n  @%p2 bra DONE;\n"
                           "  barrier.cluster.arrive;\n")
    races = analysis.cta_races(_run(body)[0])
    assert races and {r[2] for r in races} == {(0, 3)}, races


def test_arriving_twice_without_a_wait_is_an_error():
    body = ORDERED.replace("barrier.cluster.arrive;\n", "barrier.cluster.arrive;\n  barrier.cluster.arrive;\n")
    with pytest.raises(ptx.BarrierError, match="again before it waited"):
        _run(body)


def test_the_cluster_must_divide_the_grid():
    with pytest.raises(ptx.PTXError, match="must divide the grid"):
        _run(ORDERED, cluster=(1, 1, 3))


def test_cluster_special_registers_follow_the_launch():
    body = """  mov.u32 %r0, %tid.x;
  mov.u32 %r1, %ctaid.z;
  mul.wide.u32 %rd0, %r1, 16;
  add.s64 %rd1, %rd40, %rd0;
  setp.ne.u32 %p1, %r0, 0;
  @%p1 bra DONE;
  mov.u32 %r2, %cluster_ctarank;
  mov.u32 %r3, %clusterid.z;
  mov.u32 %r4, %cluster_nctarank;
  mov.u32 %r5, %nclusterid.z;
  st.global.v4.b32 [%rd1], {%r2, %r3, %r4, %r5};
DONE:
  ret;
"""
    out = torch.full((8 * 4,), -7, dtype=torch.int32)
    run_kernel(body, {"out": out}, grid=(1, 1, 8), cluster=(1, 1, 4))
    assert out.view(8, 4).tolist() == [[z % 4, z // 4, 4, 2] for z in range(8)]
    # without a cluster each CTA is a cluster of one
    run_kernel(body, {"out": out}, grid=(1, 1, 8))
    assert out.view(8, 4).tolist() == [[0, z, 1, 8] for z in range(8)]


def test_a_chunk_holds_whole_clusters(monkeypatch):
    from ptx_executor import machine
    monkeypatch.setattr(machine, "CHUNK_REGISTER_BYTES", 1)  # one CTA a chunk without a cluster
    res, row, out = _run(ORDERED, grid=(1, 1, 2 * CTAS))  # two clusters, one a chunk: no deadlock
    assert res.chunks == 2 and torch.equal(out[:CTAS * WORDS], _expected_out())
    # the second cluster (no writer of its own) ran after the first one's overwrite: chunks run in order
    assert torch.equal(out[CTAS * WORDS:], _expected_out(2 * CTAS)[CTAS * WORDS:] + 100)
