"""The values the kernel's parts pass each other, one bundle each (NamedTuples: traced as their fields).

* :class:`Cta`: one CTA's coordinates, its thread and the pool rows it reads and writes;
* :class:`Shared`: its shared-memory buffers, and :class:`Drafts`: those of a verify step whose drafts'
  outputs come from the checkpoint;
* :class:`Token`: one token's coordinates, B buffers, decay coefficients and random words;
* :class:`RowGroup`: one row group of the thread's share of the state, in registers;
* :class:`Operands`: B, Bstate and C at the lane's columns, in registers.

The kernel's global tensors travel as one :class:`~mamba3_step.tensors.KernelArgs` ``m``, declared
(free of cutlass) in :mod:`mamba3_step.tensors`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import cutlass

from ..contract import DTYPES

__all__ = ["CUTLASS_DTYPES", "Cta", "Drafts", "Operands", "RowGroup", "Shared", "Token"]

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
    scales: Any = None  # per row group, an 8-bit state's scales loaded with the asynchronous state copy


class Shared(NamedTuple):
    """The CTA's shared-memory buffers, fp32."""

    sBB: Any  # (2, R, N): this token's B and the previous one, by token parity
    sC: Any  # (R, N): C
    sX: Any  # (tile_D,): x
    sXr: Any  # (R, tile_D): x * xproj
    sUV: Any  # (tile_D, 2R): row coefficients u_r = gamma xr, v_r = beta xprev xproj_r
    sY: Any  # (R, tile_D): sum_n new * C
    sAng: Any = None  # (rope_angles,) Int64: the lane's angles after this token (rotary only)
    sCS: Any = None  # (2, rope_angles): cos and sin of sAng (rotary only)
    sG: Any = None  # (flush_length, R, R): B_j . C per token j since the checkpoint (replay's checkpoint outputs only)
    sW: Any = None  # (flush_length + 1,): the tokens' weights w_j and the decay product P (replay's checkpoint outputs only)
    sWp: Any = None  # (flush_length,): with rotary, w_j's trapezoid part (token j's B~ rounded, as token j + 1 reads it)
    drafts: Any = None  # Drafts: a verify step's tokens, staged at once (replay's checkpoint outputs with T > 1)
    sS: Any = None  # (tile_D, N) in the state dtype: the slab, copied asynchronously (async_state_copy, the pipeline's stage)
    sStages: Any = None  # (stages, tile_D, N) in the state dtype: the slab pipeline's tiles (pipeline_ctas only)
    sHeader: Any = None  # (stages, 2) Int32: each stage's src and dst row, -1 where not live (pipeline_ctas only)
    sIndex: Any = None  # (stages, 2) Int32: a later slab's raw src and dst, copied asynchronously (pipeline_ctas only)
    full: Any = None  # the stages' mbarriers (an Int64 pointer): a stage's tile landed (pipeline_ctas only)


class Drafts(NamedTuple):
    """A verify step's tokens staged together for the drafts' outputs from the checkpoint
    (``replay_from_checkpoint`` with T > 1), fp32, by slot: slot 0 the token before the ring
    (Bstate/Xstate's, or after a flush the last committed token's), slots 1 .. flush_length - 1 the committed ring
    tokens the algebra reads (none after a flush), slots flush_length .. slots - 1 the drafts
    (``slots = flush_length + T``). The B and C rows are
    padded to N + 4 words, so the rows a quarter-warp reads at one column fall in different banks."""

    sB: Any  # (slots, R, N): each slot's B
    sC: Any  # (T, R, N): each draft's C
    sX: Any  # (slots, tile_D): each slot's x
    sXr: Any  # (T, R, tile_D): each draft's x * xproj (the epilogue's skip term)
    sY: Any  # (T, R, tile_D): each draft's y, the checkpoint's term, then all of it
    sG: Any  # (pairs, R, R): per draft i and token j <= ring + i + 1, w_ij B_j . C_i (pairs in (i, j) order)
    sW: Any  # (T, slots + 1): w of draft i's token in each slot, and at slots the decay product P_i


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
    epi: Any = None  # EpilogueOperands, loaded at the token's start (tiling.early_epilogue), else None


class EpilogueOperands(NamedTuple):
    """The epilogue's global operands of one thread for one token, loaded early (tiling.early_epilogue)."""

    dskip: Any  # Float32: D[h]
    rows: list  # per row the thread takes (for_thread_indices' k): (z or None, [zproj per rank], [outproj per rank]), fp32


class RowGroup(NamedTuple):
    """One row group of the thread's share of the state slab."""

    tSrS: Any  # (VN, rows_per_group, CPT) registers in the state dtype, updated in place
    rows: list  # the tile row (Int32) of each register row
    tSrScale: Any = None  # (rows_per_group,) fp32: an 8-bit state's scale per register row, updated in place
    uv_rows: Any = None  # each register row's coordinate in a skewed sUV (Mamba3StepKernel.uv_layout), else None


class Operands(NamedTuple):
    """B, Bstate and C at the lane's columns, read once per token (``ThreadLayout.cache_operands``)."""

    tOrB: Any  # (R, VN, CPT) fp32 registers
    tOrBs: Any  # (R, VN, CPT) fp32 registers
    tOrC: Any  # (R, VN, CPT) fp32 registers, ranks in the lane's order (slot r: rank r ^ (phi & (R-1)))
