"""Arithmetic, logic, comparison, move and conversion instructions.

Integer results wrap at their width (numpy's modular unsigned/signed arithmetic); shifts
by the width or more give 0 (or the sign fill for ``shr.s``), as PTX defines. Floating
point follows :mod:`mamba3_step.ptx.numerics`.
"""

from __future__ import annotations

import numpy as np

from . import numerics as fp
from .frame import VIEW
from .isa import check_mods, handler, type_of, unsupported
from .parse import Vec

_ROUND = ("rn", "rz", "rm", "rp")
_INT_TYPES = ("s8", "u8", "b8", "s16", "u16", "b16", "s32", "u32", "b32", "s64", "u64", "b64")
_HALF = ("f16", "bf16", "f16x2", "bf16x2")


def _rounding(mods: set, default: str = "rn") -> str:
    found = [m for m in _ROUND if m in mods]
    return found[0] if found else default


def _bits(t: str) -> int:
    return np.dtype(VIEW[t]).itemsize * 8


def _u(t: str):
    return {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[_bits(t)]


def _s(t: str):
    return {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}[_bits(t)]


def _unary(ins, t, fn):
    d, a = ins.operands

    def run(F, idx):
        F.write(d, fn(F.read(a, VIEW[t], idx)), VIEW[t], idx)
    return run


def _binary(ins, t, fn, out_t=None):
    d, a, b = ins.operands[:3]
    out = VIEW[out_t or t]

    def run(F, idx):
        F.write(d, fn(F.read(a, VIEW[t], idx), F.read(b, VIEW[t], idx)), out, idx)
    return run


def _ternary(ins, t, fn, out_t=None):
    d, a, b, c = ins.operands
    out = VIEW[out_t or t]

    def run(F, idx):
        F.write(d, fn(F.read(a, VIEW[t], idx), F.read(b, VIEW[t], idx), F.read(c, VIEW[t], idx)), out, idx)
    return run


# ------------------------------------------------------------------------ 16-bit floats

def _half_fmt(t: str) -> str:
    return "bf16" if t.startswith("bf16") else "f16"


def _half_lanes(t: str, fn):
    """Apply ``fn`` (on uint16 bit arrays) to each 16-bit lane of a scalar or x2 value."""
    if not t.endswith("x2"):
        return fn

    def lanes(*vals):
        lo = fn(*[(np.asarray(v) & np.uint32(0xFFFF)).astype(np.uint16) for v in vals])
        hi = fn(*[(np.asarray(v) >> np.uint32(16)).astype(np.uint16) for v in vals])
        return (hi.astype(np.uint32) << np.uint32(16)) | lo.astype(np.uint32)
    return lanes


def _half_op(ins, t, kind, mods):
    fmt = _half_fmt(t)
    if mods & {"ftz", "sat", "relu", "rz", "rm", "rp"} - ({"ftz"} if fmt == "f16" else set()):
        raise unsupported(ins, "16-bit arithmetic is implemented with .rn only")

    def exact(*bits):
        v = [fp.bits16_to_f64(b, fmt) for b in bits]
        if kind == "add":
            hi, lo = fp.two_sum(v[0], v[1])
        elif kind == "sub":
            hi, lo = fp.two_sum(v[0], -v[1])
        elif kind == "mul":
            hi, lo = v[0] * v[1], np.zeros_like(v[0])  # exact: 11/8-bit significands
        else:  # fma
            hi, lo = fp.two_sum(v[0] * v[1], v[2])
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(hi)
            lo = np.where(bad, 0.0, lo)
        return fp.round_to_16(hi, lo, fmt)
    return _half_lanes(t, exact)


# ------------------------------------------------------------------------ add sub mul mad fma

@handler("add", "sub")
def _add_sub(ins, ctx):
    t = type_of(ins)
    sub = ins.base == "sub"
    if t == "f32":
        mods = check_mods(ins, {"f32", "ftz", "sat", *_ROUND})
        mode = _rounding(mods)
        return _binary(ins, t, lambda a, b: fp.add32(a, -b if sub else b, mode, "ftz" in mods, "sat" in mods))
    if t == "f64":
        check_mods(ins, {"f64", "rn"})
        return _binary(ins, t, lambda a, b: a - b if sub else a + b)
    if t in _HALF:
        mods = check_mods(ins, {t, "rn", "ftz", "sat"})
        return _binary(ins, t, _half_op(ins, t, ins.base, mods))
    if t in _INT_TYPES:
        mods = check_mods(ins, {t, "sat"})
        if "sat" in mods:
            if t != "s32":
                raise unsupported(ins, ".sat is defined for .s32 only")
            lim = (-2**31, 2**31 - 1)
            return _binary(ins, t, lambda a, b: np.clip(a.astype(np.int64) + (-1 if sub else 1) * b.astype(np.int64),
                                                        *lim).astype(np.int32))
        u = _u(t)
        return _binary(ins, t, lambda a, b: (a.view(u) - b.view(u) if sub else a.view(u) + b.view(u)).view(VIEW[t]))
    raise unsupported(ins)


def _mul_int(ins, t, part: str):
    """``mul.{lo,hi,wide}`` on integers: the low or high half of the double-width product."""
    signed = t.startswith("s")
    bits = _bits(t)
    if part == "wide":
        if bits > 32:
            raise unsupported(ins, "mul.wide is defined for 16/32-bit types")
        wide = np.int64 if signed else np.uint64
        out_t = ("s" if signed else "u") + str(2 * bits)
        return lambda a, b: (a.astype(wide) * b.astype(wide)).astype(VIEW[out_t]), out_t
    if part == "lo" or bits < 64:
        if bits < 64 and part == "hi":
            wide = np.int64 if signed else np.uint64
            return lambda a, b: ((a.astype(wide) * b.astype(wide)) >> bits).astype(VIEW[t]), t
        u = _u(t)
        return lambda a, b: (a.view(u) * b.view(u)).view(VIEW[t]), t
    return lambda a, b: _mulhi64(a, b, signed), t


def _mulhi64(a, b, signed):
    """High 64 bits of a 64x64-bit product, from 32-bit halves."""
    au, bu = np.asarray(a).view(np.uint64), np.asarray(b).view(np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    a0, a1, b0, b1 = au & m32, au >> np.uint64(32), bu & m32, bu >> np.uint64(32)
    lo = a0 * b0
    mid1 = a1 * b0 + (lo >> np.uint64(32))
    mid2 = a0 * b1 + (mid1 & m32)
    hi = a1 * b1 + (mid1 >> np.uint64(32)) + (mid2 >> np.uint64(32))
    if signed:  # correct the unsigned high word for negative operands
        hi = hi - np.where(np.asarray(a).view(np.int64) < 0, bu, np.uint64(0))
        hi = hi - np.where(np.asarray(b).view(np.int64) < 0, au, np.uint64(0))
        return hi.view(np.int64)
    return hi


@handler("mul")
def _mul(ins, ctx):
    t = type_of(ins)
    if t == "f32":
        mods = check_mods(ins, {"f32", "ftz", "sat", *_ROUND})
        mode = _rounding(mods)
        return _binary(ins, t, lambda a, b: fp.mul32(a, b, mode, "ftz" in mods, "sat" in mods))
    if t == "f64":
        check_mods(ins, {"f64", "rn"})
        return _binary(ins, t, lambda a, b: a * b)
    if t in _HALF:
        mods = check_mods(ins, {t, "rn", "ftz", "sat"})
        return _binary(ins, t, _half_op(ins, t, "mul", mods))
    mods = check_mods(ins, {t, "lo", "hi", "wide"})
    part = next((m for m in ("lo", "hi", "wide") if m in mods), None)
    if part is None or t not in _INT_TYPES:
        raise unsupported(ins, "integer mul needs .lo, .hi or .wide")
    fn, out_t = _mul_int(ins, t, part)
    return _binary(ins, t, fn, out_t)


@handler("mad", "fma")
def _mad_fma(ins, ctx):
    t = type_of(ins)
    if t == "f32":
        mods = check_mods(ins, {"f32", "ftz", "sat", *_ROUND})
        mode = _rounding(mods)
        return _ternary(ins, t, lambda a, b, c: fp.fma32(a, b, c, mode, "ftz" in mods, "sat" in mods))
    if t == "f64":
        raise unsupported(ins, "fp64 fma is not implemented")
    if t in _HALF:
        mods = check_mods(ins, {t, "rn", "ftz", "sat", "relu"})
        return _ternary(ins, t, _half_op(ins, t, "fma", mods))
    if ins.base == "fma" or t not in _INT_TYPES:
        raise unsupported(ins)
    mods = check_mods(ins, {t, "lo", "hi", "wide", "sat"})
    part = next((m for m in ("lo", "hi", "wide") if m in mods), None)
    if part is None or "sat" in mods:
        raise unsupported(ins, "integer mad needs .lo, .hi or .wide (no .sat)")
    mul, out_t = _mul_int(ins, t, part)
    u = _u(out_t)
    d, a, b, c = ins.operands

    def run(F, idx):
        p = mul(F.read(a, VIEW[t], idx), F.read(b, VIEW[t], idx))
        F.write(d, (np.asarray(p).view(u) + F.read(c, VIEW[out_t], idx).view(u)).view(VIEW[out_t]), VIEW[out_t], idx)
    return run


# ------------------------------------------------------------------------ div rem min max ...

@handler("div")
def _div(ins, ctx):
    t = type_of(ins)
    if t == "f32":
        mods = check_mods(ins, {"f32", "ftz", "rn", "full", "approx"})
        if not mods & {"rn", "full", "approx"}:
            raise unsupported(ins, "div.f32 needs .rn, .full or .approx")
        return _binary(ins, t, lambda a, b: fp.div32(a, b, "ftz" in mods))
    if t == "f64":
        check_mods(ins, {"f64", "rn"})
        return _binary(ins, t, lambda a, b: a / b)
    if t in ("s32", "u32", "s64", "u64"):
        check_mods(ins, {t})
        return _binary(ins, t, lambda a, b: _int_divmod(a, b, t, rem=False))
    raise unsupported(ins)


@handler("rem")
def _rem(ins, ctx):
    t = type_of(ins)
    if t not in ("s32", "u32", "s64", "u64"):
        raise unsupported(ins)
    check_mods(ins, {t})
    return _binary(ins, t, lambda a, b: _int_divmod(a, b, t, rem=True))


def _int_divmod(a, b, t, rem):
    """Truncating integer division/remainder (C semantics); division by zero gives all ones."""
    a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
    zero = b == 0
    safe = np.where(zero, 1, b).astype(b.dtype)
    with np.errstate(all="ignore"):
        if t.startswith("s"):
            q = np.trunc(a.astype(np.float64) / safe.astype(np.float64)) if _bits(t) == 32 else None
            if q is None:  # 64-bit: avoid float rounding
                q = np.abs(a) // np.abs(safe) * np.sign(a) * np.sign(safe)
            q = q.astype(a.dtype)
        else:
            q = a // safe
        r = a - q * safe
    out = r if rem else q
    return np.where(zero, np.array(-1).astype(a.dtype) if not rem else a, out).astype(a.dtype)


@handler("abs", "neg")
def _abs_neg(ins, ctx):
    t = type_of(ins)
    if t in ("f32", "f64", "f16", "bf16"):
        check_mods(ins, {t, "ftz"})
        bits = _bits(t)
        sign = _u(t)(1 << (bits - 1))
        u = _u(t)
        if ins.base == "neg":
            return _unary(ins, t, lambda a: (np.asarray(a).view(u) ^ sign).view(VIEW[t]))
        return _unary(ins, t, lambda a: (np.asarray(a).view(u) & ~sign).view(VIEW[t]))
    if t in ("s16", "s32", "s64"):
        check_mods(ins, {t})
        if ins.base == "neg":
            return _unary(ins, t, lambda a: (-a.view(_u(t))).view(VIEW[t]))
        return _unary(ins, t, lambda a: np.where(a < 0, (-a.view(_u(t))).view(VIEW[t]), a))
    raise unsupported(ins)


@handler("min", "max")
def _min_max(ins, ctx):
    t = type_of(ins)
    is_max = ins.base == "max"
    if t == "f32":
        mods = check_mods(ins, {"f32", "ftz", "NaN"})
        if "NaN" in mods:
            def fn(a, b):
                r = fp.minmax32(a, b, is_max, "ftz" in mods)
                return np.where(np.isnan(a) | np.isnan(b), np.uint32(0x7FFFFFFF).view(np.float32), r)
            return _binary(ins, t, fn)
        return _binary(ins, t, lambda a, b: fp.minmax32(a, b, is_max, "ftz" in mods))
    if t in ("s16", "u16", "s32", "u32", "s64", "u64"):
        check_mods(ins, {t})
        return _binary(ins, t, np.maximum if is_max else np.minimum)
    raise unsupported(ins)


@handler("rcp", "sqrt", "rsqrt", "ex2", "lg2", "sin", "cos", "tanh")
def _special_fn(ins, ctx):
    t = type_of(ins)
    if t != "f32":
        raise unsupported(ins, "implemented for .f32")
    mods = check_mods(ins, {"f32", "ftz", "approx", "rn"})
    ftz = "ftz" in mods
    if "rn" in mods and ins.base in ("rcp", "sqrt"):
        if ins.base == "rcp":
            return _unary(ins, t, lambda a: fp.div32(np.float32(1.0), a, ftz))
        return _unary(ins, t, lambda a: fp.canon32(np.sqrt(fp.ftz32(a) if ftz else a).astype(np.float32)))
    if "approx" not in mods:
        raise unsupported(ins, f"{ins.base}.f32 needs .approx (or .rn for rcp/sqrt)")
    return _unary(ins, t, lambda a: fp.approx32(ins.base, a, ftz))


@handler("copysign")
def _copysign(ins, ctx):
    t = type_of(ins)
    if t != "f32":
        raise unsupported(ins)
    check_mods(ins, {"f32"})
    return _binary(ins, t, lambda a, b: np.copysign(b, a).astype(np.float32))


@handler("testp")
def _testp(ins, ctx):
    t = type_of(ins)
    kinds = {"finite": np.isfinite, "infinite": np.isinf, "number": lambda x: ~np.isnan(x),
             "notanumber": np.isnan,
             "normal": lambda x: np.isfinite(x) & (np.abs(x) >= np.finfo(x.dtype).tiny),
             "subnormal": lambda x: (x != 0) & (np.abs(x) < np.finfo(x.dtype).tiny)}
    kind = ins.mods[0]
    if t not in ("f32", "f64") or kind not in kinds:
        raise unsupported(ins)
    d, a = ins.operands

    def run(F, idx):
        F.write(d, kinds[kind](np.asarray(F.read(a, VIEW[t], idx))), np.bool_, idx)
    return run


# ------------------------------------------------------------------------ logic and bits

@handler("and", "or", "xor")
def _logic(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t})
    fn = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[ins.base]
    if t == "pred":
        return _binary(ins, t, fn)
    if t not in ("b16", "b32", "b64"):
        raise unsupported(ins)
    return _binary(ins, t, fn)


@handler("not", "cnot")
def _not(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t})
    if ins.base == "cnot":
        return _unary(ins, t, lambda a: (np.asarray(a) == 0).astype(VIEW[t]))
    if t == "pred":
        return _unary(ins, t, np.logical_not)
    return _unary(ins, t, np.invert)


