"""The rotary angle: its fixed-point representation, its update, and the rotation of B and C.

Letters (docs/contract.md): B lanes, H heads, N state size, R MIMO rank, S rotary angles per head.

Mamba-3 keeps a running angle per (request, head, angle) and advances it every token by
``tanh(angle_proj) * dt * pi`` radians (upstream's ``angle_dt_state``). Stored as fp32 radians
without reduction, its resolution falls as it grows (a float32 ulp at 10^4 rad is 1e-3 rad). This
package stores it as a **fixed-point fraction of a turn**: an int64 ``q`` stands for the angle
``2 pi q / 2**64`` radians, so the representable angles are ``[-pi, pi)`` with a resolution of
2**-64 turn (3.4e-19 rad) everywhere, and int64 wrap-around *is* the reduction modulo a turn.

The update in fixed point (kernel and PyTorch alike): ``w = tanh(angle_proj) * dt`` in the compute
dtype (the increment is ``w / 2`` turns); whole turns are dropped exactly, ``w_f = w - 2 rint(w/2)``
in [-1, 1]; the increment is ``2 * rint(w_f * 2**62)`` units, added with wrap-around. For an fp32
``w`` the only rounding is of ``w_f * 2**62`` to an integer (at most one unit, 2**-64 turn, and
none at all when ``|w_f| >= 2**-39``): over 10^6 steps the stored angle stays within
10^6 x 2**-64 turn (3.4e-13 rad) of the float64 sum
of the same fp32 increments, whatever their signs (tests/contract/test_rotary.py iterates 10^6 steps).

``cos``/``sin`` of a stored angle: the top bits are the quadrant, ``k = round(q / 2**62)``; the
rest, ``r = q - k 2**62`` in [-2**61, 2**61), is at most an eighth of a turn; ``x = r * 2 pi / 2**64``
in [-pi/4, pi/4) is evaluated, then rotated by ``k`` quarter turns (no range reduction of a large
float ever happens). Conversions from and to upstream's fp32 radians (what a prefill writes):
:func:`angle_from_radians`, :func:`angle_to_radians`.

Pairs (upstream's ``rotate_pairwise``): MIMO pairs element ``i`` with ``i + N/2``, SISO pairs
``2i`` with ``2i + 1``; pair ``i < S`` rotates by angle ``i``, the others pass through. Rotation:
``(a, b) -> (a cos t - b sin t, a sin t + b cos t)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ANGLE_UNIT_RADIANS", "advance_angle", "angle_cos_sin", "angle_from_radians", "angle_increment",
           "angle_to_radians", "rotate_pairs"]

#: radians per unit of the fixed-point angle (2 pi / 2**64)
ANGLE_UNIT_RADIANS = 2 * math.pi / 2.0**64
_TWO62 = 2.0**62


def angle_increment(angle_proj: torch.Tensor, dt: torch.Tensor, compute_dtype=torch.float32) -> torch.Tensor:
    """The fixed-point increment (int64 units of 2**-64 turn) of ``tanh(angle_proj) * dt * pi``
    radians: ``angle_proj`` (..., H, S), ``dt`` (..., H), computed in ``compute_dtype``."""
    w = torch.tanh(angle_proj.to(compute_dtype)) * dt.to(compute_dtype)[..., None]
    w_frac = w - 2 * torch.round(w * 0.5)  # exact: drops whole turns
    units = torch.round(w_frac * _TWO62).to(torch.int64)  # |units| <= 2**62
    return units * 2  # wraps at +-2**63: half a turn either way


def advance_angle(angle: torch.Tensor, angle_proj: torch.Tensor, dt: torch.Tensor,
                  compute_dtype=torch.float32) -> torch.Tensor:
    """``angle`` (..., H, S) int64 advanced by one token (wrapping modulo a turn)."""
    return angle + angle_increment(angle_proj, dt, compute_dtype)


def angle_cos_sin(angle: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of fixed-point angles ``angle`` (int64), in ``dtype``: quadrant from the top
    bits, the remaining eighth of a turn evaluated in ``dtype`` (module docstring)."""
    k = ((angle >> 61) + 1) >> 1  # round(q / 2**62): in [-2, 2]
    r = (angle << 2) >> 2  # q - k 2**62, sign-extended from 62 bits: [-2**61, 2**61)
    x = r.to(dtype) * torch.tensor(ANGLE_UNIT_RADIANS, dtype=dtype)
    c, s = torch.cos(x), torch.sin(x)
    quadrant = k & 3
    cos = torch.where(quadrant == 0, c, torch.where(quadrant == 1, -s, torch.where(quadrant == 2, -c, s)))
    sin = torch.where(quadrant == 0, s, torch.where(quadrant == 1, c, torch.where(quadrant == 2, -s, -c)))
    return cos, sin


