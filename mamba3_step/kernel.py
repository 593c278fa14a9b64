"""The CuteDSL Mamba-3 MIMO decode-step kernel: the kernel class and its compile function.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size,
R MIMO rank. In dense mode the "pool" tensors have B rows and lane b uses row b.

Grid ``(B, H, D / tile_D)``; one CTA owns one (lane, head, D-tile) slab of the state. The
device work is split into small ``@cute.jit`` stages that take ``tidx`` as an argument, so
that each stage can be exercised on its own:

1. :meth:`Mamba3StepKernel.select_rows`      lane -> (src, dst, src_live, dst_live)
2. :meth:`Mamba3StepKernel.stage_operands`   B, Bstate, C -> (R, N) fp32; x, Xstate, xproj
                                              -> (tile_D,) / (R, tile_D) fp32 (shared memory)
3. :meth:`Mamba3StepKernel.store_kv_state`   update_kv_state: staged B / x -> Bstate / Xstate[dst]
4. :meth:`Mamba3StepKernel.update_rows`      a thread's state fragment -> new state (in place)
                                              and its partial y[r, d] sums over its N elements,
   :meth:`Mamba3StepKernel.reduce_row`       (GPU only) completed by a butterfly shuffle over
                                              the TPR lanes of the row -> sY (R, tile_D)
5. :meth:`Mamba3StepKernel.store_state`      16-byte stores of the new state to row dst
6. :meth:`Mamba3StepKernel.epilogue`         y + D * xr, z gate, outproj -> out
   :meth:`Mamba3StepKernel.zero_out`         padding lanes: out = 0, nothing else

Only the barriers, the shuffle reduction, the row fence (an empty asm) and shared-memory
allocation are GPU-only (docs/design.md).

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
from .tiling import thread_layout, tiling_problem

__all__ = ["CUTLASS_DTYPES", "Mamba3StepKernel", "compile_step_kernel", "fake_arguments", "kernel_arguments"]

#: the contract's dtype table, as CuteDSL types
CUTLASS_DTYPES = {name: getattr(cutlass, d.cutlass) for name, d in DTYPES.items()}


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
        lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo)
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
        self.group_rows = lay.rows_per_pass * lay.rows_per_group  # tile rows in one row group

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mState: cute.Tensor,  # (P, H, D, N) state dtype, updated in place (pool: P rows; dense: B rows)
        mBstate: cute.Tensor,  # (P, R, H, N) kv dtype
        mXstate: cute.Tensor,  # (P, H, D) x dtype
        mA: cute.Tensor,  # (B, H) fp32
        mB: cute.Tensor,  # (B, R, H, N) kv dtype
        mC: cute.Tensor,  # (B, R, H, N) kv dtype
        mDskip: cute.Tensor,  # (H,) fp32, the contract's D (skip) parameter
        mX: cute.Tensor,  # (B, H, D) x dtype
        mDt: cute.Tensor,  # (B, H) fp32
        mTrap: cute.Tensor,  # (B, H) fp32
        mXproj: cute.Tensor,  # (R, H, D) proj dtype
        mZproj: Optional[cute.Tensor],  # (R, H, D) proj dtype, with z
        mOutproj: Optional[cute.Tensor],  # (R, H, D) proj dtype
        mZ: Optional[cute.Tensor],  # (B, H, D) x dtype
        mOut: cute.Tensor,  # (B, H, D) with outproj else (B, R, H, D), x dtype
        mStateOut: Optional[cute.Tensor],  # (B, H, D, N) dense mode only
        mSrcIdx: Optional[cute.Tensor],  # (B,) int32, pool mode
        mDstIdx: Optional[cute.Tensor],  # (B,) int32, pool mode with separate destination
        null_slot: Int32,  # pool rows equal to this are padding (pass -1 for none)
        stream,
    ):
        batch = mX.shape[0]
        heads = mX.shape[1]
        self.kernel(
            mState, mBstate, mXstate, mA, mB, mC, mDskip, mX, mDt, mTrap, mXproj, mZproj,
            mOutproj, mZ, mOut, mStateOut, mSrcIdx, mDstIdx, null_slot,
        ).launch(
            grid=(batch, heads, self.D // self.tile_D),
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
        mA: cute.Tensor,  # (B, H)
        mB: cute.Tensor,  # (B, R, H, N)
        mC: cute.Tensor,  # (B, R, H, N)
        mDskip: cute.Tensor,  # (H,)
        mX: cute.Tensor,  # (B, H, D)
        mDt: cute.Tensor,  # (B, H)
        mTrap: cute.Tensor,  # (B, H)
        mXproj: cute.Tensor,  # (R, H, D)
        mZproj: Optional[cute.Tensor],  # (R, H, D)
        mOutproj: Optional[cute.Tensor],  # (R, H, D)
        mZ: Optional[cute.Tensor],  # (B, H, D)
        mOut: cute.Tensor,  # (B, H, D) or (B, R, H, D)
        mStateOut: Optional[cute.Tensor],  # (B, H, D, N)
        mSrcIdx: Optional[cute.Tensor],  # (B,)
        mDstIdx: Optional[cute.Tensor],  # (B,)
        null_slot: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        b, h, dtile = cute.arch.block_idx()

        src, dst, src_live, dst_live = self.select_rows(mSrcIdx, mDstIdx, null_slot, mState.shape[0], b)
        if src_live:
            smem = cutlass.memory.SmemAllocator()
            sB = smem.allocate_tensor(Float32, cute.make_layout((self.R, self.N), stride=(self.N, 1)), 16)
            sBs = smem.allocate_tensor(Float32, cute.make_layout((self.R, self.N), stride=(self.N, 1)), 16)
            sC = smem.allocate_tensor(Float32, cute.make_layout((self.R, self.N), stride=(self.N, 1)), 16)
            sX = smem.allocate_tensor(Float32, cute.make_layout(self.tile_D), 16)
            sXs = smem.allocate_tensor(Float32, cute.make_layout(self.tile_D), 16)
            sXproj = smem.allocate_tensor(
                Float32, cute.make_layout((self.R, self.tile_D), stride=(self.tile_D, 1)), 16
            )
            sY = smem.allocate_tensor(
                Float32, cute.make_layout((self.R, self.tile_D), stride=(self.tile_D, 1)), 16
            )

            # Issue the first row group's state loads first: they are the bytes that matter.
            tiled_copy = self.state_tiled_copy()
            tSgS, tScS = self.partition_state(tiled_copy, mState, src, h, dtile, 0, tidx)
            tSrS = cute.make_fragment_like(tSgS)
            cute.copy(tiled_copy, tSgS, tSrS)

            self.stage_operands(
                mBstate, mXstate, mB, mC, mX, mXproj, sB, sBs, sC, sX, sXs, sXproj, src, b, h, dtile, tidx
            )
            cute.arch.barrier()
            # Every read of the old Bstate/Xstate rows happened before the barrier.
            if const_expr(self.update_kv_state):
                if dst_live:
                    self.store_kv_state(mBstate, mXstate, sB, sX, dst, h, dtile, tidx)

            alpha, beta, gamma = self.decay_coefficients(mA, mDt, mTrap, b, h)
            for g in cutlass.range_constexpr(self.layout.row_groups):
                if const_expr(g > 0):
                    tSgS, tScS = self.partition_state(tiled_copy, mState, src, h, dtile, g, tidx)
                    tSrS = cute.make_fragment_like(tSgS)
                    cute.copy(tiled_copy, tSgS, tSrS)
                self.update_rows(tSrS, tScS, sB, sBs, sC, sX, sXs, sXproj, sY, alpha, beta, gamma, tidx)
                if dst_live:
                    self.store_state(tiled_copy, tSrS, mState, mStateOut, dst, h, dtile, g, tidx)
            cute.arch.barrier()
            self.epilogue(
                sY, sX, sXproj, mDskip, mZ, mZproj, mOutproj, mOut, b, h, dtile, tidx, self.num_threads
            )
        else:
            self.zero_out(mOut, b, h, dtile, tidx, self.num_threads)

    # ------------------------------------------------------------------ stages
    @cute.jit
    def select_rows(self, mSrcIdx: Optional[cute.Tensor], mDstIdx: Optional[cute.Tensor], null_slot: Int32,
                    num_rows: Int32, b: Int32):
        """Lane ``b`` -> ``(src, dst, src_live, dst_live)``.

        Dense mode: row b, always live. Pool mode: ``src = state_batch_indices[b]``; a row
        is padding when negative, ``>= num_rows`` (P) or equal to ``null_slot``. ``dst``
        defaults to ``src``; ``dst_live`` requires a live src too.
        """
        src = Int32(b)
        dst = Int32(b)
        src_live = Boolean(True)
        dst_live = Boolean(True)
        if const_expr(self.pool):
            src = mSrcIdx[b]
            src_live = self.row_is_live(src, num_rows, null_slot)
            dst = src
            dst_live = src_live
            if const_expr(self.has_dst):
                dst = mDstIdx[b]
                dst_live = src_live & self.row_is_live(dst, num_rows, null_slot)
        return src, dst, src_live, dst_live

    @cute.jit
    def row_is_live(self, row: Int32, num_rows: Int32, null_slot: Int32) -> Boolean:
        return (row >= 0) & (row < num_rows) & (row != null_slot)

    @cute.jit
    def decay_coefficients(self, mA: cute.Tensor, mDt: cute.Tensor, mTrap: cute.Tensor, b: Int32, h: Int32):
        """``alpha = exp(A dt)``, ``beta = (1 - trap) dt alpha``, ``gamma = trap dt`` (fp32)."""
        dt = mDt[b, h]
        trap = mTrap[b, h]
        alpha = cute.math.exp(mA[b, h] * dt)
        beta = (Float32(1.0) - trap) * dt * alpha
        gamma = trap * dt
        return alpha, beta, gamma

    def state_tiled_copy(self):
        """16-byte vector copies: thread t owns rows ``t // TPR + i * rows_per_pass`` and
        the VN-element vectors ``(c * TPR + t % TPR) * VN`` of each of its rows."""
        lay = self.layout
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.state_dtype, num_bits_per_copy=128)
        thr_layout = cute.make_layout((lay.rows_per_pass, lay.TPR), stride=(lay.TPR, 1))
        val_layout = cute.make_layout((1, lay.VN), stride=(lay.VN, 1))
        return cute.make_tiled_copy_tv(atom, thr_layout, val_layout)

    @cute.jit
    def state_tile(self, mState: cute.Tensor, row: Int32, h: Int32, dtile: Int32, g: int) -> cute.Tensor:
        """Row group ``g`` of the ``(tile_D, N)`` slab of ``mState[row, h]`` this CTA owns:
        ``(rows_per_pass * rows_per_group, N)``. Offsets are 64-bit (64-bit strides)."""
        gS = mState[row, h, None, None]  # (D, N)
        gT = cute.local_tile(gS, (self.tile_D, self.N), (dtile, 0))  # (tile_D, N)
        return cute.local_tile(gT, (self.group_rows, self.N), (g, 0))

    @cute.jit
    def partition_state(self, tiled_copy: cute.TiledCopy, mState: cute.Tensor, row: Int32, h: Int32,
                        dtile: Int32, g: int, tidx: Int32):
        """Thread ``tidx``'s view of row group ``g`` of its slab: ``(tSgS, tScS)``.

        ``tSgS`` (VN, rows_per_group, CPT) are the state elements it moves; ``tScS`` the
        matching (d, n) coordinates inside the (tile_D, N) tile.
        """
        thr_copy = tiled_copy.get_slice(tidx)
        gS = self.state_tile(mState, row, h, dtile, g)
        cS = cute.local_tile(cute.make_identity_tensor((self.tile_D, self.N)), (self.group_rows, self.N), (g, 0))
        return thr_copy.partition_S(gS), thr_copy.partition_S(cS)

    @cute.jit
    def stage_operands(
        self,
        mBstate: cute.Tensor,  # (P, R, H, N)
        mXstate: cute.Tensor,  # (P, H, D)
        mB: cute.Tensor,  # (B, R, H, N)
        mC: cute.Tensor,  # (B, R, H, N)
        mX: cute.Tensor,  # (B, H, D)
        mXproj: cute.Tensor,  # (R, H, D)
        sB: cute.Tensor,  # (R, N) fp32
        sBs: cute.Tensor,  # (R, N) fp32
        sC: cute.Tensor,  # (R, N) fp32
        sX: cute.Tensor,  # (tile_D,) fp32
        sXs: cute.Tensor,  # (tile_D,) fp32
        sXproj: cute.Tensor,  # (R, tile_D) fp32
        src: Int32,
        b: Int32,
        h: Int32,
        dtile: Int32,
        tidx: Int32,
    ):
        """Thread ``tidx``'s share of converting this (lane, head)'s small operands to fp32."""
        RN = self.R * self.N
        for k in cutlass.range_constexpr((RN + self.num_threads - 1) // self.num_threads):
            i = tidx + k * self.num_threads
            if i < RN:
                r = i // self.N
                n = i - r * self.N
                sB[r, n] = mB[b, r, h, n].to(Float32)
                sC[r, n] = mC[b, r, h, n].to(Float32)
                sBs[r, n] = mBstate[src, r, h, n].to(Float32)
        RT = self.R * self.tile_D
        d0 = dtile * self.tile_D
        for k in cutlass.range_constexpr((RT + self.num_threads - 1) // self.num_threads):
            i = tidx + k * self.num_threads
            if i < RT:
                r = i // self.tile_D
                d = i - r * self.tile_D
                sXproj[r, d] = mXproj[r, h, d0 + d].to(Float32)
                if r == 0:
                    sX[d] = mX[b, h, d0 + d].to(Float32)
                    sXs[d] = mXstate[src, h, d0 + d].to(Float32)

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

    @cute.jit
    def update_rows(
        self,
        tSrS: cute.Tensor,  # (VN, rows_per_group, CPT) state dtype, registers: in -> out
        tScS: cute.Tensor,  # (VN, rows_per_group, CPT) (d, n) coordinates in the tile
        sB: cute.Tensor,  # (R, N) fp32
        sBs: cute.Tensor,  # (R, N) fp32
        sC: cute.Tensor,  # (R, N) fp32
        sX: cute.Tensor,  # (tile_D,) fp32
        sXs: cute.Tensor,  # (tile_D,) fp32
        sXproj: cute.Tensor,  # (R, tile_D) fp32
        sY: cute.Tensor,  # (R, tile_D) fp32 out: sum_n new[d, n] C[r, n]
        alpha: Float32,
        beta: Float32,
        gamma: Float32,
        tidx: Int32,
    ):
        """Per-thread state update (docs/contract.md math, fp32 accumulation), one owned row at a time.

        ``new[d, n] = alpha s[d, n] + sum_r (gamma xr[r, d]) B[r, n] + (beta xsr[r, d]) Bs[r, n]``
        (summed in r order) is written back into ``tSrS`` rounded to the state dtype; then
        for each r the thread's partial ``sum_n new[d, n] C[r, n]`` (unrounded new) goes
        to :meth:`reduce_row`, which completes the sum over the row's TPR threads. Working
        on one row and one r at a time keeps only ``VN * CPT + 3`` fp32 values live beside
        the state fragment, whatever R is.
        """
        lay = self.layout
        for i in cutlass.range_constexpr(lay.rows_per_group):
            if const_expr(lay.fence_rows and i > 0):
                self.row_fence()
            d = tScS[0, i, 0][0]
            xd = sX[d] * gamma
            xsd = sXs[d] * beta
            tNrN = cute.make_rmem_tensor(cute.make_layout((lay.VN, lay.CPT), stride=(1, lay.VN)), Float32)
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    tNrN[e, c] = alpha * tSrS[e, i, c].to(Float32)
            for r in cutlass.range_constexpr(self.R):
                if const_expr(lay.fence_rows):
                    self.row_fence()
                u = xd * sXproj[r, d]
                v = xsd * sXproj[r, d]
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        n = tScS[e, i, c][1]
                        tNrN[e, c] = tNrN[e, c] + u * sB[r, n] + v * sBs[r, n]
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    tSrS[e, i, c] = tNrN[e, c].to(self.state_dtype)
            for r in cutlass.range_constexpr(self.R):
                if const_expr(lay.fence_rows):
                    self.row_fence()
                acc = Float32(0.0)
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        acc = acc + tNrN[e, c] * sC[r, tScS[e, i, c][1]]
                self.reduce_row(acc, sY, r, d, tidx)

    @cute.jit
    def row_fence(self):
        """GPU only: a compiler-level memory clobber between rows (an empty volatile asm, no
        instruction), so B/Bs/C are re-read from shared memory instead of being cached in
        registers across rows (``ThreadLayout.fence_rows``). Host: no-op."""
        llvm.inline_asm(None, [], "", "~{memory}", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)

    @cute.jit
    def reduce_row(self, partial: Float32, sY: cute.Tensor, r: int, d: Int32, tidx: Int32):
        """GPU only: butterfly-sum ``partial`` over the TPR lanes of the row; one lane stores
        it to ``sY[r, d]``. (A host-side stand-in may override this with a plain accumulation.)"""
        total = cute.arch.warp_reduction_sum(partial, threads_in_group=self.layout.TPR)
        if tidx % self.layout.TPR == 0:
            sY[r, d] = total

    @cute.jit
    def store_state(
        self,
        tiled_copy: cute.TiledCopy,
        tSrS: cute.Tensor,  # (VN, rows_per_group, CPT) new state
        mState: cute.Tensor,  # (P, H, D, N)
        mStateOut: Optional[cute.Tensor],  # (B, H, D, N)
        dst: Int32,
        h: Int32,
        dtile: Int32,
        g: int,
        tidx: Int32,
    ):
        """16-byte stores of the thread's new state (row group ``g``) to row ``dst`` (or
        ``state_out``)."""
        target = mState
        if const_expr(self.has_state_out):
            target = mStateOut
        thr_copy = tiled_copy.get_slice(tidx)
        tSgD = thr_copy.partition_D(self.state_tile(target, dst, h, dtile, g))
        cute.copy(tiled_copy, tSrS, tSgD)

    @cute.jit
    def epilogue(
        self,
        sY: cute.Tensor,  # (R, tile_D) fp32, sum_n new * C
        sX: cute.Tensor,  # (tile_D,) fp32
        sXproj: cute.Tensor,  # (R, tile_D) fp32
        mDskip: cute.Tensor,  # (H,)
        mZ: Optional[cute.Tensor],  # (B, H, D)
        mZproj: Optional[cute.Tensor],  # (R, H, D)
        mOutproj: Optional[cute.Tensor],  # (R, H, D)
        mOut: cute.Tensor,  # (B, H, D) or (B, R, H, D)
        b: Int32,
        h: Int32,
        dtile: Int32,
        tidx: Int32,
        num_threads: int,
    ):
        """``y = sY + D xr``; ``y *= silu(z zproj)``; ``out = sum_r y outproj`` (or out = y)."""
        dskip = mDskip[h]
        d0 = dtile * self.tile_D
        for k in cutlass.range_constexpr((self.tile_D + num_threads - 1) // num_threads):
            d = tidx + k * num_threads
            if d < self.tile_D:
                dg = d0 + d
                xd = sX[d]
                zd = Float32(0.0)
                if const_expr(self.has_z):
                    zd = mZ[b, h, dg].to(Float32)
                acc = Float32(0.0)
                for r in cutlass.range_constexpr(self.R):
                    y = sY[r, d] + dskip * (xd * sXproj[r, d])
                    if const_expr(self.has_z):
                        g = zd * mZproj[r, h, dg].to(Float32)
                        y = y * (g / (Float32(1.0) + cute.math.exp(-g)))
                    if const_expr(self.has_outproj):
                        acc = acc + y * mOutproj[r, h, dg].to(Float32)
                    else:
                        mOut[b, r, h, dg] = y.to(self.x_dtype)
                if const_expr(self.has_outproj):
                    mOut[b, h, dg] = acc.to(self.x_dtype)

    @cute.jit
    def zero_out(self, mOut: cute.Tensor, b: Int32, h: Int32, dtile: Int32, tidx: Int32, num_threads: int):
        """Padding lane: ``out`` = 0; no pool row is read or written."""
        d0 = dtile * self.tile_D
        for k in cutlass.range_constexpr((self.tile_D + num_threads - 1) // num_threads):
            d = tidx + k * num_threads
            if d < self.tile_D:
                if const_expr(self.has_outproj):
                    mOut[b, h, d0 + d] = self.x_dtype(0.0)
                else:
                    for r in cutlass.range_constexpr(self.R):
                        mOut[b, r, h, d0 + d] = self.x_dtype(0.0)


# ---------------------------------------------------------------------- compile
def fake_arguments(spec: StepSpec) -> list:
    """Fake tensors for ``cute.compile``: B, P, H and every stride symbolic.

    Strides are 64-bit (pool offsets exceed 2**31 elements). State strides are declared
    divisible by the 16-byte vector and the base 16-byte aligned (the wrapper checks both),
    which is what lets the state copies become 16-byte accesses.
    """
    make = cute.runtime.make_fake_tensor
    sym, sym64 = cute.sym_int, cute.sym_int64
    st, kv, xt, pj = (CUTLASS_DTYPES[n] for n in (spec.state_dtype, spec.kv_dtype, spec.x_dtype, spec.proj_dtype))
    N, D, R = spec.dstate, spec.headdim, spec.mimo
    VN = thread_layout(N, spec.tile_D, spec.num_warps, spec.state_dtype, R).VN
    batch, pool, heads = sym(), sym(), sym()

    def state_like(rows):  # (rows, H, D, N)
        return make(st, (rows, heads, D, N), stride=(sym64(divisibility=VN), sym64(divisibility=VN),
                                                      sym64(divisibility=VN), 1), assumed_align=16)

    def strided(dtype, shape):
        return make(dtype, shape, stride=tuple(sym64() for _ in shape[:-1]) + (1,),
                    assumed_align=dtype.width // 8)

    rows = pool if spec.pool else batch
    return [
        state_like(rows),  # state
        strided(kv, (rows, R, heads, N)),  # Bstate
        strided(xt, (rows, heads, D)),  # Xstate
        strided(Float32, (batch, heads)),  # A
        strided(kv, (batch, R, heads, N)),  # B
        strided(kv, (batch, R, heads, N)),  # C
        strided(Float32, (heads,)),  # D
        strided(xt, (batch, heads, D)),  # x
        strided(Float32, (batch, heads)),  # dt
        strided(Float32, (batch, heads)),  # trap
        strided(pj, (R, heads, D)),  # xproj
        strided(pj, (R, heads, D)) if spec.has_z else None,  # zproj
        strided(pj, (R, heads, D)) if spec.has_outproj else None,  # outproj
        strided(xt, (batch, heads, D)) if spec.has_z else None,  # z
        strided(xt, (batch, heads, D) if spec.has_outproj else (batch, R, heads, D)),  # out
        state_like(batch) if spec.has_state_out else None,  # state_out
        strided(Int32, (batch,)) if spec.pool else None,  # state_batch_indices
        strided(Int32, (batch,)) if spec.has_dst else None,  # dst_state_batch_indices
        Int32(-1),  # null_slot
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    ]


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
