"""The register kernel's load layouts, compiled for sm_90a and sm_100a (no GPU needed): the default (every load
of the first token pinned above the first use of any by a barrier, the epilogue's operands loaded at the
token's start), the loads in the compiler's order (``StepSpec.unpinned_loads``) and, with that, the epilogue's
operands loaded after the update (``StepSpec.late_epilogue``). Each compiles with no spill and no stack, and
the flagship's schedule is read from its SASS (``latency_model.global_round_trips``): the default makes at
most two dependent round trips (the index, then every other load), each previous layout one more than the
next, all at the same CTAs per SM (``latency_model.KERNEL_LATENCY_FACTS``, ``UNPINNED_LATENCY_FACTS``,
``LATE_EPILOGUE_LATENCY_FACTS``)."""

from __future__ import annotations

import pytest
from async_state_cases import STATE_FORMS

from mamba3_step.kernel import compile_step_kernel
from mamba3_step.spec import flagship_spec
from mamba3_step.tools.inspection.facts import kernel_facts
from mamba3_step.tools.latency_model import (KERNEL_LATENCY_FACTS, LATE_EPILOGUE_LATENCY_FACTS, UNPINNED_LATENCY_FACTS,
                                             global_round_trips)

#: each layout's StepSpec fields and its facts
LAYOUTS = {"pinned": ({}, {arch: KERNEL_LATENCY_FACTS for arch in ("sm_90a", "sm_100a")}),
           "unpinned": (dict(unpinned_loads=True), UNPINNED_LATENCY_FACTS),
           "late": (dict(unpinned_loads=True, late_epilogue=True), LATE_EPILOGUE_LATENCY_FACTS)}


@pytest.mark.parametrize("arch, form", [pytest.param(arch, form, id=f"{arch}-{form}", marks=[] if (
    arch, form) == ("sm_90a", "fp32") else [pytest.mark.full_matrix])
    for arch, forms in LATE_EPILOGUE_LATENCY_FACTS.items() for form in forms])
def test_each_load_layout_compiles_clean_and_the_default_makes_two_round_trips(arch, form):
    facts = {}
    for layout, (fields, expected) in LAYOUTS.items():
        f = kernel_facts(compile_step_kernel(flagship_spec(**fields, **STATE_FORMS[form]), arch))
        where = f"flagship {form}, {layout} loads @ {arch}"
        assert (f.spill_bytes, f.stack_bytes) == (0, 0), f"{where}: {f.spill_bytes} spill, {f.stack_bytes} stack bytes"
        facts[layout] = (global_round_trips(f.sass_text).round_trips, f.occupancy()["ctas_per_sm"])
        assert facts[layout] == expected[arch][form], (where, facts)
    assert facts["pinned"][0] <= 2, facts
    assert facts["unpinned"] == (facts["pinned"][0] + 1, facts["pinned"][1]), facts
    assert facts["late"] == (facts["unpinned"][0] + 1, facts["unpinned"][1]), facts
