"""Single PTX instructions the kernel's arithmetic is pinned to, as DSL values.

:func:`inline_ptx` emits one pure instruction (free to be moved or dropped by the compiler); the
helpers below name the ones the kernel uses: products and fmas rounded once (never contracted), an
IEEE division, fp32 <-> bit-pattern moves, unsigned and signed min/max of bit patterns, the e4m3
pair conversion, and :func:`row_fence`, a compiler-level memory clobber.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Uint16, Uint32
from cutlass._mlir.dialects import llvm

__all__ = ["asm_f32", "asm_u32", "bits_f32", "div_rn", "e4m3_pair", "f32_bits", "fma_rn", "inline_ptx", "mul_rn",
           "row_fence", "smax", "umax", "umin"]


def inline_ptx(result_type, text: str, constraints: str, *operands):
    """One inline PTX instruction ``text`` on ``operands`` (DSL numbers), its result as ``result_type``
    (``constraints`` in LLVM's form, result first: ``"=f,f,f"``). Pure: free to be moved or dropped."""
    value = llvm.inline_asm(result_type.mlir_type, [op.ir_value() for op in operands], text, constraints,
                            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return result_type(value)


def mul_rn(a: Float32, b: Float32) -> Float32:
    """``a * b`` rounded to fp32 on its own: ``mul.rn`` is never contracted into an FMA, so
    the sum it feeds has the same terms however it is split."""
    return inline_ptx(Float32, "mul.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b))


def fma_rn(a: Float32, b: Float32, c: Float32) -> Float32:
    """``a b + c`` rounded once, to nearest."""
    return inline_ptx(Float32, "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", Float32(a), Float32(b), Float32(c))


def div_rn(a: Float32, b: Float32) -> Float32:
    """``a / b`` rounded to nearest (IEEE), as the CPU path divides."""
    return inline_ptx(Float32, "div.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b))


def asm_f32(text: str, a: Float32) -> Float32:
    """A one-operand fp32 PTX instruction ``text`` applied to ``a``."""
    return inline_ptx(Float32, text, "=f,f", Float32(a))


def asm_u32(text: str, a: Float32) -> Uint32:
    return inline_ptx(Uint32, text, "=r,f", Float32(a))


def f32_bits(x: Float32) -> Uint32:
    """The bit pattern of ``x``."""
    return inline_ptx(Uint32, "mov.b32 $0, $1;", "=r,f", Float32(x))


def bits_f32(b: Uint32) -> Float32:
    """The fp32 whose bit pattern is ``b``."""
    return inline_ptx(Float32, "mov.b32 $0, $1;", "=f,r", Uint32(b))


def umax(a: Uint32, b: Uint32) -> Uint32:
    return inline_ptx(Uint32, "max.u32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b))


def umin(a: Uint32, b: Uint32) -> Uint32:
    return inline_ptx(Uint32, "min.u32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b))


def smax(a: Uint32, b: Uint32) -> Uint32:
    """The larger of two patterns compared as signed 32-bit integers."""
    return inline_ptx(Uint32, "max.s32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b))


def e4m3_pair(lo: Float32, hi: Float32) -> Uint16:
    """Two e4m3 values (exact on its grid) as one 16-bit pair of codes, ``lo`` in the low byte."""
    return inline_ptx(Uint16, "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f", Float32(hi), Float32(lo))


@cute.jit
def row_fence():
    """A compiler-level memory clobber between rows (an empty volatile asm, no
    instruction), so B/Bs/C are re-read from shared memory instead of being cached in
    registers across rows when they do not fit (``ThreadLayout.cache_operands``)."""
    llvm.inline_asm(None, [], "", "~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)
