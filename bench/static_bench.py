"""Static comparison (no GPU): what the compiler made of the step kernel across
configurations and modes -- registers, spills, shared memory, occupancy, SASS instruction
counts -- and pool mode's extra instructions over dense mode.

    python bench/static_bench.py [--arch sm_90a] [--out DIR] [--quick]

Compiles each specialisation with ``mamba3_step.kernel.compile_step_kernel`` (about 1-2 s
each), reads the cubin with ``mamba3_step.tools.inspection.kernel_facts``, prints a table and
writes ``static_bench.json`` to ``bench/results/`` (or ``--out``). These are compiler
facts (static instruction counts, not executed counts); nothing runs on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

from mamba3_step.spec import flagship_spec  # noqa: E402

#: (configuration name, spec changes common to its modes)
CONFIGS = [
    ("flagship N=128 D=64 R=4 fp32", {}),
    ("bf16 state N=128 D=64 R=4", {"state_dtype": "bfloat16"}),
    ("N=64 D=64 R=2 fp32", {"dstate": 64, "mimo": 2}),
    ("N=256 D=128 R=8 fp32", {"dstate": 256, "headdim": 128, "mimo": 8}),
    ("flagship, no z, no outproj", {"has_z": False, "has_outproj": False}),
]
#: (mode name, spec changes); "dense" first: the pool modes are compared with it
MODES = [
    ("dense", {"pool": False, "has_dst": False, "update_kv_state": False}),
    ("dense+kv", {"pool": False, "has_dst": False, "update_kv_state": True}),
    ("pool", {"pool": True, "has_dst": False, "update_kv_state": False}),
    ("pool+kv", {"pool": True, "has_dst": False, "update_kv_state": True}),
    ("pool+dst+kv", {"pool": True, "has_dst": True, "update_kv_state": True}),
]
#: the modes compiled per configuration (all modes for the flagship)
QUICK_MODES = ("dense", "pool+kv")


def plan(quick: bool = False) -> list[tuple[str, str, object]]:
    """(config name, mode name, StepSpec) to compile, flagship first."""
    out = []
    for i, (cname, changes) in enumerate(CONFIGS):
        for mname, mchanges in MODES:
            if (quick or i > 0) and mname not in QUICK_MODES:
                continue
            out.append((cname, mname, flagship_spec(**changes, **mchanges)))
    return out


def measure(specs, arch: str) -> list[dict]:
    """Compile each spec and collect its facts; a failure is recorded in ``error``."""
    from mamba3_step.tools.inspection import kernel_facts, theoretical_occupancy
    from mamba3_step.kernel import compile_step_kernel

    rows = []
    for cname, mname, spec in specs:
        row = {"config": cname, "mode": mname, "spec": spec.as_dict(), "arch": arch}
        try:
            t0 = time.perf_counter()
            compiled = compile_step_kernel(spec, arch=arch)
            row["compile_seconds"] = time.perf_counter() - t0
            f = kernel_facts(compiled)
        except Exception as e:  # keep going: the table shows which one failed
            row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            continue
        occ = theoretical_occupancy(f.registers, f.threads, f.smem_bytes, arch) if f.threads else None
        row.update(
            registers=f.registers, stack_bytes=f.stack_bytes, spill_bytes=f.spill_bytes,
            smem_bytes=f.smem_bytes, threads=f.threads,
            occupancy_pct=None if occ is None else 100 * occ["occupancy"],
            total=f.sass.get("total", 0),
            ldg128=f.count("LDG", 128), stg128=f.count("STG", 128),
            ldg_narrow=f.count("LDG") - f.count("LDG", 128),
            stg_narrow=f.count("STG") - f.count("STG", 128),
            pred_stg=f.count("STG", predicated=True),
            pred_ldg=f.count("LDG", predicated=True),
            ldgsts=f.count("LDGSTS"), shfl=f.count("SHFL"), bar=f.count("BAR"),
            sass=f.sass,
        )
        rows.append(row)
    add_pool_delta(rows)
    return rows


def add_pool_delta(rows: list[dict]) -> None:
    """``extra_vs_dense``: a row's total instructions minus its configuration's dense row's
    (dense+kv for modes with update_kv_state, so the delta is pool indexing alone)."""
    base = {(r["config"], r["mode"]): r.get("total") for r in rows}
    for r in rows:
        ref_mode = "dense+kv" if r["mode"].endswith("kv") and r["mode"] != "dense+kv" else "dense"
        ref = base.get((r["config"], ref_mode))
        if ref is None and ref_mode == "dense+kv":
            ref_mode, ref = "dense", base.get((r["config"], "dense"))
        if r.get("total") is None or ref is None or r["mode"] == ref_mode:
            r["extra_vs_dense"] = None
        else:
            r["extra_vs_dense"] = r["total"] - ref
            r["extra_vs"] = ref_mode


COLUMNS = [
    ("config", "configuration", "<"),
    ("mode", "mode", "<"),
    ("registers", "regs", ">d"),
    ("spill_bytes", "spill B", ">d"),
    ("stack_bytes", "stack B", ">d"),
    ("smem_bytes", "smem B", ">d"),
    ("threads", "thr", ">d"),
    ("occupancy_pct", "occ %", ">.1f"),
    ("total", "instr", ">d"),
    ("extra_vs_dense", "+vs dense", ">+d"),
    ("ldg128", "LDG.128", ">d"),
    ("stg128", "STG.128", ">d"),
    ("ldg_narrow", "LDG<128", ">d"),
    ("stg_narrow", "STG<128", ">d"),
    ("pred_stg", "@P STG", ">d"),
    ("ldgsts", "LDGSTS", ">d"),
    ("shfl", "SHFL", ">d"),
    ("compile_seconds", "compile s", ">.2f"),
]


def format_rows(rows: list[dict]) -> str:
    text = _util.format_table(rows, COLUMNS)
    errors = [f"  {r['config']} / {r['mode']}: {r['error']}" for r in rows if "error" in r]
    if errors:
        text += "\nfailed to compile or read:\n" + "\n".join(errors)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90a", help="target (default sm_90a)")
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--quick", action="store_true", help="dense and pool+kv only, for every configuration")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = measure(plan(args.quick), args.arch)
    print(f"static comparison for {args.arch} (compiler facts, static SASS counts; '+vs dense' = "
          "instructions over the same configuration's dense kernel, dense+kv for modes with kv)")
    print(format_rows(rows))
    out = _util.results_dir(args.out)
    payload = {"what": "compiler facts read from the cubins (static, not measured on a GPU)",
               "environment": _util.environment(), "arch": args.arch, "rows": rows}
    print(f"wrote {_util.write_json(out / 'static_bench.json', payload)} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
