"""Suite ``replay``: the replay kernel against the stepwise kernel, at the flagship configuration (N=128,
D=64, R=4, fp32 state, bf16 B/C/x/z and projections, pool mode with update_kv_state), per batch size.

1. Check: a decode of 2K + 1 steps from empty rings through ``mamba3_step_fn`` in its replay mode and
   ``mamba3_step_fn`` on twin pools: with outputs replayed every ``out``, and every row at its flush,
   bit-identical; with outputs from the checkpoint a flush's ``out`` and rows bit-identical and an
   append's ``out`` within 2% (a different rounding). Every timed variant is checked.
2. Timing, eager and CUDA-graph replay: the stepwise step, then per K the replay step with outputs
   replayed and from the checkpoint, the rows' ring positions staggered (row r at position r % K) so
   that a step costs the average over positions; each timed call advances the rings as a server's
   would. ``--replay-warps 8`` adds per K the replayed step at 8 warps a CTA (column ``warps``),
   ``--checkpoint-warps 4`` the step with outputs from the checkpoint at 4 warps a CTA, and
   ``--min-ctas 3`` the replayed step at a launch bound of 3 CTAs an SM (``StepSpec.min_ctas_per_sm``).

Reports microseconds per step, the speed-up over the stepwise step, and the bytes model's ratio
(``mamba3_step.tools.bytes_model.replay_bytes``) beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import _util

from mamba3_step import mamba3_step_fn, new_ring
from mamba3_step.replay_validation import check_replay_inputs
from mamba3_step.signature import StepOptions
from mamba3_step.tools.bytes_model import bytes_per_step, replay_bytes
from mamba3_step.launch import kernel_for
from mamba3_step.spec import flagship_spec
from mamba3_step.tensors import StepTensors, kernel_arguments
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors

from .common import Run, int_list
from .timing import Timer, add_speedups, eager_and_graph_us

NAME = "replay"
BATCHES = "1,64,256"
D, N, R = 64, 128, 4


@dataclass
class Options:
    run: Run
    batches: tuple[int, ...]
    ks: tuple[int, ...]
    replay_warps: tuple[int, ...]
    checkpoint_warps: tuple[int, ...]
    min_ctas: tuple[int, ...]


def add_arguments(parser) -> None:
    group = parser.add_argument_group("suite replay")
    group.add_argument("--replay-warps", default="", help="also time the replayed step at these warps a CTA (e.g. 8)")
    group.add_argument("--checkpoint-warps", default="",
                       help="also time the step with outputs from the checkpoint at these warps a CTA (e.g. 4)")


def configure(args, run: Run) -> Options:
    return Options(run, run.batches_or(BATCHES), int_list(args.ks, "--ks"),
                   int_list(args.replay_warps, "--replay-warps", allow_empty=True),
                   int_list(args.checkpoint_warps, "--checkpoint-warps", allow_empty=True),
                   int_list(args.min_ctas, "--min-ctas", allow_empty=True))


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
        stagger_ring(self.ring, self.K)
        return self


def stagger_ring(ring, K: int) -> None:
    """Row r's ring at position r % K."""
    positions = torch.arange(ring.length.shape[0], device=ring.length.device) % K
    ring.length.copy_(positions[:, None].to(torch.int32).expand_as(ring.length))


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


def check_one(batch: int, heads: int, K: int, device, num_warps: int | None = None,
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


def check(opts: Options) -> list[str]:
    """The first failure of every variant :func:`measure` times, at every batch size ([] when none)."""
    variants = [(K, w, False, 0) for K in opts.ks for w in [None, *opts.replay_warps]]
    variants += [(K, w, True, 0) for K in opts.ks for w in opts.checkpoint_warps]
    variants += [(K, None, False, m) for K in opts.ks for m in opts.min_ctas]
    for batch in opts.batches:
        for K, warps, fc, bound in variants:
            problem = check_one(batch, opts.run.heads, K, opts.run.device, warps, fc, bound)
            if problem:
                return [problem]
    return []


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


def measure(opts: Options) -> dict:
    run = opts.run
    rows = [r for batch in opts.batches
            for r in bench(batch, run.heads, opts.ks, run.device, run.graphs, run.target_s(200.0, 50.0),
                           opts.replay_warps, opts.checkpoint_warps, opts.min_ctas)]
    return {"what": "step times, replay kernel vs stepwise kernel; bytes x: the bytes model's ratio",
            "heads": run.heads, "rows": rows}


COLUMNS = [("batch", "B", ">d"), ("step", "step", "<"), ("outputs", "append outputs", "<"),
           ("num_warps", "warps", ">d"), ("min_ctas", "CTAs bound", ">d"), ("bytes_ratio", "bytes x", ">.3f"),
           ("us_eager", "eager us", ">.1f"), ("speedup_eager", "eager speed-up", ">.2f"),
           ("us_graph", "graph us", ">.1f"), ("speedup_graph", "graph speed-up", ">.2f")]


def report(result: dict) -> str:
    rows = result["rows"]
    return (f"replay vs stepwise, flagship, H={result['heads']} (bytes x: the model's ratio)\n"
            + _util.format_table(rows, [c for c in COLUMNS if any(c[0] in r for r in rows)]))
