"""Thread/tile layout arithmetic of the step kernel, in plain Python (no CuteDSL import).

One CTA owns one (lane b, head h, D-tile) triple: a ``(tile_D, N)`` slab of the state. Its
threads are laid out as a row-major grid of ``rows_per_pass x TPR`` threads over that slab:

* each thread moves one 16-byte vector of ``VN = 16 / sizeof(state)`` consecutive N elements
  per access (fp32: 4, bf16/fp16: 8), so every state load and store is a 16-byte access;
* ``TPR = min(32, N / VN)`` consecutive lanes of a warp cover one row (threads per row);
  when ``N / VN > 32`` each thread takes ``CPT`` vectors per row, ``TPR * VN`` apart, so a
  warp instruction still touches one contiguous 512-byte span;
* a warp covers ``RPW = 32 / TPR`` rows, the CTA ``rows_per_pass = num_warps * RPW`` rows,
  and a thread owns ``rows_per_thread = tile_D / rows_per_pass`` rows, ``rows_per_pass`` apart.

A thread's columns are the same in every row it owns, so the B, Bstate and C values of
those columns (``3 * R * VN * CPT`` fp32) are read from shared memory once and kept in
registers (``cache_operands``) when that fits; otherwise they are re-read per row.

The per-row output ``y[r, d] = sum_n new_state[d, n] * C[r, n]`` leaves each thread with
``rows_per_group * R`` partial sums per row group. They are completed over the TPR lanes
of a row by a *transposed* butterfly: in each shuffle round a lane sends half of its
values and keeps the other half, so ``K`` partials over ``TPR`` lanes cost ``K - 1``
shuffle/add pairs instead of ``K * log2(TPR)``, with no selects (each lane keeps its partials
in a lane-dependent order), and each lane ends holding whole sums that it stores directly
(docs/design/kernel.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .contract import DTYPE_BYTES, SUPPORTED_D, SUPPORTED_N, SUPPORTED_R, VECTOR_BYTES
from .slab_pipeline import pipeline_problem

WARP = 32
ALLOWED_NUM_WARPS = (1, 2, 4, 8, 16)
#: the default num_warps aims at this many state values (fp32 words; twice as many 16-bit
#: values would be unpacked into twice as many registers) held per thread
TARGET_STATE_VALUES_PER_THREAD = 64


@dataclass(frozen=True)
class ThreadLayout:
    VN: int  # state elements per 16-byte vector
    TPR: int  # threads per state row
    CPT: int  # 16-byte chunks per thread per row
    RPW: int  # rows per warp per pass
    rows_per_pass: int
    rows_per_thread: int
    num_threads: int
    state_words_per_thread: int  # 32-bit registers the whole state share of a thread occupies
    row_groups: int  # the thread's rows are reduced (and stored) in this many groups
    rows_per_group: int
    cache_operands: bool  # the thread's B/Bstate/C columns live in registers for all its rows
    mimo: int  # R
    preload: bool  # all row groups' state loads are issued up front (else group by group)

    @property
    def partials_per_group(self) -> int:
        """Partial y sums a thread holds per row group: one per (row, rank)."""
        return self.rows_per_group * self.mimo


#: the asynchronous state copy's rows per group in a one-token step (StepSpec.async_state_copy) of a 16-bit or
#: 8-bit state. Its update reads the slab from shared memory one row group at a time, so a small group holds few
#: registers, at the cost of reading the staged B and C once per group (the bf16 flagship: 120 LDS.128 where 8 rows
#: take 40; on the H200 its shared-memory stalls cost more than the CTAs gained: docs/performance.md). Read from the compiled flagship on sm_90a: a 16-bit state's 2 rows take 78-80
#: registers (6 CTAs per SM) where thread_layout's 8 take 166-168 (3); with stochastic rounding 104 (4 CTAs)
#: where 8 take 210, an 8-bit state 108 where 8 take 164. One row would take 72 (7 CTAs), but for N = 64,
#: D = 32, R = 2 (bf16, stochastic) the compiled update then rounds one element of the executed test's 24,576
#: one unit away from the register kernel's bits. An fp32 state keeps thread_layout's groups: its 8 rows hold
#: 128 registers, 2 rows spill.
ASYNC_ROWS_PER_GROUP = 2


def async_copy_layout(lay: ThreadLayout, state_dtype: str, tokens: int) -> ThreadLayout:
    """``lay`` as the asynchronous state copy runs it: a one-token step of a 16-bit or 8-bit state in row
    groups of :data:`ASYNC_ROWS_PER_GROUP` rows (at most the thread's); an fp32 state, or more tokens (the
    whole share stays in registers from token to token), ``lay`` itself."""
    if tokens > 1 or DTYPE_BYTES[state_dtype] == 4 or ASYNC_ROWS_PER_GROUP >= lay.rows_per_group:
        return lay
    return dataclasses.replace(lay, rows_per_group=ASYNC_ROWS_PER_GROUP,
                               row_groups=lay.rows_per_thread // ASYNC_ROWS_PER_GROUP)


#: a row group's partial sums (rows x R) a thread reduces at once, at most
MAX_GROUP_PARTIALS = 32
#: B, Bstate and C values of a thread's columns kept in registers, at most (fp32 words)
MAX_CACHED_OPERAND_WORDS = 48


def thread_layout(dstate: int, tile_D: int, num_warps: int, state_dtype: str, mimo: int = 1,
                  tokens: int = 1, rounding: bool = False) -> ThreadLayout:
    """The thread layout of one specialisation (see the module docstring).

    All ``rows_per_thread`` rows of a thread are loaded at once (at most 64 state words,
    :func:`tiling_problem`); they are updated and reduced in ``row_groups`` groups of
    ``rows_per_group`` rows whose ``rows_per_group * R`` partial sums fit
    :data:`MAX_GROUP_PARTIALS` (a group is at least one row). With more than one token the
    whole state stays in registers across the token loop (``preload`` is required) and the
    loop keeps more values live: groups hold half as many partials and the register model
    reserves :data:`TOKEN_LOOP_RESERVE` more. A one-token store with stochastic rounding
    (``rounding``) reserves :data:`ROUNDING_RESERVE` for the Philox state.
    """
    VN = VECTOR_BYTES // DTYPE_BYTES[state_dtype]
    TPR = min(WARP, dstate // VN)
    CPT = dstate // (TPR * VN)
    RPW = WARP // TPR
    rows_per_pass = num_warps * RPW
    rows_per_thread = max(1, tile_D // rows_per_pass)
    words = rows_per_thread * CPT * VN * DTYPE_BYTES[state_dtype] // 4
    cache = 3 * mimo * VN * CPT <= MAX_CACHED_OPERAND_WORDS
    budget = min(MAX_REGISTERS, REGISTER_FILE // (num_warps * WARP)) - REGISTER_RESERVE
    max_partials = MAX_GROUP_PARTIALS
    if tokens > 1:
        budget -= TOKEN_LOOP_RESERVE
        max_partials //= 2
    elif rounding:
        budget -= ROUNDING_RESERVE
    rows_per_group = rows_per_thread
    while rows_per_group % 2 == 0 and (
            rows_per_group * mimo > max_partials
            or _registers(words // (rows_per_thread // rows_per_group), rows_per_group * mimo, mimo, VN * CPT,
                          cache) > budget):
        rows_per_group //= 2
    preload = _registers(words, rows_per_group * mimo, mimo, VN * CPT, cache) <= budget
    return ThreadLayout(VN, TPR, CPT, RPW, rows_per_pass, rows_per_thread, num_warps * WARP, words,
                        rows_per_thread // rows_per_group, rows_per_group, cache, mimo, preload)


#: registers of the SM's file, the per-thread maximum, and what a thread needs besides the
#: state, operands and partials (addresses, indices, loop-invariant scalars): a coarse model
#: used to keep every configuration free of spills (the compile tests check the result)
REGISTER_FILE = 65536
MAX_REGISTERS = 255
REGISTER_RESERVE = 40
#: registers the token loop keeps live besides the state (its addresses, the next token's indices)
TOKEN_LOOP_RESERVE = 32
#: registers a stochastic-rounding store keeps live besides the state: a Philox call's counter,
#: key and products, the row's draws. It matters only where the cap is 128 a thread (16 warps):
#: there the row groups shrink and stop preloading (the compile matrix's D = 128, N = 128/256
#: specialisations used 8-200 bytes of stack without it)
ROUNDING_RESERVE = 24


def _registers(state_words: int, partials: int, mimo: int, elements: int, cache: bool) -> int:
    """Registers a thread holds at once: state, partial sums, a row's 2R coefficients, the
    row's fp32 accumulators, and B/Bstate/C of its columns (all ranks when cached, one rank
    at a time otherwise)."""
    operands = 3 * mimo * elements if cache else 3 * elements
    return state_words + partials + 2 * mimo + elements + operands


def launch_grid(batch, heads, headdim: int, tile_D: int) -> tuple:
    """The kernel's grid ``(B, H, D / tile_D)``: one CTA per (lane, head, D-tile) slab. The
    kernel launches it and the PTX execution tier runs it (``batch``/``heads`` may be symbolic)."""
    return (batch, heads, headdim // tile_D)


MAX_CLUSTER_CTAS = 8  #: the most CTAs of one cluster (the portable cluster size of sm_90 and sm_100)


def kv_split_fits(headdim: int, tile_D: int) -> bool:
    """Whether update_kv_state takes ``tile_D``: its ``headdim / tile_D`` D-tiles fit a cluster."""
    return headdim // tile_D <= MAX_CLUSTER_CTAS


def launch_cluster(spec) -> tuple | None:
    """The register kernel's (and the PTX tier's) launch cluster, or None: with ``update_kv_state`` and ``tile_D <
    headdim`` the ``D / tile_D`` CTAs of a (lane, head), ``(1, 1, D / tile_D)`` (``Staging.store_kv_state``)."""
    tiles = spec.headdim // spec.tile_D
    if not spec.update_kv_state or tiles == 1 or spec.pipeline_ctas:
        return None
    return (1, 1, tiles)


def default_tiling(dstate: int, headdim: int, mimo: int, state_dtype: str, tokens: int = 1,
                   whole_head: bool = True, lean: bool | str = False, replay: bool = False,
                   verify: bool = False, from_checkpoint: bool = False, states: str = "") -> tuple[int, int]:
    """Per-configuration default ``(tile_D, num_warps)``.

    ``tile_D = headdim``: one CTA owns a whole (lane, head), which is what makes
    update_kv_state race-free and keeps the B/C staging cost paid once per (lane, head).
    ``num_warps`` is the smallest power of two in [1, 16] that keeps the state fragment at
    about 64 *values* per thread (64 registers of fp32 state, 32 of a 16-bit one, whose words
    unpack into two fp32 values each): few threads with many elements each, so the per-row and
    per-thread overheads (coefficients, reductions, staging) are spread over more state;
    it is lowered if the CTA would have more rows per pass than the tile has rows. (At 64
    words of 16-bit state, i.e. 128 values, seven configurations of the full compile matrix
    used 16-40 bytes of stack on sm_90a, e.g. N=64 D=64 R=1 and R=8, N=32 D=128 R=8.) With
    more than one token the target is half as many values (the token loop keeps more of them
    live): 32 words of fp32 state, 16 of a 16-bit one. (At 32 words of fp16 state, N=32 D=128
    R=1 T=6 compiled to 128 registers and 20 spilled bytes.) With more than one token, when the thread's share of the
    state cannot stay in registers across the tokens, fewer warps (more registers each) are
    tried, then, without ``whole_head`` (no update_kv_state), half the tile_D (N=256 D=128 R=8
    fp32: tile_D=64 with 8 warps). ``lean`` (True: half, ``"quarter"``) lowers the target too, for
    a store that keeps many more values live: stochastic rounding with R = 8 (``spec._rounding_lean``;
    bf16 or fp16, N=32 D=64 at 1 warp used 208 bytes of stack on sm_90a, at 4 warps none). A
    replay step (``replay``, ``tokens`` = K; outputs replayed or from the checkpoint) keeps the
    one-token default where that layout still holds the state across K tokens: its average step runs
    few tokens, and fewer threads issue fewer per-token instructions (staging, coefficients,
    reductions): the flagship at K = 4 averages 1.78x a stepwise slab's executed instructions at 4
    warps (2.14x at the K-token default's 8, counted before the state's D stride was static). With
    outputs from the checkpoint the flagship at 4 warps takes 184 registers, 2 CTAs per SM, against
    the K-token default's 8 warps, 149 registers and one CTA: measured on an H200 1.55x faster
    (K = 2 and 4, B = 256; docs/performance.md, 3d); above :data:`CHECKPOINT_REPLAY_MAX_MIMO` they
    keep the K-token default (``from_checkpoint``). Where that default is one warp, a replay step takes
    two when they fit the tile (:data:`REPLAY_MIN_WARPS`); a replayed verify step (``verify``: T
    drafts) takes at least the warps :data:`VERIFY_WARPS` lists for its shape, and a step with outputs
    from the checkpoint and the other ``states`` (``"rotary"``: the angle with per-head B/C; ``"sr"``:
    stochastic rounding) the warps :data:`CHECKPOINT_STATES_WARPS` lists, a verify step with its drafts
    from the checkpoint those :data:`CHECKPOINT_VERIFY_WARPS` lists.
    """
    tile_D = headdim
    if verify and from_checkpoint and (dstate, headdim, mimo, state_dtype) in CHECKPOINT_VERIFY_WARPS:
        return tile_D, CHECKPOINT_VERIFY_WARPS[(dstate, headdim, mimo, state_dtype)]
    if from_checkpoint and (dstate, headdim, mimo, state_dtype, states) in CHECKPOINT_STATES_WARPS:
        return tile_D, CHECKPOINT_STATES_WARPS[(dstate, headdim, mimo, state_dtype, states)]
    if replay and (not from_checkpoint or mimo <= CHECKPOINT_REPLAY_MAX_MIMO):
        # a replay step: the one-token default where it still keeps the state across the tokens
        num_warps = _replay_warps(dstate, tile_D, state_dtype, mimo, tokens, lean)
        num_warps = max(num_warps, REPLAY_WARPS.get((dstate, headdim, mimo, state_dtype), 0))
        if verify:
            num_warps = max(num_warps, VERIFY_WARPS.get((dstate, headdim, mimo, state_dtype), 0))
        if thread_layout(dstate, tile_D, num_warps, state_dtype, mimo, tokens).preload:
            return tile_D, num_warps
    while True:
        default = _default_warps(dstate, tile_D, state_dtype, tokens, lean)
        if tokens == 1:
            return tile_D, default
        num_warps = default
        while num_warps > 1 and not thread_layout(dstate, tile_D, num_warps, state_dtype, mimo, tokens).preload:
            num_warps //= 2
        if thread_layout(dstate, tile_D, num_warps, state_dtype, mimo, tokens).preload:
            return tile_D, num_warps
        if whole_head or tile_D <= 8:
            return tile_D, default  # no tiling keeps the state: tiling_problem says so
        tile_D //= 2


#: the fewest warps a replayed step's default gives a CTA where the tile has rows for them. At one
#: warp (the one-token default of the small slabs: N = 32, 64 with D = 32, 64) a replay thread holds
#: the ring's coefficients, the draft's partials and a flush's whole share at once, and the register
#: model misses it: N=64 D=32 R=4 fp32 used 16 bytes of stack on sm_90a, N=32 D=64 R=2 fp32 with
#: destinations 24, the T = 4 verify step at R = 8 up to 544. At two warps the 108 replayed
#: specialisations (plain, destinations, T = 4 verify; every N, D, R, 16- and 32-bit state) whose
#: default was one warp compile clean on sm_90a but N=32 D=64 R=8 fp16's verify step (304 bytes;
#: :data:`VERIFY_WARPS` gives it four), and on sm_100a but that step (320) and N=32 D=32 R=4 fp32
#: plain (8 bytes at 80 registers; clean at one warp and at four, which it takes: :data:`REPLAY_WARPS`).
#: The outputs keep their bits: a row's reduction is laid out by N and the state's width
#: (``ThreadLayout`` VN, TPR, CPT), not by warps (the PTX tier's replay tests compare them).
REPLAY_MIN_WARPS = 2


#: replay steps' warps, by (N, D, R, state dtype), where :data:`REPLAY_MIN_WARPS` made the default use
#: stack: N = 32 D = 32 R = 4 fp32 at two warps used 8 bytes on sm_100a at 80 registers, with and
#: without the rotary angle (clean at one warp, and at four, 64 registers: a sweep at 1-16 warps,
#: 2026-11-28; sm_90a is clean at both).
REPLAY_WARPS = {(32, 32, 4, "float32"): 4}


#: the largest MIMO rank at which a step with outputs from the checkpoint takes the replayed default
#: tiling (fewer warps, more registers a thread); above it, the K-token default. At R = 8 the append
#: path's R x R tables and the ring's terms beside a flush's slab used stack at the replayed default in
#: 16 of the 28 shapes that compile clean at the K-token default on sm_90a and 15 of 27 on sm_100a
#: (every N, D and 16/32-bit state at K = 4, 2026-11-27); at R <= 4 none that was clean there did
#: (the known spills, tests/kernel/test_kernel_compile.py's REPLAY_SPILLS, stay).
CHECKPOINT_REPLAY_MAX_MIMO = 4


#: replayed verify steps' warps, by (N, D, R, state dtype), where the replay default used stack:
#: the fewest at which the K = 4, T = 4 verify step compiled with none on both sm_90a and sm_100a
#: (a sweep at 2, 4 and 8 warps of every shape that spilled, 2026-11-27: at their default each ran
#: at the 255-register cap; tests/kernel/test_kernel_compile.py's full matrix checks every shape at its
#: default). N = 256, D = 128 with a 16-bit state is not here: it uses stack at 8 warps, and at 16
#: (the register cap halved to 128; compiled with the layout forced to keep the state, which the
#: register model refuses) R = 4 bf16 spilled 660 bytes on sm_90a (2026-11-27). A verify thread
#: holds each draft's partial sums and the ring's coefficients beside the state, which the register
#: model does not count; a rule that predicts it is open work.
VERIFY_WARPS = {
    (32, 64, 8, "float16"): 4,
    **{(32, 128, R, sd): 4 for R in (4, 8) for sd in ("float32", "bfloat16", "float16")},
    **{(64, 64, 8, sd): 4 for sd in ("float32", "bfloat16", "float16")},
    **{(64, 128, 8, sd): 8 for sd in ("float32", "bfloat16", "float16")},
    (128, 64, 2, "float16"): 8,
}


#: warps of steps with outputs from the checkpoint and the other states, by (N, D, R, state dtype, states:
#: ``"rotary"`` the angle with per-head B/C, ``"sr"`` stochastic rounding), where the default used stack:
#: the fewest at which the one-token step (rotary and bf16 at K = 4, int8 at K = 2) compiled with none on
#: both sm_90a and sm_100a (a sweep at 2, 4, 8 and 16 warps of every such shape that spilled, 2026-11-28;
#: at their default 8-200 bytes, the append's re-staged B~ or rounded operands beside the R x R tables).
#: No warp count was clean for bf16 N = 128 D = 128 R = 8 on sm_90a, int8 N = 256 D = 128 R = 2, rotary
#: N = 128 D = 128 R = 4 (sm_90a) and R = 8, rotary N = 256 D = 64 R = 8 (8-88 bytes at 8 warps; 16 has no
#: layout): they keep their defaults (tests/kernel/test_kernel_compile.py's REPLAY_STATES_SPILLS). One exception
#: to "the fewest": bf16 N = 128 D = 128 R = 1 compiled clean at 4 warps only at the 255-register cap on
#: both targets, so it takes 16 (121 registers). The flagship's rotary layer (B/C shared by the heads) is
#: clean at its default and not listed. Their speed at these warps is not measured.
CHECKPOINT_STATES_WARPS = {
    (32, 32, 8, "float32", "rotary"): 2,
    (32, 128, 2, "float32", "rotary"): 8,
    (32, 128, 4, "float32", "rotary"): 4,
    (64, 32, 1, "float32", "rotary"): 4,
    (64, 64, 4, "float32", "rotary"): 4,
    (64, 128, 4, "float32", "rotary"): 8,
    (128, 32, 4, "float32", "rotary"): 4,
    (128, 64, 4, "float32", "rotary"): 8,
    (32, 64, 8, "int8", "sr"): 2,
    (128, 128, 1, "bfloat16", "sr"): 16,
}


#: warps of verify steps with the drafts' outputs from the checkpoint, by (N, D, R, state dtype), where
#: the default used stack: the fewest at which the K = 4, T = 4 step compiled with none on both sm_90a and
#: sm_100a (every N, D, R and unscaled state dtype at its default, 280 compiles, 2026-11-28: 11 used 8-264
#: bytes; each such shape then at 2, 4, 8 and 16 warps). Besides that sweep: the int8 flagship (8 bytes on
#: sm_90a at 4 warps) and N = 32 D = 64 R = 2 bf16 (8 bytes at 2 warps with K = 2, T = 3; clean at K = 4,
#: T = 4). N = 256 D = 64 R = 1 fp16 is clean at 4 warps only at 254 registers and takes 16 (94). Left:
#: N = 256 D = 64 R = 1 fp32 on sm_90a (8 bytes at 8 warps, the only count with a layout) and N = 256
#: D = 128 R = 8 with a 16-bit state (160-264 bytes at 8 warps, as the replayed verify step):
#: tests/kernel/test_kernel_compile.py's CHECKPOINT_VERIFY_SPILLS. Their speed at these warps is not measured.
CHECKPOINT_VERIFY_WARPS = {
    (32, 32, 1, "float32"): 4,
    (32, 64, 2, "bfloat16"): 4,
    (128, 64, 1, "float16"): 8,
    (128, 64, 2, "float32"): 8,
    (128, 64, 4, "int8"): 8,
    (256, 64, 1, "float16"): 16,
}


def _replay_warps(dstate: int, tile_D: int, state_dtype: str, mimo: int, tokens: int, lean) -> int:
    """A replayed step's default warps: the one-token default, raised to :data:`REPLAY_MIN_WARPS`
    where that many warps' rows fit the tile and still keep the state across the ``tokens``."""
    num_warps = _default_warps(dstate, tile_D, state_dtype, 1, lean)
    if num_warps < REPLAY_MIN_WARPS:
        lay = thread_layout(dstate, tile_D, REPLAY_MIN_WARPS, state_dtype, mimo, tokens)
        if lay.rows_per_pass <= tile_D and lay.preload:
            return REPLAY_MIN_WARPS
    return num_warps


