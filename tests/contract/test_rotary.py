"""mamba3_step.rotary: the fixed-point angle's precision over 10^6 steps, the conversions from
and to radians, cos/sin of a stored angle in float32, and the rotation of pairs.

The precision test compares the stored int64 angle with the *exact* sum of the same fp32
increments: ``math.fsum`` of the increments (in units of ``w``, a half turn each) less a whole
number of turns, correctly rounded once, so the reference's own error (~4e-16 rad) is far below
what is measured (docs/performance.md, "Rotary angle"; ``bench/angle_bench.py`` compares the other
representations).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mamba3_step.rotary import (ANGLE_UNIT_RADIANS, advance_angle, angle_cos_sin, angle_from_radians, angle_increment, angle_to_radians, rotate_pairs)

STEPS = 10**6
#: one unit of the fixed-point angle in radians: the increment's rounding is at most one unit a step
UNIT = 2 * math.pi / 2.0**64


def _layer_increments(regime: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(angle_proj, dt)`` (n, 1) and (n,) fp32 as a layer makes them: ``dt`` = softplus of
    N(-4, 1) (about 0.03: the angle turns ~0.05 rad a step), ``angle_proj`` N(0, 1) (both signs)
    or its absolute value (one sign); ``adversarial``: the same small increment every step
    (dt = 0.0025, tanh(0.5): 3.6e-3 rad)."""
    g = torch.Generator().manual_seed(seed)
    if regime == "adversarial":
        return torch.full((n, 1), 0.5), torch.full((n,), 0.0025)
    p = torch.randn(n, 1, generator=g)
    dt = F.softplus(torch.randn(n, generator=g) - 4.0)
    return (p.abs() if regime == "one sign" else p), dt


def _exact_turns(w: np.ndarray) -> float:
    """The exact sum of ``w`` (float64 copies of fp32 values, in half turns) less a whole number
    of turns, correctly rounded: a value in about [-1, 1] half turns, error ~1e-16."""
    k = round(float(np.sum(w)) / 2)  # any integer works: it only has to keep the result small
    return math.fsum(np.append(w, -2.0 * k))


def _wrapping_sum(units: torch.Tensor) -> torch.Tensor:
    """The sum of int64 ``units`` modulo 2**64 (unsigned arithmetic: wrap-around is defined)."""
    total = units.numpy().view(np.uint64).sum(dtype=np.uint64)
    return torch.tensor(np.array([total], dtype=np.uint64).view(np.int64))


@pytest.mark.parametrize("regime", ["both signs", "one sign", "adversarial"])
def test_angle_stays_within_1e_6_of_the_float64_sum_after_a_million_steps(regime):
    """10^6 advances of one angle against cos/sin of pi x the exact sum of the same fp32
    increments: within 1e-6 (the contract), in fact within one unit (2**-64 turn) a step."""
    proj, dt = _layer_increments(regime, STEPS, seed=11)
    units = angle_increment(proj, dt)[:, 0]  # (n,) int64: one advance each
    w = (torch.tanh(proj) * dt[:, None])[:, 0]  # the same fp32 w the increment is made of
    # the increment is 2 rint(w_frac 2**62), exactly (w_frac = w less its whole turns)
    w64 = w.double().numpy()
    w_frac = w64 - 2 * np.rint(w64 / 2)
    assert np.array_equal(units.numpy(), 2 * np.rint(w_frac * 2.0**62).astype(np.int64))
    # advancing step by step is the wrapping sum of the increments (first 1000 steps)
    q = torch.zeros(1, 1, dtype=torch.int64)
    for k in range(1000):
        q = advance_angle(q, proj[k:k + 1], dt[k:k + 1])
    assert q.item() == _wrapping_sum(units[:1000]).item()

    angle = _wrapping_sum(units)
    cos, sin = angle_cos_sin(angle, torch.float64)
    ref = math.pi * _exact_turns(w64)
    err = max(abs(cos.item() - math.cos(ref)), abs(sin.item() - math.sin(ref)))
    grown = math.pi * float(np.abs(w64).sum())
    assert grown > (3e-3 * STEPS if regime == "adversarial" else 0.04 * STEPS)  # it did turn a lot (radians)
    assert err <= 1e-6
    assert err <= STEPS * UNIT + 1e-15, err  # one unit a step at most: 3.4e-13 rad after 10^6 steps


