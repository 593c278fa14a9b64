"""PTX executor self-tests, asynchronous copies: ``cp.async`` with its groups and waits
(ptx_executor/isa_async.py, docs/ptx-tier.md "Asynchronous copies").

Each kernel is hand-written PTX; expected data is computed here in plain Python from the
source words. The planted mistakes each raise :class:`ptx_executor.AsyncCopyError` with the
model on, and each runs without an error with ``async_copies="immediate"`` (every copy lands
when issued): the model is what finds them.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from ptx_harness import kernel_ptx, ptr_param

import ptx_executor as ptx
from ptx_executor import analysis, isa_async, machine

READ_EARLY = re.escape(isa_async.READ_BEFORE_LANDED)
WRITE_FILLING = re.escape(isa_async.WRITE_WHILE_FILLING)
SOURCE_WRITTEN = re.escape(isa_async.SOURCE_OVERWRITTEN)
EXIT_PENDING = re.escape(isa_async.EXIT_IN_FLIGHT)


def _words(n, seed=1):
    rng = random.Random(seed)
    return [rng.randrange(-2**31, 2**31) for _ in range(n)]


def run_kernel(body, tensors, *, grid=(1, 1, 1), block=(32, 1, 1), decls="", readonly=(), record_shared=False,
               async_copies="modelled"):
    """``ptx_harness.run_kernel`` with the ``async_copies`` switch."""
    mem = ptx.GlobalMemory()
    for name, t in tensors.items():
        mem.add(name, t, writable=name not in readonly)
    return ptx.run(kernel_ptx(body, tuple(tensors), decls), grid=grid, block=block,
                   params=[ptr_param(t) for t in tensors.values()], memory=mem, record_shared=record_shared,
                   async_copies=async_copies)


def _out(n):
    return torch.full((n,), -7, dtype=torch.int32)


def _neighbour_slices(src, nt, n_cta, words):
    """Thread t of CTA c gets the ``words``-word slice of thread (t + 1) % nt of its CTA."""
    out = []
    for c in range(n_cta):
        for t in range(nt):
            n = c * nt + (t + 1) % nt
            out += src[n * words:(n + 1) * words]
    return out


# ------------------------------------------------------------------------------ one group, 16 bytes a thread

# Thread t (global index g) copies 16 bytes of src at 16 g into buf[16 t], waits, passes the
# barrier and stores its neighbour's slice to out at 16 g. The three cp.async lines are
# spelled exactly as the DSL emits them.
STAGE = """  mov.u32 %r0, %tid.x;
  mov.u32 %r30, %ctaid.x;
  mov.u32 %r29, %ntid.x;
  mad.lo.u32 %r31, %r30, %r29, %r0;
  mul.wide.u32 %rd0, %r31, 16;
  add.s64 %rd1, %rd40, %rd0;
  add.s64 %rd4, %rd41, %rd0;
  mov.u32 %r2, buf;
  shl.b32 %r3, %r0, 4;
  add.u32 %r6, %r2, %r3;
	cp.async.cg.shared.global [%r6], [%rd4], 16, 16;
	cp.async.commit_group;
	cp.async.wait_group 	0;
  bar.sync 0;
  add.u32 %r7, %r0, 1;
  rem.u32 %r7, %r7, %r29;
  shl.b32 %r7, %r7, 4;
  add.u32 %r8, %r2, %r7;
  ld.shared.v4.b32 {%r10, %r11, %r12, %r13}, [%r8];
  st.global.v4.b32 [%rd1], {%r10, %r11, %r12, %r13};
  ret;
