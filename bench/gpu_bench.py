"""GPU benchmark, measured: one entry, four suites that share their shape (check bit for bit, then time
eager calls and CUDA-graph replay with CUDA events, then report a table).

    python bench/gpu_bench.py [--suite step|replay|replay-states|replay-verify|all|a,b,...]
                              [--batches ...] [--heads 48] [--out DIR] [--no-graph] [--no-plot] [--target-ms MS]
                              [--padded-rows] [--dense-rows]                            (suite step)
                              [--async-copy] [--unpinned-loads] [--late-epilogue] [--upstream PATH] [--step-state-dtype bfloat16]  (suite step)
                              [--ks 2,4,8] [--replay-warps 8] [--checkpoint-warps 4]   (suite replay)
                              [--forms rotary,bf16-sr,int8,int8-F4]                     (suite replay-states)
                              [--tokens 4] [--outputs replayed,checkpoint]             (suite replay-verify)
                              [--min-ctas 3]                                  (suites step, replay, replay-states)

Suites (each module's docstring under ``bench/gpu_suites/`` says what it checks and times):

* ``step`` (the default): pool mode vs gather -> dense -> scatter vs dense mode, microseconds, GB/s and
  percent of the copy bandwidth measured in the same run; batches 1..512.
* ``replay``: the replay kernel's one-token steps against the stepwise step; batches 1, 64, 256.
* ``replay-states``: replay with the rotary angle, a stochastically rounded bf16 state and int8 states
  against each state's stepwise step, beside the issue model's H200 ratio; batch 256 (on a GPU most of
  its time is compiling: 75-95 s a form on an H200).
* ``replay-verify``: replay's verify steps (T drafts in the ring) against today's verify step (a state
  row per draft); batches 1, 64, 256.

Every selected suite's checks run before any timing; if one fails, it prints what failed, times
nothing, writes nothing and exits 1. Then each suite is timed in turn and its table printed as soon as
it is done; ``gpu_bench.json`` in ``bench/results/`` (or ``--out``) holds every finished suite's rows
under ``"suites"`` (rewritten after each suite, so a run stopped by a time limit keeps the suites it
finished), with ``gpu_bench.png`` (suite step) and ``gpu_bench_replay.png`` (the replay suites'
speed-ups) when matplotlib is there. ``bench/model_bench.py --measured`` and ``bench/issue_model.py
--measured`` set this JSON's times beside their models.

Without a CUDA device it prints "no CUDA device: GPU benchmark not run" and exits 0; ``--device cpu``
runs the same plumbing on CPU tensors (the PyTorch path, perf_counter timing, no graphs): a smoke test
of this script, not a benchmark.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

from gpu_suites import replay, replay_states, replay_verify, step  # noqa: E402
from gpu_suites.common import Run, device_environment, int_list  # noqa: E402
from gpu_suites.replay_plot import plot_speedups  # noqa: E402
from mamba3_step.spec import FLAGSHIP_HEADS  # noqa: E402

NO_CUDA_MESSAGE = "no CUDA device: GPU benchmark not run"
#: suite name -> its module, in the order an ``all`` run takes them
SUITES = {m.NAME: m for m in (step, replay, replay_verify, replay_states)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="step",
                   help=f"comma-separated suites, or all (default step): {', '.join(SUITES)}")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default: each suite's own)")
    p.add_argument("--heads", type=int, default=FLAGSHIP_HEADS, help=f"H (default {FLAGSHIP_HEADS})")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: smoke-test the plumbing on the PyTorch path (not a benchmark)")
    p.add_argument("--no-graph", action="store_true", help="eager calls only")
    p.add_argument("--target-ms", type=float, default=None,
                   help="time per measurement repetition (default: step 60; the replay suites 200, 50 on the CPU)")
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    p.add_argument("--ks", default="2,4,8", help="flush lengths K of suites replay and replay-verify (default 2,4,8)")
    p.add_argument("--min-ctas", default="",
                   help="suites replay and replay-states: also time the replayed step at these launch bounds, CTAs "
                        "an SM (e.g. 3; StepSpec.min_ctas_per_sm); suite step: pool mode's kernels at them")
    for suite in SUITES.values():
        suite.add_arguments(p)
    return p


def suite_names(text: str) -> list[str]:
    """``"all"`` or a comma-separated subset of :data:`SUITES`, in the order given; a ValueError else."""
    names = list(SUITES) if text == "all" else text.split(",")
    unknown = [n for n in names if n not in SUITES]
    if unknown or not names:
        raise ValueError(f"--suite: expected all or a comma-separated subset of {','.join(SUITES)}, got {text!r}")
    return names


def configure(args, step_fn=None, reference_fn=None) -> dict:
    """``{suite name: its options}``, every option checked (a ValueError naming it)."""
    if args.heads < 1:
        raise ValueError(f"--heads: expected an int >= 1, got {args.heads}")
    batches = None if args.batches is None else int_list(args.batches, "--batches")
    run = Run(args.device, args.heads, batches, graphs=not args.no_graph, target_ms=args.target_ms)
    return {name: (step.configure(args, run, step_fn, reference_fn) if name == step.NAME
                   else SUITES[name].configure(args, run)) for name in suite_names(args.suite)}


def main(argv: list[str] | None = None, step_fn=None, reference_fn=None) -> int:
    """Check every selected suite, then time them in turn (module doc); ``step_fn``/``reference_fn``
    replace the step suite's kernel entry and PyTorch path (the tests' corrupted steps)."""
    p = parser()
    args = p.parse_args(argv)
    try:
        options = configure(args, step_fn, reference_fn)
    except ValueError as e:
        p.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    run = next(iter(options.values())).run
    run.env = device_environment(args.device, _util.environment()) | {"heads": args.heads}
    print(f"GPU benchmark (measured): {run.env['device']}, {run.env['date_utc']}; suites {', '.join(options)}",
          flush=True)
    for name, opts in options.items():  # 1. every check before any timing
        failures = SUITES[name].check(opts)
        if failures:
            print(f"CORRECTNESS FAILURE in suite {name}; no timing is reported:\n" + "\n".join(failures))
            return 1
    if "graph_error" in run.env:
        print(f"CUDA-graph capture failed, graph replay not measured: {run.env['graph_error']}")
    out = _util.results_dir(args.out)
    payload = {"what": "measured on a GPU (CUDA events)" if run.cuda else "CPU smoke run of the plumbing: not a "
               "benchmark", "environment": run.env, "suites": {}}
    for name, opts in options.items():  # 2. timing, a suite at a time
        result = SUITES[name].measure(opts)
        payload["suites"][name] = result
        print(f"\n== suite {name}\n{SUITES[name].report(result)}", flush=True)
        _util.write_json(out / "gpu_bench.json", payload)
    print(f"wrote {out / 'gpu_bench.json'}")
    if not args.no_plot:
        write_plots(payload, out)
    return 0


def write_plots(payload: dict, out) -> None:
    """``gpu_bench.png`` (suite step) and ``gpu_bench_replay.png`` (the replay suites), where they ran."""
    env, suites = payload["environment"], payload["suites"]
    title = f"{env['device']} ({env['date_utc']}), flagship H={env['heads']}"
    if step.NAME in suites:
        _util.write_plot(lambda png: step.plot(suites[step.NAME], f"{title}\nmeasured; solid = CUDA graph, "
                                               "dashed = eager", png), out / "gpu_bench.png")
    replays = {name: result for name, result in suites.items() if name != step.NAME}
    if replays:
        _util.write_plot(lambda png: plot_speedups(replays, title, png), out / "gpu_bench_replay.png")


if __name__ == "__main__":
    sys.exit(main())
