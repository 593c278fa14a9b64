"""The latency model's measured inputs, each read from a compiled kernel's SASS or a GPU's profile: the round
trips and CTAs per SM of each kernel and state form (:func:`~mamba3_step.tools.latency_model.global_round_trips`
and the occupancy read them; the compile tests hold them equal), and the warps' own stall cycles per
instruction that Nsight Compute measured (:func:`own_stalls`, recomputed from the raw pages under
docs/measured/ by tests/tools/test_latency_model.py). :mod:`~mamba3_step.tools.latency_model` re-exports them."""

from __future__ import annotations

import re

__all__ = ["ASYNC_LATENCY_FACTS", "FLAGSHIP_TRIPS", "KERNEL_LATENCY_FACTS", "LATE_EPILOGUE_LATENCY_FACTS",
           "MEASURED_OWN_STALLS", "NOT_OWN_STALLS", "PIPELINE_LATENCY_FACTS", "PIPELINE_PROLOGUE_TRIPS",
           "SPLIT_LATENCY_FACTS", "UNPINNED_LATENCY_FACTS", "VERIFY_PIPELINE_LATENCY_FACTS", "own_stalls"]

#: dependent global round trips of the flagship's CTA today, as :func:`~mamba3_step.tools.latency_model.global_round_trips` reads them from
#: its SASS on sm_90a and sm_100a (the index; then the 16 state loads, the staging loads and the epilogue's
#: operands, all issued before the first use of any: the loads' dependence depth); tests/tools/test_latency_model.py
#: holds them equal
FLAGSHIP_TRIPS = 2
#: ``(round trips, CTAs per SM)`` of today's kernel for each state form the designs' table models
#: (sm_90a, default tiling; the replay kernel with replayed outputs), as :func:`~mamba3_step.tools.latency_model.global_round_trips` and the
#: occupancy read them from the SASS. A replay kernel's live path falls through every ring position's
#: branches, so its count is an upper bound (bench/latency_model.py models one position's path with the
#: stepwise kernel's round trips); the bench re-reads them and says when they differ
KERNEL_LATENCY_FACTS = {"fp32": (2, 3), "bf16, round to nearest": (2, 3), "bf16, stochastic rounding": (2, 2),
                        "fp32 replay F = 2": (10, 3), "fp32 replay F = 4": (12, 2),
                        # the T = 4 verify step (issue_model.verify_spec, 8 warps: one CTA of 168 registers an SM;
                        # token 0's loads pinned, each later token's staging a trip) and replay's verify kernel
                        "fp32 verify T = 4": (10, 1), "fp32 replay verify F = 2, T = 4": (29, 2),
                        "fp32 replay verify F = 4, T = 4": (31, 2)}


#: ``(round trips, CTAs per SM)`` of the asynchronous state copy (``StepSpec.async_state_copy``), read from the
#: SASS as KERNEL_LATENCY_FACTS are: each state form on sm_90a (its row groups of tiling.ASYNC_ROWS_PER_GROUP),
#: the fp32 flagship on sm_100a (136 registers: 3 CTAs; 128 and no spill under a launch bound of 4). The last
#: trip is the epilogue's operands, which the compiler issues after the staging loads' first use and waits on
#: after the update. tests/kernel/
#: test_async_state_compile.py holds them equal
ASYNC_LATENCY_FACTS = {"sm_90a": {"fp32": (3, 4), "bf16, round to nearest": (3, 6), "bf16, stochastic rounding": (3, 4)},
                       "sm_100a": {"fp32": (3, 3)}}


#: ``(round trips a slab waits on, CTAs per SM)`` of the slab pipeline (``StepSpec.pipeline_ctas``), each state form
#: on sm_90a and sm_100a: in its slab loop a CTA waits on one round trip per slab, its token's staging loads (the
#: slab's state was put in flight ``S - 1`` slabs earlier, its row indices ``S``: tests/kernel/test_pipeline_compile.py
#: reads the loop from the SASS); the CTAs per SM are the occupancy (three: the stages take 64 KiB, two fp32 tiles or
#: four 16-bit ones, and the registers fit slab_pipeline.PIPELINE_LAUNCH_BOUND), which that test holds equal
PIPELINE_LATENCY_FACTS = {arch: {"fp32": (1, 3), "bf16, round to nearest": (1, 3), "bf16, stochastic rounding": (1, 3)}
                          for arch in ("sm_90a", "sm_100a")}
#: the slab pipeline's prologue on the live path: two dependent round trips (the first ``S - 1`` slabs' indices
#: together, then the next one's); the live path's other trips are the slab loop's
PIPELINE_PROLOGUE_TRIPS = 2
#: ``(round trips a slab waits on, CTAs per SM)`` of the slab pipeline running the fp32 flagship's T = 4 verify step
#: (issue_model.verify_spec; sm_90a): each token's staging loads a trip of their own, as in the register kernel, and
#: one CTA of 232 registers (multi-token steps take no launch bound). tests/kernel/test_pipeline_compile.py holds it
VERIFY_PIPELINE_LATENCY_FACTS = {"sm_90a": (10, 1)}


