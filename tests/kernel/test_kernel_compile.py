"""The kernel compiles for sm_90a and sm_100a, and what the compiler made of it is checked.

No GPU needed: ``cute.compile`` runs on the CPU and the cubin is read back from the compiled
object (mamba3_step.tools.inspection). For every configuration compiled: zero stack and spill bytes, a
register count the launch can have, every state load and store a 16-byte access (fp32 and
16-bit states alike: VN elements per vector), and in pool mode no pool access before the
padding branch. The flagship (pool mode with update_kv_state) stays within its instruction
budget per state slab and keeps at least 32 KiB of state loads in flight per SM.

The default run compiles a covering set (every N, D, R, dtype and mode flag at least once) for
both architectures, the multi-token specialisations (the flagship with T in {2, 3, 4, 6, 8},
every T-specific path) for both, the rotary, stochastic, 8-bit and replay sets for both, and the
covering set with T in {2, 4, 8} for sm_90a;
``--full-matrix`` adds the latter for sm_100a and compiles the cross product.
"""

from __future__ import annotations

import itertools
import re

import pytest

from mamba3_step.tools.inspection import kernel_facts
from mamba3_step.tools.issue_model import GPUS, issue_model, slab_bytes, verify_spec
from mamba3_step.kernel import compile_step_kernel
from mamba3_step.tools.ptx_tier import ptx_kernel
from mamba3_step.contract import (DTYPE_BYTES, KV_DTYPES, SCALED_STATE_DTYPES, STATE_DTYPES, SUPPORTED_D, SUPPORTED_N,
                                  SUPPORTED_R)
from mamba3_step.spec import StepSpec, flagship_rotary_spec, flagship_spec, flush_specs
from mamba3_step.tools.latency_model import KERNEL_LATENCY_FACTS, SPLIT_LATENCY_FACTS, global_round_trips
from mamba3_step.tiling import (CHECKPOINT_STATES_WARPS, CHECKPOINT_VERIFY_WARPS, VERIFY_WARPS, default_tiling,
                                thread_layout, tiling_problem)

ARCHS = ("sm_90a", "sm_100a")

# Every N, D, R, state/kv/x/proj dtype and mode flag appears at least once.
COVERING = {
    "flagship-pool-kv": flagship_spec(),
    "flagship-dense": flagship_spec(pool=False, update_kv_state=False),
    "N32-D32-R1-bf16state-dense-noz-noout": StepSpec(
        32, 32, 1, "bfloat16", "float16", "float16", "float32", has_z=False, has_outproj=False),
    "N64-D128-R2-fp16state-pool-dst-kv-noout": StepSpec(
        64, 128, 2, "float16", "float32", "float32", "float16", pool=True, has_dst=True,
        update_kv_state=True, has_outproj=False),
    "N256-D128-R8-fp32-dense-stateout-noz": StepSpec(
        256, 128, 8, "float32", "float32", "bfloat16", "bfloat16", has_state_out=True, has_z=False),
    # on sm_100a the padding guard of this one is a uniform-predicate operand (BRA.U !UP0, ...)
    "N256-D32-R8-bf16state-pool-dst-kv": StepSpec(
        256, 32, 8, "bfloat16", "bfloat16", "bfloat16", "bfloat16", pool=True, has_dst=True,
        update_kv_state=True),
    # update_kv_state with two D-tiles a (lane, head): a cluster of 2 CTAs (tiling.launch_cluster)
    "N32-D64-R4-tileD32-pool-kv": StepSpec(
        32, 64, 4, "float32", "bfloat16", "bfloat16", "bfloat16", tile_D=32, num_warps=2, pool=True,
        update_kv_state=True),
}


def _speculative(**changes) -> dict:
    """A speculative verify step's flags: (B, K) sources picked by num_accepted_tokens, a row per token."""
    return dict(pool=True, has_dst=True, dst_per_token=True, num_accepted=True, **changes)


# Multi-token steps: every T-specific path (per-token and final destinations, accepted
# counts, dense with state_out, several CTAs per lane, each state dtype) at least once.
MULTI_TOKEN = {
    "flagship-T2-spec": flagship_spec(tokens=2, **_speculative()),
    "flagship-T4-spec": flagship_spec(tokens=4, **_speculative()),
    "flagship-T3-spec": flagship_spec(tokens=3, **_speculative()),
    "flagship-T6-spec": flagship_spec(tokens=6, **_speculative()),
    "flagship-T8-spec": flagship_spec(tokens=8, **_speculative()),
    "flagship-T3-final-dst": flagship_spec(tokens=3, has_dst=True),
    "flagship-T4-dense-stateout": flagship_spec(tokens=4, pool=False, update_kv_state=False, has_state_out=True),
    "N64-D64-R4-bf16state-T4-spec-tileD32-kv": StepSpec(
        64, 64, 4, "bfloat16", "bfloat16", "bfloat16", "bfloat16", tile_D=32, tokens=4, update_kv_state=True,
        **_speculative()),
    "N256-D32-R8-bf16state-T2-spec-kv": StepSpec(
        256, 32, 8, "bfloat16", "bfloat16", "bfloat16", "bfloat16", tokens=2, update_kv_state=True, **_speculative()),
    "N32-D128-R1-fp16state-T6-spec-noz-noout": StepSpec(
        32, 128, 1, "float16", "float32", "float16", "float32", tokens=6, has_z=False, has_outproj=False,
        update_kv_state=True, **_speculative()),
    "N256-D128-R8-fp32-T2-dense": StepSpec(256, 128, 8, "float32", "float32", "bfloat16", "bfloat16", tokens=2),
}


def with_tokens(spec: StepSpec, T: int) -> StepSpec:
    """``spec`` as a T-token step: pool specs take (B, K) sources and a row per token for T = 2, 8
    and a final destination for T = 4; the explicit tiling is kept when it still fits, else the
    T-token default is taken."""
    per_token = spec.pool and T != 4
    s = spec.replace(tokens=T, num_accepted=per_token, dst_per_token=per_token and spec.has_dst)
    return s if tiling_problem(s.with_default_tiling()) is None else s.replace(tile_D=0, num_warps=0)


# Rotary: the layer's flagship form, SISO pairwise with rope fraction 1.0, a 16-bit
# state in dense mode, fp16 with separate destinations, and a speculative step.
ROTARY = {
    "flagship-rotary": flagship_rotary_spec(),
    "N64-D32-R1-siso-pairwise-rope1": StepSpec(
        64, 32, 1, "float32", "bfloat16", "bfloat16", "bfloat16", pool=True, update_kv_state=True,
        rope_angles=32, rotate_pairwise=True, has_bc_bias=True),
    "N32-D64-R2-bf16state-dense-rotary": StepSpec(
        32, 64, 2, "bfloat16", "bfloat16", "bfloat16", "bfloat16", has_z=False, rope_angles=8),
    "N128-D64-R4-fp16state-pool-dst-rotary-perhead": StepSpec(
        128, 64, 4, "float16", "float16", "float16", "float16", pool=True, has_dst=True, update_kv_state=True,
        rope_angles=64, has_bc_bias=True),
    "flagship-rotary-T4-spec": flagship_rotary_spec(tokens=4, **_speculative()),
}

#: the state dtypes without a scale (8-bit states need stochastic rounding and state_scale: EIGHT_BIT)
UNSCALED = tuple(d for d in STATE_DTYPES if d not in SCALED_STATE_DTYPES)

# Stochastic rounding of 16-bit states: bf16 and fp16, pool, dense, a speculative step.
STOCHASTIC = {
    "flagship-bf16state-sr": flagship_spec(state_dtype="bfloat16", stochastic_rounding=True),
    "flagship-fp16state-sr": flagship_spec(state_dtype="float16", stochastic_rounding=True),
    "N64-D32-R2-bf16state-dense-sr": StepSpec(64, 32, 2, "bfloat16", stochastic_rounding=True),
    "flagship-fp16state-dense-sr-rows": flagship_spec(state_dtype="float16", pool=False, stochastic_rounding=True,
                                                      has_rand_rows=True),
    "N256-D32-R8-fp16state-pool-dst-sr": StepSpec(
        256, 32, 8, "float16", "bfloat16", "bfloat16", "bfloat16", pool=True, has_dst=True, update_kv_state=True,
        stochastic_rounding=True),
    "flagship-bf16state-sr-T4-spec": flagship_spec(state_dtype="bfloat16", tokens=4, stochastic_rounding=True,
                                                   **_speculative()),
    # 16 warps, 128 registers a thread: row groups of one row, loaded group by group (no preload)
    "N128-D128-R8-fp16state-pool-dst-sr": StepSpec(
        128, 128, 8, "float16", pool=True, has_dst=True, update_kv_state=True, stochastic_rounding=True),
}

