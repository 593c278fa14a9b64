"""What the compiler made of a step kernel, read from the cubin; no GPU needed.

Library API (used by the compile tests and by ``bench/static_bench.py``):

* :func:`kernel_facts` -- ``compiled`` (the ``cute.compile`` result, e.g. from
  :func:`mamba3_step.kernel.compile_step_kernel`) -> :class:`KernelFacts`: registers per
  thread, stack frame, spill bytes, shared memory per CTA, threads per CTA, a SASS
  histogram and the raw SASS text.
* :func:`cubins_from_compiled` -- the ELF cubin(s) embedded in ``compiled.ir_module``.
* :func:`sass_histogram` -- classify SASS text into instruction counts, global/shared/local
  memory accesses split by width and by predication.
* :func:`theoretical_occupancy` -- CTAs and warps per SM from registers, threads and
  shared memory, for the architectures in :data:`ARCH_LIMITS`.

CLI: ``python -m mamba3_step inspect [--arch sm_90a] [--dstate N --headdim D --mimo R
--state-dtype ... --kv-dtype ... --pool --dst --update-kv-state --no-z --no-outproj]
[--batch B] [--heads H] [--json]`` compiles one specialisation (default: the flagship
configuration in dense mode) and prints the report; ``--json`` prints exactly one JSON
object.

Where each fact comes from (all read from what the DSL produced, nothing guessed):

* The cubin is the ``llvm.mlir.global`` whose name ends in ``_binary`` in
  ``compiled.ir_module``: a fatbin whose ELF entries are the cubins.
* ``registers``: ``EIATTR_REGCOUNT`` (0x2f) in the ELF's ``.nv.info`` section;
  ``stack_bytes``: ``EIATTR_FRAME_SIZE`` (0x11). These are the figures ``ptxas -v`` prints
  as "Used N registers" and "N bytes stack frame" (tests cross-check with ptxas when it
  is installed).
* ``spill_store_bytes`` / ``spill_load_bytes``: the widths of the local-memory stores
  (``STL``) and loads (``LDL``) in the SASS, summed over the instructions. Spills are the
  only local-memory traffic a kernel without local arrays has, so these equal ptxas's
  "bytes spill stores / loads"; ``spill_bytes`` is their sum (0 means no spill at all).
* ``smem_static_bytes``: the size of ``.nv.shared.<kernel>``, less the 1 KiB that sm_90
  and later place at its start for the system (ptxas 13 includes it in the section, and
  excludes it from the "bytes smem" it prints). The DSL's dynamic shared memory symbol is
  1024-byte aligned, so a kernel with static data pads it to that alignment.
* ``smem_dynamic_bytes``: the constant stored into the ``sharedMem`` field of the launch
  configuration in the host code of ``ir_module`` (0 when the launch requests none).
* ``threads``: ``EIATTR_REQNTID`` (0x10, the ``.reqntid`` the DSL emits from the constant
  block size), else ``EIATTR_MAX_THREADS`` (0x05), else the constant block size stored
  into the launch configuration.
* SASS: ``nvdisasm`` from the pip package ``nvidia-cuda-nvdisasm`` (located through the
  package's file list), else ``nvdisasm`` on ``PATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

__all__ = [
    "ARCH_LIMITS",
    "KernelFacts",
    "InspectError",
    "cubins_from_compiled",
    "cubins_from_fatbin",
    "elf_facts",
    "find_nvdisasm",
    "disassemble",
    "sass_histogram",
    "count_sass",
    "kernel_facts",
    "theoretical_occupancy",
    "cli_main",
]


class InspectError(RuntimeError):
    """The compiled object does not contain what this module knows how to read."""


# ----------------------------------------------------------------------------------------
# Fatbin / ELF reading
# ----------------------------------------------------------------------------------------

FATBIN_MAGIC = 0xBA55ED50
_FATBIN_KIND_ELF = 2
_FATBIN_FLAG_COMPRESSED = 0x2000
ELF_MAGIC = b"\x7fELF"

# EIATTR codes of the CUDA ELF ``.nv.info`` sections that this module reads.
EIATTR_MAX_THREADS = 0x05
EIATTR_REQNTID = 0x10
EIATTR_FRAME_SIZE = 0x11
EIATTR_MIN_STACK_SIZE = 0x12
EIATTR_MAX_STACK_SIZE = 0x23
EIATTR_REGCOUNT = 0x2F
# EIFMT: how an attribute's value is encoded
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 1, 2, 3, 4

#: bytes at the start of ``.nv.shared.<kernel>`` reserved for the system on sm_90 and later
SM90_SHARED_RESERVED_IN_SECTION = 1024


def _walk_ops(op):
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child
                yield from _walk_ops(child.operation)


def _attr_str(attr) -> str:
    s = str(attr)
    return s[1:-1] if len(s) >= 2 and s[0] == s[-1] == '"' else s


def _binary_blobs(compiled) -> list[bytes]:
    module = getattr(compiled, "ir_module", None)
    if module is None:
        raise InspectError(
            f"expected a cute.compile result with an .ir_module, got {type(compiled).__name__}"
        )
    blobs = []
    for op in _walk_ops(module.operation):
        if op.operation.name != "llvm.mlir.global":
            continue
        if not _attr_str(op.attributes["sym_name"]).endswith("_binary"):
            continue
        value = op.attributes["value"]
        data = getattr(value, "value_bytes", None)
        if data is None:  # pragma: no cover - older MLIR bindings
            raise InspectError("the _binary global's value is not a string attribute")
        blobs.append(bytes(data))
    if not blobs:
        raise InspectError("no llvm.mlir.global named *_binary in compiled.ir_module")
    return blobs


def _elf_size(data: bytes, start: int) -> int:
    """Length of the ELF64 image that starts at ``data[start]`` (section table is last)."""
    if data[start + 4] != 2 or data[start + 5] != 1:
        raise InspectError("embedded ELF is not 64-bit little-endian")
    e_shoff, = struct.unpack_from("<Q", data, start + 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, start + 0x3A)
    e_phoff, = struct.unpack_from("<Q", data, start + 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, start + 0x36)
    end = max(e_shoff + e_shentsize * e_shnum, e_phoff + e_phentsize * e_phnum)
    # sections may lie after the section table
    for k in range(e_shnum):
        off = start + e_shoff + k * e_shentsize
        sh_type, = struct.unpack_from("<I", data, off + 4)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, off + 0x18)
        if sh_type != 8:  # SHT_NOBITS occupies no file bytes
            end = max(end, sh_offset + sh_size)
    return end


def cubins_from_fatbin(fatbin: bytes) -> list[bytes]:
    """The ELF cubins inside a fatbin (or ``[fatbin]`` when it already is an ELF).

    Raises InspectError for compressed entries (the DSL does not compress; this would need
    the CUDA driver's LZ4 variant) and when no ELF is present.
    """
    if fatbin[:4] == ELF_MAGIC:
        return [fatbin[: _elf_size(fatbin, 0)]]
    if len(fatbin) < 16 or struct.unpack_from("<I", fatbin, 0)[0] != FATBIN_MAGIC:
        raise InspectError("binary is neither a fatbin nor an ELF cubin")
    out = []
    pos = 0
    while pos + 16 <= len(fatbin) and struct.unpack_from("<I", fatbin, pos)[0] == FATBIN_MAGIC:
        _, header_size, fat_size = struct.unpack_from("<HHQ", fatbin, pos + 4)
        entry = pos + header_size
        end = entry + fat_size
        while entry + 16 <= end:
            kind, _ver, ehdr_size, payload_size = struct.unpack_from("<HHIQ", fatbin, entry)
            flags = struct.unpack_from("<Q", fatbin, entry + 0x28)[0] if ehdr_size >= 0x30 else 0
            payload = fatbin[entry + ehdr_size : entry + ehdr_size + payload_size]
            if kind == _FATBIN_KIND_ELF:
                if payload[:4] == ELF_MAGIC:
                    out.append(payload)
                elif flags & _FATBIN_FLAG_COMPRESSED:
                    raise InspectError("compressed fatbin entries are not supported")
            if ehdr_size == 0:
                break
            entry += ehdr_size + payload_size
        pos = end
    if not out:  # unknown layout: fall back on the first ELF magic
        at = fatbin.find(ELF_MAGIC)
        if at < 0:
            raise InspectError("no ELF cubin inside the fatbin")
        out.append(fatbin[at : at + _elf_size(fatbin, at)])
    return out


def cubins_from_compiled(compiled) -> list[bytes]:
    """The ELF cubins the DSL embedded in ``compiled.ir_module`` (usually exactly one)."""
    out = []
    for blob in _binary_blobs(compiled):
        out.extend(cubins_from_fatbin(blob))
    return out


@dataclass
class _Section:
    name: str
    type: int
    flags: int
    offset: int
    size: int
    link: int
    info: int


def _sections(elf: bytes) -> list[_Section]:
    if elf[:4] != ELF_MAGIC:
        raise InspectError("not an ELF image")
    e_shoff, = struct.unpack_from("<Q", elf, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = []
    for k in range(e_shnum):
        sh_name, sh_type, sh_flags, _addr, sh_offset, sh_size, sh_link, sh_info = struct.unpack_from(
            "<IIQQQQII", elf, e_shoff + k * e_shentsize
        )
        raw.append((sh_name, sh_type, sh_flags, sh_offset, sh_size, sh_link, sh_info))
    strtab_off = raw[e_shstrndx][3]

    def name(off):
        end = elf.index(b"\0", strtab_off + off)
        return elf[strtab_off + off : end].decode()

    return [_Section(name(r[0]), *r[1:]) for r in raw]


def _symbols(elf: bytes, secs: list[_Section]) -> list[tuple[str, int, int]]:
    """(name, st_info, st_shndx) for every symbol of ``.symtab``."""
    symtab = next((s for s in secs if s.type == 2), None)
    if symtab is None:
        return []
    strtab = secs[symtab.link]
    out = []
    for off in range(symtab.offset, symtab.offset + symtab.size, 24):
        st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", elf, off)
        end = elf.index(b"\0", strtab.offset + st_name)
        out.append((elf[strtab.offset + st_name : end].decode(), st_info, st_shndx))
    return out


def _nv_info(data: bytes) -> list[tuple[int, bytes]]:
    """Decode an ``.nv.info*`` section into (attribute, value bytes) pairs."""
    out = []
    p = 0
    while p + 2 <= len(data):
        fmt, attr = data[p], data[p + 1]
        if fmt == _EIFMT_SVAL:
            (size,) = struct.unpack_from("<H", data, p + 2)
            out.append((attr, data[p + 4 : p + 4 + size]))
            p += 4 + size
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            # value (if any) in the two bytes after the attribute; every entry is 4 bytes
            out.append((attr, data[p + 2 : p + 4] if fmt != _EIFMT_NVAL else b""))
            p += 4
        else:
            raise InspectError(f"unknown .nv.info attribute format {fmt:#x} at offset {p}")
    return out


def elf_facts(elf: bytes) -> list[dict]:
    """Per-kernel facts of one cubin, from its ELF sections.

    Returns one dict per kernel (entry function): ``name``, ``registers``, ``stack_bytes``,
    ``min_stack_bytes``, ``max_stack_bytes``, ``reqntid`` ((x, y, z) or None),
    ``max_threads`` ((x, y, z) or None), ``shared_section_bytes`` (size of
    ``.nv.shared.<name>``, 0 without one), ``code_bytes`` (size of ``.text.<name>``) and
    ``sm`` (the target number the ELF header names, e.g. 90).
    """
    secs = _sections(elf)
    syms = _symbols(elf, secs)
    (e_flags,) = struct.unpack_from("<I", elf, 0x30)
    kernels = [s.name[len(".text.") :] for s in secs if s.name.startswith(".text.")]
    by_name = {s.name: s for s in secs}
    sym_index = {name: i for i, (name, _, _) in enumerate(syms)}
    facts = {k: {"name": k, "registers": None, "stack_bytes": 0, "min_stack_bytes": 0,
                 "max_stack_bytes": 0, "reqntid": None, "max_threads": None} for k in kernels}
    index_to_kernel = {sym_index[k]: k for k in kernels if k in sym_index}

    def u32(v, i=0):
        return struct.unpack_from("<I", v, 4 * i)[0]

    glob = by_name.get(".nv.info")
    if glob is not None:
        for attr, val in _nv_info(elf[glob.offset : glob.offset + glob.size]):
            if len(val) < 8:
                continue
            k = index_to_kernel.get(u32(val, 0))
            if k is None:
                continue
            if attr == EIATTR_REGCOUNT:
                facts[k]["registers"] = u32(val, 1)
            elif attr == EIATTR_FRAME_SIZE:
                facts[k]["stack_bytes"] = u32(val, 1)
            elif attr == EIATTR_MIN_STACK_SIZE:
                facts[k]["min_stack_bytes"] = u32(val, 1)
            elif attr == EIATTR_MAX_STACK_SIZE:
                facts[k]["max_stack_bytes"] = u32(val, 1)
    for k in kernels:
        info = by_name.get(".nv.info." + k)
        if info is not None:
            for attr, val in _nv_info(elf[info.offset : info.offset + info.size]):
                if attr in (EIATTR_REQNTID, EIATTR_MAX_THREADS) and len(val) >= 12:
                    dims = (u32(val, 0), u32(val, 1), u32(val, 2))
                    facts[k]["reqntid" if attr == EIATTR_REQNTID else "max_threads"] = dims
        shared = by_name.get(".nv.shared." + k)
        facts[k]["shared_section_bytes"] = shared.size if shared is not None else 0
        facts[k]["code_bytes"] = by_name[".text." + k].size
        # ELF ABI version 7 (the DSL's cubins) keeps the SM number in the low byte of
        # e_flags; version 8 (ptxas 13 output) in the second byte
        facts[k]["sm"] = (e_flags >> 8) & 0xFF if elf[8] >= 8 else e_flags & 0xFF
    return [facts[k] for k in kernels]


# ----------------------------------------------------------------------------------------
# Host side of the launch: dynamic shared memory and block size
# ----------------------------------------------------------------------------------------

# the launch configuration struct the DSL lowers to: (grid[3], block[3], sharedMem, stream, attrs, numAttrs)
_LAUNCH_CONFIG_TYPE = "struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def _launch_config(compiled) -> dict:
    """Constants stored into launch configurations: {'smem': [..], 'block': [(x,y,z)..]}.

    Each host launch stores into a ``(grid, block, sharedMem, ...)`` struct; this reads the
    constant ``sharedMem`` (field 2) and block dims (field 1) from the printed host IR,
    function by function (SSA names are per function). Values that are not compile-time
    constants are skipped.
    """
    smem, blocks = [], []
    const_re = re.compile(r"^\s*(%[\w.]+) = llvm\.mlir\.constant\((-?\d+) : i\d+\)")
    gep_re = re.compile(r"^\s*(%[\w.]+) = llvm\.getelementptr (%[\w.]+)\[([0-9, ]+)\]")
    store_re = re.compile(r"^\s*llvm\.store (%[\w.]+), (%[\w.]+) :")
    constants: dict = {}
    gep: dict = {}
    block_dims: dict = {}

    def flush():
        for dims in block_dims.values():
            if len(dims) == 3:
                blocks.append((dims[0], dims[1], dims[2]))

    for line in str(compiled.ir_module).splitlines():
        if line.lstrip().startswith("llvm.func "):
            flush()
            constants, gep, block_dims = {}, {}, {}
            continue
        m = const_re.match(line)
        if m:
            constants[m.group(1)] = int(m.group(2))
            continue
        if _LAUNCH_CONFIG_TYPE in line:
            m = gep_re.match(line)
            if m:
                gep[m.group(1)] = (m.group(2), tuple(int(x) for x in m.group(3).split(",")))
            continue
        m = store_re.match(line)
        if m and m.group(2) in gep and m.group(1) in constants:
            base, idx = gep[m.group(2)]
            value = constants[m.group(1)]
            if idx == (0, 2):
                smem.append(value)
            elif len(idx) == 3 and idx[:2] == (0, 1):
                block_dims.setdefault(base, {})[idx[2]] = value
    flush()
    return {"smem": smem, "block": blocks}


# ----------------------------------------------------------------------------------------
# SASS
# ----------------------------------------------------------------------------------------


def find_nvdisasm() -> str | None:
    """Path of ``nvdisasm``: the pip package ``nvidia-cuda-nvdisasm`` first, then PATH."""
    try:
        from importlib import metadata

        files = metadata.files("nvidia-cuda-nvdisasm") or []
        for f in files:
            if f.name == "nvdisasm":
                path = str(f.locate())
                if os.path.isfile(path) and os.access(path, os.X_OK):
                    return path
    except Exception:  # package not installed
        pass
    return shutil.which("nvdisasm")


def disassemble(elf: bytes, nvdisasm: str | None = None) -> str:
    """SASS text of a cubin (``nvdisasm -c``). Raises InspectError without nvdisasm."""
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise InspectError(
            "nvdisasm not found: pip install nvidia-cuda-nvdisasm (the 'bench'/'test' extra)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(elf)
        proc = subprocess.run([tool, "-c", path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise InspectError(f"nvdisasm failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
    return proc.stdout


#: memory opcodes whose histogram keys carry the access width and predication
MEMORY_OPS = ("LDG", "STG", "LDGSTS", "LDS", "STS", "LDL", "STL", "LD", "ST",
              "LDSM", "ATOMG", "ATOMS", "ATOM", "RED", "REDG")
_WIDTH_TOKENS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "32": 32, "64": 64, "128": 128}
_INSTR_RE = re.compile(
    r"^\s*/\*[0-9a-fA-F]+\*/\s+(?P<guard>@!?U?P[0-9T]+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)"
)


@dataclass(frozen=True)
class SassInstr:
    opcode: str  # base opcode, e.g. "STG"
    modifiers: tuple  # e.g. ("E", "128")
    predicated: bool  # guarded by a predicate other than PT
    width: int | None  # access width in bits for memory opcodes, else None


def parse_sass(sass_text: str) -> list[SassInstr]:
    """Every instruction of an ``nvdisasm`` listing, in order (NOPs included)."""
    out = []
    for line in sass_text.splitlines():
        m = _INSTR_RE.match(line)
        if not m:
            continue
        parts = m.group("op").rstrip(".").split(".")
        base, mods = parts[0], tuple(parts[1:])
        guard = (m.group("guard") or "").strip()
        predicated = bool(guard) and guard not in ("@PT", "@UPT")
        width = None
        if base in MEMORY_OPS:
            width = 32
            for tok in mods:
                if tok in _WIDTH_TOKENS:
                    width = _WIDTH_TOKENS[tok]
        out.append(SassInstr(base, mods, predicated, width))
    return out


def sass_histogram(sass_text: str) -> dict[str, int]:
    """Instruction counts of an ``nvdisasm`` listing (static counts, not executed counts).

    Keys:

    * memory opcodes (:data:`MEMORY_OPS`): ``"<OP>.<bits>"`` for unpredicated and
      ``"@P <OP>.<bits>"`` for predicated instructions, e.g. ``"LDG.128"`` for
      ``LDG.E.128``, ``"@P STG.128"`` for ``@!P0 STG.E.128``, ``"LDG.32"`` for ``LDG.E``,
      ``"LDGSTS.128"`` for ``LDGSTS.E.BYPASS.LTC128B.128``, ``"STG.16"`` for ``STG.E.U16``;
    * every other opcode by its base name (``"SHFL"``, ``"FFMA"``, ``"BAR"``, ``"EXIT"``),
      predicated or not;
    * ``"NOP"``: alignment padding, not part of ``"total"``;
    * ``"total"``: all instructions except NOPs.

    ``@PT`` (always true) does not count as a predicate.
    """
    hist: Counter = Counter()
    for ins in parse_sass(sass_text):
        if ins.opcode == "NOP":
            hist["NOP"] += 1
            continue
        if ins.width is not None:
            key = f"{ins.opcode}.{ins.width}"
            if ins.predicated:
                key = "@P " + key
        else:
            key = ins.opcode
        hist[key] += 1
        hist["total"] += 1
    hist.setdefault("total", 0)
    return dict(sorted(hist.items()))


def count_sass(hist: dict, op: str, width: int | None = None, predicated: bool | None = None) -> int:
    """Sum of histogram counts for opcode ``op`` (e.g. "STG"), optionally one width (bits)
    and/or only predicated (True) / unpredicated (False) instructions."""
    total = 0
    for key, n in hist.items():
        pred = key.startswith("@P ")
        k = key[3:] if pred else key
        kop, _, kwidth = k.partition(".")
        if kop != op:
            continue
        if width is not None and kwidth != str(width):
            continue
        if predicated is not None and pred != predicated:
            continue
        total += n
    return total


# ----------------------------------------------------------------------------------------
# Occupancy
# ----------------------------------------------------------------------------------------

#: Per-SM limits by compute capability. Sources: CUDA C++ Programming Guide, "Technical
#: Specifications per Compute Capability" table (warps/SM, CTAs/SM, registers/SM, max
#: shared memory per SM / per block), and the CUDA occupancy calculator header
#: cuda_occupancy.h (register allocation unit 256 per warp, 4 SM sub-partitions, 1 KiB
#: shared memory reserved per CTA on cc >= 8.0, shared allocation granularity 128 B).
#: cc 10.0 (B200) has the same limits as cc 9.0 in that table; cc 12.x has 48 warps and
#: 100 KiB of shared memory per SM.
ARCH_LIMITS = {
    80: dict(max_warps=64, max_ctas=32, regs=65536, smem_sm=167936, smem_cta=166912),
    86: dict(max_warps=48, max_ctas=16, regs=65536, smem_sm=102400, smem_cta=101376),
    89: dict(max_warps=48, max_ctas=24, regs=65536, smem_sm=102400, smem_cta=101376),
    90: dict(max_warps=64, max_ctas=32, regs=65536, smem_sm=233472, smem_cta=232448),
    100: dict(max_warps=64, max_ctas=32, regs=65536, smem_sm=233472, smem_cta=232448),
    103: dict(max_warps=64, max_ctas=32, regs=65536, smem_sm=233472, smem_cta=232448),
    120: dict(max_warps=48, max_ctas=32, regs=65536, smem_sm=102400, smem_cta=101376),
    121: dict(max_warps=48, max_ctas=32, regs=65536, smem_sm=102400, smem_cta=101376),
}
_REG_ALLOC_UNIT = 256
_SUB_PARTITIONS = 4
_SMEM_RESERVED_PER_CTA = 1024
_SMEM_GRANULARITY = 128


def sm_number(arch: str) -> int:
    """``"sm_90a"`` -> 90. Raises ValueError naming ``arch`` for anything else."""
    m = re.fullmatch(r"sm_(\d+)[af]?", arch or "")
    if not m:
        raise ValueError(f"arch must look like 'sm_90a' or 'sm_100a', got {arch!r}")
    return int(m.group(1))


def theoretical_occupancy(registers: int, threads: int, smem_bytes: int, arch: str) -> dict | None:
    """Resident CTAs and warps per SM, and the limiting resource.

    Args:
        registers: registers per thread (as compiled).
        threads: threads per CTA.
        smem_bytes: shared memory per CTA (static + dynamic), excluding the 1 KiB per CTA
            the system reserves (added here).
        arch: e.g. ``"sm_90a"``.

    Returns ``None`` for an architecture not in :data:`ARCH_LIMITS`, else a dict with
    ``ctas_per_sm``, ``warps_per_sm``, ``max_warps_per_sm``, ``occupancy`` (fraction of
    the SM's warp slots), ``limiter`` ("registers", "shared memory", "threads" or
    "CTA slots") and the CTA counts each limit alone allows.
    """
    lim = ARCH_LIMITS.get(sm_number(arch))
    if lim is None:
        return None
    if threads <= 0:
        raise ValueError(f"threads must be positive, got {threads}")
    warps = -(-threads // 32)
    by = {}
    by["CTA slots"] = lim["max_ctas"]
    by["threads"] = lim["max_warps"] // warps
    if registers > 0:
        regs_per_warp = -(-registers * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
        warps_per_partition = (lim["regs"] // _SUB_PARTITIONS) // regs_per_warp
        by["registers"] = (warps_per_partition * _SUB_PARTITIONS) // warps
    smem_cta = -(-smem_bytes // _SMEM_GRANULARITY) * _SMEM_GRANULARITY + _SMEM_RESERVED_PER_CTA
    by["shared memory"] = (lim["smem_sm"] // smem_cta) if smem_bytes <= lim["smem_cta"] else 0
    limiter = min(by, key=lambda k: (by[k], k != "registers"))
    ctas = by[limiter]
    return {
        "ctas_per_sm": ctas,
        "warps_per_sm": ctas * warps,
        "max_warps_per_sm": lim["max_warps"],
        "occupancy": ctas * warps / lim["max_warps"],
        "limiter": limiter,
        "ctas_by_limit": by,
    }


# ----------------------------------------------------------------------------------------
# KernelFacts
# ----------------------------------------------------------------------------------------


@dataclass
class KernelFacts:
    """What the compiler made of one kernel.

    Attributes:
        name: the kernel's entry symbol.
        arch: the target the SASS was generated for, e.g. ``"sm_90a"``.
        registers: registers per thread (EIATTR_REGCOUNT).
        stack_bytes: stack frame per thread in bytes (EIATTR_FRAME_SIZE).
        spill_store_bytes / spill_load_bytes: bytes of local-memory stores/loads in the
            SASS (static sum of access widths; what ptxas reports as spill stores/loads).
        spill_bytes: ``spill_store_bytes + spill_load_bytes``.
        smem_static_bytes / smem_dynamic_bytes / smem_bytes: shared memory per CTA
            (static, requested at launch, total).
        threads: threads per CTA (None when neither the ELF nor the launch tells).
        sass: :func:`sass_histogram` of the kernel's SASS.
        code_bytes: size of the kernel's code section.
        sass_text: the ``nvdisasm`` listing (omitted from :meth:`as_dict`).
    """

    name: str
    arch: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    spill_bytes: int
    smem_static_bytes: int
    smem_dynamic_bytes: int
    smem_bytes: int
    threads: int | None
    code_bytes: int
    sass: dict = field(default_factory=dict)
    sass_text: str = field(default="", repr=False)

    def count(self, op: str, width: int | None = None, predicated: bool | None = None) -> int:
        """:func:`count_sass` on this kernel's histogram."""
        return count_sass(self.sass, op, width, predicated)

    def occupancy(self, arch: str | None = None) -> dict | None:
        """:func:`theoretical_occupancy` on ``arch`` (default: the compiled target)."""
        if self.threads is None:
            return None
        return theoretical_occupancy(self.registers, self.threads, self.smem_bytes, arch or self.arch)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("sass_text")
        return d


def _listing_arch(listing: str) -> str | None:
    """The target of an nvdisasm listing: ``.target sm_90a``, or for the DSL's older ELF
    format the header flags ``EF_CUDA_SM90`` (+ ``EF_CUDA_ACCELERATORS`` for the "a")."""
    m = re.search(r"^\s*\.target\s+(sm_\w+)", listing, re.M)
    if m:
        return m.group(1)
    m = re.search(r"^\s*\.headerflags\s+(.*)$", listing, re.M)
    if m:
        sm = re.search(r"EF_CUDA_SM(\d+)", m.group(1))
        if sm:
            return f"sm_{sm.group(1)}" + ("a" if "EF_CUDA_ACCELERATORS" in m.group(1) else "")
    return None


def _sass_for_kernel(sass_text: str, kernel: str) -> str:
    """The part of a multi-kernel listing that belongs to ``.text.<kernel>``."""
    marker = re.compile(r"^\s*\.section\s+\.text\.(\S+?),", re.M)
    spans = [(m.start(), m.group(1)) for m in marker.finditer(sass_text)]
    if len(spans) <= 1:
        return sass_text
    for i, (start, name) in enumerate(spans):
        if name == kernel:
            end = spans[i + 1][0] if i + 1 < len(spans) else len(sass_text)
            return sass_text[start:end]
    return sass_text


def kernel_facts(compiled, kernel: str | None = None, nvdisasm: str | None = None) -> KernelFacts:
    """Read registers, stack, spills, shared memory, threads and SASS of a compiled kernel.

    Args:
        compiled: a ``cute.compile`` result (``JitCompiledFunction``) with ``.ir_module``;
            or the bytes of a cubin / fatbin.
        kernel: which entry function when the cubin holds several (default: the only one;
            InspectError if there are several and none is named).
        nvdisasm: path of nvdisasm (default: :func:`find_nvdisasm`).

    Needs no GPU. Raises InspectError when the object holds no readable cubin or nvdisasm
    is missing.
    """
    if isinstance(compiled, (bytes, bytearray)):
        cubins = cubins_from_fatbin(bytes(compiled))
        launch = {"smem": [], "block": []}
    else:
        cubins = cubins_from_compiled(compiled)
        launch = _launch_config(compiled)
    found = []
    for elf in cubins:
        for facts in elf_facts(elf):
            found.append((elf, facts))
    if not found:
        raise InspectError("the cubin contains no kernel")
    if kernel is None:
        if len(found) > 1:
            names = [f["name"] for _, f in found]
            raise InspectError(f"several kernels in the cubin, name one of {names}")
        elf, facts = found[0]
    else:
        matches = [(e, f) for e, f in found if f["name"] == kernel]
        if not matches:
            raise ValueError(f"kernel must be one of {[f['name'] for _, f in found]}, got {kernel!r}")
        elf, facts = matches[0]
    if facts["registers"] is None:
        raise InspectError(f"no register count (EIATTR_REGCOUNT) for {facts['name']}")

    listing = disassemble(elf, nvdisasm)
    arch = _listing_arch(listing) or f"sm_{facts['sm']}"
    sass_text = _sass_for_kernel(listing, facts["name"])
    instrs = parse_sass(sass_text)
    spill_st = sum(i.width // 8 for i in instrs if i.opcode == "STL")
    spill_ld = sum(i.width // 8 for i in instrs if i.opcode == "LDL")

    section = facts["shared_section_bytes"]
    reserved = SM90_SHARED_RESERVED_IN_SECTION if sm_number(arch) >= 90 else 0
    smem_static = max(0, section - reserved)
    # one kernel per module: every constant launch of it requests the same amount
    smem_dynamic = max(launch["smem"]) if launch["smem"] else 0

    threads = None
    for dims in (facts["reqntid"], facts["max_threads"]):
        if dims:
            threads = dims[0] * dims[1] * dims[2]
            break
    if threads is None and len(set(launch["block"])) == 1:
        x, y, z = launch["block"][0]
        threads = x * y * z

    return KernelFacts(
        name=facts["name"],
        arch=arch,
        registers=facts["registers"],
        stack_bytes=facts["stack_bytes"],
        spill_store_bytes=spill_st,
        spill_load_bytes=spill_ld,
        spill_bytes=spill_st + spill_ld,
        smem_static_bytes=smem_static,
        smem_dynamic_bytes=smem_dynamic,
        smem_bytes=smem_static + smem_dynamic,
        threads=threads,
        code_bytes=facts["code_bytes"],
        sass=sass_histogram(sass_text),
        sass_text=sass_text,
    )


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .spec import KV_DTYPES, PROJ_DTYPES, STATE_DTYPES, X_DTYPES

    p = argparse.ArgumentParser(
        prog="python -m mamba3_step inspect",
        description="Compile one specialisation of the step kernel (no GPU needed) and report "
        "registers, spills, shared memory, threads, occupancy, a SASS histogram, compile time "
        "and the bytes one decode step moves. Default: the flagship configuration, dense mode.",
    )
    p.add_argument("--arch", default="sm_90a", help="target, e.g. sm_90a, sm_100a (default sm_90a)")
    p.add_argument("--dstate", type=int, default=128, help="N (default 128)")
    p.add_argument("--headdim", type=int, default=64, help="D (default 64)")
    p.add_argument("--mimo", type=int, default=4, help="R (default 4)")
    p.add_argument("--state-dtype", default="float32", choices=STATE_DTYPES)
    p.add_argument("--kv-dtype", default="bfloat16", choices=KV_DTYPES, help="B, C, Bstate")
    p.add_argument("--x-dtype", default="bfloat16", choices=X_DTYPES, help="x, z, Xstate, out")
    p.add_argument("--proj-dtype", default="bfloat16", choices=PROJ_DTYPES, help="xproj, zproj, outproj")
    p.add_argument("--tile-d", type=int, default=0, help="rows of D per CTA (default: per-config)")
    p.add_argument("--num-warps", type=int, default=0, help="warps per CTA (default: per-config)")
    p.add_argument("--pool", action="store_true", help="pool mode (state_batch_indices)")
    p.add_argument("--dst", action="store_true", help="separate dst_state_batch_indices (needs --pool)")
    p.add_argument("--update-kv-state", action="store_true", help="store this step's B/x into Bstate/Xstate")
    p.add_argument("--no-z", action="store_true", help="no z gate")
    p.add_argument("--no-outproj", action="store_true", help="no outproj (out is (B, R, H, D))")
    p.add_argument("--batch", type=int, default=256, help="B for the bytes-per-step figure (default 256)")
    p.add_argument("--heads", type=int, default=48, help="H for the bytes-per-step figure (default 48)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--sass", action="store_true", help="also print the SASS listing (text mode)")
    return p


def spec_from_args(args):
    """The StepSpec the CLI flags describe; ValueError naming the flag on bad input."""
    from .spec import StepSpec
    from .tiling import shape_problem, tiling_problem

    if args.dst and not args.pool:
        raise ValueError("--dst needs --pool (dst_state_batch_indices exist in pool mode only)")
    problem = shape_problem(args.dstate, args.headdim, args.mimo)
    if problem:
        raise ValueError(problem)
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if args.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {args.heads}")
    spec = StepSpec(
        dstate=args.dstate, headdim=args.headdim, mimo=args.mimo,
        state_dtype=args.state_dtype, kv_dtype=args.kv_dtype, x_dtype=args.x_dtype,
        proj_dtype=args.proj_dtype, tile_D=args.tile_d, num_warps=args.num_warps,
        pool=args.pool, has_dst=args.dst, update_kv_state=args.update_kv_state,
        has_z=not args.no_z, has_outproj=not args.no_outproj,
    ).with_default_tiling()
    problem = tiling_problem(spec)
    if problem:
        raise ValueError(problem)
    return spec


def inspect_spec(spec, arch: str = "sm_90a", batch: int = 256, heads: int = 48,
                 compiled=None) -> tuple[dict, KernelFacts]:
    """Compile ``spec`` for ``arch`` and return (report dict, KernelFacts).

    ``compiled``: an already compiled kernel of ``spec`` for ``arch`` to read instead of
    compiling (``compile_seconds`` is then None).

    The report holds ``spec``, ``arch``, ``kernel``, ``registers``, ``stack_bytes``,
    ``spill_bytes`` (+ store/load split), ``smem_bytes`` (+ static/dynamic split),
    ``threads``, ``occupancy``, ``sass``, ``compile_seconds``, ``bytes_per_step`` (per
    tensor and ``total`` at ``batch`` lanes and ``heads`` heads, all lanes live) and
    ``batch``/``heads``.
    """
    from .bytes_model import bytes_per_step
    from .kernel import compile_step_kernel
    from .tiling import thread_layout

    sm_number(arch)
    compile_seconds = None
    if compiled is None:
        t0 = time.perf_counter()
        compiled = compile_step_kernel(spec, arch=arch)
        compile_seconds = round(time.perf_counter() - t0, 3)
    facts = kernel_facts(compiled)
    expected_threads = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype).num_threads
    threads = facts.threads if facts.threads is not None else expected_threads
    report = {
        "spec": spec.as_dict(),
        "arch": arch,
        "kernel": facts.name,
        "registers": facts.registers,
        "stack_bytes": facts.stack_bytes,
        "spill_bytes": facts.spill_bytes,
        "spill_store_bytes": facts.spill_store_bytes,
        "spill_load_bytes": facts.spill_load_bytes,
        "smem_bytes": facts.smem_bytes,
        "smem_static_bytes": facts.smem_static_bytes,
        "smem_dynamic_bytes": facts.smem_dynamic_bytes,
        "threads": threads,
        "threads_expected_from_tiling": expected_threads,
        "occupancy": theoretical_occupancy(facts.registers, threads, facts.smem_bytes, arch),
        "code_bytes": facts.code_bytes,
        "sass": facts.sass,
        "compile_seconds": compile_seconds,
        "batch": batch,
        "heads": heads,
        "bytes_per_step": bytes_per_step(spec, batch, heads),
    }
    return report, facts


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_report(report: dict) -> str:
    s = report["spec"]
    mode = "pool" if s["pool"] else "dense"
    flags = [k for k in ("has_dst", "update_kv_state", "has_z", "has_outproj") if s[k]]
    lines = [
        f"mamba3_step kernel for {report['arch']}: N={s['dstate']} D={s['headdim']} R={s['mimo']} "
        f"state={s['state_dtype']} kv={s['kv_dtype']} x={s['x_dtype']} proj={s['proj_dtype']} "
        f"tile_D={s['tile_D']} num_warps={s['num_warps']} mode={mode} {' '.join(flags)}",
        f"  kernel            {report['kernel']}",
        f"  compile           "
        + ("(not compiled here)" if report["compile_seconds"] is None else f"{report['compile_seconds']:.2f} s"),
        f"  registers/thread  {report['registers']}",
        f"  stack frame       {report['stack_bytes']} B",
        f"  spills            {report['spill_bytes']} B "
        f"(stores {report['spill_store_bytes']} B, loads {report['spill_load_bytes']} B)",
        f"  shared mem/CTA    {report['smem_bytes']} B "
        f"(static {report['smem_static_bytes']} B, dynamic {report['smem_dynamic_bytes']} B)",
        f"  threads/CTA       {report['threads']}",
    ]
    occ = report["occupancy"]
    if occ:
        lines.append(
            f"  occupancy         {occ['ctas_per_sm']} CTAs = {occ['warps_per_sm']}/{occ['max_warps_per_sm']} "
            f"warps per SM ({100 * occ['occupancy']:.1f}%), limited by {occ['limiter']}"
        )
    else:
        lines.append("  occupancy         (no limits table for this arch)")
    lines.append(f"  code              {report['code_bytes']} B, {report['sass'].get('total', 0)} instructions "
                 f"(+{report['sass'].get('NOP', 0)} NOP padding)")
    lines.append("  SASS histogram (static counts; '@P' = predicated):")
    mem = {k: v for k, v in report["sass"].items() if k.split(" ")[-1].split(".")[0] in MEMORY_OPS}
    other = {k: v for k, v in report["sass"].items() if k not in mem and k not in ("total", "NOP")}
    for title, group in (("memory", mem), ("other", other)):
        items = sorted(group.items(), key=lambda kv: (-kv[1], kv[0]))
        row = []
        for k, v in items:
            row.append(f"{k}={v}")
        for i in range(0, len(row), 6):
            lines.append(f"    {title + ':' if i == 0 else '':<8}" + "  ".join(row[i : i + 6]))
    bps = report["bytes_per_step"]
    lines.append(f"  bytes per step    B={report['batch']} H={report['heads']} (all lanes live, modelled):")
    for k, v in bps.items():
        if k != "total" and v:
            lines.append(f"    {k:<26}{v:>14,d}  {_fmt_bytes(v)}")
    lines.append(f"    {'total':<26}{bps['total']:>14,d}  {_fmt_bytes(bps['total'])}")
    return "\n".join(lines)


def cli_main(argv: list[str] | None = None) -> int:
    """``python -m mamba3_step inspect ...``; returns the exit status (2 on bad flags)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
        sm_number(args.arch)
    except ValueError as e:
        parser.error(str(e))  # exits 2 with the message
    try:
        report, facts = inspect_spec(spec, args.arch, args.batch, args.heads)
    except InspectError as e:
        print(f"inspect: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, sort_keys=False))
    else:
        print(format_report(report))
        if args.sass:
            print(facts.sass_text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli_main())
