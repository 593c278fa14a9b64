"""An append's output from the checkpoint and the ring (``replay_from_checkpoint``, one token; docs/design/replay.md,
the algebra): the checkpoint's contraction with C decayed, plus each token's term since
through its table ``G_j = B_j . C`` and weight ``w_j``; the state is read only.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..tensors import KernelArgs
from .bundles import Cta, Shared, Token

__all__ = ["CheckpointOutputs"]


class CheckpointOutputs:
    """A one-token append's output from the checkpoint (a mixin of the kernel class)."""

    @cute.jit
    def append_from_checkpoint(self, m: KernelArgs, count: Int32, cta: Cta, shared: Shared, groups: list):
        """An append (``count < flush_length - 1``): ``out`` of token ``k = count + 1`` after the checkpoint
        (token 0 is Bstate/Xstate's, tokens 1..count the ring's, token k this step's) without the
        new state (docs/design/replay.md, the algebra)::

            y[r, d] = P sum_n s_0[d, n] C[r, n] + sum_j w_j sum_r' x_j[d] xproj[r', d] G_j[r', r] + D xr[r, d]

        with ``G_j[r', r] = B_j[r'] . C[r]`` (:meth:`gram`), ``w_j`` and ``P`` from the tokens' decays
        (:meth:`token_weights`); then this token is appended to the ring. With rotary, B_j is token
        j's B~ (staged again from its ring entry and angle) in its own update and B~ rounded to the
        kv dtype in token j + 1's trapezoid term, so ``G_j`` carries the two weights
        (:meth:`gram`); C is this token's C~. The state row is read only."""
        src, h = cta.src, cta.h
        lane_t = (cta.b,)
        k = count + 1
        parity = k % 2
        tok = Token(0, lane_t, shared.sBB[parity, None, None], shared.sBB[1 - parity, None, None],
                    *self.decay_coefficients(m, lane_t, h))
        hbc = 0 if const_expr(self.shared_bc) else h
        if const_expr(self.rope_angles > 0):
            def store_angle(a, q):  # this token's angle goes with its ring entry
                mRingAngle = m.ring_angle
                if cta.dst_live:
                    mRingAngle[cta.dst, count, h, a] = q

            self.advance_angles(m, tok, shared, cta, start=lambda a: self.current_angle(m, count, cta, a),
                                store=store_angle)
            cute.arch.barrier()  # cos/sin of this token's angles, for its B~ and C~
            self.stage_bc(m, tok, shared, cta)
        else:
            self.stage_kv_row(m.C, lane_t, hbc, shared.sC, cta)
        self.stage_coefficients(m, (m.x, lane_t), lambda dg: Float32(0.0), tok, shared, cta)
        if cta.tidx == 0:
            self.token_weights(m, count, tok, shared, cta)
        cute.arch.barrier()
        operands = self.load_operands(tok, shared, cta)  # C only: the B operands are never read
        for g in cutlass.range_constexpr(self.layout.row_groups):  # first, so the state dies early
            self.reduce_rows(self.contract_rows(groups[g], operands, shared, cta), shared.sY, cta, g)
        if const_expr(self.rope_angles > 0):
            self.rotary_grams(m, count, tok, shared, cta)
        else:
            for j in cutlass.range_constexpr(self.flush_length):  # token j's B to sBB[j % 2], then its row of G
                if j <= k:
                    sBj = shared.sBB[j % 2, None, None]
                    if const_expr(j == 0):
                        self.stage_kv_row(m.Bstate, (src,), h, sBj, cta)
                    else:
                        if j <= count:
                            self.stage_kv_row(m.ring_B, (src, j - 1), h, sBj, cta)
                        else:
                            self.stage_kv_row(m.B, lane_t, hbc, sBj, cta)
                    cute.arch.barrier()
                    self.gram(sBj, shared.sC, shared.sG[j, None, None], cta)
        if cta.dst_live:
            self.append_ring(m, count, tok, shared, cta)
            if cta.tidx == 0:
                mLength = m.ring_length
                mLength[cta.dst, h] = count + 1
        cute.arch.barrier()
        self.ring_terms(m, count, shared, cta)
        cute.arch.barrier()
        self.epilogue(m, tok, shared, cta)

    @cute.jit
    def rotary_grams(self, m: KernelArgs, count: Int32, tok: Token, shared: Shared, cta: Cta):
        """With rotary, the weighted tables ``sG[j]`` (:meth:`gram`) of token k (this one: its
        B~ staged in ``tok.sB``, its own update only), token 0 (Bstate, B~ as stored: the trapezoid
        term only) and ring tokens 1..count (B~ staged again from the entry's B, the bias and the
        entry's angle: both terms)."""
        src, h = cta.src, cta.h
        k = count + 1
        self.gram(tok.sB, shared.sC, shared.sG[k, None, None], cta, weights=(shared.sW[k], Float32(0.0)))
        for j in cutlass.range_constexpr(self.flush_length - 1):
            if j <= count:
                sBj = shared.sBB[j % 2, None, None]
                cute.arch.barrier()  # the last table's reads of this buffer (and of sCS) are done
                if const_expr(j == 0):
                    self.stage_kv_row(m.Bstate, (src,), h, sBj, cta)
                else:
                    self.stored_angles(m.ring_angle, (src, j - 1), shared, cta)
                    cute.arch.barrier()
                    self.stage_rotated(m.ring_B, m.B_bias, (src, j - 1), h, sBj, shared.sCS, cta)
                cute.arch.barrier()
                if const_expr(j == 0):
                    self.gram(sBj, shared.sC, shared.sG[0, None, None], cta, weights=(Float32(0.0), shared.sWp[0]))
                else:
                    self.gram(sBj, shared.sC, shared.sG[j, None, None], cta, weights=(shared.sW[j], shared.sWp[j]),
                              both=True)

    @cute.jit
    def token_weights(self, m: KernelArgs, count: Int32, tok: Token, shared: Shared, cta: Cta):
        """One thread: ``sW[j] = w_j = gamma_j a_{j+1}..a_k + beta_{j+1} a_{j+2}..a_k`` for the tokens
        ``j = 0..k`` since the checkpoint (no gamma term for token 0, no beta term past k) and
        ``sW[flush_length] = P = a_1..a_k`` (``a`` the decays alpha); tokens 1..count from the ring, token k
        this step's (``tok``). The suffix products are built from token k down, as the CPU path. With
        rotary the two terms go apart (:meth:`rotary_grams`): ``sW[j]`` the gamma term, ``sWp[j]`` the
        beta term (token j's B~ rounded)."""
        src, h = cta.src, cta.h
        sW, sWp = shared.sW, shared.sWp
        suffix = Float32(1.0)  # a_{j+1} .. a_k
        suffix_next = Float32(1.0)  # a_{j+2} .. a_k
        beta_next = Float32(0.0)  # beta_{j+1}; none past k
        for i in cutlass.range_constexpr(self.flush_length - 1):
            j = self.flush_length - 1 - i  # tokens flush_length - 1 .. 1, those up to k taken
            if j <= count + 1:
                alpha = tok.alpha
                beta = tok.beta
                gamma = tok.gamma
                if j <= count:  # a ring token
                    alpha, beta, gamma = self.decay(m.ring_coef[src, j - 1, h, 0], m.ring_coef[src, j - 1, h, 1],
                                                    m.ring_coef[src, j - 1, h, 2])[:3]
                if const_expr(self.rope_angles > 0):
                    sW[j] = gamma * suffix
                    if j <= count:  # token k has no trapezoid term after it
                        sWp[j] = beta_next * suffix_next
                else:
                    sW[j] = gamma * suffix + beta_next * suffix_next
                suffix_next = suffix
                suffix = suffix * alpha
                beta_next = beta
        if const_expr(self.rope_angles > 0):
            sWp[0] = beta_next * suffix_next
        else:
            sW[0] = beta_next * suffix_next
        sW[self.flush_length] = suffix

    @cute.jit
    def gram(self, sB: cute.Tensor, sC: cute.Tensor, sG: cute.Tensor, cta: Cta, weights: Optional[tuple] = None,
             both: bool = False):
        """``sG[r', r] = sum_n sB[r', n] sC[r, n]`` (R x R dot products of length N): warp ``w`` takes
        pairs ``w, w + warps, ...``, its lanes stride over n, a butterfly sums them. With rotary,
        ``weights = (w_own, w_prev)``: ``sG[r', r] = w_own sB[r'] . sC[r] + w_prev round(sB[r']) . sC[r]``,
        ``round`` the kv dtype's (as the next token reads this one's B~ from Bstate), both dot
        products in one pass when ``both`` (compile time) and the kv dtype rounds, else
        ``(w_own + w_prev) sB[r'] . sC[r]`` (one weight zero, or nothing to round)."""
        warps = self.num_threads // 32
        warp = cta.tidx // 32
        lane = cta.tidx % 32
        rounds = both and self.kv_dtype is not Float32
        for q in cutlass.range_constexpr(-(-self.R * self.R // warps)):
            pair = warp + q * warps
            if pair < self.R * self.R:
                rp = pair // self.R
                r = pair - rp * self.R
                acc = Float32(0.0)
                prev = Float32(0.0)
                for c in cutlass.range_constexpr(self.N // 32):  # every supported N is a multiple of 32
                    n = lane + c * 32
                    acc = acc + sB[rp, n] * sC[r, n]
                    if const_expr(rounds):
                        prev = prev + sB[rp, n].to(self.kv_dtype).to(Float32) * sC[r, n]
                for k in cutlass.range_constexpr(5):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=16 >> k)
                    if const_expr(rounds):
                        prev = prev + cute.arch.shuffle_sync_bfly(prev, offset=16 >> k)
                if lane == 0:
                    if const_expr(weights is None):
                        sG[rp, r] = acc
                    elif const_expr(rounds):
                        sG[rp, r] = weights[0] * acc + weights[1] * prev
                    else:
                        sG[rp, r] = (weights[0] + weights[1]) * acc

    @cute.jit
    def ring_terms(self, m: KernelArgs, count: Int32, shared: Shared, cta: Cta):
        """``sY[r, d] = P sY[r, d] + sum_j w_j sum_r' x_j[d] xproj[r', d] G_j[r', r]``: the checkpoint's
        contraction decayed, plus each token's term since, in token order; ``x_j`` is Xstate's for
        token 0, the ring's for tokens 1..count, this step's (``sX``) for token k. With rotary the
        weights are in the tables already (:meth:`rotary_grams`)."""
        src, h = cta.src, cta.h
        d0 = cta.dtile * self.tile_D

        def combine(i):  # i = r * tile_D + d
            sY = shared.sY  # stored under a runtime `if`: a local name (see for_thread_indices)
            r = i // self.tile_D
            d = i - r * self.tile_D
            acc = shared.sW[self.flush_length] * sY[r, d]
            for j in cutlass.range_constexpr(self.flush_length):
                if j <= count + 1:
                    xj = shared.sX[d]
                    if const_expr(j == 0):
                        xj = m.Xstate[src, h, d0 + d].to(Float32)
                    else:
                        if j <= count:
                            xj = m.ring_x[src, j - 1, h, d0 + d].to(Float32)
                    t = Float32(0.0)
                    for rp in cutlass.range_constexpr(self.R):
                        t = t + (xj * m.xproj[rp, h, d0 + d].to(Float32)) * shared.sG[j, rp, r]
                    if const_expr(self.rope_angles > 0):  # the table carries the weights (rotary_grams)
                        acc = acc + t
                    else:
                        acc = acc + shared.sW[j] * t
            sY[r, d] = acc

        self.for_thread_indices(self.R * self.tile_D, cta.tidx, combine)
