"""The slab pipeline (``StepSpec.pipeline_ctas``), compiled for sm_90a and sm_100a: its compiler facts, and the
latency facts its design promises, read from the SASS.

* every specialisation the PTX tier executes on it (tests/ptx/test_ptx_pipeline.py) compiles with no spill and no
  stack, except the forms ``KNOWN_SPILLS`` lists with their exact bytes; the state arrives by bulk copies (``UBLKCP``), no thread loads it (no ``LDG.128``), and it is stored by
  ``STG.128`` from registers as in the register kernel;
* the flagship's forms (fp32, bf16 rounded to nearest, bf16 with stochastic rounding): the resident CTAs per SM
  and the round trips a slab waits on that ``PIPELINE_LATENCY_FACTS`` gives the latency model, exactly. The live
  path (mamba3_step.tools.latency_model.global_round_trips: conditional branches fall through, so it runs the
  prologue and one pass of the slab loop) makes the prologue's two trips (the first ``S - 1`` slabs' indices
  together, then the next one's, which the loop's first refill uses) and then the loop's: the token's staging
  loads, with the index ``S`` slabs ahead, never waited on in the same pass;
* the flagship's forms keep the bytes Little's law asks in flight: a CTA issues the bulk copies of ``S`` slabs
  before its first wait (the prologue's ``S - 1`` and the first refill), so at least ``S - 1`` tiles stay
  outstanding at every wait, and the resident CTAs' tiles cover ``latency_model.bytes_in_flight_needed`` per SM on
  the target's GPUs (sm_90a: H100, H200; sm_100a: B200);
* the flagship's T = 4 verify step on the pipeline: the round trips a slab waits on and the CTAs per SM that
  ``VERIFY_PIPELINE_LATENCY_FACTS`` gives the latency model.
"""

from __future__ import annotations

import pytest
from async_state_cases import ASYNC_DEFAULT, ASYNC_FULL, STATE_FORMS, compile_facts, compile_params, pipeline_spec
from test_kernel_compile import ARCHS

from mamba3_step.spec import flagship_spec
from mamba3_step.slab_pipeline import PIPELINE_DEFAULT_CTAS, pipeline_stages, stage_tile_bytes
from mamba3_step.tiling import thread_layout
from mamba3_step.tools.issue_model import verify_spec
from mamba3_step.tools.latency_model import (PIPELINE_LATENCY_FACTS, PIPELINE_PROLOGUE_TRIPS, VERIFY_PIPELINE_LATENCY_FACTS,
                                             bytes_in_flight_needed, global_round_trips)

#: (name, arch) -> (spill, stack) bytes of the forms that are not clean, exactly
KNOWN_SPILLS = {}
#: the GPUs of each target, whose Little's-law need the pipeline's bytes in flight are held against
GPUS_OF = {"sm_90a": ("H100", "H200"), "sm_100a": ("B200",)}
#: the flagship's forms on each target, one xdist group each: the tests reading their SASS share one compile
FLAGSHIP_FORMS = [pytest.param(arch, form, marks=pytest.mark.xdist_group(f"pipeline-flagship-{form}@{arch}"))
                  for arch, forms in PIPELINE_LATENCY_FACTS.items() for form in forms]


@pytest.mark.parametrize("name, arch", compile_params(ARCHS))
def test_the_pipeline_compiles_clean(name, arch):
    spec = pipeline_spec({**ASYNC_DEFAULT, **ASYNC_FULL}[name].with_default_tiling(), PIPELINE_DEFAULT_CTAS)
    f = compile_facts(spec, arch)
    where = f"{name} (slab pipeline) @ {arch}"
    spills = KNOWN_SPILLS.get((name, arch), (0, 0))
    assert (f.spill_bytes, f.stack_bytes) == spills, f"{where}: {f.spill_bytes} spill, {f.stack_bytes} stack bytes"
    lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo, spec.carried_tokens)
    writes = spec.tokens if spec.dst_per_token else 1
    assert f.count("UBLKCP") >= 1 and f.count("LDG", 128) == 0, (where, f.sass)
    assert f.count("STG", 128) == lay.rows_per_thread * lay.CPT * writes, (where, f.sass)


