"""Host overhead of one step: the time from the Python call to the kernel launch, on the CPU.

    python bench/bench_host.py [--batches 1,64,256] [--calls 4000] [--rounds 5] [--inference-mode]
                               [--out DIR] [--no-plot]

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.

What is timed is the real CUDA code path of ``mamba3_step_fn`` and of ``StepPlan.run`` up to and
including the call of the compiled kernel, with CPU tensors and without a GPU. Three things are
replaced, nothing else:

* the kernel: the compile cache gets a builder whose "compiled kernel" is a no-op Python callable
  counting its calls (``compile_cache.set_builder``); the lookup itself is the real in-memory
  compile cache (one dict read per launch), the argument list the real ``kernel_arguments``;
* which tensors run the kernel: ``api.runs_kernel`` (``x.is_cuda``) becomes ``x.is_cpu`` (in
  ``mamba3_step.api`` and ``mamba3_step.plan``), an attribute read of the same cost;
* the device's architecture: ``launch.device_arch`` answers ``sm_90a`` for the CPU device; it is
  asked once per device and remembered (``launch.arch_of``), so the timed calls read the memo.

The column ``replay K=4`` times ``mamba3_step_fn`` in its replay mode (``replay_ring``, the replay
kernel's route, flush length 4, one ring per layer) in the same way, and ``replay plan.run`` the same
calls through one ``plan_step`` plan of the replay mode (``StepPlan.run``).

So validation (the cache's guard and address checks, or the full validation on a miss), ``out``
allocation, the kernel lookup and the argument list are all what a CUDA call runs; what a GPU
would add is the cost of a real tvm-ffi launch (converting the tensors to DLTensors, the driver
call) instead of a no-op, which this machine cannot measure.

The flagship layer (H=48, D=64, N=128, R=4, fp32 state, bf16 B/x/z/projections, z and outproj,
pool mode with ``update_kv_state`` and a null slot, P = B + 1 rows) at each batch size B, as a
server calls it: every call gets the next of several sets of per-step tensors (A, B, C, x, dt,
trap, z, indices, out), and the sets alternate between two layers (their own pool and weights),
so consecutive calls never pass the same addresses. Each figure is the median over
``rounds x calls`` single calls timed with ``time.perf_counter_ns`` (the median of an empty timed
region subtracted); the calibration ops (``torch.add`` of two 16-element fp32 tensors,
``torch.empty`` of the flagship's ``out``) are timed in the same rounds, interleaved, so the
figures can be compared across machines as multiples of them. Host-side only: no GPU involved.

The per-call check of a validated signature runs in C where ``mamba3_step.validation._admit``
is built (``setup.py``), else in Python; the columns ``eager (py)`` and ``plan.run (py)`` time the
same calls (``out`` given) with the Python check, in the same rounds, so the two can be read side
by side (equal where the C module is not built: the header says which check the main columns use).

Writes ``bench_host.json`` (and ``bench_host.png`` when matplotlib is importable) to
``bench/results/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

from mamba3_step import api, compile_cache, launch, mamba3_step_fn, new_ring, plan, plan_step  # noqa: E402
from mamba3_step.build import KernelBuilder  # noqa: E402
from mamba3_step.spec import FLAGSHIP_HEADS  # noqa: E402
from mamba3_step.tensors import StepTensors  # noqa: E402
from mamba3_step.validation import ValidationCache, cache, check_step_inputs  # noqa: E402

BATCHES = (1, 64, 256)
SETS = 8  # per-step tensor sets cycled through (two layers, alternating)
H, D, N, R = FLAGSHIP_HEADS, 64, 128, 4
CASES = ("torch.add", "torch.empty(out)", "eager (out given)", "eager (out=None)", "plan.run (out given)",
         "plan.run (out=None)", "eager, Python check (out given)", "plan.run, Python check (out given)",
         "replay mode K=4 (out given)", "replay plan.run K=4 (out given)")
K = 4  # the replay case's flush length
FULL = "check_step_inputs (full validation)"
MISS = "first call of a signature (cache miss)"


class NoopKernel:
    """The compiled kernel's stand-in: counts its calls and does nothing else."""

    def __init__(self):
        self.calls = itertools.count()

    def __call__(self, *args):
        next(self.calls)