def rotate_pairs(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairwise: bool) -> torch.Tensor:
    """``v`` (..., N) with its first S pairs rotated by ``cos``/``sin`` (..., S), broadcast over
    ``v``'s leading axes; the other elements pass through. A new tensor."""
    S, N = cos.shape[-1], v.shape[-1]
    out = v.clone()
    if pairwise:
        ia, ib = slice(0, 2 * S, 2), slice(1, 2 * S, 2)
    else:
        ia, ib = slice(0, S), slice(N // 2, N // 2 + S)
    a, b = v[..., ia], v[..., ib]
    out[..., ia] = a * cos - b * sin
    out[..., ib] = a * sin + b * cos
    return out


def _pi_times(scale: int) -> int:
    """``floor(pi * scale)`` (to within one unit) for a power of two ``scale``, from Machin's formula
    ``pi = 16 atan(1/5) - 4 atan(1/239)`` in Python integers with 64 guard bits."""
    work = scale << 64

    def atan_inv(n: int) -> int:  # atan(1/n) * work, by its alternating series
        total, power, k, n2 = 0, work // n, 1, n * n
        while power:
            total += power // k if k % 4 == 1 else -(power // k)
            power //= n2
            k += 2
        return total

    return (16 * atan_inv(5) - 4 * atan_inv(239)) >> 64


#: the bits of 1/(2 pi): ``_INV_TWO_PI``, ``2**_INV_BITS / (2 pi)`` within 1.1 units. A float64 is below
#: 2**1024, so 1280 bits leave more than 190 guard bits below the 2**-62 turn
_INV_BITS = 1280


def _inv_two_pi(bits: int) -> int:
    """``2**bits / (2 pi)`` within 1.1 units (the denominator ``2 pi 2**bits`` is floored)."""
    return (1 << (2 * bits)) // ((2 * _pi_times(1 << (bits + 64))) >> 64)


_INV_TWO_PI = _inv_two_pi(_INV_BITS)
_TURN_BITS = 62  # angle_from_radians's resolution: 2**-62 turn


def _units_of_turn(theta: float) -> int:
    """``round(theta / (2 pi) * 2**62)`` modulo ``2**62``, exactly (Payne-Hanek: the integer mantissa times
    enough bits of 1/(2 pi)). Ties cannot occur (pi is irrational) but at 0; where the bits at hand cannot
    decide the rounding, more are taken."""
    num, den = abs(theta).as_integer_ratio()  # den: a power of two
    if num == 0:
        return 0
    shift_den = den.bit_length() - 1
    bits, inv = _INV_BITS, _INV_TWO_PI
    while True:
        # theta / (2 pi) * 2**62 = num * 2**(62 - shift_den) * inv / 2**bits, inv within 1.1 units of
        # 2**bits / (2 pi): the true product lies within 2 num of product
        shift = bits + shift_den - _TURN_BITS
        product = num * inv
        half = 1 << (shift - 1)
        rest = product & ((1 << shift) - 1)
        if abs(rest - half) > 2 * num:  # the rounding is decided
            units = (product + half) >> shift
            break
        bits *= 2  # more bits of 1/(2 pi)
        inv = _inv_two_pi(bits)
    units &= (1 << _TURN_BITS) - 1
    return units if theta > 0 else (-units) & ((1 << _TURN_BITS) - 1)


def angle_from_radians(theta: torch.Tensor) -> torch.Tensor:
    """Angles in radians (any float dtype: upstream's unreduced fp32 ``angle_dt_state``) -> the fixed-point
    int64 angles of ``angle_state``: for every finite input the nearest multiple of 2**-62 turn, exactly
    (the reduction modulo a turn is exact, whatever the size of ``theta``: no float division by 2 pi).

    Host arithmetic in Python integers, one element at a time (about 2 us an element: a prefill's
    conversion, not a step's); the result lies on ``theta``'s device. TypeError for a non-float tensor,
    ValueError naming ``theta`` for a NaN or an infinity (no angle)."""
    if not isinstance(theta, torch.Tensor) or not theta.dtype.is_floating_point:
        raise TypeError(f"theta: expected a floating-point tensor of radians, got "
                        f"{getattr(theta, 'dtype', type(theta).__name__)}")
    values = theta.detach().to("cpu", torch.float64)
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = values[~finite]
        raise ValueError(f"theta: expected finite radians, got {bad.numel()} non-finite value(s) "
                         f"({bad[:4].tolist()} ...) at index {(~finite).nonzero()[0].tolist()}")
    top, wrap = 1 << 63, 1 << 64
    words = [(_units_of_turn(v) << 2) for v in values.flatten().tolist()]  # 2**-64 turn units in [0, 2**64)
    signed = [w - wrap if w >= top else w for w in words]
    return torch.tensor(signed, dtype=torch.int64).view(theta.shape).to(theta.device)


def angle_to_radians(angle: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Fixed-point int64 angles -> radians in [-pi, pi), in ``dtype``."""
    if not isinstance(angle, torch.Tensor) or angle.dtype != torch.int64:
        raise TypeError(f"angle: expected an int64 tensor (angle_state), got "
                        f"{getattr(angle, 'dtype', type(angle).__name__)}")
    return (angle.to(torch.float64) * ANGLE_UNIT_RADIANS).to(dtype)
