"""Suite ``step``: pool mode vs gather -> dense -> scatter vs dense mode, at the flagship configuration
(N=128, D=64, R=4, fp32 state (``--step-state-dtype``: a 16-bit one, rounded to nearest), bf16
B/C/x/z and projections, z and outproj, ``update_kv_state`` as a server runs it), for every batch size.

1. Check (``step_checks.check_batch``): on fresh random data, pool mode bit-identical to
   gather -> dense -> scatter (out, and every row of state / Bstate / Xstate, untouched rows included);
   pool and dense mode within PyTorch float32's error of a float64 evaluation of the PyTorch path, plus
   one unit in the last place of the output dtype; B/x rows stored by update_kv_state exact; rows no
   lane writes bit-for-bit unchanged; a CUDA-graph replay of each mode the eager call's bits.
2. Timing with CUDA events, eager calls and CUDA-graph replay, cycling through several input sets
   (distinct pool rows and per-lane tensors) so that one round touches at least 4x the L2 cache and
   small batches are not served from L2.
3. The device-to-device copy bandwidth of the same GPU in the same run (``Tensor.copy_`` of 1 GiB,
   read + write bytes), as the practical ceiling.

``--padded-rows`` adds pool mode over a copy of the pool whose state rows have a padded D stride
(N + 4): the kernel that reads the state's D stride at run time, checked first (pool mode's bits, the
padding untouched). ``--dense-rows`` adds pool mode whose indices name dense mode's rows in order (set
``s`` at batch ``B``: rows ``s*B ... s*B + B - 1``): pool against it isolates where the rows are, it
against dense isolates the wait for ``state_batch_indices``; pool mode's check covers it.
``--async-copy`` adds pool mode through the asynchronous state copy (``StepSpec.async_state_copy``,
the kernel beside the register kernel), checked bit for bit against pool mode first; ``--min-ctas
4,5`` adds pool mode's kernels at those launch bounds (``StepSpec.min_ctas_per_sm``: the register
kernel, and the copy with ``--async-copy``), checked likewise; ``--unpinned-loads`` adds pool mode
through the register kernel with its loads in the compiler's order (``StepSpec.unpinned_loads``, one
round trip more), ``--late-epilogue`` through it with the epilogue's operands also loaded after the
update (``StepSpec.late_epilogue``), each checked likewise; ``--pipeline-per-sm 2,3`` adds pool mode
through the slab pipeline (``StepSpec.pipeline_ctas``) with 2 and 3 persistent CTAs per SM of the device,
checked likewise; ``--small-batch`` adds pool mode through the register kernel's small-batch forms (the D
split over a cluster of 2 and 4 CTAs, programmatic dependent launch alone and with each: step_checks.SMALL_BATCH_FORMS),
checked likewise. ``--upstream
PATH`` adds the peer: upstream's own CuteDSL dense step from the state-spaces/mamba checkout at PATH,
with the gather and scatter a server needs around it (:mod:`.upstream`), checked first.

Reports microseconds per step, GB/s (the bytes of ``mamba3_step.tools.bytes_model``, compulsory bytes of the
mode, over the time) and percent of the copy bandwidth. A guard stops timing new batches after 270 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import _util

from mamba3_step import mamba3_step_fn
from mamba3_step.tools.bytes_model import bytes_per_step
from mamba3_step.spec import flagship_spec

from .common import Run, int_list
from .upstream import upstream_step
from .step_checks import (ASYNC_MODE, LATE_MODE, LAYOUTS, PIPELINE_MODE, SMALL_BATCH_FORMS, UNPINNED_MODE, check_batch, dense_step, gather_scatter_step, kernel_variants, make_lanes,
                          make_pool, make_shared, padded_copy, pool_step)
from .timing import GraphUnavailable, Timer, capture, copy_bandwidth, n_sets, time_round

NAME = "step"
BATCHES = "1,2,4,8,16,32,64,128,256,512"
MODES = ("pool", "gather_scatter", "dense")
#: with --padded-rows: pool mode on state rows of a padded D stride (the run-time stride kernel)
PADDED_MODE = "pool_padded"
#: with --dense-rows: pool mode whose indices name dense mode's rows, in order
DENSE_ROWS_MODE = "pool_dense_rows"
#: with --upstream: upstream's dense step, gathered and scattered
UPSTREAM_MODE = "upstream"
MODE_LABELS = {"pool": "pool", "gather_scatter": "gather->dense->scatter", "dense": "dense",
               PADDED_MODE: "pool, padded rows", DENSE_ROWS_MODE: "pool, dense's rows",
               ASYNC_MODE: "pool, asynchronous state copy", LATE_MODE: "pool, epilogue loaded late",
               UNPINNED_MODE: "pool, loads unpinned",
               "pool_early_epilogue": "pool, early epilogue",
               UPSTREAM_MODE: "upstream dense, gathered/scattered"}


def mode_label(mode: str) -> str:
    """A mode's label in the table; a launch-bound variant (``--min-ctas``) names its bound, a slab pipeline
    (``--pipeline-per-sm``) its CTAs."""
    if mode.startswith(PIPELINE_MODE):
        ctas, _, programmatic = mode[len(PIPELINE_MODE):].partition("_")
        return f"pool, slab pipeline, {ctas} CTAs" + (", programmatic launch" if programmatic else "")
    if mode.startswith("pool_") and mode[5:] in SMALL_BATCH_FORMS:
        return "pool, " + SMALL_BATCH_FORMS[mode[5:]][0]
    base, _, bound = mode.partition("_bound")
    return MODE_LABELS[base] + (f", launch bound {bound}" if bound else "")
TIME_GUARD_S = 270.0


@dataclass
class Options:
    run: Run
    batches: tuple[int, ...]
    padded_rows: bool
    dense_rows: bool
    async_copy: bool = False
    state_dtype: str = "float32"
    bounds: tuple[int, ...] = ()
    layouts: tuple[str, ...] = ()
    pipelines: tuple[int, ...] = ()
    upstream_fn: object = None
    step_fn: object = None
    reference_fn: object = None


def add_arguments(parser) -> None:
    group = parser.add_argument_group("suite step")
    group.add_argument("--padded-rows", action="store_true",
                       help="also time pool mode on state rows of a padded D stride (the run-time stride kernel)")
    group.add_argument("--dense-rows", action="store_true",
                       help="also time pool mode with indices naming dense mode's rows in order (where the rows "
                            "are vs waiting for the index)")
    group.add_argument("--step-state-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                       help="the flagship's state dtype in this suite (16-bit: rounded to nearest; default float32)")
    group.add_argument("--upstream", default=None, metavar="PATH",
                       help="also time upstream's CuteDSL mamba3_step_fn from the state-spaces/mamba checkout at PATH "
                            "(gathered and scattered; its code at PATH is executed)")
    group.add_argument("--async-copy", action="store_true",
                       help="also time pool mode through the asynchronous state copy (StepSpec.async_state_copy)")
    group.add_argument("--late-epilogue", action="store_true",
                       help="also time pool mode through the register kernel with its epilogue's operands loaded after "
                            "the update (StepSpec.late_epilogue, with StepSpec.unpinned_loads: the layout before they were loaded early)")
    group.add_argument("--pipeline-per-sm", default="", metavar="K[,K...]",
                       help="also time pool mode through the slab pipeline (StepSpec.pipeline_ctas) with K persistent "
                            "CTAs per SM of the device, for each K")
    group.add_argument("--small-batch", action="store_true",
                       help="also time pool mode through the register kernel's small-batch forms: the D split over a "
                            "cluster of 2 and 4 CTAs (tile_D 32, 16) and programmatic dependent launch "
                            "(StepSpec.programmatic_launch), alone and with each split (with --pipeline-per-sm, the slab "
                            "pipeline launched programmatically too)")
    group.add_argument("--unpinned-loads", action="store_true",
                       help="also time pool mode through the register kernel with its loads in the compiler's order "
                            "(StepSpec.unpinned_loads: the kernel without the barrier that pins them)")


def configure(args, run: Run, step_fn=None, reference_fn=None) -> Options:
    upstream_fn = None
    if args.upstream is not None:
        from .upstream import load_upstream_step
        upstream_fn = load_upstream_step(args.upstream)
    bounds = int_list(args.min_ctas, "--min-ctas", allow_empty=True)
    layouts = tuple(layout for layout in LAYOUTS if getattr(args, layout)) + (
        tuple(SMALL_BATCH_FORMS) if args.small_batch else ())
    per_sm = int_list(args.pipeline_per_sm, "--pipeline-per-sm", allow_empty=True)
    if not run.cuda and (args.async_copy or bounds or layouts or per_sm) and step_fn is None:
        raise ValueError("--async-copy, --min-ctas, --pipeline-per-sm, --small-batch, --unpinned-loads and "
                         "--late-epilogue time "
                         "kernels beside pool "
                         "mode's, bit for bit; with --device cpu pool mode runs the PyTorch path, which they cannot "
                         "match: run them on a CUDA device")
    sms = torch.cuda.get_device_properties(torch.device(run.device)).multi_processor_count if run.cuda and per_sm else 0
    pipelines = tuple(k * sms if sms else k for k in per_sm)
    return Options(run, run.batches_or(BATCHES), args.padded_rows, args.dense_rows, args.async_copy,
                   args.step_state_dtype, bounds, layouts, pipelines, upstream_fn, step_fn, reference_fn)


def check(opts: Options) -> list[str]:
    """Every check at every batch size; on a failed graph capture, graph timing is dropped (``env``
    records why) and the checks go on without it. A peer that fails its check or raises is not timed
    (``env["upstream_not_timed"]`` says why) and does not stop this project's modes."""
    run, spec, failures = opts.run, flagship_spec(state_dtype=opts.state_dtype), []
    for batch in opts.batches:
        peer: list[str] = []
        kw = dict(padded=opts.padded_rows, async_copy=opts.async_copy, upstream_fn=opts.upstream_fn,
                  peer_failures=peer, bounds=opts.bounds, layouts=opts.layouts, pipelines=opts.pipelines)
        try:
            failures += check_batch(spec, batch, run.heads, torch.device(run.device), opts.step_fn, opts.reference_fn,
                                    graphs=run.graphs and run.cuda, **kw)
        except GraphUnavailable as e:
            run.env["graph_error"] = str(e)
            run.graphs = False
            peer.clear()
            failures += check_batch(spec, batch, run.heads, torch.device(run.device), opts.step_fn, opts.reference_fn,
                                    graphs=False, **kw)
        if peer:
            run.env["upstream_not_timed"] = peer
            opts.upstream_fn = None
            print("PEER NOT TIMED (upstream's step failed its check):\n" + "\n".join(peer), flush=True)
    return failures


