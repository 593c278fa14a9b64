"""mamba3_step.tools.inspection: reading registers, stack, spills, shared memory, threads and SASS from
the cubin the DSL produced (no GPU), checked against ``ptxas -v`` and hand-made listings.

Stand-in kernels are defined here (a predicated vectorised copy through shared memory, and a
register-hungry kernel that spills when capped), so the cubin tooling is tested on code whose
facts are known; the real step kernel is checked through the CLI.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402

from mamba3_step.tools import cli  # noqa: E402
from mamba3_step.tools import inspection as I  # noqa: E402
from mamba3_step.specsets import spec_label, specs_from_args  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PTXAS = shutil.which("ptxas")
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas not installed (cross-check only)")
needs_nvdisasm = pytest.mark.skipif(I.find_nvdisasm() is None, reason="nvidia-cuda-nvdisasm not installed")


# ----------------------------------------------------------------------------- stand-in kernels
@cute.kernel
def _vcopy_kernel(gA: cute.Tensor, gC: cute.Tensor, mIdx: cute.Tensor):
    """CTA m: 32 threads, each loads one 16-byte vector of row m, stages one float in shared
    memory, and if idx[m] >= 0 stores the vector plus a neighbour's float to row idx[m]."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sbuf = smem.allocate_tensor(cutlass.Float32, cute.make_layout(128), byte_alignment=16)
    row = mIdx[bidx]
    v = gA[(None, (bidx, tidx))].load()
    sbuf[tidx] = v[0]
    cute.arch.sync_threads()
    if row >= 0:
        gC[(None, (row, tidx))].store(v + sbuf[(tidx + 1) % 32])


@cute.jit
def _vcopy(mA: cute.Tensor, mC: cute.Tensor, mIdx: cute.Tensor):
    gA = cute.zipped_divide(mA, (1, 4))
    gC = cute.zipped_divide(mC, (1, 4))
    _vcopy_kernel(gA, gC, mIdx).launch(grid=[cute.size(gA, mode=[1, 0]), 1, 1], block=[32, 1, 1])


@cute.kernel
def _press_kernel(gA: cute.Tensor, gC: cute.Tensor):
    """Each thread keeps 48 floats live through a 48 x 48 multiply-add chain."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    src = gA[(None, bidx * 32 + tidx)]
    dst = gC[(None, bidx * 32 + tidx)]
    frag = cute.make_rmem_tensor(cute.make_layout(48), cutlass.Float32)
    frag.store(src.load())
    res = cute.make_rmem_tensor(cute.make_layout(48), cutlass.Float32)
    for i in cutlass.range(48, unroll_full=True):
        acc = frag[i]
        for j in cutlass.range(48, unroll_full=True):
            acc = acc * frag[j] + frag[(i + j) % 48]
        res[i] = acc
    dst.store(res.load())


@cute.jit
def _press(mA: cute.Tensor, mC: cute.Tensor):
    gA = cute.zipped_divide(mA, (48,))
    gC = cute.zipped_divide(mC, (48,))
    _press_kernel(gA, gC).launch(grid=[cute.size(gA, mode=[1]) // 32, 1, 1], block=[32, 1, 1])


def _compile_vcopy(options=""):
    M, P = cute.sym_int(), cute.sym_int()
    a = cute.runtime.make_fake_tensor(cutlass.Float32, (M, 128), stride=(128, 1), assumed_align=16)
    c = cute.runtime.make_fake_tensor(cutlass.Float32, (P, 128), stride=(128, 1), assumed_align=16)
    idx = cute.runtime.make_fake_tensor(cutlass.Int32, (M,), stride=(1,), assumed_align=4)
    return cute.compile(_vcopy, a, c, idx, options=f"--gpu-arch sm_90a {options}".strip())


def _compile_press(options=""):
    M = cute.sym_int(divisibility=48 * 32)
    a = cute.runtime.make_fake_tensor(cutlass.Float32, (M,), stride=(1,), assumed_align=16)
    c = cute.runtime.make_fake_tensor(cutlass.Float32, (M,), stride=(1,), assumed_align=16)
    return cute.compile(_press, a, c, options=f"--gpu-arch sm_90a {options}".strip())


@pytest.fixture(scope="module")
def vcopy(tmp_path_factory):
    """(compiled, ptx text) of the vcopy stand-in."""
    d = tmp_path_factory.mktemp("vcopy")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = _compile_vcopy(f"--keep-ptx --dump-dir {d}")
    return compiled, compiled.artifacts.PTX


def _ptxas_report(ptx: str, arch: str, tmp_path, name="k") -> dict:
    """Run ptxas -v; returns registers, stack, spill stores/loads, smem and the cubin bytes."""
    src = tmp_path / f"{name}.ptx"
    out = tmp_path / f"{name}.cubin"
    src.write_text(ptx)
    proc = subprocess.run([PTXAS, f"-arch={arch}", "-v", str(src), "-o", str(out)],
                          capture_output=True, text=True, check=True)
    text = proc.stdout + proc.stderr
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    smem = re.search(r"(\d+) bytes smem", text)
    return {
        "registers": int(regs.group(1)),
        "stack": int(m.group(1)), "spill_stores": int(m.group(2)), "spill_loads": int(m.group(3)),
        "smem": int(smem.group(1)) if smem else 0,
        "cubin": out.read_bytes(),
    }


# ----------------------------------------------------------------------------- SASS histogram
LISTING = """
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
	.section	.text.k,"ax",@progbits
