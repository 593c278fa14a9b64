"""PTX executor self-tests, execution model: SIMT control flow, barriers, warp shuffles,
memory checking, unsupported opcodes and the executed-fact analyses.

Each test is a small hand-written kernel whose expected result is computed here in plain
Python (per thread, scalar), independently of the executor.
"""

from __future__ import annotations

import pytest
import torch
from ptx_harness import GTID_ADDR, TID_ADDR, run_kernel

import ptx_executor as ptx
from ptx_executor import analysis, machine


def _out(n=32, dtype=torch.int32):
    return torch.full((n,), -7, dtype=dtype)


# ------------------------------------------------------------------------------ control flow

DIVERGE = TID_ADDR + """  and.b32 %r2, %r0, 1;
  setp.eq.u32 %p1, %r2, 0;
  @%p1 bra EVEN;
  mul.lo.u32 %r3, %r0, 3;
  bra.uni JOIN;
EVEN:
  add.u32 %r3, %r0, 100;
JOIN:
  add.u32 %r4, %r3, 1;
  shfl.sync.bfly.b32 %r5, %r4, 1, 31, -1;
  st.global.b32 [%rd1], %r5;
  ret;
"""


def test_divergent_branches_reconverge_before_a_full_warp_shuffle():
    out = _out(64)
    res = run_kernel(DIVERGE, {"out": out}, block=(64, 1, 1))
    v = [(t + 100 if t % 2 == 0 else 3 * t) + 1 for t in range(64)]
    assert out.tolist() == [v[t ^ 1] for t in range(64)]
    # issue counts: both warps issue every instruction of both paths once
    lines = [i.text for i in res.entry.instructions]
    assert res.issued[lines.index("mul.lo.u32 %r3, %r0, 3")] == 2
    assert res.issued[lines.index("shfl.sync.bfly.b32 %r5, %r4, 1, 31, -1")] == 2


LOOP = TID_ADDR + """  and.b32 %r2, %r0, 7;
  mov.u32 %r3, 0;
  mov.u32 %r4, 0;
LOOP:
  setp.ge.u32 %p1, %r4, %r2;
  @%p1 bra DONE;
  add.u32 %r3, %r3, %r4;
  add.u32 %r4, %r4, 1;
  bra LOOP;
DONE:
  shfl.sync.bfly.b32 %r5, %r3, 16, 31, -1;
  add.u32 %r6, %r5, %r3;
  st.global.b32 [%rd1], %r6;
  ret;
"""


def test_loops_with_per_thread_trip_counts_reconverge_at_the_exit():
    out = _out()
    run_kernel(LOOP, {"out": out})
    s = [sum(range(t % 8)) for t in range(32)]
    assert out.tolist() == [s[t] + s[t ^ 16] for t in range(32)]


def test_bra_uni_with_a_divergent_condition_is_an_error():
    body = DIVERGE.replace("@%p1 bra EVEN;", "@%p1 bra.uni EVEN;")
    with pytest.raises(ptx.WarpSyncError, match="bra.uni"):
        run_kernel(body, {"out": _out()})


# ------------------------------------------------------------------------------ shared memory, barriers

SHARED_ROTATE = GTID_ADDR + """  mov.u32 %r2, buf;
  shl.b32 %r3, %r0, 2;
  add.u32 %r4, %r2, %r3;
  mul.lo.u32 %r5, %r0, 7;
  st.shared.b32 [%r4], %r5;
  bar.sync 0;
  add.u32 %r6, %r0, 1;
  rem.u32 %r6, %r6, 64;
  shl.b32 %r6, %r6, 2;
  add.u32 %r7, %r2, %r6;
  ld.shared.b32 %r8, [%r7];
  st.global.b32 [%rd1], %r8;
  ret;
"""


@pytest.mark.parametrize("dynamic", [False, True])
def test_shared_memory_and_barrier_across_warps(dynamic):
    decls = ".extern .shared .align 16 .b8 buf[];\n" if dynamic else ".shared .align 16 .b8 buf[256];\n"
    out = _out(128)
    run_kernel(SHARED_ROTATE, {"out": out}, grid=(2, 1, 1), block=(64, 1, 1), decls=decls,
               dynamic_smem=256 if dynamic else 0)
    want = [((t + 1) % 64) * 7 for t in range(64)]
    assert out.tolist() == want + want, "each CTA has its own shared memory"


def test_shared_access_outside_the_allocation_faults():
    decls = ".shared .align 16 .b8 buf[128];\n"  # 32 words, but 64 threads store
    with pytest.raises(ptx.MemoryFault, match=r"shared access.*outside") as e:
        run_kernel(SHARED_ROTATE, {"out": _out(64)}, block=(64, 1, 1), decls=decls)
    assert e.value.thread == (32, 0, 0) and e.value.cta == (0, 0, 0)


