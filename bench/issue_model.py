"""Instructions per state byte, side by side with upstream, and the static issue model (no GPU).

    python bench/issue_model.py [--out DIR] [--no-execute] [--tokens 2,4,8] [--replay 2,4,8] [--replay-states]
                                [--measured bench/results/gpu_bench.json]

Compiles the flagship as servers run it (pool mode with update_kv_state; N=128, D=64, R=4, fp32
state, bf16 B/x/proj, z and outproj) for sm_90a and sm_100a, counts its SASS, executes its PTX
on the CPU (``--no-execute`` skips that), and prints

1. the comparison table against upstream: SASS instructions per thread, threads per CTA,
   warp-instructions per (64 x 128) state slab and registers, upstream's dense kernel as a
   stated constant (``mamba3_step.tools.issue_model.UPSTREAM``, with its source) next to this
   project's kernel;
2. the issue model (``mamba3_step.tools.issue_model``): per SM and slab, issue time vs memory time on
   H100, H200 and B200 datasheet figures, from static SASS counts and from executed PTX counts;
3. the same model for the speculative verify step (``--tokens``: T tokens, (B, K) sources, a row
   per token): per slab the state is read once and written T times, and T tokens' instructions
   are issued.
4. the replay kernel (``--replay``, K values; docs/design/replay.md): executed PTX
   warp-instructions per slab at each ring position, with outputs replayed (exact) and from the
   checkpoint, and the issue model averaged over positions (the counts
   ``mamba3_step.tools.issue_model.REPLAY_EXECUTED`` holds for bench/model_bench.py, checked equal);
5. with ``--replay-states``, the same for the flagship with the rotary angle, a stochastically
   rounded bf16 state and an int8 state (replayed outputs; the counts
   ``mamba3_step.tools.issue_model.REPLAY_STATES_EXECUTED`` holds, checked equal); with ``--measured``, a
   result of ``bench/gpu_bench.py --suite replay-states``, its graph times at B = 256 over the stepwise
   step's beside the model.

Writes ``issue_model.json`` and, with matplotlib, ``issue_model.png`` to ``bench/results/``.
These are compiler facts and a model, not GPU measurements.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

import gpu_results  # noqa: E402
from mamba3_step.build import compile_kernel  # noqa: E402
from mamba3_step.tools.inspection import kernel_facts  # noqa: E402
from mamba3_step.tools.issue_model import (GPUS, REPLAY_EXECUTED, REPLAY_STATES_EXECUTED, UPSTREAM, issue_model, replay_issue_model, replay_states_issue_model, replay_states_replay_spec, replay_states_spec, slab_bytes)
from mamba3_step.spec import flagship_spec  # noqa: E402
from mamba3_step.tools.verify.step import executed_facts, replay_instructions  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")


def compiled_rows(spec) -> list[dict]:
    rows = []
    for arch in ARCHS:
        f = kernel_facts(compile_kernel(spec, arch))
        per_thread = sum(v for k, v in f.sass.items() if k not in ("total", "NOP"))
        warps = f.threads // 32 * (spec.headdim // spec.tile_D)
        up = UPSTREAM[arch]
        rows.append({"kernel": "upstream (dense)", "arch": arch, "per_thread": up.get("instructions_per_thread"),
                     "threads": up.get("threads"), "slab": up["warp_instructions_per_slab"],
                     "registers": up.get("registers"), "vs_upstream": 1.0})
        rows.append({"kernel": "this project (pool + update_kv_state)", "arch": arch, "per_thread": per_thread,
                     "threads": f.threads, "slab": per_thread * warps, "registers": f.registers,
                     "spill_bytes": f.spill_bytes, "vs_upstream": per_thread * warps / up["warp_instructions_per_slab"]})
    return rows


def model_rows(spec, compiled: list[dict], executed: float | None) -> list[dict]:
    nbytes = slab_bytes(spec)
    out = []
    for name, gpu in GPUS.items():
        static = {r["kernel"]: r["slab"] for r in compiled if r["arch"] == gpu.arch}
        counts = [("upstream, static SASS", static["upstream (dense)"]),
                  ("this project, static SASS", static["this project (pool + update_kv_state)"])]
        if executed is not None:
            counts.append(("this project, executed PTX", executed))
        for what, n in counts:
            m = issue_model(n, nbytes, gpu)
            out.append({"gpu": name, "count": what, "warp_instructions": n, "slab_bytes": nbytes,
                        "clock_ghz": gpu.clock_hz / 1e9, **m})
    return out


def token_rows(tokens) -> list[dict]:
    """Static counts and the issue model of the flagship's speculative verify step for each T."""
    rows = []
    for T in tokens:
        spec = flagship_spec(tokens=T, has_dst=True, dst_per_token=True, num_accepted=True)
        nbytes = slab_bytes(spec)
        for arch in ARCHS:
            f = kernel_facts(compile_kernel(spec, arch))
            per_thread = sum(v for k, v in f.sass.items() if k not in ("total", "NOP"))
            slab = per_thread * f.threads // 32 * (spec.headdim // spec.tile_D)
            row = {"tokens": T, "arch": arch, "per_thread": per_thread, "threads": f.threads,
                   "registers": f.registers, "spill_bytes": f.spill_bytes, "slab": slab, "per_token": slab / T,
                   "slab_bytes": nbytes}
            for name, gpu in GPUS.items():
                if gpu.arch == arch:
                    row[f"ratio_{name}"] = issue_model(slab, nbytes, gpu)["ratio"]
            rows.append(row)
    return rows