"""
BUF = ".shared .align 16 .b8 buf[1024];\n"
COPY = "\tcp.async.cg.shared.global [%r6], [%rd4], 16, 16;\n"
COMMIT = "\tcp.async.commit_group;\n"
WAIT0 = "\tcp.async.wait_group \t0;\n"
READ = "  ld.shared.v4.b32 {%r10, %r11, %r12, %r13}, [%r8];\n"


def _stage(body=STAGE, *, grid=1, block=64, src=None, readonly=("src",), **kw):
    src = src if src is not None else torch.tensor(_words(grid * block * 4), dtype=torch.int32)
    out = _out(grid * block * 4)
    res = run_kernel(body, {"out": out, "src": src}, grid=(grid, 1, 1), block=(block, 1, 1), decls=BUF,
                     readonly=readonly, **kw)
    return out, src, res


@pytest.mark.parametrize("grid,block", [(1, 32), (2, 64), (3, 48)])
def test_staging_kernel_gives_every_thread_its_neighbours_slice(grid, block):
    out, src, res = _stage(grid=grid, block=block, record_shared=True)
    assert out.tolist() == _neighbour_slices(src.tolist(), block, grid, 4)
    assert analysis.intra_cta_races(res, shared=True) == []
    assert analysis.intra_cta_races(res) == [] and analysis.cta_races(res) == []


def test_the_copy_is_a_logged_global_read_and_a_shared_write_of_the_issuing_thread():
    out, src, res = _stage(grid=2, block=64, record_shared=True)
    lines = [i.text for i in res.entry.instructions]
    cp_line = res.entry.instructions[lines.index(COPY.strip().rstrip(";"))].line
    mem = ptx.GlobalMemory()
    mem.add("out", out)
    mem.add("src", src)
    assert analysis.bytes_touched(res, mem) == {"out": {"read": 0, "written": 2048},
                                                "src": {"read": 2048, "written": 0}}
    # a request per warp (2 CTAs x 2 warps), each 32 x 16 contiguous bytes: 16 sectors, the minimum
    assert analysis.coalescing(res)[cp_line] == {"requests": 4, "sectors": 64, "ideal_sectors": 64, "width": 16,
                                                  "write": False}
    sh = res.shared_log.arrays()
    mine = sh["instr"] == cp_line
    assert sh["write"][mine].all() and sorted(sh["thread"][mine].tolist()) == list(range(128))
    assert (sh["epoch"][mine] == 0).all() and (sh["width"][mine] == 16).all()
    t = sh["thread"][mine]
    assert (sh["addr"][mine] == 1024 + 16 * (t % 64)).all()
    mix = analysis.instruction_mix(res)
    assert analysis.classify("cp.async.cg.shared.global") == "global"
    assert analysis.classify("cp.async.commit_group") == analysis.classify("cp.async.wait_group") == "other"
    assert mix["global"] == 4 * 2  # per warp: the cp.async and the st.global
    assert mix["shared"] == 4  # the ld.shared


def test_chunked_grids_give_the_same_result(monkeypatch):
    out1, src, _ = _stage(grid=4, block=64)
    monkeypatch.setattr(machine, "CHUNK_REGISTER_BYTES", 1)
    out2, _, res = _stage(grid=4, block=64, src=src)
    assert res.chunks == 4 and torch.equal(out1, out2)
    assert out2.tolist() == _neighbour_slices(src.tolist(), 64, 4, 4)


def test_a_predicated_copy_issues_only_for_its_threads():
    body = STAGE.replace(COPY, "  and.b32 %r20, %r0, 1;\n  setp.eq.u32 %p1, %r20, 0;\n  @%p1 " + COPY.strip() + "\n")
    out, src, _ = _stage(body, block=32)
    s = src.tolist()
    want = []
    for t in range(32):
        n = (t + 1) % 32
        want += s[4 * n:4 * n + 4] if n % 2 == 0 else [0, 0, 0, 0]  # shared memory starts zeroed
    assert out.tolist() == want


# ------------------------------------------------------------------------------ zero fill, cp-sizes 4 and 8

# every thread first fills its slice with -1, so zero-filled bytes are visible
PREFILL = """  mov.u32 %r21, -1;
  st.shared.v4.b32 [%r6], {%r21, %r21, %r21, %r21};
