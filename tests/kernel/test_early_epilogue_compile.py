"""The register kernel with the epilogue's operands loaded early (its default at 4 and 8 warps) and after the
update (``StepSpec.late_epilogue``), compiled for sm_90a and sm_100a (no GPU needed): no spill and no stack,
and the flagship's schedule read from its SASS (``latency_model.global_round_trips``): the early layout makes
one dependent round trip fewer at the same CTAs per SM (``latency_model.KERNEL_LATENCY_FACTS`` and
``LATE_EPILOGUE_LATENCY_FACTS``: the trip the late layout makes for the epilogue's operands after the
update is gone)."""

from __future__ import annotations

import pytest

from mamba3_step.kernel import compile_step_kernel
from mamba3_step.spec import flagship_spec
from mamba3_step.tools.inspection.facts import kernel_facts
from mamba3_step.tools.latency_model import KERNEL_LATENCY_FACTS, LATE_EPILOGUE_LATENCY_FACTS, global_round_trips

#: the state forms the facts name, as flagship specialisations
FORMS = {"fp32": {}, "bf16, round to nearest": dict(state_dtype="bfloat16"),
         "bf16, stochastic rounding": dict(state_dtype="bfloat16", stochastic_rounding=True)}


@pytest.mark.parametrize("arch, form", [pytest.param(arch, form, id=f"{arch}-{form}", marks=[] if (
    arch, form) == ("sm_90a", "fp32") else [pytest.mark.full_matrix])
    for arch, forms in LATE_EPILOGUE_LATENCY_FACTS.items() for form in forms])
def test_the_early_epilogue_compiles_clean_with_one_round_trip_fewer(arch, form):
    facts = {}
    for late in (False, True):
        f = kernel_facts(compile_step_kernel(flagship_spec(late_epilogue=late, **FORMS[form]), arch))
        where = f"flagship {form}, {'late' if late else 'early'} epilogue @ {arch}"
        assert (f.spill_bytes, f.stack_bytes) == (0, 0), f"{where}: {f.spill_bytes} spill, {f.stack_bytes} stack bytes"
        facts[late] = (global_round_trips(f.sass_text).round_trips, f.occupancy()["ctas_per_sm"])
    assert facts[True] == LATE_EPILOGUE_LATENCY_FACTS[arch][form], facts
    assert facts[False] == KERNEL_LATENCY_FACTS[form] == (facts[True][0] - 1, facts[True][1]), facts