def _default_warps(dstate: int, tile_D: int, state_dtype: str, tokens: int, lean: bool | str = False) -> int:
    """The default warp count for a tile (see :func:`default_tiling`)."""
    slab_bytes = tile_D * dstate * DTYPE_BYTES[state_dtype]
    target = TARGET_STATE_VALUES_PER_THREAD * DTYPE_BYTES[state_dtype] // 4  # in 32-bit state words
    if tokens > 1 or lean:
        target //= 2
    if lean == "quarter":
        target //= 2
    want = slab_bytes // (WARP * 4 * target)
    num_warps = 1
    while num_warps < want and num_warps < 16:
        num_warps *= 2
    while num_warps > 1 and thread_layout(dstate, tile_D, num_warps, state_dtype).rows_per_pass > tile_D:
        num_warps //= 2
    return num_warps


#: the tilings whose stepwise tokens load the epilogue's operands at their start (unless StepSpec.late_epilogue):
#: it takes one dependent round trip off the CTA and keeps its CTAs per SM at 4 and 8 warps, where the compiled
#: covering and feature sets (sm_90a) gain 0-34 registers and lose no CTA. At 1, 2 and 16 warps 7-11 more
#: registers cost CTAs (32 -> 28 at 1 warp, 14 -> 12 at 2, 2 -> 1 at 16). docs/design/kernel.md has the table
EARLY_EPILOGUE_WARPS = (4, 8)