"""


@pytest.mark.parametrize("src_size", [0, 8, 16, "reg"])
def test_bytes_past_src_size_are_zero_filled(src_size):
    if src_size == "reg":  # per thread: (t % 3) * 4 bytes, from a register
        size_op = "%r22"
        setup = "  rem.u32 %r22, %r0, 3;\n  shl.b32 %r22, %r22, 2;\n"
    else:
        size_op, setup = str(src_size), ""
    body = STAGE.replace(COPY, PREFILL + setup + f"  cp.async.cg.shared.global [%r6], [%rd4], 16, {size_op};\n")
    out, src, _ = _stage(body, block=32)
    s = src.tolist()
    want = []
    for t in range(32):
        n = (t + 1) % 32
        k = (n % 3) if src_size == "reg" else src_size // 4
        want += s[4 * n:4 * n + k] + [0] * (4 - k)
    assert out.tolist() == want


def test_src_size_zero_reads_nothing_so_its_source_is_not_checked():
    """src-size 0 (a masked-off element) reads no byte: its address may lie outside every tensor."""
    body = STAGE.replace(COPY, PREFILL + "  add.s64 %rd5, %rd4, 4096;\n"
                         "  cp.async.cg.shared.global [%r6], [%rd5], 16, 0;\n")
    out, _, res = _stage(body, block=32)
    assert out.tolist() == [0] * 128
    cp_lines = {i.line for i in res.entry.instructions if i.opcode.startswith("cp.async.cg")}
    log = res.log.arrays()
    assert not (set(log["instr"].tolist()) & cp_lines), "nothing read, nothing logged"


def test_src_size_larger_than_cp_size_is_an_error():
    body = STAGE.replace(COPY, "  cp.async.cg.shared.global [%r6], [%rd4], 16, 20;\n")
    with pytest.raises(ptx.AsyncCopyError, match="src-size 20 is larger than the cp-size 16"):
        _stage(body, block=32)


@pytest.mark.parametrize("size", [4, 8])
def test_ca_copies_of_4_and_8_bytes(size):
    words = size // 4
    vec = "" if words == 1 else ".v2"
    regs = "%r10" if words == 1 else "{%r10, %r11}"
    body = f"""  mov.u32 %r0, %tid.x;
  mul.wide.u32 %rd0, %r0, {size};
  add.s64 %rd1, %rd40, %rd0;
  add.s64 %rd4, %rd41, %rd0;
  mov.u32 %r2, buf;
  mul.lo.u32 %r3, %r0, {size};
  add.u32 %r6, %r2, %r3;
  cp.async.ca.shared.global.L2::128B [%r6], [%rd4], {size};
  cp.async.wait_all;
  bar.sync 0;
  add.u32 %r7, %r0, 1;
  and.b32 %r7, %r7, 31;
  mul.lo.u32 %r7, %r7, {size};
  add.u32 %r8, %r2, %r7;
  ld.shared{vec}.b32 {regs}, [%r8];
  st.global{vec}.b32 [%rd1], {regs};
  ret;
"""
    src = torch.tensor(_words(32 * words, seed=size), dtype=torch.int32)
    out = _out(32 * words)
    run_kernel(body, {"out": out, "src": src}, decls=BUF, readonly=("src",))
    assert out.tolist() == _neighbour_slices(src.tolist(), 32, 1, words)


def test_shared_cta_spelling_and_a_misaligned_destination():
    body = STAGE.replace(COPY, "  cp.async.cg.shared::cta.global [%r6], [%rd4], 16;\n")
    out, src, _ = _stage(body, block=32)
    assert out.tolist() == _neighbour_slices(src.tolist(), 32, 1, 4)
    with pytest.raises(ptx.MemoryFault, match="misaligned"):
        _stage(STAGE.replace(COPY, "  cp.async.cg.shared.global [%r6+8], [%rd4], 16;\n"), block=32)


# ------------------------------------------------------------------------------ two groups

TWO = """  mov.u32 %r0, %tid.x;
  mul.wide.u32 %rd0, %r0, 16;
  add.s64 %rd1, %rd40, %rd0;
  add.s64 %rd2, %rd41, %rd0;
  mov.u32 %r2, bufA;
  mov.u32 %r3, bufB;
  shl.b32 %r4, %r0, 4;
  add.u32 %r5, %r2, %r4;
  add.u32 %r6, %r3, %r4;
  cp.async.cg.shared.global [%r5], [%rd2], 16;
  cp.async.commit_group;
  cp.async.cg.shared.global [%r6], [%rd2+512], 16;
  cp.async.commit_group;
  cp.async.wait_group 1;
  bar.sync 0;
  add.u32 %r7, %r0, 1;
  and.b32 %r7, %r7, 31;
  shl.b32 %r7, %r7, 4;
  add.u32 %r8, %r2, %r7;
  add.u32 %r9, %r3, %r7;
  ld.shared.v4.b32 {%r10, %r11, %r12, %r13}, [%r8];
  st.global.v4.b32 [%rd1], {%r10, %r11, %r12, %r13};
  cp.async.wait_group 0;
  bar.sync 0;
  ld.shared.v4.b32 {%r14, %r15, %r16, %r17}, [%r9];
  st.global.v4.b32 [%rd1+512], {%r14, %r15, %r16, %r17};
  ret;
