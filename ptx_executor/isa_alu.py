"""Arithmetic, logic, comparison, move and conversion instructions.

Integer results wrap at their width (numpy's modular unsigned/signed arithmetic); shifts
by the width or more give 0 (or the sign fill for ``shr.s``), as PTX defines. Floating
point follows :mod:`ptx_executor.numerics`.
"""

from __future__ import annotations

import numpy as np

from . import numerics as fp
from .frame import VIEW
from .isa import binary_op, bit_width, check_mods, handler, ternary_op, type_of, unary_op, unsigned_of, unsupported

_ROUND = ("rn", "rz", "rm", "rp")
_INT_TYPES = ("s8", "u8", "b8", "s16", "u16", "b16", "s32", "u32", "b32", "s64", "u64", "b64")
_HALF = ("f16", "bf16", "f16x2", "bf16x2")


def _rounding(mods: set, default: str = "rn") -> str:
    found = [m for m in _ROUND if m in mods]
    return found[0] if found else default


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
        return binary_op(ins, t, lambda a, b: fp.add32(a, -b if sub else b, mode, "ftz" in mods, "sat" in mods))
    if t == "f64":
        check_mods(ins, {"f64", "rn"})
        return binary_op(ins, t, lambda a, b: a - b if sub else a + b)
    if t in _HALF:
        mods = check_mods(ins, {t, "rn", "ftz", "sat"})
        return binary_op(ins, t, _half_op(ins, t, ins.base, mods))
    if t in _INT_TYPES:
        mods = check_mods(ins, {t, "sat"})
        if "sat" in mods:
            if t != "s32":
                raise unsupported(ins, ".sat is defined for .s32 only")
            lim = (-2**31, 2**31 - 1)
            return binary_op(ins, t, lambda a, b: np.clip(a.astype(np.int64) + (-1 if sub else 1) * b.astype(np.int64),
                                                        *lim).astype(np.int32))
        u = unsigned_of(t)
        return binary_op(ins, t, lambda a, b: (a.view(u) - b.view(u) if sub else a.view(u) + b.view(u)).view(VIEW[t]))
    raise unsupported(ins)


def _mul_int(ins, t, part: str):
    """``mul.{lo,hi,wide}`` on integers: the low or high half of the double-width product."""
    signed = t.startswith("s")
    bits = bit_width(t)
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
        u = unsigned_of(t)
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
        return binary_op(ins, t, lambda a, b: fp.mul32(a, b, mode, "ftz" in mods, "sat" in mods))
    if t == "f64":
        check_mods(ins, {"f64", "rn"})
        return binary_op(ins, t, lambda a, b: a * b)
    if t in _HALF:
        mods = check_mods(ins, {t, "rn", "ftz", "sat"})
        return binary_op(ins, t, _half_op(ins, t, "mul", mods))
    mods = check_mods(ins, {t, "lo", "hi", "wide"})
    part = next((m for m in ("lo", "hi", "wide") if m in mods), None)
    if part is None or t not in _INT_TYPES:
        raise unsupported(ins, "integer mul needs .lo, .hi or .wide")
    fn, out_t = _mul_int(ins, t, part)
    return binary_op(ins, t, fn, out_t)


@handler("mad", "fma")
def _mad_fma(ins, ctx):
    t = type_of(ins)
    if t == "f32":
        mods = check_mods(ins, {"f32", "ftz", "sat", *_ROUND})
        mode = _rounding(mods)
        return ternary_op(ins, t, lambda a, b, c: fp.fma32(a, b, c, mode, "ftz" in mods, "sat" in mods))
    if t == "f64":
        raise unsupported(ins, "fp64 fma is not implemented")
    if t in _HALF:
        mods = check_mods(ins, {t, "rn", "ftz", "sat", "relu"})
        return ternary_op(ins, t, _half_op(ins, t, "fma", mods))
    if ins.base == "fma" or t not in _INT_TYPES:
        raise unsupported(ins)
    mods = check_mods(ins, {t, "lo", "hi", "wide", "sat"})
    part = next((m for m in ("lo", "hi", "wide") if m in mods), None)
    if part is None or "sat" in mods:
        raise unsupported(ins, "integer mad needs .lo, .hi or .wide (no .sat)")
    mul, out_t = _mul_int(ins, t, part)
    u = unsigned_of(out_t)
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
        return binary_op(ins, t, lambda a, b: fp.div32(a, b, "ftz" in mods))
    if t == "f64":
        check_mods(ins, {"f64", "rn"})
        return binary_op(ins, t, lambda a, b: a / b)
    if t in ("s32", "u32", "s64", "u64"):
        check_mods(ins, {t})
        return binary_op(ins, t, lambda a, b: _int_divmod(a, b, t, rem=False))
    raise unsupported(ins)


@handler("rem")
def _rem(ins, ctx):
    t = type_of(ins)
    if t not in ("s32", "u32", "s64", "u64"):
        raise unsupported(ins)
    check_mods(ins, {t})
    return binary_op(ins, t, lambda a, b: _int_divmod(a, b, t, rem=True))


def _int_divmod(a, b, t, rem):
    """Truncating integer division/remainder (C semantics); division by zero gives all ones."""
    a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
    zero = b == 0
    safe = np.where(zero, 1, b).astype(b.dtype)
    with np.errstate(all="ignore"):
        if t.startswith("s"):
            q = np.trunc(a.astype(np.float64) / safe.astype(np.float64)) if bit_width(t) == 32 else None
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
        bits = bit_width(t)
        sign = unsigned_of(t)(1 << (bits - 1))
        u = unsigned_of(t)
        if ins.base == "neg":
            return unary_op(ins, t, lambda a: (np.asarray(a).view(u) ^ sign).view(VIEW[t]))
        return unary_op(ins, t, lambda a: (np.asarray(a).view(u) & ~sign).view(VIEW[t]))
    if t in ("s16", "s32", "s64"):
        check_mods(ins, {t})
        if ins.base == "neg":
            return unary_op(ins, t, lambda a: (-a.view(unsigned_of(t))).view(VIEW[t]))
        return unary_op(ins, t, lambda a: np.where(a < 0, (-a.view(unsigned_of(t))).view(VIEW[t]), a))
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
            return binary_op(ins, t, fn)
        return binary_op(ins, t, lambda a, b: fp.minmax32(a, b, is_max, "ftz" in mods))
    if t in ("s16", "u16", "s32", "u32", "s64", "u64"):
        check_mods(ins, {t})
        return binary_op(ins, t, np.maximum if is_max else np.minimum)
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
            return unary_op(ins, t, lambda a: fp.div32(np.float32(1.0), a, ftz))
        return unary_op(ins, t, lambda a: fp.canon32(np.sqrt(fp.ftz32(a) if ftz else a).astype(np.float32)))
    if "approx" not in mods:
        raise unsupported(ins, f"{ins.base}.f32 needs .approx (or .rn for rcp/sqrt)")
    return unary_op(ins, t, lambda a: fp.approx32(ins.base, a, ftz))


@handler("copysign")
def _copysign(ins, ctx):
    t = type_of(ins)
    if t != "f32":
        raise unsupported(ins)
    check_mods(ins, {"f32"})
    return binary_op(ins, t, lambda a, b: np.copysign(b, a).astype(np.float32))


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
