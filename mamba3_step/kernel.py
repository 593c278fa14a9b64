"""The CuteDSL Mamba-3 MIMO decode-step kernel: the kernel class and its compile function.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size,
R MIMO rank. In dense mode the "pool" tensors have B rows and lane b uses row b.

Grid ``(B, H, D / tile_D)``; one CTA owns one (lane, head, D-tile) slab of the state. The
kernel's global tensors travel as one :class:`~mamba3_step.tensors.KernelArgs` bundle ``m``
(``m.state`` is CuTe's mState), the CTA's coordinates and rows as one :class:`Cta`, its shared
buffers as one :class:`Shared`, and one token's coordinates and coefficients as one
:class:`Token`. The device work is split into small ``@cute.jit`` stages (thread layout:
:mod:`mamba3_step.tiling`):

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

With rotary (``angle_state``; docs/contract.md, "Rotary angle") each token first runs
:meth:`Mamba3StepKernel.advance_angles` (threads ``i < S``: the angle advanced in fixed point, its
cos/sin to shared memory, the angle stored to row ``dst``) and a barrier, and step 3 stages B and
C through :meth:`Mamba3StepKernel.stage_rotated` (bias, rotation, fp32 in shared memory); a
token ``t > 0`` first rounds the previous token's staged B~ to the kv dtype
(:meth:`Mamba3StepKernel.round_previous_b`), the value a one-token step reads back from Bstate.

With stochastic rounding (a 16-bit state and ``rand_seed``; docs/contract.md) step 5 rounds each
16-byte vector of the new state through :meth:`Mamba3StepKernel.store_rounded`: one Philox4x32-10
call (:meth:`Mamba3StepKernel.philox`) for its 8 elements' random bits, then
:meth:`Mamba3StepKernel.round_bf16_pair` per bf16 pair or :meth:`Mamba3StepKernel.round_fp16`
per fp16 element (the rules of :mod:`mamba3_step.rounding`, on the fp32 pattern, without branches).
An 8-bit state (int8, e4m3; docs/contract.md, "8-bit states") is read as ``q * scale`` (the row's
scale loaded with it by step 2) and stored through :meth:`Mamba3StepKernel.store_quantized` after
the row group's update: each row's absmax over its TPR lanes, its scale, and per 16-byte vector
two Philox calls for :meth:`Mamba3StepKernel.quantize_int8` (per code) or
:meth:`Mamba3StepKernel.round_e4m3` (converted in pairs); the row's first lane stores the scale.

A T-token specialisation (speculative decoding) loads the slab once (2) and runs 3-8 once per
token, :meth:`Mamba3StepKernel.token_step`, in a loop unrolled at trace time: the state stays
in registers between tokens, the previous token's B stays in the other half of a two-parity
shared buffer and its x is re-read from ``x``; the state (and B/x) is stored after every token
with a (B, T) destination, else once after the last.

Without a GPU the compiled kernel is verified by executing its PTX on the CPU
(:mod:`mamba3_step.tools.ptx_tier`, docs/ptx-tier.md).

Where this module sits (docs/design.md, "Architecture"): it imports cutlass, so only the build
layer (:mod:`mamba3_step.build`) imports it, on the first compile. Launching goes through
:mod:`mamba3_step.launch` and the compile cache, which never import this module; the runtime
arguments (:class:`~mamba3_step.tensors.KernelArgs`) are declared, free of cutlass, in
:mod:`mamba3_step.tensors`. Whatever this module imports from the package is part of the disk
cache's key (:func:`mamba3_step.build.kernel_sources`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint16, Uint32, Uint64, const_expr
from cutlass._mlir.dialects import llvm

from .contract import DTYPES, SCALED_STATE_DTYPES
from .rotary import ANGLE_UNIT_RADIANS
from .rounding import N_PER_CALL, PHILOX_M, PHILOX_W, QMAX, SMALL_ROW, SUBNORMAL_GRIDS
from .spec import StepSpec
from .tensors import KERNEL_ARGUMENT_NAMES, KernelArgs
from .tiling import launch_grid, thread_layout, tiling_problem

__all__ = ["CUTLASS_DTYPES", "Cta", "Mamba3StepKernel", "Operands", "RowGroup", "Shared", "Token",
           "argument_masks", "compile_step_kernel", "fake_arguments"]

#: the contract's dtype table, as CuteDSL types
CUTLASS_DTYPES = {name: getattr(cutlass, d.cutlass) for name, d in DTYPES.items()}


class Cta(NamedTuple):
    """One live CTA's coordinates, its thread, and the pool rows it reads and writes (dynamic
    values, fixed for the CTA's life except ``dst``/``dst_live`` with a row per token)."""

    b: Any  # Int32: the batch lane
    h: Any  # Int32: the head
    dtile: Any  # Int32: the D-tile
    tidx: Any  # Int32: the thread
    lane: Any  # Int32: the thread's lane among the TPR threads of its rows (tidx % TPR)
    phi: Any  # Int32: the lane's slot permutation (Mamba3StepKernel.lane_permutation)
    src: Any  # Int32: the row the state and Bstate/Xstate are read from
    dst: Any  # Int32: the row they are written to
    src_live: Any  # Boolean: src is a real row (else the lane is padding)
    dst_live: Any  # Boolean: dst is a real row (and src too)
    seed: Any = None  # (seed, offset, row) from rand_seed (and rand_rows), read once (stochastic rounding only)


class Shared(NamedTuple):
    """The CTA's shared-memory buffers, fp32."""

    sBB: Any  # (2, R, N): this token's B and the previous one, by token parity
    sC: Any  # (R, N): C
    sX: Any  # (tile_D,): x
    sXr: Any  # (R, tile_D): x * xproj
    sUV: Any  # (tile_D, 2R): row coefficients u_r = gamma xr, v_r = beta xprev xproj_r
    sY: Any  # (R, tile_D): sum_n new * C
    sAng: Any = None  # (S,) Int64: the lane's angles after this token (rotary only)
    sCS: Any = None  # (2, S): cos and sin of sAng (rotary only)
    sG: Any = None  # (K, R, R): B_j . C per token j since the checkpoint (replay's checkpoint outputs only)
    sW: Any = None  # (K + 1,): the tokens' weights w_j and the decay product P (replay's checkpoint outputs only)
    sWp: Any = None  # (K,): with rotary, w_j's trapezoid part (token j's B~ rounded, as token j + 1 reads it)
    drafts: Any = None  # Drafts: a verify step's tokens, staged at once (replay's checkpoint outputs with T > 1)


class Drafts(NamedTuple):
    """A verify step's tokens staged together for the drafts' outputs from the checkpoint
    (``replay_from_checkpoint`` with T > 1), fp32, by slot: slot 0 the token before the ring
    (Bstate/Xstate's, or after a flush the last committed token's), slots 1..K-1 the committed ring
    tokens the algebra reads (none after a flush), slots K..K+T-1 the drafts. The B and C rows are
    padded to N + 4 words, so the rows a quarter-warp reads at one column fall in different banks."""

    sB: Any  # (K + T, R, N): each slot's B
    sC: Any  # (T, R, N): each draft's C
    sX: Any  # (K + T, tile_D): each slot's x
    sXr: Any  # (T, R, tile_D): each draft's x * xproj (the epilogue's skip term)
    sY: Any  # (T, R, tile_D): each draft's y, the checkpoint's term, then all of it
    sG: Any  # (pairs, R, R): per draft i and token j <= ring + i + 1, w_ij B_j . C_i (pairs in (i, j) order)
    sW: Any  # (T, K + T + 1): w of draft i's token in each slot, and at K + T the decay product P_i


class Token(NamedTuple):
    """One token of the step: its index, coordinates, B buffers and decay coefficients."""

    t: int  # the token index (compile time)
    lane_t: tuple  # the (lane, token)'s leading coordinates in a per-lane tensor (lane_index)
    sB: Any  # (R, N) fp32 shared: this token's B
    sBs: Any  # (R, N) fp32 shared: the previous B (Bstate for token 0)
    alpha: Any  # Float32: exp(A dt)
    beta: Any  # Float32: (1 - trap) dt alpha
    gamma: Any  # Float32: trap dt
    dt: Any  # Float32: dt (the rotary angle's rate)
    rng: Any = None  # (k0, k1, o0, o1[, row]) Uint32: stochastic rounding's key, the token's offset words (and a replayed entry's recorded row)


class RowGroup(NamedTuple):
    """One row group of the thread's share of the state slab."""

    tSrS: Any  # (VN, rows_per_group, CPT) registers in the state dtype, updated in place
    rows: list  # the tile row (Int32) of each register row
    tSrScale: Any = None  # (rows_per_group,) fp32: an 8-bit state's scale per register row, updated in place


class Operands(NamedTuple):
    """B, Bstate and C at the lane's columns, read once per token (``ThreadLayout.cache_operands``)."""

    tOrB: Any  # (R, VN, CPT) fp32 registers
    tOrBs: Any  # (R, VN, CPT) fp32 registers
    tOrC: Any  # (R, VN, CPT) fp32 registers, ranks in the lane's order (slot r: rank r ^ (phi & (R-1)))


