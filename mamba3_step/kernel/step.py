"""The step kernel's class: one specialisation, and the CTA's life in stage order.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size,
R MIMO rank, T tokens. In dense mode the "pool" tensors have B rows and lane b uses row b.

Grid ``(B, H, D / tile_D)``; one CTA owns one (lane, head, D-tile) slab of the state. The
kernel's global tensors travel as one :class:`~mamba3_step.tensors.KernelArgs` bundle ``m``, the
CTA's values as the bundles of :mod:`.bundles`. :class:`Mamba3StepKernel` composes the parts, one
mixin per module, and holds the state's storage format (:mod:`.state_formats`, chosen once).
:meth:`Mamba3StepKernel.kernel` runs the stages in this order (thread layout: :mod:`mamba3_step.tiling`):

==  ==================  ===============  ==========================================================
1   ``select_rows``     here             lane -> (src, dst, src_live, dst_live); padding lanes go
                                         straight to ``zero_out`` (epilogue); replay: ``ring_count``
2   ``load_state``      :mod:`.slab`     the thread's rows of the slab, 16-byte loads, issued first
                                         (``async_state_copy``: :mod:`.async_state` copies them to
                                         shared memory here and stage 5 reads them from there)
3   ``stage_operands``  :mod:`.staging`  B, Bstate, C -> (R, N) fp32 in shared memory, and per tile
                                         row the coefficients; with rotary ``advance_angles`` first
                                         and B, C rotated (:mod:`.rotary`)
4   ``store_kv_state``  :mod:`.staging`  update_kv_state: staged B / x -> Bstate / Xstate[dst]
5   ``update_rows``     :mod:`.update`   the new state in registers, stored through the state's
                                         format, and the thread's partials of y
6   ``reduce_rows``     :mod:`.epilogue` partials completed over the row's lanes -> sY
7   ``store_state``     :mod:`.slab`     16-byte stores of the new state to row dst
8   ``epilogue``        :mod:`.epilogue` y + D x xproj, z gate, outproj -> out
==  ==================  ===============  ==========================================================

Stages 3-8 run once per token: :mod:`.tokens` (the step's T tokens), or a replay step
(:mod:`.replay`: the ring replayed, the live token or the drafts; with outputs from the checkpoint
:mod:`.checkpoint` for an append and :mod:`.drafts` for a verify step's drafts). Stochastic
rounding's random words are :mod:`.philox`, single PTX instructions :mod:`.ptx_ops`, the compile
function and its fake arguments :mod:`.compile`.
"""

from __future__ import annotations

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from ..contract import SCALED_STATE_DTYPES
from ..rounding import N_PER_CALL
from ..spec import StepSpec
from ..tensors import KernelArgs
from ..slab_pipeline import launch_bound, pipeline_grid
from ..tiling import (async_copy_layout, early_epilogue, launch_cluster, launch_grid, pinned_loads, thread_layout,
                      tiling_problem)
from .async_state import AsyncStateCopy
from .bundles import CUTLASS_DTYPES, Cta, Shared
from .checkpoint import CheckpointOutputs
from .drafts import DraftOutputs
from .epilogue import Epilogue, reduction_plan
from .philox import RandomBits
from .pipeline import SlabPipeline
from .replay import Replay
from .rotary import Rotary
from .slab import Slab
from .staging import Staging
from .state_formats import state_format
from .tokens import TokenSteps
from .update import StateUpdate

__all__ = ["Mamba3StepKernel"]


