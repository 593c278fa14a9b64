"""Run the kernel's own ``@cute.jit`` stages on the CPU, one CTA and one thread at a time.

No GPU simulator exists; but a ``@cute.jit`` function without a launch is compiled for and
run on the host (CUTEDSL-NOTES.md). :class:`HostDriver` walks the kernel's grid
``(B, H, D / tile_D)`` and, for every CTA, every thread index ``tidx``, calling the very
methods the ``@cute.kernel`` calls (:class:`~mamba3_step.kernel.Mamba3StepKernel`):
``select_rows``, ``partition_state`` + the 16-byte ``cute.copy``, ``stage_operands``,
``store_kv_state``, ``decay_coefficients``, ``update_rows``, ``store_state``,
``epilogue`` and ``zero_out``. Shared memory becomes CPU scratch tensors, the barrier
becomes the order of the loops (all threads finish one stage before the next starts), and
the warp shuffle reduction is replaced by summing the per-thread partials in thread order
(so ``out`` matches the GPU to rounding, not to the bit).

The driver also records, per lane, which pool rows it handed to the load and store stages
(``-1`` for none), so tests can check which rows a step reads and writes.

This is a test instrument: it is slow (a Python-free but scalar host loop), meant for small
shapes.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from .kernel import Mamba3StepKernel, kernel_arguments
from .spec import StepSpec


class HostStages(Mamba3StepKernel):
    """The kernel's stages with the one cross-thread step replaced for a serial host loop."""

    @cute.jit
    def row_fence(self):
        pass  # threads run one after another: nothing to order

    @cute.jit
    def reduce_row(self, partial: Float32, sY: cute.Tensor, r: int, d: Int32, tidx: Int32):
        # stands in for the butterfly shuffle: threads run in order, so accumulate
        sY[r, d] = sY[r, d] + partial


class HostDriver:
    def __init__(self, spec: StepSpec):
        self.k = HostStages(spec)
        self.spec = spec
        self.nt = self.k.num_threads
        self.row_groups = self.k.layout.row_groups
        self.R = spec.mimo
        self.tile_D = spec.tile_D
        self.n_dtiles = spec.headdim // spec.tile_D

    @cute.jit
    def __call__(
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
        sB: cute.Tensor,  # (R, N) fp32 scratch standing in for shared memory
        sBs: cute.Tensor,  # (R, N)
        sC: cute.Tensor,  # (R, N)
        sX: cute.Tensor,  # (tile_D,)
        sXs: cute.Tensor,  # (tile_D,)
        sXproj: cute.Tensor,  # (R, tile_D)
        sY: cute.Tensor,  # (R, tile_D)
        mRowsRead: cute.Tensor,  # (B,) int32 out: row handed to the loads, -1 if none
        mRowsWritten: cute.Tensor,  # (B,) int32 out: row handed to the stores, -1 if none
    ):
        for b in cutlass.range(mX.shape[0]):
            for h in cutlass.range(mX.shape[1]):
                for dtile in cutlass.range(self.n_dtiles):
                    src, dst, src_live, dst_live = self.k.select_rows(mSrcIdx, mDstIdx, null_slot, mState.shape[0], b)
                    if src_live:
                        mRowsRead[b] = src
                        for tidx in cutlass.range(self.nt):
                            self.k.stage_operands(mBstate, mXstate, mB, mC, mX, mXproj, sB, sBs, sC, sX, sXs, sXproj,
                                             src, b, h, dtile, tidx)
                        # -- barrier --
                        if const_expr(self.k.update_kv_state):
                            if dst_live:
                                for tidx in cutlass.range(self.nt):
                                    self.k.store_kv_state(mBstate, mXstate, sB, sX, dst, h, dtile, tidx)
                        alpha, beta, gamma = self.k.decay_coefficients(mA, mDt, mTrap, b, h)
                        for r in cutlass.range(self.R):
                            for d in cutlass.range(self.tile_D):
                                sY[r, d] = Float32(0.0)
                        for g in cutlass.range_constexpr(self.row_groups):
                            for tidx in cutlass.range(self.nt):
                                tiled_copy = self.k.state_tiled_copy()
                                tSgS, tScS = self.k.partition_state(tiled_copy, mState, src, h, dtile, g, tidx)
                                tSrS = cute.make_fragment_like(tSgS)
                                cute.copy(tiled_copy, tSgS, tSrS)
                                self.k.update_rows(tSrS, tScS, sB, sBs, sC, sX, sXs, sXproj, sY, alpha, beta,
                                                   gamma, tidx)
                                if dst_live:
                                    mRowsWritten[b] = dst
                                    self.k.store_state(tiled_copy, tSrS, mState, mStateOut, dst, h, dtile, g, tidx)
                        # -- barrier --
                        for tidx in cutlass.range(self.nt):
                            self.k.epilogue(sY, sX, sXproj, mDskip, mZ, mZproj, mOutproj, mOut, b, h, dtile, tidx, self.nt)
                    else:
                        for tidx in cutlass.range(self.nt):
                            self.k.zero_out(mOut, b, h, dtile, tidx, self.nt)


def _cute(t: Optional[torch.Tensor]):
    if t is None:
        return None
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=16 if t.data_ptr() % 16 == 0 else t.element_size())


def run_on_host(spec: StepSpec, **tensors) -> dict:
    """Run one step on CPU tensors through the kernel's stages (see module docstring).

    ``tensors`` are ``mamba3_step_fn``'s tensors by name (``out`` required, updated in place
    like the kernel does). Returns ``{"rows_read": (B,) int32, "rows_written": (B,) int32}``.
    """
    args = kernel_arguments(spec, **tensors)
    batch = tensors["x"].shape[0]
    R, N, tD = spec.mimo, spec.dstate, spec.tile_D
    scratch = [torch.full(shape, float("nan"), dtype=torch.float32)
               for shape in [(R, N), (R, N), (R, N), (tD,), (tD,), (R, tD), (R, tD)]]
    rows_read = torch.full((batch,), -1, dtype=torch.int32)
    rows_written = torch.full((batch,), -1, dtype=torch.int32)
    cargs = [_cute(a) if isinstance(a, torch.Tensor) or a is None else Int32(a) for a in args]
    driver = HostDriver(spec)
    driver(*cargs, *[_cute(s) for s in scratch], _cute(rows_read), _cute(rows_written))
    return {"rows_read": rows_read, "rows_written": rows_written}


def host_step_fn(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj=None, state_out=None, out=None,
                 z=None, zproj=None, *, state_batch_indices=None, dst_state_batch_indices=None, null_slot_id=None,
                 update_kv_state=False, tile_D=None, num_warps=None, validate_indices=False):
    """``mamba3_step_fn``'s contract on CPU tensors, computed by the kernel's own stages.

    Same arguments, validation and in-place effects as :func:`mamba3_step.mamba3_step_fn`;
    the work is done by :func:`run_on_host`. A test instrument: slow, for small shapes.
    """
    from .api import prepare_step

    spec, tensors = prepare_step(
        state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj,
        state_batch_indices=state_batch_indices, dst_state_batch_indices=dst_state_batch_indices,
        null_slot_id=null_slot_id, update_kv_state=update_kv_state, tile_D=tile_D, num_warps=num_warps,
        validate_indices=validate_indices,
    )
    if x.shape[0] > 0:
        run_on_host(spec, **tensors)
    return tensors["out"]