def inline_ptx(result_type, text: str, constraints: str, *operands):
    """One inline PTX instruction ``text`` on ``operands`` (DSL numbers), its result as ``result_type``
    (``constraints`` in LLVM's form, result first: ``"=f,f,f"``). Pure: free to be moved or dropped."""
    value = llvm.inline_asm(result_type.mlir_type, [op.ir_value() for op in operands], text, constraints,
                            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return result_type(value)


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


def _flat_call(names: tuple) -> Callable:
    """``__call__(self, <names...>, stream)``: packs its arguments into a :class:`KernelArgs` and
    launches (:meth:`Mamba3StepKernel.launch`).

    The compiled function is called through tvm-ffi, which passes a tuple argument as an ffi
    Array (about twice the host cost of flat arguments), so the launcher keeps one parameter per
    field; it is generated from the field names so that the bundle stays the one declaration,
    and the compiled signature shows those names.
    """
    params = ", ".join(names)
    namespace = {"KernelArgs": KernelArgs}
    exec(f"def __call__(self, {params}, stream):\n    self.launch(KernelArgs({params}), stream)\n", namespace)
    return namespace["__call__"]


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
        lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo,
                            spec.carried_tokens, spec.stochastic_rounding)
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
        self.S = spec.rope_angles  # rotary angles per head; 0: no rotary
        self.rotate_pairwise = spec.rotate_pairwise
        self.has_bc_bias = spec.has_bc_bias
        self.shared_bc = spec.shared_bc
        self.stochastic = spec.stochastic_rounding
        self.K = spec.replay_ring  # replay's flush length; 0: no replay
        self.L = spec.ring_entries  # the most committed ring entries a step replays
        #: replay's appends compute out from the checkpoint and the ring (else by replaying the state)
        self.algebra = self.K > 0 and spec.replay_from_checkpoint
        #: a verify step's drafts take out from the checkpoint by the algebra (else they are stepped)
        self.draft_algebra = self.algebra and self.T > 1
        #: the drafts' token slots (Drafts), the most (draft i, token j) pairs of their tables (i + 2 tokens
        #: after a flush, up to K + i + 1 with K - 1 committed), and their B/C rows' padded words
        self.slots = self.K + self.T
        self.draft_pairs = self.T * (self.K + 1) + self.T * (self.T - 1) // 2
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
        #: row stride of the coefficients in shared memory (words): 16-byte rows, padded so that the
        #: rows a warp's lanes read at once (rows_per_pass apart) fall in different banks
        self.uv_stride = -(-2 * self.R // 4) * 4
        if (self.uv_stride * lay.rows_per_pass) % 32 == 0:
            self.uv_stride += 4
        #: lanes sharing one row of the epilogue (each takes R / split ranks)
        self.epilogue_split = max(1, min(self.R, lay.num_threads // self.tile_D, 32))
        #: ascending: each round joins neighbouring subtrees of the ranks' pairwise sum (epilogue)
        self.epilogue_masks = [1 << k for k in range(self.epilogue_split.bit_length() - 1)]

    # ------------------------------------------------------------------ host side
    #: the DSL entry point, one parameter per KernelArgs field, plus the stream (see _flat_call)
    __call__ = cute.jit(preprocess=False)(_flat_call(KERNEL_ARGUMENT_NAMES))

    def launch(self, m: KernelArgs, stream):
        """Launch :meth:`kernel` on ``m`` (traced inside ``__call__``). With ``min_ctas_per_sm`` the
        launch bound goes with it, and the device's default shared-memory carveout (-1) so that
        compiling asks no device."""
        bound = {}
        if self.spec.min_ctas_per_sm:
            bound = dict(min_blocks_per_mp=self.spec.min_ctas_per_sm, preferred_smem_carveout=-1)
        self.kernel(m).launch(
            grid=launch_grid(m.x.shape[0], m.xproj.shape[1], self.D, self.tile_D),
            block=(self.num_threads, 1, 1),
            stream=stream,
            **bound,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, m: KernelArgs):
        """One CTA, in launch order: select its rows; allocate shared memory and load the slab;
        run the tokens; store the final state when it is stored once. A padding lane only
        zeroes its ``out``."""
        tidx, _, _ = cute.arch.thread_idx()
        b, h, dtile = cute.arch.block_idx()

        src, dst, src_live, dst_live = self.select_rows(m, b)
        count = Int32(0)
        if const_expr(self.K):  # replay: the row's committed ring tokens; a count out of range is padding
            count, live = self.ring_count(m, b, src, h, src_live)
            src_live, dst_live = live, dst_live & live
        if src_live:
            shared = self.allocate_shared()
            # Issue every state load first: they are the bytes that matter.
            lane = tidx % self.layout.TPR
            cta = Cta(b, h, dtile, tidx, lane, self.lane_permutation(lane), src, dst, src_live, dst_live,
                      self.rng_source(m, b) if const_expr(self.stochastic) else None)
            groups = []  # RowGroup per row group, loaded up front with preload (else by token_step)
            for g in cutlass.range_constexpr(self.layout.row_groups if self.layout.preload else 1):
                groups.append(self.load_state(m, g, cta))
            if const_expr(self.K):
                self.replay_tokens(m, count, cta, shared, groups)
            else:
                self.run_tokens(m, cta, shared, groups)
        else:
            for t in cutlass.range_constexpr(self.T):
                self.zero_out(m.out, self.lane_index(b, t), h, dtile, tidx)

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
            if cta.dst_live:
                for g in cutlass.range_constexpr(self.layout.row_groups):
                    self.store_state(groups[g], m, cta)
                if const_expr(self.update_kv_state):
                    self.store_kv_state(m, shared.sBB[(self.T - 1) % 2, None, None], shared.sX, cta)

    def allocate_shared(self) -> Shared:
        """The CTA's shared buffers (:class:`Shared`), 16-byte aligned."""
        smem = cutlass.memory.SmemAllocator()
        rn = cute.make_layout((self.R, self.N), stride=(self.N, 1))
        rd = cute.make_layout((self.R, self.tile_D), stride=(self.tile_D, 1))
        return Shared(
            sBB=smem.allocate_tensor(
                Float32, cute.make_layout((2, self.R, self.N), stride=(self.R * self.N, self.N, 1)), 16),
            sC=smem.allocate_tensor(Float32, rn, 16),
            sX=smem.allocate_tensor(Float32, cute.make_layout(self.tile_D), 16),
            sXr=smem.allocate_tensor(Float32, rd, 16),
            sUV=smem.allocate_tensor(
                Float32, cute.make_layout((self.tile_D, 2 * self.R), stride=(self.uv_stride, 1)), 16),
            sY=smem.allocate_tensor(Float32, rd, 16),
            sAng=smem.allocate_tensor(Int64, cute.make_layout(self.S), 16) if const_expr(self.S) else None,
            sCS=smem.allocate_tensor(Float32, cute.make_layout((2, self.S), stride=(self.S, 1)), 16)
            if const_expr(self.S) else None,
            sG=smem.allocate_tensor(Float32, cute.make_layout((self.K, self.R, self.R), stride=(self.R * self.R,
                                                                                               self.R, 1)), 16)
            if const_expr(self.algebra and self.T == 1) else None,
            # K + 1 words, padded to whole 16-byte vectors: the compiler reads them four at a time
            sW=smem.allocate_tensor(Float32, cute.make_layout(-(-(self.K + 1) // 4) * 4), 16)
            if const_expr(self.algebra and self.T == 1) else None,
            sWp=smem.allocate_tensor(Float32, cute.make_layout(-(-self.K // 4) * 4), 16)
            if const_expr(self.algebra and self.T == 1 and self.S > 0) else None,
            drafts=self.allocate_drafts(smem) if const_expr(self.draft_algebra) else None,
        )

    def allocate_drafts(self, smem) -> Drafts:
        """The :class:`Drafts` buffers of a verify step with outputs from the checkpoint, 16-byte aligned."""
        T, R, N, tD, w = self.T, self.R, self.N, self.tile_D, self.draft_row

        def rows(tokens):  # (tokens, R, N), rows padded to w words
            return smem.allocate_tensor(Float32, cute.make_layout((tokens, R, N), stride=(R * w, w, 1)), 16)

        def per_token(tokens, inner):  # (tokens, *inner), row-major
            shape = (tokens,) + inner
            stride = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
            return smem.allocate_tensor(Float32, cute.make_layout(shape, stride=stride), 16)

        return Drafts(sB=rows(self.slots), sC=rows(T), sX=per_token(self.slots, (tD,)), sXr=per_token(T, (R, tD)),
                      sY=per_token(T, (R, tD)), sG=per_token(self.draft_pairs, (R, R)),
                      sW=per_token(T, (self.slots + 1,)))

    def state_target(self, m: KernelArgs):
        """Where the new state goes: ``state_out`` in dense mode with it, else the state itself."""
        return m.state_out if self.has_state_out else m.state

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
                    rng=self.token_rng(cta.seed, t) if const_expr(self.stochastic) else None)
        if const_expr(self.S > 0):
            if const_expr(self.dst_per_token):  # the angle is stored by advance_angles
                cta = self.token_destination(m, t, cta)
            self.advance_angles(m, tok, shared, cta)
            cute.arch.barrier()  # cos/sin of the new angles, for the B/C staging
        if const_expr(t == 0):
            self.stage_kv_row(m.Bstate, (cta.src,), cta.h, sBs, cta)
            Xprev = (m.Xstate, (cta.src,))
        else:
            Xprev = (m.x, self.lane_index(cta.b, t - 1))
            if const_expr(self.S > 0 and self.kv_dtype is not Float32):
                self.round_previous_b(sBs, cta)
        self.stage_operands(m, tok, Xprev, shared, cta)
        cute.arch.barrier()
        # Every read of the old Bstate/Xstate rows happened before the barrier.
        if const_expr(self.dst_per_token and self.S == 0):  # read late: fewer values live while staging
            cta = self.token_destination(m, t, cta)
        if const_expr(self.update_kv_state and self.store_each):
            if cta.dst_live:
                self.store_kv_state(m, sB, shared.sX, cta)
        operands = self.load_operands(tok, shared, cta)
        for g in cutlass.range_constexpr(self.layout.row_groups):
            if const_expr(g >= len(groups)):  # without preload: this group's loads now
                groups.append(self.load_state(m, g, cta))
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

    # ------------------------------------------------------------------ replay (docs/design.md, "Replay")
    @cute.jit
    def ring_count(self, m: KernelArgs, b: Int32, src: Int32, h: Int32, src_live: Boolean):
        """``(count, live)``: the committed ring tokens of (row ``src``, head ``h``), plus with
        ``num_accepted`` the drafts lane ``b`` commits now, and whether the lane is live. A length or
        an accepted count out of range (above ``L``: ``K - 1`` for a one-token step, for a verify
        step ``K - 1 + max(T, replay_draft)``), or a ring of fewer than ``L`` entries, makes the lane
        padding: every ring access stays inside ``ring_B``'s entries."""
        most = self.L
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
        ``replay_from_checkpoint`` only a flush (``count = K - 1``) does and an append's ``out``
        comes from the checkpoint and the ring (:meth:`append_from_checkpoint`)."""
        if const_expr(self.T > 1):
            self.verify_state(m, count, cta, shared, groups)
        elif const_expr(self.algebra):
            if self.flushes(count, cta):
                # the count passed on opaque: the tokens stay conditional, as in every other flush
                # (unconditional, the compiler interleaves them and spills at 4 warps)
                self.replay_state(m, inline_ptx(Int32, "mov.b32 $0, $1;", "=r,r", count), cta, shared, groups)
            else:
                self.append_from_checkpoint(m, count, cta, shared, groups)
        else:
            self.replay_state(m, count, cta, shared, groups)

    @cute.jit
    def verify_state(self, m: KernelArgs, count: Int32, cta: Cta, shared: Shared, groups: list):
        """A verify step: the ``count`` committed ring tokens replayed in registers
        (:meth:`ring_token`); with ``count >= K`` a flush (:meth:`store_checkpoint`). Then the T
        drafts (:meth:`draft_token`), each writing its ``out`` and its uncommitted ring entry after
        the committed ones. The ring's length becomes the committed count (0 after a flush): a draft
        the next step does not accept is never replayed. With ``replay_from_checkpoint`` only a flush
        replays, and the drafts' outputs come from the checkpoint (the flush's, or the row's) and the
        ring tokens since by the algebra (:meth:`drafts_from_checkpoint`): no draft is stepped."""
        flush = count >= self.K
        if const_expr(self.draft_algebra):
            if flush:  # the count passed on opaque: the tokens stay conditional (see replay_tokens)
                self.replay_committed(m, inline_ptx(Int32, "mov.b32 $0, $1;", "=r,r", count), cta, shared, groups)
                self.store_checkpoint(m, count, flush, cta, shared, groups)
        else:
            self.replay_committed(m, count, cta, shared, groups)
            self.store_checkpoint(m, count, flush, cta, shared, groups)
        first = cutlass.select_(flush, Int32(0), count)  # the drafts' first ring entry
        if const_expr(self.draft_algebra):
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
            if const_expr(self.S > 0):  # the checkpoint's angle: the last committed entry's
                self.for_thread_indices(self.S, cta.tidx, lambda a: self.store_angle_state(m, count, cta, a))

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
        if const_expr(self.S > 0):
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
    def drafts_from_checkpoint(self, m: KernelArgs, count: Int32, ring: Int32, cta: Cta, shared: Shared,
                               groups: list):
        """The T drafts' outputs from the checkpoint in registers (the flush's new one, or the row's
        as loaded) and the ``ring`` committed ring tokens since (``count`` without a flush, else 0),
        by the algebra (docs/design.md, "Replay"): for draft i (token ``k = ring + i + 1``; token 0
        the one before the ring)::

            y_i[r, d] = P_i sum_n s[d, n] C_i[r, n] + sum_{j <= k} sum_r' xr_j[r', d] w_ij B_j[r'] . C_i[r]

        In order: every token staged (:meth:`stage_drafts`); per draft the checkpoint's contraction
        with its C (:meth:`contract_rows`) and its ring entry ``ring + i``; the tables
        (:meth:`draft_grams`); the terms (:meth:`combine_drafts`); each draft's epilogue. Nothing is
        stepped; the state row is written only by a flush."""
        dr = shared.drafts
        self.stage_drafts(m, count, ring, cta, shared)
        cute.arch.barrier()  # the staged tokens, and every read of the ring entries the drafts overwrite
        for i in cutlass.range_constexpr(self.T):
            tok = self.draft_of(i, cta, dr)
            view = shared._replace(sC=dr.sC[i, None, None], sX=dr.sX[self.K + i, None])
            operands = self.load_operands(tok, view, cta)  # C only: the B operands are never read
            for g in cutlass.range_constexpr(self.layout.row_groups):
                self.reduce_rows(self.contract_rows(groups[g], operands, view, cta), dr.sY[i, None, None], cta, g)
            if cta.dst_live:
                self.append_ring(m, ring + i, tok, view, cta)
        self.draft_grams(dr, ring, cta)
        cute.arch.barrier()
        self.combine_drafts(m, dr, ring, cta)
        cute.arch.barrier()
        for i in cutlass.range_constexpr(self.T):
            self.epilogue(m, self.draft_of(i, cta, dr), shared._replace(sY=dr.sY[i, None, None],
                                                                        sXr=dr.sXr[i, None, None]), cta)

    def draft_of(self, i: int, cta: Cta, dr: Drafts) -> Token:
        """Draft ``i`` as a :class:`Token` for the stages that take one (its B staged in ``dr``; its
        decays are in ``dr.sW``)."""
        s = self.K + i
        return Token(i, (cta.b, i), dr.sB[s, None, None], dr.sB[s - 1, None, None], None, None, None, None)

    def draft_slot(self, j, ring):
        """The :class:`Drafts` slot of token ``j`` of a draft's sum (0 the one before the ring, then
        the ``ring`` committed tokens, then the drafts)."""
        return cutlass.select_(j <= ring, j, j + (self.K - 1) - ring)

    def draft_pair(self, i, ring):
        """Draft ``i``'s first pair: the drafts before it have ``ring + 2``, ``ring + 3``, ... tokens."""
        return i * (ring + 2) + ((i * (i - 1)) >> 1)

    @cute.jit
    def stage_drafts(self, m: KernelArgs, count: Int32, ring: Int32, cta: Cta, shared: Shared):
        """The :class:`Drafts` buffers: slot 0 (Bstate/Xstate's row, or after a flush the last committed
        entry's), the ``ring`` committed entries, each draft's B, C, x and x * xproj; thread 0 the
        weights (:meth:`draft_weights`)."""
        dr = shared.drafts
        src, h = cta.src, cta.h
        hbc = 0 if const_expr(self.shared_bc) else h
        flushed = ring < count  # the token before the ring is the last committed one

        def before_b(i):  # i = r * N + n
            sB = dr.sB  # stored under a runtime `if`: a local name (see for_thread_indices)
            r = i // self.N
            n = i - r * self.N
            v = Float32(0.0)
            if flushed:
                v = m.ring_B[src, count - 1, r, h, n].to(Float32)
            else:
                v = m.Bstate[src, r, h, n].to(Float32)
            sB[0, r, n] = v

        self.for_thread_indices(self.R * self.N, cta.tidx, before_b)
        for s in cutlass.range_constexpr(1, self.K):
            if s <= ring:
                self.stage_kv_row(m.ring_B, (src, s - 1), h, dr.sB[s, None, None], cta)
        for i in cutlass.range_constexpr(self.T):
            self.stage_kv_row(m.B, (cta.b, i), hbc, dr.sB[self.K + i, None, None], cta)
            self.stage_kv_row(m.C, (cta.b, i), hbc, dr.sC[i, None, None], cta)
        for s in cutlass.range_constexpr(self.slots):
            if const_expr(s == 0 or s >= self.K):
                self.stage_slot_x(m, s, count, flushed, cta, dr)
            else:
                if s <= ring:
                    self.stage_slot_x(m, s, count, flushed, cta, dr)
        if cta.tidx == 0:
            self.draft_weights(m, ring, cta, dr)

    @cute.jit
    def stage_slot_x(self, m: KernelArgs, s: int, count: Int32, flushed: Boolean, cta: Cta, dr: Drafts):
        """Slot ``s``'s x to ``dr.sX`` (and a draft's x * xproj to ``dr.sXr``)."""
        src, h = cta.src, cta.h
        d0 = cta.dtile * self.tile_D

        def stage(d):
            sX, sXr = dr.sX, dr.sXr  # stored under a runtime `if`: local names (see for_thread_indices)
            x = Float32(0.0)
            if const_expr(s == 0):
                if flushed:
                    x = m.ring_x[src, count - 1, h, d0 + d].to(Float32)
                else:
                    x = m.Xstate[src, h, d0 + d].to(Float32)
            elif const_expr(s < self.K):
                x = m.ring_x[src, s - 1, h, d0 + d].to(Float32)
            else:
                x = m.x[cta.b, s - self.K, h, d0 + d].to(Float32)
                for r in cutlass.range_constexpr(self.R):
                    sXr[s - self.K, r, d] = x * m.xproj[r, h, d0 + d].to(Float32)
            sX[s, d] = x

        self.for_thread_indices(self.tile_D, cta.tidx, stage)

    @cute.jit
    def draft_weights(self, m: KernelArgs, ring: Int32, cta: Cta, dr: Drafts):
        """One thread: per draft i (token ``k = ring + i + 1``) ``sW[i, slot(j)] = gamma_j a_{j+1}..a_k +
        beta_{j+1} a_{j+2}..a_k`` for its tokens j = 0..k (no gamma term for token 0) and
        ``sW[i, K + T] = P_i = a_1..a_k``; the ring tokens' decays from ``ring_coef``, the drafts'
        from the step's inputs. Suffix products from token k down, as the CPU path."""
        sW = dr.sW
        src, h = cta.src, cta.h
        decays = [None]  # by slot; slot 0 has none
        for s in cutlass.range_constexpr(1, self.K):
            alpha, beta, gamma = Float32(1.0), Float32(0.0), Float32(0.0)
            if s <= ring:
                alpha, beta, gamma = self.decay(m.ring_coef[src, s - 1, h, 0], m.ring_coef[src, s - 1, h, 1],
                                                m.ring_coef[src, s - 1, h, 2])[:3]
            decays.append((alpha, beta, gamma))
        for i in cutlass.range_constexpr(self.T):
            decays.append(self.decay_coefficients(m, (cta.b, i), h)[:3])
        for i in cutlass.range_constexpr(self.T):
            suffix = Float32(1.0)  # a_{j+1} .. a_k
            suffix_next = Float32(1.0)  # a_{j+2} .. a_k
            beta_next = Float32(0.0)  # beta_{j+1}; none past k
            for q in cutlass.range_constexpr(i + 1):  # the drafts, the last first
                alpha, beta, gamma = decays[self.K + i - q]
                sW[i, self.K + i - q] = gamma * suffix + beta_next * suffix_next
                suffix_next = suffix
                suffix = suffix * alpha
                beta_next = beta
            for q in cutlass.range_constexpr(self.K - 1):  # the ring tokens, the last first
                s = self.K - 1 - q
                if s <= ring:
                    alpha, beta, gamma = decays[s]
                    sW[i, s] = gamma * suffix + beta_next * suffix_next
                    suffix_next = suffix
                    suffix = suffix * alpha
                    beta_next = beta
            sW[i, 0] = beta_next * suffix_next
            sW[i, self.slots] = suffix

    @cute.jit
    def draft_grams(self, dr: Drafts, ring: Int32, cta: Cta):
        """``sG[p, r', r] = w_ij B_j[r'] . C_i[r]`` for every pair ``p`` of draft i and its token j
        (:meth:`draft_pair`, :meth:`draft_slot`), one entry a thread: four running sums over the
        columns (16-byte shared loads), summed in pairs."""
        R2 = self.R * self.R
        total = (self.T * (ring + 2) + self.T * (self.T - 1) // 2) * R2
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)

        def entry(e):  # e = p * R^2 + r' * R + r
            sG = dr.sG  # stored under a runtime `if`: a local name (see for_thread_indices)
            if e < total:
                p = e // R2
                q = e - p * R2
                rp = q // self.R
                r = q - rp * self.R
                i = Int32(0)
                for t in cutlass.range_constexpr(1, self.T):  # the draft: how many drafts' pairs lie before p
                    i = i + cutlass.select_(p >= self.draft_pair(t, ring), Int32(1), Int32(0))
                slot = self.draft_slot(p - self.draft_pair(i, ring), ring)
                tB = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                tC = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                acc = [Float32(0.0)] * 4
                for c in cutlass.range_constexpr(self.N // 4):
                    cute.copy(atom, cute.local_tile(dr.sB[slot, rp, None], (4,), (c,)), tB)
                    cute.copy(atom, cute.local_tile(dr.sC[i, r, None], (4,), (c,)), tC)
                    for k in cutlass.range_constexpr(4):
                        acc[k] = acc[k] + tB[k] * tC[k]
                sG[p, rp, r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) * dr.sW[i, slot]

        self.for_thread_indices(self.draft_pairs * R2, cta.tidx, entry)

    @cute.jit
    def combine_drafts(self, m: KernelArgs, dr: Drafts, ring: Int32, cta: Cta):
        """Per row d (a thread each) and draft i: ``sY[i, r, d] = P_i sY[i, r, d] + sum_j sum_r' x_j[d]
        xproj[r', d] sG[p(i, j), r', r]``, tokens in order."""
        T, R, K = self.T, self.R, self.K
        h = cta.h
        d0 = cta.dtile * self.tile_D

        def combine(d):
            sY = dr.sY  # stored under a runtime `if`: a local name (see for_thread_indices)
            xp = []
            for rp in cutlass.range_constexpr(R):
                xp.append(m.xproj[rp, h, d0 + d].to(Float32))
            acc = cute.make_rmem_tensor(cute.make_layout(R), Float32)
            for i in cutlass.range_constexpr(T):
                first = self.draft_pair(i, ring)
                for r in cutlass.range_constexpr(R):
                    acc[r] = dr.sW[i, self.slots] * sY[i, r, d]
                for s in cutlass.range_constexpr(K + i + 1):  # slot 0, the ring's (those held), the drafts'
                    if const_expr(s == 0):
                        self.add_token(dr, acc, s, first, d, xp)
                    elif const_expr(s < K):
                        if s <= ring:
                            self.add_token(dr, acc, s, first + s, d, xp)
                    else:
                        self.add_token(dr, acc, s, first + ring + 1 + (s - K), d, xp)
                for r in cutlass.range_constexpr(R):
                    sY[i, r, d] = acc[r]

        self.for_thread_indices(self.tile_D, cta.tidx, combine)

    @cute.jit
    def add_token(self, dr: Drafts, acc: cute.Tensor, s: int, p, d, xp: list):
        """``acc[r] += sum_r' x_s[d] xproj[r', d] sG[p, r', r]``: the token in slot ``s``, pair ``p``."""
        x = dr.sX[s, d]
        for rp in cutlass.range_constexpr(self.R):
            xr = x * xp[rp]
            for r in cutlass.range_constexpr(self.R):
                acc[r] = acc[r] + xr * dr.sG[p, rp, r]

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

    @cute.jit
    def flushes(self, count: Int32, cta: Cta) -> Boolean:
        """Whether a one-token step after ``count`` committed tokens writes the state: at ``K - 1``
        (past it too when the step commits drafts), and whenever the destination is another row
        (that row gets the state after these tokens, the source keeps its checkpoint and ring)."""
        flush = count == self.K - 1
        if const_expr(self.num_accepted):
            flush = count >= self.K - 1  # committed drafts may carry the count past K - 1
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
        """The ``count`` committed ring entries (at most ``L``) stepped on the state in registers,
        in order (:meth:`ring_token`); Bstate, the token before the ring, staged as token -1's B."""
        self.stage_kv_row(m.Bstate, (cta.src,), cta.h, shared.sBB[1, None, None], cta)
        for j in cutlass.range_constexpr(self.L):
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
        if const_expr(self.S > 0):  # B~ again: B, its bias, rotated by the entry's stored angle
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
    def store_angle_state(self, m: KernelArgs, count: Int32, cta: Cta, a: Int32):
        """A verify step's flush: angle ``a`` of the last committed entry to ``angle_state[dst]``."""
        mAngle = m.angle_state
        mAngle[cta.dst, cta.h, a] = m.ring_angle[cta.src, count - 1, cta.h, a]

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
        if const_expr(self.S > 0):
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
    def append_from_checkpoint(self, m: KernelArgs, count: Int32, cta: Cta, shared: Shared, groups: list):
        """An append (``count < K - 1``): ``out`` of token ``k = count + 1`` after the checkpoint
        (token 0 is Bstate/Xstate's, tokens 1..count the ring's, token k this step's) without the
        new state (docs/design.md, "Replay", the algebra)::

            y[r, d] = P sum_n s_0[d, n] C[r, n] + sum_j w_j sum_r' x_j[d] xproj[r', d] G_j[r', r] + D xr[r, d]

        with ``G_j[r', r] = B_j[r'] . C[r]`` (:meth:`gram`), ``w_j`` and ``P`` from the tokens' decays
        (:meth:`token_weights`); then this token is appended to the ring. With rotary, B_j is token
        j's B~ (staged again from its ring entry and angle) in its own update and B~ rounded to the
        kv dtype in token j + 1's trapezoid term, so ``G_j`` carries the two weights
        (:meth:`gram`); C is this token's C~. The state row is read only."""
        src, h = cta.src, cta.h
        lane_t = (cta.b,)
        k = count + 1
        parity = k % 2
        tok = Token(0, lane_t, shared.sBB[parity, None, None], shared.sBB[1 - parity, None, None],
                    *self.decay_coefficients(m, lane_t, h))
        hbc = 0 if const_expr(self.shared_bc) else h
        if const_expr(self.S > 0):
            def store_angle(a, q):  # this token's angle goes with its ring entry
                mRingAngle = m.ring_angle
                if cta.dst_live:
                    mRingAngle[cta.dst, count, h, a] = q

            self.advance_angles(m, tok, shared, cta, start=lambda a: self.current_angle(m, count, cta, a),
                                store=store_angle)
            cute.arch.barrier()  # cos/sin of this token's angles, for its B~ and C~
            self.stage_bc(m, tok, shared, cta)
        else:
            self.stage_kv_row(m.C, lane_t, hbc, shared.sC, cta)
        self.stage_coefficients(m, (m.x, lane_t), lambda dg: Float32(0.0), tok, shared, cta)
        if cta.tidx == 0:
            self.token_weights(m, count, tok, shared, cta)
        cute.arch.barrier()
        operands = self.load_operands(tok, shared, cta)  # C only: the B operands are never read
        for g in cutlass.range_constexpr(self.layout.row_groups):  # first, so the state dies early
            self.reduce_rows(self.contract_rows(groups[g], operands, shared, cta), shared.sY, cta, g)
        if const_expr(self.S > 0):
            self.rotary_grams(m, count, tok, shared, cta)
        else:
            for j in cutlass.range_constexpr(self.K):  # token j's B to sBB[j % 2], then its row of G
                if j <= k:
                    sBj = shared.sBB[j % 2, None, None]
                    if const_expr(j == 0):
                        self.stage_kv_row(m.Bstate, (src,), h, sBj, cta)
                    else:
                        if j <= count:
                            self.stage_kv_row(m.ring_B, (src, j - 1), h, sBj, cta)
                        else:
                            self.stage_kv_row(m.B, lane_t, hbc, sBj, cta)
                    cute.arch.barrier()
                    self.gram(sBj, shared.sC, shared.sG[j, None, None], cta)
        if cta.dst_live:
            self.append_ring(m, count, tok, shared, cta)
            if cta.tidx == 0:
                mLength = m.ring_length
                mLength[cta.dst, h] = count + 1
        cute.arch.barrier()
        self.ring_terms(m, count, shared, cta)
        cute.arch.barrier()
        self.epilogue(m, tok, shared, cta)

    @cute.jit
    def rotary_grams(self, m: KernelArgs, count: Int32, tok: Token, shared: Shared, cta: Cta):
        """With rotary, the weighted tables ``sG[j]`` (:meth:`gram`) of token k (this one: its
        B~ staged in ``tok.sB``, its own update only), token 0 (Bstate, B~ as stored: the trapezoid
        term only) and ring tokens 1..count (B~ staged again from the entry's B, the bias and the
        entry's angle: both terms)."""
        src, h = cta.src, cta.h
        k = count + 1
        self.gram(tok.sB, shared.sC, shared.sG[k, None, None], cta, weights=(shared.sW[k], Float32(0.0)))
        for j in cutlass.range_constexpr(self.K - 1):
            if j <= count:
                sBj = shared.sBB[j % 2, None, None]
                cute.arch.barrier()  # the last table's reads of this buffer (and of sCS) are done
                if const_expr(j == 0):
                    self.stage_kv_row(m.Bstate, (src,), h, sBj, cta)
                else:
                    self.stored_angles(m.ring_angle, (src, j - 1), shared, cta)
                    cute.arch.barrier()
                    self.stage_rotated(m.ring_B, m.B_bias, (src, j - 1), h, sBj, shared.sCS, cta)
                cute.arch.barrier()
                if const_expr(j == 0):
                    self.gram(sBj, shared.sC, shared.sG[0, None, None], cta, weights=(Float32(0.0), shared.sWp[0]))
                else:
                    self.gram(sBj, shared.sC, shared.sG[j, None, None], cta, weights=(shared.sW[j], shared.sWp[j]),
                              both=True)

    @cute.jit
    def token_weights(self, m: KernelArgs, count: Int32, tok: Token, shared: Shared, cta: Cta):
        """One thread: ``sW[j] = w_j = gamma_j a_{j+1}..a_k + beta_{j+1} a_{j+2}..a_k`` for the tokens
        ``j = 0..k`` since the checkpoint (no gamma term for token 0, no beta term past k) and
        ``sW[K] = P = a_1..a_k`` (``a`` the decays alpha); tokens 1..count from the ring, token k
        this step's (``tok``). The suffix products are built from token k down, as the CPU path. With
        rotary the two terms go apart (:meth:`rotary_grams`): ``sW[j]`` the gamma term, ``sWp[j]`` the
        beta term (token j's B~ rounded)."""
        src, h = cta.src, cta.h
        sW, sWp = shared.sW, shared.sWp
        suffix = Float32(1.0)  # a_{j+1} .. a_k
        suffix_next = Float32(1.0)  # a_{j+2} .. a_k
        beta_next = Float32(0.0)  # beta_{j+1}; none past k
        for i in cutlass.range_constexpr(self.K - 1):
            j = self.K - 1 - i  # tokens K - 1 .. 1, those up to k taken
            if j <= count + 1:
                alpha = tok.alpha
                beta = tok.beta
                gamma = tok.gamma
                if j <= count:  # a ring token
                    alpha, beta, gamma = self.decay(m.ring_coef[src, j - 1, h, 0], m.ring_coef[src, j - 1, h, 1],
                                                    m.ring_coef[src, j - 1, h, 2])[:3]
                if const_expr(self.S > 0):
                    sW[j] = gamma * suffix
                    if j <= count:  # token k has no trapezoid term after it
                        sWp[j] = beta_next * suffix_next
                else:
                    sW[j] = gamma * suffix + beta_next * suffix_next
                suffix_next = suffix
                suffix = suffix * alpha
                beta_next = beta
        if const_expr(self.S > 0):
            sWp[0] = beta_next * suffix_next
        else:
            sW[0] = beta_next * suffix_next
        sW[self.K] = suffix

    @cute.jit
    def gram(self, sB: cute.Tensor, sC: cute.Tensor, sG: cute.Tensor, cta: Cta, weights: Optional[tuple] = None,
             both: bool = False):
        """``sG[r', r] = sum_n sB[r', n] sC[r, n]`` (R x R dot products of length N): warp ``w`` takes
        pairs ``w, w + warps, ...``, its lanes stride over n, a butterfly sums them. With rotary,
        ``weights = (w_own, w_prev)``: ``sG[r', r] = w_own sB[r'] . sC[r] + w_prev round(sB[r']) . sC[r]``,
        ``round`` the kv dtype's (as the next token reads this one's B~ from Bstate), both dot
        products in one pass when ``both`` (compile time) and the kv dtype rounds, else
        ``(w_own + w_prev) sB[r'] . sC[r]`` (one weight zero, or nothing to round)."""
        warps = self.num_threads // 32
        warp = cta.tidx // 32
        lane = cta.tidx % 32
        rounds = both and self.kv_dtype is not Float32
        for q in cutlass.range_constexpr(-(-self.R * self.R // warps)):
            pair = warp + q * warps
            if pair < self.R * self.R:
                rp = pair // self.R
                r = pair - rp * self.R
                acc = Float32(0.0)
                prev = Float32(0.0)
                for c in cutlass.range_constexpr(self.N // 32):  # every supported N is a multiple of 32
                    n = lane + c * 32
                    acc = acc + sB[rp, n] * sC[r, n]
                    if const_expr(rounds):
                        prev = prev + sB[rp, n].to(self.kv_dtype).to(Float32) * sC[r, n]
                for k in cutlass.range_constexpr(5):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=16 >> k)
                    if const_expr(rounds):
                        prev = prev + cute.arch.shuffle_sync_bfly(prev, offset=16 >> k)
                if lane == 0:
                    if const_expr(weights is None):
                        sG[rp, r] = acc
                    elif const_expr(rounds):
                        sG[rp, r] = weights[0] * acc + weights[1] * prev
                    else:
                        sG[rp, r] = (weights[0] + weights[1]) * acc

    @cute.jit
    def contract_rows(self, group: RowGroup, operands: Optional[Operands], shared: Shared, cta: Cta) -> cute.Tensor:
        """The thread's partials of ``y[r, d] = sum_n s[d, n] C[r, n]`` over its own columns for one row
        group of the loaded state, not updated (the checkpoint's term of an append; an 8-bit row's sum
        times its scale); slots as :meth:`update_rows`' ``tYrY``."""
        lay = self.layout
        sigma = cta.phi & (self.R - 1)
        tYrY = cute.make_rmem_tensor(cute.make_layout(lay.partials_per_group), Float32)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            for r in cutlass.range_constexpr(self.R):
                y = Float32(0.0)
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        s_ = group.tSrS[e, i, c].to(Float32)
                        if const_expr(lay.cache_operands):
                            y = y + s_ * operands.tOrC[r, e, c]
                        else:
                            y = y + s_ * shared.sC[r ^ sigma, self.column(c, e, cta.lane)]
                if const_expr(self.scaled):  # an 8-bit checkpoint is q * scale: the row's scale once
                    y = y * group.tSrScale[i]
                tYrY[i * self.R + r] = y
        return tYrY

    @cute.jit
    def ring_terms(self, m: KernelArgs, count: Int32, shared: Shared, cta: Cta):
        """``sY[r, d] = P sY[r, d] + sum_j w_j sum_r' x_j[d] xproj[r', d] G_j[r', r]``: the checkpoint's
        contraction decayed, plus each token's term since, in token order; ``x_j`` is Xstate's for
        token 0, the ring's for tokens 1..count, this step's (``sX``) for token k. With rotary the
        weights are in the tables already (:meth:`rotary_grams`)."""
        src, h = cta.src, cta.h
        d0 = cta.dtile * self.tile_D

        def combine(i):  # i = r * tile_D + d
            sY = shared.sY  # stored under a runtime `if`: a local name (see for_thread_indices)
            r = i // self.tile_D
            d = i - r * self.tile_D
            acc = shared.sW[self.K] * sY[r, d]
            for j in cutlass.range_constexpr(self.K):
                if j <= count + 1:
                    xj = shared.sX[d]
                    if const_expr(j == 0):
                        xj = m.Xstate[src, h, d0 + d].to(Float32)
                    else:
                        if j <= count:
                            xj = m.ring_x[src, j - 1, h, d0 + d].to(Float32)
                    t = Float32(0.0)
                    for rp in cutlass.range_constexpr(self.R):
                        t = t + (xj * m.xproj[rp, h, d0 + d].to(Float32)) * shared.sG[j, rp, r]
                    if const_expr(self.S > 0):  # the table carries the weights (rotary_grams)
                        acc = acc + t
                    else:
                        acc = acc + shared.sW[j] * t
            sY[r, d] = acc

        self.for_thread_indices(self.R * self.tile_D, cta.tidx, combine)

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
            if const_expr(self.S > 0):  # B as received (sB holds B~)
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

    # ------------------------------------------------------------------ stages
    @cute.jit
    def select_rows(self, m: KernelArgs, b: Int32):
        """Lane ``b`` -> ``(src, dst, src_live, dst_live)``.

        Dense mode: row b, always live. Pool mode: ``src = state_batch_indices[b]``, or with
        num_accepted ``state_batch_indices[b, num_accepted_tokens[b] - 1]`` (a count outside
        [1, K] makes the lane padding, and nothing outside the index tensor is read); a row is
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
            if const_expr(self.num_accepted and not self.K):  # with replay it commits ring entries instead
                k = m.num_accepted_tokens[b] - 1
                src = Int32(-1)
                if (k >= 0) & (k < m.state_batch_indices.shape[1]):
                    src = m.state_batch_indices[b, k]
            else:
                src = m.state_batch_indices[b]
            src_live = self.row_is_live(src, num_rows, m.null_slot)
            dst = src
            dst_live = src_live
            if const_expr(self.has_dst and not self.dst_per_token):
                dst = m.dst_state_batch_indices[b]
                dst_live = src_live & self.row_is_live(dst, num_rows, m.null_slot)
        return src, dst, src_live, dst_live

    @cute.jit
    def row_is_live(self, row: Int32, num_rows: Int32, null_slot: Int32) -> Boolean:
        return (row >= 0) & (row < num_rows) & (row != null_slot)

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

    def lane_permutation(self, lane):
        """``phi``: which of a row group's ``rows x R`` partial sums this lane keeps at each
        halving round of :meth:`reduce_rows`, as a permutation of slot indices (slot ``k``
        of the lane holds partial ``k ^ phi``). Built from the lane bits the rounds use, so
        every lane always keeps its *first* half and no selects are needed. Shifts and masks
        of the lane's bits: linear over XOR, so ``phi(a ^ b) = phi(a) ^ phi(b)`` (a Python int
        ``lane`` gives the trace-time value)."""
        lay = self.layout
        K = lay.partials_per_group
        if const_expr(K <= lay.TPR):
            return (lane >> (lay.TPR.bit_length() - K.bit_length())) & (K - 1)
        return (lane << (K.bit_length() - lay.TPR.bit_length())) & (K - 1)

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
    def load_state(self, m: KernelArgs, g: int, cta: Cta) -> RowGroup:
        """Row group ``g`` of the thread's share of pool row ``src``: 16-byte loads into a
        ``(VN, rows_per_group, CPT)`` register fragment in the state dtype (and, for an 8-bit
        state, each row's scale)."""
        lay = self.layout
        rows = self.thread_rows(cta, g)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.state_dtype, num_bits_per_copy=128)
        tSrS = cute.make_rmem_tensor(
            cute.make_layout((lay.VN, lay.rows_per_group, lay.CPT), stride=(1, lay.VN, lay.VN * lay.rows_per_group)),
            self.state_dtype)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            for c in cutlass.range_constexpr(lay.CPT):
                cute.copy(atom, self.state_vector(m.state, cta.src, rows[i], c, cta), tSrS[None, i, c])
        tSrScale = None
        if const_expr(self.scaled):
            tSrScale = cute.make_rmem_tensor(cute.make_layout(lay.rows_per_group), Float32)
            d0 = cta.dtile * self.tile_D
            for i in cutlass.range_constexpr(lay.rows_per_group):
                tSrScale[i] = m.state_scale[cta.src, cta.h, d0 + rows[i]]
        return RowGroup(tSrS, rows, tSrScale)

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
        if const_expr(self.scaled):  # every lane of a row holds its scale: the first stores it
            if cta.lane == 0:
                mScale = m.state_scale
                d0 = cta.dtile * self.tile_D
                for i in cutlass.range_constexpr(lay.rows_per_group):
                    mScale[cta.dst, cta.h, d0 + group.rows[i]] = group.tSrScale[i]

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
        if const_expr(self.S > 0):
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

    # ------------------------------------------------------------------ rotary stages
    @cute.jit
    def advance_angles(self, m: KernelArgs, tok: Token, shared: Shared, cta: Cta, start: Optional[Callable] = None,
                       store: Optional[Callable] = None):
        """Thread ``i < S``: angle ``i`` of the (lane, head) advanced by ``tanh(angle_proj) dt pi``
        in fixed point (:meth:`angle_units`), kept in ``sAng`` for the next token, its cos/sin
        to ``sCS``, and stored to ``angle_state[dst]`` when this token's state is stored. Angle
        ``i`` is read and written by thread ``i`` only, and one CTA owns the (lane, head)
        (``tile_D >= D``), so an in-place row (dst = src) is race-free. Replay passes
        ``start(i)``, token 0's angle before it (else ``angle_state[src]``), and ``store(i, q)``,
        which stores the new angle where it goes (else the rule above)."""

        def advance(i):
            sAng, sCS = shared.sAng, shared.sCS  # stored under a runtime `if`: local names
            mAngle = m.angle_state
            q = Int64(0)
            if const_expr(tok.t > 0):
                q = sAng[i]
            elif const_expr(start is None):
                q = mAngle[cta.src, cta.h, i]
            else:
                q = start(i)
            w = cute.math.tanh(m.angle_proj[tok.lane_t + (cta.h, i)]) * tok.dt
            q = q + self.angle_units(w)
            sAng[i] = q
            c, s = self.turn_cos_sin(q)
            sCS[0, i] = c
            sCS[1, i] = s
            if const_expr(store is not None):
                store(i, q)
            elif const_expr(self.store_each or tok.t == self.T - 1):
                if cta.dst_live:
                    mAngle[cta.dst, cta.h, i] = q

        self.for_thread_indices(self.S, cta.tidx, advance)

    @cute.jit
    def stored_angles(self, mAngle: cute.Tensor, lead: tuple, shared: Shared, cta: Cta):
        """Thread ``i < S``: the cos/sin of a stored angle ``mAngle[lead][h, i]`` (a ring entry's) to
        ``sCS``, for staging that token's B~ again."""

        def turn(i):
            sCS = shared.sCS  # stored under a runtime `if`: a local name
            c, s = self.turn_cos_sin(mAngle[lead + (cta.h, i)])
            sCS[0, i] = c
            sCS[1, i] = s

        self.for_thread_indices(self.S, cta.tidx, turn)

    def angle_units(self, w: Float32) -> Int64:
        """The fixed-point increment of ``w / 2`` turns (``w = tanh(angle_proj) dt``), in units of
        2**-64 turn: whole turns dropped exactly (``w - 2 rint(w / 2)``), then
        ``2 rint(w_frac 2**62)`` (wrapping at a half turn, like the CPU path)."""
        w_frac = w - Float32(2.0) * self.asm_f32("cvt.rni.f32.f32 $0, $1;", w * Float32(0.5))
        units = inline_ptx(Int64, "cvt.rni.s64.f32 $0, $1;", "=l,f", Float32(w_frac * Float32(2.0**62)))
        return units + units

    def asm_f32(self, text: str, a: Float32) -> Float32:
        """A one-operand fp32 PTX instruction ``text`` applied to ``a``."""
        return inline_ptx(Float32, text, "=f,f", Float32(a))

    @cute.jit
    def turn_cos_sin(self, q: Int64):
        """``(cos, sin)`` of the fixed-point angle ``q``: quadrant ``k = round(q / 2**62)`` from the
        top bits, the rest (at most an eighth of a turn) as ``x`` in [-pi/4, pi/4), Taylor
        polynomials to x**9 / x**10 (truncation below 3e-9), then ``k`` quarter turns."""
        k = Int32(((q >> 61) + 1) >> 1) & 3
        x = Float32((q << 2) >> 2) * Float32(ANGLE_UNIT_RADIANS)
        x2 = x * x
        s = x + x * x2 * (Float32(-1 / 6) + x2 * (Float32(1 / 120) + x2 * (Float32(-1 / 5040)
                                                                           + x2 * Float32(1 / 362880))))
        c = Float32(1.0) + x2 * (Float32(-0.5) + x2 * (Float32(1 / 24) + x2 * (
            Float32(-1 / 720) + x2 * (Float32(1 / 40320) + x2 * Float32(-1 / 3628800)))))
        odd = (k & 1) != 0
        cos = cutlass.select_(odd, -s, c)
        sin = cutlass.select_(odd, c, s)
        half = (k & 2) != 0
        return cutlass.select_(half, -cos, cos), cutlass.select_(half, -sin, sin)

    @cute.jit
    def stage_rotated(self, mT: cute.Tensor, mBias, lead: tuple, head: Int32, sT: cute.Tensor,
                      sCS: cute.Tensor, cta: Cta):
        """B or C with rotary -> ``sT`` (R, N) fp32: ``mT[lead][:, head, :]`` plus the bias of head
        ``h`` (when given), pair ``j < S`` rotated by angle ``j`` (``sCS``), the other pairs
        passed through; one pair per thread step. Pairs: ``(j, j + N/2)``, or ``(2j, 2j + 1)``
        with ``rotate_pairwise``."""
        half = self.N // 2

        def stage(i):  # i = r * N/2 + j
            r = i // half
            j = i - r * half
            n0, n1 = (2 * j, 2 * j + 1) if const_expr(self.rotate_pairwise) else (j, j + half)
            a = mT[lead + (r, head, n0)].to(Float32)
            b = mT[lead + (r, head, n1)].to(Float32)
            if const_expr(self.has_bc_bias):
                a = a + mBias[r, cta.h, n0]
                b = b + mBias[r, cta.h, n1]
            if j < self.S:
                c = sCS[0, j]
                s = sCS[1, j]
                a, b = a * c - b * s, a * s + b * c
            sT[r, n0] = a
            sT[r, n1] = b

        self.for_thread_indices(self.R * half, cta.tidx, stage)

    @cute.jit
    def round_previous_b(self, sBs: cute.Tensor, cta: Cta):
        """Token t > 0 with rotary: the previous token's staged B~ (fp32) rounded to the kv dtype
        in place, the value a one-token step reads back from Bstate (so T tokens stay T one-token
        steps bit for bit)."""

        def round_one(i):  # i = r * N + n
            r = i // self.N
            n = i - r * self.N
            sBs[r, n] = sBs[r, n].to(self.kv_dtype).to(Float32)

        self.for_thread_indices(self.R * self.N, cta.tidx, round_one)

    @cute.jit
    def store_kv_state(self, m: KernelArgs, sB: cute.Tensor, sX: cute.Tensor, cta: Cta):
        """update_kv_state: this step's B (``sB``, (R, N) fp32) and x (``sX``, (tile_D,) fp32) ->
        row ``dst`` of Bstate/Xstate.

        The staged fp32 copies convert back exactly (B and Bstate share a dtype, as do x
        and Xstate). Only race-free when this CTA is the only one of its (lane, head):
        ``tile_D >= D``, checked by the wrapper.
        """

        def store_b(i):  # i = r * N + n
            r = i // self.N
            n = i - r * self.N
            m.Bstate[cta.dst, r, cta.h, n] = sB[r, n].to(self.kv_dtype)

        self.for_thread_indices(self.R * self.N, cta.tidx, store_b)
        d0 = cta.dtile * self.tile_D

        def store_x(d):
            m.Xstate[cta.dst, cta.h, d0 + d] = sX[d].to(self.x_dtype)

        self.for_thread_indices(self.tile_D, cta.tidx, store_x)

    def column(self, c: int, e: int, lane: Int32) -> Int32:
        """State column of element ``e`` of the lane's vector ``c`` (the same in every row)."""
        return (c * self.layout.TPR + lane) * self.layout.VN + e

    @cute.jit
    def load_operands(self, tok: Token, shared: Shared, cta: Cta) -> Optional[Operands]:
        """The B, Bstate and C values of the lane's columns, ``(R, VN, CPT)`` fp32 each, read
        once from shared memory when they fit in registers (``cache_operands``), else None
        (then :meth:`update_rows` reads them per row). C is read in the lane's rank order:
        slot ``r`` holds rank ``r ^ (phi & (R - 1))`` (see :meth:`lane_permutation`)."""
        lay = self.layout
        if const_expr(not lay.cache_operands):
            return None
        shape = cute.make_layout((self.R, lay.VN, lay.CPT), stride=(lay.VN * lay.CPT, 1, lay.VN))
        tOrB = cute.make_rmem_tensor(shape, Float32)
        tOrBs = cute.make_rmem_tensor(shape, Float32)
        tOrC = cute.make_rmem_tensor(shape, Float32)
        sigma = cta.phi & (self.R - 1)
        for r in cutlass.range_constexpr(self.R):
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    n = self.column(c, e, cta.lane)
                    tOrB[r, e, c] = tok.sB[r, n]
                    tOrBs[r, e, c] = tok.sBs[r, n]
                    tOrC[r, e, c] = shared.sC[r ^ sigma, n]
        return Operands(tOrB, tOrBs, tOrC)

    @cute.jit
    def update_rows(self, group: RowGroup, operands: Optional[Operands], tok: Token, shared: Shared,
                    cta: Cta) -> cute.Tensor:
        """Per-thread state update of one row group (the math of docs/contract.md, fp32).

        ``new[d, n] = alpha s[d, n] + sum_r u_r[d] B[r, n] + v_r[d] Bs[r, n]`` (summed in r
        order) is written back into ``group.tSrS`` rounded to the state dtype; the unrounded
        new value feeds the thread's partial ``y[r, d] = sum_n new[d, n] C[r, n]`` over its own
        columns. ``operands``: B, Bs, C in registers, or None (read from shared memory per
        row). Returns the partials ``tYrY``, ``(rows_per_group * R,)`` fp32, slot ``i * R + r``
        holding register row ``i`` and rank ``r ^ (phi & (R - 1))``.
        """
        lay = self.layout
        R = self.R
        tSrS, rows = group.tSrS, group.rows
        sigma = cta.phi & (R - 1)
        tYrY = cute.make_rmem_tensor(cute.make_layout(lay.partials_per_group), Float32)
        if const_expr(self.scaled):  # the whole group's new state, fp32: a row's scale needs its lanes' rows
            tSrNewG = cute.make_rmem_tensor(
                cute.make_layout((lay.VN, lay.rows_per_group, lay.CPT), stride=(1, lay.VN, lay.VN * lay.rows_per_group)),
                Float32)
        for i in cutlass.range_constexpr(lay.rows_per_group):
            tSrUV = cute.make_rmem_tensor(cute.make_layout(2 * R), Float32)  # the row's u_r, v_r
            for k in cutlass.range_constexpr(2 * R):
                tSrUV[k] = shared.sUV[rows[i], k]
            if const_expr(self.scaled):
                tSrNew = tSrNewG[None, i, None]  # (VN, CPT) view
            else:
                tSrNew = cute.make_rmem_tensor(cute.make_layout((lay.VN, lay.CPT), stride=(1, lay.VN)), Float32)
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    if const_expr(self.scaled):  # q * scale, then the decay: two rounded products
                        tSrNew[e, c] = tok.alpha * (tSrS[e, i, c].to(Float32) * group.tSrScale[i])
                    else:
                        tSrNew[e, c] = tok.alpha * tSrS[e, i, c].to(Float32)
            for r in cutlass.range_constexpr(R):
                if const_expr(not lay.cache_operands):
                    self.row_fence()  # one rank's operands at a time in registers
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        if const_expr(lay.cache_operands):
                            b_, bs_ = operands.tOrB[r, e, c], operands.tOrBs[r, e, c]
                        else:
                            n = self.column(c, e, cta.lane)
                            b_, bs_ = tok.sB[r, n], tok.sBs[r, n]
                        tSrNew[e, c] = tSrNew[e, c] + tSrUV[r] * b_ + tSrUV[R + r] * bs_
            if const_expr(self.scaled):
                pass  # after the group (store_quantized)
            elif const_expr(self.stochastic):
                self.store_rounded(tSrS, tSrNew, i, rows[i], tok, cta)
            else:
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        tSrS[e, i, c] = tSrNew[e, c].to(self.state_dtype)
            for r in cutlass.range_constexpr(R):
                if const_expr(not lay.cache_operands):
                    self.row_fence()
                y = Float32(0.0)
                for c in cutlass.range_constexpr(lay.CPT):
                    for e in cutlass.range_constexpr(lay.VN):
                        if const_expr(lay.cache_operands):
                            y = y + tSrNew[e, c] * operands.tOrC[r, e, c]
                        else:
                            y = y + tSrNew[e, c] * shared.sC[r ^ sigma, self.column(c, e, cta.lane)]
                tYrY[i * R + r] = y
        if const_expr(self.scaled):
            self.store_quantized(group, tSrNewG, tok, cta)
        return tYrY

    # ------------------------------------------------------------------ stochastic rounding
    @cute.jit
    def rng_source(self, m: KernelArgs, b: Int32) -> tuple:
        """``(seed, offset, row)``: rand_seed's two int64 values and, in dense mode with
        ``rand_rows``, the row lane ``b`` draws for (else None: the row written, ``cta.dst``)."""
        row = m.rand_rows[b] if const_expr(self.spec.has_rand_rows) else None
        return (m.rand_seed[0], m.rand_seed[1], row)

    @cute.jit
    def token_rng(self, seed_offset: tuple, t: int) -> tuple:
        """``(k0, k1, o0, o1)``: the seed's and token ``t``'s offset's (``offset + t``) 32-bit words."""
        return self.rng_words(seed_offset[0], seed_offset[1] + Int64(t))

    @cute.jit
    def ring_rng(self, m: KernelArgs, j: int, cta: Cta) -> tuple:
        """``(k0, k1, o0, o1, row)``: a replayed ring entry's draws, as its step drew them: the seed's
        words, the entry's recorded offset's, and the row it drew for."""
        return self.rng_words(cta.seed[0], m.ring_offset[cta.src, j, cta.h]) + (m.ring_drawn_for[cta.src, j, cta.h],)

    def rng_words(self, seed: Int64, offset: Int64) -> tuple:
        """``(k0, k1, o0, o1)``: the 32-bit words of the seed (Philox's key) and of an offset."""
        return (Uint32(seed), Uint32(Uint64(seed) >> 32), Uint32(offset), Uint32(Uint64(offset) >> 32))

    def draw_row(self, tok: Token, cta: Cta):
        """The row a token's draws are for: a replayed entry's recorded one, else the lane's
        ``rand_rows`` entry (dense mode), else the row its state is stored to."""
        if len(tok.rng) > 4:
            return tok.rng[4]
        return cta.dst if cta.seed[2] is None else cta.seed[2]

    @cute.jit
    def store_rounded(self, tSrS: cute.Tensor, tSrNew: cute.Tensor, i: int, row: Int32, tok: Token, cta: Cta):
        """Register row ``i`` of the new state (fp32 ``tSrNew``) stochastically rounded into
        ``tSrS``: vector ``c`` holds the 8 elements ``n = 8 g ... 8 g + 7`` of ``g = c TPR + lane``,
        whose 16-bit draws are one Philox4x32 call with the counter (offset words, the row the
        state goes to, ``(h D + d) N/8 + g``) and the seed's key (mamba3_step.rounding); output
        word ``j`` holds the draws of elements ``2j`` (low half) and ``2j + 1`` (high half). A bf16
        pair is written as one word (:meth:`round_bf16_pair`)."""
        lay = self.layout
        k0, k1, o0, o1 = tok.rng[:4]
        d = cta.dtile * self.tile_D + row
        base = (Uint32(cta.h) * Uint32(self.D) + Uint32(d)) * Uint32(self.N // N_PER_CALL)
        tSrW = cute.recast_tensor(tSrS, Uint32) if const_expr(self.state_dtype is cutlass.BFloat16) else None
        for c in cutlass.range_constexpr(lay.CPT):
            row_id = self.draw_row(tok, cta)
            words = self.philox((o0, o1, Uint32(row_id), base + Uint32(c * lay.TPR + cta.lane)), k0, k1)
            for j in cutlass.range_constexpr(lay.VN // 2):
                if const_expr(tSrW is not None):
                    tSrW[j, i, c] = self.round_bf16_pair(tSrNew[2 * j, c], tSrNew[2 * j + 1, c], words[j])
                else:
                    tSrS[2 * j, i, c] = self.round_fp16(tSrNew[2 * j, c], words[j] & Uint32(0xFFFF))
                    tSrS[2 * j + 1, i, c] = self.round_fp16(tSrNew[2 * j + 1, c], words[j] >> Uint32(16))

    @cute.jit
    def store_quantized(self, group: RowGroup, tSrNewG: cute.Tensor, tok: Token, cta: Cta):
        """A row group's new state (fp32 ``tSrNewG``, ``(VN, rows_per_group, CPT)``) quantised to 8
        bits into ``group.tSrS``, each row's scale into ``group.tSrScale``
        (mamba3_step.rounding.quantize_rows).

        A row's absmax is the largest ``|x|`` bit pattern (integer order is magnitude order, and
        any NaN or inf pattern is at least 0x7F800000): over the thread's columns, then over the
        row's TPR lanes by a butterfly. Lanes keep their rows in different register orders
        (:meth:`thread_rows`: register ``i`` holds row ``i ^ rho``), and ``rho`` is linear in the
        lane's bits, so across lane mask ``m`` the partner holds this lane's register ``i`` at
        ``i ^ rho(m)``, a trace-time constant: each round sends register ``i ^ rho(m)`` and
        receives the partner's copy of row ``i``. Every lane ends with its rows' absmax."""
        lay = self.layout
        big = []
        for i in cutlass.range_constexpr(lay.rows_per_group):
            top = Uint32(0)
            for c in cutlass.range_constexpr(lay.CPT):
                for e in cutlass.range_constexpr(lay.VN):
                    top = self.umax(top, self.f32_bits(tSrNewG[e, i, c]) & Uint32(0x7FFFFFFF))
            big.append(top)
        log2r = self.R.bit_length() - 1
        for k in cutlass.range_constexpr(lay.TPR.bit_length() - 1):
            mask = lay.TPR >> (k + 1)
            swap = self.lane_permutation(mask) >> log2r  # rho(mask), a Python int
            sent = [cute.arch.shuffle_sync_bfly(big[i ^ swap], offset=mask) for i in range(lay.rows_per_group)]
            big = [self.umax(big[i], sent[i]) for i in range(lay.rows_per_group)]
        for i in cutlass.range_constexpr(lay.rows_per_group):
            self.quantize_row(group, tSrNewG, i, big[i], tok, cta)

    @cute.jit
    def quantize_row(self, group: RowGroup, tSrNewG: cute.Tensor, i: int, big: Uint32, tok: Token, cta: Cta):
        """Register row ``i``: its scale from the row's absmax pattern ``big`` (``scale = absmax /
        Q`` and ``inv = Q / absmax`` IEEE divisions, ``v = x inv`` a rounded product; a row with a
        NaN or inf stores zeros and scale NaN, a row below SMALL_ROW zeros and scale 0), and its
        values rounded with their bits. Each 16-byte vector ``c`` (16 elements, ``n = 16 (c TPR
        + lane) ...``) takes the bits of two Philox calls, ``g = 2 (c TPR + lane)`` and ``g + 1``:
        the 8 elements of each, as for a 16-bit state."""
        lay = self.layout
        absmax = self.bits_f32(big)
        bad = big >= Uint32(0x7F800000)  # a NaN or an inf in the row
        odd = bad | (absmax < Float32(SMALL_ROW))
        safe = Float32(cutlass.select_(odd, Float32(1.0), absmax))
        q_max = Float32(QMAX[self.spec.state_dtype])
        # odd rows: v = x * 0 (0, or NaN in a bad row): int8 converts both to code 0, e4m3 pairs are zeroed
        inv = Float32(cutlass.select_(odd, Float32(0.0), self.div_rn(q_max, safe)))
        scale = Float32(cutlass.select_(odd, Float32(0.0), self.div_rn(safe, q_max)))
        group.tSrScale[i] = Float32(cutlass.select_(bad, Float32(float("nan")), scale))
        k0, k1, o0, o1 = tok.rng[:4]
        d = cta.dtile * self.tile_D + group.rows[i]
        base = (Uint32(cta.h) * Uint32(self.D) + Uint32(d)) * Uint32(self.N // N_PER_CALL)
        row_id = self.draw_row(tok, cta)
        int8 = const_expr(self.state_dtype is cutlass.Int8)
        tSrH = None if int8 else cute.recast_tensor(group.tSrS, Uint16)  # e4m3 codes in pairs
        for c in cutlass.range_constexpr(lay.CPT):
            for half in cutlass.range_constexpr(2):
                g = Uint32(2 * (c * lay.TPR + cta.lane) + half)
                words = self.philox((o0, o1, Uint32(row_id), base + g), k0, k1)
                for k in cutlass.range_constexpr(0, N_PER_CALL, 2):
                    e = half * N_PER_CALL + k
                    w = words[k // 2]
                    v0, v1 = self.mul_rn(tSrNewG[e, i, c], inv), self.mul_rn(tSrNewG[e + 1, i, c], inv)
                    if const_expr(int8):
                        group.tSrS[e, i, c] = self.quantize_int8(v0, w & Uint32(0xFFFF))
                        group.tSrS[e + 1, i, c] = self.quantize_int8(v1, w >> Uint32(16))
                    else:
                        pair = self.e4m3_pair(self.round_e4m3(v0, w & Uint32(0xFFFF)),
                                              self.round_e4m3(v1, w >> Uint32(16)))
                        tSrH[e // 2, i, c] = Uint16(cutlass.select_(odd, Uint16(0), pair))

    @cute.jit
    def quantize_int8(self, v: Float32, r: Uint32):
        """``v`` (``|v| <= 127`` up to two roundings) stochastically rounded with the 16 bits ``r``:
        ``sign(v) min(127, (floor(|v| 2**16) + r) >> 16)``; a NaN ``v`` (a bad row) converts to 0."""
        frac = self.asm_u32("cvt.rzi.u32.f32 $0, $1;", self.asm_f32("abs.f32 $0, $1;", v) * Float32(65536.0))
        mag = Int32(self.umin((frac + r) >> 16, Uint32(127)))
        return Int32(cutlass.select_(v < Float32(0.0), -mag, mag)).to(self.state_dtype)

    @cute.jit
    def round_e4m3(self, v: Float32, r: Uint32) -> Float32:
        """``v`` (``|v| <= 448`` up to two roundings) stochastically rounded to e4m3's grid with the 16
        bits ``r``: :meth:`round_on_grid` with ``r << 4`` (20 bits below e4m3's last mantissa bit),
        saturated at 448, ``v``'s sign; exact in e4m3. ``|v|`` is finite, so the sum cannot carry into
        the sign bit (no guard)."""
        y = self.round_on_grid(v, r << Uint32(4), SUBNORMAL_GRIDS[self.spec.state_dtype], guard=False)
        y = self.asm_f32("min.f32 $0, $1, 0f43E00000;", y)  # 448: e4m3fn saturates
        return self.bits_f32(self.f32_bits(y) | (self.f32_bits(v) & Uint32(0x80000000)))

    def e4m3_pair(self, lo: Float32, hi: Float32) -> Uint16:
        """Two e4m3 values (exact on its grid) as one 16-bit pair of codes, ``lo`` in the low byte."""
        return inline_ptx(Uint16, "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f", Float32(hi), Float32(lo))

    def umax(self, a: Uint32, b: Uint32) -> Uint32:
        return inline_ptx(Uint32, "max.u32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b))

    def umin(self, a: Uint32, b: Uint32) -> Uint32:
        return inline_ptx(Uint32, "min.u32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b))

    def div_rn(self, a: Float32, b: Float32) -> Float32:
        """``a / b`` rounded to nearest (IEEE), as the CPU path divides."""
        return inline_ptx(Float32, "div.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b))

    def asm_u32(self, text: str, a: Float32) -> Uint32:
        return inline_ptx(Uint32, text, "=r,f", Float32(a))

    def philox(self, counter: tuple, k0: Uint32, k1: Uint32) -> list:
        """Philox4x32-10 (Random123): four Uint32 words of ``counter`` under the key ``(k0, k1)``."""
        c0, c1, c2, c3 = counter
        for _ in range(10):
            p0 = Uint64(c0) * Uint64(PHILOX_M[0])
            p1 = Uint64(c2) * Uint64(PHILOX_M[1])
            c0, c1, c2, c3 = (Uint32(p1 >> 32) ^ c1 ^ k0, Uint32(p1), Uint32(p0 >> 32) ^ c3 ^ k1, Uint32(p0))
            k0, k1 = k0 + Uint32(PHILOX_W[0]), k1 + Uint32(PHILOX_W[1])
        return [c0, c1, c2, c3]

    @cute.jit
    def round_bf16_pair(self, x0: Float32, x1: Float32, w: Uint32) -> Uint32:
        """Two bf16 values stochastically rounded (mamba3_step.rounding's rule: the magnitude rounds
        up iff its 16-bit fraction of a ulp plus ``r`` carries), packed as one word: each fp32
        pattern plus its 16 bits of ``w`` (``x0`` the low half, ``x1`` the high), the high halves
        taken (a byte permute, the truncation). The signed max with the pattern keeps a NaN from
        carrying into the sign bit: the new state comes from fp32 arithmetic, whose NaN is the
        canonical 0x7FFFFFFF (PTX ISA), stored as 0x7FFF."""
        b0, b1 = self.f32_bits(x0), self.f32_bits(x1)
        s0 = self.smax(b0 + (w & Uint32(0xFFFF)), b0)
        s1 = self.smax(b1 + (w >> Uint32(16)), b1)
        return inline_ptx(Uint32, "prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", s0, s1)

    @cute.jit
    def round_fp16(self, x: Float32, r: Uint32):
        """``x`` rounded to fp16 with the 16 random bits ``r``: :meth:`round_on_grid` with ``r >> 3``
        (13 bits below fp16's last mantissa bit), then ``x``'s sign. The truncated value is exact
        in fp16 (or beyond its range: inf), so the final conversion does not round; a NaN converts
        to the canonical 0x7FFF."""
        y = self.round_on_grid(x, r >> Uint32(3), SUBNORMAL_GRIDS[self.spec.state_dtype], guard=True)
        return self.bits_f32(self.f32_bits(y) | (self.f32_bits(x) & Uint32(0x80000000))).to(self.state_dtype)

    @cute.jit
    def round_on_grid(self, x: Float32, r_aligned: Uint32, grid: tuple, guard: bool) -> Float32:
        """``|x|`` stochastically rounded to the grid of a format whose smallest normal is
        ``grid[0]`` and whose last mantissa bit lies ``grid[1]`` bits above fp32's
        (mamba3_step.rounding, ``_round_magnitude``): ``t = |x| + c`` with ``c`` = the smallest
        normal if ``|x|`` is below it, else 0 (one rounded addition that puts the subnormal grid on
        t's last kept bit), ``t``'s pattern plus ``r_aligned`` (the random bits below that bit)
        truncated, minus ``c`` (exact). ``c`` is a 0/1 flag times the smallest normal, folded into
        two fmas (the product is exact, so each is the rounded sum). A NaN ``t`` is the canonical
        0x7FFFFFFF; ``guard`` keeps its sum from carrying into the sign bit (an unsigned min)."""
        smallest, kept = grid
        a = self.asm_f32("abs.f32 $0, $1;", x)
        below = inline_ptx(Float32, "set.lt.f32.f32 $0, $1, $2;", "=f,f,f", a, Float32(smallest))
        s = self.f32_bits(self.fma_rn(below, Float32(smallest), a)) + r_aligned
        if const_expr(guard):
            s = self.umin(s, Uint32(0x7FFFFFFF))
        return self.fma_rn(below, Float32(-smallest), self.bits_f32(s & Uint32((0xFFFFFFFF << kept) & 0xFFFFFFFF)))

    def fma_rn(self, a: Float32, b: Float32, c: Float32) -> Float32:
        """``a b + c`` rounded once, to nearest."""
        return inline_ptx(Float32, "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", Float32(a), Float32(b), Float32(c))

    def smax(self, a: Uint32, b: Uint32) -> Uint32:
        """The larger of two patterns compared as signed 32-bit integers."""
        return inline_ptx(Uint32, "max.s32 $0, $1, $2;", "=r,r,r", Uint32(a), Uint32(b))

    def f32_bits(self, x: Float32) -> Uint32:
        """The bit pattern of ``x``."""
        return inline_ptx(Uint32, "mov.b32 $0, $1;", "=r,f", Float32(x))

    def bits_f32(self, b: Uint32) -> Float32:
        """The fp32 whose bit pattern is ``b``."""
        return inline_ptx(Float32, "mov.b32 $0, $1;", "=f,r", Uint32(b))

    @cute.jit
    def row_fence(self):
        """A compiler-level memory clobber between rows (an empty volatile asm, no
        instruction), so B/Bs/C are re-read from shared memory instead of being cached in
        registers across rows when they do not fit (``ThreadLayout.cache_operands``)."""
        llvm.inline_asm(None, [], "", "~{memory}", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)

    @cute.jit
    def reduce_rows(self, tYrY: cute.Tensor, sY: cute.Tensor, cta: Cta, g: int):
        """Complete a row group's partial sums ``tYrY`` over the TPR lanes of each row; store
        them to sY.

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
            vals.append(tYrY[k])
        for step in cutlass.range_constexpr(len(self.reduce_plan)):
            mask, halving = self.reduce_plan[step]
            if const_expr(halving):
                half = len(vals) // 2
                kept = []
                for j in cutlass.range_constexpr(half):
                    kept.append(vals[j] + cute.arch.shuffle_sync_bfly(vals[j + half], offset=mask))
                vals = kept
            else:
                vals = [vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=mask)]
        lane = cta.tidx % lay.TPR
        row0 = g * self.group_rows + cta.tidx // lay.TPR
        log2r = self.R.bit_length() - 1
        for j in cutlass.range_constexpr(len(vals)):
            k = cta.phi ^ j
            if (lane & self.reduce_plain_mask) == 0:
                sY[k & (self.R - 1), row0 + (k >> log2r) * lay.rows_per_pass] = vals[j]

    @cute.jit
    def epilogue(self, m: KernelArgs, tok: Token, shared: Shared, cta: Cta):
        """``y = sY + D xr``; ``y *= silu(z zproj)``; ``out = sum_r y outproj`` (or out = y).

        When the CTA has more threads than rows, ``epilogue_split`` adjacent lanes share a row
        ``d``, each taking ``R / epilogue_split`` consecutive ranks; with outproj their partial sums
        are combined by a butterfly over those lanes and the first one stores ``out``.

        The sum over the ranks has one order whatever the split (so a T-token step, whose default
        tiling has more threads, writes the bits of T one-token steps): each product
        ``y_r outproj_r`` rounded on its own (:meth:`mul_rn`, never fused into an add), then a
        pairwise tree over ranks ``(0, 1), (2, 3), ...``: a lane sums the subtree of its ranks
        (:meth:`pairwise_sum`), and butterfly rounds with ascending masks join neighbouring
        subtrees.
        """
        split = self.epilogue_split
        ranks = self.R // split
        h = cta.h
        lane_t = tok.lane_t
        dskip = m.D[h]
        d0 = cta.dtile * self.tile_D
        part = cta.tidx % split

        def row(d):
            mOut = m.out  # stored under a runtime `if`: a local name (see for_thread_indices)
            acc = Float32(0.0)
            if d < self.tile_D:
                dg = d0 + d
                zd = Float32(0.0)
                if const_expr(self.has_z):
                    zd = m.z[lane_t + (h, dg)].to(Float32)
                products = []
                for j in cutlass.range_constexpr(ranks):
                    r = part * ranks + j
                    y = shared.sY[r, d] + dskip * shared.sXr[r, d]
                    if const_expr(self.has_z):
                        gz = zd * m.zproj[r, h, dg].to(Float32)
                        y = y * (gz * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-gz)))
                    if const_expr(self.has_outproj):
                        products.append(self.mul_rn(y, m.outproj[r, h, dg].to(Float32)))
                    else:
                        mOut[lane_t + (r, h, dg)] = y.to(self.x_dtype)
                if const_expr(self.has_outproj):
                    acc = self.pairwise_sum(products)
            if const_expr(self.has_outproj):
                # the lanes sharing a row are adjacent and agree on d < tile_D: every lane shuffles
                for k in cutlass.range_constexpr(len(self.epilogue_masks)):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=self.epilogue_masks[k])
                if d < self.tile_D:
                    if part == 0:
                        mOut[lane_t + (h, d0 + d)] = acc.to(self.x_dtype)

        self.for_thread_indices(self.tile_D, cta.tidx, row, spread=split, guarded=False)

    def mul_rn(self, a: Float32, b: Float32) -> Float32:
        """``a * b`` rounded to fp32 on its own: ``mul.rn`` is never contracted into an FMA, so
        the sum it feeds has the same terms however it is split."""
        return inline_ptx(Float32, "mul.rn.f32 $0, $1, $2;", "=f,f,f", Float32(a), Float32(b))

    def pairwise_sum(self, values: list) -> Float32:
        """The pairwise tree of ``values`` (a power of two of them): ``(v0 + v1) + (v2 + v3) ...``."""
        while len(values) > 1:
            values = [values[i] + values[i + 1] for i in range(0, len(values), 2)]
        return values[0]

    @cute.jit
    def zero_out(self, mOut: cute.Tensor, lane_t: tuple, h: Int32, dtile: Int32, tidx: Int32):
        """Padding lane: ``out`` = 0 for one token (``lane_t``: its leading coordinates); no pool row
        is read or written."""
        d0 = dtile * self.tile_D

        def zero(d):
            if const_expr(self.has_outproj):
                mOut[lane_t + (h, d0 + d)] = self.x_dtype(0.0)
            else:
                for r in cutlass.range_constexpr(self.R):
                    mOut[lane_t + (r, h, d0 + d)] = self.x_dtype(0.0)

        self.for_thread_indices(self.tile_D, tidx, zero)


# ---------------------------------------------------------------------- compile
def fake_arguments(spec: StepSpec) -> KernelArgs:
    """Fake tensors for ``cute.compile``, one per :class:`KernelArgs` field (None where the spec
    has no such tensor): B, P, H, K and every stride symbolic but the state's D stride (N unless
    ``padded_state_rows``); T static.

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
        # (validation.check_state_strides), which keeps per-vector address math 32-bit. The D
        # stride is N unless the rows are padded: then a thread's rows are immediate offsets
        # from one address (StepSpec.padded_state_rows)
        d_stride = sym(divisibility=VN) if spec.padded_state_rows else N
        return make(st, (rows, heads, D, N), stride=(sym64(divisibility=VN), sym(divisibility=VN), d_stride, 1),
                    assumed_align=16)

    def strided(dtype, shape):  # outermost stride 64-bit, the others 32-bit, innermost 1
        inner = tuple(sym() for _ in shape[1:-1])
        outer = (sym64(),) if len(shape) > 1 else ()
        return make(dtype, shape, stride=outer + inner + (1,), assumed_align=dtype.width // 8)

    rows = pool if spec.pool else batch
    T = spec.tokens
    S = spec.rope_angles
    bc_heads = 1 if spec.shared_bc else heads
    K, ring = spec.replay_ring, sym()

    def lane(dtype, rest):  # a per-lane tensor: (B, *rest), or (B, T, *rest) with tokens > 1
        return strided(dtype, (batch,) + ((T,) if T > 1 else ()) + rest)

    return KernelArgs(
        state=state_like(rows),
        Bstate=strided(kv, (rows, R, heads, N)),
        Xstate=strided(xt, (rows, heads, D)),
        A=lane(Float32, (heads,)),
        B=lane(kv, (R, bc_heads, N)),
        C=lane(kv, (R, bc_heads, N)),
        D=strided(Float32, (heads,)),
        x=lane(xt, (heads, D)),
        dt=lane(Float32, (heads,)),
        trap=lane(Float32, (heads,)),
        xproj=strided(pj, (R, heads, D)),
        zproj=strided(pj, (R, heads, D)) if spec.has_z else None,
        outproj=strided(pj, (R, heads, D)) if spec.has_outproj else None,
        z=lane(xt, (heads, D)) if spec.has_z else None,
        out=lane(xt, (heads, D) if spec.has_outproj else (R, heads, D)),
        state_out=state_like(batch) if spec.has_state_out else None,
        # (B,), or (B, K) with num_accepted_tokens (but for replay, whose accepted drafts are ring entries)
        state_batch_indices=(strided(Int32, (batch, sym())) if spec.num_accepted and not K
                             else strided(Int32, (batch,)))
        if spec.pool else None,
        # (B,), or (B, T) per token
        dst_state_batch_indices=(strided(Int32, (batch, T)) if spec.dst_per_token else strided(Int32, (batch,)))
        if spec.has_dst else None,
        num_accepted_tokens=strided(Int32, (batch,)) if spec.num_accepted else None,
        angle_state=strided(Int64, (rows, heads, S)) if S else None,
        angle_proj=lane(Float32, (heads, S)) if S else None,
        B_bias=strided(Float32, (R, heads, N)) if spec.has_bc_bias else None,
        C_bias=strided(Float32, (R, heads, N)) if spec.has_bc_bias else None,
        rand_seed=strided(Int64, (2,)) if spec.stochastic_rounding else None,
        rand_rows=strided(Int32, (batch,)) if spec.has_rand_rows else None,
        state_scale=strided(Float32, (rows, heads, D)) if spec.state_dtype in SCALED_STATE_DTYPES else None,
        # replay: (P, L, ...) ring entries, L symbolic; the length per (row, head)
        ring_B=strided(kv, (pool, ring, R, heads, N)) if K else None,
        ring_x=strided(xt, (pool, ring, heads, D)) if K else None,
        ring_coef=strided(Float32, (pool, ring, heads, 3)) if K else None,
        ring_length=strided(Int32, (pool, heads)) if K else None,
        ring_angle=strided(Int64, (pool, ring, heads, S)) if K and S else None,
        ring_offset=strided(Int64, (pool, ring, heads)) if K and spec.stochastic_rounding else None,
        ring_drawn_for=strided(Int32, (pool, ring, heads)) if K and spec.stochastic_rounding else None,
        null_slot=Int32(-1),
    )


def argument_masks(spec: StepSpec) -> KernelArgs:
    """Per :class:`KernelArgs` field: ``None`` for an absent tensor, ``"scalar"`` for
    ``null_slot``, else ``(dynamic shape modes, dynamic stride modes)`` as bool tuples: which
    values the DSL passes in a tensor's parameter struct."""
    out = []
    for fake in fake_arguments(spec):
        if fake is None:
            out.append(None)
        elif hasattr(fake, "dynamic_shapes_mask"):
            out.append((tuple(bool(m) for m in fake.dynamic_shapes_mask),
                        tuple(bool(m) for m in fake.dynamic_strides_mask)))
        else:
            out.append("scalar")
    return KernelArgs(*out)


def compile_step_kernel(spec: StepSpec, arch: str = "sm_90a", *, extra_options: str = ""):
    """Compile one specialisation for ``arch`` (no GPU needed) and return the tvm-ffi callable.

    The callable takes the :class:`KernelArgs` fields in order (``None`` where the spec has no
    such tensor; :func:`~mamba3_step.tensors.kernel_arguments` fills them from a call); it
    launches on the caller's current CUDA stream.
    """
    problem = tiling_problem(spec)
    if problem is not None:
        raise ValueError(problem)
    options = f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip()
    return cute.compile(Mamba3StepKernel(spec), *fake_arguments(spec),
                        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options=options)