def _layer(P: int) -> dict:
    """One layer's pool rows and weights (contents never read: the kernel is a no-op)."""
    bf16, f32 = torch.bfloat16, torch.float32
    return dict(state=torch.empty(P, H, D, N, dtype=f32), Bstate=torch.empty(P, R, H, N, dtype=bf16),
                Xstate=torch.empty(P, H, D, dtype=bf16), D=torch.empty(H, dtype=f32),
                xproj=torch.empty(R, H, D, dtype=bf16), outproj=torch.empty(R, H, D, dtype=bf16),
                zproj=torch.empty(R, H, D, dtype=bf16))


def _step_tensors(B: int) -> dict:
    """This step's per-lane tensors and pool indices (lane b reads and writes row b + 1; row 0 is
    the null slot)."""
    bf16, f32 = torch.bfloat16, torch.float32
    return dict(A=torch.empty(B, H, dtype=f32), B=torch.empty(B, R, H, N, dtype=bf16),
                C=torch.empty(B, R, H, N, dtype=bf16), x=torch.empty(B, H, D, dtype=bf16),
                dt=torch.empty(B, H, dtype=f32), trap=torch.empty(B, H, dtype=f32),
                z=torch.empty(B, H, D, dtype=bf16), out=torch.empty(B, H, D, dtype=bf16),
                state_batch_indices=torch.arange(1, B + 1, dtype=torch.int32))


def calls_for(B: int) -> list[tuple[tuple, dict]]:
    """``SETS`` calls ``(args, kwargs)`` of ``mamba3_step_fn``'s signature, as a server passes them."""
    layers = [_layer(B + 1) for _ in range(2)]
    calls = []
    for s in range(SETS):
        t = {**layers[s % 2], **_step_tensors(B)}
        args = (t["state"], t["Bstate"], t["Xstate"], t["A"], t["B"], t["C"], t["D"], t["x"], t["dt"], t["trap"],
                t["xproj"], t["outproj"], None, t["out"], t["z"], t["zproj"])  # state_out None: pool mode
        calls.append((args, dict(state_batch_indices=t["state_batch_indices"], null_slot_id=0)))
    return calls


def _without_out(call):
    args, kwargs = call
    return args[:13] + (None,) + args[14:], kwargs


def install_noop_launch() -> NoopKernel:
    """Route CPU tensors through the CUDA launch path with a no-op kernel (the module docstring)."""
    kernel = NoopKernel()
    compile_cache.set_builder(KernelBuilder(name="bench-host-noop", compile=lambda spec, arch: kernel, sources=(),
                                            exportable=False))

    def runs_kernel_here(x: torch.Tensor) -> bool:  # the same cost as the real x.is_cuda
        return x.is_cpu

    api.runs_kernel = plan.runs_kernel = runs_kernel_here
    launch.device_arch = lambda device: "sm_90a"
    return kernel


def _timed(fn, calls, n: int, overhead: int) -> list[int]:
    """``n`` single calls of ``fn(*args, **kwargs)``, cycling through ``calls``; nanoseconds each."""
    pc = time.perf_counter_ns
    out = []
    cycle = itertools.cycle(calls)
    for _ in range(n):
        args, kwargs = next(cycle)
        t0 = pc()
        fn(*args, **kwargs)
        t1 = pc()
        out.append(t1 - t0 - overhead)
    return out


def _timer_overhead(n: int = 20000) -> int:
    pc = time.perf_counter_ns
    samples = []
    for _ in range(n):
        t0 = pc()
        t1 = pc()
        samples.append(t1 - t0)
    return int(statistics.median(samples))


