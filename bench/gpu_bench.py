"""GPU benchmark: pool mode vs gather -> dense -> scatter vs dense mode, measured.

    python bench/gpu_bench.py [--batches 1,2,4,...,512] [--heads 48] [--out DIR] [--no-graph] [--no-plot]
                              [--padded-rows] [--dense-rows]

Without a CUDA device it prints "no CUDA device: GPU benchmark not run" and exits 0.

What it does, at the flagship configuration (N=128, D=64, R=4, fp32 state, bf16 B/C/x/z and
projections, z and outproj, ``update_kv_state`` as a server runs it), for every batch size:

1. Correctness first. On fresh random data it runs pool mode, gather -> dense -> scatter and
   dense mode through ``mamba3_step.mamba3_step_fn`` (the CuteDSL kernel), and checks
   (a) pool mode is bit-identical to gather -> dense -> scatter (out, and every row of
   state / Bstate / Xstate, untouched rows included); (b) pool and dense mode agree with the
   PyTorch path (``mamba3_step.reference.mamba3_step_reference``): the kernel's error
   against a float64 evaluation is at most twice PyTorch float32's, plus one unit in the last
   place of the output dtype; B/x rows stored by update_kv_state are exact; rows no lane
   writes are bit-for-bit unchanged; (c) a CUDA-graph replay of each mode gives the same bits
   as the eager call. If any check fails it prints what failed and **no timing**, and exits 1.
2. Timing, with CUDA events: eager calls and CUDA-graph replay, cycling through several input
   sets (distinct pool rows and per-lane tensors) so that one round touches at least 4x the
   L2 cache and small batches are not served from L2.
3. The device-to-device copy bandwidth of the same GPU, measured in the same run
   (``Tensor.copy_`` of 1 GiB, read + write bytes), as the practical ceiling.

``--padded-rows`` adds a fourth mode, pool mode over a copy of the pool whose state rows have a
padded D stride (N + 4): that compiles the kernel reading the stride at run time, the kernel every
pool ran before packed state rows, so one run times the two side by side on the same GPU (checked
first: bit for bit pool mode's results, the padding untouched).

Reports microseconds per step, GB/s (the bytes of ``mamba3_step.tools.bytes_model`` -- compulsory
bytes of the mode -- divided by the measured time) and percent of the copy bandwidth, as a
table, ``gpu_bench.json`` and ``gpu_bench.png`` in ``bench/results/`` (or ``--out``).
Designed to finish in well under 5 minutes on one H100 (a guard stops timing at 270 s).

``--dense-rows`` adds pool mode whose indices name dense mode's rows (set ``s`` at batch ``B``: rows
``s*B ... s*B + B - 1`` in order) where pool mode names random rows: the pool kernel at dense mode's
addresses. Pool against it isolates where the rows are (random rows: DRAM pages and TLB reach); it
against dense isolates the index (the state loads waiting for ``state_batch_indices``). It is pool
mode's kernel and call with other index values, so pool mode's check covers it.

``--device cpu`` runs the same plumbing on CPU tensors (the PyTorch path, perf_counter timing,
no graphs): a smoke test of this script, not a benchmark.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

from gpu_checks import (GraphUnavailable, capture, check_batch, dense_step, gather_scatter_step, make_lanes, make_pool, make_shared, padded_copy, pool_step, within_reference)

from mamba3_step import mamba3_step_fn  # noqa: E402
from mamba3_step.tools.bytes_model import bytes_per_step  # noqa: E402
from mamba3_step.reference import mamba3_step_reference  # noqa: E402
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_spec  # noqa: E402
from mamba3_step.testing import bits_equal  # noqa: E402,F401

NO_CUDA_MESSAGE = "no CUDA device: GPU benchmark not run"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MODES = ("pool", "gather_scatter", "dense")
#: with --padded-rows: pool mode on state rows of a padded D stride (the run-time stride kernel)
PADDED_MODE = "pool_padded"
#: with --dense-rows: pool mode whose indices name dense mode's rows, in order
DENSE_ROWS_MODE = "pool_dense_rows"
MODE_LABELS = {"pool": "pool", "gather_scatter": "gather->dense->scatter", "dense": "dense",
               PADDED_MODE: "pool, padded rows", DENSE_ROWS_MODE: "pool, dense's rows"}
TIME_GUARD_S = 270.0


class CorrectnessError(RuntimeError):
    """A result failed the benchmark's own correctness check; nothing is reported."""


