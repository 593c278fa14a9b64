"""GPU benchmark of replay: the replay kernel against the stepwise kernel, measured.

    python bench/gpu_replay_bench.py [--batches 1,64,256] [--heads 48] [--ks 2,4,8] [--replay-warps 8]
                                     [--checkpoint-warps 4] [--min-ctas 3] [--out DIR] [--no-graph]

Without a CUDA device it prints "no CUDA device: GPU replay benchmark not run" and exits 0
(``--device cpu`` runs the plumbing on the CPU path: a smoke test, not a benchmark).

At the flagship configuration (N=128, D=64, R=4, fp32 state, bf16 B/C/x/z and projections, pool
mode with update_kv_state), for every batch size:

1. Correctness first: a decode of 2K + 1 steps from empty rings through
   ``mamba3_step_fn`` in its replay mode (the replay kernel, outputs replayed) and ``mamba3_step_fn`` (the
   stepwise kernel) on twin pools: every ``out`` and every row at its flush must be bit-identical.
   If not, it prints what failed and no timing, and exits 1.
2. Timing with CUDA events, eager and CUDA-graph replay: the stepwise step, and the replay step
   for each K with outputs replayed and from the checkpoint, the rows' ring positions staggered
   (row r at position r % K) so that a step costs the average over positions; each timed call
   advances the rings as a server's would. ``--replay-warps 8`` adds, per K, the replayed step at
   8 warps a CTA (column ``warps``; else each step runs its default tiling): at K = 4 it compiles to
   128 registers, 2 CTAs = 16 warps per SM, against the 4-warp default's 194 registers and 8 warps
   per SM, for 2.07x the stepwise step's instructions against 1.78x (docs/performance.md, 3d).
   ``--checkpoint-warps 4`` adds the step with outputs from the checkpoint at 4 warps a CTA, checked
   first (every flush's ``out`` and rows bit-identical to the stepwise kernel's, every append's ``out``
   within 2% of it): 184 registers and 2 CTAs = 8 warps per SM on sm_90a, against its 8-warp
   default's 149 registers and one CTA of 8 warps. ``--min-ctas 3`` adds, per K, the replayed step at
   a launch bound of 3 CTAs an SM (column ``CTAs bound``; ``StepSpec.min_ctas_per_sm``), checked bit
   for bit first: at K = 4, 168 registers and 56 bytes of stack on sm_90a against 194 registers and
   2 CTAs without it (docs/performance.md, 3d).

Reports microseconds per step, the speed-up over the stepwise step, and the bytes model's ratio
(``mamba3_step.bytes_model.replay_bytes``) beside it; ``gpu_replay_bench.json`` in
``bench/results/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

from gpu_bench import Timer, add_speedups, eager_and_graph_us  # noqa: E402

from mamba3_step import mamba3_step_fn, new_ring  # noqa: E402
from mamba3_step.replay_validation import check_replay_inputs  # noqa: E402
from mamba3_step.signature import StepOptions  # noqa: E402
from mamba3_step.bytes_model import bytes_per_step, replay_bytes  # noqa: E402
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_spec  # noqa: E402
from mamba3_step.launch import kernel_for  # noqa: E402
from mamba3_step.tensors import StepTensors, kernel_arguments  # noqa: E402
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors  # noqa: E402

NO_CUDA_MESSAGE = "no CUDA device: GPU replay benchmark not run"
D, N, R = 64, 128, 4


class Layer:
    """One layer's pools (rows = lanes), weights, a ring, and one lane-input set, on ``device``."""

    def __init__(self, batch: int, heads: int, K: int, device, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.pools = row_tensors(batch, heads, D, N, R, generator=g, device=device)
        self.w = layer_weights(heads, D, R, generator=g, device=device)
        self.lane = lane_inputs(batch, heads, D, N, R, generator=g, device=device)
        self.ring = new_ring(batch, K, R, heads, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, device=device)
        self.index = torch.arange(batch, dtype=torch.int32, device=device)
        self.out = torch.empty(batch, heads, D, dtype=torch.bfloat16, device=device)
        self.K = K

    def call(self) -> StepTensors:
        p, w, x = self.pools, self.w, self.lane
        return StepTensors(p["state"], p["Bstate"], p["Xstate"], x["A"], x["B"], x["C"], w["D"], x["x"], x["dt"],
                           x["trap"], w["xproj"], outproj=w["outproj"], out=self.out, z=x["z"], zproj=w["zproj"],
                           state_batch_indices=self.index)

    def stepwise(self):
        return mamba3_step_fn(**self.call()._asdict(), update_kv_state=True)

    def dense(self):
        """The stepwise step in dense mode (lane b on row b, no index): the same rows as
        :meth:`stepwise` reads through its identity index."""
        return mamba3_step_fn(**self.call()._replace(state_batch_indices=None)._asdict(), update_kv_state=True)

    def replay(self, from_checkpoint: bool = False, num_warps: int | None = None, min_ctas: int = 0):
        return bounded_replay(self.call(), self.ring, self.K, from_checkpoint, num_warps, min_ctas)

    def stagger(self) -> "Layer":
        """Row r's ring at position r % K, so that a step costs the average over positions."""
        positions = torch.arange(self.ring.length.shape[0], device=self.ring.length.device) % self.K
        self.ring.length.copy_(positions[:, None].to(torch.int32).expand_as(self.ring.length))
        return self


def bounded_replay(tensors: StepTensors, ring, K: int, from_checkpoint: bool = False, num_warps: int | None = None,
                   min_ctas: int = 0):
    """``mamba3_step_fn`` in its replay mode (``replay_ring``, flush length ``K``), or with ``min_ctas``
    on CUDA the same launch at that launch bound (``StepSpec.min_ctas_per_sm``: an experiment's knob, no
    public option, so launched here as ``mamba3_step_fn`` launches; on the CPU path there is no bound
    to set)."""
    t = tensors._replace(replay_ring=ring)
    options = StepOptions(update_kv_state=True, num_warps=num_warps, stochastic_rounding=t.rand_seed is not None,
                          replay_flush_length=K, replay_from_checkpoint=from_checkpoint)
    if not min_ctas or not tensors.x.is_cuda:
        return mamba3_step_fn(**t._asdict(), **options._asdict())
    spec = check_replay_inputs(t, options)
    t = t.with_out()
    kernel_for(spec.replace(min_ctas_per_sm=min_ctas), t.x)(*kernel_arguments(t.one_token_squeezed()))
    return t.out


def add_min_ctas_argument(parser) -> None:
    """``--min-ctas``: the launch bounds at which a benchmark also times the replayed step (:func:`bounded_replay`)."""
    parser.add_argument("--min-ctas", default="",
                        help="also time the replayed step at these launch bounds, CTAs an SM "
                             "(e.g. 3; StepSpec.min_ctas_per_sm)")


def check(batch: int, heads: int, K: int, device, num_warps: int | None = None,
          from_checkpoint: bool = False, min_ctas: int = 0) -> str | None:
    """What differs between a replay decode (at ``num_warps`` warps a CTA, else the default; at the
    launch bound ``min_ctas``, else none) and a stepwise decode of 2K + 1 steps, or None: every ``out``
    bit for bit with outputs replayed; from the checkpoint, a flush's ``out`` bit for bit and an
    append's within 2% (a different rounding)."""
    a, b = Layer(batch, heads, K, device, seed=batch), Layer(batch, heads, K, device, seed=batch)
    g = torch.Generator().manual_seed(K)
    what = (f"B={batch} K={K} warps={num_warps or 'default'}" + (" from the checkpoint" if from_checkpoint else "")
            + (f" at {min_ctas} CTAs an SM" if min_ctas else ""))
    for step in range(2 * K + 1):
        fresh = lane_inputs(batch, heads, D, N, R, generator=g, device=device)
        for layer in (a, b):
            for k, v in fresh.items():
                layer.lane[k].copy_(v)
        got, want = a.replay(from_checkpoint, num_warps, min_ctas).clone(), b.stepwise()
        flushed = int(a.ring.length[0, 0]) == 0
        exact = flushed or not from_checkpoint
        if not (bits_equal(got, want) if exact else torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)):
            return f"{what} step {step}: out differs from the stepwise kernel's"
        if flushed and not all(bits_equal(a.pools[k], b.pools[k]) for k in a.pools):
            return f"{what} step {step}: the flushed rows differ from stepwise decoding"
    return None