def bench_batch(spec, batch: int, heads: int, device, *, pool: dict, shared: dict, step_fn,
                l2_bytes: int, graphs: bool, target_s: float, gen: torch.Generator,
                padded: dict | None = None, dense_rows: bool = False, async_copy: bool = False,
                upstream_fn=None, bounds: tuple[int, ...] = (), layouts: tuple[str, ...] = (),
                pipelines: tuple[int, ...] = ()) -> list[dict]:
    """Time the three modes at one batch size, pool mode on ``padded`` (a :func:`padded_copy` of
    ``pool``) when given, pool mode on dense mode's rows with ``dense_rows``, the kernel variants
    (``step_checks.kernel_variants``: ``async_copy``, ``bounds``) and the peer; one row per (mode, eager|graph)."""
    timer = Timer(device)
    P = pool["state"].shape[0]
    per_set = bytes_per_step(spec, batch, heads, mode="pool")["total"]
    sets = n_sets(per_set, l2_bytes, max_sets=max(1, P // batch))
    variants = kernel_variants(async_copy, bounds, layouts, pipelines)
    round_of = _rounds(spec, batch, heads, device, pool, shared, step_fn, sets, gen, padded, upstream_fn, variants)
    rows = []
    extra = (((PADDED_MODE,) if padded is not None else ()) + ((DENSE_ROWS_MODE,) if dense_rows else ())
             + tuple(variants) + ((UPSTREAM_MODE,) if upstream_fn is not None else ()))
    for mode in MODES + extra:
        moved = "gather_scatter" if mode == UPSTREAM_MODE else mode if mode in MODES else "pool"
        nbytes = bytes_per_step(spec, batch, heads, mode=moved)["total"]
        for kind in ["eager"] + (["graph"] if graphs else []):
            row = {"mode": mode, "kind": kind, "batch": batch, "sets": sets, "bytes": nbytes}
            try:
                fn = round_of(mode)
                if kind == "graph":
                    fn = capture(fn).replay
                sec = time_round(timer, fn, sets, target_s)
                row.update(us=sec * 1e6, gbps=nbytes / sec / 1e9)
            except Exception as e:  # a capture that fails is reported, the rest goes on
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    return rows


def _rounds(spec, batch: int, heads: int, device, pool: dict, shared: dict, step_fn, sets: int, gen, padded,
            upstream_fn=None, variants: dict | None = None):
    """``round_of(mode)``: a function running one step of ``mode`` on each of ``sets`` input sets."""
    P = pool["state"].shape[0]
    perm = torch.randperm(P, generator=gen)[: sets * batch].view(sets, batch)
    idx32 = [perm[s].to(torch.int32).to(device) for s in range(sets)]
    idx64 = [perm[s].to(device) for s in range(sets)]
    in_order = [torch.arange(s * batch, (s + 1) * batch, dtype=torch.int32, device=device) for s in range(sets)]
    lanes = [make_lanes(spec, batch, heads, device, gen) for _ in range(sets)]
    # dense mode: set s uses pool rows [s*B, (s+1)*B) as its (B, ...) dense tensors (views)
    dense = [{k: v[s * batch:(s + 1) * batch] for k, v in pool.items()} for s in range(sets)]
    scratch = {k: torch.empty((batch,) + tuple(v.shape[1:]), dtype=v.dtype, device=device) for k, v in pool.items()}

    def round_of(mode):
        if mode in ("pool", PADDED_MODE, DENSE_ROWS_MODE) or mode in (variants or {}):
            rows_of = padded if mode == PADDED_MODE else pool
            idx = in_order if mode == DENSE_ROWS_MODE else idx32
            fn = variants[mode][1] if mode in (variants or {}) else step_fn
            calls = [lambda s=s: pool_step(fn, spec, rows_of, shared, lanes[s], idx[s]) for s in range(sets)]
        elif mode == UPSTREAM_MODE:
            calls = [lambda s=s: upstream_step(upstream_fn, spec, pool, scratch, shared, lanes[s], idx64[s])
                     for s in range(sets)]
        elif mode == "gather_scatter":
            calls = [lambda s=s: gather_scatter_step(step_fn, spec, pool, scratch, shared, lanes[s], idx64[s])
                     for s in range(sets)]
        else:
            calls = [lambda s=s: dense_step(step_fn, spec, dense[s], shared, lanes[s]) for s in range(sets)]

        def run_round():
            for c in calls:
                c()

        return run_round

    return round_of


def measure(opts: Options) -> dict:
    """The copy bandwidth, then every batch size's rows (until the time guard)."""
    t_start = time.perf_counter()
    run, spec = opts.run, flagship_spec(state_dtype=opts.state_dtype)
    device = torch.device(run.device)
    graphs = run.graphs and run.cuda
    copy_bps = copy_bandwidth(device, nbytes=(1 << 30) if run.cuda else (1 << 24))
    gen = torch.Generator().manual_seed(7)
    P = max(2 * max(opts.batches), 16)
    pool = make_pool(spec, P, run.heads, device, gen)
    shared = make_shared(spec, run.heads, device, gen)
    padded = padded_copy(pool) if opts.padded_rows else None
    rows, skipped = [], []
    for batch in opts.batches:
        if time.perf_counter() - t_start > TIME_GUARD_S:
            skipped.append(batch)
            continue
        rows += bench_batch(spec, batch, run.heads, device, pool=pool, shared=shared,
                            step_fn=opts.step_fn or mamba3_step_fn, l2_bytes=run.env["l2_bytes"], graphs=graphs,
                            target_s=run.target_s(60.0, 60.0), gen=gen, padded=padded, dense_rows=opts.dense_rows,
                            async_copy=opts.async_copy, upstream_fn=opts.upstream_fn, bounds=opts.bounds,
                            layouts=opts.layouts, pipelines=opts.pipelines)
    return {
        "what": "pool vs gather->dense->scatter vs dense; GB/s use the compulsory bytes of mamba3_step.tools.bytes_model",
        "checks": ("pool == gather->dense->scatter bit for bit; pool and dense within PyTorch float32's error of a "
                   "float64 evaluation; untouched rows unchanged" + ("; graph replay == eager" if graphs else "")),
        "heads": run.heads,
        "spec": spec.as_dict(),
        "copy_bandwidth_bytes_per_s": copy_bps,
        "rows": rows,
        "table": table_rows(rows, copy_bps),
        "skipped_batches_time_guard": skipped,
        "upstream_not_timed": run.env.get("upstream_not_timed", []),
        "seconds": round(time.perf_counter() - t_start, 1),
    }


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
            "batch": r["batch"], "mode": r["mode"], "mode_label": mode_label(r["mode"]),
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


def report(result: dict) -> str:
    copy_bps, trows = result["copy_bandwidth_bytes_per_s"], result["table"]
    lines = [
        f"pool vs gather->dense->scatter vs dense, flagship, H={result['heads']}, update_kv_state; device-to-device "
        f"copy bandwidth measured in this run: {copy_bps / 1e9:.0f} GB/s (read + write)",
        "GB/s = compulsory bytes of the mode (bytes_model) / measured time; 'sets' = input sets "
        "cycled per round so a round touches >= 4x L2",
        _util.format_table(trows, TABLE_COLUMNS),
    ]
    errors = [f"  B={r['batch']} {r['mode']} {k[6:]}: {v}" for r in trows for k, v in r.items()
              if k.startswith("error_")]
    if errors:
        lines.append("not measured:\n" + "\n".join(errors))
    if result.get("upstream_not_timed"):
        lines.append("upstream's step not timed, it failed its check:\n  " + "\n  ".join(result["upstream_not_timed"]))
    if result["skipped_batches_time_guard"]:
        lines.append(f"time guard ({TIME_GUARD_S:.0f} s) reached: batches {result['skipped_batches_time_guard']} "
                     "not timed")
    return "\n".join(lines)


def plot(result: dict, title: str, path) -> bool:
    """Time per step and % of the copy bandwidth against the batch size, per mode (solid: CUDA graph,
    dashed: eager); False without matplotlib."""
    plt = _util.pyplot()
    if plt is None:
        return False
    trows, copy_bps = result["table"], result["copy_bandwidth_bytes_per_s"]
    # pool and dense mode may nearly coincide: pool is drawn wide and translucent under dense
    look = {"pool": dict(lw=4.0, alpha=0.45), "gather_scatter": dict(lw=1.6, marker="o", ms=3),
            "dense": dict(lw=1.0, marker="x", ms=4), PADDED_MODE: dict(lw=1.0, ls=":", marker="+", ms=5),
            DENSE_ROWS_MODE: dict(lw=1.0, ls="-.", marker="d", ms=4), ASYNC_MODE: dict(lw=1.6, marker="s", ms=3),
            UPSTREAM_MODE: dict(lw=1.2, marker="^", ms=4), LATE_MODE: dict(lw=1.6, marker="D", ms=3),
            UNPINNED_MODE: dict(lw=1.6, marker="v", ms=3)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    for mode in MODES + (PADDED_MODE, DENSE_ROWS_MODE, ASYNC_MODE, UNPINNED_MODE, LATE_MODE, UPSTREAM_MODE):
        sub = sorted((r for r in trows if r["mode"] == mode), key=lambda r: r["batch"])
        for kind, style in (("graph", "-"), ("eager", "--")):
            for ax, key in ((ax1, f"us_{kind}"), (ax2, f"pct_copy_{kind}")):
                pts = [(r["batch"], r[key]) for r in sub if key in r]
                if pts:
                    ax.plot(*zip(*pts), style, color=_util.MODE_COLORS[mode], label=f"{MODE_LABELS[mode]}, {kind}",
                            **look[mode])
    ax1.set_yscale("log")
    ax1.set_ylabel("measured time per step (us, one layer)")
    ax1.set_title(title, fontsize=10)
    ax1.legend(fontsize=8)
    ax2.set_ylabel("% of device-to-device copy bandwidth")
    ax2.set_title(f"effective bandwidth (compulsory bytes / time); copy = {copy_bps / 1e9:.0f} GB/s", fontsize=10)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=8)
    _util.save_batch_plot(plt, fig, (ax1, ax2), sorted({r["batch"] for r in trows}), path)
    return True