"""
TWO_BUFS = ".shared .align 16 .b8 bufA[512];\n.shared .align 16 .b8 bufB[512];\n"


def _two(body=TWO, **kw):
    src = torch.tensor(_words(256, seed=2), dtype=torch.int32)
    out = _out(256)
    res = run_kernel(body, {"out": out, "src": src}, decls=TWO_BUFS, readonly=("src",), **kw)
    return out, src, res


def _two_expected(src):
    s = src.tolist()
    return _neighbour_slices(s[:128], 32, 1, 4) + _neighbour_slices(s[128:], 32, 1, 4)


def test_two_groups_wait_group_1_completes_the_older_one():
    out, src, res = _two(record_shared=True)
    assert out.tolist() == _two_expected(src)
    assert analysis.intra_cta_races(res, shared=True) == []


def test_empty_groups_count_in_wait_group():
    """A commit with no copy is an empty group: after it, wait_group 1 completes the group before."""
    body = TWO.replace("""  cp.async.wait_group 1;
  bar.sync 0;""", """  cp.async.commit_group;
  cp.async.wait_group 1;
  bar.sync 0;
  ld.shared.v4.b32 {%r18, %r19, %r20, %r21}, [%r6];""")  # the newest copy's own bytes: also complete
    out, src, _ = _two(body)
    assert out.tolist() == _two_expected(src)


# ------------------------------------------------------------------------------ planted mistakes

def _both_modes(run, error, match):
    """``run(async_copies)`` raises ``error`` matching ``match`` with the model, nothing without it."""
    with pytest.raises(error, match=match) as e:
        run("modelled")
    run("immediate")
    return e.value


def test_a_read_before_the_wait():
    body = STAGE.replace(WAIT0, "").replace(READ, READ + WAIT0)  # the wait after the read
    err = _both_modes(lambda m: _stage(body, block=32, async_copies=m), ptx.AsyncCopyError, READ_EARLY)
    assert "ld.shared.v4.b32" in err.instruction and err.cta == (0, 0, 0) and err.thread == (0, 0, 0)
    assert err.address == 1024 + 16 and "by thread (1, 0, 0)" in str(err)
    out, src, _ = _stage(body, block=32, async_copies="immediate")
    assert out.tolist() == _neighbour_slices(src.tolist(), 32, 1, 4), "without the model the mistake is invisible"


def test_a_generic_load_into_the_shared_window_before_the_wait():
    generic = "  cvt.u64.u32 %rd6, %r8;\n  cvta.shared.u64 %rd7, %rd6;\n  ld.v4.b32 {%r10, %r11, %r12, %r13}, [%rd7];\n"
    body = STAGE.replace(WAIT0, "").replace(READ, generic + WAIT0)
    err = _both_modes(lambda m: _stage(body, block=32, async_copies=m), ptx.AsyncCopyError, READ_EARLY)
    assert err.instruction.startswith("ld.v4.b32")


def test_b_wait_group_1_then_reading_the_newest_group():
    body = TWO.replace("[%r8];\n  st.global.v4.b32 [%rd1], ", "[%r9];\n  st.global.v4.b32 [%rd1], ")
    err = _both_modes(lambda m: _two(body, async_copies=m), ptx.AsyncCopyError, READ_EARLY)
    assert "[%r9]" in err.instruction and err.address == 1024 + 512 + 16


def test_c_a_store_into_a_stage_still_in_flight():
    body = STAGE.replace(COMMIT, COMMIT + "  st.shared.b32 [%r6+4], %r0;\n")
    err = _both_modes(lambda m: _stage(body, block=32, async_copies=m), ptx.AsyncCopyError, WRITE_FILLING)
    assert err.address == 1024 + 4 and err.instruction.startswith("st.shared.b32")


def test_another_copy_into_bytes_a_copy_still_fills():
    body = STAGE.replace(COMMIT, COMMIT + COPY)
    _both_modes(lambda m: _stage(body, block=32, async_copies=m), ptx.AsyncCopyError, WRITE_FILLING)
    # every thread of one instruction copying into the same 16 bytes
    same = STAGE.replace(COPY, "  cp.async.cg.shared.global [%r2], [%rd4], 16;\n")
    with pytest.raises(ptx.AsyncCopyError, match=WRITE_FILLING + ".*same instruction") as e:
        _stage(same, block=32)
    assert e.value.thread == (1, 0, 0) and e.value.address == 1024


def test_d_a_global_store_to_a_copys_source_before_the_wait():
    body = STAGE.replace(COMMIT, COMMIT + "  st.global.b32 [%rd4+12], %r0;\n")
    err = _both_modes(lambda m: _stage(body, block=32, readonly=(), async_copies=m), ptx.AsyncCopyError,
                      SOURCE_WRITTEN)
    assert err.instruction.startswith("st.global.b32") and err.thread == (0, 0, 0)
    # after the wait the source may be reused
    out, src, _ = _stage(STAGE.replace(WAIT0, WAIT0 + "  st.global.b32 [%rd4+12], %r0;\n"), block=32, readonly=())
    assert out.tolist() == _neighbour_slices(_words(128), 32, 1, 4) and src.tolist()[3::4] == list(range(32))
    # a store next to a source, not into it, is fine
    _stage(STAGE.replace(COMMIT, COMMIT + "  st.global.b32 [%rd1], %r0;\n"), block=32, readonly=())


@pytest.mark.parametrize("how", ["committed", "uncommitted", "fall off the end", "exit"])
def test_e_a_thread_exiting_with_a_copy_in_flight(how):
    tail = STAGE[STAGE.index(WAIT0):]
    body = STAGE.replace(tail, "  ret;\n")
    if how == "uncommitted":
        body = body.replace(COMMIT, "")
    elif how == "fall off the end":
        body = body.replace("  ret;\n", "")
    elif how == "exit":  # only the odd threads leave early, the even ones wait first
        body = body.replace("  ret;\n", "  and.b32 %r20, %r0, 1;\n  setp.eq.u32 %p1, %r20, 1;\n  @%p1 exit;\n"
                            + WAIT0 + "  ret;\n")
    err = _both_modes(lambda m: _stage(body, block=32, async_copies=m), ptx.AsyncCopyError, EXIT_PENDING)
    assert err.thread == ((1, 0, 0) if how == "exit" else (0, 0, 0))
    assert ("running past" in str(err)) == (how == "fall off the end")


def test_f_reading_a_neighbours_slice_before_the_barrier_is_a_race():
    """The executor runs the CTA's threads at one wait together, so every copy has landed when
    the neighbour's slice is read: no AsyncCopyError, but the landed write (logged as the
    issuing thread's, in the barrier epoch of its wait) and the read are a race in that epoch."""
    body = STAGE.replace("  bar.sync 0;\n", "")
    for mode in ("modelled", "immediate"):
        out, src, res = _stage(body, block=64, async_copies=mode, record_shared=True)
        races = analysis.intra_cta_races(res, shared=True)
        assert races and races[0][0] == 1024 and races[0][2][:2] == [0, 63], mode
    out, src, res = _stage(block=64, record_shared=True)
    assert analysis.intra_cta_races(res, shared=True) == []