@pytest.mark.parametrize("arch, form", FLAGSHIP_FORMS)
def test_the_flagship_waits_on_one_round_trip_a_slab(arch, form):
    spec = flagship_spec(pipeline_ctas=PIPELINE_DEFAULT_CTAS, **STATE_FORMS[form])
    f = compile_facts(spec, arch)
    trips = global_round_trips(f.sass_text)
    per_slab, ctas = PIPELINE_LATENCY_FACTS[arch][form]
    assert trips.trips[0]["loads"] == pipeline_stages(spec) - 1, "the first slabs' indices alone in the first round trip"
    assert trips.round_trips == PIPELINE_PROLOGUE_TRIPS + per_slab, f"{arch} {form}: {trips.round_trips} round trips"
    name = {"fp32": "flagship-pool-kv", "bf16, stochastic rounding": "flagship-bf16state-sr"}.get(form, "")
    assert (f.spill_bytes, f.stack_bytes) == KNOWN_SPILLS.get((name, arch), (0, 0))
    assert f.occupancy()["ctas_per_sm"] == ctas, f"{arch} {form}: {f.occupancy()}"


@pytest.mark.parametrize("arch, form", FLAGSHIP_FORMS)
def test_the_flagship_keeps_the_bytes_littles_law_asks_in_flight(arch, form):
    spec = flagship_spec(pipeline_ctas=PIPELINE_DEFAULT_CTAS, **STATE_FORMS[form])
    f = compile_facts(spec, arch)
    ops = f.sass_text.splitlines()
    first_wait = next(i for i, line in enumerate(ops) if "SYNCS" in line and "TRYWAIT" in line)
    copies = sum("UBLKCP" in line for line in ops[:first_wait])
    assert copies == pipeline_stages(spec), f"{arch} {form}: {copies} bulk copies before the first wait"
    per_sm = f.occupancy(arch)["ctas_per_sm"] * (copies - 1) * stage_tile_bytes(spec)
    for gpu in GPUS_OF[arch]:
        need = bytes_in_flight_needed(gpu)["bytes_per_sm"]
        assert per_sm >= need, f"{arch} {form}: {per_sm} bytes in flight per SM, {gpu} needs {need:.0f}"


@pytest.mark.parametrize("arch", [ARCHS[0], pytest.param(ARCHS[1], marks=pytest.mark.full_matrix)])
@pytest.mark.parametrize("form", list(STATE_FORMS))
def test_the_pipeline_launched_programmatically_compiles_like_the_pipeline(form, arch):
    """StepSpec.programmatic_launch on the slab pipeline: no spill, the pipeline's registers within 8 and its CTAs
    per SM, one wait (ACQBULK) before the slab loop's first mbarrier wait and launch_dependents (PREEXIT) after it."""
    spec = flagship_spec(pipeline_ctas=PIPELINE_DEFAULT_CTAS, **STATE_FORMS[form])
    early, plain = compile_facts(spec.replace(programmatic_launch=True), arch), compile_facts(spec, arch)
    assert (early.spill_bytes, early.stack_bytes) == (0, 0)
    assert abs(early.registers - plain.registers) <= 8 and early.occupancy(arch) == plain.occupancy(arch)
    ops = early.sass_text.splitlines()
    wait = [i for i, line in enumerate(ops) if "ACQBULK" in line]
    assert len(wait) == 1 and any("PREEXIT" in line for line in ops[wait[0]:])
    assert wait[0] < next(i for i, line in enumerate(ops) if "SYNCS" in line and "TRYWAIT" in line), "before the loop"


def test_the_verify_step_on_the_pipeline_has_the_models_latency_facts():
    f = compile_facts(verify_spec(pipeline_ctas=PIPELINE_DEFAULT_CTAS), "sm_90a")
    trips = global_round_trips(f.sass_text).round_trips - PIPELINE_PROLOGUE_TRIPS
    assert (f.spill_bytes, f.stack_bytes) == (0, 0)
    assert (trips, f.occupancy()["ctas_per_sm"]) == VERIFY_PIPELINE_LATENCY_FACTS["sm_90a"]