#: ``split -> (round trips, CTAs per SM)`` of the register kernel with the flagship's D split over ``split`` CTAs,
#: one cluster (update_kv_state with tile_D = 64 / split: tiling.launch_cluster), each state form on sm_90a and
#: sm_100a, read from the SASS as KERNEL_LATENCY_FACTS are (at tile_D = 16 the compiler puts the state loads in a
#: trip apart from the staging loads); tests/kernel/test_kernel_compile.py holds them equal
SPLIT_LATENCY_FACTS = {arch: {"fp32": {2: (2, 4), 4: (4, 6)}, "bf16, round to nearest": {2: (2, 4), 4: (4, 8)},
                              "bf16, stochastic rounding": {2: (2, 4), 4: (3, 7)}}
                       for arch in ("sm_90a", "sm_100a")}
#: ``(round trips, CTAs per SM)`` of the register kernel with its loads in the compiler's order
#: (``StepSpec.unpinned_loads``: no barrier after the first token's loads), read from the SASS as
#: KERNEL_LATENCY_FACTS are: the compiler issues 1-8 of the 16-byte state loads (by form and target) before the
#: staging loads' first use and the rest after it, one trip more at the same registers (fp32 166, bf16 168, bf16
#: with stochastic rounding 222, on both targets, as the default kernel). tests/kernel/test_load_layouts_compile.py
#: holds them equal
UNPINNED_LATENCY_FACTS = {arch: {"fp32": (3, 3), "bf16, round to nearest": (3, 3), "bf16, stochastic rounding": (3, 2)}
                          for arch in ("sm_90a", "sm_100a")}


#: ``(round trips, CTAs per SM)`` of the register kernel with its loads unpinned and the epilogue's operands
#: loaded after the update (``StepSpec.unpinned_loads`` and ``StepSpec.late_epilogue``, the layout before they
#: were loaded early), read from the SASS as KERNEL_LATENCY_FACTS are: the epilogue's operands are a trip of
#: their own (fp32 161 registers, bf16 167, bf16 with stochastic rounding 190, on both targets).
#: tests/kernel/test_load_layouts_compile.py holds them equal
LATE_EPILOGUE_LATENCY_FACTS = {arch: {"fp32": (4, 3), "bf16, round to nearest": (4, 3), "bf16, stochastic rounding": (4, 2)}
                               for arch in ("sm_90a", "sm_100a")}


#: the stall reasons :func:`own_stalls` leaves out: the global loads' waits (the model's round trips and DRAM queue),
#: a barrier's (warps waiting for their CTA's slowest warp, whose wait is those), other warps issuing (the issue
#: queue) and the issue itself
NOT_OWN_STALLS = ("long_scoreboard", "barrier", "not_selected", "selected")
_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio\s+\S+\s+([\d.,]+)")


def own_stalls(ncu_raw: str) -> list[float]:
    """Cycles a warp stalls per issued instruction on its own fixed-latency dependencies, for each kernel of an
    Nsight Compute raw page (``ncu --page raw``), in the order profiled: the sum of
    ``smsp__average_warps_issue_stalled_*_per_issue_active`` over every reason but :data:`NOT_OWN_STALLS`."""
    kernels: list[dict] = []
    for m in _STALL.finditer(ncu_raw):
        reason, value = m.group(1), float(m.group(2).replace(",", ""))
        if not kernels or reason in kernels[-1]:
            kernels.append({})
        kernels[-1][reason] = value
    return [round(sum(v for r, v in k.items() if r not in NOT_OWN_STALLS), 2) for k in kernels]


#: :func:`own_stalls` of the flagship (pool mode, B = 256) measured by Nsight Compute on the H200, per state form
#: and kernel: the default register kernel ("pinned": docs/measured/2026-11-28-h200-pinned/ncu_raw_*.log), the
#: register kernel with its loads unpinned and its epilogue loaded late, then the asynchronous state copy
#: (docs/measured/2026-11-28-h200-async/ncu_raw_*.log). Under ncu the SM clock is locked, so these are cycles at
#: its clock. The model's ``extra_cycles_per_instruction`` replaced by them ("measured stalls" in
#: bench/latency_model.py --measured); tests/tools/test_latency_model.py recomputes them from those logs
MEASURED_OWN_STALLS = {
    ("fp32", "pinned"): 1.97, ("fp32", "late epilogue"): 1.40, ("fp32", "async"): 4.62,
    ("bf16, round to nearest", "pinned"): 2.53, ("bf16, round to nearest", "late epilogue"): 3.20,
    ("bf16, round to nearest", "async"): 12.77,
}
