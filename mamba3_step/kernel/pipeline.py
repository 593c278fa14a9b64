"""The slab pipeline (``StepSpec.pipeline_ctas``): persistent CTAs walk the slabs, and the next
slab's state arrives in shared memory by a bulk copy while the CTA updates this one.

A launch has ``min(slabs, pipeline_ctas)`` CTAs; CTA ``c`` takes slabs ``c, c + G, c + 2G, ...``
(``G`` the grid; slab ``(b H + h) tiles + dtile``). The CTA keeps ``S``
(:func:`~mamba3_step.slab_pipeline.pipeline_stages`: 2 to 4, as many tiles as its budget holds) stages, each a
``(tile_D, N)`` state buffer in the state dtype, a two-word header and a "full" mbarrier. Warp 0 is the producer
between its other work: at the top of slab ``k`` it writes slab ``k + S - 1``'s rows into the header of the stage
slab ``k - 1`` released, arms that stage's mbarrier with the slab's bytes and issues one ``cp.async.bulk`` for the
tile (one per tile row when the rows are padded); a padding slab only arrives, so it moves no pool byte. It puts
slab ``k + S``'s row indices on their way there too, by ``cp.async`` into shared memory, and reads them one slab
later: the index's round trip is never waited on. Every thread then waits on slab ``k``'s mbarrier, reads the header, and runs the
register kernel's tokens on the staged tile (:meth:`~.async_state.AsyncStateCopy.staged_rows`
reads it into the same registers :meth:`~.slab.Slab.load_state` fills); the new state, B/x and
``out`` go to global memory as in the register kernel, so its bits are the register kernel's. A
CTA barrier ends each slab: every read of the stage (and of the shared buffers) is done before
warp 0 refills it, after a ``fence.proxy.async`` orders those generic-proxy reads before the
async-proxy writes.

What stays a dependent round trip per slab: the token's own operands (B, C, Bstate, x, Xstate, z,
the decay and epilogue scalars), loaded by the register kernel's staging. Only the state, the
bytes that matter, is prefetched.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..slab_pipeline import PIPELINE_INDEX_SLOTS, pipeline_stages
from ..tensors import KernelArgs
from .bundles import Shared

__all__ = ["SlabPipeline"]


class SlabPipeline:
    """Persistent CTAs with the next slab's state in flight (a mixin of the kernel class)."""

    def allocate_stages(self, smem) -> dict:
        """The stages' buffers: ``sStages`` (stages, tile_D, N) in the state dtype, ``sHeader``
        (stages, 2) Int32 (the slab's src and dst, -1 where not live), ``sIndex`` (slots, 32, words) Int32 (a
        later slab's raw row indices, src and, with a destination, dst, copied asynchronously, one copy per lane of
        warp 0), ``full`` one mbarrier per stage."""
        stages, words = self.stages, self.index_words
        return dict(
            sStages=smem.allocate_tensor(
                self.state_dtype,
                cute.make_layout((stages, self.tile_D, self.N), stride=(self.tile_D * self.N, self.N, 1)), 128),
            sHeader=smem.allocate_tensor(Int32, cute.make_layout((stages, 2), stride=(2, 1)), 16),
            sIndex=smem.allocate_tensor(
                Int32, cute.make_layout((PIPELINE_INDEX_SLOTS, 32, words), stride=(32 * words, words, 1)), 16),
            full=smem.allocate_array(cutlass.Int64, stages),
        )

    @property
    def stages(self) -> int:
        """The CTA's stages (:func:`~mamba3_step.slab_pipeline.pipeline_stages`)."""
        return pipeline_stages(self.spec)

    @property
    def index_words(self) -> int:
        """Words of one prefetched slab's raw row indices: src, and dst with one destination per lane."""
        return 2 if self.has_dst and not self.dst_per_token else 1

    def slab_coordinates(self, slab: Int32, heads: Int32):
        """``(b, h, dtile)`` of slab ``(b H + h) tiles + dtile``."""
        tiles = self.D // self.tile_D
        lane_head = slab // tiles
        b = lane_head // heads
        return b, lane_head - b * heads, slab - lane_head * tiles

    @cute.jit
    def slab_indices(self, m: KernelArgs, slab: Int32, heads: Int32):
        """Slab ``slab``'s raw row indices ``(src, dst)`` (pool mode, as :meth:`select_rows` reads them; the lane
        itself in dense mode). Loaded here and decided (:meth:`rows_of`) a slab later, so nothing waits on them
        (but the accepted count of ``num_accepted``, which the candidate's load needs)."""
        b, _, _ = self.slab_coordinates(slab, heads)
        src = Int32(b)
        dst = Int32(b)
        if const_expr(self.pool):
            src = self.source_row(m, b)
            dst = src
            if const_expr(self.has_dst and not self.dst_per_token):
                dst = m.dst_state_batch_indices[b]
        return src, dst

    @cute.jit
    def rows_of(self, m: KernelArgs, src: Int32, dst: Int32):
        """``(src, dst)`` with -1 for a row that is not live (:meth:`row_is_live`; a dead src kills dst)."""
        if const_expr(self.pool):
            num_rows = m.state.shape[0]
            src_live = self.row_is_live(src, num_rows, m.null_slot)
            dst_live = src_live & self.row_is_live(dst, num_rows, m.null_slot)
            if not dst_live:
                dst = Int32(-1)
            if not src_live:
                src = Int32(-1)
        return src, dst

    @cute.jit
    def fetch_slab(self, m: KernelArgs, shared: Shared, stage: Int32, slab: Int32, src: Int32, dst: Int32, lane: Int32):
        """Warp 0: slab ``slab``'s rows to the header of ``stage``, and its tile in flight into the stage,
        signalled by the stage's mbarrier (a padding slab arrives without bytes)."""
        src, dst = self.rows_of(m, src, dst)
        full = shared.full + stage
        if lane == 0:
            sHeader = shared.sHeader
            sHeader[stage, 0] = src
            sHeader[stage, 1] = dst
        if src >= 0:
            b, h, dtile = self.slab_coordinates(slab, m.xproj.shape[1])
            tile_bytes = self.tile_D * self.N * self.state_dtype.width // 8
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full, tile_bytes)
            gT = cute.local_tile(m.state[src, h, None, None], (self.tile_D, self.N), (dtile, 0))
            sT = shared.sStages[stage, None, None]
            if const_expr(self.spec.padded_state_rows):  # one copy per tile row, over the warp's lanes
                atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), self.state_dtype,
                                           num_bits_per_copy=self.N * self.state_dtype.width)
                for k in cutlass.range_constexpr(-(-self.tile_D // 32)):
                    d = lane + k * 32
                    if d < self.tile_D:
                        cute.copy(atom, gT[d, None], sT[d, None], mbar_ptr=full)
            else:  # the tile is contiguous: one copy
                atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), self.state_dtype,
                                           num_bits_per_copy=self.tile_D * self.N * self.state_dtype.width)
                if lane == 0:
                    flat = cute.make_layout(self.tile_D * self.N)
                    cute.copy(atom, cute.make_tensor(gT.iterator, flat), cute.make_tensor(sT.iterator, flat),
                              mbar_ptr=full)
        else:
            if lane == 0:
                cute.arch.mbarrier_arrive(full)

    @cute.jit
    def prefetch_indices(self, m: KernelArgs, shared: Shared, slot: Int32, slab: Int32, heads: Int32, lane: Int32):
        """Warp 0: slab ``slab``'s raw row indices (pool mode) on their way to ``sIndex[slot]``, by a 4-byte
        ``cp.async`` each, committed as one group, so no register waits for them: a load into a register is moved
        into a uniform register at once, a wait in the same pass. Every lane copies the same words into its own
        slot (one warp instruction each) and later reads only what it copied, so its own wait orders them
        (:meth:`prefetched_indices`, a slab later). With ``num_accepted`` the candidate's address needs the count:
        nothing here."""
        if const_expr(self.pool and not self.num_accepted):
            b, _, _ = self.slab_coordinates(slab, heads)
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32)
            sSlot = shared.sIndex[slot, lane, None]
            cute.copy(atom, cute.local_tile(m.state_batch_indices, (1,), (b,)), cute.local_tile(sSlot, (1,), (0,)))
            if const_expr(self.has_dst and not self.dst_per_token):
                cute.copy(atom, cute.local_tile(m.dst_state_batch_indices, (1,), (b,)), cute.local_tile(sSlot, (1,), (1,)))
            cute.arch.cp_async_commit_group()

    @cute.jit
    def prefetched_indices(self, m: KernelArgs, shared: Shared, slot: Int32, slab: Int32, heads: Int32, lane: Int32):
        """Warp 0: the raw ``(src, dst)`` of slab ``slab`` that :meth:`prefetch_indices` put in the lane's slot of
        ``sIndex[slot]`` (its copies waited for); dense mode: the lane; ``num_accepted``: loaded now
        (:meth:`slab_indices`)."""
        src, dst = self.slab_indices(m, slab, heads) if const_expr(not self.pool or self.num_accepted) else (None, None)
        if const_expr(self.pool and not self.num_accepted):
            cute.arch.cp_async_wait_group(0)
            src = shared.sIndex[slot, lane, 0]
            dst = src
            if const_expr(self.has_dst and not self.dst_per_token):
                dst = shared.sIndex[slot, lane, 1]
        return src, dst

    @cute.jit
    def walk_slabs(self, m: KernelArgs):
        """The persistent CTA's life: initialise the stages, put its first ``S - 1`` slabs in flight, then per
        slab ``k``: refill the free stage with slab ``k + S - 1`` and prefetch slab ``k + S``'s indices (warp 0),
        wait for this slab's stage, run its tokens, pass a barrier."""
        tidx, _, _ = cute.arch.thread_idx()
        cta_id, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        heads = m.xproj.shape[1]
        slabs = m.x.shape[0] * heads * (self.D // self.tile_D)
        count = (slabs - cta_id + grid - 1) // grid  # the slabs this CTA takes: cta_id + k grid
        stages = self.stages
        shared = self.allocate_shared()
        producer = tidx < 32
        lane = tidx % 32
        if tidx == 0:
            for s in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(shared.full + s, 1)
        cute.arch.mbarrier_init_fence()
        if producer:
            cute.arch.sync_warp()  # lane 0's initialisation before the warp's copies signal the mbarriers
            # the first slabs' indices all loaded before any is used (a later slab's clamped to the last slab: the
            # load stays in the index tensor, and a slab the CTA does not take is not fetched), one round trip
            first = [self.slab_indices(m, cta_id if s == 0 else cutlass.min(cta_id + s * grid, slabs - 1), heads)
                     for s in range(stages - 1)]
            cute.arch.sync_warp()  # keeps the compiler from sinking a later slab's load below the first fetch
            for s in cutlass.range_constexpr(stages - 1):
                if s < count:
                    self.fetch_slab(m, shared, Int32(s), cta_id + s * grid, first[s][0], first[s][1], lane)
            if count > stages - 1:
                self.prefetch_indices(m, shared, Int32((stages - 1) % PIPELINE_INDEX_SLOTS), cta_id + (stages - 1) * grid,
                                      heads, lane)
        # the mbarriers initialised and the first headers written before any thread waits or reads; every later
        # header is written a slab ahead, before the barrier that ends the slab before its own
        cute.arch.barrier()
        if const_expr(self.programmatic_launch):  # the indices and the first slabs' rows were all it read
            self.after_prologue()
        for k in cutlass.range(count, unroll=1):
            slab = cta_id + k * grid
            stage = k % stages
            if producer:
                if k + stages - 1 < count:  # the stage slab k - 1 used: its readers passed the barrier that ended it
                    ahead = slab + (stages - 1) * grid
                    src, dst = self.prefetched_indices(m, shared, (k + stages - 1) % PIPELINE_INDEX_SLOTS, ahead, heads,
                                                       lane)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.fetch_slab(m, shared, (k + stages - 1) % stages, ahead, src, dst, lane)
                if k + stages < count:
                    self.prefetch_indices(m, shared, (k + stages) % PIPELINE_INDEX_SLOTS, slab + stages * grid, heads,
                                          lane)
            cute.arch.mbarrier_wait(shared.full + stage, (k // stages) % 2)
            self.run_slab(m, shared, stage, slab, heads, tidx)
            cute.arch.barrier()  # every thread is done with the stage and the shared buffers

    @cute.jit
    def run_slab(self, m: KernelArgs, shared: Shared, stage: Int32, slab: Int32, heads: Int32, tidx: Int32):
        """One slab from its landed stage: the register kernel's tokens, or a padding lane's zero ``out``."""
        b, h, dtile = self.slab_coordinates(slab, heads)
        src = shared.sHeader[stage, 0]
        dst = shared.sHeader[stage, 1]
        if src >= 0:
            cta = self.live_cta(m, b, h, dtile, tidx, src, dst, src >= 0, dst >= 0)
            if const_expr(self.scaled):  # an 8-bit state's scales, into registers with the staging loads
                cta = cta._replace(scales=self.group_scales(m, cta))
            staged = shared._replace(sS=shared.sStages[stage, None, None])
            groups = []
            for g in cutlass.range_constexpr(self.layout.row_groups if self.layout.preload else 1):
                groups.append(self.load_state(m, g, cta, staged))
            self.run_tokens(m, cta, staged, groups)
        else:
            self.zero_lane_out(m, b, h, dtile, tidx)
