"""The slab pipeline (``StepSpec.pipeline_ctas``), executed: its PTX run on the CPU beside the register kernel
users get by default.

How the slab reaches the update changes when bytes arrive, not what is computed, so for each specialisation
both kernels run on the same fresh random inputs (poisoned ``out``, every padding kind in the batch) and
everything they write must be the same bits: ``out``, the state pool (or ``state_out``), Bstate/Xstate, the
rotary angles and an 8-bit state's scales. The pipeline runs with fewer CTAs than slabs, so each CTA walks
several and its stages turn over, their mbarriers' phases flipping; and with more CTAs than slabs. The
executor models the bulk copies' asynchrony (docs/ptx-tier.md, "Mbarriers and bulk copies"): a copy's bytes
land in shared memory when a thread's wait on its mbarrier's phase completes it, and a read of them before is
an error, so these runs also show that the kernel waits where it must and refills a stage only once every
reader is done with it.

Padding lanes: not one byte of any pool row read (no copy issued) or written; live lanes' slabs read exactly
their source rows, each state byte once.

The covering set, one multi-token, one rotary, one stochastic-rounding and one 8-bit specialisation run by
default; every multi-token, rotary, stochastic and 8-bit one with ``--full-matrix``.
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest
from async_state_cases import (assert_same_writes, case_params, case_spec, pipeline_spec, prepared_call, prepared_heads,
                               run_each)
from test_kernel_compile import COVERING

from mamba3_step.spec import flagship_spec
from mamba3_step.testing import bits_equal
from mamba3_step.slab_pipeline import pipeline_problem, pipeline_stages
from mamba3_step.tools.ptx_tier import run_step_ptx
from ptx_executor import analysis

#: persistent CTAs of the race and padding runs: fewer than the slabs of B = 6 or 8 lanes, so each CTA walks several
CTAS = 4


def walking_ctas(spec, batch: int) -> int:
    """CTAs for ``batch`` lanes of ``spec`` that walk at least ``2 S + 1`` slabs each where the slabs allow (``S``
    its stages: every stage refilled and its mbarrier's phase flipped), and at least 1."""
    slabs = batch * prepared_heads(spec) * (spec.headdim // spec.tile_D)
    return max(1, slabs // (2 * pipeline_stages(spec.replace(pipeline_ctas=1)) + 1))
#: the lane kinds of mamba3_step.testing.step_indices that read a row; every other kind is padding
LIVE_KINDS = ("live", "live_nodst", "live_gaps")


@pytest.mark.parametrize("name", case_params())
def test_the_pipeline_writes_the_register_kernels_bits(name):
    spec = case_spec(name)
    tensors, _ = prepared_call(spec, B=6, seed=29)
    piped = pipeline_spec(spec, 1)
    registers, piped = run_each(tensors, spec, piped.replace(pipeline_ctas=walking_ctas(piped, 6)))
    assert assert_same_writes(registers, piped, f"{name}, the register kernel and the slab pipeline") >= 2
    assert not bits_equal(registers.out, tensors.out), f"{name}: the step wrote nothing to out"


def test_a_pipeline_with_more_ctas_than_slabs_writes_the_same_bits():
    spec = flagship_spec()
    tensors, _ = prepared_call(spec, B=3, seed=31)
    registers, piped = run_each(tensors, spec, spec.replace(pipeline_ctas=64))
    assert assert_same_writes(registers, piped, "flagship, 64 CTAs for 6 slabs") >= 4


@pytest.mark.parametrize("name", [n for n, s in COVERING.items() if s.pool] + ["flagship-T4-spec"])
def test_padding_lanes_copy_no_pool_byte_and_live_slabs_their_rows_once(name):
    spec = pipeline_spec(case_spec(name), CTAS)
    tensors, kinds = prepared_call(case_spec(name), B=8, seed=5)
    res = run_step_ptx(spec, tensors)
    log = res.log.arrays()
    pool = tensors.state
    start, end = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
    reads = Counter()
    for a, w, write in zip(log["addr"].astype(np.int64).tolist(), log["width"].tolist(), log["write"].tolist()):
        if not write and start <= a < end:
            reads.update(range(a, a + w))
    src = tensors.state_batch_indices
    if src.dim() == 2:  # (B, K): the accepted entry
        nat = tensors.num_accepted_tokens
        src = [int(src[b, int(nat[b]) - 1]) if 1 <= int(nat[b]) <= src.shape[1] else -1 for b in range(len(kinds))]
    else:
        src = src.tolist()
    want = Counter()
    for b, kind in enumerate(kinds):
        if kind in LIVE_KINDS:
            row = pool[int(src[b])]
            want.update(range(row.data_ptr(), row.data_ptr() + row.numel() * row.element_size()))
    assert want, f"{name}: no live lane"
    assert reads == want, (f"{name}: the state bytes read are not exactly the live lanes' source rows, once each "
                           f"({len(set(reads) - set(want))} bytes outside them, "
                           f"{sum((reads - want).values())} read too often, {sum((want - reads).values())} missing)")


@pytest.mark.parametrize("name, ctas", [("flagship-pool-kv", CTAS), ("flagship-T4-spec", CTAS),
                                        ("flagship-bf16state-sr", 2)])
def test_no_race_between_ctas_or_inside_one(name, ctas):
    """No global byte is shared by two CTAs with a write, and no two threads of a CTA touch a shared or global byte
    between the same two barriers with one writing (the stage's bulk copy counted in the epoch it was issued: its
    readers wait on the mbarrier phase it completes). Without the barrier that ends a slab, the next slab's header
    and staging writes race with this slab's reads: this test fails on that kernel. The 4-stage form runs on 2 CTAs of
    6 slabs each, so two of its stages are refilled."""
    spec = case_spec(name)
    tensors, _ = prepared_call(spec, B=6, seed=3)
    res = run_step_ptx(pipeline_spec(spec, ctas), tensors, record_shared=True)
    assert analysis.cta_races(res) == []
    assert analysis.intra_cta_races(res) == []
    assert analysis.intra_cta_races(res, shared=True) == []
    with warnings.catch_warnings():  # the bank model counts warps' requests: a bulk copy's write is none of them
        warnings.simplefilter("error")
        conflicts = analysis.bank_conflicts(res)
    bulk = {ln for ln, w in zip(res.shared_log.arrays()["instr"].tolist(), res.shared_log.arrays()["width"].tolist())
            if w > 16}
    assert bulk and conflicts and not bulk & set(conflicts)


@pytest.mark.parametrize("form", [{}, dict(state_dtype="bfloat16")], ids=["fp32", "bf16"])
def test_every_vector_load_from_shared_memory_is_free_of_bank_conflicts(form):
    """Every 16-byte shared load of the flagship's pipeline (the staged tile, the operand rows ``sBB``/``sC``, the
    coefficient rows ``sUV``) takes its ideal wavefronts in the executor's bank model. The layouts that make it so
    (Mamba3StepKernel.uv_layout, operand_columns) are what the test checks: with the register kernel's padded
    coefficient rows the bf16 loads conflict 4-way, with rows of 8 words unskewed the fp32 ones 2-way, and with the
    operand columns in order the bf16 operand loads 2-way."""
    spec = flagship_spec(**form)
    tensors, _ = prepared_call(spec, B=2, seed=7)
    res = run_step_ptx(pipeline_spec(spec, 1), tensors, record_shared=True)
    log = res.shared_log.arrays()
    loads = {ln for ln, w, write in zip(log["instr"].tolist(), log["width"].tolist(), log["write"].tolist())
             if w == 16 and not write}
    conflicts = analysis.bank_conflicts(res)
    assert len(loads) >= 20, f"{len(loads)} vector loads from shared memory"
    bad = {ln: conflicts[ln] for ln in loads if conflicts[ln]["wavefronts"] != conflicts[ln]["ideal"]}
    assert not bad, f"bank-conflicted vector loads (PTX line: wavefronts): {bad}"


def test_the_stages_fill_their_budget():
    """As many tiles as 64 KiB holds, 2 to 4 (slab_pipeline.pipeline_stages; the contract's dtypes' widths)."""
    stages = {dtype: pipeline_stages(flagship_spec(state_dtype=dtype, pipeline_ctas=8))
              for dtype in ("float32", "bfloat16", "float16", "int8")}
    assert stages == {"float32": 2, "bfloat16": 4, "float16": 4, "int8": 4}, stages  # 32, 16, 16, 8 KiB tiles
    big = flagship_spec(dstate=256, pipeline_ctas=8)  # a 64 KiB fp32 tile: two stages, 128 KiB, still accepted
    assert pipeline_stages(big) == 2 and pipeline_problem(big) is None


def test_what_the_pipeline_refuses():
    for changes in (dict(replay_ring=2), dict(async_state_copy=True)):
        problem = pipeline_problem(flagship_spec(pipeline_ctas=8).replace(**changes))
        assert problem and "pipeline_ctas" in problem, (changes, problem)
    assert "pipeline_ctas must be in" in pipeline_problem(flagship_spec(pipeline_ctas=-1))
    big = flagship_spec(dstate=256, headdim=128, pipeline_ctas=8).with_default_tiling()
    assert "shared memory" in pipeline_problem(big.replace(tile_D=128))
    assert pipeline_problem(flagship_spec()) is None
