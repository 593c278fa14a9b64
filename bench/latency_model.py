"""The latency model of the flagship step (modelled, no GPU): bytes in flight, round trips, time per step.

    python bench/latency_model.py [--measured gpu_bench.json] [--json] [--no-compile] [--latency-us 0.6]
                                  [--launch-us 1.0] [--out DIR]

Prints (``mamba3_step.tools.latency_model``; every figure *modelled* unless its column says measured):

1. Little's law per GPU: the bytes in flight per SM the copy bandwidth needs at a loaded latency;
2. read from the flagship's SASS (sm_90a, sm_100a; compiled here unless ``--no-compile``): its
   dependent global round trips, the loads of each, and the bytes a CTA has in flight before its
   first wait x resident CTAs, against (1);
3. the model against a measured table (``--measured``: a ``bench/gpu_bench.py`` JSON, pool mode,
   CUDA-graph replay) on the H200, side by side;
4. the candidate designs (today, one round trip, small-batch path, the D split over a cluster the kernel
   compiles, pipeline, the asynchronous state copy, the slab pipeline) for the fp32 flagship, a bf16 state
   rounded to nearest and stochastically, replay F = 2 and 4, and the T = 4 verify step (on the register kernel
   and the slab pipeline) and replay's verify step at F = 2 and 4: modelled % of the copy bandwidth at
   B = 1 .. 512 on the H200, issuing the SASS warp-instructions a slab issues
   (``mamba3_step.tools.issue_model.ISSUED_SASS``, read from the cubins).

Writes ``latency_model.json`` to the output folder (default ``bench/results``); ``--json`` prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

from mamba3_step.tools import latency_model as lm  # noqa: E402
from mamba3_step.tools.bytes_model import bytes_per_step, replay_bytes  # noqa: E402
from mamba3_step.tools.issue_model import (GPUS, ISSUED_SASS, REPLAY_EXECUTED, STATE_FORMS_EXECUTED,  # noqa: E402
                                           VERIFY_EXECUTED, VERIFY_TOKENS, issue_model, verify_spec)
from mamba3_step.spec import flagship_spec  # noqa: E402
from mamba3_step.slab_pipeline import PIPELINE_DEFAULT_CTAS  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 64, 256, 512)
HEADS = 48
#: the stepwise verify step's form (issue_model.verify_spec)
VERIFY_FORM = f"fp32 verify T = {VERIFY_TOKENS}"


def sass_rows(overrides: dict) -> list[dict]:
    """The flagship's round trips and bytes in flight per SM, read from its SASS on both targets: the
    peak (resident CTAs x the largest trip after the index's) and the time average at B = 256 (each
    trip's bytes in flight for the assumed loaded latency, over the model's CTA life), against Little's
    law's need at the same latency on the target's GPUs."""
    from mamba3_step.tools.inspection import kernel_facts
    from mamba3_step.kernel import compile_step_kernel
    spec, rows = flagship_spec(), []
    total = bytes_per_step(spec, 256, HEADS)["total"]
    for arch, gpus in (("sm_90a", ("H100", "H200")), ("sm_100a", ("B200",))):
        f = kernel_facts(compile_step_kernel(spec, arch))
        trips = lm.global_round_trips(f.sass_text)
        ctas = f.occupancy()["ctas_per_sm"]
        per_cta = trips.bytes_before_first_wait(f.threads)
        row = {"arch": arch, "registers": f.registers, "ctas_per_sm": ctas, "round_trips": trips.round_trips,
               "dependence_depth": trips.dependence_depth, "loads_per_trip": [t["loads"] for t in trips.trips],
               "state_loads_per_trip": [t["by_width"].get(16, 0) for t in trips.trips],
               "bytes_in_flight_per_cta": per_cta, "peak_bytes_in_flight_per_sm": per_cta * ctas}
        for g in gpus:
            d = lm.flagship_designs(spec, REPLAY_EXECUTED["stepwise"], total / (256 * HEADS), 0,
                                    trips.round_trips)["today"]
            life = lm.step_time(d, 256, HEADS, g, **overrides)["cta_seconds"]
            row[f"average_bytes_in_flight_per_sm_{g}"] = lm.average_bytes_in_flight(
                [t["bytes_per_thread"] * f.threads for t in trips.trips], ctas, lm.assumption("loaded_latency_s"), life)
            row[f"needed_bytes_in_flight_per_sm_{g}"] = lm.bytes_in_flight_needed(g)["bytes_per_sm"]
        rows.append(row)
    return rows


#: the stepwise forms whose built variants (asynchronous state copy, slab pipeline, D split) the table models; the
#: verify step's: the slab pipeline
BUILT_VARIANTS = {"fp32": ("async", "pipeline", "split"), "bf16, round to nearest": ("async", "pipeline", "split"),
                  "bf16, stochastic rounding": ("async", "pipeline", "split"), VERIFY_FORM: ("pipeline",)}


def state_forms() -> dict:
    """name -> (spec, SASS warp-instructions a slab issues (``ISSUED_SASS``; a replay form: its executed PTX counts
    averaged over the ring positions, a replay verify step's in the steady state of every draft accepted, x the fp32
    register kernel's SASS / PTX ratio, since its SASS has a branch per position), replay K or None, the spec whose
    kernel today's design is). A verify form's spec is the T = 4 verify step (``issue_model.verify_spec``)."""
    fp32, bf16 = flagship_spec(), flagship_spec(state_dtype="bfloat16")
    sr = flagship_spec(state_dtype="bfloat16", stochastic_rounding=True)
    forms = {form: (spec, ISSUED_SASS[form]["registers"], None, spec)
             for form, spec in (("fp32", fp32), ("bf16, round to nearest", bf16), ("bf16, stochastic rounding", sr))}
    fused = ISSUED_SASS["fp32"]["registers"] / STATE_FORMS_EXECUTED["fp32"][0]
    for K in (2, 4):
        counts = REPLAY_EXECUTED[(K, False)][1]
        forms[f"fp32 replay F = {K}"] = (fp32, sum(counts) / K * fused, K, flagship_spec(replay_ring=K))
    verify = verify_spec()
    forms[VERIFY_FORM] = (verify, ISSUED_SASS[VERIFY_FORM]["registers"], None, verify)
    for K in (2, 4):
        counts = VERIFY_EXECUTED[K]
        forms[f"fp32 replay verify F = {K}, T = {VERIFY_TOKENS}"] = (
            verify, sum(counts.values()) / len(counts) * fused, K,
            flagship_spec(replay_ring=K, tokens=VERIFY_TOKENS, num_accepted=True))
    return forms


def kernel_latency_facts(compile_kernels: bool) -> dict:
    """form -> (round trips, CTAs per SM) of today's kernel on sm_90a, and ``(form, "async")`` -> those of the
    asynchronous state copy for the stepwise forms: read from the SASS when ``compile_kernels``, else
    ``mamba3_step.tools.latency_model.KERNEL_LATENCY_FACTS`` and ``ASYNC_LATENCY_FACTS``."""
    if not compile_kernels:
        return {**lm.KERNEL_LATENCY_FACTS, **{(form, "async"): v for form, v in lm.ASYNC_LATENCY_FACTS["sm_90a"].items()},
                **{(form, "pipeline"): v for form, v in lm.PIPELINE_LATENCY_FACTS["sm_90a"].items()},
                (VERIFY_FORM, "pipeline"): lm.VERIFY_PIPELINE_LATENCY_FACTS["sm_90a"],
                **{(form, "split", k): v for form, by in lm.SPLIT_LATENCY_FACTS["sm_90a"].items() for k, v in by.items()}}
    from mamba3_step.tools.inspection import kernel_facts
    from mamba3_step.kernel import compile_step_kernel
    facts = {}
    for form, (_, _, K, kernel_spec) in state_forms().items():
        built = BUILT_VARIANTS.get(form, ())
        variants = [(form, kernel_spec)]
        variants += [((form, "async"), kernel_spec.replace(async_state_copy=True))] if "async" in built else []
        variants += ([((form, "pipeline"), kernel_spec.replace(pipeline_ctas=PIPELINE_DEFAULT_CTAS))]
                     if "pipeline" in built else [])
        variants += [((form, "split", k), kernel_spec.replace(tile_D=kernel_spec.headdim // k))
                     for k in (2, 4) if "split" in built]
        for key, spec in variants:
            f = kernel_facts(compile_step_kernel(spec, "sm_90a"))
            trips = lm.global_round_trips(f.sass_text).round_trips
            # the slab pipeline: the trips a slab waits on are the live path's after its prologue's
            facts[key] = (trips - lm.PIPELINE_PROLOGUE_TRIPS if key[1:] == ("pipeline",) else trips,
                          f.occupancy()["ctas_per_sm"])
    return facts


def _bytes(spec, K, batch):
    return (replay_bytes(spec, K, batch, HEADS) if K else bytes_per_step(spec, batch, HEADS))["total"]


def design_rows(gpu: str, facts: dict, copy_bw: float | None, overrides: dict) -> list[dict]:
    rows = []
    for form, (spec, warp_instr, K, _) in state_forms().items():
        state_read = spec.headdim * spec.dstate * {"float32": 4}.get(spec.state_dtype, 2)
        path_trips, ctas = facts[form]
        # a replay kernel's live path falls through every ring position's branches: an upper bound; one
        # position's path is modelled with the round trips of the stepwise kernel that loads as it does (loads
        # unpinned, the epilogue late; for a verify step, the stepwise verify step's) and the replay kernel's CTAs
        trips = (facts[VERIFY_FORM][0] if spec.tokens > 1 else lm.LATE_EPILOGUE_LATENCY_FACTS["sm_90a"]["fp32"][0]) \
            if K else path_trips
        copied, piped = facts.get((form, "async")), facts.get((form, "pipeline"))
        # the built D split: (split, one CTA's share of the slab's instructions, its round trips, CTAs per SM)
        split = tuple((k, ISSUED_SASS[form][k] / warp_instr, *facts[(form, "split", k)]) for k in (2, 4)
                      if (form, "split", k) in facts)
        programmatic = not K and spec.tokens == 1  # programmatic launch: modelled for the one-token step
        names = (("today", "one round trip", "small-batch path") + (("D split (cluster)",) if split else ())
                 + (("today, programmatic launch",) if programmatic else ())
                 + (("D split, programmatic launch",) if split else ())
                 + ("pipeline",) + (("asynchronous state copy",) if copied else ())
                 + (("slab pipeline",) if piped else ())
                 + (("slab pipeline, programmatic launch",) if piped and programmatic else ()))
        for name in names:
            kernel = name.split(", programmatic launch")[0]  # launched programmatically: the same kernel's facts
            row = {"state": form, "design": name,
                   "SASS path trips": {"asynchronous state copy": copied and copied[0],
                                       "slab pipeline": piped and piped[0]}.get(kernel, path_trips),
                   "trips": {"today": trips, "asynchronous state copy": copied and copied[0],
                             "slab pipeline": piped and piped[0]}.get(kernel, 2),
                   "CTAs/SM": {"pipeline": int(lm.assumption("pipeline_ctas_per_sm")),
                               "asynchronous state copy": copied and copied[1],
                               "slab pipeline": piped and piped[1]}.get(kernel, ctas)}
            for batch in BATCHES:
                total = _bytes(spec, K, batch)
                instr = {"asynchronous state copy": ISSUED_SASS.get(form, {}).get("async"),
                         "slab pipeline": ISSUED_SASS.get(form, {}).get("pipeline")}.get(kernel) or warp_instr
                d = lm.flagship_designs(spec, instr, total / (batch * HEADS), state_read, trips, ctas,
                                        async_copy=copied, slab_pipeline=piped, split=split, programmatic=programmatic)[name]
                r = lm.percent_of_copy(d, batch, HEADS, gpu, total, copy_bw, **overrides)
                row[f"B{batch}"] = r["percent"]
                row[f"us_B{batch}"] = r["seconds"] * 1e6
            bw = lm.COPY_BANDWIDTH[gpu][0] if copy_bw is None else copy_bw
            issue = issue_model(instr, _bytes(spec, K, 256) / (256 * HEADS), GPUS[gpu])
            row["issue/memory"] = issue["ratio"] * bw / GPUS[gpu].hbm_bytes_per_s  # memory time at copy speed
            row["SASS/slab"] = instr
            rows.append(row)
    return rows


#: a gpu_bench step-suite mode -> (the kernel, its design in the model). Pool mode is the default register kernel,
#: which :func:`pool_kernel` names by the fields its run's spec has; each register kernel is today's design at its
#: own round trips and CTAs (:data:`REGISTER_FACTS`)
MEASURED_KERNELS = {"pool": ("pinned", "today"), "pool_async_copy": ("async", "asynchronous state copy"),
                    "pool_pipeline": ("pipeline", "slab pipeline"),
                    "pool_unpinned_loads": ("unpinned", "today"), "pool_early_epilogue": ("unpinned", "today"),
                    "pool_late_epilogue": ("late epilogue", "today")}
#: a register kernel other than the default -> its ``(round trips, CTAs per SM)`` per form (sm_90a)
REGISTER_FACTS = {"unpinned": lm.UNPINNED_LATENCY_FACTS["sm_90a"], "late epilogue": lm.LATE_EPILOGUE_LATENCY_FACTS["sm_90a"]}
#: a kernel whose own stalls Nsight Compute did not measure -> the kernel whose it takes (the same code less
#: one barrier)
STALLS_OF = {"unpinned": "late epilogue"}


def pool_kernel(spec: dict) -> str:
    """Which register kernel pool mode ran, by the StepSpec fields of its run (a field a run's spec lacks did
    not exist yet): ``unpinned_loads`` the pinned loads, else ``late_epilogue`` the early epilogue unpinned,
    else the late epilogue."""
    return "pinned" if "unpinned_loads" in spec else "unpinned" if "late_epilogue" in spec else "late epilogue"
#: a state dtype of the step suite -> its form here
DTYPE_FORMS = {"float32": "fp32", "bfloat16": "bf16, round to nearest"}


def measured_rows(path: str, facts: dict, overrides: dict) -> tuple[list[dict], float]:
    """The measured CUDA-graph rows of a ``bench/gpu_bench.py`` JSON (suite step: pool mode, and the
    asynchronous state copy and the other epilogue layout when they ran) beside the model at its copy
    bandwidth: with the assumed
    ``extra_cycles_per_instruction`` and with the stalls Nsight Compute measured
    (``latency_model.MEASURED_OWN_STALLS``, where measured for the form)."""
    try:
        with open(path) as f:
            data = json.load(f)
        result = data["suites"]["step"] if "suites" in data else data
        copy_bw = float(result["copy_bandwidth_bytes_per_s"])
        dtype = result.get("spec", {}).get("state_dtype", "float32")
        pool = pool_kernel(result.get("spec", {}))
        form = DTYPE_FORMS[dtype]
        table = result["table"]
    except OSError as e:
        raise ValueError(f"--measured: no such file or unreadable: {path} ({e})") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--measured: expected a bench/gpu_bench.py JSON of suite step with a float32 or bfloat16 "
                         f"state, got {path} ({type(e).__name__}: {e})") from None
    spec = flagship_spec(state_dtype=dtype)
    state_read = spec.headdim * spec.dstate * (4 if dtype == "float32" else 2)
    trips, ctas = facts[form]
    rows = []
    for entry in table:
        mode = entry.get("mode", "")
        kernel, design = MEASURED_KERNELS.get("pool_pipeline" if mode.startswith("pool_pipeline") else mode, (None, None))
        if kernel is None or "us_graph" not in entry:
            continue
        if entry["mode"] == "pool":
            kernel = pool
        batch, total = int(entry["batch"]), bytes_per_step(spec, int(entry["batch"]), HEADS)["total"]
        # the unpinned and late layouts issue the pinned kernel's arithmetic in another order: its count
        issued = ISSUED_SASS[form]["pipeline" if kernel == "pipeline" else "async" if kernel == "async" else "registers"]
        trips_k, ctas_k = REGISTER_FACTS[kernel][form] if kernel in REGISTER_FACTS else (trips, ctas)
        d = lm.flagship_designs(spec, issued, total / (batch * HEADS), state_read, trips_k, ctas_k,
                                async_copy=facts.get((form, "async")), slab_pipeline=facts.get((form, "pipeline")))[design]
        m = lm.percent_of_copy(d, batch, HEADS, "H200", total, copy_bw, **overrides)
        row = {"state": form, "kernel": kernel, "B": batch, "modelled us": m["seconds"] * 1e6,
               "measured us": entry["us_graph"], "modelled % copy": m["percent"]}
        stalls = lm.MEASURED_OWN_STALLS.get((form, STALLS_OF.get(kernel, kernel)))
        if stalls is not None:
            row["modelled % copy, measured stalls"] = lm.percent_of_copy(
                d, batch, HEADS, "H200", total, copy_bw, **(overrides | {"extra_cycles_per_instruction": stalls}))["percent"]
        row |= {"measured % copy": 100 * total / (entry["us_graph"] * 1e-6) / copy_bw,
                "model / measured": m["seconds"] * 1e6 / entry["us_graph"],
                "loaded latency us": m["loaded_latency_s"] * 1e6}
        rows.append(row)
    return sorted(rows, key=lambda r: (r["kernel"], r["B"])), copy_bw


def _cols(keys, fmt=">.1f"):
    formats = {"state": "<", "design": "<", "kernel": "<", "B": ">d", "trips": ">d", "SASS path trips": ">d", "CTAs/SM": ">d", "SASS/slab": ">,.0f"}
    return [(k, k, formats.get(k, fmt)) for k in keys]


def report(args, overrides: dict) -> dict:
    little = [lm.bytes_in_flight_needed(g) | {"copy source": lm.COPY_BANDWIDTH[g][1]} for g in ("H100", "H200", "B200")]
    print("1. Little's law (modelled): bytes in flight per SM = copy bandwidth x loaded latency "
          f"({lm.assumption('loaded_latency_s') * 1e6:.1f} us, assumed) / SMs")
    print(_util.format_table([{"gpu": r["gpu"], "SMs": r["sms"], "copy GB/s": r["copy_bytes_per_s"] / 1e9,
                               "KiB per SM": r["bytes_per_sm"] / 1024} for r in little],
                             [("gpu", "gpu", "<"), ("SMs", "SMs", ">d"), ("copy GB/s", "copy GB/s", ">,.0f"),
                              ("KiB per SM", "KiB in flight per SM needed", ">.1f")]))
    sass = [] if args.no_compile else sass_rows(overrides)
    facts = kernel_latency_facts(not args.no_compile)
    stated = kernel_latency_facts(False)
    stale = [f for f in facts if facts[f] != stated.get(f)]
    if sass:
        print("\n2. read from the flagship's SASS (pool mode, update_kv_state): round trips of a live CTA and the "
              "bytes in flight per SM (time average: modelled at B = 256)")
        for r in sass:
            print(f"  {r['arch']}: {r['round_trips']} round trips (dependence depth {r['dependence_depth']}); loads "
                  f"per trip {r['loads_per_trip']}, 16-byte state loads {r['state_loads_per_trip']}; peak "
                  f"{r['ctas_per_sm']} CTAs x {r['bytes_in_flight_per_cta']:,} B = "
                  f"{r['peak_bytes_in_flight_per_sm'] / 1024:.0f} KiB per SM")
            for g in [k.rsplit("_", 1)[1] for k in r if k.startswith("needed_")]:
                print(f"      {g}: time-averaged {r[f'average_bytes_in_flight_per_sm_{g}'] / 1024:.1f} KiB per SM "
                      f"against {r[f'needed_bytes_in_flight_per_sm_{g}'] / 1024:.1f} KiB needed")
    if stale:
        print(f"  ! mamba3_step.tools.latency_model's stated facts differ from the SASS for {', '.join(map(str, stale))}: "
              f"{ {f: facts[f] for f in stale} }: update it")
    measured, copy_bw = ([], None) if not args.measured else measured_rows(args.measured, facts, overrides)
    if measured:
        print(f"\n3. flagship on the H200, modelled beside measured ({args.measured}; copy bandwidth "
              f"{copy_bw / 1e9:,.0f} GB/s, the model uses it too; 'measured stalls': the model with Nsight "
              "Compute's own-dependency stalls per instruction, latency_model.MEASURED_OWN_STALLS)")
        print(_util.format_table(measured, _cols(measured[0].keys(), ">.2f")))
    design_bw = copy_bw if args.gpu == "H200" else None
    designs = design_rows(args.gpu, facts, design_bw, overrides)
    print(f"\n4. the candidate designs on the {args.gpu}, modelled % of the copy bandwidth "
          f"({(design_bw or lm.COPY_BANDWIDTH[args.gpu][0]) / 1e9:,.0f} GB/s); us at B = 1; issue / memory time at "
          "B = 256 (the SASS warp-instructions a slab issues, issue_model.ISSUED_SASS)")
    keys = ["state", "design", "SASS path trips", "trips", "CTAs/SM"] + [f"B{b}" for b in BATCHES] + [
        "us_B1", "SASS/slab", "issue/memory"]
    print(_util.format_table(designs, _cols(keys)))
    print("\nassumed inputs: " + "; ".join(f"{k} = {overrides.get(k, v[0]):g}" for k, v in lm.ASSUMPTIONS.items()))
    return {"what": "modelled (no GPU); the 'measured' columns are read from --measured", "little": little,
            "sass": sass, "measured": measured, "designs": designs,
            "assumptions": {k: {"value": overrides.get(k, v[0]), "why": v[1]} for k, v in lm.ASSUMPTIONS.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", default=None, help="a bench/gpu_bench.py JSON of suite step to compare with (pool mode and the "
                   "asynchronous state copy, CUDA graph)")
    p.add_argument("--json", action="store_true", help="print the JSON too")
    p.add_argument("--no-compile", action="store_true",
                   help="no SASS: take the round trips and CTAs of latency_model.KERNEL_LATENCY_FACTS")
    p.add_argument("--latency-us", type=float, default=None, help="idle DRAM latency (default assumed)")
    p.add_argument("--launch-us", type=float, default=None, help="launch gap under a CUDA graph (default assumed)")
    p.add_argument("--gpu", default="H200", choices=sorted(GPUS), help="the GPU of the designs' table (default H200)")
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    args = p.parse_args(argv)
    overrides = {k: v * 1e-6 for k, v in (("idle_latency_s", args.latency_us), ("launch_s", args.launch_us))
                 if v is not None}
    try:
        payload = report(args, overrides)
    except ValueError as e:
        p.error(str(e))
    path = _util.write_json(_util.results_dir(args.out) / "latency_model.json", payload)
    if args.json:
        print(json.dumps(payload, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
