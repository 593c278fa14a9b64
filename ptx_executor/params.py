"""Kernel parameter structs, built the way the DSL's host launcher passes them.

A CuteDSL tensor argument reaches the kernel as a struct: the data pointer, then the
*dynamic* shape values (i32), then the *dynamic* stride values (i64 or i32), nested as the
layout nests them. The compiled host launcher's signature states these types (for
example ``!llvm.struct<(ptr<1>, struct<(struct<(i32, i32)>, struct<(i64, i64, i64)>)>)>``
for a tensor with two dynamic extents and three dynamic strides). This module parses such
types, lays them out with the C rules LLVM uses for the ``.param`` space (each field at its
natural alignment, the struct padded to its largest alignment), and packs values into
bytes. The caller checks every struct's size against the PTX ``.param`` declaration, so a
layout this module got wrong cannot pass silently.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from .errors import PTXError

_SCALARS = {"i1": (1, 1), "i8": (1, 1), "i16": (2, 2), "i32": (4, 4), "i64": (8, 8), "f32": (4, 4),
            "f64": (8, 8), "ptr": (8, 8)}


@dataclass(frozen=True)
class LType:
    """A parsed LLVM type: a scalar (``kind``) or a struct of ``fields``."""
    kind: str  # "struct" or a scalar name
    fields: tuple = ()

    def size_align(self) -> tuple[int, int]:
        if self.kind != "struct":
            return _SCALARS[self.kind]
        off, align = 0, 1
        for f in self.fields:
            s, a = f.size_align()
            off = -(-off // a) * a + s
            align = max(align, a)
        return -(-off // align) * align, align

    def leaves(self) -> list[tuple[str, int]]:
        """``(scalar kind, byte offset)`` of every scalar, in order."""
        out: list = []
        self._leaves(0, out)
        return out

    def _leaves(self, base: int, out: list) -> None:
        if self.kind != "struct":
            out.append((self.kind, base))
            return
        off = 0
        for f in self.fields:
            s, a = f.size_align()
            off = -(-off // a) * a
            f._leaves(base + off, out)
            off += s


def parse_llvm_type(text: str) -> LType:
    """Parse ``!llvm.struct<(...)>``, ``!llvm.ptr``, ``i32``... (address spaces ignored)."""
    toks = re.findall(r"struct<\(|\)>|ptr(?:<\d+>)?|i\d+|f32|f64|,", text.replace("!llvm.", ""))
    pos = 0

    def one() -> LType:
        nonlocal pos
        tok = toks[pos]
        pos += 1
        if tok == "struct<(":
            fields = []
            while toks[pos] != ")>":
                if toks[pos] == ",":
                    pos += 1
                    continue
                fields.append(one())
            pos += 1
            return LType("struct", tuple(fields))
        if tok.startswith("ptr"):
            return LType("ptr")
        if tok in _SCALARS:
            return LType(tok)
        raise PTXError(f"cannot parse LLVM type near {tok!r} in {text!r}")

    t = one()
    if pos != len(toks):
        raise PTXError(f"trailing tokens in LLVM type {text!r}")
    return t


def pack(t: LType, values: list) -> bytes:
    """Bytes of struct ``t`` holding ``values`` (one per leaf, in order; ints)."""
    leaves = t.leaves()
    if len(leaves) != len(values):
        raise PTXError(f"struct has {len(leaves)} fields, got {len(values)} values")
    size, _ = t.size_align()
    buf = bytearray(size)
    fmt = {"i8": "<b", "i16": "<h", "i32": "<i", "i64": "<q", "ptr": "<Q", "f32": "<f", "f64": "<d", "i1": "<B"}
    for (kind, off), v in zip(leaves, values):
        code = fmt[kind]
        if code in ("<i", "<q", "<h", "<b") and isinstance(v, int):
            bits = struct.calcsize(code) * 8
            v = ((v + (1 << (bits - 1))) % (1 << bits)) - (1 << (bits - 1))  # wrap to the signed range
        struct.pack_into(code, buf, off, v)
    return bytes(buf)
