"""The state's storage formats, behind one interface: how the slab's values are read into the
update, and how the new state is stored back into its registers (and scales).

* :class:`StateFormat`: a state in its dtype, stored by conversion (fp32, or 16-bit rounded to
  nearest); the interface, with the plain behaviour;
* :class:`RoundedState`: a 16-bit state stochastically rounded (a state dtype of 16 bits and
  ``rand_seed``; docs/contract.md): each 16-byte vector of the new state takes one Philox4x32-10
  call's random bits (:mod:`.philox`), rounded per bf16 pair or fp16 element by the rules of
  :mod:`mamba3_step.rounding`, on the fp32 pattern, without branches;
* :class:`ScaledState`: an 8-bit state (int8, e4m3; docs/contract.md, "8-bit states") read as
  ``q * scale`` (the row's scale loaded with it) and stored after the row group's update: each row's
  absmax over its TPR lanes, its scale, and per 16-byte vector two Philox calls; the row's first lane
  stores the scale.

:func:`state_format` picks one per specialisation, once; the kernel calls it as ``self.storage``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint16, Uint32, const_expr

from ..contract import SCALED_STATE_DTYPES
from ..rounding import N_PER_CALL, QMAX, SMALL_ROW, SUBNORMAL_GRIDS
from ..tensors import KernelArgs
from .bundles import Cta, RowGroup, Token
from .ptx_ops import (asm_f32, asm_u32, bits_f32, div_rn, e4m3_pair, f32_bits, fma_rn, inline_ptx, mul_rn, smax,
                      umax, umin)

__all__ = ["RoundedState", "ScaledState", "StateFormat", "state_format"]


def state_format(kernel) -> "StateFormat":
    """The storage format of ``kernel``'s specialisation (its ``spec``, ``layout`` and dtypes set)."""
    if kernel.spec.state_dtype in SCALED_STATE_DTYPES:
        return ScaledState(kernel)
    if kernel.spec.stochastic_rounding:
        return RoundedState(kernel)
    return StateFormat(kernel)


class StateFormat:
    """A state in its dtype, stored by conversion; the interface every format implements.

    The slab (:mod:`.slab`) calls :meth:`load_scales` and :meth:`store_scales` with the state's
    loads and stores; the update (:mod:`.update`) takes a row's values through :meth:`decoded`,
    builds the new state in :meth:`new_group` / :meth:`new_row` buffers, and stores it with
    :meth:`store_row` after each row and :meth:`store_group` after the group; a contraction of the
    state as loaded is finished by :meth:`contracted`."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.layout = kernel.layout
        self.state_dtype = kernel.state_dtype
        self.dtype_name = kernel.spec.state_dtype
        self.R, self.N, self.D, self.tile_D = kernel.R, kernel.N, kernel.D, kernel.tile_D

    def load_scales(self, m: KernelArgs, rows: list, cta: Cta):
        """The scales of the thread's register rows of pool row ``src`` (none: None)."""
        return None

    def store_scales(self, group: RowGroup, m: KernelArgs, cta: Cta):
        """A row group's scales to pool row ``dst`` (none)."""

    def new_group(self):
        """A buffer for a whole row group's new state, fp32, when the format stores by group (else None)."""
        return None

    def new_row(self, tSrNewG, i: int) -> cute.Tensor:
        """Register row ``i``'s new state, fp32 ``(VN, CPT)``: its own registers."""
        lay = self.layout
        return cute.make_rmem_tensor(cute.make_layout((lay.VN, lay.CPT), stride=(1, lay.VN)), Float32)

    def decoded(self, group: RowGroup, e: int, i: int, c: int) -> Float32:
        """Element ``e`` of vector ``c`` of register row ``i``, fp32."""
        return group.tSrS[e, i, c].to(Float32)

    @cute.jit
    def store_row(self, group: RowGroup, tSrNew: cute.Tensor, i: int, tok: Token, cta: Cta):
        """Register row ``i`` of the new state (fp32 ``tSrNew``) into ``group.tSrS``, converted."""
        lay = self.layout
        for c in cutlass.range_constexpr(lay.CPT):
            for e in cutlass.range_constexpr(lay.VN):
                group.tSrS[e, i, c] = tSrNew[e, c].to(self.state_dtype)

    def store_group(self, group: RowGroup, tSrNewG, tok: Token, cta: Cta):
        """After a row group's rows: nothing (each row was stored by :meth:`store_row`)."""

    def contracted(self, y: Float32, group: RowGroup, i: int) -> Float32:
        """A sum over register row ``i``'s values as loaded, as a sum over the state's values."""
        return y


