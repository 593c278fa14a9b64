"""The asynchronous state copy (``StepSpec.async_state_copy``), compiled for sm_90a and sm_100a: its
compiler facts, and the latency facts its design promises, read from the SASS.

* every specialisation the PTX tier executes on it (tests/ptx/test_ptx_async_state.py) compiles
  with no spill and no stack, except the forms ``KNOWN_SPILLS`` lists with their exact bytes; the state moves by one 16-byte ``LDGSTS`` per vector a thread owns
  (no ``LDG.128`` left) and is stored by ``STG.128`` as in the register kernel; in pool mode the
  padding branch comes before any copy;
* the flagship's schedule (mamba3_step.tools.latency_model.global_round_trips): the index alone
  in the first round trip, every state copy issued in the second, before the first use of any
  global load; the round trips and resident CTAs per SM that ``ASYNC_LATENCY_FACTS`` gives the
  latency model, exactly.
"""

from __future__ import annotations

import pytest
from async_state_cases import ASYNC_DEFAULT, ASYNC_FULL, STATE_FORMS, compile_facts, compile_params
from test_kernel_compile import ARCHS, check_padding_guard

from mamba3_step.spec import flagship_spec
from mamba3_step.tiling import thread_layout
from mamba3_step.tools.latency_model import ASYNC_LATENCY_FACTS, global_round_trips

#: (name, arch) -> (spill, stack) bytes of the forms that are not clean, exactly: on sm_100a ptxas gives the
#: rotary flagship 128 registers and spills (on sm_90a it is clean at 128)
KNOWN_SPILLS = {("flagship-rotary", "sm_100a"): (32, 16)}


@pytest.mark.parametrize("name, arch", compile_params(ARCHS))
def test_the_asynchronous_copy_compiles_clean(name, arch):
    spec = {**ASYNC_DEFAULT, **ASYNC_FULL}[name].with_default_tiling().replace(async_state_copy=True)
    f = compile_facts(spec, arch)
    where = f"{name} (asynchronous state copy) @ {arch}"
    spills = KNOWN_SPILLS.get((name, arch), (0, 0))
    assert (f.spill_bytes, f.stack_bytes) == spills, f"{where}: {f.spill_bytes} spill, {f.stack_bytes} stack bytes"
    lay = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo, spec.carried_tokens)
    vectors = lay.rows_per_thread * lay.CPT
    writes = spec.tokens if spec.dst_per_token else 1
    assert f.count("LDGSTS", 128) == vectors and f.count("LDG", 128) == 0, (where, f.sass)
    assert f.count("STG", 128) == vectors * writes, (where, f.sass)
    if spec.pool:
        check_padding_guard(f.sass_text, where, loads=2 + spec.num_accepted)


@pytest.mark.parametrize("arch, form", [(arch, form) for arch, forms in ASYNC_LATENCY_FACTS.items() for form in forms])
def test_the_flagship_issues_every_state_copy_in_its_second_round_trip(arch, form):
    spec = flagship_spec(async_state_copy=True, **STATE_FORMS[form])
    f = compile_facts(spec, arch)
    trips = global_round_trips(f.sass_text)
    copies = [trip for _, text, trip, _ in trips.loads if "LDGSTS" in text]
    vectors = 16 if form == "fp32" else 8
    assert trips.trips[0]["loads"] == 1, "the index alone in the first round trip"
    assert len(copies) == vectors and set(copies) == {2}, f"state copies by round trip: {copies}"
    assert trips.trips[1]["by_width"].get(16) == vectors
    rounds, ctas = ASYNC_LATENCY_FACTS[arch][form]
    assert trips.round_trips == rounds, f"{arch} {form}: {trips.round_trips} round trips"
    assert f.occupancy()["ctas_per_sm"] == ctas, f"{arch} {form}: {f.registers} registers, {f.occupancy()}"
    assert f.spill_bytes == 0 and f.stack_bytes == 0
