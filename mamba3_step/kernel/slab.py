"""The CTA's slab of the state in registers: which tile rows a thread owns (in the lane order the
reduction wants), and its 16-byte loads and stores. The per-format parts (an 8-bit state's scales)
go through the kernel's state format (:mod:`.state_formats`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..tensors import KernelArgs
from .bundles import Cta, RowGroup

__all__ = ["Slab"]


class Slab:
    """The thread's rows of the state slab, loaded and stored (a mixin of the kernel class)."""

    @cute.jit
    def thread_rows(self, cta: Cta, g: int) -> list:
        """Tile rows of the thread's ``rows_per_group`` registers rows in group ``g``.

        Thread ``t`` owns rows ``t // TPR + j * rows_per_pass`` (``j`` over the group); its
        register row ``i`` holds ``j = i ^ (phi >> log2 R)``, the lane-dependent order the
        reduction wants. A row's TPR lanes together still cover it exactly once, and each
        lane's vectors stay 16-byte accesses.
        """
        lay = self.layout
        rho = cta.phi >> (self.R.bit_length() - 1)
        base = g * self.group_rows + cta.tidx // lay.TPR
        rows = []
        for i in cutlass.range_constexpr(lay.rows_per_group):
            rows.append(base + (rho ^ i) * lay.rows_per_pass)
        return rows

    @cute.jit
    def state_vector(self, mState: cute.Tensor, row: Int32, d: Int32, c: int, cta: Cta) -> cute.Tensor:
        """The ``(VN,)`` 16-byte vector ``c`` of tile row ``d`` a lane moves: elements
        ``(c * TPR + lane) * VN ...`` of ``mState[row, h, dtile * tile_D + d]``."""
        gS = mState[row, cta.h, None, None]  # (D, N); 64-bit offsets (64-bit strides)
        gT = cute.local_tile(gS, (self.tile_D, self.N), (cta.dtile, 0))  # (tile_D, N)
        return cute.local_tile(gT[d, None], (self.layout.VN,), (c * self.layout.TPR + cta.lane,))

    @cute.jit
    def load_state(self, m: KernelArgs, g: int, cta: Cta, shared=None) -> RowGroup:
        """Row group ``g`` of the thread's share of pool row ``src``: 16-byte loads into a
        ``(VN, rows_per_group, CPT)`` register fragment in the state dtype (and, for an 8-bit
        state, each row's scale). With the asynchronous state copy, read from the staged slab
        in ``shared`` instead (:meth:`~.async_state.AsyncStateCopy.staged_rows`)."""
        if cutlass.const_expr(self.async_state or self.pipeline_ctas):
            return self.staged_rows(g, shared.sS, cta)
        lay = self.layout
        rows = self.thread_rows(cta, g)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.state_dtype, num_bits_per_copy=128)
        tSrS = self.row_group_fragment()
        for i in cutlass.range_constexpr(lay.rows_per_group):
            for c in cutlass.range_constexpr(lay.CPT):
                cute.copy(atom, self.state_vector(m.state, cta.src, rows[i], c, cta), tSrS[None, i, c])
        return RowGroup(tSrS, rows, self.storage.load_scales(m, rows, cta))

    def row_group_fragment(self) -> cute.Tensor:
        """A row group's registers: ``(VN, rows_per_group, CPT)`` in the state dtype."""
        lay = self.layout
        return cute.make_rmem_tensor(
            cute.make_layout((lay.VN, lay.rows_per_group, lay.CPT), stride=(1, lay.VN, lay.VN * lay.rows_per_group)),
            self.state_dtype)

    @cute.jit
    def store_state(self, group: RowGroup, m: KernelArgs, cta: Cta):
        """16-byte stores of a row group's new state to row ``dst`` of the pool (or of
        ``state_out`` in dense mode with it); an 8-bit state's scales to ``state_scale``."""
        lay = self.layout
        mTarget = self.state_target(m)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.state_dtype, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            for c in cutlass.range_constexpr(lay.CPT):
                cute.copy(atom, group.tSrS[None, i, c], self.state_vector(mTarget, cta.dst, group.rows[i], c, cta))
        self.storage.store_scales(group, m, cta)

    def state_target(self, m: KernelArgs):
        """Where the new state goes: ``state_out`` in dense mode with it, else the state itself."""
        return m.state_out if self.has_state_out else m.state