class RoundedState(StateFormat):
    """A 16-bit state stochastically rounded: one Philox call per 16-byte vector (8 elements)."""

    @cute.jit
    def store_row(self, group: RowGroup, tSrNew: cute.Tensor, i: int, tok: Token, cta: Cta):
        """Register row ``i`` of the new state (fp32 ``tSrNew``) stochastically rounded into
        ``group.tSrS``: vector ``c`` holds the 8 elements ``n = 8 g ... 8 g + 7`` of ``g = c TPR + lane``,
        whose 16-bit draws are one Philox4x32 call with the counter (offset words, the row the
        state goes to, ``(h D + d) N/8 + g``) and the seed's key (mamba3_step.rounding); output
        word ``j`` holds the draws of elements ``2j`` (low half) and ``2j + 1`` (high half). A bf16
        pair is written as one word (:meth:`round_bf16_pair`)."""
        lay = self.layout
        tSrS, row = group.tSrS, group.rows[i]
        k0, k1, o0, o1 = tok.rng[:4]
        d = cta.dtile * self.tile_D + row
        base = (Uint32(cta.h) * Uint32(self.D) + Uint32(d)) * Uint32(self.N // N_PER_CALL)
        tSrW = cute.recast_tensor(tSrS, Uint32) if const_expr(self.state_dtype is cutlass.BFloat16) else None
        for c in cutlass.range_constexpr(lay.CPT):
            row_id = self.kernel.draw_row(tok, cta)
            words = self.kernel.philox((o0, o1, Uint32(row_id), base + Uint32(c * lay.TPR + cta.lane)), k0, k1)
            for j in cutlass.range_constexpr(lay.VN // 2):
                if const_expr(tSrW is not None):
                    tSrW[j, i, c] = self.round_bf16_pair(tSrNew[2 * j, c], tSrNew[2 * j + 1, c], words[j])
                else:
                    tSrS[2 * j, i, c] = self.round_fp16(tSrNew[2 * j, c], words[j] & Uint32(0xFFFF))
                    tSrS[2 * j + 1, i, c] = self.round_fp16(tSrNew[2 * j + 1, c], words[j] >> Uint32(16))

    @cute.jit
    def round_bf16_pair(self, x0: Float32, x1: Float32, w: Uint32) -> Uint32:
        """Two bf16 values stochastically rounded (mamba3_step.rounding's rule: the magnitude rounds
        up iff its 16-bit fraction of a ulp plus ``r`` carries), packed as one word: each fp32
        pattern plus its 16 bits of ``w`` (``x0`` the low half, ``x1`` the high), the high halves
        taken (a byte permute, the truncation). The signed max with the pattern keeps a NaN from
        carrying into the sign bit: the new state comes from fp32 arithmetic, whose NaN is the
        canonical 0x7FFFFFFF (PTX ISA), stored as 0x7FFF."""
        b0, b1 = f32_bits(x0), f32_bits(x1)
        s0 = smax(b0 + (w & Uint32(0xFFFF)), b0)
        s1 = smax(b1 + (w >> Uint32(16)), b1)
        return inline_ptx(Uint32, "prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", s0, s1)

    @cute.jit
    def round_fp16(self, x: Float32, r: Uint32):
        """``x`` rounded to fp16 with the 16 random bits ``r``: :func:`round_on_grid` with ``r >> 3``
        (13 bits below fp16's last mantissa bit), then ``x``'s sign. The truncated value is exact
        in fp16 (or beyond its range: inf), so the final conversion does not round; a NaN converts
        to the canonical 0x7FFF."""
        y = round_on_grid(x, r >> Uint32(3), SUBNORMAL_GRIDS[self.dtype_name], guard=True)
        return bits_f32(f32_bits(y) | (f32_bits(x) & Uint32(0x80000000))).to(self.state_dtype)


class ScaledState(StateFormat):
    """An 8-bit state with a scale per (row, head, d): ``q * scale``, quantised after the row group."""

    @cute.jit
    def load_scales(self, m: KernelArgs, rows: list, cta: Cta):
        """Each register row's scale, fp32 ``(rows_per_group,)``."""
        lay = self.layout
        tSrScale = cute.make_rmem_tensor(cute.make_layout(lay.rows_per_group), Float32)
        d0 = cta.dtile * self.tile_D
        for i in cutlass.range_constexpr(lay.rows_per_group):
            tSrScale[i] = m.state_scale[cta.src, cta.h, d0 + rows[i]]
        return tSrScale

    @cute.jit
    def store_scales(self, group: RowGroup, m: KernelArgs, cta: Cta):
        """Every lane of a row holds its scale: the first stores it."""
        lay = self.layout
        if cta.lane == 0:
            mScale = m.state_scale
            d0 = cta.dtile * self.tile_D
            for i in cutlass.range_constexpr(lay.rows_per_group):
                mScale[cta.dst, cta.h, d0 + group.rows[i]] = group.tSrScale[i]

    def new_group(self):
        """The whole group's new state, fp32: a row's scale needs its lanes' rows."""
        lay = self.layout
        return cute.make_rmem_tensor(
            cute.make_layout((lay.VN, lay.rows_per_group, lay.CPT), stride=(1, lay.VN, lay.VN * lay.rows_per_group)),
            Float32)

    def new_row(self, tSrNewG, i: int) -> cute.Tensor:
        """Register row ``i``'s part of the group's buffer, a ``(VN, CPT)`` view."""
        return tSrNewG[None, i, None]

    def decoded(self, group: RowGroup, e: int, i: int, c: int) -> Float32:
        """``q * scale``, one rounded product (the decay is a second one)."""
        return group.tSrS[e, i, c].to(Float32) * group.tSrScale[i]

    def store_row(self, group: RowGroup, tSrNew: cute.Tensor, i: int, tok: Token, cta: Cta):
        """Nothing yet: the group is quantised together (:meth:`store_group`)."""

    @cute.jit
    def store_group(self, group: RowGroup, tSrNewG: cute.Tensor, tok: Token, cta: Cta):
        """A row group's new state (fp32 ``tSrNewG``, ``(VN, rows_per_group, CPT)``) quantised to 8
        bits into ``group.tSrS``, each row's scale into ``group.tSrScale``
        (mamba3_step.rounding.quantize_rows).

        A row's absmax is the largest ``|x|`` bit pattern (integer order is magnitude order, and
        any NaN or inf pattern is at least 0x7F800000): over the thread's columns, then over the
        row's TPR lanes by a butterfly. Lanes keep their rows in different register orders
        (:meth:`~.slab.Slab.thread_rows`: register ``i`` holds row ``i ^ rho``), and ``rho`` is linear in the
        lane's bits, so across lane mask ``m`` the partner holds this lane's register ``i`` at
        ``i ^ rho(m)``, a trace-time constant: each round sends register ``i ^ rho(m)`` and
        receives the partner's copy of row ``i``. Every lane ends with its rows' absmax."""
        lay = self.layout
        big = []
        for i in cutlass.range_constexpr(lay.rows_per_group):
            top = Uint32(0)
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    top = umax(top, f32_bits(tSrNewG[e, i, c]) & Uint32(0x7FFFFFFF))
            big.append(top)
        log2r = self.R.bit_length() - 1
        for k in cutlass.range_constexpr(lay.TPR.bit_length() - 1):
            mask = lay.TPR >> (k + 1)
            swap = self.kernel.lane_permutation(mask) >> log2r  # rho(mask), a Python int
            sent = [cute.arch.shuffle_sync_bfly(big[i ^ swap], offset=mask) for i in range(lay.rows_per_group)]
            big = [umax(big[i], sent[i]) for i in range(lay.rows_per_group)]
        for i in cutlass.range_constexpr(lay.rows_per_group):
            self.quantize_row(group, tSrNewG, i, big[i], tok, cta)

    @cute.jit
    def quantize_row(self, group: RowGroup, tSrNewG: cute.Tensor, i: int, big: Uint32, tok: Token, cta: Cta):
        """Register row ``i``: its scale from the row's absmax pattern ``big`` (``scale = absmax /
        Q`` and ``inv = Q / absmax`` IEEE divisions, ``v = x inv`` a rounded product; a row with a
        NaN or inf stores zeros and scale NaN, a row below SMALL_ROW zeros and scale 0), and its
        values rounded with their bits. Each 16-byte vector ``c`` (16 elements, ``n = 16 (c TPR
        + lane) ...``) takes the bits of two Philox calls, ``g = 2 (c TPR + lane)`` and ``g + 1``:
        the 8 elements of each, as for a 16-bit state."""
        lay = self.layout
        absmax = bits_f32(big)
        bad = big >= Uint32(0x7F800000)  # a NaN or an inf in the row
        odd = bad | (absmax < Float32(SMALL_ROW))
        safe = Float32(cutlass.select_(odd, Float32(1.0), absmax))
        q_max = Float32(QMAX[self.dtype_name])
        # odd rows: v = x * 0 (0, or NaN in a bad row): int8 converts both to code 0, e4m3 pairs are zeroed
        inv = Float32(cutlass.select_(odd, Float32(0.0), div_rn(q_max, safe)))
        scale = Float32(cutlass.select_(odd, Float32(0.0), div_rn(safe, q_max)))
        group.tSrScale[i] = Float32(cutlass.select_(bad, Float32(float("nan")), scale))
        k0, k1, o0, o1 = tok.rng[:4]
        d = cta.dtile * self.tile_D + group.rows[i]
        base = (Uint32(cta.h) * Uint32(self.D) + Uint32(d)) * Uint32(self.N // N_PER_CALL)
        row_id = self.kernel.draw_row(tok, cta)
        int8 = const_expr(self.state_dtype is cutlass.Int8)
        tSrH = None if int8 else cute.recast_tensor(group.tSrS, Uint16)  # e4m3 codes in pairs
        for c in cutlass.range_constexpr(lay.CPT):
            for half in cutlass.range_constexpr(2):
                g = Uint32(2 * (c * lay.TPR + cta.lane) + half)
                words = self.kernel.philox((o0, o1, Uint32(row_id), base + g), k0, k1)
                for k in cutlass.range_constexpr(0, N_PER_CALL, 2):
                    e = half * N_PER_CALL + k
                    w = words[k // 2]
                    v0, v1 = mul_rn(tSrNewG[e, i, c], inv), mul_rn(tSrNewG[e + 1, i, c], inv)
                    if const_expr(int8):
                        group.tSrS[e, i, c] = self.quantize_int8(v0, w & Uint32(0xFFFF))
                        group.tSrS[e + 1, i, c] = self.quantize_int8(v1, w >> Uint32(16))
                    else:
                        pair = e4m3_pair(self.round_e4m3(v0, w & Uint32(0xFFFF)),
                                              self.round_e4m3(v1, w >> Uint32(16)))
                        tSrH[e // 2, i, c] = Uint16(cutlass.select_(odd, Uint16(0), pair))

    @cute.jit
    def quantize_int8(self, v: Float32, r: Uint32):
        """``v`` (``|v| <= 127`` up to two roundings) stochastically rounded with the 16 bits ``r``:
        ``sign(v) min(127, (floor(|v| 2**16) + r) >> 16)``; a NaN ``v`` (a bad row) converts to 0."""
        frac = asm_u32("cvt.rzi.u32.f32 $0, $1;", asm_f32("abs.f32 $0, $1;", v) * Float32(65536.0))
        mag = Int32(umin((frac + r) >> 16, Uint32(127)))
        return Int32(cutlass.select_(v < Float32(0.0), -mag, mag)).to(self.state_dtype)

    @cute.jit
    def round_e4m3(self, v: Float32, r: Uint32) -> Float32:
        """``v`` (``|v| <= 448`` up to two roundings) stochastically rounded to e4m3's grid with the 16
        bits ``r``: :func:`round_on_grid` with ``r << 4`` (20 bits below e4m3's last mantissa bit),
        saturated at 448, ``v``'s sign; exact in e4m3. ``|v|`` is finite, so the sum cannot carry into
        the sign bit (no guard)."""
        y = round_on_grid(v, r << Uint32(4), SUBNORMAL_GRIDS[self.dtype_name], guard=False)
        y = asm_f32("min.f32 $0, $1, 0f43E00000;", y)  # 448: e4m3fn saturates
        return bits_f32(f32_bits(y) | (f32_bits(v) & Uint32(0x80000000)))

    def contracted(self, y: Float32, group: RowGroup, i: int) -> Float32:
        """An 8-bit checkpoint is ``q * scale``: the row's scale once, on the sum."""
        return y * group.tSrScale[i]


@cute.jit
def round_on_grid(x: Float32, r_aligned: Uint32, grid: tuple, guard: bool) -> Float32:
    """``|x|`` stochastically rounded to the grid of a format whose smallest normal is
    ``grid[0]`` and whose last mantissa bit lies ``grid[1]`` bits above fp32's
    (mamba3_step.rounding, ``_round_magnitude``): ``t = |x| + c`` with ``c`` = the smallest
    normal if ``|x|`` is below it, else 0 (one rounded addition that puts the subnormal grid on
    t's last kept bit), ``t``'s pattern plus ``r_aligned`` (the random bits below that bit)
    truncated, minus ``c`` (exact). ``c`` is a 0/1 flag times the smallest normal, folded into
    two fmas (the product is exact, so each is the rounded sum). A NaN ``t`` is the canonical
    0x7FFFFFFF; ``guard`` keeps its sum from carrying into the sign bit (an unsigned min)."""
    smallest, kept = grid
    a = asm_f32("abs.f32 $0, $1;", x)
    below = inline_ptx(Float32, "set.lt.f32.f32 $0, $1, $2;", "=f,f,f", a, Float32(smallest))
    s = f32_bits(fma_rn(below, Float32(smallest), a)) + r_aligned
    if const_expr(guard):
        s = umin(s, Uint32(0x7FFFFFFF))
    return fma_rn(below, Float32(-smallest), bits_f32(s & Uint32((0xFFFFFFFF << kept) & 0xFFFFFFFF)))
