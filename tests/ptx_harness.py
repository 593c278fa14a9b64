"""Hand-written PTX for the executor's self-tests, and expected values computed independently.

The expected values here never use numpy floating point or the executor's numerics: exact
results are Python ``Fraction``s rounded by :func:`round_binary` (a direct transcription of
IEEE-754 rounding onto a p-bit significand grid), bit patterns come from ``struct``, and
integer results from Python's unbounded ints reduced modulo 2**w. A bug in
``ptx_executor.numerics`` therefore cannot make its own test pass.

:func:`run_lanes` wraps a PTX body into a kernel whose thread ``i`` loads word ``i`` of
inputs ``a``, ``b``, ``c`` into ``%r1``/``%r2``/``%r3`` (or ``%rd1``.. for 64-bit), runs the
body, and stores ``%r4`` (``%rd4``) to ``out[i]``.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import torch

import ptx_executor as ptx

HEADER = """.version 8.8
.target sm_90a
.address_size 64
"""

_LANES = """
.visible .entry lanes(.param .u64 pa, .param .u64 pb, .param .u64 pc, .param .u64 pd)
{{
  .reg .pred %p<16>;
  .reg .b16 %h<16>;
  .reg .b32 %r<64>;
  .reg .b64 %rd<64>;
  ld.param.u64 %rd50, [pa];
  ld.param.u64 %rd51, [pb];
  ld.param.u64 %rd52, [pc];
  ld.param.u64 %rd53, [pd];
  mov.u32 %r60, %tid.x;
  mov.u32 %r61, %ctaid.x;
  mov.u32 %r62, %ntid.x;
  mad.lo.s32 %r63, %r61, %r62, %r60;
  mul.wide.u32 %rd54, %r63, {w};
  add.s64 %rd55, %rd50, %rd54;
  add.s64 %rd56, %rd51, %rd54;
  add.s64 %rd57, %rd52, %rd54;
  add.s64 %rd58, %rd53, %rd54;
  ld.global.b{bits} {a}, [%rd55];
  ld.global.b{bits} {b}, [%rd56];
  ld.global.b{bits} {c}, [%rd57];
{body}
  st.global.b{bits} [%rd58], {d};
  ret;
}}
"""


def lanes_ptx(body: str, bits: int = 32) -> str:
    regs = ("%r1", "%r2", "%r3", "%r4") if bits == 32 else ("%rd1", "%rd2", "%rd3", "%rd4")
    return HEADER + _LANES.format(body=body, bits=bits, w=bits // 8, a=regs[0], b=regs[1], c=regs[2], d=regs[3])


def ptr_param(t: torch.Tensor) -> bytes:
    return struct.pack("<Q", t.data_ptr())


def run_lanes(body: str, a, b=None, c=None, *, bits: int = 32, block: int = 32) -> np.ndarray:
    """Run ``body`` over the words of ``a``/``b``/``c`` (uint32 or uint64 arrays); return ``out``."""
    dt = torch.int32 if bits == 32 else torch.int64
    n = len(a)
    ts = [torch.from_numpy(np.asarray(v if v is not None else np.zeros(n), dtype=np.int64)
                           .astype(np.uint64 if bits == 64 else np.uint32).view(np.int64 if bits == 64 else np.int32)
                           .copy()).to(dt) for v in (a, b, c)]
    out = torch.zeros(n, dtype=dt)
    mem = ptx.GlobalMemory()
    for name, t in zip("abc", ts):
        mem.add(name, t, writable=False)
    mem.add("out", out)
    assert n % block == 0
    ptx.run(lanes_ptx(body, bits), grid=(n // block, 1, 1), block=(block, 1, 1),
            params=[ptr_param(t) for t in (*ts, out)], memory=mem)
    return out.numpy().view(np.uint32 if bits == 32 else np.uint64)


# ------------------------------------------------------------------ independent float model

def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_f32_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def exact(bits32: int) -> Fraction:
    """The exact value of a finite fp32 bit pattern."""
    return Fraction(from_f32_bits(bits32))


def round_binary(x: Fraction, mode: str = "rn", *, p: int = 24, emin: int = -126, emax: int = 127) -> Fraction | float:
    """Round ``x`` to a binary format with ``p``-bit significands (fp32 by default).

    Returns a Fraction; a float for the results a Fraction cannot hold: a signed zero, or
    ``math.inf``/``-math.inf`` on overflow (directed modes give the largest finite value
    where IEEE says so).
    """
    if x == 0:
        return Fraction(0)
    sign = -1 if x < 0 else 1
    m = abs(x)
    e = math.floor(math.log2(m.numerator) - math.log2(m.denominator))
    while Fraction(2) ** e > m:
        e -= 1
    while Fraction(2) ** (e + 1) <= m:
        e += 1
    quantum = Fraction(2) ** (max(e, emin) - (p - 1))
    q = m / quantum
    fl = q.numerator // q.denominator
    rem = q - fl
    if mode == "rn":
        up = rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1)
    elif mode == "rz":
        up = False
    elif mode == "rm":
        up = rem > 0 and sign < 0
    elif mode == "rp":
        up = rem > 0 and sign > 0
    else:
        raise ValueError(mode)
    r = (fl + (1 if up else 0)) * quantum
    if r == 0:
        return math.copysign(0.0, sign)  # a float, to keep the sign of zero
    largest = (2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax
    if r > largest:
        toward_inf = mode == "rn" or (mode == "rp" and sign > 0) or (mode == "rm" and sign < 0)
        return sign * math.inf if toward_inf else sign * largest
    return sign * r


def to_f32_bits(v) -> int:
    """fp32 bits of a Fraction exactly representable in fp32, or of a float (signed zero, inf)."""
    return f32_bits(float(v))


def bf16_bits_of(v) -> int:
    """bf16 bits of a value exactly representable in bf16 (or an infinity)."""
    return to_f32_bits(v) >> 16


def f16_bits_of(v) -> int:
    if isinstance(v, float) and math.isinf(v):
        return 0x7C00 if v > 0 else 0xFC00
    return struct.unpack("<H", struct.pack("<e", float(v)))[0]


def random_f32_bits(rng: np.random.Generator, n: int, *, special: bool = True) -> np.ndarray:
    """fp32 bit patterns: random normals of mixed magnitudes plus (optionally) specials."""
    mant = rng.integers(0, 1 << 23, n, dtype=np.uint64)
    exp = rng.integers(100, 155, n, dtype=np.uint64)
    sign = rng.integers(0, 2, n, dtype=np.uint64)
    out = (sign << np.uint64(31)) | (exp << np.uint64(23)) | mant
    if special:
        specials = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x807FFFFF,
                    0x00800000, 0x7F7FFFFF, 0x3F800000, 0xBF800000]
        out[: len(specials)] = specials
    return out.astype(np.uint32)


# ------------------------------------------------------------------ whole small kernels

_REGS = """  .reg .pred %p<16>;
  .reg .b16 %h<16>;
  .reg .b32 %r<64>;
  .reg .b64 %rd<64>;
