"""A token's operands staged in shared memory: B, C (rotated by :mod:`.rotary` with rotary) and the
per-row coefficients of the update, converted to fp32; its decay coefficients; and the Bstate/Xstate
rows written back (``update_kv_state``).
"""

from __future__ import annotations

from typing import Callable

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..tensors import KernelArgs
from .bundles import Cta, Shared, Token

__all__ = ["Staging"]


class Staging:
    """A token's operands to shared memory, and its B/x back to Bstate/Xstate (a mixin of the kernel class)."""

    @cute.jit
    def decay_coefficients(self, m: KernelArgs, lane_t: tuple, h: Int32):
        """``alpha = exp(A dt)``, ``beta = (1 - trap) dt alpha``, ``gamma = trap dt`` and ``dt`` (fp32)
        of one (lane, token) (``lane_t``: its leading coordinates, :meth:`lane_index`)."""
        dt = m.dt[lane_t + (h,)]  # read in this order: the stepwise kernels' code (and registers) depend on it
        trap = m.trap[lane_t + (h,)]
        return self.decay(m.A[lane_t + (h,)], dt, trap)

    @cute.jit
    def decay(self, A: Float32, dt: Float32, trap: Float32):
        """``(alpha, beta, gamma, dt)`` of one token's ``A``, ``dt``, ``trap`` (the contract's math)."""
        alpha = cute.math.exp(A * dt)
        beta = (Float32(1.0) - trap) * dt * alpha
        gamma = trap * dt
        return alpha, beta, gamma, dt

    @cute.jit
    def stage_operands(self, m: KernelArgs, tok: Token, Xprev: tuple, shared: Shared, cta: Cta):
        """Thread ``tidx``'s share of one token's per-(lane, head) operands, converted to fp32:
        B and C rows to shared memory as they are (rotated with rotary), then the coefficients of
        the state update (:meth:`stage_coefficients`). ``Xprev``: the previous x as (tensor,
        leading coordinates): Xstate (P, H, D) and ``(src,)``, or ``x`` itself and the previous
        token's coordinates.
        """
        self.stage_bc(m, tok, shared, cta)
        mXprev, prev = Xprev
        self.stage_coefficients(m, (m.x, tok.lane_t), lambda dg: mXprev[prev + (cta.h, dg)].to(Float32), tok, shared,
                                cta)

    @cute.jit
    def stage_bc(self, m: KernelArgs, tok: Token, shared: Shared, cta: Cta):
        """The token's B and C rows to ``tok.sB`` and ``sC``, fp32: as they are, or with rotary B~ and
        C~ (plus their biases, rotated by the token's angles in ``sCS``)."""
        hbc = 0 if const_expr(self.shared_bc) else cta.h  # B/C's head: one shared by the heads, or h
        if const_expr(self.rope_angles > 0):
            self.stage_rotated(m.B, m.B_bias, tok.lane_t, hbc, tok.sB, shared.sCS, cta)
            self.stage_rotated(m.C, m.C_bias, tok.lane_t, hbc, shared.sC, shared.sCS, cta)
        else:
            self.stage_kv_row(m.B, tok.lane_t, hbc, tok.sB, cta)
            self.stage_kv_row(m.C, tok.lane_t, hbc, shared.sC, cta)

    @cute.jit
    def stage_coefficients(self, m: KernelArgs, X: tuple, xprev: Callable, tok: Token, shared: Shared, cta: Cta):
        """The per-row coefficients of one token: for each tile row ``d`` and rank ``r``
        ``xr = x xproj`` (kept for the epilogue's skip term) and x itself to ``sXr``/``sX``,
        ``u = gamma xr`` and ``v = beta (xprev xproj)`` to ``sUV``, row-major
        ``(d, [u_0..u_R-1, v_0..v_R-1])`` so a thread reads a row's 2R coefficients with vector
        loads. ``X``: the token's x as (tensor, leading coordinates); ``xprev(dg)``: the previous
        token's x at head dim ``dg``, fp32."""
        mX, lead = X
        h = cta.h
        d0 = cta.dtile * self.tile_D

        def coefficients(i):  # i = d * R + r
            sX = shared.sX  # stored under a runtime `if`: a local name (see for_thread_indices)
            d = i // self.R
            r = i - d * self.R
            xp = m.xproj[r, h, d0 + d].to(Float32)
            xd = mX[lead + (h, d0 + d)].to(Float32)
            xr = xd * xp
            shared.sXr[r, d] = xr
            shared.sUV[d, r] = tok.gamma * xr
            shared.sUV[d, self.R + r] = tok.beta * (xprev(d0 + d) * xp)
            if r == 0:
                sX[d] = xd

        self.for_thread_indices(self.R * self.tile_D, cta.tidx, coefficients)

    @cute.jit
    def stage_kv_row(self, mT: cute.Tensor, lead: tuple, head: Int32, sT: cute.Tensor, cta: Cta):
        """``mT[lead][:, head, :]`` (R, N) in the kv dtype -> ``sT`` (R, N) fp32, element by element
        (``lead``: the leading coordinates: a pool row, or a lane and token). Scalar loads: for
        bf16 rows, unpacking a 16-byte vector to fp32 costs more instructions than the loads it
        saves (docs/performance.md)."""

        def stage(i):  # i = r * N + n
            r = i // self.N
            n = i - r * self.N
            sT[r, n] = mT[lead + (r, head, n)].to(Float32)

        self.for_thread_indices(self.R * self.N, cta.tidx, stage)

    @cute.jit
    def store_kv_state(self, m: KernelArgs, sB: cute.Tensor, sX: cute.Tensor, cta: Cta):
        """update_kv_state: this step's B (``sB``, (R, N) fp32) and x (``sX``, (tile_D,) fp32) ->
        row ``dst`` of Bstate/Xstate.

        The staged fp32 copies convert back exactly (B and Bstate share a dtype, as do x
        and Xstate). Each CTA stores its own Xstate elements; the Bstate row is the (lane,
        head)'s: with ``tile_D < D`` (a cluster, ``tiling.launch_cluster``) the first D-tile
        stores it, after the cluster barrier that orders it behind every D-tile's read of the
        old row (:meth:`run_tokens`, :meth:`token_step`).
        """

        def store_b(i):  # i = r * N + n
            r = i // self.N
            n = i - r * self.N
            m.Bstate[cta.dst, r, cta.h, n] = sB[r, n].to(self.kv_dtype)

        if const_expr(self.cluster is not None):
            if cta.dtile == 0:
                self.for_thread_indices(self.R * self.N, cta.tidx, store_b)
        else:
            self.for_thread_indices(self.R * self.N, cta.tidx, store_b)
        d0 = cta.dtile * self.tile_D

        def store_x(d):
            m.Xstate[cta.dst, cta.h, d0 + d] = sX[d].to(self.x_dtype)

        self.for_thread_indices(self.tile_D, cta.tidx, store_x)
