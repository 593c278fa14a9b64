"""PTX executor self-tests, arithmetic: hand-written PTX against independently computed values.

Every expected value comes from tests/ptx_harness.py (exact Fractions, struct bit patterns,
Python ints): nothing here shares code with ptx_executor.numerics, so a rounding bug in
the executor cannot hide a rounding bug in the kernel it executes.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from ptx_harness import (bf16_bits_of, exact, f16_bits_of, from_f32_bits, random_f32_bits, round_binary,
                         run_lanes, to_f32_bits)

RNG = np.random.default_rng(20261122)
N = 256


def _expect_f32(fn, *args, mode="rn"):
    """fp32 bits of ``round(fn(exact args))`` lane by lane."""
    out = []
    for vals in zip(*args):
        out.append(to_f32_bits(round_binary(fn(*[exact(int(v)) for v in vals]), mode)))
    return np.array(out, np.uint64).astype(np.uint32)


# ------------------------------------------------------------------------------ fp32 basic ops

@pytest.mark.parametrize("mode", ["rn", "rz", "rm", "rp"])
def test_fma_f32_single_rounding_in_every_mode(mode):
    a = random_f32_bits(RNG, N, special=False)
    b = random_f32_bits(RNG, N, special=False)
    c = random_f32_bits(RNG, N, special=False)
    # cancellation-heavy lanes: c close to -a*b, where one rounding vs two differ most
    c[::4] = [to_f32_bits(-round_binary(exact(int(x)) * exact(int(y)), "rn")) for x, y in zip(a[::4], b[::4])]
    got = run_lanes(f"fma.{mode}.f32 %r4, %r1, %r2, %r3;", a, b, c)
    want = _expect_f32(lambda x, y, z: x * y + z, a, b, c, mode=mode)
    np.testing.assert_array_equal(got, want)


def test_fma_f32_is_not_double_rounded():
    """(1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is an fp32 tie; a tiny c decides it. Computing a*b+c
    in float64 and rounding again would lose c and round the tie to even."""
    one = to_f32_bits(Fraction(1) + Fraction(1, 2**12))
    tiny = to_f32_bits(Fraction(1, 2**70))
    a = np.full(32, one, np.uint32)
    c = np.array([tiny, to_f32_bits(-Fraction(1, 2**70))] * 16, np.uint32)
    got = run_lanes("fma.rn.f32 %r4, %r1, %r2, %r3;", a, a, c)
    base = Fraction(1) + Fraction(1, 2**11)
    assert got[0] == to_f32_bits(base + Fraction(1, 2**23))  # just above the tie: rounds up
    assert got[1] == to_f32_bits(base)  # just below: rounds down


@pytest.mark.parametrize("op,fn", [("add", lambda x, y: x + y), ("sub", lambda x, y: x - y),
                                   ("mul", lambda x, y: x * y)])
@pytest.mark.parametrize("mode", ["rn", "rz", "rm"])
def test_add_sub_mul_f32(op, fn, mode):
    a = random_f32_bits(RNG, N, special=False)
    b = random_f32_bits(RNG, N, special=False)
    got = run_lanes(f"{op}.{mode}.f32 %r4, %r1, %r2;", a, b)
    np.testing.assert_array_equal(got, _expect_f32(fn, a, b, mode=mode))


def test_div_rn_f32_correctly_rounded():
    a = random_f32_bits(RNG, N, special=False)
    b = random_f32_bits(RNG, N, special=False)
    got = run_lanes("div.rn.f32 %r4, %r1, %r2;", a, b)
    np.testing.assert_array_equal(got, _expect_f32(lambda x, y: x / y, a, b))


def test_ftz_flushes_subnormal_inputs_and_results():
    sub = 0x00000123  # a subnormal
    a = np.array([sub, 0x80000123, 0x00800000, 0x3F800000] * 8, np.uint32)
    b = np.array([0x3F800000, 0x3F800000, 0x3F000000, 0x00000001] * 8, np.uint32)
    got = run_lanes("mul.ftz.f32 %r4, %r1, %r2;", a, b)
    # sub*1 -> input flushed -> +0; -sub*1 -> -0; 2^-126 * 0.5 = subnormal result -> +0; 1*sub -> +0
    assert got[:4].tolist() == [0x00000000, 0x80000000, 0x00000000, 0x00000000]
    got = run_lanes("mul.f32 %r4, %r1, %r2;", a, b)  # without .ftz subnormals survive
    assert got[:4].tolist() == [sub, 0x80000123, 0x00400000, 0x00000001]


def test_sat_and_canonical_nan():
    a = np.array([0x40000000, 0xC0000000, 0x7FC00001, 0x3F000000] * 8, np.uint32)  # 2, -2, NaN(payload), 0.5
    zero = np.zeros(32, np.uint32)
    got = run_lanes("add.sat.f32 %r4, %r1, %r2;", a, zero)
    assert got[:4].tolist() == [0x3F800000, 0x00000000, 0x00000000, 0x3F000000]
    got = run_lanes("add.f32 %r4, %r1, %r2;", a, zero)
    assert got[2] == 0x7FFFFFFF, "a NaN result is the canonical NaN"
    got = run_lanes("neg.f32 %r4, %r1;", a)
    assert got[:4].tolist() == [0xC0000000, 0x40000000, 0xFFC00001, 0xBF000000], "neg is a sign-bit flip"


def test_min_max_nan_and_signed_zero():
    a = np.array([0x7FC00000, 0x00000000, 0x3F800000, 0x80000000] * 8, np.uint32)
    b = np.array([0x3F800000, 0x80000000, 0x7FC00000, 0x00000000] * 8, np.uint32)
    assert run_lanes("min.f32 %r4, %r1, %r2;", a, b)[:4].tolist() == [0x3F800000, 0x80000000, 0x3F800000, 0x80000000]
    assert run_lanes("max.f32 %r4, %r1, %r2;", a, b)[:4].tolist() == [0x3F800000, 0x00000000, 0x3F800000, 0x00000000]


def test_ex2_approx_within_its_documented_error():
    x = np.array([to_f32_bits(round_binary(Fraction(v).limit_denominator(1 << 20)))
                  for v in np.linspace(-20, 20, N)], np.uint32)
    got = run_lanes("ex2.approx.ftz.f32 %r4, %r1;", x)
    for xi, gi in zip(x, got):
        ref = math.pow(2.0, from_f32_bits(int(xi)))
        ulp = 2.0 ** (math.floor(math.log2(ref)) - 23)  # fp32 ulp at the result
        assert abs(from_f32_bits(int(gi)) - ref) <= 2 * ulp, (from_f32_bits(int(xi)), from_f32_bits(int(gi)), ref)


# ------------------------------------------------------------------------------ conversions

@pytest.mark.parametrize("mode", ["rn", "rz", "rm", "rp"])
def test_cvt_f32_to_bf16(mode):
    a = random_f32_bits(RNG, N, special=False)
    a[::3] = (a[::3] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exact ties
    a[1::7] = (a[1::7] & np.uint32(0xFFFF0000)) | np.uint32(0x8001)  # just above a tie
    got = run_lanes(f"cvt.{mode}.bf16.f32 %h1, %r1; cvt.u32.u16 %r4, %h1;", a)
    want = [bf16_bits_of(round_binary(exact(int(v)), mode, p=8)) for v in a]
    np.testing.assert_array_equal(got, np.array(want, np.uint32))


def test_cvt_bf16_specials():
    a = np.array([0x7FC00001, 0xFF800000, 0x7F7FFFFF, 0x00000001] * 8, np.uint32)  # NaN, -inf, max, tiny
    got = run_lanes("cvt.rn.bf16.f32 %h1, %r1; cvt.u32.u16 %r4, %h1;", a)
    assert got[:4].tolist() == [0x7FFF, 0xFF80, 0x7F80, 0x0000]
    got = run_lanes("cvt.rz.bf16.f32 %h1, %r1; cvt.u32.u16 %r4, %h1;", a)
    assert got[2] == 0x7F7F, "rz never rounds up to infinity"


def test_cvt_f32_to_f16_including_subnormals_and_overflow():
    a = random_f32_bits(RNG, N, special=False)
    a = (a & np.uint32(0x807FFFFF)) | (RNG.integers(97, 145, N).astype(np.uint32) << np.uint32(23))  # 2^-30..2^17
    got = run_lanes("cvt.rn.f16.f32 %h1, %r1; cvt.u32.u16 %r4, %h1;", a)
    want = [f16_bits_of(round_binary(exact(int(v)), "rn", p=11, emin=-14, emax=15)) for v in a]
    np.testing.assert_array_equal(got, np.array(want, np.uint32))


def test_cvt_widening_and_packing():
    a = random_f32_bits(RNG, 64, special=False)
    b = random_f32_bits(RNG, 64, special=False)
    got = run_lanes("cvt.rn.bf16x2.f32 %r4, %r1, %r2;", a, b)
    hi = [bf16_bits_of(round_binary(exact(int(v)), "rn", p=8)) for v in a]
    lo = [bf16_bits_of(round_binary(exact(int(v)), "rn", p=8)) for v in b]
    np.testing.assert_array_equal(got, (np.array(hi, np.uint64) << 16 | np.array(lo, np.uint64)).astype(np.uint32))
    # bf16 -> f32 is exact: the bits shift up
    h = a >> np.uint32(16)
    got = run_lanes("cvt.u16.u32 %h1, %r1; cvt.f32.bf16 %r4, %h1;", h)
    np.testing.assert_array_equal(got, h << np.uint32(16))


def test_cvt_float_to_int_rounds_saturates_and_maps_nan_to_zero():
    vals = [2.5, -2.5, 3.5, -0.4, 1e10, -1e10, float("nan"), 2147483520.0]
    a = np.array([to_f32_bits(Fraction(v)) if v == v else 0x7FC00000 for v in vals] * 4, np.uint32)
    rni = run_lanes("cvt.rni.s32.f32 %r4, %r1;", a).view(np.int32)[:8].tolist()
    assert rni == [2, -2, 4, 0, 2**31 - 1, -2**31, 0, 2147483520]
    rzi = run_lanes("cvt.rzi.s32.f32 %r4, %r1;", a).view(np.int32)[:8].tolist()
    assert rzi == [2, -2, 3, 0, 2**31 - 1, -2**31, 0, 2147483520]
    rmi = run_lanes("cvt.rmi.u32.f32 %r4, %r1;", a)[:8].tolist()
    assert rmi == [2, 0, 3, 0, 2**32 - 1, 0, 0, 2147483520]
    sat = run_lanes("cvt.sat.f32.f32 %r4, %r1;", a)[:8].tolist()
    assert sat == [0x3F800000, 0, 0x3F800000, 0, 0x3F800000, 0, 0, 0x3F800000]


def test_cvt_int_to_float_rounds():
    a = np.array([16777217, -16777217, 2**31 - 1, 7] * 8, np.int32).view(np.uint32)
    got = run_lanes("cvt.rn.f32.s32 %r4, %r1;", a)
    want = [to_f32_bits(round_binary(Fraction(int(v)), "rn")) for v in a.view(np.int32)[:4]]
    assert got[:4].tolist() == want
    got = run_lanes("cvt.rz.f32.s32 %r4, %r1;", a)
    assert got[0] == to_f32_bits(Fraction(16777216))


# ------------------------------------------------------------------------------ integers

def _ints(bits, n=N):
    return RNG.integers(0, 2**bits, n, dtype=np.uint64)


@pytest.mark.parametrize("body,fn", [
    ("add.s32 %r4, %r1, %r2;", lambda a, b: a + b),
    ("sub.u32 %r4, %r1, %r2;", lambda a, b: a - b),
    ("mul.lo.s32 %r4, %r1, %r2;", lambda a, b: a * b),
    ("mul.hi.u32 %r4, %r1, %r2;", lambda a, b: (a * b) >> 32),
    ("mul.hi.s32 %r4, %r1, %r2;", lambda a, b: (_s(a, 32) * _s(b, 32)) >> 32),
    ("mad.lo.s32 %r4, %r1, %r2, %r3;", None),
    ("and.b32 %r4, %r1, %r2;", lambda a, b: a & b),
    ("xor.b32 %r4, %r1, %r2;", lambda a, b: a ^ b),
    ("shl.b32 %r4, %r1, %r2;", lambda a, b: 0 if b % 64 >= 32 else a << (b % 64)),
    ("shr.u32 %r4, %r1, %r2;", lambda a, b: 0 if b % 64 >= 32 else a >> (b % 64)),
    ("shr.s32 %r4, %r1, %r2;", lambda a, b: _s(a, 32) >> min(b % 64, 31)),
    ("min.s32 %r4, %r1, %r2;", lambda a, b: min(_s(a, 32), _s(b, 32))),
    ("max.u32 %r4, %r1, %r2;", lambda a, b: max(a, b)),
    ("popc.b32 %r4, %r1;", lambda a, b: bin(a).count("1")),
    ("clz.b32 %r4, %r1;", lambda a, b: 32 - a.bit_length()),
    ("bfe.u32 %r4, %r1, 5, 9;", lambda a, b: (a >> 5) & 0x1FF),
    ("bfe.s32 %r4, %r1, 5, 9;", lambda a, b: _s((a >> 5) & 0x1FF, 9)),
    ("prmt.b32 %r4, %r1, %r2, 0x5140;", lambda a, b: _prmt(a, b, 0x5140)),
    ("prmt.b32 %r4, %r1, %r2, 0x3a1f;", lambda a, b: _prmt(a, b, 0x3A1F)),
    ("lop3.b32 %r4, %r1, %r2, %r3, 0x96;", None),
    ("setp.lo.u32 %p1, %r1, %r2; selp.b32 %r4, 1, 0, %p1;", lambda a, b: int(a < b)),
    ("setp.lt.s32 %p1, %r1, %r2; selp.b32 %r4, 1, 0, %p1;", lambda a, b: int(_s(a, 32) < _s(b, 32))),
    ("div.s32 %r4, %r1, %r2;", lambda a, b: _tdiv(_s(a, 32), _s(b, 32))),
    ("rem.u32 %r4, %r1, %r2;", lambda a, b: a % b),
])
def test_int32_ops_wrap_like_ptx(body, fn):
    a, b, c = _ints(32), _ints(32), _ints(32)
    if "shl" in body or "shr" in body:
        b = RNG.integers(0, 64, N, dtype=np.uint64)
    if "div" in body or "rem" in body:
        b[b == 0] = 3
    got = run_lanes(body, a, b, c)
    for i in range(N):
        x, y, z = int(a[i]), int(b[i]), int(c[i])
        if body.startswith("mad"):
            want = _s(x, 32) * _s(y, 32) + z
        elif body.startswith("lop3"):
            want = x ^ y ^ z
        else:
            want = fn(x, y)
        assert int(got[i]) == want % 2**32, (body, x, y, z, int(got[i]), want % 2**32)


@pytest.mark.parametrize("body,fn", [
    ("add.s64 %rd4, %rd1, %rd2;", lambda a, b: a + b),
    ("mul.lo.u64 %rd4, %rd1, %rd2;", lambda a, b: a * b),
    ("mul.hi.u64 %rd4, %rd1, %rd2;", lambda a, b: (a * b) >> 64),
    ("mul.hi.s64 %rd4, %rd1, %rd2;", lambda a, b: (_s(a, 64) * _s(b, 64)) >> 64),
    ("mad.lo.s64 %rd4, %rd1, %rd2, %rd3;", None),
    ("shl.b64 %rd4, %rd1, 37;", lambda a, b: a << 37),
    ("cvt.u32.u64 %r10, %rd1; cvt.s64.s32 %rd4, %r10;", lambda a, b: _s(a & 0xFFFFFFFF, 32)),
    ("cvt.u32.u64 %r10, %rd1; mul.wide.u32 %rd4, %r10, %r10;", lambda a, b: (a & 0xFFFFFFFF) ** 2),
    ("cvt.u32.u64 %r10, %rd1; mul.wide.s32 %rd4, %r10, %r10;", lambda a, b: _s(a & 0xFFFFFFFF, 32) ** 2),
])
def test_int64_ops_wrap_like_ptx(body, fn):
    a, b, c = _ints(64), _ints(64), _ints(64)
    got = run_lanes(body, a, b, c, bits=64)
    for i in range(N):
        x, y, z = int(a[i]), int(b[i]), int(c[i])
        want = x * y + z if body.startswith("mad") else fn(x, y)
        assert int(got[i]) == want % 2**64, (body, hex(x), hex(y))


def test_cvt_integer_extension_and_saturation():
    a = np.array([0x80, 0x7F, 0x1FF, 0xFFFFFFFF] * 8, np.uint32)
    assert run_lanes("cvt.u8.u32 %h1, %r1; cvt.s32.s8 %r4, %h1;", a)[:4].tolist() == [
        0xFFFFFF80, 0x7F, 0xFFFFFFFF, 0xFFFFFFFF]
    assert run_lanes("cvt.sat.u8.s32 %h1, %r1; cvt.u32.u16 %r4, %h1;", a)[:4].tolist() == [0x80, 0x7F, 0xFF, 0]


def test_float_compare_is_ordered_or_unordered_as_named():
    a = np.array([0x7FC00000, 0x3F800000, 0x3F800000, 0x00000000] * 8, np.uint32)
    b = np.array([0x3F800000, 0x7FC00000, 0x3F800000, 0x80000000] * 8, np.uint32)
    for cmp, want in [("lt", [0, 0, 0, 0]), ("ltu", [1, 1, 0, 0]), ("eq", [0, 0, 1, 1]), ("ne", [0, 0, 0, 0]),
                      ("neu", [1, 1, 0, 0]), ("nan", [1, 1, 0, 0]), ("num", [0, 0, 1, 1]), ("ge", [0, 0, 1, 1])]:
        got = run_lanes(f"setp.{cmp}.f32 %p1, %r1, %r2; selp.b32 %r4, 1, 0, %p1;", a, b)
        assert got[:4].tolist() == want, cmp


def test_set_writes_one_or_zero_in_the_destination_type():
    """set.lt.f32.f32 (the fp16/e4m3 rounding's "below the smallest normal" flag): 1.0f or 0.0f, false
    for a NaN; set with an integer destination: all ones or 0."""
    a = np.array([0x387FFFFF, 0x38800000, 0x7FFFFFFF, 0x80000000] * 8, np.uint32)  # < 2**-14, 2**-14, NaN, -0
    b = np.full(32, 0x38800000, np.uint32)
    got = run_lanes("set.lt.f32.f32 %r4, %r1, %r2;", a, b)
    assert got[:4].tolist() == [0x3F800000, 0, 0, 0x3F800000]
    got = run_lanes("set.ge.u32.f32 %r4, %r1, %r2;", a, b)
    assert got[:4].tolist() == [0, 0xFFFFFFFF, 0, 0]


# ------------------------------------------------------------------------------ helpers

def _s(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _tdiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _prmt(a: int, b: int, sel: int) -> int:
    pool = a | (b << 32)
    out = 0
    for k in range(4):
        nib = (sel >> (4 * k)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out
