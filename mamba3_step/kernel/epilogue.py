"""From the partial sums to ``out``: the transposed butterfly that completes y over a row's lanes
(:func:`reduction_plan`), the epilogue (skip term, z gate, outproj, a fixed order of the ranks'
sum), and a padding lane's zeroed ``out``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..tensors import KernelArgs
from .bundles import Cta, EpilogueOperands, Shared, Token
from .ptx_ops import mul_rn

__all__ = ["Epilogue", "reduction_plan"]


def reduction_plan(partials: int, lanes: int) -> tuple[list, int]:
    """The shuffle rounds of :meth:`Mamba3StepKernel.reduce_rows` for ``partials`` values per
    lane over ``lanes`` lanes (powers of two): ``[(mask, halving), ...]`` with descending masks,
    and the mask bits of the plain (non-halving) rounds: lanes with those bits set hold
    duplicates and do not store."""
    plan, plain, count, m = [], 0, partials, lanes // 2
    while m >= 1:
        plan.append((m, count > 1))
        if count > 1:
            count //= 2
        else:
            plain |= m
        m //= 2
    return plan, plain


class Epilogue:
    """The reduction of y and the epilogue (a mixin of the kernel class)."""

    @cute.jit
    def reduce_rows(self, tYrY: cute.Tensor, sY: cute.Tensor, cta: Cta, g: int):
        """Complete a row group's partial sums ``tYrY`` over the TPR lanes of each row; store
        them to sY.

        Transposed butterfly: while a lane holds more than one value, the round with lane
        mask ``m`` sends the second half of the lane's slots to its partner ``lane ^ m`` and
        adds what arrives to the first half. Because the lane's slots are ordered by
        ``phi`` (:meth:`lane_permutation`), the partner's second half holds the same
        partials as the lane's first half, and ``n`` partials over TPR lanes cost ``n - 1``
        shuffles and adds, with no selects. Once a lane holds one value the remaining rounds
        are plain butterflies, after which only the lanes with those mask bits clear store.
        Slot ``j`` left at the end is partial ``j ^ phi``: row ``(j ^ phi) // R``, rank
        ``(j ^ phi) % R``.
        """
        lay = self.layout
        vals = []
        for k in cutlass.range_constexpr(lay.partials_per_group):
            vals.append(tYrY[k])
        for step in cutlass.range_constexpr(len(self.reduce_plan)):
            mask, halving = self.reduce_plan[step]
            if const_expr(halving):
                half = len(vals) // 2
                kept = []
                for j in cutlass.range_constexpr(half):
                    kept.append(vals[j] + cute.arch.shuffle_sync_bfly(vals[j + half], offset=mask))
                vals = kept
            else:
                vals = [vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=mask)]
        lane = cta.tidx % lay.TPR
        row0 = g * self.group_rows + cta.tidx // lay.TPR
        log2r = self.R.bit_length() - 1
        for j in cutlass.range_constexpr(len(vals)):
            k = cta.phi ^ j
            if (lane & self.reduce_plain_mask) == 0:
                sY[k & (self.R - 1), row0 + (k >> log2r) * lay.rows_per_pass] = vals[j]

    @cute.jit
    def epilogue(self, m: KernelArgs, tok: Token, shared: Shared, cta: Cta):
        """``y = sY + D xr``; ``y *= silu(z zproj)``; ``out = sum_r y outproj`` (or out = y).

        When the CTA has more threads than rows, ``epilogue_split`` adjacent lanes share a row
        ``d``, each taking ``R / epilogue_split`` consecutive ranks; with outproj their partial sums
        are combined by a butterfly over those lanes and the first one stores ``out``.

        The sum over the ranks has one order whatever the split (so a T-token step, whose default
        tiling has more threads, writes the bits of T one-token steps): each product
        ``y_r outproj_r`` rounded on its own (:func:`~.ptx_ops.mul_rn`, never fused into an add), then a
        pairwise tree over ranks ``(0, 1), (2, 3), ...``: a lane sums the subtree of its ranks
        (:meth:`pairwise_sum`), and butterfly rounds with ascending masks join neighbouring
        subtrees.
        """
        split = self.epilogue_split
        ranks = self.R // split
        h = cta.h
        lane_t = tok.lane_t
        early = tok.epi is not None
        dskip = tok.epi.dskip if const_expr(early) else m.D[h]
        d0 = cta.dtile * self.tile_D
        part = cta.tidx % split

        def row(d, pre=None):  # pre: the row's operands loaded early (load_epilogue_operands), or None
            mOut = m.out  # stored under a runtime `if`: a local name (see for_thread_indices)
            acc = Float32(0.0)
            if d < self.tile_D:
                dg = d0 + d
                zd = Float32(0.0)
                if const_expr(self.has_z):
                    zd = pre[0] if const_expr(pre is not None) else m.z[lane_t + (h, dg)].to(Float32)
                products = []
                for j in cutlass.range_constexpr(ranks):
                    r = part * ranks + j
                    y = shared.sY[r, d] + dskip * shared.sXr[r, d]
                    if const_expr(self.has_z):
                        gz = zd * (pre[1][j] if const_expr(pre is not None) else m.zproj[r, h, dg].to(Float32))
                        y = y * (gz * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gz)))
                    if const_expr(self.has_outproj):
                        w = pre[2][j] if const_expr(pre is not None) else m.outproj[r, h, dg].to(Float32)
                        products.append(mul_rn(y, w))
                    else:
                        mOut[lane_t + (r, h, dg)] = y.to(self.x_dtype)
                if const_expr(self.has_outproj):
                    acc = self.pairwise_sum(products)
            if const_expr(self.has_outproj):
                # the lanes sharing a row are adjacent and agree on d < tile_D: every lane shuffles
                for k in cutlass.range_constexpr(len(self.epilogue_masks)):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=self.epilogue_masks[k])
                if d < self.tile_D:
                    if part == 0:
                        mOut[lane_t + (h, d0 + d)] = acc.to(self.x_dtype)

        if const_expr(early):
            for k in cutlass.range_constexpr(len(tok.epi.rows)):
                row((cta.tidx + k * self.num_threads) // split, tok.epi.rows[k])
        else:
            self.for_thread_indices(self.tile_D, cta.tidx, row, spread=split, guarded=False)

    @cute.jit
    def load_epilogue_operands(self, m: KernelArgs, lane_t: tuple, cta: Cta) -> EpilogueOperands:
        """The epilogue's global operands of this thread for one token (tiling.early_epilogue): D[h],
        and for each row :meth:`epilogue` gives it (``for_thread_indices``' k, split lanes per row)
        its z and its ranks' zproj and outproj, fp32. Loaded at the token's start, they go out with
        its staging loads instead of in a round trip of their own after the update. A row past the
        tile (when the tile's rows do not fill the block) loads the tile's last row: in range, unused."""
        split = self.epilogue_split
        ranks = self.R // split
        h = cta.h
        d0 = cta.dtile * self.tile_D
        part = cta.tidx % split
        nt = self.num_threads
        rows = []
        for k in cutlass.range_constexpr((self.tile_D * split + nt - 1) // nt):
            d = (cta.tidx + k * nt) // split
            if const_expr((self.tile_D * split) % nt != 0):
                if d >= self.tile_D:  # past the tile: its last row
                    d = Int32(self.tile_D - 1)
            dg = d0 + d
            zd = m.z[lane_t + (h, dg)].to(Float32) if const_expr(self.has_z) else None
            zp, op = [], []
            for j in cutlass.range_constexpr(ranks):
                r = part * ranks + j
                if const_expr(self.has_z):
                    zp.append(m.zproj[r, h, dg].to(Float32))
                if const_expr(self.has_outproj):
                    op.append(m.outproj[r, h, dg].to(Float32))
            rows.append((zd, zp, op))
        return EpilogueOperands(m.D[h], rows)

    def pairwise_sum(self, values: list) -> Float32:
        """The pairwise tree of ``values`` (a power of two of them): ``(v0 + v1) + (v2 + v3) ...``."""
        while len(values) > 1:
            values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
        return values[0]

    @cute.jit
    def zero_out(self, mOut: cute.Tensor, lane_t: tuple, h: Int32, dtile: Int32, tidx: Int32):
        """Padding lane: ``out`` = 0 for one token (``lane_t``: its leading coordinates); no pool row
        is read or written."""
        d0 = dtile * self.tile_D

        def zero(d):
            if const_expr(self.has_outproj):
                mOut[lane_t + (h, d0 + d)] = self.x_dtype(0.0)
            else:
                for r in cutlass.range_constexpr(self.R):
                    mOut[lane_t + (r, h, d0 + d)] = self.x_dtype(0.0)

        self.for_thread_indices(self.tile_D, tidx, zero)