def measure_batch(B: int, kernel: NoopKernel, calls_per_round: int, rounds: int, overhead: int) -> dict:
    """The medians (microseconds) of every case at batch ``B``; checks each timed step launched."""
    calls = calls_for(B)
    no_out = [_without_out(c) for c in calls]
    options = dict(update_kv_state=True)
    p_out = plan_step(*calls[0][0], **calls[0][1], **options)
    p_none = plan_step(*no_out[0][0], **no_out[0][1], **options)
    p_python = _python_check_plan(calls[0], options)
    python_cache = ValidationCache(prefer_native=False)
    out_shape = tuple(calls[0][0][13].shape)
    eager = [(args, dict(kwargs, **options)) for args, kwargs in calls]
    eager_no_out = [(args, dict(kwargs, **options)) for args, kwargs in no_out]
    rings = [new_ring(B + 1, K, R, H, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16) for _ in range(2)]
    replay_runs = [(args, dict(kwargs, replay_ring=rings[s % 2])) for s, (args, kwargs) in enumerate(calls)]
    replays = [(args, dict(kwargs, update_kv_state=True, replay_flush_length=K)) for args, kwargs in replay_runs]
    replay_plan = plan_step(*replays[0][0], **replays[0][1])
    default_cache = cache.VALIDATION_CACHE
    cases = {  # name: (function, its calls (args, kwargs), whether each call must launch, eager's cache)
        "torch.add": (torch.add, [((torch.ones(16), torch.ones(16)), {})], False, default_cache),
        "torch.empty(out)": (torch.empty, [((out_shape,), {"dtype": torch.bfloat16})], False, default_cache),
        "eager (out given)": (mamba3_step_fn, eager, True, default_cache),
        "eager (out=None)": (mamba3_step_fn, eager_no_out, True, default_cache),
        "plan.run (out given)": (p_out.run, calls, True, default_cache),
        "plan.run (out=None)": (p_none.run, no_out, True, default_cache),
        "eager, Python check (out given)": (mamba3_step_fn, eager, True, python_cache),
        "plan.run, Python check (out given)": (p_python.run, calls, True, default_cache),
        "replay mode K=4 (out given)": (mamba3_step_fn, replays, True, default_cache),
        "replay plan.run K=4 (out given)": (replay_plan.run, replay_runs, True, default_cache),
    }
    try:
        for fn, cs, _, eager_cache in cases.values():  # warm-up: validation caches filled, kernel "compiled"
            cache.VALIDATION_CACHE = eager_cache
            _timed(fn, cs, 2 * SETS, 0)
        samples = {name: [] for name in cases}
        for _ in range(rounds):
            for name, (fn, cs, launches, eager_cache) in cases.items():
                cache.VALIDATION_CACHE = eager_cache
                before = next(kernel.calls)
                samples[name] += _timed(fn, cs, calls_per_round, overhead)
                launched = next(kernel.calls) - before - 1
                if launches and launched != calls_per_round:
                    raise AssertionError(f"{name}: {launched} launches for {calls_per_round} calls")
    finally:
        cache.VALIDATION_CACHE = default_cache
    row = {"batch": B, "heads": H}
    for name, values in samples.items():
        row[name] = statistics.median(values) / 1000
    few = max(50, calls_per_round // 50)
    full = _timed(lambda *s, **k: check_step_inputs(StepTensors(*s, **k), update_kv_state=True), calls, few, overhead)
    row[FULL] = statistics.median(full) / 1000
    miss = _timed(lambda *s, **k: ValidationCache().check(StepTensors(*s, **k), update_kv_state=True), calls, few,
                  overhead)
    row[MISS] = statistics.median(miss) / 1000
    return row


def _python_check_plan(call, options):
    """A plan whose signature checks calls with the Python definition (``admits_python``), for
    the side-by-side columns; the same plan otherwise."""
    native = cache.NATIVE
    cache.NATIVE = False
    try:
        p = plan_step(*call[0], **call[1], **options)
    finally:
        cache.NATIVE = native
    assert not p._sig.native
    return p


HEADERS = {"torch.add": "torch.add", "torch.empty(out)": "torch.empty", "eager (out given)": "eager",
           "eager (out=None)": "eager out=None", "plan.run (out given)": "plan.run",
           "plan.run (out=None)": "plan.run out=None", "eager, Python check (out given)": "eager (py)",
           "plan.run, Python check (out given)": "plan.run (py)", "replay mode K=4 (out given)": "replay K=4",
           "replay plan.run K=4 (out given)": "replay plan.run",
           FULL: "full validation", MISS: "cache miss"}
COLUMNS = [("batch", "B", ">d")] + [(c, HEADERS[c], ">.2f") for c in CASES] + \
    [(c, HEADERS[c], ">.0f") for c in (FULL, MISS)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--calls", type=int, default=4000, help="timed calls per case and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--inference-mode", action="store_true",
                    help="make the tensors and run every call inside torch.inference_mode(), as servers do")
    opts = ap.parse_args(argv)
    batches = [int(b) for b in opts.batches.split(",")]
    kernel = install_noop_launch()
    overhead = _timer_overhead()
    with torch.inference_mode(opts.inference_mode):
        rows = [measure_batch(B, kernel, opts.calls, opts.rounds, overhead) for B in batches]
    env = _util.environment()
    env["cpu_cores"] = os.cpu_count()
    mode = "inside torch.inference_mode()" if opts.inference_mode else "outside inference mode"
    check = "in C (mamba3_step.validation._admit)" if cache.NATIVE else "in Python (the C module is not built here)"
    print(f"host overhead per step, median microseconds (CPU only, no GPU; {env['date_utc']}, "
          f"torch {env.get('torch')}, {os.cpu_count()} cores); flagship H={H} D={D} N={N} R={R}, pool mode, "
          f"update_kv_state, {mode}; the kernel launch is a no-op; per-call check {check}, '(py)': the Python "
          f"check in the same run")
    print(_util.format_table(rows, COLUMNS))
    print("as multiples of torch.add: " + "; ".join(
        f"B={r['batch']}: eager {r['eager (out given)'] / r['torch.add']:.1f}x / "
        f"{r['eager (out=None)'] / r['torch.add']:.1f}x, plan.run {r['plan.run (out given)'] / r['torch.add']:.1f}x / "
        f"{r['plan.run (out=None)'] / r['torch.add']:.1f}x" for r in rows))
    print(f"validation cache: {cache.VALIDATION_CACHE.full_validations} full validations, "
          f"{len(cache.VALIDATION_CACHE)} signatures")
    out_dir = _util.results_dir(opts.out)
    payload = {"environment": env, "what": "median us from the Python call to the (no-op) kernel launch",
               "inference_mode": opts.inference_mode, "native_check": cache.NATIVE,
               "timer_overhead_ns": overhead, "calls_per_round": opts.calls, "rounds": opts.rounds, "rows": rows}
    print(f"wrote {_util.write_json(out_dir / 'bench_host.json', payload)}")
    plt = None if opts.no_plot else _util.pyplot()
    if plt is not None:
        _plot(plt, rows, out_dir / "bench_host.png")
        print(f"wrote {out_dir / 'bench_host.png'}")
    return 0


def _plot(plt, rows, path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = range(len(rows))
    width = 0.8 / len(CASES)
    for i, case in enumerate(CASES):
        ax.bar([x + i * width for x in xs], [r[case] for r in rows], width, label=case)
    ax.set_xticks([x + width * (len(CASES) - 1) / 2 for x in xs])
    ax.set_xticklabels([f"B={r['batch']}" for r in rows])
    ax.axhline(15, color="gray", linestyle="--", linewidth=0.8, label="target, eager (15 us)")
    ax.axhline(5, color="gray", linestyle=":", linewidth=0.8, label="target, plan/run (5 us)")
    ax.set_ylabel("median us per call (host only)")
    ax.set_title("mamba3_step host overhead, flagship, CPU (launch is a no-op)")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