# ------------------------------------------------------------------------------ input sets
def n_sets(bytes_per_set: int, l2_bytes: int, max_sets: int, min_sets: int = 2) -> int:
    """How many distinct input sets one timing round cycles through: enough that a round
    touches at least 4x the L2 cache, at least ``min_sets`` and at most ``max_sets``."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    want = math.ceil(4 * l2_bytes / bytes_per_set)
    return max(1, min(max_sets, max(min_sets, want)))


# ------------------------------------------------------------------------------ timing
class Timer:
    """Seconds for ``n`` calls of ``fn``: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn, n: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t0


def time_round(timer: Timer, round_fn, calls_per_round: int, target_s: float, reps: int = 3) -> float:
    """Median seconds per call of ``round_fn`` (one call = ``calls_per_round`` steps), with as
    many rounds per repetition as fit ``target_s`` (at least 2)."""
    round_fn()  # warm-up
    est = max(timer(round_fn, 1), 1e-7)
    n = max(2, min(10_000, int(target_s / est)))
    samples = [timer(round_fn, n) / (n * calls_per_round) for _ in range(reps)]
    return statistics.median(samples)


def eager_and_graph_us(timer: Timer, fn, graphs: bool, target_s: float) -> dict:
    """``{"us_eager": ...}`` microseconds per call of ``fn``, plus ``"us_graph"`` from a CUDA graph of
    it when ``graphs`` and the timer is on CUDA."""
    row = {"us_eager": time_round(timer, fn, 1, target_s) * 1e6}
    if graphs and timer.cuda:
        row["us_graph"] = time_round(timer, capture(fn).replay, 1, target_s) * 1e6
    return row


def add_speedups(rows: list[dict]) -> list[dict]:
    """Each row's ``speedup_eager``/``speedup_graph``: the first row's time over its own."""
    for row in rows:
        for kind in ("eager", "graph"):
            if f"us_{kind}" in row:
                row[f"speedup_{kind}"] = rows[0][f"us_{kind}"] / row[f"us_{kind}"]
    return rows