# 8-bit states with scales: int8 and e4m3, pool, dense (with rand_rows), R = 8, a speculative step.
EIGHT_BIT = {
    "flagship-int8state": flagship_spec(state_dtype="int8", stochastic_rounding=True),
    "flagship-fp8state": flagship_spec(state_dtype="float8_e4m3fn", stochastic_rounding=True),
    "N32-D64-R2-int8state-dense": StepSpec(32, 64, 2, "int8", stochastic_rounding=True),
    "flagship-fp8state-dense-rows": flagship_spec(state_dtype="float8_e4m3fn", pool=False, stochastic_rounding=True,
                                                  has_rand_rows=True),
    "N256-D32-R8-fp8state-pool-dst": StepSpec(
        256, 32, 8, "float8_e4m3fn", "bfloat16", "bfloat16", "bfloat16", pool=True, has_dst=True,
        update_kv_state=True, stochastic_rounding=True),
    "flagship-int8state-T4-spec": flagship_spec(state_dtype="int8", tokens=4, stochastic_rounding=True,
                                                **_speculative()),
}

# Replay: the flagship at K = 4 (the plain-decode default), K = 2 with a bf16 state, K = 8
# with an fp16 state and B/C shared by the heads, R = 8 without outproj, fp32 x and out; outputs from
# the checkpoint (replay_from_checkpoint) for the flagship at K = 4 and 8 and R = 8 at K = 3; the
# flagship at K = 4 replayed at 8 warps (128 registers, 16 warps per SM: what gpu_bench.py --suite replay
# --replay-warps 8 times against the 4-warp default).
REPLAY = {
    "flagship-replay-K4": flagship_spec(replay_ring=4),
    "flagship-replay-K4-8warps": flagship_spec(replay_ring=4, num_warps=8),
    "flagship-replay-K4-from-checkpoint": flagship_spec(replay_ring=4, replay_from_checkpoint=True),
    "flagship-replay-K8-from-checkpoint": flagship_spec(replay_ring=8, replay_from_checkpoint=True),
    "N32-D64-R8-replay-K3-bf16state-from-checkpoint-noout": StepSpec(
        32, 64, 8, "bfloat16", pool=True, update_kv_state=True, has_outproj=False, replay_ring=3,
        replay_from_checkpoint=True),
    "flagship-replay-K2-bf16state": flagship_spec(replay_ring=2, state_dtype="bfloat16"),
    "N64-D32-R2-fp16state-replay-K8-sharedbc-noz": StepSpec(
        64, 32, 2, "float16", "float16", "float16", "bfloat16", pool=True, update_kv_state=True, has_z=False,
        shared_bc=True, replay_ring=8),
    "N32-D64-R8-replay-K3-fp32io-noout": StepSpec(
        32, 64, 8, "float32", "float32", "float32", "float32", pool=True, update_kv_state=True, has_outproj=False,
        replay_ring=3),
    # the rotary flagship (the whole Mamba-3 decode state): ring entries keep B and the angle, a replayed
    # token's B~ is staged again from them
    "flagship-rotary-replay-K4": flagship_rotary_spec(replay_ring=4),
    # low-precision states: each replayed entry rounds with the draws its step made (its recorded offset
    # and row); a 16-bit state rounded stochastically, and the 8-bit flagship a replay pool keeps
    "flagship-bf16state-sr-replay-K4": flagship_spec(replay_ring=4, state_dtype="bfloat16", stochastic_rounding=True),
    "flagship-int8state-replay-K2": flagship_spec(replay_ring=2, state_dtype="int8", stochastic_rounding=True),
    # the same with outputs from the checkpoint: an append contracts the scaled 8-bit checkpoint, a flush
    # rounds with the recorded draws
    "flagship-int8state-replay-K2-from-checkpoint": flagship_spec(replay_ring=2, state_dtype="int8",
                                                                  stochastic_rounding=True, replay_from_checkpoint=True),
    "flagship-bf16state-sr-replay-K4-from-checkpoint": flagship_spec(
        replay_ring=4, state_dtype="bfloat16", stochastic_rounding=True, replay_from_checkpoint=True),
    # the rotary flagship from the checkpoint: each ring token's B~ staged again, its own update's and the
    # next token's trapezoid term's (B~ rounded to bf16) weighted into one table
    "flagship-rotary-replay-K4-from-checkpoint": flagship_rotary_spec(replay_ring=4, replay_from_checkpoint=True),
    # per-head B/C, 16-bit B and fp32 x and out: the B~ rounding of the trapezoid term is visible in out
    "N32-D64-R2-fp32io-bf16kv-replay-K3-rotary-perhead-from-checkpoint": StepSpec(
        32, 64, 2, "float32", "bfloat16", "float32", "float32", pool=True, update_kv_state=True, has_z=False,
        replay_ring=3, rope_angles=8, has_bc_bias=True, replay_from_checkpoint=True),
}

#: replay's verify steps (T draft tokens; the next step commits num_accepted_tokens of them)
REPLAY_VERIFY = {
    "flagship-replay-K4-verify-T4": flagship_spec(replay_ring=4, tokens=4, num_accepted=True),
    "flagship-replay-K8-verify-T4": flagship_spec(replay_ring=8, tokens=4, num_accepted=True),
    "N32-D64-R2-bf16state-replay-K2-verify-T2-noz": StepSpec(
        32, 64, 2, "bfloat16", pool=True, update_kv_state=True, has_z=False, replay_ring=2, tokens=2,
        num_accepted=True),
    "flagship-rotary-replay-K4-verify-T4": flagship_rotary_spec(replay_ring=4, tokens=4, num_accepted=True),
    "N32-D64-R2-fp16-replay-K2-verify-T3-rotary-perhead": StepSpec(
        32, 64, 2, "float32", "float16", "float16", "float16", pool=True, update_kv_state=True, has_z=False,
        replay_ring=2, tokens=3, num_accepted=True, rope_angles=8, has_bc_bias=True),
    "flagship-fp8state-replay-K4-verify-T4": flagship_spec(replay_ring=4, tokens=4, num_accepted=True,
                                                           state_dtype="float8_e4m3fn", stochastic_rounding=True),
    "N32-D64-R2-fp16state-sr-replay-K2-verify-T2-noz": StepSpec(
        32, 64, 2, "float16", pool=True, update_kv_state=True, has_z=False, replay_ring=2, tokens=2,
        num_accepted=True, stochastic_rounding=True),
    # the drafts' outputs from the checkpoint (replay_from_checkpoint)
    "flagship-replay-K4-verify-T4-from-checkpoint": flagship_spec(replay_ring=4, tokens=4, num_accepted=True,
                                                                  replay_from_checkpoint=True),
    "N32-D64-R2-bf16state-replay-K2-verify-T3-noz-from-checkpoint": StepSpec(
        32, 64, 2, "bfloat16", pool=True, update_kv_state=True, has_z=False, replay_ring=2, tokens=3,
        num_accepted=True, replay_from_checkpoint=True),
    "flagship-replay-K8-verify-T4-from-checkpoint": flagship_spec(replay_ring=8, tokens=4, num_accepted=True,
                                                                  replay_from_checkpoint=True),
    "flagship-int8state-replay-K4-verify-T4-from-checkpoint": flagship_spec(
        replay_ring=4, tokens=4, num_accepted=True, state_dtype="int8", stochastic_rounding=True,
        replay_from_checkpoint=True),
}

#: the verify steps compiled and executed with --full-matrix only (the default run covers their code at
#: smaller K, T or N: K = 8 by K = 4; rotary and 8-bit verify steps by the per-head fp16 rotary and the
#: fp16 stochastically rounded T = 2 and 3 forms, and the flagship's one-token rotary and int8 forms; the drafts
#: from the checkpoint at K = 8 and with an int8 state by the flagship's at K = 4, the bf16 form's and the one-token
#: int8 form's scale)
REPLAY_VERIFY_FULL = frozenset({"flagship-replay-K8-verify-T4", "flagship-rotary-replay-K4-verify-T4",
                                "flagship-fp8state-replay-K4-verify-T4",
                                "flagship-replay-K8-verify-T4-from-checkpoint",
                                "flagship-int8state-replay-K4-verify-T4-from-checkpoint"})