@handler("shl", "shr")
def _shift(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t})
    bits = _bits(t)
    d, a, b = ins.operands
    signed = ins.base == "shr" and t.startswith("s")

    def run(F, idx):
        x = F.read(a, VIEW[t], idx)
        n = F.read(b, np.uint32, idx).astype(np.uint64)
        big = n >= bits
        k = np.where(big, 0, n).astype(VIEW[t] if not signed else np.int64)
        if ins.base == "shl":
            r = np.where(big, 0, (x.view(_u(t)) << k.astype(_u(t))))
            r = np.asarray(r).astype(_u(t)).view(VIEW[t])
        elif signed:
            r = np.where(big, np.where(x < 0, -1, 0), x >> k.astype(VIEW[t])).astype(VIEW[t])
        else:
            r = np.where(big, 0, x.view(_u(t)) >> k.astype(_u(t))).astype(_u(t)).view(VIEW[t])
        F.write(d, r, VIEW[t], idx)
    return run


@handler("popc", "clz", "brev", "bfind")
def _bitcount(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t, "shiftamt"} if ins.base == "bfind" else {t})
    if t not in ("b32", "b64", "u32", "u64", "s32", "s64"):
        raise unsupported(ins)
    bits = _bits(t)
    u = _u(t)

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
        return _unary(ins, t, brev)
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
    bits = _bits(t)
    d, a, b, c = ins.operands

    def run(F, idx):
        x = F.read(a, VIEW[t], idx)
        pos = np.minimum(F.read(b, np.uint32, idx) & np.uint32(0xFF), bits).astype(np.int64)
        ln = np.minimum(F.read(c, np.uint32, idx) & np.uint32(0xFF), bits).astype(np.int64)
        xu = np.asarray(x).view(_u(t)).astype(np.uint64)
        field = (xu >> np.minimum(pos, 63).astype(np.uint64)) & ((np.uint64(1) << np.minimum(ln, 63).astype(np.uint64)) - np.uint64(1))
        field = np.where(ln >= 64, xu >> np.minimum(pos, 63).astype(np.uint64), field)
        field = np.where(pos >= bits, 0, field).astype(np.uint64)
        if t.startswith("s"):
            sbit_pos = np.minimum(pos + ln - 1, bits - 1)
            sign = ((xu >> sbit_pos.astype(np.uint64)) & np.uint64(1)).astype(bool) & (ln > 0)
            fill = ~((np.uint64(1) << np.minimum(ln, 63).astype(np.uint64)) - np.uint64(1))
            field = np.where(sign & (ln < 64), field | fill, field)
        F.write(d, (field & np.uint64((1 << bits) - 1)).astype(_u(t)).view(VIEW[t]), VIEW[t], idx)
    return run


@handler("bfi")
def _bfi(ins, ctx):
    t = type_of(ins)
    if t not in ("b32", "b64"):
        raise unsupported(ins)
    check_mods(ins, {t})
    bits = _bits(t)
    d, a, b, c, e = ins.operands

    def run(F, idx):
        ins_v = F.read(a, VIEW[t], idx).astype(np.uint64)
        base = F.read(b, VIEW[t], idx).astype(np.uint64)
        pos = np.minimum(F.read(c, np.uint32, idx) & np.uint32(0xFF), bits).astype(np.uint64)
        ln = np.minimum(F.read(e, np.uint32, idx) & np.uint32(0xFF), bits).astype(np.uint64)
        mask = np.where(ln >= 64, ~np.uint64(0), (np.uint64(1) << np.minimum(ln, np.uint64(63))) - np.uint64(1))
        mask = np.where(pos >= bits, np.uint64(0), mask << np.minimum(pos, np.uint64(63)))
        r = (base & ~mask) | ((ins_v << np.minimum(pos, np.uint64(63))) & mask)
        F.write(d, (r & np.uint64((1 << bits) - 1)).astype(_u(t)), VIEW[t], idx)
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
