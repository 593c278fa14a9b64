"""``python -m mamba3_step precompile``: fill the disk cache ahead of time and report.

Names specialisations with ``--config flagship|all|N,D,R[,dtypes]`` and the mode flags
(:func:`specs_for_config`); default: the flagship as servers run it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Optional

from ..arch import DEFAULT_ARCH, check_arch, current_arch
from ..contract import KV_DTYPES, PROJ_DTYPES, STATE_DTYPES, SUPPORTED_D, SUPPORTED_N, SUPPORTED_R, X_DTYPES
from ..spec import StepSpec, flagship_spec
from ..tiling import shape_problem, tiling_problem
from .front import obtain, stats
from .key import ENV_CACHE_DIR, cache_dir

__all__ = ["cli_main", "precompile", "spec_label", "specs_for_config"]


_CONFIG_HELP = ("flagship | all | N,D,R[,state_dtype[,kv_dtype[,x_dtype[,proj_dtype]]]] "
                "(repeatable)")


def specs_for_config(config: str, **flags) -> list:
    """Specs named by one ``--config`` value; ``flags`` are StepSpec mode fields (pool, has_dst,
    update_kv_state, has_z, has_outproj, has_state_out) applied over the flagship's.

    ``all`` is the supported cross product N x D x R (4 x 3 x 4 = 48) with the flagship dtypes
    and the given flags, minus combinations whose default tiling is impossible.
    """
    if not isinstance(config, str):
        raise TypeError(f"config: expected a string ({_CONFIG_HELP}), got {type(config).__name__}")
    text = config.strip()
    if text == "flagship":
        return [flagship_spec(**flags)]
    if text == "all":
        out = []
        for n, d, r in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R):
            s = flagship_spec(dstate=n, headdim=d, mimo=r, **flags)
            if tiling_problem(s) is None:
                out.append(s)
        return out
    parts = [p.strip() for p in text.split(",")]
    if not 3 <= len(parts) <= 7:
        raise ValueError(f"config: expected {_CONFIG_HELP}, got {config!r}")
    try:
        n, d, r = (int(p) for p in parts[:3])
    except ValueError:
        raise ValueError(f"config: N,D,R must be integers ({_CONFIG_HELP}), got {config!r}") from None
    problem = shape_problem(n, d, r)
    if problem:
        raise ValueError(f"config {config!r}: {problem}")
    changes = dict(dstate=n, headdim=d, mimo=r)
    for field, allowed, value in zip(("state_dtype", "kv_dtype", "x_dtype", "proj_dtype"),
                                     (STATE_DTYPES, KV_DTYPES, X_DTYPES, PROJ_DTYPES), parts[3:]):
        if value not in allowed:
            raise ValueError(f"config {config!r}: {field} must be one of {allowed}, got {value!r}")
        changes[field] = value
    spec = flagship_spec(**changes, **flags)
    problem = tiling_problem(spec)
    if problem:
        raise ValueError(f"config {config!r}: {problem}")
    return [spec]


def spec_label(spec: StepSpec) -> str:
    """A short human-readable name: ``N128 D64 R4 float32/bfloat16/bfloat16/bfloat16 tD64 w8 pool+kv+z+outproj``."""
    flags = [n for n, on in (("pool", spec.pool), ("dst", spec.has_dst), ("kv", spec.update_kv_state),
                             ("z", spec.has_z), ("outproj", spec.has_outproj),
                             ("state_out", spec.has_state_out)) if on]
    return (f"N{spec.dstate} D{spec.headdim} R{spec.mimo} {spec.state_dtype}/{spec.kv_dtype}/"
            f"{spec.x_dtype}/{spec.proj_dtype} tD{spec.tile_D} w{spec.num_warps} "
            f"{'+'.join(flags) or 'dense'}")


def precompile(specs, arch: Optional[str] = None) -> list:
    """Fill the cache for ``specs``; one result dict per spec (``how``, ``seconds``, ``error``...)."""
    arch = check_arch(arch if arch is not None else current_arch())
    results = []
    for spec in specs:
        row = {"spec": spec.key(), "label": spec_label(spec), "arch": arch}
        try:
            _, how, seconds, entry = obtain(spec, arch)
            row.update(how=how, seconds=round(seconds, 4), entry=str(entry) if entry else None,
                       error=None)
        except Exception as e:  # report and go on with the other specs
            row.update(how="failed", seconds=None, entry=None, error=f"{type(e).__name__}: {e}")
        results.append(row)
    return results


def cli_main(argv: Optional[list] = None) -> int:
    """``python -m mamba3_step precompile [--arch sm_90a] [--config ...] [--json] ...``"""
    p = argparse.ArgumentParser(
        prog="python -m mamba3_step precompile",
        description="Compile step-kernel specialisations into the disk cache ahead of time (server "
                    "start-up, image build) and report, per specialisation, whether it was compiled "
                    "or loaded and how long it took.")
    p.add_argument("--arch", default=None,
                   help=f"target architecture, e.g. sm_90a, sm_100a (default: this machine's GPU, "
                        f"else {DEFAULT_ARCH})")
    p.add_argument("--config", action="append", default=None, metavar="CONFIG",
                   help=f"{_CONFIG_HELP}; default flagship. 'all' = the 48 supported N x D x R "
                        "combinations with the flagship dtypes and the given mode flags")
    p.add_argument("--mode", choices=("pool", "dense"), default="pool",
                   help="pool mode (state_batch_indices given; default) or dense mode")
    p.add_argument("--dst", action="store_true", help="pool mode with dst_state_batch_indices")
    p.add_argument("--no-update-kv-state", action="store_true", help="without update_kv_state")
    p.add_argument("--no-z", action="store_true", help="without the z gate")
    p.add_argument("--no-outproj", action="store_true", help="without outproj (out is (B, R, H, D))")
    p.add_argument("--state-out", action="store_true", help="dense mode with state_out")
    p.add_argument("--cache-dir", default=None, help=f"cache directory (default: ${ENV_CACHE_DIR}, "
                   "else $XDG_CACHE_HOME/mamba3_step, else ~/.cache/mamba3_step)")
    p.add_argument("--list", action="store_true", help="print the specialisations, compile nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = p.parse_args(argv)

    if a.dst and a.mode != "pool":
        p.error("--dst needs --mode pool")
    if a.state_out and a.mode != "dense":
        p.error("--state-out needs --mode dense")
    flags = dict(pool=a.mode == "pool", has_dst=a.dst, update_kv_state=not a.no_update_kv_state,
                 has_z=not a.no_z, has_outproj=not a.no_outproj, has_state_out=a.state_out)
    try:
        arch = check_arch(a.arch) if a.arch is not None else current_arch()
        specs = []
        for c in a.config or ["flagship"]:
            for s in specs_for_config(c, **flags):
                if s not in specs:
                    specs.append(s)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    if a.cache_dir is not None:
        os.environ[ENV_CACHE_DIR] = a.cache_dir

    if a.list:
        if a.json:
            print(json.dumps({"arch": arch, "count": len(specs),
                              "specs": [{"spec": s.key(), "label": spec_label(s)} for s in specs]}))
        else:
            for s in specs:
                print(spec_label(s))
            print(f"{len(specs)} specialisation(s) for {arch}")
        return 0

    t0 = time.perf_counter()
    results = precompile(specs, arch)
    total = time.perf_counter() - t0
    summary = {how: sum(r["how"] == how for r in results)
               for how in ("compiled", "rebuilt", "compiled-in-memory", "loaded", "memory", "failed")}
    failed = summary["failed"]
    if a.json:
        print(json.dumps({"arch": arch, "cache_dir": str(cache_dir()), "total_seconds": round(total, 4),
                          "results": results, "summary": summary, "counters": stats(),
                          "failed": failed}))
    else:
        width = max(len(r["label"]) for r in results)
        print(f"{'specialisation':<{width}}  {'result':<18} {'seconds':>8}")
        for r in results:
            secs = f"{r['seconds']:8.3f}" if r["seconds"] is not None else f"{'-':>8}"
            print(f"{r['label']:<{width}}  {r['how']:<18} {secs}")
            if r["error"]:
                print(f"    error: {r['error']}")
        n = summary
        print(f"{len(results)} specialisation(s) for {arch} in {total:.2f} s: "
              f"{n['compiled'] + n['compiled-in-memory']} compiled, {n['loaded']} loaded, "
              f"{n['rebuilt']} rebuilt, {n['memory']} already in memory, {failed} failed; "
              f"cache {cache_dir()}")
    return 1 if failed else 0
