"""Moves, conversions, comparisons and selects."""

from __future__ import annotations

import numpy as np

from . import numerics as fp
from .frame import VIEW
from .isa import check_mods, handler, type_of, unsupported
from .ir import Pair, Vec

_INTS = ("s8", "u8", "b8", "s16", "u16", "b16", "s32", "u32", "b32", "s64", "u64", "b64")
_IRND = ("rni", "rzi", "rmi", "rpi")
_FRND = ("rn", "rz", "rm", "rp")


def _size(t: str) -> int:
    return np.dtype(VIEW[t]).itemsize


# ------------------------------------------------------------------------------ mov

@handler("mov")
def _mov(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t})
    d, a = ins.operands
    if isinstance(d, Vec) or isinstance(a, Vec):
        return _mov_vector(ins, t, d, a)

    def run(F, idx):
        F.write(d, F.read(a, VIEW[t], idx), VIEW[t], idx)
    return run


def _mov_vector(ins, t, d, a):
    """Pack ``mov.b64 %rd, {%r0, %r1}`` or unpack ``mov.b64 {%r0, %r1}, %rd`` (element 0 lowest)."""
    total = _size(t) * 8
    vec, scalar = (d, a) if isinstance(d, Vec) else (a, d)
    n = len(vec.items)
    if total % n:
        raise unsupported(ins, "vector does not split the register evenly")
    part = total // n
    pt = {8: np.uint8, 16: np.uint16, 32: np.uint32}[part]
    wide = np.uint64

    if isinstance(d, Vec):  # unpack
        def run(F, idx):
            x = np.asarray(F.read(a, VIEW[t], idx)).view(np.dtype(f"u{total // 8}")).astype(wide)
            for k, item in enumerate(d.items):
                if item is not None:
                    F.write(item, ((x >> wide(k * part)) & wide((1 << part) - 1)).astype(pt), pt, idx)
        return run

    def pack(F, idx):
        acc = wide(0)
        for k, item in enumerate(a.items):
            acc = acc | (np.asarray(F.read(item, pt, idx)).astype(wide) << wide(k * part))
        F.write(d, np.asarray(acc).astype(np.dtype(f"u{total // 8}")), np.dtype(f"u{total // 8}"), idx)
    return pack


# ------------------------------------------------------------------------------ cvt

@handler("cvt")
def _cvt(ins, ctx):
    if len(ins.mods) < 2:
        raise unsupported(ins)
    dt, at = ins.mods[-2], ins.mods[-1]
    mods = check_mods(ins, {dt, at, "ftz", "sat", "satfinite", "relu", *_IRND, *_FRND})
    if at == "e4m3x2" or dt == "e4m3x2":
        return _cvt_e4m3(ins, dt, at, mods)
    if dt in ("f16x2", "bf16x2"):
        return _cvt_pack(ins, dt, at, mods)
    conv = _converter(ins, dt, at, mods)
    d, a = ins.operands

    def run(F, idx):
        F.write(d, conv(F.read(a, VIEW[at], idx)), VIEW[dt], idx)
    return run


def _to_f32(x, at):
    if at == "f32":
        return np.asarray(x, np.float32)
    if at == "bf16":
        return fp.bf16_bits_to_f32(x)
    if at == "f16":
        return fp.f16_bits_to_f32(x)
    if at == "f64":
        raise AssertionError("f64 handled by the caller")
    raise AssertionError(at)


def _converter(ins, dt, at, mods):
    frnd = next((m for m in _FRND if m in mods), None)
    irnd = next((m for m in _IRND if m in mods), None)
    ftz, sat = "ftz" in mods, "sat" in mods
    floats = ("f32", "f16", "bf16", "f64")
    if dt in floats and at in floats:
        return _float_to_float(ins, dt, at, frnd, irnd, ftz, sat, mods)
    if dt in _INTS and at in floats:
        if irnd is None:
            raise unsupported(ins, "float -> integer cvt needs .rni/.rzi/.rmi/.rpi")
        def f2i(x):
            v = np.asarray(x, np.float64) if at == "f64" else _to_f32(x, at).astype(np.float64)
            if ftz:
                v = np.where(np.abs(v) < np.finfo(np.float32).tiny, 0.0, v)
            return fp.float_to_int(v, irnd, dt.replace("b", "u")).astype(VIEW[dt])
        return f2i
    if dt in floats and at in _INTS:
        return _int_to_float(ins, dt, at, frnd)
    if dt in _INTS and at in _INTS:
        if frnd or irnd:
            raise unsupported(ins, "integer -> integer cvt takes no rounding")
        return _int_to_int(dt, at, sat)
    raise unsupported(ins)


