"""The ``precompile`` subcommand: fill the disk cache ahead of time (server start-up, image build).

``python -m mamba3_step precompile [spec flags] [--cache-dir DIR] [--list] [--json]``; the spec
flags are the shared ones of :mod:`mamba3_step.specsets` (default: the flagship as servers run
it). Exit status 1 if any specialisation failed or could not be saved to the cache (the others
are still done; the reason is printed), 2 for bad flags (an empty ``--cache-dir``, an unknown
``--arch`` included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from ..specsets import add_spec_arguments, parse_spec_args, spec_label
from ..compile_cache.front import CompileCacheWarning, precompile, stats
from ..compile_cache.key import ENV_CACHE_DIR, cache_dir

__all__ = ["HELP", "add_arguments", "run"]

HELP = "fill the ahead-of-time kernel cache"
_OUTCOMES = ("compiled", "rebuilt", "compiled-in-memory", "loaded", "memory", "failed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Compile step-kernel specialisations into the disk cache ahead of time (server "
                     "start-up, image build) and report, per specialisation, whether it was compiled "
                     "or loaded and how long it took.")
    add_spec_arguments(p)
    p.add_argument("--cache-dir", default=None, help=f"cache directory (default: ${ENV_CACHE_DIR}, "
                   "else $XDG_CACHE_HOME/mamba3_step, else ~/.cache/mamba3_step)")
    p.add_argument("--list", action="store_true", help="print the specialisations, compile nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.cache_dir is not None and not args.cache_dir.strip():
        parser.error("--cache-dir: expected a directory path, got an empty string (leave the flag out "
                     f"for the default: ${ENV_CACHE_DIR}, else $XDG_CACHE_HOME/mamba3_step, else ~/.cache/mamba3_step)")
    specs, arch = parse_spec_args(args, parser)
    if args.cache_dir is not None:
        os.environ[ENV_CACHE_DIR] = args.cache_dir
    if args.list:
        if args.json:
            print(json.dumps({"arch": arch, "count": len(specs),
                              "specs": [{"spec": s.key(), "label": spec_label(s)} for s in specs]}))
        else:
            for s in specs:
                print(spec_label(s))
            print(f"{len(specs)} specialisation(s) for {arch}")
        return 0
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileCacheWarning)
        results = precompile(specs, arch)
    total = time.perf_counter() - t0
    why = [str(w.message) for w in caught if issubclass(w.category, CompileCacheWarning)]
    n = {how: sum(r["how"] == how for r in results) for how in _OUTCOMES}
    unsaved = n["compiled-in-memory"]
    if args.json:
        print(json.dumps({"arch": arch, "cache_dir": str(cache_dir()), "total_seconds": round(total, 4),
                          "results": results, "summary": n, "counters": stats(), "failed": n["failed"],
                          "unsaved": unsaved, "warnings": why}))
    else:
        _print_table(results, arch, total, n)
    for message in why:
        print(f"warning: {message}", file=sys.stderr)
    if unsaved:
        print(f"precompile: {unsaved} specialisation(s) compiled but not saved to the cache {cache_dir()} "
              f"(see the warning above); a later process would compile them again", file=sys.stderr)
    return 1 if n["failed"] or unsaved else 0


def _print_table(results: list, arch: str, total: float, n: dict) -> None:
    width = max(len(r["label"]) for r in results)
    print(f"{'specialisation':<{width}}  {'result':<18} {'seconds':>8}")
    for r in results:
        secs = f"{r['seconds']:8.3f}" if r["seconds"] is not None else f"{'-':>8}"
        print(f"{r['label']:<{width}}  {r['how']:<18} {secs}")
        if r["error"]:
            print(f"    error: {r['error']}")
    print(f"{len(results)} specialisation(s) for {arch} in {total:.2f} s: "
          f"{n['compiled'] + n['compiled-in-memory']} compiled, {n['loaded']} loaded, "
          f"{n['rebuilt']} rebuilt, {n['memory']} already in memory, {n['failed']} failed; "
          f"cache {cache_dir()}")
