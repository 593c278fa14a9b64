"""The memory side of the static performance model: latency, bytes in flight and round trips (modelled).

Letters (docs/contract.md): B lanes, H heads, D head dim, N state size, R MIMO rank.

Three parts, all static (no GPU):

1. **Little's law** (:func:`bytes_in_flight_needed`): to move ``bw`` bytes per second through a
   memory whose loaded latency is ``L``, ``bw x L`` bytes must be in flight; per SM that is
   ``copy bandwidth x L / SMs``.
2. **What a kernel keeps in flight, read from its SASS** (:mod:`.sass_trips`'s :func:`global_round_trips`): along the
   straight-line path of a live CTA (conditional branches fall through, up to the first
   unconditional ``EXIT``), each global load (``LDG``/``LDGSTS``) and the first instruction that
   reads or overwrites its destination register (where the scoreboard makes the warp wait). A
   *round trip* is the set of loads issued between two such waits: the first use of any load of
   the open trip closes it (its loads were issued together, so they arrive together). The
   *dependence depth* is the length of the longest chain load -> value -> address (or branch
   predicate) -> load: the fewest round trips any schedule of the same loads can have.
3. **The time of a step** (:func:`step_time`): each SM runs ``C`` resident CTAs (its occupancy),
   which circulate through a closed queueing network solved by exact mean-value analysis
   (:func:`mean_value_analysis`): the SM's issue slots (a queue: warp-instructions / (4 per
   clock x clock)), the DRAM at the SM's share of the copy bandwidth (a queue: the CTA's
   bytes), the round trips (a delay: ``trips x idle latency``, the latency a lone request sees;
   the queueing at DRAM is the model's, so the loaded latency is an output) and the CTA's own
   instruction dependencies (a delay: ``instructions per thread x extra cycles / clock``). A
   grid of fewer CTAs than ``C x SMs`` runs one partial wave on ``min(SMs, CTAs)`` SMs whose DRAM
   share is capped by an SM's port. Add the launch overhead under a CUDA graph.

Every input is an argument; the defaults are named assumptions (:data:`ASSUMPTIONS`) or figures
with their source (:data:`COPY_BANDWIDTH`). Nothing here is a measurement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..slab_pipeline import pipeline_stages
from .issue_model import GPUS, ISSUE_PER_CLOCK, GPU
from .sass_trips import LoadTrips, global_round_trips, live_path, sass_instructions  # re-exported: part 2
from .latency_facts import (ASYNC_LATENCY_FACTS, FLAGSHIP_TRIPS, KERNEL_LATENCY_FACTS, LATE_EPILOGUE_LATENCY_FACTS,
                            MEASURED_OWN_STALLS, NOT_OWN_STALLS, PIPELINE_LATENCY_FACTS, PIPELINE_PROLOGUE_TRIPS,
                            SPLIT_LATENCY_FACTS, UNPINNED_LATENCY_FACTS, VERIFY_PIPELINE_LATENCY_FACTS, own_stalls)

__all__ = ["ASSUMPTIONS", "ASYNC_LATENCY_FACTS", "COPY_BANDWIDTH", "FLAGSHIP_TRIPS", "KERNEL_LATENCY_FACTS",
           "LATE_EPILOGUE_LATENCY_FACTS", "MEASURED_OWN_STALLS", "NOT_OWN_STALLS", "PIPELINE_LATENCY_FACTS",
           "PIPELINE_PROLOGUE_TRIPS", "SPLIT_LATENCY_FACTS", "UNPINNED_LATENCY_FACTS", "VERIFY_PIPELINE_LATENCY_FACTS",
           "own_stalls",
           "Design",
           "LoadTrips",
           "average_bytes_in_flight", "bytes_in_flight_needed", "flagship_designs", "global_round_trips", "live_path",
           "mean_value_analysis", "percent_of_copy", "sass_instructions", "step_time"]

# ------------------------------------------------------------------------------------------------ inputs
#: copy bandwidth (device-to-device ``Tensor.copy_``, read + write bytes) per GPU, bytes/s, and its source
COPY_BANDWIDTH = {
    "H200": (4.24e12, "measured in this project's H200 runs (docs/measured/2026-11-27-h200*/gpu_bench.json: "
                      "4,247, 4,241, 4,262 GB/s; dense_rows_1.log 4,214 GB/s): their mean, 88% of the "
                      "4.8 TB/s datasheet figure"),
    "H100": (0.88 * 3.35e12, "assumption: the datasheet's 3.35 TB/s x 0.88, the efficiency measured on the H200"),
    "B200": (0.88 * 8.0e12, "assumption: the datasheet's 8 TB/s x 0.88, the efficiency measured on the H200"),
}

#: the model's assumed inputs (seconds, cycles, bytes/s), each with why
ASSUMPTIONS = {
    "idle_latency_s": (0.6e-6, "a DRAM round trip from an SM when the memory system is not queueing: "
                               "pointer-chasing microbenchmarks (Luo et al., 'Benchmarking and Dissecting the "
                               "Nvidia Hopper GPU Architecture', arXiv 2402.13499; Chips and Cheese, 'Nvidia's "
                               "H100: Funny L2, and Tons of Bandwidth') put Hopper's HBM latency at several "
                               "hundred ns; 0.6 us allows a TLB miss for rows scattered over a multi-GB pool. "
                               "The figure was not read from those papers: an assumption (--latency-us)"),
    "loaded_latency_s": (1.2e-6, "the latency near 80% of the copy bandwidth, for Little's law: Nsight "
                                 "Compute on the H200 (docs/measured/2026-11-27-h200-run3/ncu_pool_dense.log) saw 4.8 "
                                 "cycles of global-load wait per issued instruction x 1,478 instructions / 4 "
                                 "round trips at 1.47 GHz = 1.2 us a round trip"),
    "extra_cycles_per_instruction": (0.5, "cycles a warp waits per instruction on its own fixed-latency "
                                          "dependencies (FFMA chains, shuffles, shared memory) beyond its "
                                          "issue slot: an assumption"),
    "sm_port_bytes_per_s": (64 * 1.98e9, "the most one SM takes from L2 per clock (64 B/clk at the boost "
                                         "clock): the cap on an SM's DRAM share when few SMs are busy"),
    "launch_s": (1.0e-6, "the gap a back-to-back single-kernel CUDA-graph replay adds to the kernel (launch "
                         "latency, the grid's start and drain): an assumption"),
    "split_fixed_fraction": (0.25, "small-batch path: the share of a CTA's instructions that a D split does "
                                   "not divide (index, staging of B/C/Bstate, scalars): an assumption"),
    "cluster_barrier_s": (0.3e-6, "D split over a cluster (the kernel update_kv_state with tile_D < headdim "
                                  "compiles): what its barrier adds to a CTA's life, the skew between the cluster's "
                                  "CTAs at the wait plus the barrier's own round trip through the GPC (the release's "
                                  "memory barrier waits for the loads in flight, which the update waits for next "
                                  "anyway): an assumption"),
    "programmatic_hidden_trips": (1, "programmatic dependent launch (StepSpec.programmatic_launch): the dependent "
                                     "round trips of the step's first wave that overlap the previous kernel's tail "
                                     "(the index's: the state loads are issued before the wait, then the staging "
                                     "loads after it), with the launch gap; assumes that tail lasts that long "
                                     "(a server's in-projection GEMM before the step): an assumption"),
    "pipeline_stages": (3, "asynchronous-copy pipeline: shared-memory stages per CTA (FlashInfer's Hopper "
                           "selective_state_update uses 3)"),
    "pipeline_ctas_per_sm": (2, "asynchronous-copy pipeline: resident CTAs per SM (state in shared memory, "
                                "not registers): an assumption"),
}


def assumption(name: str) -> float:
    return ASSUMPTIONS[name][0]


def bytes_in_flight_needed(gpu_name: str, latency_s: float | None = None, copy_bandwidth: float | None = None) -> dict:
    """Little's law per SM of ``gpu_name``: ``copy bandwidth x loaded latency / SMs`` bytes in flight."""
    gpu = GPUS[gpu_name]
    bw = COPY_BANDWIDTH[gpu_name][0] if copy_bandwidth is None else copy_bandwidth
    lat = assumption("loaded_latency_s") if latency_s is None else latency_s
    return {"gpu": gpu_name, "sms": gpu.sms, "copy_bytes_per_s": bw, "latency_s": lat,
            "bytes_per_sm": bw * lat / gpu.sms, "bytes_total": bw * lat}