#: one-token replay steps executed and compiled with --full-matrix only: K = 8
#: from the checkpoint (K = 4 runs by default), the flagship at 8 warps (a row's bits do not depend on
#: the warps: test_ptx_replay.py checks that by default), and the bf16 flagship rounded stochastically, replayed
#: and from the checkpoint (a replay pool keeps no 16-bit stochastic state; its code runs by default in
#: the bf16 form with destinations and the fp16 verify step, the flagship's 8-bit forms in the int8 ones),
#: and R = 8 replayed with fp32 x and B (R = 8 runs by default from the checkpoint, fp32 x in the per-head
#: rotary form from the checkpoint, whose flushes replay)
REPLAY_FULL = frozenset({"flagship-replay-K8-from-checkpoint", "flagship-bf16state-sr-replay-K4",
                         "flagship-bf16state-sr-replay-K4-from-checkpoint", "flagship-replay-K4-8warps",
                         "N32-D64-R8-replay-K3-fp32io-noout"})

#: one-token replay steps with destinations (a lane whose destination is another row flushes into it)
REPLAY_DST = {
    "N32-D64-R2-bf16state-replay-K3-dst-noz": StepSpec(
        32, 64, 2, "bfloat16", pool=True, has_dst=True, update_kv_state=True, has_z=False, replay_ring=3),
    "N32-D64-R2-bf16state-replay-K3-dst-from-checkpoint-noz": StepSpec(
        32, 64, 2, "bfloat16", pool=True, has_dst=True, update_kv_state=True, has_z=False, replay_ring=3,
        replay_from_checkpoint=True),
    "N64-D32-R1-siso-pairwise-rope1-replay-K3-dst": ROTARY["N64-D32-R1-siso-pairwise-rope1"].replace(
        has_dst=True, replay_ring=3),
    "N64-D32-R1-siso-pairwise-rope1-replay-K3-dst-from-checkpoint": ROTARY["N64-D32-R1-siso-pairwise-rope1"].replace(
        has_dst=True, replay_ring=3, replay_from_checkpoint=True),
    # a moved lane's ring entries replay with the draws of the row they were decoded in, its own token
    # draws for the destination
    "N32-D64-R2-bf16state-sr-replay-K3-dst-noz": StepSpec(
        32, 64, 2, "bfloat16", pool=True, has_dst=True, update_kv_state=True, has_z=False, replay_ring=3,
        stochastic_rounding=True),
}

#: replayed steps whose one-token default is one warp, at the two warps they get instead
#: (tiling.REPLAY_MIN_WARPS): each used stack at one warp on sm_90a (16, 24 and 8 bytes)
REPLAY_SMALL = {
    "N64-D32-R4-replay-K4": StepSpec(64, 32, 4, "float32", pool=True, update_kv_state=True, replay_ring=4),
    "N32-D64-R2-replay-K4-dst": StepSpec(32, 64, 2, "float32", pool=True, has_dst=True, update_kv_state=True,
                                         replay_ring=4),
    "N32-D32-R8-bf16state-replay-K4-verify-T4": StepSpec(32, 32, 8, "bfloat16", pool=True, update_kv_state=True,
                                                         replay_ring=4, tokens=4, num_accepted=True),
}

#: verify steps with fewer drafts than their ring holds (a ring made for T = 3, StepSpec.replay_draft),
#: and a one-token step committing drafts, beside the T = 3 step that fills the ring:
#: tests/ptx/test_ptx_replay_verify.py alternates them
_SMALL_VERIFY = REPLAY_VERIFY["N32-D64-R2-bf16state-replay-K2-verify-T2-noz"]
REPLAY_VERIFY_MIXED = {
    "N32-D64-R2-bf16state-replay-K2-verify-T3-noz": _SMALL_VERIFY.replace(tokens=3),
    "N32-D64-R2-bf16state-replay-K2-verify-T2-draft3-noz": _SMALL_VERIFY.replace(replay_draft=3),
    "N32-D64-R2-bf16state-replay-K2-T1-accepted-noz": _SMALL_VERIFY.replace(tokens=1, replay_draft=3),
}

#: materialize_fn's flush form on CUDA (mamba3_step.materialize.flush_specs: a verify step with K = 1 and two
#: zero drafts) for the pools users make: the flagship at K = 4 (fp32, rotary, bf16 verify rounds of T = 4),
#: the int8 flagship at K = 2, and a ring of 31 entries (K = 16, T = 16: two launches, the second K = 16)
MATERIALIZE = {
    "flagship-flush-L3": flush_specs(flagship_spec(), 3)[0],
    "flagship-rotary-flush-L3": flush_specs(flagship_rotary_spec(), 3)[0],
    "flagship-bf16state-flush-L7": flush_specs(flagship_spec(state_dtype="bfloat16"), 7)[0],
    "flagship-int8state-flush-L1": flush_specs(flagship_spec(state_dtype="int8", stochastic_rounding=True), 1)[0],
    "flagship-flush-L31-first": flush_specs(flagship_spec(), 31)[0],
    "flagship-flush-L31-second": flush_specs(flagship_spec(), 31)[1],
}
#: compiled with --full-matrix only: the default run compiles the fp32 and int8 forms (the rotary and bf16
#: forms differ from them as the replay verify steps compiled by default do; the L = 31 ones unroll 31 entries)
MATERIALIZE_FULL = frozenset({"flagship-rotary-flush-L3", "flagship-bf16state-flush-L7", "flagship-flush-L31-first",
                              "flagship-flush-L31-second"})

#: the covering set with T in {2, 4, 8} (T = 1 is COVERING itself)
COVERING_TOKENS = {f"{name}-T{T}": with_tokens(spec, T) for name, spec in COVERING.items() for T in (2, 4, 8)}

#: the specialisations the PTX execution tier runs (tests/test_ptx_*.py, on EXECUTED_ARCH): their
#: compiler facts come from that compile, the others' from a plain compile (no PTX to parse)
EXECUTED_ARCH = "sm_90a"
EXECUTED = frozenset(s.with_default_tiling() for s in (*COVERING.values(), *MULTI_TOKEN.values(), *ROTARY.values(),
                                                       *STOCHASTIC.values(), *EIGHT_BIT.values(), *REPLAY.values(),
                                                       *REPLAY_VERIFY.values(), *REPLAY_VERIFY_MIXED.values(),
                                                       *REPLAY_DST.values(), *MATERIALIZE.values()))


def _full_matrix():
    specs = {}
    for N, D, R, sd, kv in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R, UNSCALED, KV_DTYPES):
        specs[f"N{N}-D{D}-R{R}-{sd}-{kv}-pool-dst-kv"] = StepSpec(
            N, D, R, sd, kv, kv, "bfloat16", pool=True, has_dst=True, update_kv_state=True)
    for dst, kv, z, o in itertools.product((False, True), repeat=4):
        specs[f"flagship-pool-dst{dst:d}-kv{kv:d}-z{z:d}-o{o:d}"] = flagship_spec(
            has_dst=dst, update_kv_state=kv, has_z=z, has_outproj=o)
    for so, kv, z, o in itertools.product((False, True), repeat=4):
        specs[f"flagship-dense-so{so:d}-kv{kv:d}-z{z:d}-o{o:d}"] = flagship_spec(
            pool=False, has_state_out=so, update_kv_state=kv, has_z=z, has_outproj=o)
    for N, D, R in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R):  # rotary, rope fraction 0.5
        specs[f"N{N}-D{D}-R{R}-rotary-pool-dst-kv"] = StepSpec(
            N, D, R, pool=True, has_dst=True, update_kv_state=True, rope_angles=N // 4, has_bc_bias=True,
            shared_bc=True)
    for N, D, R, sd in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R, ("bfloat16", "float16",
                                                                                *SCALED_STATE_DTYPES)):
        specs[f"N{N}-D{D}-R{R}-{sd}-sr-pool-dst-kv"] = StepSpec(
            N, D, R, sd, pool=True, has_dst=True, update_kv_state=True, stochastic_rounding=True)
    for S, pw, bias, shared, dst, T in itertools.product((32, 64), *([(False, True)] * 4), (1, 4)):
        flags = dict(tokens=T, dst_per_token=dst and T > 1, num_accepted=T > 1) if T > 1 else {}
        specs[f"flagship-rotary-S{S}-pw{pw:d}-b{bias:d}-sh{shared:d}-dst{dst:d}-T{T}"] = flagship_spec(
            has_dst=dst or T > 1, rope_angles=S, rotate_pairwise=pw, has_bc_bias=bias, shared_bc=shared, **flags)
    return specs


_CACHE: dict = {}


