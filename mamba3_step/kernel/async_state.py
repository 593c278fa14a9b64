"""The asynchronous state copy (``StepSpec.async_state_copy``): the slab arrives in shared memory.

Right after the row index, each thread issues one 16-byte ``cp.async`` per vector of its rows of
pool row ``src`` (every row group, one commit group), before any other load of the CTA. The
staging loads of the token's operands then go out while the slab is in flight, so the state's
bytes and theirs share one round trip, and no register holds the slab until the update reads
it. The update reads a row group from shared memory when it needs it (:meth:`staged_rows`,
called by :meth:`~.slab.Slab.load_state`); the first read waits for the copies. A thread reads
only the vectors it copied itself, so its own wait orders them and no barrier is needed. A
one-token step's row groups are small (``tiling.async_copy_layout``): fewer registers hold the
state at a time, and the staged B and C are read once per group.

An 8-bit state's scales are loaded into registers right after the copies (:meth:`issue_state_copies`
returns them; the CTA carries them as ``Cta.scales``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from ..tensors import KernelArgs
from .bundles import Cta, RowGroup

__all__ = ["AsyncStateCopy"]


class AsyncStateCopy:
    """The slab copied to shared memory asynchronously, and read back by row group (a mixin of the kernel class)."""

    def staged_vector(self, sS: cute.Tensor, d, c: int, cta: Cta) -> cute.Tensor:
        """The ``(VN,)`` vector ``c`` of tile row ``d`` in the staged slab ``sS`` (tile_D, N): the
        same elements :meth:`~.slab.Slab.state_vector` names in the pool."""
        return cute.local_tile(sS[d, None], (self.layout.VN,), (c * self.layout.TPR + cta.lane,))

    @cute.jit
    def issue_state_copies(self, m: KernelArgs, sS: cute.Tensor, cta: Cta) -> list:
        """Every vector of the thread's rows of pool row ``src`` -> ``sS``, one 16-byte ``cp.async``
        each (bypassing L1: ``.cg``), committed as one group. Returns each row group's scales (an
        8-bit state's, loaded now into registers; else None)."""
        lay = self.layout
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.state_dtype,
                                   num_bits_per_copy=128)
        for g in cutlass.range_constexpr(lay.row_groups):
            rows = self.thread_rows(cta, g)
            for i in cutlass.range_constexpr(lay.rows_per_group):
                for c in cutlass.range_constexpr(lay.CPT):
                    cute.copy(atom, self.state_vector(m.state, cta.src, rows[i], c, cta),
                              self.staged_vector(sS, rows[i], c, cta))
        cute.arch.cp_async_commit_group()
        return self.group_scales(m, cta)

    @cute.jit
    def group_scales(self, m: KernelArgs, cta: Cta) -> list:
        """Each row group's scales of the thread's rows, loaded into registers (an 8-bit state's; else None each),
        for :meth:`staged_rows` to hand the update."""
        scales = []
        for g in cutlass.range_constexpr(self.layout.row_groups):
            scales.append(self.storage.load_scales(m, self.thread_rows(cta, g), cta))
        return scales

    @cute.jit
    def staged_rows(self, g: int, sS: cute.Tensor, cta: Cta) -> RowGroup:
        """Row group ``g`` of the thread's share of the staged slab, into registers as
        :meth:`~.slab.Slab.load_state` leaves it; the first group waits for the copies."""
        lay = self.layout
        if cutlass.const_expr(g == 0 and self.async_state):  # the slab pipeline waited on the stage's mbarrier
            cute.arch.cp_async_wait_group(0)
        rows = self.thread_rows(cta, g)
        tSrS = self.row_group_fragment()
        for i in cutlass.range_constexpr(lay.rows_per_group):
            for c in cutlass.range_constexpr(lay.CPT):
                cute.autovec_copy(self.staged_vector(sS, rows[i], c, cta), tSrS[None, i, c])
        return RowGroup(tSrS, rows, cta.scales[g] if cutlass.const_expr(self.scaled) else None,
                        self.uv_rows(cta, g) if cutlass.const_expr(self.uv_skewed) else None)