def copy_bandwidth(device, nbytes: int = 1 << 30, timer: Timer | None = None) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written per second)."""
    timer = timer or Timer(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(7)
    dst = torch.empty_like(src)
    t = time_round(timer, lambda: dst.copy_(src), 1, target_s=0.2 if timer.cuda else 0.05)
    del src, dst
    return 2 * nbytes / t


def bench_batch(spec, batch: int, heads: int, device, *, pool: dict, shared: dict, step_fn,
                l2_bytes: int, graphs: bool, target_s: float, gen: torch.Generator,
                padded: dict | None = None, dense_rows: bool = False) -> list[dict]:
    """Time the three modes at one batch size, pool mode on ``padded`` (a :func:`padded_copy` of
    ``pool``) when given, and pool mode on dense mode's rows with ``dense_rows``; one row per
    (mode, eager|graph)."""
    timer = Timer(device)
    P = pool["state"].shape[0]
    per_set = bytes_per_step(spec, batch, heads, mode="pool")["total"]
    K = n_sets(per_set, l2_bytes, max_sets=max(1, P // batch))
    perm = torch.randperm(P, generator=gen)[: K * batch].view(K, batch)
    idx32 = [perm[k].to(torch.int32).to(device) for k in range(K)]
    idx64 = [perm[k].to(device) for k in range(K)]
    in_order = [torch.arange(k * batch, (k + 1) * batch, dtype=torch.int32, device=device) for k in range(K)]
    lanes = [make_lanes(spec, batch, heads, device, gen) for _ in range(K)]
    # dense mode: set k uses pool rows [k*B, (k+1)*B) as its (B, ...) dense tensors (views)
    dense = [{k: v[s * batch:(s + 1) * batch] for k, v in pool.items()} for s in range(K)]
    scratch = {k: torch.empty((batch,) + tuple(v.shape[1:]), dtype=v.dtype, device=device)
               for k, v in pool.items()}

    def round_of(mode):
        if mode in ("pool", PADDED_MODE, DENSE_ROWS_MODE):
            rows_of = padded if mode == PADDED_MODE else pool
            idx = in_order if mode == DENSE_ROWS_MODE else idx32
            calls = [lambda s=s: pool_step(step_fn, spec, rows_of, shared, lanes[s], idx[s]) for s in range(K)]
        elif mode == "gather_scatter":
            calls = [lambda s=s: gather_scatter_step(step_fn, spec, pool, scratch, shared, lanes[s], idx64[s])
                     for s in range(K)]
        else:
            calls = [lambda s=s: dense_step(step_fn, spec, dense[s], shared, lanes[s]) for s in range(K)]

        def run_round():
            for c in calls:
                c()

        return run_round

    rows = []
    extra = ((PADDED_MODE,) if padded is not None else ()) + ((DENSE_ROWS_MODE,) if dense_rows else ())
    for mode in MODES + extra:
        nbytes = bytes_per_step(spec, batch, heads, mode=mode if mode in MODES else "pool")["total"]
        kinds = ["eager"] + (["graph"] if graphs else [])
        for kind in kinds:
            row = {"mode": mode, "kind": kind, "batch": batch, "sets": K, "bytes": nbytes}
            try:
                fn = round_of(mode)
                if kind == "graph":
                    g = capture(fn)
                    fn = g.replay
                sec = time_round(timer, fn, K, target_s)
                row.update(us=sec * 1e6, gbps=nbytes / sec / 1e9)
            except Exception as e:  # a capture that fails is reported, the rest goes on
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------ output
TABLE_COLUMNS = [
    ("batch", "B", ">d"),
    ("mode_label", "mode", "<"),
    ("sets", "sets", ">d"),
    ("mib", "MiB/step", ">.1f"),
    ("us_eager", "eager us", ">.1f"),
    ("gbps_eager", "GB/s", ">.0f"),
    ("pct_copy_eager", "% copy", ">.1f"),
    ("us_graph", "graph us", ">.1f"),
    ("gbps_graph", "GB/s", ">.0f"),
    ("pct_copy_graph", "% copy", ">.1f"),
    ("speedup_pool", "pool speed-up", ">.2f"),
]


def table_rows(rows: list[dict], copy_bps: float) -> list[dict]:
    """Merge eager/graph rows per (batch, mode); add % of copy bandwidth and pool mode's
    speed-up over the mode (graph replay if measured, else eager)."""
    merged: dict = {}
    for r in rows:
        m = merged.setdefault((r["batch"], r["mode"]), {
            "batch": r["batch"], "mode": r["mode"], "mode_label": MODE_LABELS[r["mode"]],
            "sets": r["sets"], "mib": r["bytes"] / 2**20, "bytes": r["bytes"],
        })
        if "us" in r:
            m[f"us_{r['kind']}"] = r["us"]
            m[f"gbps_{r['kind']}"] = r["gbps"]
            if copy_bps:
                m[f"pct_copy_{r['kind']}"] = 100 * r["gbps"] * 1e9 / copy_bps
        if "error" in r:
            m[f"error_{r['kind']}"] = r["error"]
    out = list(merged.values())
    for m in out:
        pool = merged.get((m["batch"], "pool"), {})
        for kind in ("graph", "eager"):
            if f"us_{kind}" in m and f"us_{kind}" in pool:
                m["speedup_pool"] = m[f"us_{kind}"] / pool[f"us_{kind}"]
                break
    return out


def format_report(env: dict, copy_bps: float, trows: list[dict]) -> str:
    lines = [
        f"GPU benchmark (measured): {env.get('device', '?')}, {env.get('date_utc', '')}",
        f"flagship configuration, H={env.get('heads')}, update_kv_state; device-to-device copy "
        f"bandwidth measured in this run: {copy_bps / 1e9:.0f} GB/s (read + write)",
        "GB/s = compulsory bytes of the mode (bytes_model) / measured time; 'sets' = input sets "
        "cycled per round so a round touches >= 4x L2",
        _util.format_table(trows, TABLE_COLUMNS),
    ]
    errors = [f"  B={r['batch']} {r['mode']} {k[6:]}: {v}" for r in trows for k, v in r.items()
              if k.startswith("error_")]
    if errors:
        lines.append("not measured:\n" + "\n".join(errors))
    return "\n".join(lines)


def plot(trows: list[dict], copy_bps: float, title: str, path) -> bool:
    plt = _util.pyplot()
    if plt is None:
        return False
    colors = _util.MODE_COLORS
    # pool and dense mode may nearly coincide: pool is drawn wide and translucent under dense
    look = {"pool": dict(lw=4.0, alpha=0.45), "gather_scatter": dict(lw=1.6, marker="o", ms=3),
            "dense": dict(lw=1.0, marker="x", ms=4), PADDED_MODE: dict(lw=1.0, ls=":", marker="+", ms=5),
            DENSE_ROWS_MODE: dict(lw=1.0, ls="-.", marker="d", ms=4)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    xs_all = sorted({r["batch"] for r in trows})
    for mode in MODES + (PADDED_MODE, DENSE_ROWS_MODE):
        sub = sorted((r for r in trows if r["mode"] == mode), key=lambda r: r["batch"])
        for kind, style in (("graph", "-"), ("eager", "--")):
            pts = [(r["batch"], r[f"us_{kind}"]) for r in sub if f"us_{kind}" in r]
            if pts:
                ax1.plot(*zip(*pts), style, color=colors[mode], label=f"{MODE_LABELS[mode]}, {kind}",
                         **look[mode])
            pts = [(r["batch"], r[f"pct_copy_{kind}"]) for r in sub if f"pct_copy_{kind}" in r]
            if pts:
                ax2.plot(*zip(*pts), style, color=colors[mode], label=f"{MODE_LABELS[mode]}, {kind}",
                         **look[mode])
    ax1.set_yscale("log")
    ax1.set_ylabel("measured time per step (us, one layer)")
    ax1.set_title(title, fontsize=10)
    ax1.legend(fontsize=8)
    ax2.set_ylabel("% of device-to-device copy bandwidth")
    ax2.set_title(f"effective bandwidth (compulsory bytes / time); copy = {copy_bps / 1e9:.0f} GB/s",
                  fontsize=10)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8)
    _util.save_batch_plot(plt, fig, (ax1, ax2), xs_all, path)
    return True


# ------------------------------------------------------------------------------ main
def parse_batches(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--batches must be comma-separated ints, got {text!r}") from None
    if not out or any(b < 1 for b in out):
        raise ValueError(f"--batches must be positive ints, got {text!r}")
    return out


def run(args, step_fn=None, reference_fn=None) -> dict:
    """Check, then time; returns the result dict. Raises CorrectnessError on a failed check."""
    t_start = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    spec = flagship_spec()
    step_fn = step_fn or mamba3_step_fn
    reference_fn = reference_fn or mamba3_step_reference
    graphs = cuda and not args.no_graph
    env = _util.environment()
    env["heads"] = args.heads
    if cuda:
        props = torch.cuda.get_device_properties(device)
        env["device"] = torch.cuda.get_device_name(device)
        env["capability"] = "sm_%d%d" % torch.cuda.get_device_capability(device)
        env["l2_bytes"] = int(getattr(props, "L2_cache_size", 50 << 20))
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = "cpu (smoke test of the benchmark's plumbing, not a benchmark)"
        env["l2_bytes"] = 0

    # 1. correctness, every batch, before any timing
    failures = []
    for batch in args.batches:
        try:
            failures += check_batch(spec, batch, args.heads, device, step_fn, reference_fn, graphs=graphs,
                                    padded=args.padded_rows)
        except GraphUnavailable as e:
            env["graph_error"] = str(e)
            graphs = False
            failures += check_batch(spec, batch, args.heads, device, step_fn, reference_fn, graphs=False,
                                    padded=args.padded_rows)
    if failures:
        raise CorrectnessError("\n".join(failures))
    env["checks"] = ("pool == gather->dense->scatter bit for bit; pool and dense within PyTorch float32's "
                     "error of a float64 evaluation; untouched rows unchanged"
                     + ("; graph replay == eager" if graphs else ""))

    # 2. copy bandwidth, 3. timing
    copy_bps = copy_bandwidth(device, nbytes=(1 << 30) if cuda else (1 << 24))
    gen = torch.Generator().manual_seed(7)
    max_b = max(args.batches)
    P = max(2 * max_b, 16)
    pool = make_pool(spec, P, args.heads, device, gen)
    shared = make_shared(spec, args.heads, device, gen)
    padded = padded_copy(pool) if args.padded_rows else None
    rows, skipped = [], []
    for batch in args.batches:
        if time.perf_counter() - t_start > TIME_GUARD_S:
            skipped.append(batch)
            continue
        rows += bench_batch(spec, batch, args.heads, device, pool=pool, shared=shared, step_fn=step_fn,
                            l2_bytes=env["l2_bytes"], graphs=graphs, target_s=args.target_ms / 1e3, gen=gen,
                            padded=padded, dense_rows=args.dense_rows)
    env["seconds"] = round(time.perf_counter() - t_start, 1)
    return {
        "what": "measured on a GPU (CUDA events); GB/s use the compulsory bytes of mamba3_step.tools.bytes_model",
        "environment": env,
        "spec": spec.as_dict(),
        "copy_bandwidth_bytes_per_s": copy_bps,
        "rows": rows,
        "table": table_rows(rows, copy_bps),
        "skipped_batches_time_guard": skipped,
    }


def main(argv: list[str] | None = None, step_fn=None, reference_fn=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--heads", type=int, default=FLAGSHIP_HEADS, help="H (default 48)")
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--no-graph", action="store_true", help="eager calls only")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--padded-rows", action="store_true",
                   help="also time pool mode on state rows of a padded D stride (the run-time stride kernel)")
    p.add_argument("--dense-rows", action="store_true",
                   help="also time pool mode with indices naming dense mode's rows in order (where the rows are "
                        "vs waiting for the index)")
    p.add_argument("--target-ms", type=float, default=60.0, help="time per measurement repetition")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: smoke-test the plumbing on the PyTorch path (not a benchmark)")
    args = p.parse_args(argv)
    try:
        args.batches = parse_batches(args.batches)
    except ValueError as e:
        p.error(str(e))
    if args.heads < 1:
        p.error(f"--heads must be >= 1, got {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    try:
        result = run(args, step_fn=step_fn, reference_fn=reference_fn)
    except CorrectnessError as e:
        print("correctness check FAILED against the PyTorch path; no timing is reported:\n" + str(e))
        return 1
    env = result["environment"]
    print(format_report(env, result["copy_bandwidth_bytes_per_s"], result["table"]))
    if "graph_error" in env:
        print(f"CUDA-graph capture failed, graph replay not measured: {env['graph_error']}")
    if result["skipped_batches_time_guard"]:
        print(f"time guard ({TIME_GUARD_S:.0f} s) reached: batches {result['skipped_batches_time_guard']} not timed")
    out = _util.results_dir(args.out)
    print(f"wrote {_util.write_json(out / 'gpu_bench.json', result)}")
    if not args.no_plot:
        png = out / "gpu_bench.png"
        title = f"{env['device']} ({env['date_utc']}), flagship H={args.heads}\nmeasured; solid = CUDA graph, dashed = eager"
        if plot(result["table"], result["copy_bandwidth_bytes_per_s"], title, png):
            print(f"wrote {png}")
        else:
            print("matplotlib not installed: no plot (pip install mamba3-step[bench])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
