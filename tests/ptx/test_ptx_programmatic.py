"""The step with programmatic dependent launch (``StepSpec.programmatic_launch``), executed from its PTX.

docs/contract.md, "Programmatic dependent launch": before ``griddepcontrol.wait`` a CTA reads only the
indices and the state rows (and an 8-bit state's scales), and writes nothing; the results are the
bits of the kernel without it. Each form runs both kernels' PTX on the same inputs (pool mode,
padding lanes of every kind) and checks the bits and, from the recorded accesses, what came before
the wait (:func:`ptx_executor.analysis.pre_wait_accesses`).
"""

from __future__ import annotations

import pytest
import torch
from async_state_cases import ASYNC_DEFAULT, assert_same_writes, case_spec, prepared_call, run_each
from helpers import assert_bits_equal, clone_inputs

from mamba3_step.api import prepare_step
from mamba3_step.spec import flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import inputs_for, padded_indices, speculative_indices
from mamba3_step.tools.ptx_tier import run_step_ptx
from ptx_executor import analysis

NULL = 1
#: what a CTA may read before its wait (the caller's guarantee covers them)
PRE_WAIT_READS = {"state_batch_indices", "dst_state_batch_indices", "num_accepted_tokens", "state", "state_scale"}

FORMS = {
    "flagship": flagship_spec(),
    "flagship-bf16state-sr": flagship_spec(state_dtype="bfloat16", stochastic_rounding=True),  # rand_seed after
    "flagship-int8state": flagship_spec(state_dtype="int8", stochastic_rounding=True),  # the scales before
    "flagship-T2-spec": flagship_spec(tokens=2, has_dst=True, dst_per_token=True, num_accepted=True),
    "flagship-tileD16-cluster": flagship_spec(tile_D=16),
}


def _tensors(spec, seed):
    B, P = 6, 14
    inputs = inputs_for(spec, B, P, H=2, seed=seed)
    if spec.num_accepted:
        src, accepted, dst, _ = speculative_indices(B, P, spec.tokens, null_slot_id=NULL, seed=seed)
        return inputs, dict(state_batch_indices=src, num_accepted_tokens=accepted, dst_state_batch_indices=dst,
                            null_slot_id=NULL)
    src, dst, _ = padded_indices(B, P, null_slot_id=NULL, with_dst=spec.has_dst, seed=seed)
    return inputs, dict(state_batch_indices=src, dst_state_batch_indices=dst, null_slot_id=NULL)


def _execute(spec, inputs, indices, programmatic, **kernel):
    t = clone_inputs(inputs)
    x = t["x"]
    t["out"] = torch.full((*x.shape[:-1], x.shape[-1]), float("nan"), dtype=x.dtype)
    prepared, tensors, _ = prepare_step(StepTensors(**t, **indices), update_kv_state=spec.update_kv_state,
                                        tile_D=spec.tile_D or None, stochastic_rounding=spec.stochastic_rounding)
    res = run_step_ptx(prepared.replace(programmatic_launch=programmatic, **kernel), tensors)
    return t, res


@pytest.mark.parametrize("name", [n if n in ("flagship", "flagship-bf16state-sr", "flagship-tileD16-cluster")
                                  else pytest.param(n, marks=pytest.mark.full_matrix) for n in FORMS])
def test_programmatic_launch_reads_only_indices_and_rows_before_its_wait_and_keeps_the_bits(name):
    spec = FORMS[name]
    inputs, indices = _tensors(spec, seed=sum(map(ord, name)))
    plain, _ = _execute(spec, inputs, indices, False)
    early, res = _execute(spec, inputs, indices, True)
    for key in ("out", "state", "Bstate", "Xstate", "state_scale"):
        if plain.get(key) is not None:
            assert_bits_equal(early[key], plain[key], f"{name}: {key}")
    before = analysis.pre_wait_accesses(res, res.extra["memory"])
    assert set(before) <= PRE_WAIT_READS, f"{name}: touched before griddepcontrol.wait: {before}"
    assert all(v["written"] == 0 for v in before.values()), before
    assert before["state"]["read"] > 0 and before["state_batch_indices"]["read"] > 0, before
    assert res.extra["griddepcontrol"]["waited"].all(), "every thread waits (padding lanes too)"


@pytest.mark.parametrize("name", ["flagship", pytest.param("flagship-bf16state-sr", marks=pytest.mark.full_matrix)])
def test_the_slab_pipeline_launched_programmatically_reads_only_indices_and_rows_before_its_wait(name):
    """The slab pipeline (3 persistent CTAs: each walks several slabs) waits once, after its prologue (the first
    slabs' indices and their bulk copies of the state rows): the register kernel's bits, nothing else before."""
    spec = FORMS[name]
    inputs, indices = _tensors(spec, seed=7)
    plain, _ = _execute(spec, inputs, indices, False)
    early, res = _execute(spec, inputs, indices, True, pipeline_ctas=3)
    for key in ("out", "state", "Bstate", "Xstate"):
        assert_bits_equal(early[key], plain[key], f"{name}, slab pipeline: {key}")
    before = analysis.pre_wait_accesses(res, res.extra["memory"])
    assert set(before) <= PRE_WAIT_READS and all(v["written"] == 0 for v in before.values()), before
    assert before["state_batch_indices"]["read"] > 0, before


@pytest.mark.full_matrix
@pytest.mark.parametrize("name", [n for n in ASYNC_DEFAULT if n not in FORMS])
def test_programmatic_launch_of_every_covering_and_feature_form(name):
    """The covering set and one form of each feature set (the asynchronous copy's cases), programmatically
    launched: the default kernel's writes, bit for bit, and before the wait only the allowed reads."""
    spec = case_spec(name)
    tensors, _ = prepared_call(spec, 5, seed=len(name))
    plain, early = run_each(tensors, spec, spec.replace(programmatic_launch=True))
    assert assert_same_writes(plain, early, f"{name}: programmatic launch") >= 2
    res = run_step_ptx(spec.replace(programmatic_launch=True), prepared_call(spec, 5, seed=len(name))[0])
    before = analysis.pre_wait_accesses(res, res.extra["memory"])
    assert set(before) <= PRE_WAIT_READS and all(v["written"] == 0 for v in before.values()), (name, before)
