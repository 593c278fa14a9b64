"""The CuteDSL Mamba-3 MIMO decode-step kernel: the kernel class and its compile function.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size,
R MIMO rank. In dense mode the "pool" tensors have B rows and lane b uses row b.

Grid ``(B, H, D / tile_D)``; one CTA owns one (lane, head, D-tile) slab of the state. The
device work is split into small ``@cute.jit`` stages (thread layout: :mod:`mamba3_step.tiling`):

1. :meth:`Mamba3StepKernel.select_rows`     lane -> (src, dst, src_live, dst_live); padding
                                             lanes go straight to :meth:`zero_out`
2. :meth:`Mamba3StepKernel.load_state`      the thread's rows of the slab, 16-byte loads, issued
                                             first (rows in the lane order of step 6)
3. :meth:`Mamba3StepKernel.stage_operands`  B, Bstate, C -> (R, N) fp32 in shared memory, and per
                                             tile row the coefficients u_r = gamma x xproj_r,
                                             v_r = beta Xstate xproj_r, and x xproj_r
4. :meth:`Mamba3StepKernel.store_kv_state`  update_kv_state: staged B / x -> Bstate / Xstate[dst]
5. :meth:`Mamba3StepKernel.update_rows`     new state in registers, and the thread's partial
                                             y[r, d] over its own columns
6. :meth:`Mamba3StepKernel.reduce_rows`     partials completed over the row's lanes by a
                                             transposed butterfly -> sY (R, tile_D)
7. :meth:`Mamba3StepKernel.store_state`     16-byte stores of the new state to row dst
8. :meth:`Mamba3StepKernel.epilogue`        y + D x xproj, z gate, outproj -> out

A T-token specialisation (speculative decoding) loads the slab once (2) and runs 3-8 once per
token, :meth:`Mamba3StepKernel.token_step`, in a loop unrolled at trace time: the state stays
in registers between tokens, the previous token's B stays in the other half of a two-parity
shared buffer and its x is re-read from ``x``; the state (and B/x) is stored after every token
with a (B, T) destination, else once after the last.

Without a GPU the compiled kernel is verified by executing its PTX on the CPU
(:mod:`mamba3_step.ptx_tier`, docs/ptx-tier.md).

Where this module sits (docs/design.md, "Architecture"): it imports cutlass, so only the build
layer (:mod:`mamba3_step.build`) imports it, on the first compile. Launching goes through
:mod:`mamba3_step.launch` and the compile cache, which never import this module; the runtime
argument order (:func:`kernel_arguments`) lives, free of cutlass, in :mod:`mamba3_step.tensors`.
Whatever this module imports from the package is part of the disk cache's key
(:func:`mamba3_step.build.kernel_sources`).

Length: over the ~450-line guide because the kernel class is one unit (its stages in launch
order); splitting it across files would hide that order.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm

from .contract import DTYPES
from .spec import StepSpec
from .tensors import kernel_arguments  # noqa: F401  (the runtime argument order; see its docstring)
from .tiling import launch_grid, thread_layout, tiling_problem

__all__ = ["CUTLASS_DTYPES", "Mamba3StepKernel", "argument_masks", "compile_step_kernel", "fake_arguments",
           "kernel_arguments"]

#: the contract's dtype table, as CuteDSL types
CUTLASS_DTYPES = {name: getattr(cutlass, d.cutlass) for name, d in DTYPES.items()}


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


class Mamba3StepKernel:
    """One specialisation of the step kernel (see :class:`~mamba3_step.spec.StepSpec`)."""

    def __init__(self, spec: StepSpec):
        problem = tiling_problem(spec)
        assert problem is None, problem  # the wrapper validated user input already
        self.spec = spec
        self.N = spec.dstate
        self.D = spec.headdim
        self.R = spec.mimo
        self.tile_D = spec.tile_D
        lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo, spec.tokens)
        self.layout = lay
        self.num_threads = lay.num_threads
        self.state_dtype = CUTLASS_DTYPES[spec.state_dtype]
        self.kv_dtype = CUTLASS_DTYPES[spec.kv_dtype]
        self.x_dtype = CUTLASS_DTYPES[spec.x_dtype]
        self.proj_dtype = CUTLASS_DTYPES[spec.proj_dtype]
        self.pool = spec.pool
        self.has_dst = spec.has_dst
        self.update_kv_state = spec.update_kv_state
        self.has_z = spec.has_z
        self.has_outproj = spec.has_outproj
        self.has_state_out = spec.has_state_out
        self.T = spec.tokens
        self.dst_per_token = spec.dst_per_token
        self.num_accepted = spec.num_accepted
        self.group_rows = lay.rows_per_pass * lay.rows_per_group  # tile rows in one row group
        self.reduce_plan, self.reduce_plain_mask = reduction_plan(lay.partials_per_group, lay.TPR)
        #: row stride of the coefficients in shared memory (words): 16-byte rows, padded so that the
        #: rows a warp's lanes read at once (rows_per_pass apart) fall in different banks
        self.uv_stride = -(-2 * self.R // 4) * 4
        if (self.uv_stride * lay.rows_per_pass) % 32 == 0:
            self.uv_stride += 4
        #: lanes sharing one row of the epilogue (each takes R / split ranks)
        self.epilogue_split = max(1, min(self.R, lay.num_threads // self.tile_D, 32))
        self.epilogue_masks = [1 << k for k in reversed(range(self.epilogue_split.bit_length() - 1))]

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mState: cute.Tensor,  # (P, H, D, N) state dtype, updated in place (pool: P rows; dense: B rows)
        mBstate: cute.Tensor,  # (P, R, H, N) kv dtype
        mXstate: cute.Tensor,  # (P, H, D) x dtype
        mA: cute.Tensor,  # (B[, T], H) fp32; the token axis T only when tokens > 1
        mB: cute.Tensor,  # (B[, T], R, H, N) kv dtype
        mC: cute.Tensor,  # (B[, T], R, H, N) kv dtype
        mDskip: cute.Tensor,  # (H,) fp32, the contract's D (skip) parameter
        mX: cute.Tensor,  # (B[, T], H, D) x dtype
        mDt: cute.Tensor,  # (B[, T], H) fp32
        mTrap: cute.Tensor,  # (B[, T], H) fp32
        mXproj: cute.Tensor,  # (R, H, D) proj dtype
        mZproj: Optional[cute.Tensor],  # (R, H, D) proj dtype, with z
        mOutproj: Optional[cute.Tensor],  # (R, H, D) proj dtype
        mZ: Optional[cute.Tensor],  # (B[, T], H, D) x dtype
        mOut: cute.Tensor,  # (B[, T], H, D) with outproj else (B[, T], R, H, D), x dtype
        mStateOut: Optional[cute.Tensor],  # (B, H, D, N) dense mode only
        mSrcIdx: Optional[cute.Tensor],  # (B,) int32 pool mode; (B, K) with num_accepted
        mDstIdx: Optional[cute.Tensor],  # (B,) int32 separate destination; (B, T) per token
        mNumAccepted: Optional[cute.Tensor],  # (B,) int32, with num_accepted
        null_slot: Int32,  # pool rows equal to this are padding (pass -1 for none)
        stream,
    ):
        self.kernel(
            mState, mBstate, mXstate, mA, mB, mC, mDskip, mX, mDt, mTrap, mXproj, mZproj,
            mOutproj, mZ, mOut, mStateOut, mSrcIdx, mDstIdx, mNumAccepted, null_slot,
        ).launch(
            grid=launch_grid(mX.shape[0], mXproj.shape[1], self.D, self.tile_D),
            block=(self.num_threads, 1, 1),
            stream=stream,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mState: cute.Tensor,  # (P, H, D, N)
        mBstate: cute.Tensor,  # (P, R, H, N)
        mXstate: cute.Tensor,  # (P, H, D)
        mA: cute.Tensor,  # (B[, T], H)
        mB: cute.Tensor,  # (B[, T], R, H, N)
        mC: cute.Tensor,  # (B[, T], R, H, N)
        mDskip: cute.Tensor,  # (H,)
        mX: cute.Tensor,  # (B[, T], H, D)
        mDt: cute.Tensor,  # (B[, T], H)
        mTrap: cute.Tensor,  # (B[, T], H)
        mXproj: cute.Tensor,  # (R, H, D)
        mZproj: Optional[cute.Tensor],  # (R, H, D)
        mOutproj: Optional[cute.Tensor],  # (R, H, D)
        mZ: Optional[cute.Tensor],  # (B[, T], H, D)
        mOut: cute.Tensor,  # (B[, T], H, D) or (B[, T], R, H, D)
        mStateOut: Optional[cute.Tensor],  # (B, H, D, N)
        mSrcIdx: Optional[cute.Tensor],  # (B,) or (B, K)
        mDstIdx: Optional[cute.Tensor],  # (B,) or (B, T)
        mNumAccepted: Optional[cute.Tensor],  # (B,)
        null_slot: Int32,
    ):
        """Length: one CTA's whole life, in launch order (select rows; load the slab; the tokens;
        the final stores); each step is a stage below."""
        tidx, _, _ = cute.arch.thread_idx()
        b, h, dtile = cute.arch.block_idx()

        src, dst, src_live, dst_live = self.select_rows(mSrcIdx, mDstIdx, mNumAccepted, null_slot,
                                                        mState.shape[0], b)
        if src_live:
            smem = cutlass.memory.SmemAllocator()
            rn = cute.make_layout((self.R, self.N), stride=(self.N, 1))
            rd = cute.make_layout((self.R, self.tile_D), stride=(self.tile_D, 1))
            sBB = smem.allocate_tensor(  # (2, R, N): this token's B and the previous one, by parity
                Float32, cute.make_layout((2, self.R, self.N), stride=(self.R * self.N, self.N, 1)), 16)
            sC = smem.allocate_tensor(Float32, rn, 16)  # (R, N)
            sX = smem.allocate_tensor(Float32, cute.make_layout(self.tile_D), 16)  # (tile_D,) x
            sXr = smem.allocate_tensor(Float32, rd, 16)  # (R, tile_D) x * xproj
            sUV = smem.allocate_tensor(  # (tile_D, 2R) row coefficients u_r = gamma xr, v_r = beta xsr
                Float32, cute.make_layout((self.tile_D, 2 * self.R), stride=(self.uv_stride, 1)), 16)
            sY = smem.allocate_tensor(Float32, rd, 16)  # (R, tile_D) sum_n new * C
            shared = (sBB, sC, sX, sXr, sUV, sY)

            # Issue every state load first: they are the bytes that matter.
            lane = tidx % self.layout.TPR
            phi = self.lane_permutation(lane)
            frags = []  # (state registers, tile rows) per row group, loaded up front with preload
            for g in cutlass.range_constexpr(self.layout.row_groups if self.layout.preload else 1):
                rows = self.thread_rows(tidx, phi, g)
                frags.append((self.load_state(mState, src, h, dtile, rows, lane), rows))
            target = mState
            if const_expr(self.has_state_out):
                target = mStateOut
            # the state is stored after each token only when every token has its own row
            store_each = self.T == 1 or self.dst_per_token

            # the previous B and x of token 0: the Bstate/Xstate rows
            self.token_step(0, (mBstate, (src,)), (mXstate, (src,)), mState, mBstate, mXstate, mA, mB, mC,
                            mDskip, mX, mDt, mTrap, mXproj, mZproj, mOutproj, mZ, mOut, target, mDstIdx, null_slot,
                            shared, frags, src, dst, src_live, dst_live, store_each, b, h, dtile, tidx, lane, phi)
            if const_expr(self.T > 1):
                # Unrolled: a runtime token loop kept so many values live that R = 8 kernels spilled;
                # unrolled, every buffer parity and token offset is static (code grows with T).
                for t in cutlass.range_constexpr(1, self.T):
                    cute.arch.barrier()  # token t - 1 is done with the shared buffers
                    self.token_step(t, None, (mX, self.lane_index(b, t - 1)), mState, mBstate, mXstate, mA, mB,
                                    mC, mDskip, mX, mDt, mTrap, mXproj, mZproj, mOutproj, mZ, mOut, target, mDstIdx,
                                    null_slot, shared, frags, src, dst, src_live, dst_live, store_each, b, h, dtile,
                                    tidx, lane, phi)
                if const_expr(not store_each):  # the final state, and the last token's B/x, to row dst
                    if dst_live:
                        for g in cutlass.range_constexpr(self.layout.row_groups):
                            self.store_state(frags[g][0], target, dst, h, dtile, frags[g][1], lane)
                        if const_expr(self.update_kv_state):
                            self.store_kv_state(mBstate, mXstate, sBB[(self.T - 1) % 2, None, None], sX, dst, h,
                                                dtile, tidx)
        else:
            for t in cutlass.range_constexpr(self.T):
                self.zero_out(mOut, self.lane_index(b, t), h, dtile, tidx, self.num_threads)

    @cute.jit
    def token_step(self, t, Bprev: Optional[tuple], Xprev: tuple, mState: cute.Tensor,
                   mBstate: cute.Tensor, mXstate: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
                   mDskip: cute.Tensor, mX: cute.Tensor, mDt: cute.Tensor, mTrap: cute.Tensor, mXproj: cute.Tensor,
                   mZproj: Optional[cute.Tensor], mOutproj: Optional[cute.Tensor], mZ: Optional[cute.Tensor],
                   mOut: cute.Tensor, target: cute.Tensor, mDstIdx: Optional[cute.Tensor], null_slot: Int32,
                   shared: tuple, frags: list, src: Int32, dst: Int32, src_live: Boolean, dst_live: Boolean,
                   store_each: bool, b: Int32, h: Int32, dtile: Int32, tidx: Int32, lane: Int32, phi: Int32):
        """Token ``t`` (a compile-time index): stage its operands, update the state in registers,
        reduce y, write its ``out``; store the state (and B/x) when each token has its row.

        ``Bprev``/``Xprev``: (tensor, leading coordinates) of the previous B (R, H, N) and x (H, D):
        the Bstate/Xstate rows for token 0; for t > 0 the previous B is already in shared memory
        (the other half of ``sBB``, staged by token t - 1: ``Bprev`` None) and ``Xprev`` is token
        t - 1's x.
        """
        sBB, sC, sX, sXr, sUV, sY = shared
        sB = sBB[t % 2, None, None]  # (R, N) this token's B
        sBs = sBB[(t + 1) % 2, None, None]  # (R, N) the previous B
        lane_t = self.lane_index(b, t)
        alpha, beta, gamma = self.decay_coefficients(mA, mDt, mTrap, lane_t, h)
        if const_expr(Bprev is not None):
            self.stage_kv_row(Bprev[0], Bprev[1], h, sBs, tidx)
        self.stage_operands(mB, mC, mX, lane_t, Xprev[0], Xprev[1], mXproj, sB, sC, sX, sXr, sUV, beta, gamma, h,
                            dtile, tidx)
        cute.arch.barrier()
        # Every read of the old Bstate/Xstate rows happened before the barrier.
        if const_expr(self.dst_per_token):
            dst = mDstIdx[b, t]
            dst_live = src_live & self.row_is_live(dst, mState.shape[0], null_slot)
        if const_expr(self.update_kv_state and store_each):
            if dst_live:
                self.store_kv_state(mBstate, mXstate, sB, sX, dst, h, dtile, tidx)
        tOrB, tOrBs, tOrC = self.load_operands(sB, sBs, sC, lane, phi)
        for g in cutlass.range_constexpr(self.layout.row_groups):
            if const_expr(g >= len(frags)):  # without preload: this group's loads now
                rows = self.thread_rows(tidx, phi, g)
                frags.append((self.load_state(mState, src, h, dtile, rows, lane), rows))
            tSrS, rows = frags[g]
            part = self.update_rows(tSrS, rows, tOrB, tOrBs, tOrC, sB, sBs, sC, sUV, alpha, lane, phi)
            self.reduce_rows(part, sY, tidx, phi, g)
            if const_expr(store_each):
                if dst_live:
                    self.store_state(tSrS, target, dst, h, dtile, rows, lane)
        cute.arch.barrier()
        self.epilogue(sY, sXr, mDskip, mZ, mZproj, mOutproj, mOut, lane_t, h, dtile, tidx, self.num_threads)

    def lane_index(self, b: Int32, t) -> tuple:
        """The leading coordinates of lane ``b``, token ``t`` in a per-lane tensor: ``(b,)`` when the
        specialisation has one token (no token axis), else ``(b, t)``."""
        return (b,) if self.T == 1 else (b, t)

    # ------------------------------------------------------------------ stages
    @cute.jit
    def select_rows(self, mSrcIdx: Optional[cute.Tensor], mDstIdx: Optional[cute.Tensor],
                    mNumAccepted: Optional[cute.Tensor], null_slot: Int32, num_rows: Int32, b: Int32):
        """Lane ``b`` -> ``(src, dst, src_live, dst_live)``.

        Dense mode: row b, always live. Pool mode: ``src = state_batch_indices[b]``, or with
        num_accepted ``state_batch_indices[b, num_accepted_tokens[b] - 1]`` (a count outside
        [1, K] makes the lane padding, and nothing outside the index tensor is read); a row is
        padding when negative, ``>= num_rows`` (P) or equal to ``null_slot``. ``dst`` defaults
        to ``src``; ``dst_live`` requires a live src too. With a destination per token, ``dst``
        here is unused (each token reads its own).
        """
        src = Int32(b)
        dst = Int32(b)
        src_live = Boolean(True)
        dst_live = Boolean(True)
        if const_expr(self.pool):
            if const_expr(self.num_accepted):
                k = mNumAccepted[b] - 1
                src = Int32(-1)
                if (k >= 0) & (k < mSrcIdx.shape[1]):
                    src = mSrcIdx[b, k]
            else:
                src = mSrcIdx[b]
            src_live = self.row_is_live(src, num_rows, null_slot)
            dst = src
            dst_live = src_live
            if const_expr(self.has_dst and not self.dst_per_token):
                dst = mDstIdx[b]
                dst_live = src_live & self.row_is_live(dst, num_rows, null_slot)
        return src, dst, src_live, dst_live

    @cute.jit
    def row_is_live(self, row: Int32, num_rows: Int32, null_slot: Int32) -> Boolean:
        return (row >= 0) & (row < num_rows) & (row != null_slot)

    @cute.jit
    def decay_coefficients(self, mA: cute.Tensor, mDt: cute.Tensor, mTrap: cute.Tensor, lane_t: tuple, h: Int32):
        """``alpha = exp(A dt)``, ``beta = (1 - trap) dt alpha``, ``gamma = trap dt`` (fp32) of one
        (lane, token) (``lane_t``: its leading coordinates, :meth:`lane_index`)."""
        dt = mDt[lane_t + (h,)]
        trap = mTrap[lane_t + (h,)]
        alpha = cute.math.exp(mA[lane_t + (h,)] * dt)
        beta = (Float32(1.0) - trap) * dt * alpha
        gamma = trap * dt
        return alpha, beta, gamma

    @cute.jit
    def lane_permutation(self, lane: Int32) -> Int32:
        """``phi``: which of a row group's ``rows x R`` partial sums this lane keeps at each
        halving round of :meth:`reduce_rows`, as a permutation of slot indices (slot ``k``
        of the lane holds partial ``k ^ phi``). Built from the lane bits the rounds use, so
        every lane always keeps its *first* half and no selects are needed."""
        lay = self.layout
        K = lay.partials_per_group
        if const_expr(K <= lay.TPR):
            return (lane >> (lay.TPR.bit_length() - K.bit_length())) & (K - 1)
        return (lane << (K.bit_length() - lay.TPR.bit_length())) & (K - 1)

    @cute.jit
    def thread_rows(self, tidx: Int32, phi: Int32, g: int) -> list:
        """Tile rows of the thread's ``rows_per_group`` registers rows in group ``g``.

        Thread ``t`` owns rows ``t // TPR + j * rows_per_pass`` (``j`` over the group); its
        register row ``i`` holds ``j = i ^ (phi >> log2 R)``, the lane-dependent order the
        reduction wants. A row's TPR lanes together still cover it exactly once, and each
        lane's vectors stay 16-byte accesses.
        """
        lay = self.layout
        rho = phi >> (self.R.bit_length() - 1)
        base = g * self.group_rows + tidx // lay.TPR
        rows = []
        for i in cutlass.range_constexpr(lay.rows_per_group):
            rows.append(base + (rho ^ i) * lay.rows_per_pass)
        return rows

    @cute.jit
    def state_vector(self, mState: cute.Tensor, row: Int32, h: Int32, dtile: Int32, d: Int32, c: int,
                     lane: Int32) -> cute.Tensor:
        """The ``(VN,)`` 16-byte vector ``c`` of tile row ``d`` a lane moves: elements
        ``(c * TPR + lane) * VN ...`` of ``mState[row, h, dtile * tile_D + d]``."""
        gS = mState[row, h, None, None]  # (D, N); 64-bit offsets (64-bit strides)
        gT = cute.local_tile(gS, (self.tile_D, self.N), (dtile, 0))  # (tile_D, N)
        return cute.local_tile(gT[d, None], (self.layout.VN,), (c * self.layout.TPR + lane,))

    @cute.jit
    def load_state(self, mState: cute.Tensor, row: Int32, h: Int32, dtile: Int32, rows: list,
                   lane: Int32) -> cute.Tensor:
        """16-byte loads of the thread's rows ``rows`` of pool row ``row``: ``(VN, rows_per_group,
        CPT)`` registers in the state dtype."""
        lay = self.layout
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.state_dtype, num_bits_per_copy=128)
        frag = cute.make_rmem_tensor(
            cute.make_layout((lay.VN, lay.rows_per_group, lay.CPT), stride=(1, lay.VN, lay.VN * lay.rows_per_group)),
            self.state_dtype)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            for c in cutlass.range_constexpr(lay.CPT):
                cute.copy(atom, self.state_vector(mState, row, h, dtile, rows[i], c, lane), frag[None, i, c])
        return frag

    @cute.jit
    def store_state(self, frag: cute.Tensor, mTarget: cute.Tensor, row: Int32, h: Int32, dtile: Int32,
                    rows: list, lane: Int32):
        """16-byte stores of the thread's new state (``frag``, rows ``rows``) to row ``row`` of
        ``mTarget`` (the pool, or ``state_out`` in dense mode)."""
        lay = self.layout
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.state_dtype, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            for c in cutlass.range_constexpr(lay.CPT):
                cute.copy(atom, frag[None, i, c], self.state_vector(mTarget, row, h, dtile, rows[i], c, lane))

    @cute.jit
    def stage_operands(
        self,
        mB: cute.Tensor,  # (B[, T], R, H, N)
        mC: cute.Tensor,  # (B[, T], R, H, N)
        mX: cute.Tensor,  # (B[, T], H, D)
        lane_t: tuple,  # this (lane, token)'s leading coordinates in mB, mC, mX
        mXprev: cute.Tensor,  # the previous x: Xstate (P, H, D), or x itself (the previous token)
        prev: tuple,  # the previous x's leading coordinates in mXprev
        mXproj: cute.Tensor,  # (R, H, D)
        sB: cute.Tensor,  # (R, N) fp32 out
        sC: cute.Tensor,  # (R, N) fp32 out
        sX: cute.Tensor,  # (tile_D,) fp32 out: x
        sXr: cute.Tensor,  # (R, tile_D) fp32 out: x * xproj
        sUV: cute.Tensor,  # (tile_D, 2R) fp32 out: gamma * xr, beta * xprev * xproj
        beta: Float32,
        gamma: Float32,
        h: Int32,
        dtile: Int32,
        tidx: Int32,
    ):
        """Thread ``tidx``'s share of one token's per-(lane, head) operands, converted to fp32.

        B and C rows go to shared memory as they are; for each tile row ``d`` and rank ``r`` the
        coefficients of the state update are computed once per CTA: ``xr = x xproj`` (kept for
        the epilogue's skip term), ``u = gamma xr`` and ``v = beta (xprev xproj)``, stored
        row-major ``(d, [u_0..u_R-1, v_0..v_R-1])`` so a thread reads a row's 2R coefficients
        with vector loads.
        """
        self.stage_kv_row(mB, lane_t, h, sB, tidx)
        self.stage_kv_row(mC, lane_t, h, sC, tidx)
        RT = self.R * self.tile_D
        d0 = dtile * self.tile_D
        for k in cutlass.range_constexpr((RT + self.num_threads - 1) // self.num_threads):
            i = tidx + k * self.num_threads
            if i < RT:
                d = i // self.R
                r = i - d * self.R
                xp = mXproj[r, h, d0 + d].to(Float32)
                xd = mX[lane_t + (h, d0 + d)].to(Float32)
                xr = xd * xp
                sXr[r, d] = xr
                sUV[d, r] = gamma * xr
                sUV[d, self.R + r] = beta * (mXprev[prev + (h, d0 + d)].to(Float32) * xp)
                if r == 0:
                    sX[d] = xd

    @cute.jit
    def stage_kv_row(self, mT: cute.Tensor, lead: tuple, h: Int32, sT: cute.Tensor, tidx: Int32):
        """``mT[lead][:, h, :]`` (R, N) in the kv dtype -> ``sT`` (R, N) fp32, element by element
        (``lead``: the leading coordinates: a pool row, or a lane and token).

        (16-byte loads of the bf16 rows were tried: the bf16 -> fp32 unpacking of a vector
        costs more instructions than the scalar loads it saves, docs/performance.md.)"""
        RN = self.R * self.N
        for k in cutlass.range_constexpr((RN + self.num_threads - 1) // self.num_threads):
            i = tidx + k * self.num_threads
            if i < RN:
                r = i // self.N
                n = i - r * self.N
                sT[r, n] = mT[lead + (r, h, n)].to(Float32)

    @cute.jit
    def store_kv_state(
        self,
        mBstate: cute.Tensor,  # (P, R, H, N)
        mXstate: cute.Tensor,  # (P, H, D)
        sB: cute.Tensor,  # (R, N) fp32, this step's B
        sX: cute.Tensor,  # (tile_D,) fp32, this step's x
        dst: Int32,
        h: Int32,
        dtile: Int32,
        tidx: Int32,
    ):
        """update_kv_state: this step's B/x -> row ``dst`` of Bstate/Xstate.

        The staged fp32 copies convert back exactly (B and Bstate share a dtype, as do x
        and Xstate). Only race-free when this CTA is the only one of its (lane, head):
        ``tile_D >= D``, checked by the wrapper.
        """
        RN = self.R * self.N
        for k in cutlass.range_constexpr((RN + self.num_threads - 1) // self.num_threads):
            i = tidx + k * self.num_threads
            if i < RN:
                r = i // self.N
                n = i - r * self.N
                mBstate[dst, r, h, n] = sB[r, n].to(self.kv_dtype)
        d0 = dtile * self.tile_D
        for k in cutlass.range_constexpr((self.tile_D + self.num_threads - 1) // self.num_threads):
            d = tidx + k * self.num_threads
            if d < self.tile_D:
                mXstate[dst, h, d0 + d] = sX[d].to(self.x_dtype)

    def column(self, c: int, e: int, lane: Int32) -> Int32:
        """State column of element ``e`` of the lane's vector ``c`` (the same in every row)."""
        return (c * self.layout.TPR + lane) * self.layout.VN + e

    @cute.jit
    def load_operands(self, sB: cute.Tensor, sBs: cute.Tensor, sC: cute.Tensor, lane: Int32, phi: Int32):
        """The B, Bstate and C values of the lane's columns, ``(R, VN, CPT)`` fp32 each, read
        once from shared memory when they fit in registers (``cache_operands``), else None
        (then :meth:`update_rows` reads them per row). C is read in the lane's rank order:
        slot ``r`` holds rank ``r ^ (phi & (R - 1))`` (see :meth:`lane_permutation`)."""
        lay = self.layout
        if const_expr(not lay.cache_operands):
            return None, None, None
        shape = cute.make_layout((self.R, lay.VN, lay.CPT), stride=(lay.VN * lay.CPT, 1, lay.VN))
        tOrB = cute.make_rmem_tensor(shape, Float32)
        tOrBs = cute.make_rmem_tensor(shape, Float32)
        tOrC = cute.make_rmem_tensor(shape, Float32)
        sigma = phi & (self.R - 1)
        for r in cutlass.range_constexpr(self.R):
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    n = self.column(c, e, lane)
                    tOrB[r, e, c] = sB[r, n]
                    tOrBs[r, e, c] = sBs[r, n]
                    tOrC[r, e, c] = sC[r ^ sigma, n]
        return tOrB, tOrBs, tOrC

    @cute.jit
    def update_rows(
        self,
        tSrS: cute.Tensor,  # (VN, rows_per_group, CPT) state dtype, registers: in -> out
        rows: list,  # tile row of each register row
        tOrB: Optional[cute.Tensor],  # (R, VN, CPT) fp32 registers, or None (read sB per row)
        tOrBs: Optional[cute.Tensor],  # (R, VN, CPT)
        tOrC: Optional[cute.Tensor],  # (R, VN, CPT), ranks in the lane's order
        sB: cute.Tensor,  # (R, N) fp32
        sBs: cute.Tensor,  # (R, N) fp32
        sC: cute.Tensor,  # (R, N) fp32
        sUV: cute.Tensor,  # (tile_D, 2R) fp32 row coefficients
        alpha: Float32,
        lane: Int32,
        phi: Int32,
    ) -> cute.Tensor:
        """Per-thread state update of one row group (the math of docs/contract.md, fp32).

        ``new[d, n] = alpha s[d, n] + sum_r u_r[d] B[r, n] + v_r[d] Bs[r, n]`` (summed in r
        order) is written back into ``tSrS`` rounded to the state dtype; the unrounded new
        value feeds the thread's partial ``y[r, d] = sum_n new[d, n] C[r, n]`` over its own
        columns. Returns the partials, ``(rows_per_group * R,)`` fp32, slot ``i * R + r``
        holding register row ``i`` and rank ``r ^ (phi & (R - 1))``.
        """
        lay = self.layout
        R = self.R
        sigma = phi & (R - 1)
        part = cute.make_rmem_tensor(cute.make_layout(lay.partials_per_group), Float32)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            uv = cute.make_rmem_tensor(cute.make_layout(2 * R), Float32)
            for k in cutlass.range_constexpr(2 * R):
                uv[k] = sUV[rows[i], k]
            tNrN = cute.make_rmem_tensor(cute.make_layout((lay.VN, lay.CPT), stride=(1, lay.VN)), Float32)
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    tNrN[e, c] = alpha * tSrS[e, i, c].to(Float32)
            for r in cutlass.range_constexpr(R):
                if const_expr(not lay.cache_operands):
                    self.row_fence()  # one rank's operands at a time in registers
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        if const_expr(lay.cache_operands):
                            b_, bs_ = tOrB[r, e, c], tOrBs[r, e, c]
                        else:
                            n = self.column(c, e, lane)
                            b_, bs_ = sB[r, n], sBs[r, n]
                        tNrN[e, c] = tNrN[e, c] + uv[r] * b_ + uv[R + r] * bs_
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    tSrS[e, i, c] = tNrN[e, c].to(self.state_dtype)
            for r in cutlass.range_constexpr(R):
                if const_expr(not lay.cache_operands):
                    self.row_fence()
                y = Float32(0.0)
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        if const_expr(lay.cache_operands):
                            y = y + tNrN[e, c] * tOrC[r, e, c]
                        else:
                            y = y + tNrN[e, c] * sC[r ^ sigma, self.column(c, e, lane)]
                part[i * R + r] = y
        return part

    @cute.jit
    def row_fence(self):
        """A compiler-level memory clobber between rows (an empty volatile asm, no
        instruction), so B/Bs/C are re-read from shared memory instead of being cached in
        registers across rows when they do not fit (``ThreadLayout.cache_operands``)."""
        llvm.inline_asm(None, [], "", "~{memory}", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)

    @cute.jit
    def reduce_rows(self, part: cute.Tensor, sY: cute.Tensor, tidx: Int32, phi: Int32, g: int):
        """Complete a row group's partial sums over the TPR lanes of each row; store them to sY.

        Transposed butterfly: while a lane holds more than one value, the round with lane
        mask ``m`` sends the second half of the lane's slots to its partner ``lane ^ m`` and
        adds what arrives to the first half. Because the lane's slots are ordered by
        ``phi`` (:meth:`lane_permutation`), the partner's second half holds the same
        partials as the lane's first half, and ``K`` partials over TPR lanes cost ``K - 1``
        shuffles and adds, with no selects. Once a lane holds one value the remaining rounds
        are plain butterflies, after which only the lanes with those mask bits clear store.
        Slot ``j`` left at the end is partial ``j ^ phi``: row ``(j ^ phi) // R``, rank
        ``(j ^ phi) % R``.
        """
        lay = self.layout
        vals = []
        for k in cutlass.range_constexpr(lay.partials_per_group):
            vals.append(part[k])
        for step in cutlass.range_constexpr(len(self.reduce_plan)):
            m, halving = self.reduce_plan[step]
            if const_expr(halving):
                half = len(vals) // 2
                kept = []
                for j in cutlass.range_constexpr(half):
                    kept.append(vals[j] + cute.arch.shuffle_sync_bfly(vals[j + half], offset=m))
                vals = kept
            else:
                vals = [vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=m)]
        lane = tidx % lay.TPR
        row0 = g * self.group_rows + tidx // lay.TPR
        log2r = self.R.bit_length() - 1
        for j in cutlass.range_constexpr(len(vals)):
            k = phi ^ j
            if (lane & self.reduce_plain_mask) == 0:
                sY[k & (self.R - 1), row0 + (k >> log2r) * lay.rows_per_pass] = vals[j]

    @cute.jit
    def epilogue(
        self,
        sY: cute.Tensor,  # (R, tile_D) fp32, sum_n new * C
        sXr: cute.Tensor,  # (R, tile_D) fp32, x * xproj
        mDskip: cute.Tensor,  # (H,)
        mZ: Optional[cute.Tensor],  # (B[, T], H, D)
        mZproj: Optional[cute.Tensor],  # (R, H, D)
        mOutproj: Optional[cute.Tensor],  # (R, H, D)
        mOut: cute.Tensor,  # (B[, T], H, D) or (B[, T], R, H, D)
        lane_t: tuple,  # this (lane, token)'s leading coordinates in mZ, mOut
        h: Int32,
        dtile: Int32,
        tidx: Int32,
        num_threads: int,
    ):
        """``y = sY + D xr``; ``y *= silu(z zproj)``; ``out = sum_r y outproj`` (or out = y).

        When the CTA has more threads than rows, ``epilogue_split`` adjacent lanes share a row
        ``d``, each taking ``R / epilogue_split`` ranks; with outproj their partial sums are
        combined by a butterfly over those lanes and the first one stores ``out``.
        """
        split = self.epilogue_split
        ranks = self.R // split
        dskip = mDskip[h]
        d0 = dtile * self.tile_D
        part = tidx % split
        for k in cutlass.range_constexpr((self.tile_D * split + num_threads - 1) // num_threads):
            d = (tidx + k * num_threads) // split
            acc = Float32(0.0)
            if d < self.tile_D:
                dg = d0 + d
                zd = Float32(0.0)
                if const_expr(self.has_z):
                    zd = mZ[lane_t + (h, dg)].to(Float32)
                for j in cutlass.range_constexpr(ranks):
                    r = part * ranks + j
                    y = sY[r, d] + dskip * sXr[r, d]
                    if const_expr(self.has_z):
                        gz = zd * mZproj[r, h, dg].to(Float32)
                        y = y * (gz * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gz)))
                    if const_expr(self.has_outproj):
                        acc = acc + y * mOutproj[r, h, dg].to(Float32)
                    else:
                        mOut[lane_t + (r, h, dg)] = y.to(self.x_dtype)
            if const_expr(self.has_outproj):
                # the lanes sharing a row are adjacent and agree on d < tile_D: every lane shuffles
                for m in cutlass.range_constexpr(len(self.epilogue_masks)):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=self.epilogue_masks[m])
                if d < self.tile_D:
                    if part == 0:
                        mOut[lane_t + (h, d0 + d)] = acc.to(self.x_dtype)

    @cute.jit
    def zero_out(self, mOut: cute.Tensor, lane_t: tuple, h: Int32, dtile: Int32, tidx: Int32, num_threads: int):
        """Padding lane: ``out`` = 0 for one token (``lane_t``: its leading coordinates); no pool row
        is read or written."""
        d0 = dtile * self.tile_D
        for k in cutlass.range_constexpr((self.tile_D + num_threads - 1) // num_threads):
            d = tidx + k * num_threads
            if d < self.tile_D:
                if const_expr(self.has_outproj):
                    mOut[lane_t + (h, d0 + d)] = self.x_dtype(0.0)
                else:
                    for r in cutlass.range_constexpr(self.R):
                        mOut[lane_t + (r, h, d0 + d)] = self.x_dtype(0.0)


# ---------------------------------------------------------------------- compile
def fake_arguments(spec: StepSpec) -> list:
    """Fake tensors for ``cute.compile``: B, P, H, K and every stride symbolic; T static.

    A tensor's first stride is 64-bit (pool offsets exceed 2**31 elements), the others 32-bit
    (the wrapper checks a row spans less than 2**31 elements). State strides are declared
    divisible by the 16-byte vector and the base 16-byte aligned (the wrapper checks both),
    which is what lets the state copies become 16-byte accesses. Per-lane tensors have a token
    axis (B, T, ...) only when the specialisation has more than one token, so the one-token
    kernel is the plain decode step.
    """
    make = cute.runtime.make_fake_tensor
    sym, sym64 = cute.sym_int, cute.sym_int64
    st, kv, xt, pj = (CUTLASS_DTYPES[n] for n in (spec.state_dtype, spec.kv_dtype, spec.x_dtype, spec.proj_dtype))
    N, D, R = spec.dstate, spec.headdim, spec.mimo
    VN = thread_layout(N, spec.tile_D, spec.num_warps, spec.state_dtype, R).VN
    batch, pool, heads = sym(), sym(), sym()

    def state_like(rows):  # (rows, H, D, N)
        # the row stride is 64-bit (a pool exceeds 2**31 elements); inside a row 32 bits suffice
        # (validation.check_state_strides), which keeps per-vector address math 32-bit
        return make(st, (rows, heads, D, N), stride=(sym64(divisibility=VN), sym(divisibility=VN),
                                                      sym(divisibility=VN), 1), assumed_align=16)

    def strided(dtype, shape):  # outermost stride 64-bit, the others 32-bit, innermost 1
        inner = tuple(sym() for _ in shape[1:-1])
        outer = (sym64(),) if len(shape) > 1 else ()
        return make(dtype, shape, stride=outer + inner + (1,), assumed_align=dtype.width // 8)

    rows = pool if spec.pool else batch
    T = spec.tokens

    def lane(dtype, rest):  # a per-lane tensor: (B, *rest), or (B, T, *rest) with tokens > 1
        return strided(dtype, (batch,) + ((T,) if T > 1 else ()) + rest)

    return [
        state_like(rows),  # state
        strided(kv, (rows, R, heads, N)),  # Bstate
        strided(xt, (rows, heads, D)),  # Xstate
        lane(Float32, (heads,)),  # A
        lane(kv, (R, heads, N)),  # B
        lane(kv, (R, heads, N)),  # C
        strided(Float32, (heads,)),  # D
        lane(xt, (heads, D)),  # x
        lane(Float32, (heads,)),  # dt
        lane(Float32, (heads,)),  # trap
        strided(pj, (R, heads, D)),  # xproj
        strided(pj, (R, heads, D)) if spec.has_z else None,  # zproj
        strided(pj, (R, heads, D)) if spec.has_outproj else None,  # outproj
        lane(xt, (heads, D)) if spec.has_z else None,  # z
        lane(xt, (heads, D) if spec.has_outproj else (R, heads, D)),  # out
        state_like(batch) if spec.has_state_out else None,  # state_out
        (strided(Int32, (batch, sym())) if spec.num_accepted else strided(Int32, (batch,))) if spec.pool
        else None,  # state_batch_indices: (B,), or (B, K) with num_accepted_tokens
        (strided(Int32, (batch, T)) if spec.dst_per_token else strided(Int32, (batch,))) if spec.has_dst
        else None,  # dst_state_batch_indices: (B,), or (B, T) per token
        strided(Int32, (batch,)) if spec.num_accepted else None,  # num_accepted_tokens
        Int32(-1),  # null_slot
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    ]


def argument_masks(spec: StepSpec) -> list:
    """Per runtime argument of :func:`~mamba3_step.tensors.kernel_arguments`: ``None`` for an
    absent tensor, ``"scalar"`` for ``null_slot``, else ``(dynamic shape modes, dynamic stride
    modes)`` as bool tuples: which values the DSL passes in a tensor's parameter struct."""
    out = []
    for fake in fake_arguments(spec)[:-1]:  # the stream is not a kernel parameter
        if fake is None:
            out.append(None)
        elif hasattr(fake, "dynamic_shapes_mask"):
            out.append((tuple(bool(m) for m in fake.dynamic_shapes_mask),
                        tuple(bool(m) for m in fake.dynamic_strides_mask)))
        else:
            out.append("scalar")
    return out


def compile_step_kernel(spec: StepSpec, arch: str = "sm_90a", *, extra_options: str = ""):
    """Compile one specialisation for ``arch`` (no GPU needed) and return the tvm-ffi callable.

    The callable takes the 18 tensors of :func:`kernel_arguments` (``None`` where the spec has
    none) and ``null_slot``; it launches on the caller's current CUDA stream.
    """
    problem = tiling_problem(spec)
    if problem is not None:
        raise ValueError(problem)
    options = f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip()
    return cute.compile(Mamba3StepKernel(spec), *fake_arguments(spec), options=options)