def early_epilogue(spec) -> bool:
    """Whether ``spec``'s kernel loads the epilogue's operands at the token's start: the register kernel's
    stepwise tokens (no replay, no asynchronous state copy) at 4 or 8 warps, unless ``late_epilogue``."""
    return (not spec.late_epilogue and not spec.replay_ring and not spec.async_state_copy
            and spec.num_warps in EARLY_EPILOGUE_WARPS)


def pinned_loads(spec) -> bool:
    """Whether ``spec``'s kernel puts a CTA barrier after the loads its first token issues at its start (the
    slab, the decay coefficients, the epilogue's operands when loaded early), so that the compiler issues every
    one of them before the first use of any: the register kernel's stepwise tokens (no replay, no asynchronous
    state copy) whose whole slab is loaded up front (``ThreadLayout.preload``: else the barrier would hold only
    the first row group's loads), unless ``unpinned_loads``. Compiled, the 33 such specialisations of the
    covering and feature sets keep their CTAs per SM on sm_90a and sm_100a, with no spill and 15 registers fewer
    to 16 more, and each makes the same round trips or one fewer (bench/load_layout_scan.py); the three 16-warp
    tilings that load by row group made one more on sm_100a with the barrier."""
    if spec.unpinned_loads or spec.replay_ring or spec.async_state_copy:
        return False
    return thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo, spec.carried_tokens,
                         spec.stochastic_rounding).preload