def bench(batch: int, heads: int, Ks, device, graphs: bool, target_s: float, replay_warps=(),
          checkpoint_warps=(), min_ctas=()) -> list[dict]:
    """Timed rows: the stepwise step, then per K replayed and from the checkpoint at the default tiling,
    replayed at each of ``replay_warps`` warps a CTA and from the checkpoint at each of
    ``checkpoint_warps`` (``num_warps`` set in those rows only), replayed at each launch bound of
    ``min_ctas`` (``min_ctas`` set in those rows only)."""
    timer = Timer(device)
    spec = flagship_spec()
    base_bytes = bytes_per_step(spec, batch, heads)["total"]
    runs = [("stepwise", 1, False, None, None)] + [(f"replay K={K}", K, fc, None, None) for K in Ks
                                                     for fc in (False, True)]
    runs += [(f"replay K={K}", K, False, w, None) for K in Ks for w in replay_warps]
    runs += [(f"replay K={K}", K, True, w, None) for K in Ks for w in checkpoint_warps]
    runs += [(f"replay K={K}", K, False, None, m) for K in Ks for m in min_ctas]
    rows = []
    for name, K, fc, warps, bound in runs:
        layer = Layer(batch, heads, max(K, 2), device, seed=1).stagger()
        fn = layer.stepwise if name == "stepwise" else (
            lambda layer=layer, fc=fc, w=warps, m=bound: layer.replay(fc, w, m or 0))
        row = {"batch": batch, "heads": heads, "step": name, "K": K if name != "stepwise" else None,
               "outputs": None if name == "stepwise" else ("from checkpoint" if fc else "replayed"),
               "num_warps": warps, "min_ctas": bound,
               "bytes_ratio": 1.0 if name == "stepwise" else replay_bytes(spec, K, batch, heads)["total"] / base_bytes,
               **eager_and_graph_us(timer, fn, graphs, target_s)}
        rows.append(row)
    return add_speedups(rows)