def facts_for(spec: StepSpec, arch: str):
    """Compiler facts of ``spec`` for ``arch``, from the compile the PTX execution tier keeps (one
    compile per specialisation and process serves both: the cubin is the same as a plain compile's)."""
    key = (spec.with_default_tiling(), arch)
    if key not in _CACHE:
        if arch == EXECUTED_ARCH and key[0] in EXECUTED:
            compiled = ptx_kernel(key[0], arch).compiled
        else:
            compiled = compile_step_kernel(key[0], arch)
        _CACHE[key] = kernel_facts(compiled)
    return _CACHE[key]


def check_compiler_facts(spec: StepSpec, arch: str, stack: int = 0) -> None:
    """``spec``'s compiler facts for ``arch``: ``stack`` bytes of stack (0: and no spill), a launchable
    register count, the state's and the angles' exact load and store counts."""
    spec = spec.with_default_tiling()
    f = facts_for(spec, arch)
    lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo, spec.carried_tokens)
    where = f"{spec.key()} @ {arch}"
    assert f.stack_bytes == stack, f"{where}: {f.stack_bytes} stack bytes"
    assert (f.spill_bytes == 0) == (stack == 0), f"{where}: {f.spill_bytes} spill bytes"
    assert f.threads == lay.num_threads, where
    assert f.registers * f.threads <= 65536 and f.registers <= 255, f"{where}: {f.registers} registers"
    # The state is the only 16-byte global traffic: one LDG.128 per vector a thread owns, and one
    # STG.128 per vector and row written (T rows with a destination per token, else one).
    vectors = lay.rows_per_thread * lay.CPT
    writes = spec.tokens if spec.dst_per_token else 1
    assert f.count("LDG", 128) == vectors, (where, f.sass)
    assert f.count("STG", 128) == vectors * writes, (where, f.sass)
    # the only 8-byte accesses: the rotary angles (int64), one per angle a thread owns, stored like the state,
    # and the seed and offset of stochastic rounding, read once
    angles = -(-spec.rope_angles // lay.num_threads)
    seeds = 2 if spec.stochastic_rounding else 0
    loads, stores = angles, angles * writes
    if spec.replay_ring:  # each unrolled ring entry's stored angle; the current angle from the ring or angle_state
        loads = angles * (spec.ring_entries + 2)
        # one-token: the flush's angle_state or the append's entry; verify: the flush copies the last
        # committed entry's angle to angle_state (one more load), each draft stores its entry's
        stores = angles * (2 if spec.tokens == 1 else 1 + spec.tokens)
        loads += angles * (spec.tokens > 1)
        if spec.stochastic_rounding:  # each unrolled entry's recorded offset; each appended entry's, stored
            seeds += spec.ring_entries
            stores += spec.tokens
    # from the checkpoint, an append reads its current angle (2 loads) and its ring tokens' stored ones
    # (K - 2) besides the flush's; the compiler may share the current angle's loads between the two
    shared = angles * spec.replay_ring if spec.replay_from_checkpoint and spec.rope_angles else 0
    assert loads + seeds <= f.count("LDG", 64) <= loads + seeds + shared and f.count("STG", 64) == stores, where
    if spec.pool:
        # replay: the row's ring length is read before the branch (a count out of range is padding too)
        check_padding_guard(f.sass_text, where, loads=2 + spec.num_accepted + bool(spec.replay_ring))


# One SASS instruction: optional guard predicate, opcode with modifiers, operands.
_INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?P<guard>@!?U?P[0-9T]+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)\s*(?P<args>[^;]*);")
# A conditional branch or exit: a guard prefix (``@P0 BRA``) or a predicate operand (``BRA.U !UP0, target``).
_COND_OPERAND = re.compile(r"^!?U?P\d+\s*,")


def _instructions(sass_text: str) -> list[tuple[int, str, str, str]]:
    """(line number, guard, opcode, operands) of every instruction of a listing."""
    out = []
    for i, line in enumerate(sass_text.splitlines()):
        m = _INSTR.match(line)
        if m:
            out.append((i, (m.group("guard") or "").strip(), m.group("op"), m.group("args").strip()))
    return out


def _is_conditional_exit_or_branch(guard: str, op: str, args: str) -> bool:
    if op.split(".")[0] not in ("BRA", "EXIT"):
        return False
    return (guard not in ("", "@PT", "@UPT")) or bool(_COND_OPERAND.match(args))


def _first_guard(instrs) -> int:
    return next(k for k, (_, g, op, args) in enumerate(instrs) if _is_conditional_exit_or_branch(g, op, args))


def check_padding_guard(sass_text: str, where: str, loads: int = 2) -> None:
    """Pool mode: the first thing the kernel does with global memory is read the index; a
    conditional branch/exit (the padding predicate) comes before any pool load or any store.
    ``loads``: the index loads allowed before it (src and dst, plus the accepted count)."""
    instrs = _instructions(sass_text)
    first = _first_guard(instrs)
    before = [(op, args) for _, _, op, args in instrs[:first]
              if op.split(".")[0] in ("LDG", "STG", "LDGSTS", "ATOMG", "RED")]
    assert before, f"{where}: no index load before the padding branch"
    assert all(op == "LDG.E" for op, _ in before), (
        f"{where}: global accesses other than the 32-bit index loads before the padding branch: {before}")
    assert len(before) <= loads, f"{where}: more than the {loads} index loads before the padding branch"


#: the named sets every run compiles for both architectures, by the prefix of their test ids
COMPILED_SETS = {"covering": COVERING, "multi-token": MULTI_TOKEN, "rotary": ROTARY, "stochastic": STOCHASTIC,
                 "eight-bit": EIGHT_BIT, "replay": REPLAY, "replay-verify": REPLAY_VERIFY,
                 "replay-verify-mixed": REPLAY_VERIFY_MIXED, "replay-dst": REPLAY_DST, "replay-small": REPLAY_SMALL,
                 "materialize": MATERIALIZE}


#: compiled with --full-matrix only, on every target (their executed rounds run with it too) ...
FULL_COMPILES = REPLAY_VERIFY_FULL | MATERIALIZE_FULL | REPLAY_FULL
#: ... or on sm_100a only (on sm_90a it is the compile the PTX tier keeps, which the executions in the same
#: process share): on sm_100a the default run compiles the covering set (every supported value) and the
#: feature sets' flagship default forms below; every other form is arch x feature cross product
SM100_DEFAULT = frozenset({"flagship-T4-spec", "flagship-rotary", "flagship-bf16state-sr", "flagship-int8state",
                           "flagship-fp8state", "flagship-replay-K4", "flagship-rotary-replay-K4",
                           "flagship-int8state-replay-K2", "flagship-replay-K4-verify-T4", "flagship-flush-L3"})


def _full_on_sm100(kind: str, name: str) -> bool:
    """Whether ``name`` of set ``kind`` compiles for sm_100a with --full-matrix only: everything outside
    the covering set and :data:`SM100_DEFAULT` (the feature sets' other forms are there for sm_90a's PTX
    tier, and sm_100a's PTX is sm_90a's: test_ptx_kernel.py)."""
    return kind != "covering" and name not in SM100_DEFAULT


def _compile_params() -> list:
    params = []
    for kind, specs in COMPILED_SETS.items():
        for name, spec in specs.items():
            for arch in ARCHS:
                full = name in FULL_COMPILES or (arch == "sm_100a" and _full_on_sm100(kind, name))
                params.append(pytest.param(spec, arch, id=f"{kind}-{name}-{arch}",
                                           marks=[pytest.mark.full_matrix] if full else []))
    return params


@pytest.mark.parametrize("spec, arch", _compile_params())
def test_compiles_with_clean_compiler_facts(spec, arch):
    check_compiler_facts(spec, arch)


# The default run compiles the covering set's T = 4 forms for sm_90a; T = 2, 8 and sm_100a with
# --full-matrix (the flagship's T in {2, 3, 4, 6, 8} is compiled for sm_90a in every run, T = 4 for sm_100a:
# MULTI_TOKEN).
@pytest.mark.parametrize("arch", [ARCHS[0], pytest.param(ARCHS[1], marks=pytest.mark.full_matrix)])
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n.endswith("-T4") else [pytest.mark.full_matrix])
                                  for n in COVERING_TOKENS])
def test_covering_set_with_tokens_compiles_with_clean_compiler_facts(name, arch):
    check_compiler_facts(COVERING_TOKENS[name], arch)


