"""The register kernel with the epilogue's operands loaded early (``StepSpec.early_epilogue``), compiled
for sm_90a and sm_100a (no GPU needed): no spill and no stack, and the flagship's schedule read from its
SASS (``latency_model.global_round_trips``): one dependent round trip fewer than the default kernel's,
at the CTAs per SM ``latency_model.EARLY_EPILOGUE_LATENCY_FACTS`` states (the trip the default kernel
makes for the epilogue's operands after the update is gone)."""

from __future__ import annotations

import pytest

from mamba3_step.kernel import compile_step_kernel
from mamba3_step.spec import flagship_spec
from mamba3_step.tools.inspection.facts import kernel_facts
from mamba3_step.tools.latency_model import EARLY_EPILOGUE_LATENCY_FACTS, KERNEL_LATENCY_FACTS, global_round_trips

#: the state forms the facts name, as flagship specialisations
FORMS = {"fp32": {}, "bf16, round to nearest": dict(state_dtype="bfloat16"),
         "bf16, stochastic rounding": dict(state_dtype="bfloat16", stochastic_rounding=True)}


@pytest.mark.parametrize("arch, form", [pytest.param(arch, form, id=f"{arch}-{form}", marks=[] if (
    arch, form) == ("sm_90a", "fp32") else [pytest.mark.full_matrix])
    for arch, forms in EARLY_EPILOGUE_LATENCY_FACTS.items() for form in forms])
def test_the_early_epilogue_compiles_clean_with_one_round_trip_fewer(arch, form):
    f = kernel_facts(compile_step_kernel(flagship_spec(early_epilogue=True, **FORMS[form]), arch))
    where = f"flagship {form}, early epilogue @ {arch}"
    assert (f.spill_bytes, f.stack_bytes) == (0, 0), f"{where}: {f.spill_bytes} spill, {f.stack_bytes} stack bytes"
    trips = global_round_trips(f.sass_text)
    assert (trips.round_trips, f.occupancy()["ctas_per_sm"]) == EARLY_EPILOGUE_LATENCY_FACTS[arch][form], where
    assert trips.round_trips == KERNEL_LATENCY_FACTS[form][0] - 1, where