# ------------------------------------------------------------------------------------------------ the model
def mean_value_analysis(customers: int, queues: list[float], delay: float) -> tuple[float, float]:
    """Exact mean-value analysis of a closed network: ``customers`` circulate through FIFO queues of
    the given service demands (seconds per cycle) and a delay of ``delay`` seconds. Returns
    ``(throughput in cycles per second, seconds one cycle takes)``."""
    if customers < 1 or delay < 0 or any(d < 0 for d in queues):
        raise ValueError(f"customers >= 1 and non-negative demands expected, got {customers}, {queues}, {delay}")
    backlog = [0.0] * len(queues)
    throughput = cycle = 0.0
    for n in range(1, customers + 1):
        residence = [d * (1 + q) for d, q in zip(queues, backlog)]
        cycle = sum(residence) + delay
        throughput = n / cycle
        backlog = [throughput * r for r in residence]
    return throughput, cycle


@dataclass(frozen=True)
class Design:
    """A kernel design, per (lane, head) slab: ``trips`` dependent global round trips a CTA makes,
    ``warp_instructions`` it issues, ``bytes_per_slab`` it moves (all lanes live, weights amortised),
    ``ctas_per_sm`` resident, ``warps`` per CTA; ``split``: D is split over CTAs while B x H is below
    2 x SMs (the small-batch path); ``stages`` > 0: a persistent asynchronous-copy pipeline with that
    many shared-memory stages of ``stage_bytes`` per CTA (``trips`` is then its prologue's)."""

    name: str
    trips: int
    warp_instructions: float
    bytes_per_slab: float
    ctas_per_sm: int = 3
    warps: int = 4
    split: bool = False
    stages: int = 0
    stage_bytes: float = 0.0
    #: launched with programmatic dependent launch: the launch gap and the first wave's
    #: ``programmatic_hidden_trips`` round trips overlap the previous kernel
    programmatic: bool = False
    #: a built D split: ``((split, fraction of the slab's instructions one of its CTAs issues, round trips, CTAs per
    #: SM), ...)`` for the splits the kernel has (the cluster's); empty: :data:`ASSUMPTIONS`' fixed fraction. The step
    #: takes the fastest of no split and each of them whose grid stays within 2 x SMs (a server picks the tile per
    #: batch bucket); ``fixed_split`` > 0 evaluates one
    split_facts: tuple = ()
    fixed_split: int = 0