TOKENS_TABLE = [("tokens", "T", ">d"), ("arch", "arch", "<"), ("per_thread", "SASS instr/thread", ">,d"),
                ("threads", "threads/CTA", ">d"), ("registers", "regs", ">d"), ("spill_bytes", "spill B", ">d"),
                ("slab", "warp-instr per slab", ">,d"), ("per_token", "per token", ">,.0f"),
                ("slab_bytes", "bytes/slab", ">,.0f")] + [
    (f"ratio_{g}", f"{g} issue/memory", ">.2f") for g in GPUS]


TABLE = [("kernel", "kernel", "<"), ("arch", "arch", "<"), ("per_thread", "SASS instr/thread", ">,d"),
         ("threads", "threads/CTA", ">d"), ("slab", "warp-instr per slab", ">,.0f"), ("registers", "regs", ">d"),
         ("vs_upstream", "vs upstream", ">.2f")]
MODEL = [("gpu", "GPU", "<"), ("count", "instructions", "<"), ("warp_instructions", "warp-instr/slab", ">,.0f"),
         ("clock_ghz", "GHz", ">.2f"), ("issue_us", "issue us", ">.3f"), ("slab_bytes", "bytes/slab", ">,.0f"),
         ("memory_us", "memory us", ">.3f"), ("ratio", "issue/memory", ">.2f")]


def replay_rows(Ks) -> list[dict]:
    """Executed counts per ring position of the flagship replay kernel, both output modes, and the
    issue model per GPU averaged over the positions (``mamba3_step.tools.issue_model.replay_issue_model``)."""
    rows = []
    stepwise = replay_instructions(flagship_spec())[0]
    for from_checkpoint in (False, True):
        for K in Ks:
            spec = flagship_spec(replay_ring=K, replay_from_checkpoint=from_checkpoint)
            counts = replay_instructions(spec)
            row = {"K": K, "outputs": "from checkpoint" if from_checkpoint else "replayed (exact)",
                   "num_warps": spec.num_warps, "per_position": list(counts), "stepwise": stepwise,
                   "instructions": sum(counts) / K / stepwise,
                   "matches_REPLAY_EXECUTED": REPLAY_EXECUTED.get((K, from_checkpoint)) == (spec.num_warps, counts)
                   and REPLAY_EXECUTED["stepwise"] == stepwise}
            if (K, from_checkpoint) in REPLAY_EXECUTED:
                for name, gpu in GPUS.items():
                    m = replay_issue_model(K, from_checkpoint, gpu)
                    row[f"ratio_{name}"], row[f"time_{name}"] = m["ratio"], m["time"]
            rows.append(row)
    return rows