def test_covering_set_covers_every_supported_value():
    specs = [s.with_default_tiling() for s in COVERING.values()]
    for field, values in [("dstate", SUPPORTED_N), ("headdim", SUPPORTED_D), ("mimo", SUPPORTED_R),
                          ("state_dtype", UNSCALED), ("kv_dtype", KV_DTYPES), ("x_dtype", KV_DTYPES),
                          ("proj_dtype", UNSCALED)]:
        assert {getattr(s, field) for s in specs} >= set(values), field
    assert {s.state_dtype for s in EIGHT_BIT.values()} == set(SCALED_STATE_DTYPES)  # their own set
    for flag in ("pool", "has_dst", "update_kv_state", "has_z", "has_outproj", "has_state_out"):
        assert {getattr(s, flag) for s in specs} == {False, True}, flag
    assert any(s.tile_D < s.headdim for s in specs)


#: the flagship's budgets of warp-instructions per (64 x 128) state slab, per state dtype and arch. fp32
#:: at least 15% fewer than the upstream dense kernel's 7,788 (sm_90a) and 7,268 (sm_100a).
#: A stochastically rounded 16-bit state: measured 7,864 / 7,852 (bf16) and 9,260 / 9,248
#: (fp16) on sm_90a / sm_100a, Philox4x32-10 about 1,290 of them (docs/performance.md, "Stochastic
#: rounding in the kernel")
FLAGSHIP_SLAB_BUDGET = {"float32": {"sm_90a": 6600, "sm_100a": 6200},
                        "bfloat16": {"sm_90a": 8000, "sm_100a": 8000},
                        "float16": {"sm_90a": 9400, "sm_100a": 9400}}


def slab_warp_instructions(f, spec) -> int:
    """Static SASS instructions per thread x warps per (lane, head) slab (the kernel is fully
    unrolled, so a live CTA issues each of them once per warp)."""
    n = sum(v for k, v in f.sass.items() if k not in ("total",) and not k.startswith("NOP"))
    return n * (f.threads // 32) * (spec.headdim // spec.tile_D)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", sorted(FLAGSHIP_SLAB_BUDGET))
def test_flagship_instruction_budget(state_dtype, arch):
    """The flagship (fp32) and the flagship with a stochastically rounded 16-bit state."""
    spec = flagship_spec(state_dtype=state_dtype, stochastic_rounding=state_dtype != "float32")
    issued = slab_warp_instructions(facts_for(spec, arch), spec)
    budget = FLAGSHIP_SLAB_BUDGET[state_dtype][arch]
    assert issued <= budget, f"{state_dtype} {arch}: {issued} warp-instructions per slab (budget {budget})"


@pytest.mark.parametrize("arch", ARCHS)
def test_flagship_keeps_enough_state_in_flight(arch):
    """At least 16 resident warps per SM, or at least 32 KiB of state loads in flight per SM
    (every CTA issues its whole slab's loads before the first use when ``preload``)."""
    spec = flagship_spec()
    f = facts_for(spec, arch)
    lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo)
    occ = f.occupancy(arch)
    groups_in_flight = lay.row_groups if lay.preload else 1
    per_cta = lay.num_threads * lay.state_words_per_thread * 4 * groups_in_flight // lay.row_groups
    assert occ["warps_per_sm"] >= 16 or occ["ctas_per_sm"] * per_cta >= 32 * 1024, (occ, per_cta)


def padding_path(sass_text: str) -> list[str]:
    """The instructions of the padding lanes' path: from the target of the padding guard (the
    first conditional branch) to the next unconditional EXIT."""
    instrs = _instructions(sass_text)
    _, _, op, args = instrs[_first_guard(instrs)]
    assert op.startswith("BRA"), f"the padding guard is a {op}, not a branch"
    target = re.search(r"\((\.L_x_\d+)\)", args).group(1)
    lines = sass_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == f"{target}:")
    path = []
    for _, guard, op, args in (x for x in instrs if x[0] > start):
        path.append(f"{guard} {op} {args}".strip())
        if op == "EXIT" and not guard:
            break
    return path


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", [flagship_spec(), flagship_spec(has_dst=True, has_outproj=False),
                                  COVERING["N256-D32-R8-bf16state-pool-dst-kv"]],
                         ids=["flagship", "dst-no-outproj", "N256-D32-bf16"])
def test_padding_path_issues_no_pool_traffic(spec, arch):
    """Padding lanes branch to a path that only stores zeros to out: no loads, no 16-byte
    (state) stores, nothing but 16-bit out stores of the zero register."""
    f = facts_for(spec, arch)
    path = padding_path(f.sass_text)
    assert path, "no padding path found"
    memory = [ins for ins in path if re.search(r"\b(LDG|STG|LDGSTS|ATOMG|RED|LDS|STS)\b", ins)]
    assert memory, "the padding path writes out"
    for ins in memory:
        assert re.search(r"^STG\.E\.U16\b.*RZ$", ins), f"unexpected memory access on the padding path: {ins}"


#: pool + update_kv_state *without* a destination row (the state written back in place) at the
#: default tiling: these use stack (8-40 bytes) on that architecture (found 2026-11-25, not fixed; the
#: same shapes with a destination row compile clean, the full matrix above). ptxas settles at 128 or
#: 168 registers and spills for them: R = 8 at 1-8 warps, or 16 warps (128 registers a thread). With
#: packed state rows (docs/design/kernel.md; all 288 run) five of the six on sm_90a and six of the
#: seven on sm_100a compile clean, and N=32 D=128 R=8 bf16 uses 8 bytes on sm_100a
IN_PLACE_SPILLS = {
    "sm_90a": {(32, 128, 2, "float16")},
    "sm_100a": {(32, 128, 8, "bfloat16"), (32, 128, 2, "float16")},
}


def _in_place_params() -> list:
    known = pytest.mark.xfail(strict=True, reason="uses stack at its default tiling (IN_PLACE_SPILLS, not fixed)")
    return [pytest.param(StepSpec(N, D, R, sd, pool=True, update_kv_state=True), arch,
                         id=f"N{N}-D{D}-R{R}-{sd}-pool-kv-{arch}",
                         marks=[known] if (N, D, R, sd) in IN_PLACE_SPILLS[arch] else [])
            for arch in ARCHS for N, D, R, sd in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R, UNSCALED)]


@pytest.mark.full_matrix
@pytest.mark.parametrize("spec,arch", _in_place_params())
def test_in_place_matrix_compiles_with_clean_compiler_facts(spec, arch):
    check_compiler_facts(spec, arch)


#: replay specialisations (K = 4, every N, D, R x fp32/bf16/fp16, outputs replayed or from the
#: checkpoint) that use stack (8-496 bytes) at their default tiling, per architecture: (N, D, R,
#: state dtype, from_checkpoint). Found 2026-11-25 (576 compiles, 32 of them), not fixed: from the
#: checkpoint with R = 8 at N, D >= (128, 128) or N = 256, 16-bit N=256 D=128 (8 warps at 255
#: registers: the append path's tables and partials beside a flush's whole slab), and N=64 D=32
#: R=2 fp32 on sm_90a (8 bytes); replayed outputs only at 16-bit N=256 D=128 R = 4, 8 (in place,
#: in IN_PLACE_SPILLS too at R = 4). fp32 N=256 D=128 has no tiling that keeps a whole head's
#: slab in registers across tokens: refused (test_replay_matrix_refusals). With packed state rows
#: (2026-11-27, all 560 run) four of sm_90a's and one of sm_100a's compile clean; N=64 D=32 R=4 fp32
#: replayed (1 warp) used 16 bytes on sm_90a, N=32 D=32 R=1 bf16 and N=256 D=32 R=8 fp16 from the
#: checkpoint 8 bytes each on sm_100a. Since replayed steps take two warps where the one-token default
#: gave one (tiling.REPLAY_MIN_WARPS; the 108 such shapes of plain, destination and verify steps
#: recompiled on both targets), N=64 D=32 R=4 fp32 is clean, and N=32 D=32 R=4 fp32 replayed uses 8
#: bytes on sm_100a (80 registers at 2 warps; clean at 1 and 4), the one shape the rule made worse: it
#: takes 4 since 2026-11-28 (tiling.REPLAY_WARPS).
#: Outputs from the checkpoint take the replayed tiling up to R = 4 since 2026-11-27
#: (tiling.CHECKPOINT_REPLAY_MAX_MIMO; all 280 from-checkpoint compiles rerun): the list is unchanged.
REPLAY_SPILLS = {
    "sm_90a": {(256, 128, 4, "float16", False), *((256, 128, 8, sd, False) for sd in ("bfloat16", "float16")),
               *((128, 128, 8, sd, True) for sd in UNSCALED), *((256, 64, 8, sd, True) for sd in ("bfloat16", "float16")),
               (256, 128, 2, "float16", True), *((256, 128, R, sd, True) for R in (4, 8) for sd in ("bfloat16", "float16"))},
    "sm_100a": {(256, 128, 4, "float16", False), *((256, 128, 8, sd, False) for sd in ("bfloat16", "float16")),
                (32, 32, 1, "bfloat16", True), (256, 32, 8, "float16", True),
                *((128, 128, 8, sd, True) for sd in UNSCALED),
                *((256, 64, 8, sd, True) for sd in ("bfloat16", "float16")),
                *((256, 128, R, sd, True) for R in (2, 4, 8) for sd in ("bfloat16", "float16"))},
}
#: replay specialisations refused for want of a tiling (fp32 N=256 D=128: the slab does not fit)
REPLAY_REFUSED = {(256, 128, R, "float32") for R in SUPPORTED_R}


