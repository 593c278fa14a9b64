"""Storing a state in fewer bits: the random bits, stochastic rounding, 8-bit rows with scales.

The CPU reference the step's kernel matches bit for bit (for the same fp32 values). Everything is
integer or exactly rounded arithmetic on the fp32 pattern, vectorised in PyTorch; the docstrings
are the rules.

Random bits (:func:`state_bits`): Philox4x32 (Salmon et al., SC11; :func:`philox4x32`) with

* key ``(k0, k1)`` = the low and high 32 bits of the int64 ``seed`` (two's complement);
* counter ``(c0, c1, c2, c3)`` = (low 32 bits of ``offset``, high 32 bits of ``offset``, the row
  written (the pool row; the lane in dense mode), ``(h * D + d) * G + g``) with ``G = ceil(N / 8)``
  and ``g = n // 8``: one call per 8 consecutive ``n`` of one (row, head, d);
* element ``n`` takes the 16 bits ``(out[(n % 8) // 2] >> (16 * (n % 2))) & 0xFFFF``: output word
  ``j`` feeds ``n = 8g + 2j`` (low half) and ``8g + 2j + 1`` (high half).

A thread holding a 16-byte vector of a 16-bit state (8 consecutive ``n``, ``n`` a multiple of 8)
makes exactly one Philox call for it (two for a 16-byte vector of an 8-bit state); the key
schedule (``k + i * W`` per round) depends on the seed alone and is shared by all of a thread's
calls. Nothing depends on the lane or on which other requests share the batch. A T-token step
draws token ``t``'s bits at ``offset + t``.

Stochastic rounding (:func:`stochastic_round`, :func:`quantize_rows`): for a finite fp32 ``x``
and a target grid (bf16, fp16, e4m3, or the integers), ``lo`` = ``|x|`` truncated to the grid,
``ulp`` the grid step above ``lo``, ``F = floor((|x| - lo) / ulp * 2**16)`` (0..65535). With the
element's 16 random bits ``r`` the magnitude rounds up iff ``F + r >= 2**16`` (probability
``F / 2**16``), then takes ``x``'s sign (so ``-x`` gives exactly ``-result`` for the same ``r``,
and a negative ``x`` that rounds to zero gives ``-0.0``). ``E[result] = x`` exactly when ``x``'s
fraction of a ulp has at most 16 bits (always for bf16, and for fp16 normals); otherwise the
bias is below ``2**-16`` ulp, towards zero. Below a format's smallest normal ``2**emin`` (fp16,
e4m3) the fraction is that of ``t = |x| + 2**emin``, one fp32 addition rounded to nearest, whose
ulp is the subnormal step; the result is ``t``'s rounding minus ``2**emin`` (exact), unbiased for
``t``, which is within ``2**-14`` (fp16) or ``2**-21`` (e4m3) of a subnormal step from ``|x|``.
This is what the kernel computes without a branch (``_round_magnitude``).
"""

from __future__ import annotations

import torch

__all__ = ["EIGHT_BIT_FORMATS", "QMAX", "SMALL_ROW", "dequantize_rows", "philox4x32", "quantize_rows",
           "state_bits", "stochastic_round"]

MASK32 = 0xFFFFFFFF
#: Philox4x32 multipliers and Weyl key increments (Salmon et al. 2011; Random123's philox.h)
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
#: consecutive ``n`` served by one Philox call (128 bits, 16 per element)
N_PER_CALL = 8

#: the 8-bit formats and their largest stored magnitude (the scale maps a row's absmax onto it)
EIGHT_BIT_FORMATS = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
#: rows whose absmax is below this (all-zero rows among them) are stored as zeros with scale 0
SMALL_ROW = 2.0**-100

# (mantissa bits, smallest normal exponent, largest finite value or None for "inf above the grid")
_GRIDS = {torch.bfloat16: (7, -126, None), torch.float16: (10, -14, None), torch.float8_e4m3fn: (3, -6, 448.0)}
#: the NaN a 16-bit stochastic store writes: CUDA's canonical NaN (``CUDART_NAN_BF16`` in cuda_bf16.h),
#: positive, for fp16 too (what a device conversion of a NaN gives is the kernel's to check)
NAN16 = 0x7FFF
#: float8_e4m3fn's NaN (it has no inf)
NAN8 = 0x7F
#: per format with subnormals above fp32's: (its smallest normal, the fp32 mantissa bits below its
#: last one), what the kernel's ``round_on_grid`` takes
SUBNORMAL_GRIDS = {str(dt).removeprefix("torch."): (2.0**emin, 23 - man)
                   for dt, (man, emin, _) in _GRIDS.items() if dt != torch.bfloat16}