def test_barrier_that_part_of_the_cta_never_reaches_is_an_error():
    body = TID_ADDR + """  setp.ge.u32 %p1, %r0, 40;
  @%p1 bra OUT;
  bar.sync 0;
  st.global.b32 [%rd1], %r0;
OUT:
  ret;
"""
    with pytest.raises(ptx.BarrierError, match="never reach this barrier") as e:
        run_kernel(body, {"out": _out(64)}, block=(64, 1, 1))
    assert e.value.line > 0 and "bar.sync" in e.value.instruction


def test_a_warp_split_across_two_barrier_instructions_is_an_error():
    body = TID_ADDR + """  and.b32 %r2, %r0, 1;
  setp.eq.u32 %p1, %r2, 0;
  @%p1 bra A;
  bar.sync 0;
  bra.uni END;
A:
  bar.sync 0;
END:
  st.global.b32 [%rd1], %r0;
  ret;
"""
    with pytest.raises(ptx.BarrierError, match="two different instructions"):
        run_kernel(body, {"out": _out()})


# ------------------------------------------------------------------------------ warp shuffles

def _shfl_model(mode: str, vals: list, b: int, c: int) -> list:
    """PTX ISA shfl.sync pseudo-code, one lane at a time."""
    clamp, seg = c & 31, (c >> 8) & 31
    out = []
    for lane in range(32):
        max_lane = (lane & seg) | (clamp & ~seg)
        min_lane = lane & seg
        j = {"up": lane - b, "down": lane + b, "bfly": lane ^ b, "idx": min_lane | (b & ~seg)}[mode]
        ok = j >= max_lane if mode == "up" else j <= max_lane
        out.append(vals[j if ok else lane])
    return out


@pytest.mark.parametrize("mode,b,c", [("up", 3, 0), ("down", 5, 31), ("bfly", 6, 31), ("idx", 9, 31),
                                      ("down", 1, 0x181f - 0x1800 + 0x1807), ("idx", 2, 0x181F), ("up", 1, 0x1800)])
def test_shfl_sync_modes_with_clamp_and_segment(mode, b, c):
    body = TID_ADDR + f"""  mul.lo.u32 %r2, %r0, 11;
  add.u32 %r2, %r2, 5;
  shfl.sync.{mode}.b32 %r3, %r2, {b}, {c}, -1;
  st.global.b32 [%rd1], %r3;
  ret;
"""
    out = _out()
    run_kernel(body, {"out": out})
    assert out.tolist() == _shfl_model(mode, [11 * t + 5 for t in range(32)], b, c)


def test_shfl_sync_with_lanes_of_its_mask_not_converged_is_an_error():
    body = TID_ADDR + """  setp.lt.u32 %p1, %r0, 16;
  @%p1 bra LOW;
  bra.uni END;
LOW:
  shfl.sync.bfly.b32 %r3, %r0, 1, 31, -1;
  st.global.b32 [%rd1], %r3;
END:
  ret;
"""
    with pytest.raises(ptx.WarpSyncError, match=r"lanes \[16, 17"):
        run_kernel(body, {"out": _out()})
    ok = body.replace("31, -1;", "31, 0xffff;")  # a mask naming exactly the converged lanes is fine
    out = _out()
    run_kernel(ok, {"out": out})
    assert out.tolist()[:16] == [t ^ 1 for t in range(16)] and out.tolist()[16:] == [-7] * 16


def test_vote_and_activemask():
    body = TID_ADDR + """  and.b32 %r2, %r0, 3;
  setp.eq.u32 %p1, %r2, 0;
  vote.sync.ballot.b32 %r3, %p1, -1;
  vote.sync.any.pred %p2, %p1, -1;
  vote.sync.all.pred %p3, %p1, -1;
  selp.b32 %r4, 2, 0, %p2;
  selp.b32 %r5, 1, 0, %p3;
  add.u32 %r4, %r4, %r5;
  @%p1 bra SUB;
  bra.uni END;
SUB:
  activemask.b32 %r6;
  st.global.b32 [%rd1], %r6;
  ret;
END:
  xor.b32 %r3, %r3, %r4;
  st.global.b32 [%rd1], %r3;
  ret;
"""
    out = _out()
    run_kernel(body, {"out": out})
    ballot = sum(1 << t for t in range(32) if t % 4 == 0)
    for t in range(32):
        want = ballot if t % 4 == 0 else ballot ^ 2
        assert out[t].item() & 0xFFFFFFFF == want, t


