"""Logic and bit-manipulation instructions: and/or/xor/not/cnot, shifts, popc/clz/brev,
bfe/bfi, prmt, lop3, shf.

Integer results wrap at their width; shifts by the width or more give 0 (or the sign fill for
``shr.s``), as PTX defines.
"""

from __future__ import annotations

import numpy as np

from .frame import VIEW
from .isa import binary_op, bit_width, check_mods, handler, type_of, unary_op, unsigned_of, unsupported

# ------------------------------------------------------------------------ logic and bits

@handler("and", "or", "xor")
def _logic(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t})
    fn = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[ins.base]
    if t == "pred":
        return binary_op(ins, t, fn)
    if t not in ("b16", "b32", "b64"):
        raise unsupported(ins)
    return binary_op(ins, t, fn)


@handler("not", "cnot")
def _not(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t})
    if ins.base == "cnot":
        return unary_op(ins, t, lambda a: (np.asarray(a) == 0).astype(VIEW[t]))
    if t == "pred":
        return unary_op(ins, t, np.logical_not)
    return unary_op(ins, t, np.invert)


@handler("shl", "shr")
def _shift(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t})
    bits = bit_width(t)
    d, a, b = ins.operands
    signed = ins.base == "shr" and t.startswith("s")

    def run(F, idx):
        x = F.read(a, VIEW[t], idx)
        n = F.read(b, np.uint32, idx).astype(np.uint64)
        big = n >= bits
        k = np.where(big, 0, n).astype(VIEW[t] if not signed else np.int64)
        if ins.base == "shl":
            r = np.where(big, 0, (x.view(unsigned_of(t)) << k.astype(unsigned_of(t))))
            r = np.asarray(r).astype(unsigned_of(t)).view(VIEW[t])
        elif signed:
            r = np.where(big, np.where(x < 0, -1, 0), x >> k.astype(VIEW[t])).astype(VIEW[t])
        else:
            r = np.where(big, 0, x.view(unsigned_of(t)) >> k.astype(unsigned_of(t))).astype(unsigned_of(t)).view(VIEW[t])
        F.write(d, r, VIEW[t], idx)
    return run


@handler("popc", "clz", "brev", "bfind")
def _bitcount(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t, "shiftamt"} if ins.base == "bfind" else {t})
    if t not in ("b32", "b64", "u32", "u64", "s32", "s64"):
        raise unsupported(ins)
    bits = bit_width(t)
    u = unsigned_of(t)

    def popc(a):
        return np.bitwise_count(a.view(u)).astype(np.uint32)

    def clz(a):
        x = a.view(u).astype(np.uint64)
        halves = [(x >> np.uint64(32)), x & np.uint64(0xFFFFFFFF)] if bits == 64 else [x]
        n = np.zeros(x.shape, np.uint32)
        done = np.zeros(x.shape, bool)
        for h in halves:  # each half < 2**32 converts to float64 exactly
            _, exp = np.frexp(h.astype(np.float64))
            lz = np.where(h == 0, 32, 32 - exp).astype(np.uint32)
            n = np.where(done, n, n + lz)
            done |= h != 0
        return n

    def brev(a):
        x = a.view(u)
        r = np.zeros(x.shape, u)
        for k in range(bits):
            r |= ((x >> u(k)) & u(1)) << u(bits - 1 - k)
        return r.view(VIEW[t])

    if ins.base == "popc":
        return _unary_out(ins, t, popc, np.uint32)
    if ins.base == "clz":
        return _unary_out(ins, t, clz, np.uint32)
    if ins.base == "brev":
        return unary_op(ins, t, brev)
    raise unsupported(ins, "bfind is not implemented")


def _unary_out(ins, t, fn, out):
    d, a = ins.operands

    def run(F, idx):
        F.write(d, fn(F.read(a, VIEW[t], idx)), out, idx)
    return run


