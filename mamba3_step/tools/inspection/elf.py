"""Reading the cubin the DSL embedded in a compiled kernel: fatbin, ELF sections, ``.nv.info``
attributes. No GPU needed.

* The cubin is the ``llvm.mlir.global`` whose name ends in ``_binary`` in
  ``compiled.ir_module``: a fatbin whose ELF entries are the cubins.
* ``registers``: ``EIATTR_REGCOUNT`` (0x2f) in the ELF's ``.nv.info`` section;
  ``stack_bytes``: ``EIATTR_FRAME_SIZE`` (0x11). These are the figures ``ptxas -v`` prints
  as "Used N registers" and "N bytes stack frame".
* The dynamic shared memory and the block size a launch requests are read from the host IR
  by :func:`ptx_executor.host.launch_config`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["ELF_MAGIC", "InspectError", "cubins_from_compiled", "cubins_from_fatbin", "elf_facts"]


class InspectError(RuntimeError):
    """The compiled object does not contain what this module knows how to read."""


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