# ----------------------------------------------------------------------------- Philox4x32
def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` 32-bit halves of ``a * m`` (``a`` int64 holding uint32, ``m`` a uint32 constant),
    from ``m``'s 16-bit halves so that no intermediate leaves int64 (each product is below 2**48)."""
    p1 = a * (m >> 16)
    t = a * (m & 0xFFFF) + ((p1 & 0xFFFF) << 16)  # < 2**49
    return (p1 >> 16) + (t >> 32), t & MASK32


def philox4x32(counter: torch.Tensor, key: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """Philox4x32-``rounds`` of Random123: ``counter`` (..., 4) and ``key`` (..., 2) int64 tensors holding
    uint32 values (broadcast against each other) -> (..., 4) int64 holding uint32.

    One round, with ``M0, M1`` = 0xD2511F53, 0xCD9E8D57 and 64-bit products split in hi/lo words::

        (c0, c1, c2, c3) -> (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0))

    and between rounds the key gains ``(0x9E3779B9, 0xBB67AE85)`` modulo 2**32.
    """
    if counter.shape[-1] != 4 or key.shape[-1] != 2:
        raise ValueError(f"philox4x32: counter (..., 4) and key (..., 2), got {tuple(counter.shape)}, "
                         f"{tuple(key.shape)}")
    if counter.dtype != torch.int64 or key.dtype != torch.int64:
        raise TypeError("philox4x32: counter and key must be int64 tensors holding uint32 values")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"philox4x32: rounds must be a positive int, got {rounds!r}")
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for i in range(rounds):
        if i:
            k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3), -1)


def _words(v, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high 32-bit words of int64 value(s) ``v`` (an int or an int64 tensor)."""
    t = torch.as_tensor(v)
    if t.dtype != torch.int64 or t.dim() > 1:
        raise TypeError(f"state_bits: {name} must be an int or an int64 tensor of at most one axis")
    return t & MASK32, (t >> 32) & MASK32


def state_bits(seed, offset, rows, H: int, D: int, N: int, rounds: int = 10) -> torch.Tensor:
    """The 16 random bits of every state element a store writes (module docstring: the layout).

    Args:
        seed: int64 (an int or a 0-d tensor): the key.
        offset: int64 (an int, a 0-d tensor, or a 1-D tensor of K offsets: K draws at once).
        rows: the rows written, one per lane (int tensor or sequence; ``>= 0`` and ``< 2**32``).
        H, D, N: the state's sizes.
        rounds: Philox rounds (10: Random123's default).

    Returns:
        int64 ``(len(rows), H, D, N)`` in [0, 2**16), or ``(K, len(rows), H, D, N)`` for K offsets.
    """
    k0, k1 = _words(seed, "seed")
    o0, o1 = _words(offset, "offset")
    if k0.dim():
        raise TypeError("state_bits: seed must be a single value")
    rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) > MASK32):
        raise ValueError("state_bits: rows must be in [0, 2**32)")
    G = -(-N // N_PER_CALL)
    if H * D * G > MASK32 + 1:
        raise ValueError(f"state_bits: H * D * ceil(N / 8) = {H * D * G} does not fit the counter's 32-bit word")
    K = o0.shape[0] if o0.dim() else 1
    elem = torch.arange(H * D * G, dtype=torch.int64).reshape(1, 1, H, D, G)
    shape = (K, rows.numel(), H, D, G)
    counter = torch.stack([o0.reshape(-1, 1, 1, 1, 1).expand(shape), o1.reshape(-1, 1, 1, 1, 1).expand(shape),
                           rows.reshape(1, -1, 1, 1, 1).expand(shape), elem.expand(shape)], -1)
    out = philox4x32(counter, torch.stack([k0, k1]), rounds)  # (K, L, H, D, G, 4)
    halves = torch.stack([out & 0xFFFF, out >> 16], -1)  # (..., 4, 2): n % 8 = 2 j + half
    bits = halves.reshape(K, rows.numel(), H, D, G * N_PER_CALL)[..., :N]
    return bits if o0.dim() else bits[0]


# ----------------------------------------------------------------------------- stochastic rounding
def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0 ** e`` in float64, exactly, for int64 exponents in the normal range."""
    return ((e + 1023) << 52).view(torch.float64)


def _check_bits(x: torch.Tensor, bits16: torch.Tensor, who: str) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"{who}: x must be float32, got {x.dtype}")
    if bits16.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{who}: bits16 must be an int32 or int64 tensor, got {bits16.dtype}")
    return torch.broadcast_to(bits16.to(torch.int64) & 0xFFFF, x.shape)


def _round_magnitude(x: torch.Tensor, r: torch.Tensor, man: int, emin: int) -> torch.Tensor:
    """|x| (finite fp32) stochastically rounded to the grid of a format with ``man`` mantissa bits and
    smallest normal ``2**emin`` (subnormals below it, no upper limit), as float32.

    Bit form, the kernel's (``k = 23 - man`` fp32 bits below the format's last mantissa bit)::

        c = 2**emin if |x| < 2**emin else 0
        t = |x| + c                                  (one fp32 round-to-nearest addition)
        result = ((bits(t) + r * 2**(k - 16)) & ~(2**k - 1)) - c     (r >> (16 - k) when k < 16)

    For ``|x| >= 2**emin`` (``c = 0``, ``t = |x|``) this is "round up iff F + r >= 2**16", ``F`` the top
    16 bits of ``|x|``'s fraction of a ulp. Below it, ``t`` lies in ``[2**emin, 2**(emin+1))``, whose
    ulp is the subnormal step: the fraction is ``t``'s, and the subtraction is exact."""
    a = x.abs()
    c = torch.where(a < 2.0**emin, torch.full((), 2.0**emin, dtype=x.dtype), torch.zeros((), dtype=x.dtype))
    t = a + c
    k = 23 - man
    add = (r >> (16 - k)) if k < 16 else (r << (k - 16))
    s = (t.view(torch.int32).to(torch.int64) + add) & ~((1 << k) - 1)
    return s.to(torch.int32).view(torch.float32) - c


def stochastic_round(x: torch.Tensor, bits16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32) stochastically rounded to ``dtype`` (bfloat16, float16 or float8_e4m3fn) with the
    16 random bits ``bits16`` (int32/int64, low 16 bits used, broadcast to ``x``) of each element.

    Rule (module docstring): round ``|x|`` up to the next grid value iff ``F + r >= 2**16``, ``F`` the
    top 16 bits of ``|x|``'s fraction of a ulp, then apply ``x``'s sign (``-0.0`` from a negative x).
    For bf16 this is exactly ``((bits(x) + r) & 0xFFFF0000) >> 16`` on the fp32 pattern; for fp16 the
    ulp is that of the fp16 exponent (2**-24 in the subnormal range, so small values round between
    subnormals, and below 2**-24 between 0 and 2**-24).

    * Exactly representable values come back unchanged (``F = 0``).
    * NaN -> the positive NaN ``0x7FFF`` (bf16, fp16); ``+-inf`` -> ``+-inf``. e4m3fn has no inf: NaN
      and ``+-inf`` -> its NaN ``0x7F``.
    * Overflow: the grid value above the largest finite one is inf. ``|x|`` between the largest finite
      value and the next power of two becomes max with probability ``1 - F/2**16``, inf otherwise;
      from that power of two on, inf (bf16: 2**128, i.e. never for a finite fp32 except through the
      round-up; fp16: 65536). e4m3fn saturates instead: magnitudes above 448 give 448 (it has no inf;
      the 8-bit rows never exceed it).
    """
    if dtype not in _GRIDS:
        raise ValueError(f"stochastic_round: dtype must be bfloat16, float16 or float8_e4m3fn, got {dtype}")
    r = _check_bits(x, bits16, "stochastic_round")
    nan = torch.isnan(x)
    any_nan = bool(nan.any())  # the special values take extra passes only when present
    if dtype == torch.bfloat16:  # the same rule on the fp32 pattern: add r below bf16's last bit, truncate
        b = x.view(torch.int32).to(torch.int64) + (torch.where(nan, 0, r) if any_nan else r)  # may reach inf
        val = (b & ~0xFFFF).to(torch.int32).view(torch.float32).to(torch.bfloat16)  # exact
        return torch.where(nan, torch.tensor(NAN16, dtype=torch.int16).view(dtype), val) if any_nan else val
    man, emin, satur = _GRIDS[dtype]
    finite = torch.isfinite(x)
    all_finite = bool(finite.all())
    xf = x if all_finite else torch.where(finite, x, torch.zeros((), dtype=x.dtype))
    mag = _round_magnitude(xf, r, man, emin)
    if satur is not None:
        mag = mag.clamp(max=satur)
    val = mag.copysign(xf)  # exact: on the target grid; x's sign, -0.0 included
    if dtype == torch.float8_e4m3fn:  # no inf: NaN and +-inf -> its NaN 0x7F (torch's cast would saturate inf)
        val = val.to(dtype)
        return val if all_finite else torch.where(finite, val, torch.tensor(NAN8, dtype=torch.uint8).view(dtype))
    val = (val if all_finite else torch.where(finite, val, x)).to(dtype)  # fp16: 65536 and above -> inf
    return torch.where(nan, torch.tensor(NAN16, dtype=torch.int16).view(dtype), val) if any_nan else val


# ----------------------------------------------------------------------------- 8-bit rows with scales
def _format(fmt) -> str:
    for name, dt in EIGHT_BIT_FORMATS.items():
        if fmt in (name, dt):
            return name
    if fmt in ("fp8_e4m3", "e4m3"):
        return "float8_e4m3fn"
    raise ValueError(f"8-bit format must be one of {tuple(EIGHT_BIT_FORMATS)}, got {fmt!r}")


def quantize_rows(new_state: torch.Tensor, bits: torch.Tensor, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise fp32 rows (..., N) to 8 bits with one fp32 scale per row (the (row, head, d) of a state).

    Per row, in fp32 with IEEE round-to-nearest divisions and products (``Q`` = 127 for int8, 448 for
    float8_e4m3fn)::

        absmax = max over n of |x[n]|            (exact)
        scale  = absmax / Q                      (stored; rounded to nearest, not to a power of two)
        inv    = Q / absmax                      (one division per row, then products)
        v[n]   = x[n] * inv                      (|v| <= Q up to two roundings)
        int8:  q = sign(v) * min(127, (floor(|v| * 2**16) + r) >> 16)      (integer stochastic rounding)
        e4m3:  q = stochastic_round(v, r, float8_e4m3fn)                  (saturates at 448)

    ``r`` = ``bits`` (..., N), 16 per element (:func:`state_bits`). ``floor(|v| * 2**16)`` is exact in
    fp32 (a power-of-two product, below 2**24). A row with ``absmax < 2**-100`` (zero rows among
    them) stores ``q = 0`` and ``scale = 0``. A row holding a NaN or an inf stores ``q = 0`` and
    ``scale = NaN``, so it reads back as NaN. ``E[dequantize] = x`` up to the fp32 roundings of
    ``inv``/``v`` (a few 2**-24 relative) and the 16-bit draw (< 2**-16 of a step).

    Returns:
        ``(q, scale)``: ``q`` (..., N) int8 or float8_e4m3fn, ``scale`` (...) float32.
    """
    name = _format(fmt)
    r = _check_bits(new_state, bits, "quantize_rows")
    Q = QMAX[name]
    x = new_state
    absmax = x.abs().amax(-1)
    bad = ~torch.isfinite(absmax)  # a NaN or an inf in the row
    small = absmax < SMALL_ROW
    odd = small | bad
    any_odd = bool(odd.any())
    safe = torch.where(odd, torch.ones((), dtype=x.dtype), absmax) if any_odd else absmax
    q_max = torch.full_like(safe, Q)  # tensor / tensor: an IEEE division (a scalar divisor may become a reciprocal)
    scale = safe / q_max
    inv = q_max / safe
    v = x * inv[..., None]
    if any_odd:
        v = torch.where(odd[..., None], torch.zeros((), dtype=x.dtype), v)
    if name == "int8":
        F = torch.floor(v.abs() * 65536.0).to(torch.int64)
        mag = ((F + r) >> 16).clamp(max=127)
        q = torch.where(v < 0, -mag, mag).to(torch.int8)
    else:
        q = stochastic_round(v, r, torch.float8_e4m3fn)  # odd rows: v = +0, so q = +0
    if any_odd:
        scale = torch.where(small, torch.zeros((), dtype=scale.dtype), scale)
        scale = torch.where(bad, torch.full((), float("nan"), dtype=scale.dtype), scale)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q`` (..., N) int8 or float8_e4m3fn and ``scale`` (...) fp32 -> fp32 ``q * scale`` (exact
    conversion of ``q``, one rounded product)."""
    if q.dtype not in EIGHT_BIT_FORMATS.values():
        raise TypeError(f"dequantize_rows: q must be int8 or float8_e4m3fn, got {q.dtype}")
    if scale.dtype != torch.float32 or scale.shape != q.shape[:-1]:
        raise ValueError(f"dequantize_rows: scale must be float32 of shape {tuple(q.shape[:-1])}")
    return q.to(torch.float32) * scale[..., None]
