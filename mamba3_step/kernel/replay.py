"""Replay on the device (docs/design/replay.md): a row's checkpoint plus the ring of its committed
tokens since. A one-token step replays the ring in registers and appends its token (or flushes the
state at the flush length); a verify step replays the committed tokens, optionally flushes, and
steps the drafts, each written as an uncommitted ring entry. With ``replay_from_checkpoint`` an
append's output comes from the checkpoint (:mod:`.checkpoint`) and a verify step's drafts' outputs
too (:mod:`.drafts`).
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from ..tensors import KernelArgs
from .bundles import Cta, Shared, Token
from .ptx_ops import inline_ptx

__all__ = ["Replay"]


class Replay:
    """Replay steps on the loaded checkpoint (a mixin of the kernel class)."""

    @cute.jit
    def ring_count(self, m: KernelArgs, b: Int32, src: Int32, h: Int32, src_live: Boolean):
        """``(count, live)``: the committed ring tokens of (row ``src``, head ``h``), plus with
        ``num_accepted`` the drafts lane ``b`` commits now, and whether the lane is live. A length or
        an accepted count out of range (above ``ring_entries``: ``flush_length - 1`` for a one-token
        step, for a verify step ``flush_length - 1 + max(T, replay_draft)``), or a ring of fewer than
        ``ring_entries`` entries, makes the lane
        padding: every ring access stays inside ``ring_B``'s entries."""
        most = self.ring_entries
        count = Int32(-1)
        accepted = Int32(0)
        if src_live:
            count = m.ring_length[src, h]
            if const_expr(self.num_accepted):
                accepted = m.num_accepted_tokens[b]
        total = count + accepted
        live = src_live & (count >= 0) & (accepted >= 0) & (total >= 0) & (total <= most)
        return total, live & (m.ring_B.shape[1] >= most)

    @cute.jit
    def replay_tokens(self, m: KernelArgs, count: Int32, cta: Cta, shared: Shared, groups: list):
        """A replay step on the loaded checkpoint: a verify step (T > 1, :meth:`verify_state`);
        otherwise every step replays the state (:meth:`replay_state`), or with
        ``replay_from_checkpoint`` only a flush (``count = flush_length - 1``) does and an append's ``out``
        comes from the checkpoint and the ring (:meth:`append_from_checkpoint`)."""
        if const_expr(self.T > 1):
            self.verify_state(m, count, cta, shared, groups)
        elif const_expr(self.checkpoint_outputs):
            if self.flushes(count, cta):
                # the count passed on opaque: the tokens stay conditional, as in every other flush
                # (unconditional, the compiler interleaves them and spills at 4 warps)
                self.replay_state(m, inline_ptx(Int32, "mov.b32 $0, $1;", "=r,r", count), cta, shared, groups)
            else:
                self.append_from_checkpoint(m, count, cta, shared, groups)
        else:
            self.replay_state(m, count, cta, shared, groups)

    @cute.jit
    def flushes(self, count: Int32, cta: Cta) -> Boolean:
        """Whether a one-token step after ``count`` committed tokens writes the state: at ``flush_length - 1``
        (past it too when the step commits drafts), and whenever the destination is another row
        (that row gets the state after these tokens, the source keeps its checkpoint and ring)."""
        flush = count == self.flush_length - 1
        if const_expr(self.num_accepted):
            flush = count >= self.flush_length - 1  # committed drafts may carry the count past flush_length - 1
        if const_expr(self.has_dst):
            flush = flush | (cta.dst != cta.src)
        return flush

    @cute.jit
    def replay_state(self, m: KernelArgs, count: Int32, cta: Cta, shared: Shared, groups: list):
        """The ``count`` committed ring tokens replayed in registers (:meth:`ring_token`, no output,
        nothing stored), then this step's token (:meth:`live_token`). Token ``j`` stages its B in
        ``sBB[j % 2]``; Bstate, the token before the ring, is token -1's (``sBB[1]``)."""
        self.replay_committed(m, count, cta, shared, groups)
        self.live_token(m, count, cta, shared, groups)

    @cute.jit
    def replay_committed(self, m: KernelArgs, count: Int32, cta: Cta, shared: Shared, groups: list):
        """The ``count`` committed ring entries (at most ``ring_entries``) stepped on the state in registers,
        in order (:meth:`ring_token`); Bstate, the token before the ring, staged as token -1's B."""
        self.stage_kv_row(m.Bstate, (cta.src,), cta.h, shared.sBB[1, None, None], cta)
        for j in cutlass.range_constexpr(self.ring_entries):
            if j < count:
                cute.arch.barrier()  # token j - 1 is done with the shared buffers
                self.ring_token(m, j, cta, shared, groups)
        cute.arch.barrier()

    @cute.jit
    def ring_token(self, m: KernelArgs, j: int, cta: Cta, shared: Shared, groups: list):
        """Ring entry ``j`` of row ``src`` stepped on the state in registers: its B (stored per head),
        x, A, dt, trap staged as a token's, the previous x from entry ``j - 1`` (Xstate for the
        first); the state updated and rounded as a stepwise step stores it."""
        src, h = cta.src, cta.h
        tok = Token(j, None, shared.sBB[j % 2, None, None], shared.sBB[(j + 1) % 2, None, None],
                    *self.decay(m.ring_coef[src, j, h, 0], m.ring_coef[src, j, h, 1], m.ring_coef[src, j, h, 2]),
                    rng=self.ring_rng(m, j, cta) if const_expr(self.stochastic) else None)
        if const_expr(self.rope_angles > 0):  # B~ again: B, its bias, rotated by the entry's stored angle
            self.stored_angles(m.ring_angle, (src, j), shared, cta)
            cute.arch.barrier()
            self.stage_rotated(m.ring_B, m.B_bias, (src, j), h, tok.sB, shared.sCS, cta)
            if const_expr(j > 0 and self.kv_dtype is not Float32):  # entry j - 1's B~ as Bstate would hold it
                self.round_previous_b(tok.sBs, cta)
        else:
            self.stage_kv_row(m.ring_B, (src, j), h, tok.sB, cta)
        mXprev, prev = (m.Xstate, (src,)) if const_expr(j == 0) else (m.ring_x, (src, j - 1))
        self.stage_coefficients(m, (m.ring_x, (src, j)), lambda dg: mXprev[prev + (h, dg)].to(Float32), tok, shared,
                                cta)
        cute.arch.barrier()
        operands = self.load_operands(tok, shared, cta)
        for g in cutlass.range_constexpr(self.layout.row_groups):
            self.update_rows(groups[g], operands, tok, shared, cta)  # its output is not needed: y is dead code

    @cute.jit
    def rotary_token(self, m: KernelArgs, tok: Token, count: Int32, shared: Shared, cta: Cta, store: Callable):
        """With rotary, before a replay step's token is staged: its angles advanced from the row's
        current angle (:meth:`current_angle`; the previous draft's for ``tok.t > 0``) and stored by
        ``store(i, q)``; after a barrier, the previous token's B~ rounded as Bstate holds it (a
        no-op on Bstate itself)."""
        self.advance_angles(m, tok, shared, cta, start=lambda a: self.current_angle(m, count, cta, a), store=store)
        cute.arch.barrier()  # cos/sin of the new angles, for the B/C staging
        if const_expr(self.kv_dtype is not Float32):
            self.round_previous_b(tok.sBs, cta)

    @cute.jit
    def current_angle(self, m: KernelArgs, count: Int32, cta: Cta, a: Int32) -> Int64:
        """Angle ``a`` of row ``src`` after its ``count`` committed tokens: the last one's ring entry,
        or ``angle_state`` (the checkpoint's) with none."""
        q = Int64(0)
        if count > 0:
            q = m.ring_angle[cta.src, count - 1, cta.h, a]
        else:
            q = m.angle_state[cta.src, cta.h, a]
        return q

    @cute.jit
    def live_token(self, m: KernelArgs, count: Int32, cta: Cta, shared: Shared, groups: list):
        """This step's token after ``count`` ring tokens, stepped like a one-token step's, its ``out``
        written. A flush (:meth:`flushes`) stores the state, B and x to row ``dst`` and empties its
        ring; otherwise the token becomes ring entry ``count`` (:meth:`append_ring`) and the state
        row is not written."""
        src, h = cta.src, cta.h
        lane_t = (cta.b,)
        parity = count % 2
        tok = Token(0, lane_t, shared.sBB[parity, None, None], shared.sBB[1 - parity, None, None],
                    *self.decay_coefficients(m, lane_t, h),
                    rng=self.token_rng(cta.seed, 0) if const_expr(self.stochastic) else None)
        if const_expr(self.rope_angles > 0):
            def store_angle(a, q):  # a flush's angle is the new checkpoint's, an append's its entry's
                mAngle, mRingAngle = m.angle_state, m.ring_angle
                if cta.dst_live:
                    # the flush test again, not the one below: computed before the staging it stays
                    # live across it (the N32 D64 R2 bf16 destination form then used 8 bytes of stack)
                    if self.flushes(count, cta):
                        mAngle[cta.dst, h, a] = q
                    else:
                        mRingAngle[cta.dst, count, h, a] = q

            self.rotary_token(m, tok, count, shared, cta, store_angle)
        self.stage_bc(m, tok, shared, cta)

        def xprev(dg):  # the entry before this token, or Xstate with an empty ring: one load either way
            v = Float32(0.0)
            if count > 0:
                v = m.ring_x[src, count - 1, h, dg].to(Float32)
            else:
                v = m.Xstate[src, h, dg].to(Float32)
            return v

        self.stage_coefficients(m, (m.x, lane_t), xprev, tok, shared, cta)
        cute.arch.barrier()
        flush = self.flushes(count, cta)
        if cta.dst_live:
            if flush:
                self.store_kv_state(m, tok.sB, shared.sX, cta)
            else:
                self.append_ring(m, count, tok, shared, cta)
            if cta.tidx == 0:
                mLength = m.ring_length
                mLength[cta.dst, h] = cutlass.select_(flush, Int32(0), count + 1)
        operands = self.load_operands(tok, shared, cta)
        for g in cutlass.range_constexpr(self.layout.row_groups):
            tYrY = self.update_rows(groups[g], operands, tok, shared, cta)
            self.reduce_rows(tYrY, shared.sY, cta, g)
            if cta.dst_live & flush:
                self.store_state(groups[g], m, cta)
        cute.arch.barrier()
        self.epilogue(m, tok, shared, cta)

    @cute.jit
    def append_ring(self, m: KernelArgs, entry: Int32, tok: Token, shared: Shared, cta: Cta):
        """Token ``tok`` as ring entry ``entry`` of row ``dst``: its B per head and x (from their staged
        fp32 copies, which convert back exactly; with rotary B from global memory, as received: the
        staged copy is B~), and its A, dt, trap (thread 0); with stochastic rounding where it drew."""
        dst, h = cta.dst, cta.h
        hbc = 0 if const_expr(self.shared_bc) else h

        def store_b(i):  # i = r * N + n
            mRingB = m.ring_B  # stored under a runtime `if`: a local name (see for_thread_indices)
            r = i // self.N
            n = i - r * self.N
            if const_expr(self.rope_angles > 0):  # B as received (sB holds B~)
                mRingB[dst, entry, r, h, n] = m.B[tok.lane_t + (r, hbc, n)]
            else:
                mRingB[dst, entry, r, h, n] = tok.sB[r, n].to(self.kv_dtype)

        self.for_thread_indices(self.R * self.N, cta.tidx, store_b)
        d0 = cta.dtile * self.tile_D

        def store_x(d):
            mRingX = m.ring_x
            mRingX[dst, entry, h, d0 + d] = shared.sX[d].to(self.x_dtype)

        self.for_thread_indices(self.tile_D, cta.tidx, store_x)
        if cta.tidx == 0:
            mCoef = m.ring_coef
            mCoef[dst, entry, h, 0] = m.A[tok.lane_t + (h,)]
            mCoef[dst, entry, h, 1] = m.dt[tok.lane_t + (h,)]
            mCoef[dst, entry, h, 2] = m.trap[tok.lane_t + (h,)]
            if const_expr(self.stochastic):  # where the token drew: its offset, the row its state goes to
                mOffset, mDrawnFor = m.ring_offset, m.ring_drawn_for
                mOffset[dst, entry, h] = cta.seed[1] + Int64(tok.t)
                mDrawnFor[dst, entry, h] = dst

    @cute.jit
    def verify_state(self, m: KernelArgs, count: Int32, cta: Cta, shared: Shared, groups: list):
        """A verify step: the ``count`` committed ring tokens replayed in registers
        (:meth:`ring_token`); with ``count >= flush_length`` a flush (:meth:`store_checkpoint`). Then the T
        drafts (:meth:`draft_token`), each writing its ``out`` and its uncommitted ring entry after
        the committed ones. The ring's length becomes the committed count (0 after a flush): a draft
        the next step does not accept is never replayed. With ``replay_from_checkpoint`` only a flush
        replays, and the drafts' outputs come from the checkpoint (the flush's, or the row's) and the
        ring tokens since by the algebra (:meth:`drafts_from_checkpoint`): no draft is stepped."""
        flush = count >= self.flush_length
        if const_expr(self.checkpoint_draft_outputs):
            if flush:  # the count passed on opaque: the tokens stay conditional (see replay_tokens)
                self.replay_committed(m, inline_ptx(Int32, "mov.b32 $0, $1;", "=r,r", count), cta, shared, groups)
                self.store_checkpoint(m, count, flush, cta, shared, groups)
        else:
            self.replay_committed(m, count, cta, shared, groups)
            self.store_checkpoint(m, count, flush, cta, shared, groups)
        first = cutlass.select_(flush, Int32(0), count)  # the drafts' first ring entry
        if const_expr(self.checkpoint_draft_outputs):
            self.drafts_from_checkpoint(m, count, first, cta, shared, groups)
        else:
            for i in cutlass.range_constexpr(self.T):
                cute.arch.barrier()  # the flush's stores, or draft i - 1, are done with the shared buffers
                self.draft_token(m, i, count, first, cta, shared, groups)
        if cta.dst_live:
            if cta.tidx == 0:
                mLength = m.ring_length
                mLength[cta.dst, cta.h] = first

    @cute.jit
    def store_checkpoint(self, m: KernelArgs, count: Int32, flush: Boolean, cta: Cta, shared: Shared, groups: list):
        """A verify step's flush (``flush``): the replayed state, and the last committed token's B
        and x as Bstate/Xstate, stored to the row as its new checkpoint (with rotary its angle)."""
        if cta.dst_live & flush:
            for g in cutlass.range_constexpr(self.layout.row_groups):
                self.store_state(groups[g], m, cta)
            self.store_kv_state(m, shared.sBB[(count + 1) % 2, None, None], shared.sX, cta)
            if const_expr(self.rope_angles > 0):  # the checkpoint's angle: the last committed entry's
                self.for_thread_indices(self.rope_angles, cta.tidx, lambda a: self.store_angle_state(m, count, cta, a))

    @cute.jit
    def store_angle_state(self, m: KernelArgs, count: Int32, cta: Cta, a: Int32):
        """A verify step's flush: angle ``a`` of the last committed entry to ``angle_state[dst]``."""
        mAngle = m.angle_state
        mAngle[cta.dst, cta.h, a] = m.ring_angle[cta.src, count - 1, cta.h, a]

    @cute.jit
    def draft_token(self, m: KernelArgs, i: int, count: Int32, first: Int32, cta: Cta, shared: Shared,
                    groups: list):
        """Draft ``i`` of a verify step, stepped on the state in registers after the ``count``
        committed tokens and drafts ``0 .. i - 1``; its ``out`` written, its B, x and coefficients
        stored as ring entry ``first + i`` (uncommitted), the state row not written."""
        h = cta.h
        lane_t = (cta.b, i)
        parity = (count + i) % 2
        tok = Token(i, lane_t, shared.sBB[parity, None, None], shared.sBB[1 - parity, None, None],
                    *self.decay_coefficients(m, lane_t, h),
                    rng=self.token_rng(cta.seed, i) if const_expr(self.stochastic) else None)
        if const_expr(self.rope_angles > 0):
            def store_angle(a, q):  # the draft's angle goes with its ring entry, uncommitted
                mRingAngle = m.ring_angle
                if cta.dst_live:
                    mRingAngle[cta.dst, first + i, h, a] = q

            self.rotary_token(m, tok, count, shared, cta, store_angle)
        self.stage_bc(m, tok, shared, cta)
        if const_expr(i == 0):
            self.stage_coefficients(m, (m.x, lane_t), lambda dg: self.x_before_drafts(m, count, cta, dg), tok,
                                    shared, cta)
        else:
            self.stage_coefficients(m, (m.x, lane_t), lambda dg: m.x[cta.b, i - 1, h, dg].to(Float32), tok, shared,
                                    cta)
        cute.arch.barrier()
        if cta.dst_live:
            self.append_ring(m, first + i, tok, shared, cta)
        operands = self.load_operands(tok, shared, cta)
        for g in cutlass.range_constexpr(self.layout.row_groups):
            tYrY = self.update_rows(groups[g], operands, tok, shared, cta)
            self.reduce_rows(tYrY, shared.sY, cta, g)
        cute.arch.barrier()
        self.epilogue(m, tok, shared, cta)

    @cute.jit
    def x_before_drafts(self, m: KernelArgs, count: Int32, cta: Cta, dg: Int32) -> Float32:
        """The x of the token before this step's first: the last committed ring entry's, or Xstate's
        with none (one load either way)."""
        v = Float32(0.0)
        if count > 0:
            v = m.ring_x[cta.src, count - 1, cta.h, dg].to(Float32)
        else:
            v = m.Xstate[cta.src, cta.h, dg].to(Float32)
        return v