# ----------------------------------------------------------------------------- increments
def test_increment_drops_whole_turns_and_wraps_a_half_turn():
    dt = torch.ones(5)
    # w = tanh(p) dt; pick dt so that w is exactly 0, +-1 (half a turn) and +-2 (a whole turn)
    proj = torch.full((5, 1), 20.0)  # tanh(20) == 1.0 in fp32
    assert torch.tanh(proj[0]).item() == 1.0
    units = angle_increment(proj, torch.tensor([0.0, 1.0, -1.0, 2.0, -2.0]) * dt)[:, 0].tolist()
    assert units == [0, -2**63, -2**63, 0, 0]  # a half turn either way is -2**63; whole turns vanish
    small = angle_increment(torch.full((1, 1), 20.0), torch.tensor([2.0**-20]))
    assert small.item() == 2 * 2**42  # w / 2 turns = 2**-21 turn = 2**43 units
    q = torch.tensor([2**63 - 2])
    assert advance_angle(q[:, None], torch.full((1, 1), 20.0), torch.tensor([2.0**-62])).item() == -2**63  # wraps


# ----------------------------------------------------------------------------- conversions
def _wrapped(d: torch.Tensor) -> torch.Tensor:
    return d - 2 * math.pi * torch.round(d / (2 * math.pi))


def test_radians_round_trip():
    g = torch.Generator().manual_seed(3)
    theta = torch.cat([torch.randn(1000, generator=g, dtype=torch.float64) * 10,
                       (torch.rand(1000, generator=g, dtype=torch.float64) - 0.5) * 2e5,
                       torch.tensor([0.0, math.pi, -math.pi, 1e5, -1e5, -0.5, 2 * math.pi, -3 * math.pi, 1e-300],
                                    dtype=torch.float64)])
    q = angle_from_radians(theta)
    assert q.dtype == torch.int64
    back = angle_to_radians(q, torch.float64)
    # [-pi, pi): float64's pi lies below pi, so a value just under half a turn may round to it
    assert bool(((back >= -math.pi) & (back <= math.pi)).all())
    tol = 4e-16 * theta.abs().clamp(min=1.0)  # theta / (2 pi) is rounded once, in float64
    assert bool((_wrapped(back - theta).abs() <= tol).all())
    # and the other way: a stored angle survives radians exactly up to the 2**-62 turn of from_radians
    ints = torch.randint(-2**63, 2**63 - 1, (1000,), generator=g, dtype=torch.int64)
    again = angle_from_radians(angle_to_radians(ints, torch.float64))
    assert bool(((again - ints).abs() <= 2**12).all())  # float64 keeps 53 of the 64 bits


def test_radians_special_values_and_float32():
    assert angle_from_radians(torch.tensor([0.0])).item() == 0
    # float64's pi is pi - 1.22e-16: 360 units of 2**-64 turn short of half a turn (exact reduction)
    assert angle_from_radians(torch.tensor([math.pi], dtype=torch.float64)).item() == 2**63 - 360
    assert angle_from_radians(torch.tensor([-math.pi], dtype=torch.float64)).item() == -(2**63 - 360)
    assert angle_from_radians(torch.tensor([math.pi / 2], dtype=torch.float64)).item() == 2**62 - 180
    assert angle_to_radians(torch.tensor([-2**63])).item() == np.float32(-math.pi)  # float32 by default
    assert angle_to_radians(torch.tensor([2**62]), torch.float64).item() == math.pi / 2
    theta32 = torch.tensor([1e5, -12345.678, 3.0, -3.0], dtype=torch.float32)  # upstream's fp32 state
    back = angle_to_radians(angle_from_radians(theta32))
    assert back.dtype == torch.float32
    want = _wrapped(theta32.double())
    assert torch.allclose(back.double(), want, rtol=0, atol=4e-7)


@pytest.mark.parametrize("bad", [torch.tensor([1, 2]), torch.tensor([True]), 3.0, [0.5], None])
def test_from_radians_refuses_non_float_tensors(bad):
    with pytest.raises(TypeError, match="floating-point tensor of radians"):
        angle_from_radians(bad)


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([1], dtype=torch.int32), 7, None])
def test_to_radians_refuses_anything_but_int64(bad):
    with pytest.raises(TypeError, match="int64 tensor"):
        angle_to_radians(bad)