"""


def kernel_ptx(body: str, params=("out",), decls: str = "") -> str:
    """A module with one entry ``k`` taking a ``.u64`` pointer per name in ``params``;
    ``%rd<i>`` for i = 40, 41, ... hold the pointers on entry."""
    plist = ", ".join(f".param .u64 p_{n}" for n in params)
    loads = "".join(f"  ld.param.u64 %rd{40 + i}, [p_{n}];\n" for i, n in enumerate(params))
    return HEADER + decls + f"\n.visible .entry k({plist})\n{{\n{_REGS}{loads}{body}\n}}\n"


def run_kernel(body: str, tensors: dict, *, grid=(1, 1, 1), block=(32, 1, 1), decls: str = "",
               readonly=(), dynamic_smem: int = 0, record_shared: bool = False, regions: dict | None = None,
               cluster=None):
    """Run ``kernel_ptx(body, tensors)``: each tensor is a region and a pointer parameter (``cluster``: the
    launch's CTAs per cluster, default none)."""
    mem = ptx.GlobalMemory()
    for name, t in (regions or tensors).items():
        mem.add(name, t, writable=name not in readonly)
    text = kernel_ptx(body, tuple(tensors), decls)
    return ptx.run(text, grid=grid, block=block, params=[ptr_param(t) for t in tensors.values()], memory=mem,
                   dynamic_smem=dynamic_smem, record_shared=record_shared, cluster=cluster)


# per-thread address of word tid (32-bit) of the first parameter: %rd1 = %rd40 + 4 * tid
TID_ADDR = """  mov.u32 %r0, %tid.x;
  mul.wide.u32 %rd0, %r0, 4;
  add.s64 %rd1, %rd40, %rd0;
"""

# the same for the global thread index ctaid.x * ntid.x + tid.x (in %r31); %r0 is tid.x
GTID_ADDR = """  mov.u32 %r0, %tid.x;
  mov.u32 %r30, %ctaid.x;
  mov.u32 %r29, %ntid.x;
  mad.lo.u32 %r31, %r30, %r29, %r0;
  mul.wide.u32 %rd0, %r31, 4;
  add.s64 %rd1, %rd40, %rd0;
"""
