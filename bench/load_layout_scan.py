"""The register kernel's load layouts across the covering and feature sets, compiled (no GPU): for each
stepwise specialisation of the register kernel, the default kernel beside its loads unpinned
(``StepSpec.unpinned_loads``): registers, spill and stack bytes, CTAs per SM and the dependent global round
trips of a live CTA read from the SASS (``latency_model.global_round_trips``). A row is flagged where the
default loses a CTA, spills, or makes more round trips. ``tiling.pinned_loads`` is the rule it checks.

``python bench/load_layout_scan.py [--arch sm_90a|sm_100a] [--json]`` (a few minutes a target on two cores:
two compiles a specialisation).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "kernel"), os.path.join(HERE, "..", "tests")]

from async_state_cases import ASYNC_DEFAULT, ASYNC_FULL  # noqa: E402  (the sets the kernel tests compile)
from test_kernel_compile import COVERING  # noqa: E402

from mamba3_step.kernel import compile_step_kernel  # noqa: E402
from mamba3_step.tiling import pinned_loads  # noqa: E402
from mamba3_step.tools import latency_model as lm  # noqa: E402
from mamba3_step.tools.inspection import kernel_facts  # noqa: E402


def facts(spec, arch: str) -> dict:
    f = kernel_facts(compile_step_kernel(spec, arch))
    return {"registers": f.registers, "spill_bytes": f.spill_bytes, "stack_bytes": f.stack_bytes,
            "ctas_per_sm": f.occupancy()["ctas_per_sm"], "round_trips": lm.global_round_trips(f.sass_text).round_trips}


def scan(arch: str) -> list[dict]:
    rows = []
    for name, spec in {**COVERING, **ASYNC_DEFAULT, **ASYNC_FULL}.items():
        spec = spec.with_default_tiling()
        if spec.replay_ring or spec.async_state_copy:
            continue
        default, unpinned = facts(spec, arch), facts(spec.replace(unpinned_loads=True), arch)
        worse = (default["ctas_per_sm"] < unpinned["ctas_per_sm"] or default["spill_bytes"] > 0
                 or default["round_trips"] > unpinned["round_trips"])
        rows.append({"name": name, "num_warps": spec.num_warps, "pinned": pinned_loads(spec), "default": default,
                     "unpinned": unpinned, "worse": worse})
        print(f"{name} (w={spec.num_warps}, {'pinned' if pinned_loads(spec) else 'not pinned'}): "
              f"default {default} unpinned {unpinned}{'  <-- WORSE' if worse else ''}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90a", choices=("sm_90a", "sm_100a"))
    p.add_argument("--json", action="store_true", help="print the rows as JSON at the end")
    args = p.parse_args(argv)
    rows = scan(args.arch)
    pinned = [r for r in rows if r["pinned"]]
    saved = sum(r["unpinned"]["round_trips"] - r["default"]["round_trips"] for r in pinned)
    deltas = [r["default"]["registers"] - r["unpinned"]["registers"] for r in pinned]
    print(f"{args.arch}: {len(pinned)} pinned of {len(rows)}; round trips saved {saved}; registers "
          f"{min(deltas):+d} to {max(deltas):+d}; worse: {[r['name'] for r in rows if r['worse']] or 'none'}")
    if args.json:
        print(json.dumps(rows))
    return 1 if any(r["worse"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
