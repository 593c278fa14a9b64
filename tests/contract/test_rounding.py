"""mamba3_step.rounding: Philox4x32 against Random123's published answers, the layout of the state's
random bits, stochastic rounding to bf16 / fp16 / e4m3 (exactness, neighbours, exact expectation
over all 2**16 draws, a statistical test on Philox's own bits, special values, subnormals, overflow,
sign symmetry) and the 8-bit rows with scales.

Statistical tests: each asserts a mean within 6 standard deviations of its exact expectation
(two-sided normal tail 2.0e-9 per assertion; fewer than 1,000 such assertions here, so the whole
file fails by chance with probability below 2e-6). The seeds are fixed, so a run is repeatable."""

from __future__ import annotations

import math

import pytest
import torch

from mamba3_step import rounding
from mamba3_step.rounding import dequantize_rows, philox4x32, quantize_rows, state_bits, stochastic_round
from mamba3_step.testing import bits

# Random123 (DEShawResearch/random123, commit 9545ff6413f258be2f04c1d319d99aaef7521150), file
# tests/kat_vectors, lines 24-29: name, rounds, counter (4 words), key (2 words), expected (4 words).
KAT = """
philox4x32 7 00000000 00000000 00000000 00000000 00000000 00000000   5f6fb709 0d893f64 4f121f81 4f730a48
philox4x32 7 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   5207ddc2 45165e59 4d8ee751 8c52f662
philox4x32 7 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   4dfccaba 190a87f0 c47362ba b6b5242a
philox4x32 10 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
philox4x32 10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
philox4x32 10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
"""
SIGMAS = 6.0
DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
#: (mantissa bits, smallest normal exponent) of each target, written out here independently
GRID = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float8_e4m3fn: (3, -6)}
ALL_R = torch.arange(65536, dtype=torch.int64)


def _kat_rows():
    for line in KAT.strip().splitlines():
        f = line.split()
        yield int(f[1]), [int(v, 16) for v in f[2:6]], [int(v, 16) for v in f[6:8]], [int(v, 16) for v in f[8:12]]


# ----------------------------------------------------------------------------- Philox
@pytest.mark.parametrize("rounds,counter,key,expected", list(_kat_rows()))
def test_philox_known_answers(rounds, counter, key, expected):
    out = philox4x32(torch.tensor(counter), torch.tensor(key), rounds)
    assert out.tolist() == expected


def _philox_python(counter, key, rounds):
    """Philox4x32 on Python ints (a second, loop-by-loop transcription of Random123's philox.h)."""
    c, k = list(counter), list(key)
    for i in range(rounds):
        if i:
            k = [(k[0] + 0x9E3779B9) % 2**32, (k[1] + 0xBB67AE85) % 2**32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 % 2**32, (p0 >> 32) ^ c[3] ^ k[1], p0 % 2**32]
    return c


def test_philox_batched_equals_python_ints():
    g = torch.Generator().manual_seed(1)
    counter = torch.randint(0, 2**32, (64, 4), generator=g, dtype=torch.int64)
    key = torch.randint(0, 2**32, (64, 2), generator=g, dtype=torch.int64)
    for rounds in (1, 7, 10):
        out = philox4x32(counter, key, rounds)
        for i in range(0, 64, 7):
            assert out[i].tolist() == _philox_python(counter[i].tolist(), key[i].tolist(), rounds)


def test_philox_refuses_bad_arguments():
    with pytest.raises(ValueError):
        philox4x32(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError):
        philox4x32(torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError):
        philox4x32(torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), rounds=0)


