"""Floating-point semantics of PTX on numpy arrays: exact rounding, FTZ, conversions.

What each function guarantees (the executor's numerics, documented in docs/ptx-tier.md):

* **Correctly rounded basic operations.** ``add``/``sub``/``mul``/``div``/``sqrt`` in fp32
  with round-to-nearest-even are numpy's IEEE float32 operations. Directed roundings
  (``.rz .rm .rp``) and ``fma`` (a *single* rounding of ``a*b+c``) are computed exactly: the
  product of two fp32 values is exact in fp64, the sum's rounding error is recovered with
  the error-free TwoSum transformation, and the exact value ``hi + lo`` is rounded once
  (round-to-nearest via round-to-odd on 53 bits, which is innocuous for the final 24-bit
  rounding; directed modes by comparing the candidate with ``hi + lo``).
* **FTZ.** ``.ftz`` flushes subnormal inputs and results to a zero of the same sign.
* **Conversions.** fp32 -> bf16/fp16 round-to-nearest-even (or the named direction),
  overflow to infinity (``.satfinite``: to the largest finite value), bf16/fp16 -> fp32
  exact; float -> int rounds as named and saturates, NaN -> 0; ``.sat`` clamps to [0, 1].
* **8-bit floats.** fp32 -> float8_e4m3fn rounds to nearest even and saturates at 448
  (``.satfinite``, the only form PTX has), NaN -> 0x7F; e4m3 -> fp16 is exact.
* **NaN.** Every arithmetic result that is NaN is the canonical NaN (fp32 ``0x7fffffff``,
  16-bit ``0x7fff``), as NVIDIA GPUs produce; payloads are not modelled. ``neg``/``abs``/
  ``mov`` are bit operations and keep the payload.
* **Approximate instructions** (``ex2.approx``, ``lg2.approx``, ``rcp.approx``,
  ``rsqrt.approx``, ``sqrt.approx``, ``sin/cos/tanh.approx``, ``div.approx``/``.full``)
  return the correctly rounded value of the exact function. The PTX ISA documents only an
  error bound for each of them, so a GPU may differ by up to that bound.
"""

from __future__ import annotations

import numpy as np

F32_CANON_NAN = np.uint32(0x7FFFFFFF)
H16_CANON_NAN = np.uint16(0x7FFF)
_INF = np.inf


def canon32(x: np.ndarray) -> np.ndarray:
    """float32 array with every NaN replaced by the canonical NaN (bit pattern 0x7fffffff)."""
    nan = np.isnan(x)
    if nan.any():
        x = x.copy()
        x.view(np.uint32)[nan] = F32_CANON_NAN
    return x


def ftz32(x: np.ndarray) -> np.ndarray:
    """Flush float32 subnormals to a zero of the same sign."""
    sub = (x != 0) & (np.abs(x) < np.float32(np.finfo(np.float32).tiny))
    if sub.any():
        x = np.where(sub, np.copysign(np.float32(0), x), x).astype(np.float32)
    return x


def two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Error-free sum of two float64 arrays: ``a + b == s + e`` exactly (no overflow)."""
    s = a + b
    bp = s - a
    e = (a - (s - bp)) + (b - bp)
    return s, e


def _round_odd64(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """``hi`` rounded to odd using the sign of ``lo``: an inexact value gets an odd last bit."""
    with np.errstate(invalid="ignore"):
        need = (lo != 0) & ((hi.view(np.uint64) & np.uint64(1)) == 0) & np.isfinite(hi)
    if need.any():
        toward = np.where(lo > 0, _INF, -_INF)
        hi = np.where(need, np.nextafter(hi, toward), hi)
    return hi


def round_to_f32(hi: np.ndarray, lo: np.ndarray, mode: str = "rn") -> np.ndarray:
    """Round the exact value ``hi + lo`` (float64 pair from :func:`two_sum`) to float32.

    ``mode`` is PTX's ``rn`` (nearest even), ``rz`` (toward zero), ``rm`` (toward -inf) or
    ``rp`` (toward +inf). Non-finite ``hi`` converts as is.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        if mode == "rn":
            return _round_odd64(hi, lo).astype(np.float32)
        r = hi.astype(np.float32)
        r64 = r.astype(np.float64)
        finite = np.isfinite(hi)
        above = finite & ((r64 > hi) | ((r64 == hi) & (lo < 0)))  # r exceeds the exact value
        below = finite & ((r64 < hi) | ((r64 == hi) & (lo > 0)))
        if mode == "rm":
            down, up = above, np.zeros_like(above)
        elif mode == "rp":
            down, up = np.zeros_like(above), below
        elif mode == "rz":
            exact_pos = (hi > 0) | ((hi == 0) & (lo > 0))
            down, up = above & exact_pos, below & ~exact_pos
        else:
            raise ValueError(f"unknown rounding mode {mode!r}")
        r = np.where(down, np.nextafter(r, np.float32(-_INF)), r)
        r = np.where(up, np.nextafter(r, np.float32(_INF)), r)
        return r.astype(np.float32)