# ------------------------------------------------------------------------------ global memory checks

READ_AT = TID_ADDR + """  ld.param.u64 %rd2, [p_src];
  mul.wide.u32 %rd3, %r0, {stride};
  add.s64 %rd4, %rd2, %rd3;
  ld.global.{ty} %r5, [%rd4+{off}];
  st.global.b32 [%rd1], %r5;
  ret;
"""


def test_every_access_must_fall_inside_a_tensor_view():
    """A view inside a bigger allocation: the bytes around it are unreachable (guard zones)."""
    backing = torch.arange(100, dtype=torch.int32)
    view = backing[10:42]  # 32 words
    out = _out()
    body = READ_AT.format(stride=4, ty="b32", off=0)
    run_kernel(body, {"out": out, "src": view}, readonly=("src",))
    assert out.tolist() == list(range(10, 42))
    with pytest.raises(ptx.MemoryFault, match="outside every tensor") as e:
        run_kernel(READ_AT.format(stride=4, ty="b32", off=4), {"out": _out(), "src": view}, readonly=("src",))
    f = e.value
    assert (f.cta, f.thread) == ((0, 0, 0), (31, 0, 0))
    assert f.address == view.data_ptr() + 128 and "ld.global.b32" in f.instruction and f.line > 0
    assert "0 bytes past the end of src" in str(f)


def test_misaligned_and_read_only_accesses_fault():
    src = torch.zeros(256, dtype=torch.int32)
    with pytest.raises(ptx.MemoryFault, match="misaligned"):
        run_kernel(READ_AT.format(stride=4, ty="b32", off=2), {"out": _out(), "src": src})
    body = TID_ADDR + "  st.global.b32 [%rd1], %r0;\n  ret;\n"
    out = _out()
    with pytest.raises(ptx.MemoryFault, match="read-only"):
        run_kernel(body, {"out": out}, readonly=("out",))
    assert out.tolist() == [-7] * 32, "a faulting store writes nothing"


def test_vector_accesses_and_local_memory():
    body = TID_ADDR + """  mul.wide.u32 %rd2, %r0, 16;
  ld.param.u64 %rd3, [p_src];
  add.s64 %rd4, %rd3, %rd2;
  ld.global.v4.b32 {%r4, %r5, %r6, %r7}, [%rd4];
  mov.u64 %rd5, depot;
  st.local.v2.b32 [%rd5+8], {%r7, %r6};
  ld.local.b32 %r8, [%rd5+12];
  add.u32 %r9, %r4, %r8;
  st.global.b32 [%rd1], %r9;
  ret;
"""
    decls = ""
    body = body.replace(TID_ADDR, TID_ADDR + "  .local .align 16 .b8 depot[32];\n")
    src = torch.arange(128, dtype=torch.int32)
    out = _out()
    run_kernel(body, {"out": out, "src": src}, decls=decls)
    assert out.tolist() == [4 * t + (4 * t + 2) for t in range(32)]


def test_unsupported_opcodes_are_named_before_anything_runs():
    body = TID_ADDR + "  st.global.b32 [%rd1], %r0;\n  atom.global.add.u32 %r3, [%rd1], 1;\n  ret;\n"
    out = _out()
    with pytest.raises(ptx.UnsupportedInstruction, match=r"atom\.global\.add\.u32"):
        run_kernel(body, {"out": out})
    assert out.tolist() == [-7] * 32
    with pytest.raises(ptx.UnsupportedInstruction, match=r"\.rz"):
        run_kernel(TID_ADDR + "  div.rz.f32 %r3, %r0, %r0;\n  ret;\n", {"out": out})
    with pytest.raises(ptx.PTXSyntaxError, match=r"\.func"):
        ptx.parse_module(".version 8.8\n.target sm_90a\n.address_size 64\n.func f()\n{\n ret;\n}\n")


def test_parameter_structs_follow_the_c_layout():
    t = ptx.parse_llvm_type("!llvm.struct<(ptr<1>, struct<(i32, struct<(i64, i64)>)>)>")
    assert t.size_align() == (32, 8)
    assert [off for _, off in t.leaves()] == [0, 8, 16, 24]
    raw = ptx.pack(t, [0x1122334455667788, -3, 5, 2**40])
    assert raw[:8] == (0x1122334455667788).to_bytes(8, "little") and raw[8:12] == (-3).to_bytes(4, "little", signed=True)
    empty = ptx.parse_llvm_type("!llvm.struct<(ptr<1>, struct<(i32, struct<()>)>)>")
    assert empty.size_align() == (16, 8)


