"""The rotary angle on the device (docs/contract.md, "Rotary angle"): angles advanced in fixed point,
their cos/sin, B and C rotated as they are staged, and the previous token's B~ rounded as Bstate
holds it.
"""

from __future__ import annotations

from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..tensors import KernelArgs
from .bundles import Cta, Shared, Token
from .ptx_ops import asm_f32, inline_ptx
from ..rotary import ANGLE_UNIT_RADIANS

__all__ = ["Rotary"]


class Rotary:
    """The rotary angle's stages (a mixin of the kernel class)."""

    @cute.jit
    def advance_angles(self, m: KernelArgs, tok: Token, shared: Shared, cta: Cta, start: Optional[Callable] = None,
                       store: Optional[Callable] = None):
        """Thread ``i < rope_angles``: angle ``i`` of the (lane, head) advanced by ``tanh(angle_proj) dt pi``
        in fixed point (:meth:`angle_units`), kept in ``sAng`` for the next token, its cos/sin
        to ``sCS``, and stored to ``angle_state[dst]`` when this token's state is stored. Angle
        ``i`` is read and written by thread ``i`` only, and one CTA owns the (lane, head)
        (``tile_D >= D``), so an in-place row (dst = src) is race-free. Replay passes
        ``start(i)``, token 0's angle before it (else ``angle_state[src]``), and ``store(i, q)``,
        which stores the new angle where it goes (else the rule above)."""

        def advance(i):
            sAng, sCS = shared.sAng, shared.sCS  # stored under a runtime `if`: local names
            mAngle = m.angle_state
            q = Int64(0)
            if const_expr(tok.t > 0):
                q = sAng[i]
            elif const_expr(start is None):
                q = mAngle[cta.src, cta.h, i]
            else:
                q = start(i)
            w = cute.math.tanh(m.angle_proj[tok.lane_t + (cta.h, i)]) * tok.dt
            q = q + self.angle_units(w)
            sAng[i] = q
            c, s = self.turn_cos_sin(q)
            sCS[0, i] = c
            sCS[1, i] = s
            if const_expr(store is not None):
                store(i, q)
            elif const_expr(self.store_each or tok.t == self.T - 1):
                if cta.dst_live:
                    mAngle[cta.dst, cta.h, i] = q

        self.for_thread_indices(self.rope_angles, cta.tidx, advance)

    @cute.jit
    def stored_angles(self, mAngle: cute.Tensor, lead: tuple, shared: Shared, cta: Cta):
        """Thread ``i < rope_angles``: the cos/sin of a stored angle ``mAngle[lead][h, i]`` (a ring entry's) to
        ``sCS``, for staging that token's B~ again."""

        def turn(i):
            sCS = shared.sCS  # stored under a runtime `if`: a local name
            c, s = self.turn_cos_sin(mAngle[lead + (cta.h, i)])
            sCS[0, i] = c
            sCS[1, i] = s

        self.for_thread_indices(self.rope_angles, cta.tidx, turn)

    def angle_units(self, w: Float32) -> Int64:
        """The fixed-point increment of ``w / 2`` turns (``w = tanh(angle_proj) dt``), in units of
        2**-64 turn: whole turns dropped exactly (``w - 2 rint(w / 2)``), then
        ``2 rint(w_frac 2**62)`` (wrapping at a half turn, like the CPU path)."""
        w_frac = w - Float32(2.0) * asm_f32("cvt.rni.f32.f32 $0, $1;", w * Float32(0.5))
        units = inline_ptx(Int64, "cvt.rni.s64.f32 $0, $1;", "=l,f", Float32(w_frac * Float32(2.0**62)))
        return units + units

    @cute.jit
    def turn_cos_sin(self, q: Int64):
        """``(cos, sin)`` of the fixed-point angle ``q``: quadrant ``k = round(q / 2**62)`` from the
        top bits, the rest (at most an eighth of a turn) as ``x`` in [-pi/4, pi/4), Taylor
        polynomials to x**9 / x**10 (truncation below 3e-9), then ``k`` quarter turns."""
        k = Int32(((q >> 61) + 1) >> 1) & 3
        x = Float32((q << 2) >> 2) * Float32(ANGLE_UNIT_RADIANS)
        x2 = x * x
        s = x + x * x2 * (Float32(-1 / 6) + x2 * (Float32(1 / 120) + x2 * (Float32(-1 / 5040)
                                                                           + x2 * Float32(1 / 362880))))
        c = Float32(1.0) + x2 * (Float32(-0.5) + x2 * (Float32(1 / 24) + x2 * (
            Float32(-1 / 720) + x2 * (Float32(1 / 40320) + x2 * Float32(-1 / 3628800)))))
        odd = (k & 1) != 0
        cos = cutlass.select_(odd, -s, c)
        sin = cutlass.select_(odd, c, s)
        half = (k & 2) != 0
        return cutlass.select_(half, -cos, cos), cutlass.select_(half, -sin, sin)

    @cute.jit
    def stage_rotated(self, mT: cute.Tensor, mBias, lead: tuple, head: Int32, sT: cute.Tensor,
                      sCS: cute.Tensor, cta: Cta):
        """B or C with rotary -> ``sT`` (R, N) fp32: ``mT[lead][:, head, :]`` plus the bias of head
        ``h`` (when given), pair ``j < rope_angles`` rotated by angle ``j`` (``sCS``), the other pairs
        passed through; one pair per thread step. Pairs: ``(j, j + N/2)``, or ``(2j, 2j + 1)``
        with ``rotate_pairwise``."""
        half = self.N // 2

        def stage(i):  # i = r * N/2 + j
            r = i // half
            j = i - r * half
            n0, n1 = (2 * j, 2 * j + 1) if const_expr(self.rotate_pairwise) else (j, j + half)
            a = mT[lead + (r, head, n0)].to(Float32)
            b = mT[lead + (r, head, n1)].to(Float32)
            if const_expr(self.has_bc_bias):
                a = a + mBias[r, cta.h, n0]
                b = b + mBias[r, cta.h, n1]
            if j < self.rope_angles:
                c = sCS[0, j]
                s = sCS[1, j]
                a, b = a * c - b * s, a * s + b * c
            sT[r, n0] = a
            sT[r, n1] = b

        self.for_thread_indices(self.R * half, cta.tidx, stage)

    @cute.jit
    def round_previous_b(self, sBs: cute.Tensor, cta: Cta):
        """Token t > 0 with rotary: the previous token's staged B~ (fp32) rounded to the kv dtype
        in place, the value a one-token step reads back from Bstate (so T tokens stay T one-token
        steps bit for bit)."""

        def round_one(i):  # i = r * N + n
            r = i // self.N
            n = i - r * self.N
            sBs[r, n] = sBs[r, n].to(self.kv_dtype).to(Float32)

        self.for_thread_indices(self.R * self.N, cta.tidx, round_one)
