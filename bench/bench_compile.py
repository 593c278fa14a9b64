"""Benchmark: cold compile vs warm load of the step kernel through the disk cache.

Prints, for the flagship specialisation (N=128, D=64, R=4, fp32 state, bf16 B/x/z/proj, pool
mode, update_kv_state, z, outproj), each figure measured in fresh Python processes:

* cold: ``import mamba3_step``, ``import`` of the kernel module (cutlass), the first
  ``compile_step_kernel`` of the process, a repeated compile (DSL already initialised: the
  steady per-configuration cost), and ``get_compiled`` on an empty cache (compile + export +
  link + load);
* warm: ``get_compiled`` in a fresh process with the cache filled (load only), and the time
  from ``import mamba3_step`` to a loaded flagship kernel;
* per configuration: warm loads of several specialisations in one fresh process.

Targets: warm load <= 50 ms per configuration and >= 20x faster than a cold compile.
``import mamba3_step`` imports torch and (since the compile cache's store imports it at module
level) tvm_ffi; the first load in a process still pays the first library load once.
Nothing is launched (no GPU needed): kernels are compiled for ``--arch`` and loaded.

Usage::

    python bench/bench_compile.py [--repeat 5] [--arch sm_90a] [--out bench/results/compile.json]

The cache lives in a temporary directory (the user's cache is not touched), and the package is
run from a snapshot copied there first, so edits to the working tree during the run cannot
change the kernel's source fingerprint half-way. Results are printed and written as JSON
(default ``bench/results/bench_compile.json``, git-ignored).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CONFIGS = ["flagship", "64,64,2", "128,128,4", "256,64,8"]  # for the per-configuration loads

COLD = r"""
import json, sys, time
t0 = time.perf_counter()
import mamba3_step
from mamba3_step import compile_cache as cc
t1 = time.perf_counter()
from mamba3_step import kernel
t2 = time.perf_counter()
spec, arch = mamba3_step.flagship_spec(), sys.argv[1]
kernel.compile_step_kernel(spec, arch)
t3 = time.perf_counter()
kernel.compile_step_kernel(spec, arch)
t4 = time.perf_counter()
fn, how, seconds, entry = cc.obtain(spec, arch)
t5 = time.perf_counter()
assert how == "compiled", how
print("RESULT " + json.dumps(dict(import_mamba3_step=t1 - t0, import_kernel_cutlass=t2 - t1,
      compile_first_in_process=t3 - t2, compile_repeat=t4 - t3, cold_get_compiled=t5 - t4,
      stats=cc.stats())))
"""

WARM = r"""
import json, sys, time
t0 = time.perf_counter()
import mamba3_step
from mamba3_step import compile_cache as cc
t1 = time.perf_counter()
fn, how, seconds, entry = cc.obtain(mamba3_step.flagship_spec(), sys.argv[1])
t2 = time.perf_counter()
assert how == "loaded" and cc.COUNTERS.compiles == 0, (how, cc.stats())
print("RESULT " + json.dumps(dict(import_mamba3_step=t1 - t0, warm_load=t2 - t1,
      import_to_loaded=t2 - t0, cutlass_imported="cutlass" in sys.modules, stats=cc.stats())))
"""

PER_CONFIG = r"""
import json, sys, time
import mamba3_step
from mamba3_step import compile_cache as cc
t = time.perf_counter()
import tvm_ffi  # already imported by mamba3_step (compile_cache.store): about 0 ms
tvm_ffi_import = time.perf_counter() - t
loads = []
for c in sys.argv[2:]:
    (spec,) = cc.specs_for_config(c)
    t = time.perf_counter()
    fn, how, seconds, entry = cc.obtain(spec, sys.argv[1])
    loads.append(dict(config=c, label=cc.spec_label(spec), how=how, seconds=time.perf_counter() - t))