def _float_to_float(ins, dt, at, frnd, irnd, ftz, sat, mods):
    if dt == at:  # rounding to an integral value and/or saturation, same format
        if dt != "f32":
            raise unsupported(ins, "same-type float cvt is implemented for .f32")
        def same(x):
            x = fp.ftz32(np.asarray(x, np.float32)) if ftz else np.asarray(x, np.float32)
            if irnd:
                x = fp.round_integral(x, irnd).astype(np.float32)
            if sat:
                x = fp.saturate01(x)
            return fp.canon32(x)
        return same
    if irnd:
        raise unsupported(ins, "integral rounding between different float types")
    if at in ("f16", "bf16", "f32") and dt == "f32":
        def widen(x):
            r = _to_f32(x, at)
            r = fp.ftz32(r) if ftz else r
            return fp.saturate01(r) if sat else r
        return widen
    if at == "f32" and dt in ("f16", "bf16"):
        if frnd is None:
            raise unsupported(ins, "f32 -> 16-bit cvt needs a rounding modifier")
        narrow = fp.f32_to_bf16_bits if dt == "bf16" else fp.f32_to_f16_bits
        satfinite, relu = "satfinite" in mods, "relu" in mods
        return lambda x: narrow(fp.ftz32(np.asarray(x, np.float32)) if ftz else x, frnd, satfinite, relu)
    if at == "f32" and dt == "f64":
        return lambda x: np.asarray(x, np.float32).astype(np.float64)
    if at == "f64" and dt == "f32":
        mode = frnd or "rn"
        return lambda x: fp.canon32(fp.round_to_f32(np.asarray(x, np.float64), np.zeros(np.shape(x)), mode))
    raise unsupported(ins)


def _int_to_float(ins, dt, at, frnd):
    if dt not in ("f32", "f64", "f16", "bf16"):
        raise unsupported(ins)
    mode = frnd or "rn"

    def conv(x):
        x = np.asarray(x)
        hi = x.astype(np.float64)
        # the part float64 could not hold (64-bit integers); exact as a float64
        lo = (x.astype(np.int64) - hi.astype(np.int64)).astype(np.float64) if x.dtype.itemsize == 8 else 0.0 * hi
        if dt == "f64":
            return hi
        r = fp.round_to_f32(hi, lo, mode)
        if dt == "f32":
            return r
        narrow = fp.f32_to_bf16_bits if dt == "bf16" else fp.f32_to_f16_bits
        return narrow(r, mode)
    return conv


def _int_to_int(dt, at, sat):
    out = VIEW[dt]

    def conv(x):
        x = np.asarray(x)
        if sat:
            info = np.iinfo(out)
            wide = x.astype(np.int64) if x.dtype.kind == "i" else x.astype(np.uint64)
            if x.dtype.kind == "u":
                return np.minimum(wide, np.uint64(info.max)).astype(out)
            return np.clip(wide, max(info.min, -2**63), min(info.max, 2**63 - 1)).astype(out)
        if x.dtype.itemsize >= np.dtype(out).itemsize:  # truncate
            return x.view(np.dtype(f"u{x.dtype.itemsize}")).astype(np.dtype(f"u{np.dtype(out).itemsize}")).view(out)
        return x.astype(out)  # extend by the source's signedness
    return conv


def _cvt_pack(ins, dt, at, mods):
    """``cvt.rn.{bf16x2,f16x2}.f32 d, a, b``: a -> upper half, b -> lower half."""
    if at != "f32":
        raise unsupported(ins)
    frnd = next((m for m in _FRND if m in mods), None)
    if frnd is None:
        raise unsupported(ins, "needs a rounding modifier")
    narrow = fp.f32_to_bf16_bits if dt == "bf16x2" else fp.f32_to_f16_bits
    satfinite, relu = "satfinite" in mods, "relu" in mods
    d, a, b = ins.operands

    def run(F, idx):
        hi = narrow(F.read(a, np.float32, idx), frnd, satfinite, relu).astype(np.uint32)
        lo = narrow(F.read(b, np.float32, idx), frnd, satfinite, relu).astype(np.uint32)
        F.write(d, (hi << np.uint32(16)) | lo, np.uint32, idx)
    return run


def _cvt_e4m3(ins, dt, at, mods):
    """``cvt.rn.satfinite.e4m3x2.f32 d, a, b`` (a -> upper byte, b -> lower byte of the 16-bit d) and
    ``cvt.rn.f16x2.e4m3x2 d, a`` (a's upper byte -> d's upper half, lower byte -> lower half; exact)."""
    if dt == "e4m3x2" and at == "f32":
        if "rn" not in mods or "satfinite" not in mods or "relu" in mods:
            raise unsupported(ins, "f32 -> e4m3x2 is implemented for .rn.satfinite")
        d, a, b = ins.operands

        def pack(F, idx):
            hi = fp.f32_to_e4m3_bits(F.read(a, np.float32, idx)).astype(np.uint16)
            lo = fp.f32_to_e4m3_bits(F.read(b, np.float32, idx)).astype(np.uint16)
            F.write(d, (hi << np.uint16(8)) | lo, np.uint16, idx)
        return pack
    if dt == "f16x2" and at == "e4m3x2":
        if set(mods) - {"rn", dt, at}:
            raise unsupported(ins)
        d, a = ins.operands

        def unpack(F, idx):
            v = F.read(a, np.uint16, idx).astype(np.uint32)
            hi = fp.f32_to_f16_bits(fp.e4m3_bits_to_f32(v >> np.uint32(8))).astype(np.uint32)
            lo = fp.f32_to_f16_bits(fp.e4m3_bits_to_f32(v & np.uint32(0xFF))).astype(np.uint32)
            F.write(d, (hi << np.uint32(16)) | lo, np.uint32, idx)
        return unpack
    raise unsupported(ins)


