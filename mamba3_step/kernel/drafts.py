"""A verify step's drafts' outputs from the checkpoint (``replay_from_checkpoint`` with T > 1): every
token staged at once (:class:`~.bundles.Drafts`), the checkpoint's contraction per draft, the
weights and tables of every (draft, token) pair, and their terms; no draft is stepped.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr

from ..tensors import KernelArgs
from .bundles import Cta, Drafts, Shared, Token

__all__ = ["DraftOutputs"]


class DraftOutputs:
    """A verify step's drafts' outputs from the checkpoint (a mixin of the kernel class)."""

    def allocate_drafts(self, smem) -> Drafts:
        """The :class:`Drafts` buffers of a verify step with outputs from the checkpoint, 16-byte aligned."""
        T, R, N, tD, w = self.T, self.R, self.N, self.tile_D, self.draft_row

        def rows(tokens):  # (tokens, R, N), rows padded to w words
            return smem.allocate_tensor(Float32, cute.make_layout((tokens, R, N), stride=(R * w, w, 1)), 16)

        def per_token(tokens, inner):  # (tokens, *inner), row-major
            shape = (tokens,) + inner
            stride = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
            return smem.allocate_tensor(Float32, cute.make_layout(shape, stride=stride), 16)

        return Drafts(sB=rows(self.slots), sC=rows(T), sX=per_token(self.slots, (tD,)), sXr=per_token(T, (R, tD)),
                      sY=per_token(T, (R, tD)), sG=per_token(self.draft_pairs, (R, R)),
                      sW=per_token(T, (self.slots + 1,)))

    @cute.jit
    def drafts_from_checkpoint(self, m: KernelArgs, count: Int32, ring: Int32, cta: Cta, shared: Shared,
                               groups: list):
        """The T drafts' outputs from the checkpoint in registers (the flush's new one, or the row's
        as loaded) and the ``ring`` committed ring tokens since (``count`` without a flush, else 0),
        by the algebra (docs/design/replay.md): for draft i (token ``k = ring + i + 1``; token 0
        the one before the ring)::

            y_i[r, d] = P_i sum_n s[d, n] C_i[r, n] + sum_{j <= k} sum_r' xr_j[r', d] w_ij B_j[r'] . C_i[r]

        In order: every token staged (:meth:`stage_drafts`); per draft the checkpoint's contraction
        with its C (:meth:`contract_rows`) and its ring entry ``ring + i``; the tables
        (:meth:`draft_grams`); the terms (:meth:`combine_drafts`); each draft's epilogue. Nothing is
        stepped; the state row is written only by a flush."""
        dr = shared.drafts
        self.stage_drafts(m, count, ring, cta, shared)
        cute.arch.barrier()  # the staged tokens, and every read of the ring entries the drafts overwrite
        for i in cutlass.range_constexpr(self.T):
            tok = self.draft_of(i, cta, dr)
            view = shared._replace(sC=dr.sC[i, None, None], sX=dr.sX[self.flush_length + i, None])
            operands = self.load_operands(tok, view, cta)  # C only: the B operands are never read
            for g in cutlass.range_constexpr(self.layout.row_groups):
                self.reduce_rows(self.contract_rows(groups[g], operands, view, cta), dr.sY[i, None, None], cta, g)
            if cta.dst_live:
                self.append_ring(m, ring + i, tok, view, cta)
        self.draft_grams(dr, ring, cta)
        cute.arch.barrier()
        self.combine_drafts(m, dr, ring, cta)
        cute.arch.barrier()
        for i in cutlass.range_constexpr(self.T):
            self.epilogue(m, self.draft_of(i, cta, dr), shared._replace(sY=dr.sY[i, None, None],
                                                                        sXr=dr.sXr[i, None, None]), cta)

    def draft_of(self, i: int, cta: Cta, dr: Drafts) -> Token:
        """Draft ``i`` as a :class:`Token` for the stages that take one (its B staged in ``dr``; its
        decays are in ``dr.sW``)."""
        s = self.flush_length + i
        return Token(i, (cta.b, i), dr.sB[s, None, None], dr.sB[s - 1, None, None], None, None, None, None)

    def draft_slot(self, j, ring):
        """The :class:`Drafts` slot of token ``j`` of a draft's sum (0 the one before the ring, then
        the ``ring`` committed tokens, then the drafts)."""
        return cutlass.select_(j <= ring, j, j + (self.flush_length - 1) - ring)

    def draft_pair(self, i, ring):
        """Draft ``i``'s first pair: the drafts before it have ``ring + 2``, ``ring + 3``, ... tokens."""
        return i * (ring + 2) + ((i * (i - 1)) >> 1)

    @cute.jit
    def stage_drafts(self, m: KernelArgs, count: Int32, ring: Int32, cta: Cta, shared: Shared):
        """The :class:`Drafts` buffers: slot 0 (Bstate/Xstate's row, or after a flush the last committed
        entry's), the ``ring`` committed entries, each draft's B, C, x and x * xproj; thread 0 the
        weights (:meth:`draft_weights`)."""
        dr = shared.drafts
        src, h = cta.src, cta.h
        hbc = 0 if const_expr(self.shared_bc) else h
        flushed = ring < count  # the token before the ring is the last committed one

        def before_b(i):  # i = r * N + n
            sB = dr.sB  # stored under a runtime `if`: a local name (see for_thread_indices)
            r = i // self.N
            n = i - r * self.N
            v = Float32(0.0)
            if flushed:
                v = m.ring_B[src, count - 1, r, h, n].to(Float32)
            else:
                v = m.Bstate[src, r, h, n].to(Float32)
            sB[0, r, n] = v

        self.for_thread_indices(self.R * self.N, cta.tidx, before_b)
        for s in cutlass.range_constexpr(1, self.flush_length):
            if s <= ring:
                self.stage_kv_row(m.ring_B, (src, s - 1), h, dr.sB[s, None, None], cta)
        for i in cutlass.range_constexpr(self.T):
            self.stage_kv_row(m.B, (cta.b, i), hbc, dr.sB[self.flush_length + i, None, None], cta)
            self.stage_kv_row(m.C, (cta.b, i), hbc, dr.sC[i, None, None], cta)
        for s in cutlass.range_constexpr(self.slots):
            if const_expr(s == 0 or s >= self.flush_length):
                self.stage_slot_x(m, s, count, flushed, cta, dr)
            else:
                if s <= ring:
                    self.stage_slot_x(m, s, count, flushed, cta, dr)
        if cta.tidx == 0:
            self.draft_weights(m, ring, cta, dr)

    @cute.jit
    def stage_slot_x(self, m: KernelArgs, s: int, count: Int32, flushed: Boolean, cta: Cta, dr: Drafts):
        """Slot ``s``'s x to ``dr.sX`` (and a draft's x * xproj to ``dr.sXr``)."""
        src, h = cta.src, cta.h
        d0 = cta.dtile * self.tile_D

        def stage(d):
            sX, sXr = dr.sX, dr.sXr  # stored under a runtime `if`: local names (see for_thread_indices)
            x = Float32(0.0)
            if const_expr(s == 0):
                if flushed:
                    x = m.ring_x[src, count - 1, h, d0 + d].to(Float32)
                else:
                    x = m.Xstate[src, h, d0 + d].to(Float32)
            elif const_expr(s < self.flush_length):
                x = m.ring_x[src, s - 1, h, d0 + d].to(Float32)
            else:
                x = m.x[cta.b, s - self.flush_length, h, d0 + d].to(Float32)
                for r in cutlass.range_constexpr(self.R):
                    sXr[s - self.flush_length, r, d] = x * m.xproj[r, h, d0 + d].to(Float32)
            sX[s, d] = x

        self.for_thread_indices(self.tile_D, cta.tidx, stage)

    @cute.jit
    def draft_weights(self, m: KernelArgs, ring: Int32, cta: Cta, dr: Drafts):
        """One thread: per draft i (token ``k = ring + i + 1``) ``sW[i, slot(j)] = gamma_j a_{j+1}..a_k +
        beta_{j+1} a_{j+2}..a_k`` for its tokens j = 0..k (no gamma term for token 0) and
        ``sW[i, slots] = P_i = a_1..a_k``; the ring tokens' decays from ``ring_coef``, the drafts'
        from the step's inputs. Suffix products from token k down, as the CPU path."""
        sW = dr.sW
        src, h = cta.src, cta.h
        decays = [None]  # by slot; slot 0 has none
        for s in cutlass.range_constexpr(1, self.flush_length):
            alpha, beta, gamma = Float32(1.0), Float32(0.0), Float32(0.0)
            if s <= ring:
                alpha, beta, gamma = self.decay(m.ring_coef[src, s - 1, h, 0], m.ring_coef[src, s - 1, h, 1],
                                                m.ring_coef[src, s - 1, h, 2])[:3]
            decays.append((alpha, beta, gamma))
        for i in cutlass.range_constexpr(self.T):
            decays.append(self.decay_coefficients(m, (cta.b, i), h)[:3])
        for i in cutlass.range_constexpr(self.T):
            suffix = Float32(1.0)  # a_{j+1} .. a_k
            suffix_next = Float32(1.0)  # a_{j+2} .. a_k
            beta_next = Float32(0.0)  # beta_{j+1}; none past k
            for q in cutlass.range_constexpr(i + 1):  # the drafts, the last first
                alpha, beta, gamma = decays[self.flush_length + i - q]
                sW[i, self.flush_length + i - q] = gamma * suffix + beta_next * suffix_next
                suffix_next = suffix
                suffix = suffix * alpha
                beta_next = beta
            for q in cutlass.range_constexpr(self.flush_length - 1):  # the ring tokens, the last first
                s = self.flush_length - 1 - q
                if s <= ring:
                    alpha, beta, gamma = decays[s]
                    sW[i, s] = gamma * suffix + beta_next * suffix_next
                    suffix_next = suffix
                    suffix = suffix * alpha
                    beta_next = beta
            sW[i, 0] = beta_next * suffix_next
            sW[i, self.slots] = suffix

    @cute.jit
    def draft_grams(self, dr: Drafts, ring: Int32, cta: Cta):
        """``sG[p, r', r] = w_ij B_j[r'] . C_i[r]`` for every pair ``p`` of draft i and its token j
        (:meth:`draft_pair`, :meth:`draft_slot`), one entry a thread: four running sums over the
        columns (16-byte shared loads), summed in pairs."""
        R2 = self.R * self.R
        total = (self.T * (ring + 2) + self.T * (self.T - 1) // 2) * R2
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)

        def entry(e):  # e = p * R^2 + r' * R + r
            sG = dr.sG  # stored under a runtime `if`: a local name (see for_thread_indices)
            if e < total:
                p = e // R2
                q = e - p * R2
                rp = q // self.R
                r = q - rp * self.R
                i = Int32(0)
                for t in cutlass.range_constexpr(1, self.T):  # the draft: how many drafts' pairs lie before p
                    i = i + cutlass.select_(p >= self.draft_pair(t, ring), Int32(1), Int32(0))
                slot = self.draft_slot(p - self.draft_pair(i, ring), ring)
                tB = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                tC = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                acc = [Float32(0.0)] * 4
                for c in cutlass.range_constexpr(self.N // 4):
                    cute.copy(atom, cute.local_tile(dr.sB[slot, rp, None], (4,), (c,)), tB)
                    cute.copy(atom, cute.local_tile(dr.sC[i, r, None], (4,), (c,)), tC)
                    for k in cutlass.range_constexpr(4):
                        acc[k] = acc[k] + tB[k] * tC[k]
                sG[p, rp, r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) * dr.sW[i, slot]

        self.for_thread_indices(self.draft_pairs * R2, cta.tidx, entry)

    @cute.jit
    def combine_drafts(self, m: KernelArgs, dr: Drafts, ring: Int32, cta: Cta):
        """Per row d (a thread each) and draft i: ``sY[i, r, d] = P_i sY[i, r, d] + sum_j sum_r' x_j[d]
        xproj[r', d] sG[p(i, j), r', r]``, tokens in order."""
        T, R = self.T, self.R
        first_draft = self.flush_length  # the drafts' first slot
        h = cta.h
        d0 = cta.dtile * self.tile_D

        def combine(d):
            sY = dr.sY  # stored under a runtime `if`: a local name (see for_thread_indices)
            xp = []
            for rp in cutlass.range_constexpr(R):
                xp.append(m.xproj[rp, h, d0 + d].to(Float32))
            acc = cute.make_rmem_tensor(cute.make_layout(R), Float32)
            for i in cutlass.range_constexpr(T):
                first = self.draft_pair(i, ring)
                for r in cutlass.range_constexpr(R):
                    acc[r] = dr.sW[i, self.slots] * sY[i, r, d]
                for s in cutlass.range_constexpr(first_draft + i + 1):  # slot 0, the ring's (those held), the drafts'
                    if const_expr(s == 0):
                        self.add_token(dr, acc, s, first, d, xp)
                    elif const_expr(s < first_draft):
                        if s <= ring:
                            self.add_token(dr, acc, s, first + s, d, xp)
                    else:
                        self.add_token(dr, acc, s, first + ring + 1 + (s - first_draft), d, xp)
                for r in cutlass.range_constexpr(R):
                    sY[i, r, d] = acc[r]

        self.for_thread_indices(self.tile_D, cta.tidx, combine)

    @cute.jit
    def add_token(self, dr: Drafts, acc: cute.Tensor, s: int, p, d, xp: list):
        """``acc[r] += sum_r' x_s[d] xproj[r', d] sG[p, r', r]``: the token in slot ``s``, pair ``p``."""
        x = dr.sX[s, d]
        for rp in cutlass.range_constexpr(self.R):
            xr = x * xp[rp]
            for r in cutlass.range_constexpr(self.R):
                acc[r] = acc[r] + xr * dr.sG[p, rp, r]
