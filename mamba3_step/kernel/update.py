"""The state update in registers: the operands at the lane's columns, the new state of a row group
with each thread's partial sums of y, and (replay's outputs from the checkpoint) the partials of a
state that is not updated. The new state is stored in registers through the kernel's state format
(:mod:`.state_formats`): the update loop is the same for every format.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .bundles import Cta, Operands, RowGroup, Shared, Token
from .ptx_ops import row_fence

__all__ = ["StateUpdate"]


class StateUpdate:
    """One row group's update and its partial sums of y (a mixin of the kernel class)."""

    def lane_permutation(self, lane):
        """``phi``: which of a row group's ``rows x R`` partial sums this lane keeps at each
        halving round of :meth:`reduce_rows`, as a permutation of slot indices (slot ``k``
        of the lane holds partial ``k ^ phi``). Built from the lane bits the rounds use, so
        every lane always keeps its *first* half and no selects are needed. Shifts and masks
        of the lane's bits: linear over XOR, so ``phi(a ^ b) = phi(a) ^ phi(b)`` (a Python int
        ``lane`` gives the trace-time value)."""
        lay = self.layout
        parts = lay.partials_per_group
        if const_expr(parts <= lay.TPR):
            return (lane >> (lay.TPR.bit_length() - parts.bit_length())) & (parts - 1)
        return (lane << (parts.bit_length() - lay.TPR.bit_length())) & (parts - 1)

    def column(self, c: int, e: int, lane: Int32) -> Int32:
        """State column of element ``e`` of the lane's vector ``c`` (the same in every row)."""
        return (c * self.layout.TPR + lane) * self.layout.VN + e

    @cute.jit
    def load_operands(self, tok: Token, shared: Shared, cta: Cta) -> Optional[Operands]:
        """The B, Bstate and C values of the lane's columns, ``(R, VN, CPT)`` fp32 each, read
        once from shared memory when they fit in registers (``cache_operands``), else None
        (then :meth:`update_rows` reads them per row). C is read in the lane's rank order:
        slot ``r`` holds rank ``r ^ (phi & (R - 1))`` (see :meth:`lane_permutation`)."""
        lay = self.layout
        if const_expr(not lay.cache_operands):
            return None
        shape = cute.make_layout((self.R, lay.VN, lay.CPT), stride=(lay.VN * lay.CPT, 1, lay.VN))
        tOrB = cute.make_rmem_tensor(shape, Float32)
        tOrBs = cute.make_rmem_tensor(shape, Float32)
        tOrC = cute.make_rmem_tensor(shape, Float32)
        sigma = cta.phi & (self.R - 1)
        for r in cutlass.range_constexpr(self.R):
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    n = self.column(c, e, cta.lane)
                    tOrB[r, e, c] = tok.sB[r, n]
                    tOrBs[r, e, c] = tok.sBs[r, n]
                    tOrC[r, e, c] = shared.sC[r ^ sigma, n]
        return Operands(tOrB, tOrBs, tOrC)

    @cute.jit
    def update_rows(self, group: RowGroup, operands: Optional[Operands], tok: Token, shared: Shared,
                    cta: Cta) -> cute.Tensor:
        """Per-thread state update of one row group (the math of docs/contract.md, fp32).

        ``new[d, n] = alpha s[d, n] + sum_r u_r[d] B[r, n] + v_r[d] Bs[r, n]`` (summed in r
        order) is stored back into ``group`` by the state's format (:mod:`.state_formats`); the unrounded
        new value feeds the thread's partial ``y[r, d] = sum_n new[d, n] C[r, n]`` over its own
        columns. ``operands``: B, Bs, C in registers, or None (read from shared memory per
        row). Returns the partials ``tYrY``, ``(rows_per_group * R,)`` fp32, slot ``i * R + r``
        holding register row ``i`` and rank ``r ^ (phi & (R - 1))``.
        """
        lay = self.layout
        R = self.R
        storage = self.storage
        rows = group.rows
        sigma = cta.phi & (R - 1)
        tYrY = cute.make_rmem_tensor(cute.make_layout(lay.partials_per_group), Float32)
        tSrNewG = storage.new_group()  # with a format that stores a whole group (else None)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            tSrUV = cute.make_rmem_tensor(cute.make_layout(2 * R), Float32)  # the row's u_r, v_r
            for k in cutlass.range_constexpr(2 * R):
                tSrUV[k] = shared.sUV[rows[i] if const_expr(group.uv_rows is None) else group.uv_rows[i], k]
            tSrNew = storage.new_row(tSrNewG, i)  # (VN, CPT)
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    tSrNew[e, c] = tok.alpha * storage.decoded(group, e, i, c)
            for r in cutlass.range_constexpr(R):
                if const_expr(not lay.cache_operands):
                    row_fence()  # one rank's operands at a time in registers
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        if const_expr(lay.cache_operands):
                            b_, bs_ = operands.tOrB[r, e, c], operands.tOrBs[r, e, c]
                        else:
                            n = self.column(c, e, cta.lane)
                            b_, bs_ = tok.sB[r, n], tok.sBs[r, n]
                        tSrNew[e, c] = tSrNew[e, c] + tSrUV[r] * b_ + tSrUV[R + r] * bs_
            storage.store_row(group, tSrNew, i, tok, cta)
            for r in cutlass.range_constexpr(R):
                if const_expr(not lay.cache_operands):
                    row_fence()
                y = Float32(0.0)
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        if const_expr(lay.cache_operands):
                            y = y + tSrNew[e, c] * operands.tOrC[r, e, c]
                        else:
                            y = y + tSrNew[e, c] * shared.sC[r ^ sigma, self.column(c, e, cta.lane)]
                tYrY[i * R + r] = y
        storage.store_group(group, tSrNewG, tok, cta)
        return tYrY

    @cute.jit
    def contract_rows(self, group: RowGroup, operands: Optional[Operands], shared: Shared, cta: Cta) -> cute.Tensor:
        """The thread's partials of ``y[r, d] = sum_n s[d, n] C[r, n]`` over its own columns for one row
        group of the loaded state, not updated (the checkpoint's term of an append; an 8-bit row's sum
        times its scale); slots as :meth:`update_rows`' ``tYrY``."""
        lay = self.layout
        sigma = cta.phi & (self.R - 1)
        tYrY = cute.make_rmem_tensor(cute.make_layout(lay.partials_per_group), Float32)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            for r in cutlass.range_constexpr(self.R):
                y = Float32(0.0)
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        s_ = group.tSrS[e, i, c].to(Float32)
                        if const_expr(lay.cache_operands):
                            y = y + s_ * operands.tOrC[r, e, c]
                        else:
                            y = y + s_ * shared.sC[r ^ sigma, self.column(c, e, cta.lane)]
                tYrY[i * self.R + r] = self.storage.contracted(y, group, i)
        return tYrY