def _exact_zero_sign(r: np.ndarray, s: np.ndarray, e: np.ndarray, mode: str, both_neg_zero) -> np.ndarray:
    """IEEE sign of an exact zero sum: -0 in round-down mode, else +0 unless both addends are -0."""
    zero = (s == 0) & (e == 0)
    if not zero.any():
        return r
    neg = both_neg_zero | (mode == "rm")
    return np.where(zero, np.where(neg, np.float32(-0.0), np.float32(0.0)), r).astype(np.float32)


def _prep(x: np.ndarray, ftz: bool) -> np.ndarray:
    return ftz32(x) if ftz else x


def _finish(r: np.ndarray, ftz: bool, sat: bool = False) -> np.ndarray:
    if ftz:
        r = ftz32(r)
    if sat:
        r = saturate01(r)
    return canon32(r)


def saturate01(x: np.ndarray) -> np.ndarray:
    """``.sat``: clamp to [0, 1]; NaN -> +0."""
    with np.errstate(invalid="ignore"):
        r = np.clip(x, np.float32(0), np.float32(1))
    r = np.where(np.isnan(x), np.float32(0), r)
    return np.where(r == 0, np.float32(0), r).astype(np.float32)  # -0 -> +0


def fma32(a, b, c, mode: str = "rn", ftz: bool = False, sat: bool = False) -> np.ndarray:
    """PTX ``fma.{mode}.f32``: ``a * b + c`` with a single rounding."""
    a, b, c = (_prep(np.asarray(v, np.float32), ftz) for v in (a, b, c))
    with np.errstate(over="ignore", invalid="ignore"):
        p = a.astype(np.float64) * b.astype(np.float64)  # exact
        s, e = two_sum(p, c.astype(np.float64))
        special = ~np.isfinite(s) | ~np.isfinite(e)
        r = round_to_f32(s, np.where(special, 0.0, e), mode)
        if special.any():
            r = np.where(special, (p + c.astype(np.float64)).astype(np.float32), r)
    both_neg = np.signbit(p) & (p == 0) & np.signbit(c) & (c == 0)
    r = _exact_zero_sign(r, s, e, mode, both_neg)
    return _finish(r, ftz, sat)


def add32(a, b, mode: str = "rn", ftz: bool = False, sat: bool = False) -> np.ndarray:
    a, b = (_prep(np.asarray(v, np.float32), ftz) for v in (a, b))
    if mode == "rn":
        with np.errstate(over="ignore", invalid="ignore"):
            return _finish((a + b).astype(np.float32), ftz, sat)
    return fma32(a, np.float32(1.0), b, mode, ftz, sat)


def mul32(a, b, mode: str = "rn", ftz: bool = False, sat: bool = False) -> np.ndarray:
    a, b = (_prep(np.asarray(v, np.float32), ftz) for v in (a, b))
    if mode == "rn":
        with np.errstate(over="ignore", invalid="ignore"):
            return _finish((a * b).astype(np.float32), ftz, sat)
    zero = np.zeros_like(a)
    signed_zero = np.copysign(zero, a * b)  # the sign a zero product must keep
    return fma32(a, b, signed_zero, mode, ftz, sat)


def div32(a, b, ftz: bool = False) -> np.ndarray:
    """``div.{rn,full,approx}.f32``: the correctly rounded quotient (see module docstring)."""
    a, b = (_prep(np.asarray(v, np.float32), ftz) for v in (a, b))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _finish((a / b).astype(np.float32), ftz)