.text.k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR6][R2.64] ;
        /*0020*/                   LDG.E.128.CONSTANT R8, desc[UR6][R2.64+0x10] ;
        /*0030*/              @!P0 LDG.E.64 R12, desc[UR6][R2.64] ;
        /*0040*/                   LDG.E R0, desc[UR6][R2.64] ;
        /*0050*/                   LDG.E.U16 R14, desc[UR6][R2.64] ;
        /*0060*/                   LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR6][R4.64] ;
        /*0070*/               @P1 STG.E.128 desc[UR6][R2.64], R4 ;
        /*0080*/                   STG.E.128 desc[UR6][R2.64], R8 ;
        /*0090*/               @PT STG.E.128 desc[UR6][R2.64], R8 ;
        /*00a0*/              @!P2 STG.E.U16 desc[UR6][R2.64], R8 ;
        /*00b0*/                   STS.128 [R3], R4 ;
        /*00c0*/                   LDS R5, [R3+0x4] ;
        /*00d0*/                   SHFL.BFLY PT, R6, R5, 0x1, 0x1f ;
        /*00e0*/                   SHFL.BFLY PT, R7, R6, 0x2, 0x1f ;
        /*00f0*/                   FFMA R1, R2, R3, R4 ;
        /*0100*/                   STL.64 [R1], R4 ;
        /*0110*/                   LDL R4, [R1] ;
        /*0120*/              @!P0 EXIT ;
        /*0130*/                   EXIT ;