def _inputs(overrides: dict) -> dict:
    unknown = set(overrides) - set(ASSUMPTIONS)
    if unknown:
        raise ValueError(f"inputs must be among {sorted(ASSUMPTIONS)}, got {sorted(unknown)}")
    return {k: overrides.get(k, v[0]) for k, v in ASSUMPTIONS.items()}


def _split_factor(design: Design, slabs: int, sms: int) -> int:
    """CTAs per slab: 1, or for the small-batch path doubled (up to 4) while the grid stays within 2 x SMs."""
    if design.fixed_split:
        return design.fixed_split
    split = 1
    while design.split and split < 4 and slabs * split * 2 <= 2 * sms:
        split *= 2
    return split


def _cta_demands(design: Design, gpu: GPU, share: float, instructions: float, moved: float, inp: dict,
                 trips: float) -> tuple:
    """``([issue, DRAM], delay)`` of one pass of a CTA issuing the fraction ``instructions`` of a slab's
    instructions and moving the fraction ``moved`` of its bytes at ``share`` bytes/s, in ``trips`` round trips."""
    issue = instructions * design.warp_instructions / (ISSUE_PER_CLOCK * gpu.clock_hz)
    own = instructions * design.warp_instructions / design.warps * inp["extra_cycles_per_instruction"] / gpu.clock_hz
    return [issue, moved * design.bytes_per_slab / share], trips * inp["idle_latency_s"] + own