def approx32(fn: str, a, ftz: bool = False) -> np.ndarray:
    """Approximate unary fp32 functions, returned correctly rounded (see module docstring)."""
    a = _prep(np.asarray(a, np.float32), ftz)
    x = a.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        r = {
            "ex2": np.exp2, "lg2": np.log2, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
            "sqrt": np.sqrt, "rsqrt": lambda v: 1.0 / np.sqrt(v), "rcp": lambda v: 1.0 / v,
        }[fn](x)
    return _finish(r.astype(np.float32), ftz)


def minmax32(a, b, is_max: bool, ftz: bool = False) -> np.ndarray:
    """IEEE minNum/maxNum: a NaN operand yields the other; -0 < +0."""
    a, b = (_prep(np.asarray(v, np.float32), ftz) for v in (a, b))
    if is_max:
        pick_a = (a > b) | ((a == b) & ~np.signbit(a))
    else:
        pick_a = (a < b) | ((a == b) & np.signbit(a))
    r = np.where(np.isnan(b), a, np.where(np.isnan(a), b, np.where(pick_a, a, b)))
    return _finish(r.astype(np.float32), ftz)


# ----------------------------------------------------------------------- 16-bit formats

def f32_to_bf16_bits(x: np.ndarray, mode: str = "rn", satfinite: bool = False, relu: bool = False) -> np.ndarray:
    """fp32 -> bf16 bits (uint16), rounded as ``mode``; NaN -> canonical 0x7fff."""
    x = np.asarray(x, np.float32)
    if relu:
        x = np.where(x < 0, np.float32(0), x).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    low = bits & np.uint64(0xFFFF)
    trunc = bits >> np.uint64(16)
    neg = (bits >> np.uint64(31)) == 1
    if mode == "rn":
        up = (low > 0x8000) | ((low == 0x8000) & ((trunc & np.uint64(1)) == 1))
    elif mode == "rz":
        up = np.zeros(bits.shape, bool)
    elif mode == "rm":
        up = neg & (low != 0)
    elif mode == "rp":
        up = ~neg & (low != 0)
    else:
        raise ValueError(f"unknown rounding mode {mode!r}")
    out = (trunc + up.astype(np.uint64)).astype(np.uint16)
    if satfinite:
        inf = (out & np.uint16(0x7FFF)) == np.uint16(0x7F80)
        out = np.where(inf & ~np.isinf(x), (out & np.uint16(0x8000)) | np.uint16(0x7F7F), out)
    return np.where(np.isnan(x), H16_CANON_NAN, out).astype(np.uint16)


def f32_to_f16_bits(x: np.ndarray, mode: str = "rn", satfinite: bool = False, relu: bool = False) -> np.ndarray:
    """fp32 -> fp16 bits (uint16), rounded as ``mode``; NaN -> canonical 0x7fff."""
    x = np.asarray(x, np.float32)
    if relu:
        x = np.where(x < 0, np.float32(0), x).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        r = x.astype(np.float16)
        if mode != "rn":
            r32 = r.astype(np.float32)
            exact_pos = ~np.signbit(x)
            if mode == "rm":
                down, up = r32 > x, np.zeros(x.shape, bool)
            elif mode == "rp":
                down, up = np.zeros(x.shape, bool), r32 < x
            elif mode == "rz":
                down, up = (r32 > x) & exact_pos, (r32 < x) & ~exact_pos
            else:
                raise ValueError(f"unknown rounding mode {mode!r}")
            r = np.where(down, np.nextafter(r, np.float16(-_INF)), r)
            r = np.where(up, np.nextafter(r, np.float16(_INF)), r).astype(np.float16)
        if satfinite:
            r = np.where(np.isinf(r) & ~np.isinf(x), np.copysign(np.float16(65504), x), r).astype(np.float16)
    return np.where(np.isnan(x), H16_CANON_NAN, r.view(np.uint16)).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bf16 bits -> fp32 (exact; NaN canonical)."""
    return canon32((np.asarray(b).astype(np.uint32) << np.uint32(16)).view(np.float32))


def f16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """fp16 bits -> fp32 (exact; NaN canonical)."""
    return canon32(np.asarray(b, np.uint16).view(np.float16).astype(np.float32))


# ----------------------------------------------------------------------- 8-bit float (e4m3fn)
E4M3_MAX = 448.0
E4M3_NAN = np.uint8(0x7F)


def f32_to_e4m3_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> float8_e4m3fn bits (uint8) as ``cvt.rn.satfinite.e4m3x2.f32`` does: round to nearest
    even on e4m3's grid (3 mantissa bits, normals from 2**-6, subnormals in steps of 2**-9),
    magnitudes above 448 (infinities too) to 448, NaN -> 0x7F. The sign is kept (-0.0 -> 0x80)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x.astype(np.float64))
    a = np.where(np.isnan(a), 0.0, np.minimum(a, 2.0 * E4M3_MAX))  # inf saturates; NaN is set below
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
        step = np.exp2(np.maximum(e, -6.0) - 3.0)  # the grid step at a (2**-9 below 2**-6)
        value = np.minimum(np.rint(a / step) * step, E4M3_MAX)
        ev = np.floor(np.log2(np.where(value >= 2.0**-6, value, 1.0)))
        normal = value >= 2.0**-6
        code = np.where(normal, (ev + 7.0) * 8.0 + (value / np.exp2(ev) - 1.0) * 8.0, value * 512.0)
    out = code.astype(np.uint8) | np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))
    return np.where(np.isnan(x), E4M3_NAN, out).astype(np.uint8)


def e4m3_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bits -> fp32 (exact; 0x7F/0xFF are NaN, canonical)."""
    b = np.asarray(b).astype(np.uint32) & np.uint32(0xFF)
    e = ((b >> np.uint32(3)) & np.uint32(15)).astype(np.float64)
    m = (b & np.uint32(7)).astype(np.float64)
    mag = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    val = np.where((b & np.uint32(0x80)) != 0, -mag, mag).astype(np.float32)
    return np.where((b & np.uint32(0x7F)) == np.uint32(0x7F), np.float32(np.nan), val).astype(np.float32)