# ----------------------------------------------------------------------------- cos / sin
BOUNDARIES = [0, 1, -1, 2**61, -2**61, 2**61 - 1, -2**61 - 1, 2**62, -2**62, 2**62 - 1, -2**62 + 1,
              3 * 2**61, -3 * 2**61, 2**63 - 1, -2**63, -2**63 + 1]


def test_cos_sin_float32_within_three_ulp_of_float64():
    g = torch.Generator().manual_seed(5)
    q = torch.cat([torch.tensor(BOUNDARIES, dtype=torch.int64),
                   torch.randint(-2**63, 2**63 - 1, (200_000,), generator=g, dtype=torch.int64),
                   torch.randint(-2**40, 2**40, (1000,), generator=g, dtype=torch.int64)])  # tiny angles
    c32, s32 = angle_cos_sin(q, torch.float32)
    assert c32.dtype == s32.dtype == torch.float32
    theta = q.double() * ANGLE_UNIT_RADIANS  # float64: 53 bits of q, an error below 4e-16 rad
    for got, want in ((c32, torch.cos(theta)), (s32, torch.sin(theta))):
        ulp = torch.from_numpy(np.spacing(np.abs(want.float().numpy()))).double()  # float32 ulp of the value
        ulps = ((got.double() - want).abs() - 4e-16).clamp(min=0) / ulp  # less the reference's own error
        # x = r * unit in float32 (two roundings) then cos/sin (one): 2.4 ulp at most measured
        assert ulps.max().item() <= 3.0, (ulps.max().item(), q[ulps.argmax()].item())
    assert torch.equal(c32[:1], torch.ones(1)) and torch.equal(s32[:1], torch.zeros(1))  # q = 0
    # exact quarter turns
    c, s = angle_cos_sin(torch.tensor([2**62, -2**62, -2**63]), torch.float64)
    assert c.abs().tolist() == [0.0, 0.0, 1.0] and s.tolist() == [1.0, -1.0, -0.0]
    assert c[2].item() == -1.0


def test_cos_sin_float64_against_math():
    q = torch.tensor(BOUNDARIES, dtype=torch.int64)
    c, s = angle_cos_sin(q, torch.float64)
    for qi, ci, si in zip(q.tolist(), c.tolist(), s.tolist()):
        t = qi * ANGLE_UNIT_RADIANS
        assert abs(ci - math.cos(t)) <= 4e-16 and abs(si - math.sin(t)) <= 4e-16, qi
    assert bool((c * c + s * s - 1).abs().max() <= 4e-16)