def _replay_params() -> list:
    known = pytest.mark.xfail(strict=True, reason="uses stack at its default tiling (REPLAY_SPILLS, not fixed)")
    return [pytest.param(StepSpec(N, D, R, sd, pool=True, update_kv_state=True, replay_ring=4,
                                  replay_from_checkpoint=fc), arch,
                         id=f"N{N}-D{D}-R{R}-{sd}-replay-K4{'-cp' if fc else ''}-{arch}",
                         marks=[known] if (N, D, R, sd, fc) in REPLAY_SPILLS[arch] else [])
            for arch in ARCHS for N, D, R, sd, fc in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R,
                                                                       UNSCALED, (False, True))
            if (N, D, R, sd) not in REPLAY_REFUSED]


@pytest.mark.full_matrix
@pytest.mark.parametrize("spec,arch", _replay_params())
def test_replay_matrix_compiles_with_clean_compiler_facts(spec, arch):
    check_compiler_facts(spec, arch)


#: replay verify specialisations (K = 4, T = 4, accepted) that use stack at their default tiling, per
#: arch: (N, D, R, state dtype). All 280 run 2026-11-27 at the one-token replay default: 25 of 140 a
#: target, 8-544 bytes, at R >= 4 with 1 or 2 warps (N = 32, 64) and at N = 256 D = 128 with 16-bit
#: states. Since replayed steps take at least two warps (tiling.REPLAY_MIN_WARPS) and verify steps the
#: warps of tiling.VERIFY_WARPS (each shape that still spilled, compiled at 2, 4 and 8 warps on both
#: targets: the fewest with no stack), only N = 256 D = 128 with a 16-bit state is left (24-344 bytes
#: at 8 warps; 16 warps would halve the register cap): a verify tiling rule for it is open work.
_VERIFY_SPILLS_BOTH = {(256, 128, 4, "bfloat16"), *((256, 128, 8, sd) for sd in ("bfloat16", "float16"))}
REPLAY_VERIFY_SPILLS = {"sm_90a": _VERIFY_SPILLS_BOTH,
                        "sm_100a": _VERIFY_SPILLS_BOTH | {(256, 128, 2, "float16")}}


def _verify_matrix_params(spills: dict, spills_name: str, from_checkpoint: bool = False) -> list:
    """Every shape's K = 4, T = 4 verify step (the drafts stepped, or ``from_checkpoint``) on each target,
    the pairs in ``spills`` (named ``spills_name``) strict xfails."""
    known = pytest.mark.xfail(strict=True, reason=f"uses stack at its default tiling ({spills_name}, not fixed)")
    suffix = "-fc" if from_checkpoint else ""
    return [pytest.param(StepSpec(N, D, R, sd, pool=True, update_kv_state=True, replay_ring=4, tokens=4,
                                  num_accepted=True, replay_from_checkpoint=from_checkpoint), arch,
                         id=f"N{N}-D{D}-R{R}-{sd}-replay-K4-verify-T4{suffix}-{arch}",
                         marks=[known] if (N, D, R, sd) in spills[arch] else [])
            for arch in ARCHS for N, D, R, sd in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R, UNSCALED)
            if (N, D, R, sd) not in REPLAY_REFUSED]


@pytest.mark.full_matrix
@pytest.mark.parametrize("spec,arch", _verify_matrix_params(REPLAY_VERIFY_SPILLS, "REPLAY_VERIFY_SPILLS"))
def test_replay_verify_matrix_compiles_with_clean_compiler_facts(spec, arch):
    check_compiler_facts(spec, arch)


#: verify steps with the drafts' outputs from the checkpoint (K = 4, T = 4) that use stack at their default
#: tiling, per arch: (N, D, R, state dtype). All 280 run 2026-11-28: 11 used stack; the shapes that a warp
#: count made clean take it (tiling.CHECKPOINT_VERIFY_WARPS); these have none: N = 256 D = 128 R = 8 with a
#: 16-bit state (as replayed) and N = 256 D = 64 R = 1 fp32 on sm_90a (8 bytes at 8 warps, the only count
#: with a layout). Not fixed.
_CHECKPOINT_VERIFY_BOTH = {(256, 128, 8, sd) for sd in ("bfloat16", "float16")}
CHECKPOINT_VERIFY_SPILLS = {"sm_90a": _CHECKPOINT_VERIFY_BOTH | {(256, 64, 1, "float32")},
                            "sm_100a": _CHECKPOINT_VERIFY_BOTH}


@pytest.mark.full_matrix
@pytest.mark.parametrize("spec,arch", _verify_matrix_params(CHECKPOINT_VERIFY_SPILLS, "CHECKPOINT_VERIFY_SPILLS",
                                                            from_checkpoint=True))
def test_checkpoint_verify_matrix_compiles_with_clean_compiler_facts(spec, arch):
    check_compiler_facts(spec, arch)


def test_verify_steps_from_the_checkpoint_take_the_warps_of_their_table():
    """CHECKPOINT_VERIFY_WARPS's shapes: a verify step with the drafts from the checkpoint gets the listed
    warps, the replayed verify step of the shape its own; the flagship's keeps its four."""
    for (N, D, R, sd), warps in CHECKPOINT_VERIFY_WARPS.items():
        spec = StepSpec(N, D, R, sd, pool=True, update_kv_state=True, replay_ring=4, tokens=4, num_accepted=True,
                        stochastic_rounding=sd == "int8")
        assert spec.replace(replay_from_checkpoint=True).with_default_tiling().num_warps == warps, (N, D, R, sd)
        assert spec.with_default_tiling().num_warps != warps, (N, D, R, sd)
    assert flagship_spec(replay_ring=4, tokens=4, num_accepted=True, replay_from_checkpoint=True).num_warps == 4