def round_to_16(hi: np.ndarray, lo: np.ndarray, fmt: str) -> np.ndarray:
    """Round the exact ``hi + lo`` (float64 pair) to ``fmt`` ('bf16'/'f16') bits, nearest even.

    Round-to-odd onto 53 and then 24 bits keeps the final rounding correct (both steps
    keep at least two more bits than the 8/11-bit target). PTX's 16-bit arithmetic has
    only the ``.rn`` rounding.
    """
    r64 = _round_odd64(hi, lo)
    with np.errstate(over="ignore", invalid="ignore"):
        r32 = r64.astype(np.float32)
        back = r32.astype(np.float64)
        fix = np.isfinite(r64) & (back != r64) & ((r32.view(np.uint32) & np.uint32(1)) == 0)
        if fix.any():  # make the 24-bit value odd, toward the exact one
            toward = np.where(r64 > back, np.float32(_INF), np.float32(-_INF))
            r32 = np.where(fix, np.nextafter(r32, toward), r32).astype(np.float32)
    return (f32_to_bf16_bits if fmt == "bf16" else f32_to_f16_bits)(r32, "rn")


def bits16_to_f64(b: np.ndarray, fmt: str) -> np.ndarray:
    f = bf16_bits_to_f32 if fmt == "bf16" else f16_bits_to_f32
    return f(b).astype(np.float64)


# ------------------------------------------------------------------- float -> integer

_INT_RANGE = {"s8": (-2**7, 2**7 - 1), "u8": (0, 2**8 - 1), "s16": (-2**15, 2**15 - 1), "u16": (0, 2**16 - 1),
              "s32": (-2**31, 2**31 - 1), "u32": (0, 2**32 - 1), "s64": (-2**63, 2**63 - 1), "u64": (0, 2**64 - 1)}


def round_integral(x: np.ndarray, irnd: str) -> np.ndarray:
    """Round a float array to an integral value: ``rni`` nearest even, ``rzi``, ``rmi``, ``rpi``."""
    return {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}[irnd](x)


def float_to_int(x: np.ndarray, irnd: str, itype: str) -> np.ndarray:
    """PTX float -> integer conversion: round as ``irnd``, saturate to the type, NaN -> 0.

    Returns int64 (signed types) or uint64 (unsigned) values; the caller narrows them.
    """
    lo, hi = _INT_RANGE[itype]
    x = np.asarray(x, np.float64)
    r = round_integral(x, irnd)
    r = np.where(np.isnan(r), 0.0, r)
    r = np.clip(r, float(lo), float(hi))
    if itype.startswith("u"):
        big = r >= 2.0**63
        out = np.where(big, r - 2.0**63, r).astype(np.uint64)
        return np.where(big, out + np.uint64(2**63), out)
    out = r.astype(np.int64)
    return np.where(r >= 2.0**63, np.int64(2**63 - 1), out)