REPLAY_TABLE = [("K", "K", ">d"), ("outputs", "append outputs", "<"), ("num_warps", "warps", ">d"),
                ("per_position", "executed per ring position", "<"), ("instructions", "x stepwise", ">.2f")] + [
    col for g in GPUS for col in ((f"ratio_{g}", f"{g} issue/mem", ">.2f"), (f"time_{g}", f"{g} time x", ">.3f"))]


def replay_states_rows(measured: dict | None = None) -> list[dict]:
    """Each :data:`REPLAY_STATES_EXECUTED` entry executed again (stepwise and per ring position), its
    issue model per GPU (``replay_states_issue_model``) and, where ``measured`` (``{entry: time ratio}``,
    ``gpu_results.states_times``) holds it, the measured time over the stepwise step's."""
    measured = measured or {}
    rows = []
    for name, (_, K, stepwise_count, counts) in REPLAY_STATES_EXECUTED.items():
        spec, _ = replay_states_spec(name)
        stepwise = replay_instructions(spec.with_default_tiling())[0]
        executed = replay_instructions(replay_states_replay_spec(name))
        row = {"states": name, "K": K, "stepwise": stepwise, "per_position": list(executed),
               "matches": (stepwise, executed) == (stepwise_count, counts), "measured_x": measured.get(name)}
        for g, gpu in GPUS.items():
            m = replay_states_issue_model(name, gpu)
            row.update({"bytes": m["bytes"], "instructions": m["instructions"], f"step_{g}": m["stepwise_ratio"],
                        f"ratio_{g}": m["ratio"], f"time_{g}": m["time"]})
        rows.append(row)
    return rows


STATES_TABLE = [("states", "states", "<"), ("K", "K", ">d"), ("stepwise", "stepwise", ">,d"),
                ("per_position", "replay per ring position", "<"), ("bytes", "bytes x", ">.3f"),
                ("instructions", "instr. x", ">.2f")] + [
    col for g in GPUS for col in ((f"step_{g}", f"{g} stepwise issue/mem", ">.2f"), (f"ratio_{g}", f"{g} replay", ">.2f"),
                                  (f"time_{g}", f"{g} time x", ">.2f"))] + [
    ("measured_x", "measured x", ">.2f")]


def print_states(measured: dict | None) -> list[dict]:
    """:func:`replay_states_rows` with the times of ``measured`` (a bench/gpu_bench.py result, or None),
    printed; the rows."""
    states = replay_states_rows(None if measured is None else gpu_results.states_times(measured))
    print("\nreplay kernel with the other states, flagship, plain decode (outputs replayed or from the "
          "checkpoint, B = 256, H = 48): executed PTX warp-instructions per slab, and the issue model averaged "
          "over the ring positions (time relative to the same states' stepwise step; 'measured x' is not a "
          "model: suite replay-states of bench/gpu_bench.py"
          + ("" if measured is None else f", {gpu_results.describe(measured)}") + ")")
    print(_util.format_table(states, [c for c in STATES_TABLE if c[0] != "measured_x" or measured is not None]))
    return states