#: replay with the other states at their default tiling, every N, D, R (one-token steps, outputs replayed,
#: and "-fc" from the checkpoint): the rotary angle (fp32 state, S = N/4, biases) at K = 4, a bf16 state
#: with stochastic rounding at K = 4, an int8 state at K = 2 (the forms docs/performance.md 3d prices)
REPLAY_STATES = {
    "rotary-K4": lambda N, D, R: StepSpec(N, D, R, "float32", pool=True, update_kv_state=True, replay_ring=4,
                                          rope_angles=N // 4, has_bc_bias=True),
    "bf16-sr-K4": lambda N, D, R: StepSpec(N, D, R, "bfloat16", pool=True, update_kv_state=True, replay_ring=4,
                                           stochastic_rounding=True),
    "int8-K2": lambda N, D, R: StepSpec(N, D, R, "int8", pool=True, update_kv_state=True, replay_ring=2,
                                        stochastic_rounding=True),
    "bf16-sr-K4-fc": lambda N, D, R: StepSpec(N, D, R, "bfloat16", pool=True, update_kv_state=True, replay_ring=4,
                                              stochastic_rounding=True, replay_from_checkpoint=True),
    "int8-K2-fc": lambda N, D, R: StepSpec(N, D, R, "int8", pool=True, update_kv_state=True, replay_ring=2,
                                           stochastic_rounding=True, replay_from_checkpoint=True),
    "rotary-K4-fc": lambda N, D, R: StepSpec(N, D, R, "float32", pool=True, update_kv_state=True, replay_ring=4,
                                             rope_angles=N // 4, has_bc_bias=True, replay_from_checkpoint=True),
}
#: (form, N, D, R) of REPLAY_STATES that use stack at their default tiling, per arch (all 280 compiles run
#: 2026-11-27; fp32 N = 256, D = 128 has no replay tiling, REPLAY_REFUSED): the 16-bit N = 256 D = 128 slab,
#: as without rounding (REPLAY_SPILLS); N = 32 D = 32 R = 4 rotary on sm_100a at its two warps, as without
#: rotary (4 warps since 2026-11-28, tiling.REPLAY_WARPS: clean); int8 at R = 8 with N = 32 D = 64 (4 warps, 72 registers: 8 bytes) and on sm_90a N = 256 D = 64.
#: From the checkpoint (the "-fc" forms, 2026-11-28): 28 shape/target pairs used stack at the first
#: default, 22 besides the 16-bit N = 256 D = 128 slab; tiling.CHECKPOINT_STATES_WARPS gives 10 shapes the
#: warps at which both targets are clean (14 pairs), and these remain, no warp count clean (8-88 bytes at 8 warps, no layout at 16): bf16 at N = 256 D = 128 as
#: replayed and on sm_90a N = 128 D = 128 R = 8; int8 N = 256 D = 128 R = 2; rotary N = 128 D = 128 R = 8,
#: N = 256 D = 64 R = 8 and on sm_90a N = 128 D = 128 R = 4. Not fixed.
_STATES_SPILLS_BOTH = ({(form, 256, 128, R) for form in ("bf16-sr-K4", "bf16-sr-K4-fc") for R in (2, 4, 8)}
                       | {("int8-K2", 32, 64, 8), ("int8-K2-fc", 256, 128, 2)}
                       | {("rotary-K4-fc", *shape) for shape in ((128, 128, 8), (256, 64, 8))})
REPLAY_STATES_SPILLS = {"sm_90a": _STATES_SPILLS_BOTH | {("int8-K2", 256, 64, 8), ("bf16-sr-K4-fc", 128, 128, 8),
                                                         ("rotary-K4-fc", 128, 128, 4)},
                        "sm_100a": _STATES_SPILLS_BOTH}


def _replay_states_params() -> list:
    known = pytest.mark.xfail(strict=True, reason="uses stack at its default tiling (REPLAY_STATES_SPILLS, not fixed)")
    return [pytest.param(make(N, D, R), arch, id=f"{form}-N{N}-D{D}-R{R}-{arch}",
                         marks=[known] if (form, N, D, R) in REPLAY_STATES_SPILLS[arch] else [])
            for arch in ARCHS for form, make in REPLAY_STATES.items()
            for N, D, R in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R)
            if not (form.startswith("rotary-K4") and (N, D, R, "float32") in REPLAY_REFUSED)]


@pytest.mark.full_matrix
@pytest.mark.parametrize("spec,arch", _replay_states_params())
def test_replay_states_matrix_compiles_with_clean_compiler_facts(spec, arch):
    check_compiler_facts(spec, arch)


def test_verify_steps_take_the_warps_of_their_table():
    """VERIFY_WARPS's shapes: a replayed verify step gets the listed warps, a one-token replay step
    of the same shape its own default, and the flagship's verify step keeps its four."""
    for (N, D, R, sd), warps in VERIFY_WARPS.items():
        spec = StepSpec(N, D, R, sd, pool=True, update_kv_state=True, replay_ring=4, tokens=4, num_accepted=True)
        assert spec.with_default_tiling().num_warps == warps, (N, D, R, sd)
        assert spec.replace(tokens=1, num_accepted=False).with_default_tiling().num_warps < warps, (N, D, R, sd)
    assert flagship_spec(replay_ring=4, tokens=4, num_accepted=True).num_warps == 4


def test_checkpoint_steps_with_other_states_take_the_warps_of_their_table():
    """CHECKPOINT_STATES_WARPS's shapes: the form with outputs from the checkpoint gets the listed warps,
    and the flagship's rotary layer (B/C shared by the heads) keeps its four."""
    forms = {"rotary": "rotary-K4", ("sr", "int8"): "int8-K2", ("sr", "bfloat16"): "bf16-sr-K4"}
    for (N, D, R, sd, states), warps in CHECKPOINT_STATES_WARPS.items():
        form = forms["rotary"] if states == "rotary" else forms[(states, sd)]
        assert REPLAY_STATES[form + "-fc"](N, D, R).with_default_tiling().num_warps == warps, (N, D, R, sd, states)
        assert REPLAY_STATES[form](N, D, R).state_dtype == sd
    assert flagship_rotary_spec(replay_ring=4, replay_from_checkpoint=True).with_default_tiling().num_warps == 4


def test_replayed_steps_take_two_warps_where_the_one_token_default_is_one():
    """REPLAY_SMALL's shapes: one warp stepwise, two replayed (plain, destinations, verify); the
    flagship keeps its four."""
    for name, spec in REPLAY_SMALL.items():
        stepwise = spec.replace(replay_ring=0, tokens=1, num_accepted=False).with_default_tiling()
        assert stepwise.num_warps == 1, name
        assert spec.with_default_tiling().num_warps == 2, name
    assert flagship_spec(replay_ring=4).num_warps == flagship_spec().num_warps == 4  # the flagship is unchanged


#: replay with a launch bound of 3 CTAs per SM (StepSpec.min_ctas_per_sm, an experiment's knob: the
#: stepwise step's residency, which replay needed to pay on the H200; docs/performance.md 3d): the rotary
#: layer at K = 2 and fp32 at K = 4, 194 registers (2 CTAs) without it. The PTX tier executes them
#: (tests/ptx/test_ptx_replay.py); the stack each uses under the bound, by arch (2026-11-28), is asserted exactly.
LAUNCH_BOUND = {
    "flagship-rotary-replay-K2-3ctas": flagship_rotary_spec(replay_ring=2, min_ctas_per_sm=3),
    "flagship-replay-K4-3ctas": flagship_spec(replay_ring=4, min_ctas_per_sm=3),
}
LAUNCH_BOUND_STACK = {"flagship-rotary-replay-K2-3ctas": {"sm_90a": 48, "sm_100a": 40},
                      "flagship-replay-K4-3ctas": {"sm_90a": 56, "sm_100a": 48}}
#: the launch-bound forms compiled and executed with --full-matrix only (the default run: the rotary one on sm_90a)
LAUNCH_BOUND_FULL = frozenset({"flagship-replay-K4-3ctas"})


@pytest.mark.parametrize("arch", [ARCHS[0], pytest.param(ARCHS[1], marks=pytest.mark.full_matrix)])
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.full_matrix] if n in LAUNCH_BOUND_FULL else [])
                                  for n in LAUNCH_BOUND])
def test_a_launch_bound_gives_three_ctas_at_its_recorded_stack(name, arch):
    spec = LAUNCH_BOUND[name].with_default_tiling()
    check_compiler_facts(spec, arch, stack=LAUNCH_BOUND_STACK[name][arch])
    assert facts_for(spec, arch).occupancy(arch)["ctas_per_sm"] == 3
    assert facts_for(spec.replace(min_ctas_per_sm=0), arch).occupancy(arch)["ctas_per_sm"] == 2  # without it


def test_a_launch_bound_is_refused_out_of_range_and_named_in_the_key():
    spec = flagship_spec(replay_ring=4).with_default_tiling()
    assert "min_ctas_per_sm" not in spec.key() and "min_ctas_per_sm=3" in spec.replace(min_ctas_per_sm=3).key()
    assert "min_ctas_per_sm must be in [0, 8]" in tiling_problem(spec.replace(min_ctas_per_sm=9))
    assert tiling_problem(spec.replace(min_ctas_per_sm=3)) is None


def test_replay_k2_flagship_keeps_the_stepwise_residency():
    """On sm_90a, replay at K = 2 (outputs replayed) fits the stepwise flagship's CTAs per SM with no
    spill: the residency the H200 measurement asked of replay (docs/performance.md, 3d). Packed state
    rows (a static D stride) are what brings it there; the stepwise step gains registers from them too."""
    arch = "sm_90a"
    step = facts_for(flagship_spec(), arch)
    replay = facts_for(flagship_spec(replay_ring=2), arch)
    assert replay.spill_bytes == 0 and replay.registers <= 168, replay.registers
    assert replay.occupancy(arch)["ctas_per_sm"] == step.occupancy(arch)["ctas_per_sm"] == 3
    assert step.registers < facts_for(flagship_spec(padded_state_rows=True), arch).registers


def test_replay_matrix_refusals():
    """The replay shapes without a tiling are refused by name, not compiled into spills."""
    for N, D, R, sd in sorted(REPLAY_REFUSED):
        spec = StepSpec(N, D, R, sd, pool=True, update_kv_state=True, replay_ring=4).with_default_tiling()
        assert "replay_ring=4 keeps each thread's whole share" in (tiling_problem(spec) or "") or \
            "state registers per thread" in (tiling_problem(spec) or ""), (N, D, R, sd)