# ----------------------------------------------------------------------------- pairs
def _naive_rotate(v, cos, sin, pairwise):
    """Element by element: pair i < S rotated by angle i; the rest copied."""
    out = v.clone()
    L, R, H, N = v.shape
    S = cos.shape[-1]
    for b in range(L):
        for r in range(R):
            for h in range(H):
                for i in range(S):
                    i0, i1 = (2 * i, 2 * i + 1) if pairwise else (i, i + N // 2)
                    a, bb = v[b, r, h, i0].item(), v[b, r, h, i1].item()
                    c, s = cos[b, 0, h, i].item(), sin[b, 0, h, i].item()
                    out[b, r, h, i0] = a * c - bb * s
                    out[b, r, h, i1] = a * s + bb * c
    return out


@pytest.mark.parametrize("pairwise", [False, True], ids=["mimo-halves", "pairwise"])
@pytest.mark.parametrize("S", [1, 5, 8])
def test_rotate_pairs_against_a_naive_loop(pairwise, S):
    g = torch.Generator().manual_seed(S)
    L, R, H, N = 2, 3, 2, 16
    v = torch.randn(L, R, H, N, generator=g, dtype=torch.float64)
    q = torch.randint(-2**63, 2**63 - 1, (L, H, S), generator=g, dtype=torch.int64)
    cos, sin = angle_cos_sin(q, torch.float64)
    cos, sin = cos[:, None], sin[:, None]  # (L, 1, H, S): every rank the same angle
    before = v.clone()
    got = rotate_pairs(v, cos, sin, pairwise)
    assert torch.equal(v, before)  # a new tensor
    torch.testing.assert_close(got, _naive_rotate(v, cos, sin, pairwise), rtol=0, atol=0)
    untouched = [n for n in range(N) if (n >= 2 * S if pairwise else not (n < S or N // 2 <= n < N // 2 + S))]
    assert torch.equal(got[..., untouched], v[..., untouched])
    # a rotation keeps each pair's length
    idx = (list(range(0, 2 * S, 2)), list(range(1, 2 * S, 2))) if pairwise else (
        list(range(S)), list(range(N // 2, N // 2 + S)))
    norm = v[..., idx[0]] ** 2 + v[..., idx[1]] ** 2
    torch.testing.assert_close(got[..., idx[0]] ** 2 + got[..., idx[1]] ** 2, norm)


# ----------------------------------------------------------------------------- exact reduction
def _chudnovsky_pi(digits: int):
    """pi to ``digits`` significant decimal digits, by the Chudnovsky series (14 digits a term), in
    ``decimal``: written here, independent of the library's reduction."""
    import decimal

    with decimal.localcontext() as ctx:
        ctx.prec = digits + 20
        total, k, M, L, X, K = decimal.Decimal(13591409), 1, 1, 13591409, 1, 6
        while k < digits // 14 + 3:
            M = M * (K**3 - 16 * K) // k**3
            L += 545140134
            X *= -262537412640768000
            total += decimal.Decimal(M * L) / X
            K += 12
            k += 1
        return decimal.Decimal(426880) * decimal.Decimal(10005).sqrt() / total


def _exact_units(theta: float, two_pi) -> int:
    """round(theta / (2 pi) * 2**62) modulo 2**62, times 4, as a signed int64: in ``decimal`` at 500
    digits (a float64 below 1.8e308 times 2**62 leaves more than 150 digits after the point)."""
    import decimal

    with decimal.localcontext() as ctx:
        ctx.prec = 500
        t = decimal.Decimal(theta) * (2**62) / two_pi  # Decimal(float) is exact
        q = int(t.to_integral_value(rounding=decimal.ROUND_HALF_EVEN)) % 2**62
    word = q * 4
    return word - 2**64 if word >= 2**63 else word


def test_from_radians_exact_over_the_whole_exponent_range():
    """Every finite float64 (random mantissas at every binary exponent, subnormals, the named worst
    cases 1e4 and 1.4e18, values next to multiples of pi) maps to the exactly rounded 2**-62 turn."""
    import decimal

    pi = _chudnovsky_pi(520)
    with decimal.localcontext() as ctx:
        ctx.prec = 510
        two_pi = 2 * pi
    rng = np.random.default_rng(17)
    exponents = np.arange(-1074, 1024)
    mantissas = rng.uniform(0.5, 1.0, exponents.size) * rng.choice([-1.0, 1.0], exponents.size)
    values = [math.ldexp(float(m), int(e)) for m, e in zip(mantissas, exponents)]
    values += [1e4, -1e4, 1.4e18, -1.4e18, 5e-324, 1.7976931348623157e308, -1.7976931348623157e308, 0.0, -0.0,
               math.pi, 2 * math.pi, 1e22 * math.pi, 6381956970095103 * 2.0**797]
    values += list(rng.uniform(-1e6, 1e6, 200)) + list(rng.normal(0, 10, 200))
    values = [v for v in values if math.isfinite(v)]
    got = angle_from_radians(torch.tensor(values, dtype=torch.float64)).tolist()
    want = [_exact_units(v, two_pi) for v in values]
    wrong = [(v, g, w) for v, g, w in zip(values, got, want) if g != w]
    assert not wrong, f"{len(wrong)} of {len(values)} off, e.g. {wrong[:3]}"
    # fp32 inputs (upstream's angle state) convert exactly too
    v32 = torch.tensor([1e4, 1.4e18, -3e38, 1e-45], dtype=torch.float32)
    assert angle_from_radians(v32).tolist() == [_exact_units(float(v), two_pi) for v in v32.double().tolist()]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_from_radians_refuses_nan_and_inf_by_name(bad):
    with pytest.raises(ValueError, match="theta: expected finite radians"):
        angle_from_radians(torch.tensor([0.5, bad], dtype=torch.float64))