def test_chunked_grids_give_the_same_result(monkeypatch):
    out1, out2 = _out(256), _out(256)
    decls = ".shared .align 16 .b8 buf[256];\n"
    r1 = run_kernel(SHARED_ROTATE, {"out": out1}, grid=(4, 1, 1), block=(64, 1, 1), decls=decls)
    monkeypatch.setattr(machine, "CHUNK_REGISTER_BYTES", 1)
    r2 = run_kernel(SHARED_ROTATE, {"out": out2}, grid=(4, 1, 1), block=(64, 1, 1), decls=decls)
    assert r2.chunks == 4 and r1.chunks == 1
    assert torch.equal(out1, out2) and out1.tolist() == [((t + 1) % 64) * 7 for t in range(64)] * 4
    assert (r1.issued == r2.issued).all()


# ------------------------------------------------------------------------------ analyses

def test_coalescing_counts_sectors_per_warp_request():
    src = torch.zeros(1024, dtype=torch.int32)
    for stride, sectors in ((4, 4), (8, 8), (128, 32)):
        res = run_kernel(READ_AT.format(stride=stride, ty="b32", off=0), {"out": _out(), "src": src})
        co = analysis.coalescing(res)
        loads = [v for v in co.values() if not v["write"]]
        assert loads == [{"requests": 1, "sectors": sectors, "ideal_sectors": 4, "width": 4, "write": False}]


def test_bank_conflicts_follow_the_phase_model():
    decls = ".shared .align 16 .b8 buf[4096];\n"
    for stride, waves in ((4, 1), (8, 2), (128, 32)):
        body = TID_ADDR + f"""  mov.u32 %r2, buf;
  mul.lo.u32 %r3, %r0, {stride};
  add.u32 %r4, %r2, %r3;
  st.shared.b32 [%r4], %r0;
  ret;
"""
        res = run_kernel(body, {"out": _out()}, decls=decls, record_shared=True)
        (st,) = analysis.bank_conflicts(res).values()
        assert st == {"requests": 1, "wavefronts": waves, "ideal": 1}, stride


def test_race_detectors():
    # two CTAs store to the same word: a race between CTAs
    body = TID_ADDR + "  st.global.b32 [%rd1], %r0;\n  ret;\n"
    res = run_kernel(body, {"out": _out()}, grid=(2, 1, 1))
    races = analysis.cta_races(res)
    assert races and races[0][1] == "write/write" and races[0][2] == (0, 1)
    res = run_kernel(body, {"out": _out()})
    assert analysis.cta_races(res) == []
    # a shared word written by one thread and read by another without a barrier
    decls = ".shared .align 16 .b8 buf[512];\n"
    racy = SHARED_ROTATE.replace("  bar.sync 0;\n", "")
    res = run_kernel(racy, {"out": _out(64)}, block=(64, 1, 1), decls=decls, record_shared=True)
    assert analysis.intra_cta_races(res, shared=True)
    res = run_kernel(SHARED_ROTATE, {"out": _out(64)}, block=(64, 1, 1), decls=decls, record_shared=True)
    assert analysis.intra_cta_races(res, shared=True) == []


@pytest.mark.parametrize("batch", [1, 100, 300, 1 << 20])
def test_intra_cta_races_are_the_same_in_batches_of_whole_ctas(batch, monkeypatch):
    """The shared-memory race analysis runs a batch of whole CTAs at a time (bounded memory for
    big launches): the same races, in CTA order, whatever the batch size (one CTA: 128 accesses)."""
    decls = ".shared .align 16 .b8 buf[512];\n"
    racy = SHARED_ROTATE.replace("  bar.sync 0;\n", "")
    res = run_kernel(racy, {"out": _out(64 * 5)}, grid=(5, 1, 1), block=(64, 1, 1), decls=decls,
                     record_shared=True)
    whole = analysis.intra_cta_races(res, shared=True)
    assert len(whole) == 10 and [cta for _, cta, _ in whole] == sorted(cta for _, cta, _ in whole)
    monkeypatch.setattr(analysis, "RACE_BATCH_ACCESSES", batch)
    assert analysis.intra_cta_races(res, shared=True) == whole


def test_bytes_touched_per_region():
    src = torch.zeros(256, dtype=torch.int32)
    mem_out = _out()
    res = run_kernel(READ_AT.format(stride=8, ty="b32", off=0), {"out": mem_out, "src": src})
    mem = ptx.GlobalMemory()
    mem.add("out", mem_out)
    mem.add("src", src)
    assert analysis.bytes_touched(res, mem) == {"out": {"read": 0, "written": 128}, "src": {"read": 128, "written": 0}}