@handler("bfe")
def _bfe(ins, ctx):
    t = type_of(ins)
    if t not in ("u32", "s32", "u64", "s64"):
        raise unsupported(ins)
    check_mods(ins, {t})
    bits = bit_width(t)
    d, a, b, c = ins.operands

    def run(F, idx):
        x = F.read(a, VIEW[t], idx)
        pos = np.minimum(F.read(b, np.uint32, idx) & np.uint32(0xFF), bits).astype(np.int64)
        ln = np.minimum(F.read(c, np.uint32, idx) & np.uint32(0xFF), bits).astype(np.int64)
        xu = np.asarray(x).view(unsigned_of(t)).astype(np.uint64)
        field = (xu >> np.minimum(pos, 63).astype(np.uint64)) & ((np.uint64(1) << np.minimum(ln, 63).astype(np.uint64)) - np.uint64(1))
        field = np.where(ln >= 64, xu >> np.minimum(pos, 63).astype(np.uint64), field)
        field = np.where(pos >= bits, 0, field).astype(np.uint64)
        if t.startswith("s"):
            sbit_pos = np.minimum(pos + ln - 1, bits - 1)
            sign = ((xu >> sbit_pos.astype(np.uint64)) & np.uint64(1)).astype(bool) & (ln > 0)
            fill = ~((np.uint64(1) << np.minimum(ln, 63).astype(np.uint64)) - np.uint64(1))
            field = np.where(sign & (ln < 64), field | fill, field)
        F.write(d, (field & np.uint64((1 << bits) - 1)).astype(unsigned_of(t)).view(VIEW[t]), VIEW[t], idx)
    return run


@handler("bfi")
def _bfi(ins, ctx):
    t = type_of(ins)
    if t not in ("b32", "b64"):
        raise unsupported(ins)
    check_mods(ins, {t})
    bits = bit_width(t)
    d, a, b, c, e = ins.operands

    def run(F, idx):
        ins_v = F.read(a, VIEW[t], idx).astype(np.uint64)
        base = F.read(b, VIEW[t], idx).astype(np.uint64)
        pos = np.minimum(F.read(c, np.uint32, idx) & np.uint32(0xFF), bits).astype(np.uint64)
        ln = np.minimum(F.read(e, np.uint32, idx) & np.uint32(0xFF), bits).astype(np.uint64)
        mask = np.where(ln >= 64, ~np.uint64(0), (np.uint64(1) << np.minimum(ln, np.uint64(63))) - np.uint64(1))
        mask = np.where(pos >= bits, np.uint64(0), mask << np.minimum(pos, np.uint64(63)))
        r = (base & ~mask) | ((ins_v << np.minimum(pos, np.uint64(63))) & mask)
        F.write(d, (r & np.uint64((1 << bits) - 1)).astype(unsigned_of(t)), VIEW[t], idx)
    return run


@handler("prmt")
def _prmt(ins, ctx):
    if ins.mods != ("b32",):
        raise unsupported(ins, "only the default byte-permute mode is implemented")
    d, a, b, c = ins.operands

    def run(F, idx):
        x = F.read(a, np.uint32, idx).astype(np.uint64)
        y = F.read(b, np.uint32, idx).astype(np.uint64)
        sel = F.read(c, np.uint32, idx).astype(np.uint64)
        x, y, sel = np.broadcast_arrays(x, y, sel)
        pool = x | (y << np.uint64(32))
        r = np.zeros(x.shape, np.uint64)
        for k in range(4):
            nib = (sel >> np.uint64(4 * k)) & np.uint64(0xF)
            byte = (pool >> ((nib & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
            byte = np.where(nib & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
            r |= byte << np.uint64(8 * k)
        F.write(d, r.astype(np.uint32), np.uint32, idx)
    return run


@handler("lop3")
def _lop3(ins, ctx):
    t = type_of(ins)
    if t != "b32":
        raise unsupported(ins)
    d, a, b, c, lut = ins.operands

    def run(F, idx):
        x, y, z = (F.read(o, np.uint32, idx) for o in (a, b, c))
        table = int(F.read(lut, np.uint32, None))
        r = np.zeros(np.broadcast(x, y, z).shape, np.uint32)
        for i in range(8):
            if table >> i & 1:
                r |= (x if i & 4 else ~x) & (y if i & 2 else ~y) & (z if i & 1 else ~z)
        F.write(d, r, np.uint32, idx)
    return run


@handler("shf")
def _shf(ins, ctx):
    mods = check_mods(ins, {"l", "r", "wrap", "clamp", "b32"})
    left = "l" in mods
    clamp = "clamp" in mods
    d, a, b, c = ins.operands

    def run(F, idx):
        lo = F.read(a, np.uint32, idx).astype(np.uint64)
        hi = F.read(b, np.uint32, idx).astype(np.uint64)
        n = F.read(c, np.uint32, idx).astype(np.uint64)
        n = np.minimum(n, np.uint64(32)) if clamp else n & np.uint64(31)
        pair = (hi << np.uint64(32)) | lo
        r = (pair << n) >> np.uint64(32) if left else pair >> n
        F.write(d, (r & np.uint64(0xFFFFFFFF)).astype(np.uint32), np.uint32, idx)
    return run