#: the largest launch bound StepSpec.min_ctas_per_sm takes (an experiment's knob; 8 CTAs of 4 warps
#: would leave 64 registers a thread)
MAX_MIN_CTAS_PER_SM = 8


def tiling_problem(spec) -> str | None:
    """Why ``spec``'s (tile_D, num_warps) cannot be compiled, or None when it can.

    ``spec`` is a :class:`~mamba3_step.spec.StepSpec` (read by attribute: this module sits below
    ``spec``, which builds its default tiling from :func:`default_tiling`).
    """
    if spec.num_warps not in ALLOWED_NUM_WARPS:
        return f"num_warps must be one of {ALLOWED_NUM_WARPS}, got {spec.num_warps}"
    if not 0 <= spec.min_ctas_per_sm <= MAX_MIN_CTAS_PER_SM:
        return f"min_ctas_per_sm must be in [0, {MAX_MIN_CTAS_PER_SM}], got {spec.min_ctas_per_sm}"
    if spec.tile_D <= 0 or spec.tile_D & (spec.tile_D - 1) or spec.headdim % spec.tile_D:
        return (
            f"tile_D must be a power of two dividing headdim={spec.headdim}, got {spec.tile_D}"
        )
    T = spec.carried_tokens
    lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo, T,
                        spec.stochastic_rounding)
    if lay.rows_per_pass > spec.tile_D:
        return (
            f"tile_D={spec.tile_D} is smaller than the {lay.rows_per_pass} rows that "
            f"num_warps={spec.num_warps} cover in one pass (N={spec.dstate}, "
            f"{spec.state_dtype} state); use tile_D >= {lay.rows_per_pass} or fewer warps"
        )
    if lay.state_words_per_thread > 64:
        return (
            f"tile_D={spec.tile_D}, num_warps={spec.num_warps} would hold "
            f"{lay.state_words_per_thread} state registers per thread (at most 64): "
            "use more warps or a smaller tile_D"
        )
    if T > 1 and not lay.preload:
        what = f"replay_ring={T}" if spec.replay_ring else f"tokens={T}"
        return (
            f"{what} keeps each thread's whole share of the state in registers from "
            f"token to token, which tile_D={spec.tile_D}, num_warps={spec.num_warps} cannot "
            f"(N={spec.dstate}, R={spec.mimo}, {spec.state_dtype} state, {lay.state_words_per_thread} "
            f"state registers per thread): use a smaller tile_D (without update_kv_state) or a 16-bit state"
        )
    if spec.update_kv_state and not kv_split_fits(spec.headdim, spec.tile_D):
        return (f"update_kv_state with tile_D < headdim launches the {spec.headdim // spec.tile_D} CTAs of a (lane, head) "
                f"as one cluster, at most {MAX_CLUSTER_CTAS} (the portable cluster size): use tile_D >= "
                f"{spec.headdim // MAX_CLUSTER_CTAS}, got tile_D={spec.tile_D} (headdim={spec.headdim})")
    if spec.programmatic_launch and (spec.async_state_copy or spec.replay_ring):
        return "programmatic_launch is the register kernel's and the slab pipeline's: not with async_state_copy or replay_ring"
    return pipeline_problem(spec)


def shape_problem(dstate: int, headdim: int, mimo: int) -> str | None:
    """Why (N, D, R) is unsupported, listing what is, or None."""
    bad = []
    if dstate not in SUPPORTED_N:
        bad.append(f"N (dstate) must be one of {SUPPORTED_N}, got {dstate}")
    if headdim not in SUPPORTED_D:
        bad.append(f"D (headdim) must be one of {SUPPORTED_D}, got {headdim}")
    if mimo not in SUPPORTED_R:
        bad.append(f"R (mimo rank) must be one of {SUPPORTED_R}, got {mimo}")
    return "; ".join(bad) or None