def plot(rows: list[dict], path) -> str | None:
    plt = _util.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(11, 4.5))
    short = {"upstream, static SASS": "upstream\nSASS", "this project, static SASS": "ours\nSASS",
             "this project, executed PTX": "ours\nexec. PTX"}
    labels = [f"{r['gpu']}\n{short[r['count']]}\n{r['ratio']:.2f}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["issue_us"] for r in rows], 0.4, label="issue time")
    ax.bar([x + 0.2 for x in xs], [r["memory_us"] for r in rows], 0.4, label="memory time")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_xlabel("GPU / instruction count / issue-to-memory ratio")
    ax.set_ylabel("microseconds per state slab per SM")
    ax.set_title("flagship step: issue vs memory time per slab (static model, no GPU measurement)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--no-execute", action="store_true", help="static counts only (skip the PTX tier)")
    p.add_argument("--tokens", default="2,4,8", help="T values of the speculative step to model ('' for none)")
    p.add_argument("--replay", default="2,4,8", help="K values of the replay kernel to execute ('' for none)")
    p.add_argument("--replay-states", action="store_true",
                   help="also execute the replay kernel with rotary, stochastic rounding and an int8 state")
    p.add_argument("--measured", default=None, metavar="GPU_BENCH_JSON",
                   help="with --replay-states: a bench/gpu_bench.py result (gpu_bench.json) whose suite "
                        "replay-states' times at B = 256 go beside the model ('measured x')")
    args = p.parse_args(argv)
    if args.measured is not None and not args.replay_states:
        p.error("--measured: sets suite replay-states' times beside the --replay-states table; give --replay-states")
    try:
        measured = None if args.measured is None else gpu_results.load(args.measured)
    except ValueError as e:
        p.error(str(e))
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        replay_ks = [int(k) for k in args.replay.split(",") if k.strip()]
    except ValueError:
        p.error(f"--tokens/--replay: expected comma-separated ints, got {args.tokens!r} / {args.replay!r}")
    if args.no_execute:
        replay_ks = []
    t0 = time.perf_counter()
    spec = flagship_spec()
    compiled = compiled_rows(spec)
    executed = None if args.no_execute else executed_facts(spec)["warp_instructions_per_cta"]["total"]
    rows = model_rows(spec, compiled, executed)
    print("warp-instructions per (64 x 128) state slab, flagship (upstream: stated constant)")
    print(_util.format_table(compiled, TABLE))
    print("\nissue model per SM and slab: issue time = warp-instructions / (4 per clock x clock), memory "
          "time = bytes per slab / (HBM bandwidth / SMs)")
    print(_util.format_table(rows, MODEL))
    spec_rows = token_rows(tokens)
    if spec_rows:
        print("\nspeculative verify step, flagship, T tokens ((B, K) sources, a row per token, update_kv_state): "
              "static SASS; a ratio uses the GPU's own target (H100/H200: sm_90a, B200: sm_100a)")
        print(_util.format_table(spec_rows, [c for c in TOKENS_TABLE
                                             if any(c[0] in r for r in spec_rows)]))
    replay = replay_rows(replay_ks)
    if replay:
        print("\nreplay kernel, flagship, plain decode: executed PTX warp-instructions per slab at each ring "
              "position, and the issue model averaged over the positions (B = 256, H = 48; time relative to "
              "the stepwise step's)")
        print(_util.format_table(replay, [c for c in REPLAY_TABLE if any(c[0] in r for r in replay)]))
        stale = [f"K={r['K']} {r['outputs']}" for r in replay if not r["matches_REPLAY_EXECUTED"]]
        if stale:
            print(f"  ! mamba3_step.tools.issue_model.REPLAY_EXECUTED differs from this execution for {', '.join(stale)}: "
                  "update it")
    states = print_states(measured) if args.replay_states and not args.no_execute else []
    if states:
        stale = [r["states"] for r in states if not r["matches"]]
        if stale:
            print(f"  ! mamba3_step.tools.issue_model.REPLAY_STATES_EXECUTED differs from this execution for "
                  f"{', '.join(stale)}: update it")
    out = _util.results_dir(args.out)
    payload = {"what": "static SASS counts, executed PTX counts and a model; the replay-states rows' "
               "measured_x is a GPU measurement (the rest is not)",
               "measured_on": None if measured is None else gpu_results.describe(measured),
               "environment": _util.environment(), "compiled": compiled, "model": rows, "tokens": spec_rows,
               "replay": replay, "replay_states": states,
               "gpus": {k: vars(v) | {"clock_hz": v.clock_hz} for k, v in GPUS.items()}}
    print(f"\nwrote {_util.write_json(out / 'issue_model.json', payload)}")
    png = plot(rows, out / "issue_model.png")
    if png:
        print(f"wrote {png}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