assert cc.COUNTERS.compiles == 0, cc.stats()
print("RESULT " + json.dumps(dict(loads=loads, tvm_ffi_import=tvm_ffi_import)))
"""


SRC = REPO  # replaced by the snapshot in main()


def _env(cache: Path) -> dict:
    env = dict(os.environ, MAMBA3_STEP_CACHE_DIR=str(cache))
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(script: str, args: list, cache: Path) -> tuple[dict, float]:
    env = _env(cache)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=SRC, env=env,
                       capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"benchmark subprocess failed:\n{r.stderr[-3000:]}")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), wall


def med(xs):
    return statistics.median(xs)


def print_summary(arch: str, repeat: int, summary: dict, per: list[dict]) -> None:
    """The timings of ``summary`` and the per-configuration warm loads ``per``, as a text report."""
    ms = lambda s: f"{s * 1e3:9.1f} ms"  # noqa: E731
    print(f"mamba3_step compile cache, flagship, arch {arch}, median of {repeat} fresh processes")
    print(f"  import mamba3_step                             {ms(summary['import_mamba3_step_s'])}")
    print(f"  import kernel module (cutlass)                 {ms(summary['import_kernel_cutlass_s'])}")
    print(f"  cold compile, first in process                 {ms(summary['cold_compile_first_in_process_s'])}")
    print(f"  cold compile, DSL initialised                  {ms(summary['cold_compile_s'])}")
    print(f"  cold get_compiled (compile+export+link+load)   {ms(summary['cold_get_compiled_s'])}")
    print(f"  warm load (fresh process, disk cache)          {ms(summary['warm_load_s'])}"
          f"   (max {summary['warm_load_max_s'] * 1e3:.1f} ms; includes the first library load)")
    print(f"    import tvm_ffi after import mamba3_step      {ms(summary['tvm_ffi_import_s'])}")
    print(f"  import mamba3_step -> loaded flagship kernel   {ms(summary['import_to_loaded_s'])}")
    print(f"  whole warm process (python start to exit)      {ms(summary['warm_process_wall_s'])}")
    print(f"  speed-up warm load vs cold compile             {summary['speedup_vs_cold_compile']:9.0f} x"
          f"   (vs cold get_compiled {summary['speedup_vs_cold_get_compiled']:.0f} x)")
    print(f"  cutlass imported on a warm start               {summary['warm_imports_cutlass']}")
    print("  warm loads per configuration, one fresh process, in load order:")
    for row in per:
        print(f"    {row['label']:<62} {ms(row['median_s'])}  (max {row['max_s'] * 1e3:.1f} ms)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=5, help="fresh processes per measurement (median)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--out", default=str(RESULTS / "bench_compile.json"))
    a = p.parse_args(argv)

    global SRC
    tmp = Path(tempfile.mkdtemp(prefix="mamba3_step_bench_compile-"))
    try:
        SRC = tmp / "src"
        shutil.copytree(REPO / "mamba3_step", SRC / "mamba3_step",
                        ignore=shutil.ignore_patterns("__pycache__"))
        cold, cold_wall = [], []
        for i in range(a.repeat):
            res, wall = run(COLD, [a.arch], tmp / f"cold{i}")
            cold.append(res)
            cold_wall.append(wall)
        warm_cache = tmp / "cold0"
        warm, warm_wall = [], []
        for _ in range(a.repeat):
            res, wall = run(WARM, [a.arch], warm_cache)
            warm.append(res)
            warm_wall.append(wall)
        # per-configuration warm loads: fill once, then load all of them in fresh processes
        pre = subprocess.run([sys.executable, "-m", "mamba3_step", "precompile", "--arch", a.arch, "--json"]
                             + [x for c in CONFIGS for x in ("--config", c)], cwd=SRC,
                             env=_env(warm_cache), capture_output=True, text=True, timeout=600)
        if pre.returncode != 0:
            raise SystemExit(f"precompile failed:\n{pre.stderr[-3000:]}")
        per_runs = [run(PER_CONFIG, [a.arch, *CONFIGS], warm_cache)[0] for _ in range(a.repeat)]
        per_config = [r["loads"] for r in per_runs]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    summary = {
        "import_mamba3_step_s": med([r["import_mamba3_step"] for r in warm]),
        "import_kernel_cutlass_s": med([r["import_kernel_cutlass"] for r in cold]),
        "cold_compile_first_in_process_s": med([r["compile_first_in_process"] for r in cold]),
        "cold_compile_s": med([r["compile_repeat"] for r in cold]),
        "cold_get_compiled_s": med([r["cold_get_compiled"] for r in cold]),
        "cold_process_wall_s": med(cold_wall),
        "warm_load_s": med([r["warm_load"] for r in warm]),
        "warm_load_max_s": max(r["warm_load"] for r in warm),
        "import_to_loaded_s": med([r["import_to_loaded"] for r in warm]),
        "warm_process_wall_s": med(warm_wall),
        "warm_imports_cutlass": any(r["cutlass_imported"] for r in warm),
        "tvm_ffi_import_s": med([r["tvm_ffi_import"] for r in per_runs]),
    }
    summary["speedup_vs_cold_compile"] = summary["cold_compile_s"] / summary["warm_load_s"]
    summary["speedup_vs_cold_get_compiled"] = summary["cold_get_compiled_s"] / summary["warm_load_s"]
    loads = {}
    for rep in per_config:
        for i, row in enumerate(rep):
            loads.setdefault((i, row["label"]), []).append(row["seconds"])
    per = [{"order": i, "label": label, "median_s": med(v), "max_s": max(v)}
           for (i, label), v in sorted(loads.items())]

    print_summary(a.arch, a.repeat, summary, per)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "arch": a.arch, "repeat": a.repeat, "summary": summary, "per_config": per,
        "raw": {"cold": cold, "warm": warm, "per_config": per_config},
    }, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