class Mamba3StepKernel(TokenSteps, Replay, CheckpointOutputs, DraftOutputs, Staging, Rotary, Slab, AsyncStateCopy,
                       SlabPipeline, StateUpdate, Epilogue, RandomBits):
    """One specialisation of the step kernel (see :class:`~mamba3_step.spec.StepSpec`)."""

    def __init__(self, spec: StepSpec):
        problem = tiling_problem(spec)
        assert problem is None, problem  # the wrapper validated user input already
        self.spec = spec
        self.N = spec.dstate
        self.D = spec.headdim
        self.R = spec.mimo
        self.tile_D = spec.tile_D
        lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo,
                            spec.carried_tokens, spec.stochastic_rounding)
        if spec.async_state_copy:  # the slab in shared memory: a one-token step's row groups are small
            lay = async_copy_layout(lay, spec.state_dtype, spec.carried_tokens)
        self.layout = lay
        self.num_threads = lay.num_threads
        self.state_dtype = CUTLASS_DTYPES[spec.state_dtype]
        self.kv_dtype = CUTLASS_DTYPES[spec.kv_dtype]
        self.x_dtype = CUTLASS_DTYPES[spec.x_dtype]
        self.proj_dtype = CUTLASS_DTYPES[spec.proj_dtype]
        self.pool = spec.pool
        self.has_dst = spec.has_dst
        self.update_kv_state = spec.update_kv_state
        self.cluster = launch_cluster(spec)  # the D-tiles of a (lane, head) as one cluster, or None
        self.programmatic_launch = spec.programmatic_launch  # indices and state rows read before griddepcontrol.wait
        self.has_z = spec.has_z
        self.has_outproj = spec.has_outproj
        self.has_state_out = spec.has_state_out
        self.T = spec.tokens
        self.dst_per_token = spec.dst_per_token
        self.num_accepted = spec.num_accepted
        self.rope_angles = spec.rope_angles  # rotary angles per head; 0: no rotary
        self.rotate_pairwise = spec.rotate_pairwise
        self.has_bc_bias = spec.has_bc_bias
        self.shared_bc = spec.shared_bc
        self.stochastic = spec.stochastic_rounding
        #: replay (docs/contract.md, "Replay"): the flush length, the ring tokens a row holds before its state is
        #: stored again; 0: no replay
        self.flush_length = spec.replay_ring
        self.replay = self.flush_length > 0
        self.ring_entries = spec.ring_entries  # the most committed ring entries a step replays
        #: replay's appends compute out from the checkpoint and the ring (else by replaying the state)
        self.checkpoint_outputs = self.flush_length > 0 and spec.replay_from_checkpoint
        #: a verify step's drafts take out from the checkpoint by the algebra (else they are stepped)
        self.checkpoint_draft_outputs = self.checkpoint_outputs and self.T > 1
        #: the drafts' token slots (Drafts), the most (draft i, token j) pairs of their tables (i + 2 tokens
        #: after a flush, up to flush_length + i + 1 with flush_length - 1 committed), and their B/C rows' padded words
        self.slots = self.flush_length + self.T
        self.draft_pairs = self.T * (self.flush_length + 1) + self.T * (self.T - 1) // 2
        self.draft_row = self.N + 4
        #: an 8-bit state with a scale per (row, head, d) (docs/contract.md, "8-bit states")
        self.scaled = spec.state_dtype in SCALED_STATE_DTYPES
        #: a 16-bit state's 16-byte vector is one Philox call's 8 elements, an 8-bit one's two calls' 16
        #: (mamba3_step.rounding)
        assert not self.stochastic or lay.VN in (N_PER_CALL, 2 * N_PER_CALL), "stochastic rounding: 16- or 8-bit"
        assert not self.scaled or self.stochastic, "an 8-bit state is always rounded stochastically"
        #: the state is stored after each token only when every token has its own row
        self.store_each = self.T == 1 or self.dst_per_token
        self.group_rows = lay.rows_per_pass * lay.rows_per_group  # tile rows in one row group
        self.reduce_plan, self.reduce_plain_mask = reduction_plan(lay.partials_per_group, lay.TPR)
        #: row stride of the coefficients in shared memory (words), and whether their rows are skewed
        self.uv_stride, self.uv_skewed = self.coefficient_rows(spec)
        #: lanes sharing one row of the epilogue (each takes R / split ranks)
        self.epilogue_split = max(1, min(self.R, lay.num_threads // self.tile_D, 32))
        #: ascending: each round joins neighbouring subtrees of the ranks' pairwise sum (epilogue)
        self.epilogue_masks = [1 << k for k in range(self.epilogue_split.bit_length() - 1)]
        #: how the state is held and stored (plain, stochastically rounded, 8-bit with scales), chosen once
        self.storage = state_format(self)
        #: the slab arrives in shared memory by cp.async (:mod:`.async_state`), else by loads into registers
        self.async_state = spec.async_state_copy
        #: a stepwise token of the register kernel loads the epilogue's operands at its start, where that keeps the
        #: CTAs per SM (tiling.EARLY_EPILOGUE_WARPS); a replay step's epilogue, and the asynchronous copy's, load late
        self.early_epilogue = early_epilogue(spec)
        #: a barrier after the first token's loads pins them above their first use (tiling.pinned_loads)
        self.pinned_loads = pinned_loads(spec)
        #: persistent CTAs walk the slabs with the next one's state in flight (:mod:`.pipeline`); 0: a CTA per slab
        self.pipeline_ctas = spec.pipeline_ctas

    @cute.jit(preprocess=False)
    def __call__(self, state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, zproj, outproj, z, out, state_out,
                 state_batch_indices, dst_state_batch_indices, num_accepted_tokens, angle_state, angle_proj, B_bias,
                 C_bias, rand_seed, rand_rows, state_scale, ring_B, ring_x, ring_coef, ring_length, ring_angle,
                 ring_offset, ring_drawn_for, null_slot, stream):
        """The DSL entry point: one parameter per :class:`~mamba3_step.tensors.KernelArgs` field, in its
        order, then the stream; packs them into the bundle and launches (:meth:`launch`).

        The compiled function is called through tvm-ffi, which passes a tuple argument as an ffi
        Array (about twice the host cost of flat arguments), so the launcher keeps one parameter per
        field, and the compiled signature shows their names. The list is written out here;
        tests/kernel/test_kernel_parts.py checks that it is ``KERNEL_ARGUMENT_NAMES`` plus the stream.
        """
        self.launch(KernelArgs(
            state=state, Bstate=Bstate, Xstate=Xstate, A=A, B=B, C=C, D=D, x=x, dt=dt, trap=trap, xproj=xproj,
            zproj=zproj, outproj=outproj, z=z, out=out, state_out=state_out, state_batch_indices=state_batch_indices,
            dst_state_batch_indices=dst_state_batch_indices, num_accepted_tokens=num_accepted_tokens,
            angle_state=angle_state, angle_proj=angle_proj, B_bias=B_bias, C_bias=C_bias, rand_seed=rand_seed,
            rand_rows=rand_rows, state_scale=state_scale, ring_B=ring_B, ring_x=ring_x, ring_coef=ring_coef,
            ring_length=ring_length, ring_angle=ring_angle, ring_offset=ring_offset, ring_drawn_for=ring_drawn_for,
            null_slot=null_slot), stream)

    def launch(self, m: KernelArgs, stream):
        """Launch :meth:`kernel` on ``m`` (traced inside ``__call__``). With a launch bound
        (``slab_pipeline.launch_bound``: ``min_ctas_per_sm``, or the slab pipeline's) it goes with it,
        and the device's default shared-memory carveout (-1) so that compiling asks no device; with
        ``tiling.launch_cluster`` the D-tiles of a (lane, head) are launched as one cluster; with
        ``programmatic_launch`` with programmatic stream serialization (:meth:`after_prologue`)."""
        bound = launch_bound(self.spec)
        bound = dict(min_blocks_per_mp=bound, preferred_smem_carveout=-1) if bound else {}
        grid = (pipeline_grid(m.x.shape[0], m.xproj.shape[1], self.D, self.tile_D, self.pipeline_ctas, cutlass.min)
                if const_expr(self.pipeline_ctas) else launch_grid(m.x.shape[0], m.xproj.shape[1], self.D, self.tile_D))
        options = dict(cluster=self.cluster) if const_expr(self.cluster is not None) else {}
        if const_expr(self.programmatic_launch):
            options["use_pdl"] = True
        self.kernel(m).launch(
            grid=grid,
            block=(self.num_threads, 1, 1),
            stream=stream,
            **bound,
            **options,
        )

    @cute.kernel
    def kernel(self, m: KernelArgs):
        """One CTA, in launch order: select its rows; allocate shared memory and load the slab;
        run the tokens; store the final state when it is stored once. A padding lane only
        zeroes its ``out``. The slab pipeline's CTA walks many slabs instead (:meth:`walk_slabs`)."""
        if const_expr(self.pipeline_ctas):
            self.walk_slabs(m)
        else:
            self.one_slab(m)

    @cute.jit
    def one_slab(self, m: KernelArgs):
        """The CTA of slab ``block_idx`` (:meth:`kernel`)."""
        tidx, _, _ = cute.arch.thread_idx()
        b, h, dtile = cute.arch.block_idx()

        src, dst, src_live, dst_live = self.select_rows(m, b)
        count = Int32(0)
        if const_expr(self.replay):  # the row's committed ring tokens; a count out of range is padding
            count, live = self.ring_count(m, b, src, h, src_live)
            src_live, dst_live = live, dst_live & live
        if src_live:
            shared = self.allocate_shared()
            # Issue every state load first: they are the bytes that matter.
            cta = self.live_cta(m, b, h, dtile, tidx, src, dst, src_live, dst_live)
            groups = []  # RowGroup per row group, loaded up front with preload (else by token_step)
            if const_expr(self.async_state):  # the slab to shared memory; read by row group when updated
                scales = self.issue_state_copies(m, shared.sS, cta)
                cta = cta._replace(scales=scales if const_expr(self.scaled) else None)
                if const_expr(self.replay):  # the replay forms read the whole slab before their tokens
                    for g in cutlass.range_constexpr(self.layout.row_groups):
                        groups.append(self.load_state(m, g, cta, shared))
            else:
                for g in cutlass.range_constexpr(self.layout.row_groups if self.layout.preload else 1):
                    groups.append(self.load_state(m, g, cta))
            if const_expr(self.programmatic_launch):
                self.after_prologue()
                cta = cta._replace(seed=self.rng_source(m, b) if const_expr(self.stochastic) else None)
            if const_expr(self.replay):
                self.replay_tokens(m, count, cta, shared, groups)
            else:
                self.run_tokens(m, cta, shared, groups)
        else:
            if const_expr(self.programmatic_launch):
                self.after_prologue()
            self.zero_lane_out(m, b, h, dtile, tidx)

    def after_prologue(self):
        """``programmatic_launch``: the CTA has read the indices and issued its state loads, all it may read
        while the previous kernel runs; it waits for that kernel's completion and writes (``griddepcontrol.wait``)
        before any other access, then lets the next kernel start (``launch_dependents``): no earlier, so that when
        the next one starts every kernel before this one has completed."""
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def live_cta(self, m: KernelArgs, b: Int32, h: Int32, dtile: Int32, tidx: Int32, src: Int32, dst: Int32,
                 src_live: Boolean, dst_live: Boolean) -> Cta:
        """The :class:`Cta` of a live slab ``(b, h, dtile)`` for thread ``tidx``, reading row ``src`` and writing
        ``dst`` (stochastic rounding: with the lane's random-bit source)."""
        lane = tidx % self.layout.TPR
        # programmatic launch: one slab's CTA reads the seed after its wait (one_slab); the pipeline's are past it
        seed = self.rng_source(m, b) if const_expr(self.stochastic and (not self.programmatic_launch or
                                                                       self.pipeline_ctas)) else None
        return Cta(b, h, dtile, tidx, lane, self.lane_permutation(lane), src, dst, src_live, dst_live, seed)

    @cute.jit
    def zero_lane_out(self, m: KernelArgs, b: Int32, h: Int32, dtile: Int32, tidx: Int32):
        """A padding lane's slab: ``out`` = 0 for each of its tokens (:meth:`zero_out`)."""
        for t in cutlass.range_constexpr(self.T):
            self.zero_out(m.out, self.lane_index(b, t), h, dtile, tidx)

    def allocate_shared(self) -> Shared:
        """The CTA's shared buffers (:class:`Shared`), 16-byte aligned."""
        smem = cutlass.memory.SmemAllocator()
        columns, column_stride = self.operand_columns()
        rn = cute.make_layout((self.R, columns), stride=(self.N, column_stride))
        rd = cute.make_layout((self.R, self.tile_D), stride=(self.tile_D, 1))
        return Shared(
            sBB=smem.allocate_tensor(
                Float32, cute.make_layout((2, self.R, columns), stride=(self.R * self.N, self.N, column_stride)), 16),
            sC=smem.allocate_tensor(Float32, rn, 16),
            sX=smem.allocate_tensor(Float32, cute.make_layout(self.tile_D), 16),
            sXr=smem.allocate_tensor(Float32, rd, 16),
            sUV=smem.allocate_tensor(Float32, self.uv_layout(), 16),
            sY=smem.allocate_tensor(Float32, rd, 16),
            sAng=smem.allocate_tensor(Int64, cute.make_layout(self.rope_angles), 16) if const_expr(self.rope_angles) else None,
            sCS=smem.allocate_tensor(Float32, cute.make_layout((2, self.rope_angles), stride=(self.rope_angles, 1)), 16)
            if const_expr(self.rope_angles) else None,
            sG=smem.allocate_tensor(Float32, cute.make_layout((self.flush_length, self.R, self.R), stride=(self.R * self.R,
                                                                                               self.R, 1)), 16)
            if const_expr(self.checkpoint_outputs and self.T == 1) else None,
            # flush_length + 1 words, padded to whole 16-byte vectors: the compiler reads them four at a time
            sW=smem.allocate_tensor(Float32, cute.make_layout(-(-(self.flush_length + 1) // 4) * 4), 16)
            if const_expr(self.checkpoint_outputs and self.T == 1) else None,
            sWp=smem.allocate_tensor(Float32, cute.make_layout(-(-self.flush_length // 4) * 4), 16)
            if const_expr(self.checkpoint_outputs and self.T == 1 and self.rope_angles > 0) else None,
            drafts=self.allocate_drafts(smem) if const_expr(self.checkpoint_draft_outputs) else None,
            sS=smem.allocate_tensor(self.state_dtype, cute.make_layout((self.tile_D, self.N), stride=(self.N, 1)), 16)
            if const_expr(self.async_state) else None,
            **(self.allocate_stages(smem) if const_expr(self.pipeline_ctas) else {}),
        )

    def coefficient_rows(self, spec: StepSpec) -> tuple:
        """``(uv_stride, uv_skewed)`` of ``sUV``: 16-byte rows of ``uv_stride`` words. The rows a warp's lanes read at
        once are rows_per_pass apart; where that puts them in the same banks, each row is padded by a vector, or, in
        the slab pipeline compiled for 3 CTAs per SM (slab_pipeline.launch_bound: its stages' budget is sized for
        them), a row of two vectors is skewed instead (:meth:`uv_layout`)."""
        stride = -(-2 * self.R // 4) * 4
        if (stride * self.layout.rows_per_pass) % 32:
            return stride, False
        if spec.pipeline_ctas and launch_bound(spec) and stride == 8:
            return stride, True
        return stride + 4, False

    def operand_columns(self) -> tuple:
        """The ``N`` mode of the staged operand rows ``sBB``/``sC`` (fp32): ``(N, 1)``; or, in the slab pipeline
        compiled for 3 CTAs with a lane's columns wider than one 16-byte vector (a 16- or 8-bit state: ``VN`` fp32
        values), the lane's ``VN / 4`` vectors ``TPR`` vectors apart (column ``e + 4 h + VN (lane + TPR c)`` at word
        ``e + 4 TPR h + 4 lane + VN TPR c``), so the quarter warp's lanes read consecutive vectors, not every other one
        (a 2-way bank conflict on every operand load). Not with stochastic rounding: under the launch bound its
        168 registers do not hold the addresses (16 bytes of spill)."""
        lay = self.layout
        if not (self.uv_skewed and lay.VN > 4 and not self.stochastic):
            return self.N, 1
        return (4, lay.VN // 4, lay.TPR, lay.CPT), (1, 4 * lay.TPR, 4, lay.VN * lay.TPR)

    def uv_layout(self):
        """``sUV``'s layout: ``(tile_D, 2R)`` rows of ``uv_stride`` words; skewed (``uv_skewed``): row
        ``d = a + p j`` (``p = rows_per_pass``, ``a < p``) starts at word ``8 a + (8 p + 4) (j % 4) + (32 p + 12) (j // 4)``,
        so the rows ``p`` apart that a quarter warp reads at once (consecutive ``j`` of one group of four) take
        different 16-byte bank slots, in 832 bytes less than the padded rows of the flagship's tile (2,240 against
        3,072: what gives its fp32 slab pipeline a third CTA per SM); every row still starts on 16 bytes, so its
        vectors are read whole."""
        if not self.uv_skewed:
            return cute.make_layout((self.tile_D, 2 * self.R), stride=(self.uv_stride, 1))
        shape, stride = self.uv_skew()
        return cute.make_layout((shape, 2 * self.R), stride=(stride, 1))

    def uv_skew(self) -> tuple:
        """The skewed rows' ``(shape, stride)`` in words: modes ``a``, ``j % 4``, ``j // 4`` (:meth:`uv_layout`)."""
        p = self.layout.rows_per_pass
        j = self.tile_D // p
        return (p, min(j, 4), -(-j // 4)), (8, 8 * p + 4, 32 * p + 12)

    def uv_rows(self, cta: Cta, g: int) -> list:
        """The skewed ``sUV`` coordinates ``(a, j % 4, j // 4)`` of the thread's register rows of group ``g``
        (:meth:`~.slab.Slab.thread_rows`: ``a = tidx // TPR``, below rows_per_pass, and ``j = g rows_per_group +
        (rho ^ i)``), from the thread's own values rather than divided out of each row."""
        lay = self.layout
        rho = cta.phi >> (self.R.bit_length() - 1)
        a = cta.tidx // lay.TPR
        out = []
        for i in range(lay.rows_per_group):
            j = g * lay.rows_per_group + (rho ^ i)
            out.append((a, j % 4, j // 4) if self.tile_D // lay.rows_per_pass >= 4 else (a, j, 0))
        return out

    @cute.jit
    def select_rows(self, m: KernelArgs, b: Int32):
        """Lane ``b`` -> ``(src, dst, src_live, dst_live)``.

        Dense mode: row b, always live. Pool mode: ``src = state_batch_indices[b]``, or with
        num_accepted ``state_batch_indices[b, num_accepted_tokens[b] - 1]`` (a count outside
        [1, candidates] makes the lane padding, and nothing outside the index tensor is read); a row is
        padding when negative, ``>= num_rows`` (P) or equal to ``null_slot``. ``dst`` defaults
        to ``src``; ``dst_live`` requires a live src too. With a destination per token, ``dst``
        here is unused (each token reads its own).
        """
        num_rows = m.state.shape[0]
        src = Int32(b)
        dst = Int32(b)
        src_live = Boolean(True)
        dst_live = Boolean(True)
        if const_expr(self.pool):
            src = self.source_row(m, b)
            src_live = self.row_is_live(src, num_rows, m.null_slot)
            dst = src
            dst_live = src_live
            if const_expr(self.has_dst and not self.dst_per_token):
                dst = m.dst_state_batch_indices[b]
                dst_live = src_live & self.row_is_live(dst, num_rows, m.null_slot)
        return src, dst, src_live, dst_live

    @cute.jit
    def source_row(self, m: KernelArgs, b: Int32) -> Int32:
        """Pool mode: lane ``b``'s source row as the index says it, ``state_batch_indices[b]``, or with
        num_accepted (and no replay, whose count commits ring entries instead) the accepted candidate
        ``state_batch_indices[b, num_accepted_tokens[b] - 1]``, -1 for a count outside [1, candidates]."""
        if const_expr(self.num_accepted and not self.replay):
            k = m.num_accepted_tokens[b] - 1
            src = Int32(-1)
            if (k >= 0) & (k < m.state_batch_indices.shape[1]):
                src = m.state_batch_indices[b, k]
        else:
            src = m.state_batch_indices[b]
        return src

    @cute.jit
    def row_is_live(self, row: Int32, num_rows: Int32, null_slot: Int32) -> Boolean:
        return (row >= 0) & (row < num_rows) & (row != null_slot)

    def lane_index(self, b: Int32, t) -> tuple:
        """The leading coordinates of lane ``b``, token ``t`` in a per-lane tensor: ``(b,)`` when the
        specialisation has one token (no token axis), else ``(b, t)``."""
        return (b,) if self.T == 1 else (b, t)

    @cute.jit
    def for_thread_indices(self, n: int, tidx: Int32, body: Callable, spread: int = 1, guarded: bool = True):
        """``body(i)`` for each index ``i`` of ``[0, n)`` that thread ``tidx`` takes when the
        block's threads stride over it, ``spread`` adjacent threads per index:
        ``i = (tidx + k * num_threads) // spread`` for ``k = 0, 1, ...`` (unrolled).

        Each call is guarded by ``i < n``; ``guarded=False`` calls ``body`` for every ``k`` and
        leaves the test to it (a body whose threads must all reach a shuffle). Where ``n * spread``
        is a multiple of the block the test always holds and the compiler drops it (the kernel's
        thread count bounds ``tidx``).

        ``body`` is usually a closure. The DSL's preprocessor cannot store through a tensor the
        closure captures inside a runtime ``if`` (it rebinds the name); such a tensor is bound to a
        local name at the top of the closure first.
        """
        nt = self.num_threads
        for k in cutlass.range_constexpr((n * spread + nt - 1) // nt):
            i = tidx + k * nt
            if const_expr(spread > 1):
                i = i // spread
            if const_expr(guarded):
                if i < n:
                    body(i)
            else:
                body(i)
