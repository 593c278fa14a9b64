"""The token loop of a step: T tokens on the slab in registers, stored after each token or once.

A T-token specialisation (speculative decoding) loads the slab once and runs the stages once per
token (:meth:`TokenSteps.token_step`), in a loop unrolled at trace time: the state stays in
registers between tokens, the previous token's B stays in the other half of a two-parity shared
buffer and its x is re-read from ``x``; the state (and B/x) is stored after every token with a
(B, T) destination, else once after the last.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..tensors import KernelArgs
from .bundles import Cta, Shared, Token

__all__ = ["TokenSteps"]


class TokenSteps:
    """The step's tokens, in order, on the loaded slab (a mixin of the kernel class)."""

    @cute.jit
    def run_tokens(self, m: KernelArgs, cta: Cta, shared: Shared, groups: list):
        """The step's T tokens on the loaded slab, then the final state when it is stored once.

        Unrolled at trace time: every buffer parity and token offset is static, and fewer values
        stay live than in a runtime token loop (which spilled at R = 8); code grows with T."""
        for t in cutlass.range_constexpr(self.T):
            if const_expr(t > 0):
                cute.arch.barrier()  # token t - 1 is done with the shared buffers
            self.token_step(m, t, cta, shared, groups)
        if const_expr(not self.store_each):  # the final state, and the last token's B/x, to row dst
            if const_expr(self.cluster is not None):
                cute.arch.cluster_wait()  # every CTA of the (lane, head) read the old Bstate row (token 0)
            if cta.dst_live:
                for g in cutlass.range_constexpr(self.layout.row_groups):
                    self.store_state(groups[g], m, cta)
                if const_expr(self.update_kv_state):
                    self.store_kv_state(m, shared.sBB[(self.T - 1) % 2, None, None], shared.sX, cta)

    @cute.jit
    def token_step(self, m: KernelArgs, t: int, cta: Cta, shared: Shared, groups: list):
        """Token ``t`` (a compile-time index): stage its operands, update the state in registers,
        reduce y, write its ``out``; store the state (and B/x) when each token has its row.

        The previous B and x: for token 0 the Bstate/Xstate rows of ``src``; for t > 0 the
        previous B is already in shared memory (the other half of ``sBB``, staged by token
        t - 1) and the previous x is token t - 1's ``x``.
        """
        lane_t = self.lane_index(cta.b, t)
        sB = shared.sBB[t % 2, None, None]
        sBs = shared.sBB[(t + 1) % 2, None, None]
        tok = Token(t, lane_t, sB, sBs, *self.decay_coefficients(m, lane_t, cta.h),
                    rng=self.token_rng(cta.seed, t) if const_expr(self.stochastic) else None,
                    epi=self.load_epilogue_operands(m, lane_t, cta) if const_expr(self.early_epilogue) else None)
        if const_expr(t == 0 and self.pinned_loads):
            # The compiler moves no global load across a barrier: the slab's loads (issued before this token), the
            # coefficients' and the epilogue's stay above it, so all are in flight before the first use of any.
            cute.arch.barrier()
        if const_expr(self.rope_angles > 0):
            if const_expr(self.dst_per_token):  # the angle is stored by advance_angles
                cta = self.token_destination(m, t, cta)
            self.advance_angles(m, tok, shared, cta)
            cute.arch.barrier()  # cos/sin of the new angles, for the B/C staging
        if const_expr(t == 0):
            self.stage_kv_row(m.Bstate, (cta.src,), cta.h, sBs, cta)
            Xprev = (m.Xstate, (cta.src,))
        else:
            Xprev = (m.x, self.lane_index(cta.b, t - 1))
            if const_expr(self.rope_angles > 0 and self.kv_dtype is not Float32):
                self.round_previous_b(sBs, cta)
        self.stage_operands(m, tok, Xprev, shared, cta)
        cute.arch.barrier()
        # Every read of the old Bstate/Xstate rows happened before the barrier.
        if const_expr(t == 0 and self.cluster is not None):
            # ... in this CTA, which says so to the cluster's other D-tiles (a release); the first D-tile stores
            # the Bstate row once all of them did: at once when each token stores its row (waiting after the
            # update would keep the row and B/x live across it: a bf16 stochastic state at tile_D = 16 would
            # spill), else after the last token
            cute.arch.cluster_arrive()
        if const_expr(self.dst_per_token and self.rope_angles == 0):  # read late: fewer values live while staging
            cta = self.token_destination(m, t, cta)
        if const_expr(t == 0 and self.store_each and self.cluster is not None):
            cute.arch.cluster_wait()
        if const_expr(self.update_kv_state and self.store_each):
            if cta.dst_live:
                self.store_kv_state(m, sB, shared.sX, cta)
        operands = self.load_operands(tok, shared, cta)
        for g in cutlass.range_constexpr(self.layout.row_groups):
            if const_expr(g >= len(groups)):  # without preload: this group's loads now
                groups.append(self.load_state(m, g, cta, shared))
            tYrY = self.update_rows(groups[g], operands, tok, shared, cta)
            self.reduce_rows(tYrY, shared.sY, cta, g)
            if const_expr(self.store_each):
                if cta.dst_live:
                    self.store_state(groups[g], m, cta)
        cute.arch.barrier()
        self.epilogue(m, tok, shared, cta)

    @cute.jit
    def token_destination(self, m: KernelArgs, t: int, cta: Cta) -> Cta:
        """``cta`` with token ``t``'s own destination row ``dst_state_batch_indices[b, t]``."""
        dst = m.dst_state_batch_indices[cta.b, t]
        return cta._replace(dst=dst, dst_live=cta.src_live & self.row_is_live(dst, m.state.shape[0], m.null_slot))