# refill the thread's own slice after reading the neighbour's, and complete it after a barrier
REFILL = """  cp.async.cg.shared.global [%r6], [%rd4], 16;
  cp.async.commit_group;
  bar.sync 0;
  cp.async.wait_group 0;
  ret;
"""


@pytest.mark.parametrize("mode", ["modelled", "immediate"])
def test_refilling_a_stage_others_still_read_without_a_barrier_is_a_race(mode):
    """The refill's write may happen any time from its issue to its wait: it is a race with the
    neighbour's read of the same barrier epoch before the issue, though it lands an epoch later."""
    racy = STAGE.replace("  ret;\n", REFILL)
    out, src, res = _stage(racy, block=32, async_copies=mode, record_shared=True)
    assert out.tolist() == _neighbour_slices(src.tolist(), 32, 1, 4)
    races = analysis.intra_cta_races(res, shared=True)
    assert races and races[0][0] == 1024 and races[0][2] == [0, 31]
    fixed = STAGE.replace("  ret;\n", "  bar.sync 0;\n" + REFILL)
    _, _, res = _stage(fixed, block=32, async_copies=mode, record_shared=True)
    assert analysis.intra_cta_races(res, shared=True) == []


def test_the_uncommitted_copy_is_not_completed_by_wait_group():
    body = STAGE.replace(COMMIT, "")
    _both_modes(lambda m: _stage(body, block=32, async_copies=m), ptx.AsyncCopyError, READ_EARLY)
    # wait_all commits first
    out, src, _ = _stage(STAGE.replace(COMMIT, "").replace(WAIT0, "  cp.async.wait_all;\n"), block=32)
    assert out.tolist() == _neighbour_slices(src.tolist(), 32, 1, 4)


