"""``inspect``: compile one or more specialisations (no GPU needed) and report what the compiler
made of them, with the bytes one decode step moves.

``python -m mamba3_step inspect [spec flags] [--batch B] [--heads H] [--json] [--sass] [--executed]``; the
spec flags are the shared ones of :mod:`mamba3_step.specsets` (default: the flagship as servers
run it, pool mode with update_kv_state). ``--json`` prints exactly one JSON document: an object
for one specialisation, a list for several.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ...arch import check_arch
from ...build import compile_kernel
from ..bytes_model import bytes_per_step, replay_bytes
from ...contract import MAX_GRID_X, MAX_GRID_Y
from ...spec import FLAGSHIP_HEADS
from ...specsets import add_spec_arguments, parse_spec_args
from ...tiling import early_epilogue, pinned_loads, thread_layout
from ..latency_model import global_round_trips
from ..verify.step import executed_facts, format_facts
from .elf import InspectError
from .facts import KernelFacts, kernel_facts
from .occupancy import theoretical_occupancy
from .sass import MEMORY_OPS

__all__ = ["HELP", "add_arguments", "format_report", "inspect_spec", "run"]

HELP = "compile a specialisation and report what the compiler made of it"


def inspect_spec(spec, arch: str = "sm_90a", batch: int = 256, heads: int = 48,
                 compiled=None) -> tuple[dict, KernelFacts]:
    """Compile ``spec`` for ``arch`` and return (report dict, KernelFacts).

    ``compiled``: an already compiled kernel of ``spec`` for ``arch`` to read instead of
    compiling (``compile_seconds`` is then None).

    The report holds ``spec``, ``arch``, ``kernel``, ``registers``, ``stack_bytes``,
    ``spill_bytes`` (+ store/load split), ``smem_bytes`` (+ static/dynamic split),
    ``threads``, ``occupancy``, ``sass``, ``compile_seconds``, ``bytes_per_step`` (per
    tensor and ``total`` at ``batch`` lanes and ``heads`` heads, all lanes live; with replay the
    average over its ring positions; None for materialize's flush form) and ``batch``/``heads``.
    """
    check_arch(arch)
    compile_seconds = None
    if compiled is None:
        t0 = time.perf_counter()
        compiled = compile_kernel(spec, arch)
        compile_seconds = round(time.perf_counter() - t0, 3)
    facts = kernel_facts(compiled)
    trips = global_round_trips(facts.sass_text) if facts.sass_text else None
    expected_threads = thread_layout(spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype).num_threads
    threads = facts.threads if facts.threads is not None else expected_threads
    report = {
        "spec": spec.as_dict(),
        "arch": arch,
        "kernel": facts.name,
        "registers": facts.registers,
        "stack_bytes": facts.stack_bytes,
        "spill_bytes": facts.spill_bytes,
        "spill_store_bytes": facts.spill_store_bytes,
        "spill_load_bytes": facts.spill_load_bytes,
        "smem_bytes": facts.smem_bytes,
        "smem_static_bytes": facts.smem_static_bytes,
        "smem_dynamic_bytes": facts.smem_dynamic_bytes,
        "threads": threads,
        "threads_expected_from_tiling": expected_threads,
        "occupancy": theoretical_occupancy(facts.registers, threads, facts.smem_bytes, arch),
        "code_bytes": facts.code_bytes,
        # the register kernel's load layout (tiling.pinned_loads, tiling.early_epilogue) and the dependent global
        # round trips of a live CTA read from the SASS (latency_model.global_round_trips)
        "loads_pinned": pinned_loads(spec),
        "epilogue_loaded_early": early_epilogue(spec),
        "round_trips": None if trips is None else {
            "count": trips.round_trips, "dependence_depth": trips.dependence_depth,
            "loads_per_trip": [t["loads"] for t in trips.trips],
            "state_loads_per_trip": [t["by_width"].get(16, 0) for t in trips.trips]},
        "sass": facts.sass,
        "compile_seconds": compile_seconds,
        "batch": batch,
        "heads": heads,
        # a replay step's: averaged over its ring positions (bytes_model.replay_bytes); None for
        # materialize's flush form (F = 1), which is no decode step
        "bytes_per_step": (None if spec.replay_ring == 1 else
                           replay_bytes(spec.replace(replay_ring=0, replay_from_checkpoint=False, replay_draft=0),
                                        spec.replay_ring, batch, heads) if spec.replay_ring
                           else bytes_per_step(spec, batch, heads)),
    }
    return report, facts


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_report(report: dict) -> str:
    s = report["spec"]
    mode = "pool" if s["pool"] else "dense"
    flags = [k for k in ("has_dst", "dst_per_token", "num_accepted", "update_kv_state", "has_z", "has_outproj",
                         "has_state_out", "shared_bc", "stochastic_rounding", "replay_from_checkpoint",
                         "async_state_copy", "unpinned_loads", "late_epilogue", "programmatic_launch") if s.get(k)]
    for key in ("tokens", "rope_angles", "replay_ring", "replay_draft", "min_ctas_per_sm",
                "pipeline_ctas"):  # counts not at the default
        if s.get(key, 0) > (key == "tokens"):
            flags.insert(0, f"{key}={s[key]}")
    if s.get("update_kv_state") and not s.get("pipeline_ctas") and s["tile_D"] < s["headdim"]:
        flags.append(f"cluster={s['headdim'] // s['tile_D']}")  # tiling.launch_cluster: the D-tiles of a (lane, head)
    lines = [
        f"mamba3_step kernel for {report['arch']}: N={s['dstate']} D={s['headdim']} R={s['mimo']} "
        f"state={s['state_dtype']} kv={s['kv_dtype']} x={s['x_dtype']} proj={s['proj_dtype']} "
        f"tile_D={s['tile_D']} num_warps={s['num_warps']} mode={mode} {' '.join(flags)}",
        f"  kernel            {report['kernel']}",
        "  compile           "
        + ("(not compiled here)" if report["compile_seconds"] is None else f"{report['compile_seconds']:.2f} s"),
        f"  registers/thread  {report['registers']}",
        f"  stack frame       {report['stack_bytes']} B",
        f"  spills            {report['spill_bytes']} B "
        f"(stores {report['spill_store_bytes']} B, loads {report['spill_load_bytes']} B)",
        f"  shared mem/CTA    {report['smem_bytes']} B "
        f"(static {report['smem_static_bytes']} B, dynamic {report['smem_dynamic_bytes']} B)",
        f"  threads/CTA       {report['threads']}",
    ]
    occ = report["occupancy"]
    if occ:
        lines.append(
            f"  occupancy         {occ['ctas_per_sm']} CTAs = {occ['warps_per_sm']}/{occ['max_warps_per_sm']} "
            f"warps per SM ({100 * occ['occupancy']:.1f}%), limited by {occ['limiter']}"
        )
    else:
        lines.append("  occupancy         (no limits table for this arch)")
    trips = report.get("round_trips")
    if trips:
        layout = ", ".join(w for w, on in (("loads pinned", report["loads_pinned"]),
                                            ("epilogue loaded early", report["epilogue_loaded_early"])) if on)
        lines.append(f"  round trips       {trips['count']} dependent (depth {trips['dependence_depth']}); loads per "
                     f"trip {trips['loads_per_trip']}, 16-byte loads {trips['state_loads_per_trip']}"
                     + (f"; {layout}" if layout else ""))
    lines.append(f"  code              {report['code_bytes']} B, {report['sass'].get('total', 0)} instructions "
                 f"(+{report['sass'].get('NOP', 0)} NOP padding)")
    lines.append("  SASS histogram (static counts; '@P' = predicated):")
    mem = {k: v for k, v in report["sass"].items() if k.split(" ")[-1].split(".")[0] in MEMORY_OPS}
    other = {k: v for k, v in report["sass"].items() if k not in mem and k not in ("total", "NOP")}
    for title, group in (("memory", mem), ("other", other)):
        items = sorted(group.items(), key=lambda kv: (-kv[1], kv[0]))
        row = []
        for k, v in items:
            row.append(f"{k}={v}")
        for i in range(0, len(row), 6):
            lines.append(f"    {title + ':' if i == 0 else '':<8}" + "  ".join(row[i : i + 6]))
    bps = report["bytes_per_step"]
    if bps is None:
        lines.append("  bytes per step    not modelled: materialize's flush form (F = 1), not a decode step")
        return "\n".join(lines)
    average = " averaged over ring positions" if s.get("replay_ring") else ""
    lines.append(f"  bytes per step    B={report['batch']} H={report['heads']} (all lanes live, modelled{average}):")
    for k, v in bps.items():
        if k != "total" and v:
            lines.append(f"    {k:<26}{v:>14,.0f}  {_fmt_bytes(v)}")
    lines.append(f"    {'total':<26}{bps['total']:>14,.0f}  {_fmt_bytes(bps['total'])}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Compile step-kernel specialisations (no GPU needed) and report registers, spills, "
                     "shared memory, threads, occupancy, a SASS histogram, compile time and the bytes one "
                     "decode step moves. Default: the flagship as servers run it (pool mode, update_kv_state).")
    add_spec_arguments(p)
    p.add_argument("--batch", type=int, default=256, help="B for the bytes-per-step figure (default 256)")
    p.add_argument("--heads", type=int, default=FLAGSHIP_HEADS,
                   help=f"H for the bytes-per-step figure (default {FLAGSHIP_HEADS})")
    p.add_argument("--json", action="store_true", help="print exactly one JSON document")
    p.add_argument("--sass", action="store_true", help="also print the SASS listing (text mode)")
    p.add_argument("--executed", action="store_true",
                   help="also execute the kernel's PTX on the CPU (B=4, H=2, all lanes live) and report "
                        "executed facts: warp-instructions per CTA by class, sectors per request, bank "
                        "conflicts, bytes vs the bytes model (docs/ptx-tier.md)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``inspect`` subcommand; exit status 2 on bad flags, 1 when the cubin cannot be read."""
    specs, arch = parse_spec_args(args, parser)
    for name, most in (("batch", MAX_GRID_X), ("heads", MAX_GRID_Y)):  # what one launch can have
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
        if getattr(args, name) > most:
            parser.error(f"--{name} must be at most {most} (the launch grid's limit), got {getattr(args, name)}")
    reports = []
    for spec in specs:
        try:
            report, facts = inspect_spec(spec, arch, args.batch, args.heads)
        except InspectError as e:
            print(f"inspect: {e}", file=sys.stderr)
            return 1
        if args.executed:
            report["executed"] = executed_facts(spec, arch)
        reports.append(report)
        if not args.json:
            print(format_report(report))
            if args.executed:
                print(format_facts("executed", report["executed"]))
            if args.sass:
                print(facts.sass_text)
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, sort_keys=False))
    return 0