# ----------------------------------------------------------------------------- the state's bits
def _element_bits(seed, offset, row, h, d, n, D, N, rounds=10):
    """One element's 16 bits from the documented layout, through the Python Philox."""
    G = -(-N // 8)
    u = seed % 2**64
    o = offset % 2**64
    out = _philox_python([o % 2**32, o >> 32, row, (h * D + d) * G + n // 8], [u % 2**32, u >> 32], rounds)
    return (out[(n % 8) // 2] >> (16 * (n % 2))) & 0xFFFF


@pytest.mark.parametrize("seed,offset", [(0, 0), (-1, 2**40 + 3), (0x123456789, -5)])
def test_state_bits_layout(seed, offset):
    H, D, N = 3, 5, 20  # N not a multiple of 8: the last call of a row serves 4 elements
    rows = [7, 0, 2**31 + 1]
    b = state_bits(seed, offset, rows, H, D, N)
    assert b.shape == (3, H, D, N) and b.dtype == torch.int64
    for (i, h, d, n) in [(0, 0, 0, 0), (0, 2, 4, 19), (1, 1, 3, 9), (2, 0, 1, 16), (2, 2, 2, 7), (1, 0, 0, 1)]:
        assert int(b[i, h, d, n]) == _element_bits(seed, offset, rows[i], h, d, n, D, N)


def test_state_bits_depend_on_row_not_lane_and_change_with_offset_and_seed():
    H, D, N = 2, 4, 16
    a = state_bits(9, 100, [5, 3, 8], H, D, N)
    b = state_bits(9, 100, [8, 5], H, D, N)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])  # a row's bits, whichever lane holds it
    assert not torch.equal(a[0], a[1])
    for other in (state_bits(9, 101, [5], H, D, N), state_bits(10, 100, [5], H, D, N),
                  state_bits(9, 100 + 2**32, [5], H, D, N)):
        assert (other[0] != a[0]).float().mean() > 0.99
    many = state_bits(9, torch.tensor([100, 101, 7]), [5, 3, 8], H, D, N)
    assert many.shape == (3, 3, H, D, N)
    assert torch.equal(many[0], a) and torch.equal(many[1], state_bits(9, 101, [5, 3, 8], H, D, N))
    assert torch.equal(state_bits(9, 100, [5], H, D, N, rounds=7)[0, 1, 2],
                       torch.tensor([_element_bits(9, 100, 5, 1, 2, n, D, N, 7) for n in range(N)]))


def test_state_bits_are_uniform_16_bit_words():
    b = state_bits(2024, 0, list(range(8)), 4, 64, 128)  # 262,144 draws
    assert int(b.min()) >= 0 and int(b.max()) < 65536
    n = b.numel()
    sd = math.sqrt((65536**2 - 1) / 12 / n)
    assert abs(b.double().mean() - 32767.5) < SIGMAS * sd
    for bit in (0, 7, 15):  # each bit is a fair coin
        ones = ((b >> bit) & 1).double().mean()
        assert abs(ones - 0.5) < SIGMAS * 0.5 / math.sqrt(n)


def test_state_bits_refuses_bad_arguments():
    with pytest.raises(TypeError):
        state_bits(1.5, 0, [0], 1, 1, 8)
    with pytest.raises(TypeError):
        state_bits(torch.tensor([1, 2]), 0, [0], 1, 1, 8)
    with pytest.raises(ValueError):
        state_bits(1, 0, [-1], 1, 1, 8)


# ----------------------------------------------------------------------------- stochastic rounding
def _rounded_magnitude(x: torch.Tensor, dtype) -> torch.Tensor:
    """The magnitude the rule rounds, float64: ``|x|``, or below the smallest normal ``2**emin`` (fp16,
    e4m3) ``fl32(|x| + 2**emin) - 2**emin``, within 2**-14 (fp16) / 2**-21 (e4m3) of a step of |x|."""
    man, emin = GRID[dtype]
    a = x.double().abs()
    if dtype == torch.bfloat16:
        return a
    t = (x.abs() + 2.0**emin).double() - 2.0**emin  # an fp32 addition, then exact in float64
    small = a < 2.0**emin
    assert bool(((t - a).abs()[small] <= 2.0 ** (emin - man) * 2.0 ** (man - 24)).all())
    return torch.where(small, t, a)


def _neighbours(x: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo, hi, fraction) in float64, independently of the implementation: lo = the rounded magnitude
    (:func:`_rounded_magnitude`) truncated to the target grid, hi the next grid value up (2**(emax+1)
    above the largest finite one), fraction of a step, from the format's exponent and mantissa width."""
    man, emin = GRID[dtype]
    a = _rounded_magnitude(x, dtype)
    e = torch.floor(torch.log2(a.clamp(min=1e-300))).clamp(min=emin)
    e = torch.where(2.0**e > a, e - 1, e).clamp(min=emin)  # log2 may round at a power of two
    e = torch.where(2.0 ** (e + 1) <= a, e + 1, e)
    ulp = 2.0 ** (e - man)
    lo = torch.floor(a / ulp) * ulp
    return lo, lo + ulp, (a - lo) / ulp


def _wide_values(n, seed=0) -> torch.Tensor:
    """fp32 values over many binades, both signs, with fp16 / e4m3 subnormals and fp32 subnormals."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g) + 1.0
    expo = torch.randint(-40, 16, (n,), generator=g).float()
    sign = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    x = (sign * mant * 2.0**expo).float()
    return torch.cat([x, torch.tensor([1e-40, -3e-42, 2.0**-24 * 1.3, 2.0**-25, 2.0**-30, 2.0**-9 * 0.7])])


@pytest.mark.parametrize("dtype", DTYPES)
def test_representable_values_are_exact(dtype):
    if dtype == torch.float8_e4m3fn:
        every = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype)
    else:
        every = torch.arange(-32768, 32768, dtype=torch.int16).view(dtype)
    x = every.float()
    x = x[torch.isfinite(x)]
    for r in (0, 1, 0x8000, 0xFFFF):
        got = stochastic_round(x, torch.full_like(x, r, dtype=torch.int64), dtype)
        assert torch.equal(bits(got), bits(x.to(dtype))), r


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_are_neighbours_with_the_exact_probability(dtype):
    """Every draw lands on lo or hi, and over all 2**16 values of r the result is hi exactly F times,
    F = floor(fraction * 2**16): the expectation is lo + (hi - lo) F / 2**16."""
    x = _wide_values(120)
    x = x[x.abs() < (400.0 if dtype == torch.float8_e4m3fn else 6e4)]
    lo, hi, frac = _neighbours(x, dtype)
    got = stochastic_round(x[:, None].expand(-1, 65536).contiguous(), ALL_R.expand(len(x), -1), dtype)
    mag = got.double().abs()
    assert bool(((mag == lo[:, None]) | (mag == hi[:, None])).all())
    ups = (mag == hi[:, None]).sum(1)
    assert torch.equal(ups, torch.floor(frac * 65536).to(torch.int64))
    assert bool((torch.signbit(got.float()) == torch.signbit(x)[:, None]).all())  # -0.0 from a negative x
    mean, a = mag.mean(1), _rounded_magnitude(x, dtype)
    assert bool(((a - mean) < (hi - lo) * 2.0**-16).all())  # bias below 2**-16 ulp
    assert bool((mean <= a).all())  # and towards zero


def test_bf16_is_unbiased_exactly_and_equals_the_pattern_rule():
    x = _wide_values(2000)
    r = torch.randint(0, 65536, x.shape, generator=torch.Generator().manual_seed(3))
    got = stochastic_round(x, r, torch.bfloat16)
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = (((u + r) & 0xFFFF0000) >> 16).to(torch.int32).to(torch.int16)  # wraps into int16 as bits
    assert torch.equal(got.view(torch.int16), want)
    some = x[:50]
    every = stochastic_round(some[:, None].expand(-1, 65536).contiguous(), ALL_R.expand(50, -1), torch.bfloat16)
    assert torch.equal(every.double().mean(1), some.double())  # no bias at all


@pytest.mark.parametrize("dtype", DTYPES)
def test_unbiased_with_philox_bits(dtype):
    """4096 draws per value with the state's own bits (offsets 0..4095): the mean within 6 sigma of
    the exact expectation lo + ulp F/2**16, sigma = ulp sqrt(p (1 - p) / 4096)."""
    x = torch.tensor([1.0 + 2.0**-10, -3.3, 0.1234, 2.0**-20 * 1.7, 250.0, -0.0077, 7e-3, 1.5e-5])
    draws = state_bits(77, torch.arange(4096), [0], 1, 1, 8)[:, 0, 0, 0]  # (4096, 8)
    got = stochastic_round(x.expand(4096, -1).contiguous(), draws, dtype).double().abs()
    lo, hi, frac = _neighbours(x, dtype)
    p = torch.floor(frac * 65536) / 65536
    sd = (hi - lo) * torch.sqrt(p * (1 - p) / 4096)
    err = (got.mean(0) - (lo + (hi - lo) * p)).abs()
    assert bool((err <= SIGMAS * sd + 1e-300).all()), (err, sd)


def test_special_values():
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1e-45, 1e-45])
    for dtype in (torch.bfloat16, torch.float16):
        for r in (0, 0xFFFF):
            got = stochastic_round(x, torch.full((8,), r), dtype)
            b = bits(got).tolist()
            assert b[0] == b[1] == 0x7FFF
            assert got[2] == float("inf") and got[3] == -float("inf")
            assert b[4] == 0 and b[5] == -32768  # +0, -0
            assert bool(torch.signbit(got[6])) and not bool(torch.signbit(got[7]))
    got = stochastic_round(x, torch.zeros(8, dtype=torch.int64), torch.float8_e4m3fn)
    assert bits(got)[:4].tolist() == [0x7F] * 4  # e4m3fn has no inf: NaN
    assert bits(got)[4:6].tolist() == [0, -128]


def test_overflow():
    """fp16: between 65504 and 65536, max with probability 1 - F/2**16 else inf; 65536 and above:
    inf. bf16: the round-up from its largest finite value is inf. e4m3fn saturates at 448."""
    x = torch.tensor([65505.0, 65535.0, 65536.0, 1e6, -65520.0])
    every = stochastic_round(x[:, None].expand(-1, 65536).contiguous(), ALL_R.expand(5, -1), torch.float16)
    infs = torch.isinf(every).sum(1).tolist()
    assert infs[2:4] == [65536, 65536]
    for i, v in ((0, 65505.0), (1, 65535.0), (4, 65520.0)):
        assert infs[i] == math.floor((v - 65504.0) / 32.0 * 65536)
        assert bool((every[i][~torch.isinf(every[i])].abs() == 65504.0).all())
    big = torch.tensor([3.3895e38, 3.4e38]).float()  # bf16 max is 3.3895e38 (0x7F7F)
    got = stochastic_round(big, torch.tensor([0xFFFF, 0xFFFF]), torch.bfloat16)
    assert torch.isinf(got[1]) and bits(stochastic_round(big, torch.tensor([0, 0]), torch.bfloat16))[1] == 0x7F7F
    sat = stochastic_round(torch.tensor([447.0, 449.0, 1e9, -1e9]), torch.full((4,), 0xFFFF), torch.float8_e4m3fn)
    assert sat.float().tolist() == [448.0, 448.0, 448.0, -448.0]


def test_fp16_subnormals_round_at_the_subnormal_step():
    """Between fp16 subnormals (step 2**-24) the draw compares 13 bits: t = fl32(|x| + 2**-14) has 13
    fraction bits below that step, so hi comes up 8 floor(frac(t) 2**13) times in 2**16 draws, within
    one 13-bit step of |x|'s own fraction."""
    tiny = 2.0**-24
    x = torch.tensor([1.3 * tiny, 0.3 * tiny, 5.75 * tiny, 1000.5 * tiny, -0.01 * tiny])
    every = stochastic_round(x[:, None].expand(-1, 65536).contiguous(), ALL_R.expand(5, -1), torch.float16)
    vals = [sorted(set(row.double().abs().tolist())) for row in every]
    assert vals[0] == [tiny, 2 * tiny] and vals[1] == [0.0, tiny] and vals[2] == [5 * tiny, 6 * tiny]
    assert vals[3] == [1000 * tiny, 1001 * tiny] and vals[4] == [0.0, tiny]
    ups = [(row.double().abs() == v[1]).sum().item() for row, v in zip(every, vals)]
    assert ups[2:4] == [math.floor(f * 65536) for f in (0.75, 0.5)]  # fractions of 13 bits or fewer
    for got, xi in zip(ups, x.tolist()):
        t = float(torch.tensor(abs(xi)) + 2.0**-14) - 2.0**-14  # the fp32 addition
        assert got == 8 * math.floor((t / tiny % 1) * 2**13)
        assert abs(got - (abs(xi) / tiny % 1) * 65536) <= 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_symmetry(dtype):
    x = _wide_values(3000, seed=5)
    r = torch.randint(0, 65536, x.shape, generator=torch.Generator().manual_seed(6))
    a, b = stochastic_round(x, r, dtype), stochastic_round(-x, r, dtype)
    assert torch.equal(bits(a.float()), bits(-b.float()))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_half_draw_is_round_to_nearest_away_from_ties(dtype):
    """r = 2**15 rounds up exactly when the fraction is at least a half: nearest rounding, ties away
    from zero (torch rounds ties to even): equal to torch's cast everywhere but at ties."""
    x = _wide_values(5000, seed=8)
    x = x[x.abs() < 6e4]
    got = stochastic_round(x, torch.full_like(x, 0x8000, dtype=torch.int64), dtype)
    _, _, frac = _neighbours(x, dtype)
    tie = frac == 0.5
    assert torch.equal(bits(got)[~tie], bits(x.to(dtype))[~tie])


def test_stochastic_round_refuses_bad_arguments():
    with pytest.raises(TypeError):
        stochastic_round(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.int64), torch.bfloat16)
    with pytest.raises(TypeError):
        stochastic_round(torch.zeros(2), torch.zeros(2), torch.bfloat16)
    with pytest.raises(ValueError):
        stochastic_round(torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.float32)


# ----------------------------------------------------------------------------- 8-bit rows
FMTS = ("int8", "float8_e4m3fn")


def test_rows_on_the_grid_are_exact():
    ints = torch.arange(-127, 128, dtype=torch.float32)[None].repeat(3, 1)  # absmax 127: scale 1
    e4 = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = e4[torch.isfinite(e4)][None]  # absmax 448
    for fmt, x in (("int8", ints), ("float8_e4m3fn", e4)):
        r = torch.randint(0, 65536, x.shape, generator=torch.Generator().manual_seed(1))
        q, scale = quantize_rows(x, r, fmt)
        assert bool((scale == 1.0).all()) and torch.equal(dequantize_rows(q, scale), x)


@pytest.mark.parametrize("fmt", FMTS)
def test_scale_rule_and_range(fmt):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, 128, generator=g) * torch.exp(torch.randn(6, 5, 1, generator=g) * 4)
    r = torch.randint(0, 65536, x.shape, generator=g)
    q, scale = quantize_rows(x, r, fmt)
    Q = {"int8": 127.0, "float8_e4m3fn": 448.0}[fmt]
    absmax = x.abs().amax(-1)
    assert torch.equal(scale, absmax / Q) and scale.dtype == torch.float32 and scale.shape == (6, 5)
    assert q.dtype == rounding.EIGHT_BIT_FORMATS[fmt] and q.shape == x.shape
    v = x * (Q / absmax)[..., None]  # the values that were rounded
    qf = q.float()
    assert bool((qf.abs() <= Q).all())
    if fmt == "int8":
        ok = (qf == torch.trunc(v)) | (qf == torch.trunc(v) + torch.sign(v))
        ok |= qf.abs() == 127  # clamped at the row's absmax
    else:
        lo, hi, _ = _neighbours(v, torch.float8_e4m3fn)
        ok = (qf.double().abs() == lo) | (qf.double().abs() == hi.clamp(max=448.0))
    assert bool(ok.all())
    q2, s2 = quantize_rows(-x, r, fmt)  # sign symmetry, bit for bit
    assert torch.equal(s2, scale) and torch.equal(q2.float(), -qf)


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantised_rows_are_unbiased(fmt):
    """Over all 2**16 draws the mean dequantised value is x to within the fp32 roundings of the
    scale (a few 2**-24 relative) and 2**-16 of a step."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, generator=g)
    q, scale = quantize_rows(x[:, None, :].expand(-1, 65536, -1).contiguous(),
                             ALL_R[:, None].expand(65536, 16)[None].expand(2, -1, -1), fmt)
    mean = dequantize_rows(q, scale).double().mean(1)
    step = x.abs().amax(-1, keepdim=True).double() / (127.0 if fmt == "int8" else 448.0 / 32)
    assert bool(((mean - x.double()).abs() <= 1e-6 * x.double().abs() + step * 2.0**-15).all())


def test_zero_tiny_and_non_finite_rows():
    x = torch.zeros(5, 8)
    x[1, 3] = 2.0**-101
    x[2, 0] = float("nan")
    x[3, 5] = -float("inf")
    x[4] = torch.linspace(-1, 1, 8)
    for fmt in FMTS:
        q, scale = quantize_rows(x, torch.full((5, 8), 0xFFFF), fmt)
        assert bool((q[:4].float() == 0).all())
        assert scale[:2].tolist() == [0.0, 0.0] and bool(torch.isnan(scale[2:4]).all()) and scale[4] > 0
        back = dequantize_rows(q, scale)
        assert bool((back[:2] == 0).all()) and bool(torch.isnan(back[2:4]).all())


def test_quantize_refuses_bad_arguments():
    with pytest.raises(ValueError):
        quantize_rows(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.int64), "int4")
    with pytest.raises(TypeError):
        quantize_rows(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 8, dtype=torch.int64), "int8")
    with pytest.raises(TypeError):
        dequantize_rows(torch.zeros(2, 8), torch.ones(2))
    with pytest.raises(ValueError):
        dequantize_rows(torch.zeros(2, 8, dtype=torch.int8), torch.ones(3))