.L_x_0:
        /*0140*/                   BRA `(.L_x_0);
        /*0150*/                   NOP;
        /*0160*/                   NOP;
"""


def test_sass_histogram_counts_by_width_and_predicate():
    h = I.sass_histogram(LISTING)
    assert h == {
        "LDC": 1, "LDG.128": 2, "@P LDG.64": 1, "LDG.32": 1, "LDG.16": 1, "LDGSTS.128": 1,
        "@P STG.128": 1, "STG.128": 2, "@P STG.16": 1, "STS.128": 1, "LDS.32": 1, "SHFL": 2,
        "FFMA": 1, "STL.64": 1, "LDL.32": 1, "EXIT": 2, "BRA": 1, "NOP": 2, "total": 21,
    }
    assert I.count_sass(h, "STG") == 4
    assert I.count_sass(h, "STG", 128) == 3
    assert I.count_sass(h, "STG", 128, predicated=True) == 1  # @PT is not a predicate
    assert I.count_sass(h, "STG", predicated=True) == 2
    assert I.count_sass(h, "LDG", predicated=False) == 4
    assert I.count_sass(h, "LDGSTS", 128) == 1
    assert I.count_sass(h, "LDG", 128) == 2  # LDGSTS is not LDG
    assert I.count_sass(h, "SHFL") == 2
    assert I.count_sass(h, "HMMA") == 0
    assert I.sass.listing_arch(LISTING) == "sm_90a"
    assert I.sass.listing_arch("\t.target\tsm_100a\n") == "sm_100a"


def test_parse_sass_widths_and_guards():
    ins = I.parse_sass(LISTING)
    assert len(ins) == 23
    stl = [i for i in ins if i.opcode == "STL"][0]
    assert (stl.width, stl.predicated) == (64, False)
    guarded = [i for i in ins if i.predicated]
    assert [(i.opcode, i.width) for i in guarded] == [("LDG", 64), ("STG", 128), ("STG", 16), ("EXIT", None)]


# ----------------------------------------------------------------------------- occupancy
def test_theoretical_occupancy_hand_computed():
    # 128 regs: 4096 regs per warp -> 16384 / 4096 = 4 warps per sub-partition -> 16 warps -> 4 CTAs of 4 warps
    occ = I.theoretical_occupancy(128, 128, 0, "sm_90a")
    assert (occ["ctas_per_sm"], occ["warps_per_sm"], occ["limiter"]) == (4, 16, "registers")
    assert occ["occupancy"] == 16 / 64
    # 103 regs round up to 3328 per warp -> 4 warps per sub-partition -> 16 warps -> 2 CTAs of 8 warps
    occ = I.theoretical_occupancy(103, 256, 8704, "sm_90a")
    assert (occ["ctas_per_sm"], occ["warps_per_sm"], occ["limiter"]) == (2, 16, "registers")
    # 16 regs (registers would allow 4 CTAs), 1024 threads: the 64-warp limit allows 2 CTAs
    occ = I.theoretical_occupancy(16, 1024, 0, "sm_90a")
    assert (occ["ctas_per_sm"], occ["occupancy"], occ["limiter"]) == (2, 1.0, "threads")
    # 100 KiB of shared memory (+1 KiB reserved per CTA) on a 228 KiB SM: 2 CTAs
    occ = I.theoretical_occupancy(32, 128, 100 * 1024, "sm_90a")
    assert (occ["ctas_per_sm"], occ["limiter"]) == (2, "shared memory")
    # tiny CTAs: the 32-CTA slot limit
    occ = I.theoretical_occupancy(16, 32, 0, "sm_100a")
    assert (occ["ctas_per_sm"], occ["occupancy"], occ["limiter"]) == (32, 0.5, "CTA slots")
    # more shared memory than a CTA may have: nothing fits
    assert I.theoretical_occupancy(32, 128, 240 * 1024, "sm_90a")["ctas_per_sm"] == 0
    assert I.theoretical_occupancy(32, 128, 0, "sm_75") is None
    with pytest.raises(ValueError, match="arch"):
        I.theoretical_occupancy(32, 128, 0, "hopper")


# ----------------------------------------------------------------------------- stand-in cubins
@needs_nvdisasm
def test_kernel_facts_of_standin_copy(vcopy, tmp_path):
    compiled, ptx = vcopy
    facts = I.kernel_facts(compiled)
    assert facts.arch == "sm_90a"
    assert facts.name.startswith("kernel_") and "vcopy" in facts.name
    assert facts.threads == 32  # block=[32, 1, 1]
    assert facts.smem_dynamic_bytes == 128 * 4  # the allocator's 128 floats
    assert facts.smem_static_bytes == 0
    assert facts.smem_bytes == 512
    assert (facts.stack_bytes, facts.spill_bytes) == (0, 0)
    # one 16-byte load of A, one 16-byte store of C, one 4-byte index load
    assert facts.count("LDG", 128) == 1 and facts.count("STG", 128) == 1
    assert facts.count("LDG", 32) == 1
    assert facts.count("STS") == 1 and facts.count("LDS") == 1 and facts.count("BAR") == 1
    assert facts.sass["total"] == sum(v for k, v in facts.sass.items() if k not in ("total", "NOP"))
    assert "STG.E.128" in facts.sass_text
    d = facts.as_dict()
    assert "sass_text" not in d and d["registers"] == facts.registers
    json.dumps(d)
    if PTXAS:
        rep = _ptxas_report(ptx, "sm_90a", tmp_path)
        assert facts.registers == rep["registers"]
        assert facts.stack_bytes == rep["stack"]
        assert facts.smem_static_bytes == rep["smem"]


@needs_nvdisasm
def test_cubin_extraction_round_trip(vcopy):
    compiled, _ = vcopy
    cubins = I.cubins_from_compiled(compiled)
    assert len(cubins) == 1 and cubins[0][:4] == b"\x7fELF"
    (facts,) = I.elf_facts(cubins[0])
    assert facts["reqntid"] == (32, 1, 1)
    assert facts["sm"] == 90
    # the same facts from the raw cubin bytes (no launch information: no dynamic smem)
    from_bytes = I.kernel_facts(cubins[0])
    from_obj = I.kernel_facts(compiled)
    assert from_bytes.registers == from_obj.registers
    assert from_bytes.sass == from_obj.sass
    assert from_bytes.smem_dynamic_bytes == 0


@needs_ptxas
@needs_nvdisasm
def test_spill_bytes_match_ptxas(tmp_path):
    compiled = _compile_press(f"--keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.artifacts.PTX
    free = I.kernel_facts(compiled)
    rep = _ptxas_report(ptx, "sm_90a", tmp_path, "free")
    assert free.registers == rep["registers"] > 48
    assert free.spill_bytes == rep["spill_stores"] + rep["spill_loads"] == 0
    # cap the registers: ptxas must spill, and the SASS-derived figures must equal its report
    capped = re.sub(r"(\.reqntid[^\n]*\n)", r"\1.maxnreg 40\n", ptx, count=1)
    assert capped != ptx
    rep = _ptxas_report(capped, "sm_90a", tmp_path, "capped")
    assert rep["spill_stores"] > 0
    facts = I.kernel_facts(rep["cubin"])
    assert facts.registers == rep["registers"] == 40
    assert facts.stack_bytes == rep["stack"] > 0
    assert facts.spill_store_bytes == rep["spill_stores"]
    assert facts.spill_load_bytes == rep["spill_loads"]
    assert facts.spill_bytes == rep["spill_stores"] + rep["spill_loads"]


STATIC_SMEM_PTX = """
.version 8.8
.target {arch}
.address_size 64
.shared .align 4 .b8 buf[100];
.extern .shared .align 16 .b8 dyn[];
.visible .entry k1(.param .u64 p)
{{
 .reg .b32 %r<4>; .reg .b64 %rd<3>;
 ld.param.u64 %rd1, [p];
 mov.u32 %r1, %tid.x;
 st.shared.b32 [buf], %r1;
 st.shared.b32 [dyn], %r1;
 bar.sync 0;
 ld.shared.b32 %r2, [buf+4];
 ld.shared.b32 %r3, [dyn+4];
 add.s32 %r2, %r2, %r3;
 st.global.b32 [%rd1], %r2;
 ret;
}}
"""


@needs_ptxas
@needs_nvdisasm
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a"])
def test_static_shared_memory_matches_ptxas(arch, tmp_path):
    rep = _ptxas_report(STATIC_SMEM_PTX.format(arch=arch), arch, tmp_path)
    assert rep["smem"] == 112  # 100 bytes padded to the dynamic array's 16-byte alignment
    facts = I.kernel_facts(rep["cubin"])
    assert facts.arch == arch
    assert facts.smem_static_bytes == 112
    assert facts.threads is None  # no .reqntid and no launch to read it from
    assert facts.count("STS") == 2 and facts.count("LDS") == 2


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(I.InspectError, match="ir_module"):
        I.kernel_facts(object())
    with pytest.raises(I.InspectError, match="neither a fatbin nor an ELF"):
        I.cubins_from_fatbin(b"not a cubin at all")


# ----------------------------------------------------------------------------- the real kernel: CLI
def _kernel_available() -> bool:
    try:
        from mamba3_step.kernel import compile_step_kernel  # noqa: F401
    except Exception:
        return False
    return True


needs_kernel = pytest.mark.skipif(not _kernel_available(), reason="mamba3_step.kernel not importable")


@needs_kernel
@needs_nvdisasm
def test_cli_json_flagship_dense(tmp_path):
    """`python -m mamba3_step inspect --json --mode dense --no-update-kv-state`: one JSON object;
    its fields agree with the compile tests' bounds and with an independent computation of each
    derived figure."""
    from mamba3_step.tools.bytes_model import bytes_per_step
    from mamba3_step.spec import flagship_spec
    from mamba3_step.tiling import thread_layout

    proc = subprocess.run([sys.executable, "-m", "mamba3_step", "inspect", "--json", "--batch", "64",
                           "--mode", "dense", "--no-update-kv-state"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)  # exactly one JSON document, nothing else on stdout
    for key in ("registers", "spill_bytes", "smem_bytes", "threads", "sass", "compile_seconds",
                "bytes_per_step", "occupancy", "stack_bytes"):
        assert key in report, key
    spec = flagship_spec(pool=False, update_kv_state=False)
    assert report["spec"] == spec.as_dict()  # the flagship configuration, dense mode
    assert report["arch"] == "sm_90a"
    assert report["spill_bytes"] == 0 and report["stack_bytes"] == 0
    assert 32 <= report["registers"] <= 255 and report["registers"] * report["threads"] <= 65536
    lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype)
    assert report["threads"] == lay.num_threads
    assert report["bytes_per_step"] == bytes_per_step(spec, 64, 48)
    assert report["compile_seconds"] > 0
    occ = I.theoretical_occupancy(report["registers"], report["threads"], report["smem_bytes"], "sm_90a")
    assert report["occupancy"] == occ
    # the state moves in 16-byte accesses: rows_per_thread * CPT vector loads and stores per thread
    vectors = lay.rows_per_thread * lay.CPT
    assert I.count_sass(report["sass"], "STG", 128) >= vectors
    assert I.count_sass(report["sass"], "LDG", 128) + I.count_sass(report["sass"], "LDGSTS", 128) >= vectors
    assert report["sass"]["total"] == sum(v for k, v in report["sass"].items() if k not in ("total", "NOP"))


@needs_kernel
@needs_nvdisasm
def test_text_report_pool_mode_and_ptxas_cross_check(tmp_path):
    """The text report of the server configuration (pool mode + update_kv_state), and its
    register / stack / spill / shared-memory figures against ptxas -v on the same PTX."""
    from mamba3_step.kernel import compile_step_kernel

    args = cli.build_parser().parse_args(["inspect", "--batch", "8"])
    (spec,) = specs_from_args(args)  # the default: the flagship as servers run it
    assert spec.pool and spec.update_kv_state and not spec.has_dst
    compiled = compile_step_kernel(spec, "sm_90a", extra_options=f"--keep-ptx --dump-dir {tmp_path}")
    report, facts = I.inspect_spec(spec, "sm_90a", batch=8, heads=48, compiled=compiled)
    text = I.format_report(report)
    assert "mode=pool" in text and "update_kv_state" in text
    assert re.search(rf"registers/thread\s+{facts.registers}\n", text)
    # the default kernel's loads pinned: the index, then every other load (latency_model.FLAGSHIP_TRIPS)
    assert report["loads_pinned"] and report["epilogue_loaded_early"]
    assert report["round_trips"]["count"] == report["round_trips"]["dependence_depth"] == 2
    assert report["round_trips"]["state_loads_per_trip"] == [0, 16]
    assert re.search(r"round trips\s+2 dependent \(depth 2\);.*loads pinned, epilogue loaded early", text)
    assert re.search(r"spills\s+0 B", text)
    assert "state_batch_indices" in text and "total" in text
    assert report["spill_bytes"] == 0 and report["registers"] * report["threads"] <= 65536
    if PTXAS:
        rep = _ptxas_report(compiled.artifacts.PTX, "sm_90a", tmp_path, "flagship")
        assert facts.registers == rep["registers"]
        assert facts.stack_bytes == rep["stack"]
        assert facts.spill_bytes == rep["spill_stores"] + rep["spill_loads"] == 0
        assert facts.smem_static_bytes == rep["smem"]


@pytest.mark.parametrize("argv, message", [
    (["--mode", "dense", "--dst"], "--dst needs --mode pool"),
    (["--config", "48,64,4"], "N (dstate) must be one of"),
    (["--arch", "hopper"], "arch: expected 'sm_'"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--tile-d", "4"], "as one cluster, at most 8"),
])
def test_cli_rejects_bad_flags(argv, message, capsys):
    assert cli.main(["inspect", *argv]) == 2
    assert message in capsys.readouterr().err


@needs_kernel
def test_report_of_a_replay_specialisation_names_it_and_models_its_bytes():
    """`inspect --replay-ring 4`: the header names the ring, the bytes are replay's averaged over ring positions."""
    from mamba3_step.tools.bytes_model import replay_bytes
    from mamba3_step.spec import flagship_spec

    spec = flagship_spec(replay_ring=4)
    report, facts = I.inspect_spec(spec, "sm_90a", batch=8, heads=2)
    assert report["bytes_per_step"] == replay_bytes(flagship_spec(), 4, 8, 2)
    text = I.format_report(report)
    assert "replay_ring=4" in text and "averaged over ring positions" in text and "ring.length" in text
    assert facts.spill_bytes == 0


def test_replay_draft_flag_names_a_verify_step_on_a_ring_made_for_more_drafts(capsys):
    """--replay-draft T_MAX: StepSpec.replay_draft, the ring's K - 1 + T_MAX entries; refused by name
    without --num-accepted or at most --tokens."""
    args = cli.build_parser().parse_args(["inspect", "--replay-ring", "4", "--tokens", "2", "--num-accepted",
                                          "--replay-draft", "4"])
    (spec,) = specs_from_args(args)
    assert (spec.replay_draft, spec.tokens, spec.ring_entries) == (4, 2, 7)
    assert "draft4" in spec_label(spec)
    for argv, message in ((["--replay-draft", "4"], "replay_draft needs replay_ring and num_accepted"),
                          (["--num-accepted", "--replay-draft", "2"], "replay_draft must be 0 or an int in (2, 16]")):
        assert cli.main(["inspect", "--replay-ring", "4", "--tokens", "2", *argv]) == 2
        assert message in capsys.readouterr().err


def test_materialize_ring_flag_names_the_flush_forms(capsys):
    """--materialize-ring L: spec.flush_specs of each named pool spec (two for L > 16); --replay-ring 1
    (the flush form's K) and the flags the flush form sets itself are refused by name."""
    from mamba3_step.spec import flagship_spec, flush_specs

    args = cli.build_parser().parse_args(["inspect", "--materialize-ring", "7", "--state-dtype", "bfloat16"])
    assert specs_from_args(args) == flush_specs(flagship_spec(state_dtype="bfloat16"), 7)
    (spec,) = specs_from_args(args)
    assert (spec.replay_ring, spec.tokens, spec.num_accepted, spec.replay_draft, spec.ring_entries) == (1, 2, True, 7, 7)
    args = cli.build_parser().parse_args(["inspect", "--materialize-ring", "31"])
    assert [s.replay_ring for s in specs_from_args(args)] == [1, 16]
    for argv, message in ((["--replay-ring", "1", "--tokens", "2", "--num-accepted"], "--replay-ring: expected F = 0"),
                          (["--materialize-ring", "32"], "--materialize-ring: expected L = F - 1 + T_MAX in [1, 31]"),
                          (["--materialize-ring", "3", "--replay-ring", "4", "--tokens", "2"],
                           "leave out --replay-ring, --tokens"),
                          (["--materialize-ring", "3", "--num-warps", "8"], "leave out --num-warps")):
        assert cli.main(["inspect", *argv]) == 2
        assert message in capsys.readouterr().err


@needs_kernel
def test_report_of_a_flush_form_says_its_bytes_are_not_a_steps():
    from mamba3_step.spec import flagship_spec, flush_specs

    report, facts = I.inspect_spec(flush_specs(flagship_spec(), 3)[0], "sm_90a", batch=8, heads=2)
    assert report["bytes_per_step"] is None and facts.spill_bytes == 0
    assert "not modelled: materialize's flush form" in I.format_report(report)


def test_inspect_names_the_cluster_and_programmatic_launch(capsys):
    """--tile-d 16 with update_kv_state: the D-tiles of a (lane, head) as a cluster of 4; --kernel
    programmatic-pair: the register kernel with and without programmatic launch, each report saying which."""
    assert cli.main(["inspect", "--tile-d", "16", "--kernel", "programmatic-pair"]) == 0
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mamba3_step kernel")]
    assert len(headers) == 2 and all("cluster=4" in h for h in headers)
    assert ["programmatic_launch" in h for h in headers] == [False, True]