COLUMNS = [("batch", "B", ">d"), ("step", "step", "<"), ("outputs", "append outputs", "<"), ("num_warps", "warps", ">d"),
           ("min_ctas", "CTAs bound", ">d"),
           ("bytes_ratio", "bytes x", ">.3f"), ("us_eager", "eager us", ">.1f"), ("speedup_eager", "eager speed-up", ">.2f"),
           ("us_graph", "graph us", ">.1f"), ("speedup_graph", "graph speed-up", ">.2f")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _util.add_gpu_bench_arguments(p, "1,64,256", FLAGSHIP_HEADS)
    p.add_argument("--ks", default="2,4,8", help="flush lengths K (default 2,4,8)")
    p.add_argument("--replay-warps", default="", help="also time the replayed step at these warps a CTA (e.g. 8)")
    p.add_argument("--checkpoint-warps", default="",
                   help="also time the step with outputs from the checkpoint at these warps a CTA (e.g. 4)")
    add_min_ctas_argument(p)
    args = p.parse_args(argv)
    try:
        batches = [int(v) for v in args.batches.split(",")]
        Ks = [int(v) for v in args.ks.split(",")]
        replay_warps = [int(v) for v in args.replay_warps.split(",") if v]
        checkpoint_warps = [int(v) for v in args.checkpoint_warps.split(",") if v]
        min_ctas = [int(v) for v in args.min_ctas.split(",") if v]
    except ValueError:
        p.error(f"--batches/--ks/--replay-warps/--checkpoint-warps/--min-ctas: expected comma-separated ints, got "
                f"{args.batches!r} / {args.ks!r} / {args.replay_warps!r} / {args.checkpoint_warps!r} / "
                f"{args.min_ctas!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    target_s = 0.05 if args.device == "cpu" else 0.2
    for batch in batches:
        checks = [(K, w, False, 0) for K in Ks for w in [None, *replay_warps]]
        checks += [(K, w, True, 0) for K in Ks for w in checkpoint_warps]
        checks += [(K, None, False, m) for K in Ks for m in min_ctas]
        for K, warps, fc, bound in checks:
            problem = check(batch, args.heads, K, args.device, warps, fc, bound)
            if problem:
                print(f"CORRECTNESS FAILURE, no timing: {problem}")
                return 1
    rows = [r for batch in batches
            for r in bench(batch, args.heads, Ks, args.device, not args.no_graph, target_s, replay_warps,
                           checkpoint_warps, min_ctas)]
    print(f"replay vs stepwise, flagship, H={args.heads}, {args.device} (measured; bytes x: the model's ratio)")
    print(_util.format_table(rows, [c for c in COLUMNS if any(c[0] in r for r in rows)]))
    out = _util.results_dir(args.out)
    payload = {"what": "measured step times (CUDA events), replay kernel vs stepwise kernel" if args.device == "cuda"
               else "CPU smoke run of the plumbing: not a benchmark", "environment": _util.environment(), "rows": rows}
    print(f"wrote {_util.write_json(out / 'gpu_replay_bench.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