def test_a_source_outside_every_tensor_faults_at_issue():
    body = STAGE.replace(COPY, "  cp.async.cg.shared.global [%r6], [%rd4+16], 16;\n")
    for mode in ("modelled", "immediate"):
        out = _out(128)
        src = torch.tensor(_words(128), dtype=torch.int32)
        with pytest.raises(ptx.MemoryFault, match="outside every tensor") as e:
            run_kernel(body, {"out": out, "src": src}, decls=BUF, readonly=("src",), async_copies=mode)
        assert e.value.instruction.startswith("cp.async") and e.value.thread == (31, 0, 0)
        assert e.value.address == src.data_ptr() + 512 and "0 bytes past the end of src" in str(e.value)
        assert out.tolist() == [-7] * 128, "nothing written"
    with pytest.raises(ptx.MemoryFault, match="misaligned"):
        _stage(STAGE.replace(COPY, "  cp.async.cg.shared.global [%r6], [%rd4+4], 16, 8;\n"), block=32)


# ------------------------------------------------------------------------------ what is refused

@pytest.mark.parametrize("line,why", [
    ("cp.async.ca.shared.global [%r6], [%rd4], 16, %p1;", "ignore-src"),
    ("cp.async.cg.shared.global.L2::cache_hint [%r6], [%rd4], 16, %rd9;", "cache-policy"),
    ("cp.async.cg.shared.global [%r6], [%rd4], 16, 16, %rd9;", "cache-policy"),
    ("cp.async.cg.shared.global [%r6], [%rd4], 8;", "cp-size 8"),
    ("cp.async.ca.shared.global [%r6], [%rd4], 2;", "cp-size 2"),
    ("cp.async.cg.shared::cluster.global [%r6], [%rd4], 16;", "shared::cluster"),
    ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%r6], [%rd4], 16, [%r2], "
     "%h1;", "multicast bulk"),
    ("cp.async.mbarrier.arrive.b64 [%rd4];", "mbarrier"),
    ("cp.async.wait_group %r1;", "constant"),
    ("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%rd4], [%r6], 16;", "only cp.async"),
])
def test_unsupported_forms_are_refused_by_name(line, why):
    body = STAGE.replace(COPY, "  " + line + "\n")
    with pytest.raises(ptx.UnsupportedInstruction, match=re.escape(why)):
        _stage(body, block=32)


def test_async_copies_mode_is_checked():
    with pytest.raises(ValueError, match="async_copies"):
        _stage(block=32, async_copies="eager")