#: full-matrix specialisations (by name) that use stack at their default tiling, per arch. All 1,536 run
#: 2026-11-27 with packed state rows (the static D stride of StepSpec.padded_state_rows): 8 bytes each
FULL_MATRIX_SPILLS = {"sm_90a": {"N64-D64-R8-rotary-pool-dst-kv", "N128-D128-R1-float8_e4m3fn-sr-pool-dst-kv"},
                      "sm_100a": {"N128-D128-R1-float8_e4m3fn-sr-pool-dst-kv", "N256-D32-R2-float8_e4m3fn-sr-pool-dst-kv"}}


def _full_matrix_params() -> list:
    known = pytest.mark.xfail(strict=True, reason="uses stack at its default tiling (FULL_MATRIX_SPILLS, not fixed)")
    return [pytest.param(spec, arch, id=f"{name}-{arch}", marks=[known] if name in FULL_MATRIX_SPILLS[arch] else [])
            for name, spec in _full_matrix().items() for arch in ARCHS]


@pytest.mark.full_matrix
@pytest.mark.parametrize("spec,arch", _full_matrix_params())
def test_full_matrix_compiles_with_clean_compiler_facts(spec, arch):
    check_compiler_facts(spec, arch)


def test_unsupported_tiling_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="tile_D"):
        compile_step_kernel(flagship_spec(tile_D=4), "sm_90a")  # update_kv_state: 16 D-tiles, more than a cluster
    with pytest.raises(ValueError, match="tile_D.*sm_90"):
        compile_step_kernel(flagship_spec(tile_D=32), "sm_80")  # a cluster launch needs sm_90
    with pytest.raises(ValueError, match="num_warps"):
        compile_step_kernel(flagship_spec(num_warps=3), "sm_90a")


def test_the_one_token_default_holds_at_most_64_state_values_per_thread():
    """Counted in values, not words: at 64 words of a 16-bit state (128 values unpacked to fp32)
    seven configurations of the full matrix used 16-40 bytes of stack on sm_90a (N=64 D=64 R=1
    and R=8, N=32 D=128 R=8). No compile: the tiling rule itself, for every supported shape."""
    held = {}
    for N, D, R, dtype in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R, STATE_DTYPES):
        tile_D, num_warps = default_tiling(N, D, R, dtype)
        words = thread_layout(N, tile_D, num_warps, dtype, R).state_words_per_thread
        held[(N, D, R, dtype)] = words * 4 // DTYPE_BYTES[dtype]
    assert max(held.values()) == 64, sorted(held.items(), key=lambda kv: -kv[1])[:5]
    assert held[(64, 64, 1, "bfloat16")] == held[(64, 64, 1, "float32")] == 64


def test_flagship_issue_model_leaves_hbm_the_bottleneck_on_h100():
    """Issue time per slab <= 0.35 x memory time per slab on an H100 SM ."""
    spec = flagship_spec()
    model = issue_model(slab_warp_instructions(facts_for(spec, "sm_90a"), spec), slab_bytes(spec), GPUS["H100"])
    assert model["ratio"] <= 0.35, model


@pytest.mark.parametrize("arch", [ARCHS[0], pytest.param(ARCHS[1], marks=pytest.mark.full_matrix)])
@pytest.mark.parametrize("state_dtype, rounding", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_the_kv_cluster_arrives_and_waits_once_before_the_stores(state_dtype, rounding, arch):
    """update_kv_state with the flagship's 4 D-tiles of 16 rows (a cluster), each state form: clean compiler
    facts (no spill), one arrival at the cluster barrier once the staging read the old Bstate row (a
    release: its memory barrier, then the arrive) and one wait, before the CTA's first store (Bstate's
    and the state's)."""
    spec = flagship_spec(tile_D=16, state_dtype=state_dtype, stochastic_rounding=rounding)
    check_compiler_facts(spec, arch)
    ops = facts_for(spec, arch).sass_text.splitlines()
    arrive = [i for i, line in enumerate(ops) if "UCGABAR_ARV" in line]
    wait = [i for i, line in enumerate(ops) if "UCGABAR_WAIT" in line]
    stores = [i for i, line in enumerate(ops) if "STG." in line]
    assert len(arrive) == 1 and len(wait) == 1, (arrive, wait)
    assert any("MEMBAR" in ops[i] for i in range(arrive[0] - 4, arrive[0])), "the arrival is a release"
    assert arrive[0] < wait[0] < stores[0], (arrive, wait, stores[:3])


_FORM_CHANGES = {"fp32": {}, "bf16, round to nearest": dict(state_dtype="bfloat16"),
                 "bf16, stochastic rounding": dict(state_dtype="bfloat16", stochastic_rounding=True)}


@pytest.mark.parametrize("arch, form, split", [
    pytest.param(arch, form, split, marks=[] if arch == ARCHS[0] else [pytest.mark.full_matrix])
    for arch in ARCHS for form in _FORM_CHANGES for split in (2, 4)])
def test_the_d_split_latency_facts_are_the_sass(arch, form, split):
    """SPLIT_LATENCY_FACTS, the latency model's input for the D split over a cluster: the round trips and CTAs
    per SM of the flagship with update_kv_state at tile_D = 64 / split, read from the SASS; no spill."""
    spec = flagship_spec(tile_D=64 // split, **_FORM_CHANGES[form])
    check_compiler_facts(spec, arch)
    f = facts_for(spec, arch)
    trips = global_round_trips(f.sass_text).round_trips
    assert (trips, f.occupancy(arch)["ctas_per_sm"]) == SPLIT_LATENCY_FACTS[arch][form][split]


#: the verify forms the latency model tabulates -> their specialisation (the replay verify kernel at F = 4 is the
#: one REPLAY_VERIFY compiles by default; F = 2 compiles with --full-matrix)
VERIFY_FORMS = {"fp32 verify T = 4": verify_spec(),
                "fp32 replay verify F = 2, T = 4": flagship_spec(replay_ring=2, tokens=4, num_accepted=True),
                "fp32 replay verify F = 4, T = 4": flagship_spec(replay_ring=4, tokens=4, num_accepted=True)}


@pytest.mark.parametrize("spec, form", [
    pytest.param(spec, form, id=form, marks=[pytest.mark.full_matrix] if "F = 2" in form else [])
    for form, spec in VERIFY_FORMS.items()])
def test_the_verify_forms_latency_facts_are_the_sass(spec, form):
    """KERNEL_LATENCY_FACTS of the verify forms, the latency model's inputs: the round trips of the live path
    (for replay an upper bound: it falls through every ring position's branches) and the CTAs per SM, sm_90a."""
    check_compiler_facts(spec, "sm_90a")
    f = facts_for(spec, "sm_90a")
    assert (global_round_trips(f.sass_text).round_trips, f.occupancy()["ctas_per_sm"]) == KERNEL_LATENCY_FACTS[form]


@pytest.mark.parametrize("arch", [ARCHS[0], pytest.param(ARCHS[1], marks=pytest.mark.full_matrix)])
@pytest.mark.parametrize("changes", [{}, dict(state_dtype="bfloat16", stochastic_rounding=True), dict(tile_D=16)],
                         ids=["flagship", "bf16-sr", "tileD16-cluster"])
def test_programmatic_launch_issues_every_state_load_before_its_wait(changes, arch):
    """StepSpec.programmatic_launch: clean compiler facts and the default kernel's round trips and CTAs per SM;
    in the SASS every 16-byte state load precedes the wait (ACQBULK, griddepcontrol.wait) of the live path,
    launch_dependents (PREEXIT) and every store follow it."""
    spec = flagship_spec(programmatic_launch=True, **changes)
    check_compiler_facts(spec, arch)
    f, plain = facts_for(spec, arch), facts_for(spec.replace(programmatic_launch=False), arch)
    assert f.occupancy(arch)["ctas_per_sm"] == plain.occupancy(arch)["ctas_per_sm"]
    assert global_round_trips(f.sass_text).round_trips == global_round_trips(plain.sass_text).round_trips
    ops = f.sass_text.splitlines()
    wait = next(i for i, line in enumerate(ops) if "ACQBULK" in line)
    loads = [i for i, line in enumerate(ops) if "LDG.E.128" in line]
    stores = [i for i, line in enumerate(ops) if "STG." in line]
    assert not any("PREEXIT" in line for line in ops[:wait]), "launch_dependents after the wait"
    assert loads and max(loads) < wait < min(stores), (loads, wait, stores[:2])