# ------------------------------------------------------------------------------ setp / selp

_FLOAT_CMP = {
    "eq": np.equal, "ne": lambda a, b: (a != b) & ~np.isnan(a) & ~np.isnan(b),
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "equ": lambda a, b: (a == b) | np.isnan(a) | np.isnan(b), "neu": np.not_equal,
    "ltu": lambda a, b: ~(a >= b), "leu": lambda a, b: ~(a > b),
    "gtu": lambda a, b: ~(a <= b), "geu": lambda a, b: ~(a < b),
    "num": lambda a, b: ~np.isnan(a) & ~np.isnan(b), "nan": lambda a, b: np.isnan(a) | np.isnan(b),
}
_INT_CMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
            "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal, "hi": np.greater, "hs": np.greater_equal}
_BOOL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def _compare(ins, cmp, t):
    if t in ("f32", "f64"):
        if cmp not in _FLOAT_CMP:
            raise unsupported(ins)
        return VIEW[t], _FLOAT_CMP[cmp]
    if t in ("f16", "bf16"):
        if cmp not in _FLOAT_CMP:
            raise unsupported(ins)
        conv = fp.bf16_bits_to_f32 if t == "bf16" else fp.f16_bits_to_f32
        return VIEW[t], lambda a, b: _FLOAT_CMP[cmp](conv(a), conv(b))
    if t in _INTS:
        if cmp not in _INT_CMP or (t.startswith("b") and cmp not in ("eq", "ne")):
            raise unsupported(ins)
        view = VIEW[t]
        if cmp in ("lo", "ls", "hi", "hs"):
            view = np.dtype(f"u{_size(t)}").type
        return view, _INT_CMP[cmp]
    raise unsupported(ins)


def _compared(ins, F, idx, a, b, view, fn) -> np.ndarray:
    """The comparison ``fn`` of operands ``a``, ``b`` read as ``view`` (fp32 subnormals flushed with .ftz),
    as a bool array: what setp and set compute."""
    x, y = F.read(a, view, idx), F.read(b, view, idx)
    if "ftz" in ins.mods and view is np.float32:
        x, y = fp.ftz32(np.asarray(x)), fp.ftz32(np.asarray(y))
    with np.errstate(invalid="ignore"):
        return np.asarray(fn(x, y), bool)


@handler("setp")
def _setp(ins, ctx):
    t = type_of(ins)
    cmp = ins.mods[0]
    boolop = ins.mods[1] if len(ins.mods) == 3 else None
    check_mods(ins, {t, cmp, "ftz"} | ({boolop} if boolop else set()))
    if boolop is not None and boolop not in _BOOL:
        raise unsupported(ins)
    view, fn = _compare(ins, cmp, t)
    d, a, b = ins.operands[:3]
    c = ins.operands[3] if boolop else None
    p, q = (d.first, d.second) if isinstance(d, Pair) else (d, None)

    def run(F, idx):
        r = _compared(ins, F, idx, a, b, view, fn)
        nr = ~r
        if boolop:
            cv = F.read(c, np.bool_, idx)
            r, nr = _BOOL[boolop](r, cv), _BOOL[boolop](nr, cv)
        F.write(p, r, np.bool_, idx)
        if q is not None:
            F.write(q, nr, np.bool_, idx)
    return run


@handler("set")
def _set(ins, ctx):
    """``set.CmpOp{.ftz}.dtype.stype d, a, b``: 1.0f / 0.0f into an .f32 destination, all ones / 0
    into a .u32 or .s32 one (the form without a boolean operand)."""
    dtype, stype, cmp = ins.mods[-2], ins.mods[-1], ins.mods[0]
    check_mods(ins, {cmp, "ftz", dtype, stype})
    if dtype not in ("f32", "u32", "s32") or len(ins.operands) != 3:
        raise unsupported(ins, "implemented for .f32/.u32/.s32 destinations, without a boolean operand")
    view, fn = _compare(ins, cmp, stype)
    d, a, b = ins.operands
    yes, no = (np.float32(1.0), np.float32(0.0)) if dtype == "f32" else (np.uint32(0xFFFFFFFF), np.uint32(0))

    def run(F, idx):
        F.write(d, np.where(_compared(ins, F, idx, a, b, view, fn), yes, no), type(yes), idx)
    return run


@handler("selp")
def _selp(ins, ctx):
    t = type_of(ins)
    check_mods(ins, {t})
    d, a, b, c = ins.operands

    def run(F, idx):
        F.write(d, np.where(F.read(c, np.bool_, idx), F.read(a, VIEW[t], idx), F.read(b, VIEW[t], idx)), VIEW[t], idx)
    return run


@handler("nanosleep", "membar", "prefetch", "prefetchu", "pmevent")
def _no_effect(ins, ctx):
    """No observable effect in a sequentially consistent executor (ordering/hints only)."""
    return lambda F, idx: None