def step_time(design: Design, batch: int, heads: int, gpu_name: str, copy_bandwidth: float | None = None,
              **overrides) -> dict:
    """The modelled time of one step of ``batch`` lanes on ``gpu_name``: ``seconds``, ``ctas`` (the
    grid), ``per_sm`` (CTAs or slabs the busiest SM runs), ``split`` and ``loaded_latency_s`` (a
    round trip's latency with the DRAM queueing the model predicts)."""
    if batch < 1 or heads < 1:
        raise ValueError(f"batch and heads must be >= 1, got {batch}, {heads}")
    if gpu_name not in GPUS or (copy_bandwidth is not None and copy_bandwidth <= 0):
        raise ValueError(f"gpu_name must be one of {sorted(GPUS)} and copy_bandwidth positive, got {gpu_name!r}, "
                         f"{copy_bandwidth}")
    gpu, inp = GPUS[gpu_name], _inputs(overrides)
    bw = COPY_BANDWIDTH[gpu_name][0] if copy_bandwidth is None else copy_bandwidth
    slabs = batch * heads
    if design.split_facts and not design.fixed_split:
        options = [1] + [f[0] for f in design.split_facts if slabs * f[0] <= 2 * gpu.sms]
        return min((step_time(dataclasses.replace(design, fixed_split=k), batch, heads, gpu_name, copy_bandwidth,
                              **overrides) for k in options), key=lambda r: r["seconds"])
    split = _split_factor(design, slabs, gpu.sms)
    ctas = slabs * split if not design.stages else min(slabs, gpu.sms * design.ctas_per_sm)
    active = min(gpu.sms, ctas)
    share = min(bw / active, inp["sm_port_bytes_per_s"])
    per_sm = -(-slabs // active) if design.stages else -(-ctas // active)
    if design.stages:  # persistent CTAs: each stage of each resident CTA is a customer
        fraction = design.stage_bytes / design.bytes_per_slab
        customers = min(design.stages * min(design.ctas_per_sm, per_sm), -(-per_sm // fraction))
        queues, delay = _cta_demands(design, gpu, share, fraction, fraction, inp, 1)
        rate, cycle, trips = *mean_value_analysis(int(customers), queues, delay), 1
        seconds = per_sm / fraction / rate + (design.trips - 1) * inp["idle_latency_s"]
    else:
        # a split CTA issues its share of the slab's instructions plus the part that does not divide; its
        # replicated per-lane inputs are L2 hits, so its DRAM bytes divide exactly
        fraction = (1 - inp["split_fixed_fraction"]) / split + inp["split_fixed_fraction"]
        trips, resident, barrier = design.trips, design.ctas_per_sm, 0.0
        built = {f[0]: f[1:] for f in design.split_facts}
        if split in built:
            (fraction, trips, resident), barrier = built[split], inp["cluster_barrier_s"]
        queues, delay = _cta_demands(design, gpu, share, fraction, 1 / split, inp, trips)
        delay += barrier
        rate, cycle = mean_value_analysis(min(resident, per_sm), queues, delay)
        seconds = per_sm / rate
    loaded = inp["idle_latency_s"] + (cycle - delay - queues[0]) / max(trips, 1)
    if design.programmatic:
        seconds -= inp["programmatic_hidden_trips"] * inp["idle_latency_s"]
    return {"seconds": seconds + (0.0 if design.programmatic else inp["launch_s"]), "ctas": ctas, "per_sm": per_sm,
            "split": split,
            "loaded_latency_s": loaded, "cta_seconds": cycle}


def average_bytes_in_flight(trip_bytes: list[float], ctas_per_sm: int, latency_s: float, cta_seconds: float) -> float:
    """Little's law read the other way, per SM: ``ctas_per_sm`` CTAs, each keeping ``trip_bytes[i]`` in
    flight for one ``latency_s`` per round trip of a life of ``cta_seconds``, keep on average
    ``ctas_per_sm x sum(trip_bytes) x latency_s / cta_seconds`` bytes in flight (their peak lasts one trip)."""
    if cta_seconds <= 0:
        raise ValueError(f"cta_seconds must be positive, got {cta_seconds}")
    return ctas_per_sm * sum(trip_bytes) * latency_s / cta_seconds


def percent_of_copy(design: Design, batch: int, heads: int, gpu_name: str, compulsory_bytes: float,
                    copy_bandwidth: float | None = None, **overrides) -> dict:
    """:func:`step_time` with ``percent``: ``compulsory_bytes / seconds`` as a percentage of the copy bandwidth."""
    bw = COPY_BANDWIDTH[gpu_name][0] if copy_bandwidth is None else copy_bandwidth
    t = step_time(design, batch, heads, gpu_name, bw, **overrides)
    return t | {"percent": 100 * compulsory_bytes / t["seconds"] / bw}


def flagship_designs(spec, warp_instructions: float, bytes_per_slab: float, state_read_bytes: float,
                     trips_today: int = FLAGSHIP_TRIPS, ctas_today: int = 3,
                     async_copy: tuple[int, int] | None = None,
                     slab_pipeline: tuple[int, int] | None = None, split: tuple = (),
                     programmatic: bool = False) -> dict[str, Design]:
    """Today's kernel and the three candidate designs for one state format: ``"today"`` (``trips_today``
    round trips), ``"one round trip"`` (the index, then every other load), ``"small-batch path"``
    (one round trip, D split over up to 4 CTAs while B x H < 2 x SMs) and ``"pipeline"`` (persistent
    CTAs, :data:`ASSUMPTIONS`' stages and resident CTAs, a stage = half a slab's state read), and with
    ``async_copy`` (its round trips and CTAs per SM, :data:`ASYNC_LATENCY_FACTS`) ``"asynchronous state
    copy"``, the kernel ``StepSpec.async_state_copy`` compiles, and with ``slab_pipeline`` (its round trips a slab
    waits on and CTAs per SM, :data:`PIPELINE_LATENCY_FACTS`) ``"slab pipeline"``, the kernel
    ``StepSpec.pipeline_ctas`` compiles: persistent CTAs, ``slab_pipeline.pipeline_stages`` stages of a whole slab
    each (the slab being updated and the next ones in flight), each a customer of the network with one round trip, after a prologue of
    two (the index, the first slab); with ``split`` (:attr:`Design.split_facts` of the kernel ``update_kv_state`` with
    ``tile_D < headdim`` compiles, a cluster per (lane, head)) ``"D split (cluster)"``: today's kernel from 2 x SMs
    slabs up, below that the D split the small-batch path's rule picks; with ``programmatic`` today's kernel and that
    split launched with programmatic dependent launch (``StepSpec.programmatic_launch``: the same CTAs, round trips
    and instructions, the launch gap and ``programmatic_hidden_trips`` hidden), and so the slab pipeline. The
    instructions are today's per slab for
    every design, and the register designs keep today's ``ctas_today`` resident CTAs (assumptions: the
    same arithmetic, the same registers)."""
    common = dict(warp_instructions=warp_instructions, bytes_per_slab=bytes_per_slab, warps=spec.num_warps)
    pipeline = dict(common)
    common["ctas_per_sm"] = ctas_today
    designs = {
        "today": Design("today", trips_today, **common),
        "one round trip": Design("one round trip", 2, **common),
        "small-batch path": Design("small-batch path", 2, split=True, **common),
        "pipeline": Design("pipeline", 2, ctas_per_sm=int(assumption("pipeline_ctas_per_sm")),
                           stages=int(assumption("pipeline_stages")), stage_bytes=state_read_bytes / 2, **pipeline),
    }
    if async_copy is not None:
        designs["asynchronous state copy"] = Design("asynchronous state copy", async_copy[0], ctas_per_sm=async_copy[1],
                                                    **pipeline)
    if split:
        designs["D split (cluster)"] = Design("D split (cluster)", trips_today, split=True, split_facts=tuple(split),
                                              **common)
    if programmatic:
        designs["today, programmatic launch"] = Design("today, programmatic launch", trips_today, programmatic=True,
                                                       **common)
        if split:
            designs["D split, programmatic launch"] = dataclasses.replace(designs["D split (cluster)"],
                                                                          name="D split, programmatic launch",
                                                                          programmatic=True)
    if slab_pipeline is not None:
        designs["slab pipeline"] = Design("slab pipeline", 1 + slab_pipeline[0], ctas_per_sm=slab_pipeline[1],
                                          stages=pipeline_stages(spec), stage_bytes=bytes_per_slab, **pipeline)
        if programmatic:
            designs["slab pipeline, programmatic launch"] = dataclasses.replace(
                designs["slab pipeline"], name="slab pipeline, programmatic launch", programmatic=True)
    return designs
