"""Suite ``replay-states``: replay with Mamba-3's other per-request states against the stepwise step.

The forms are those whose cost ``bench/issue_model.py --replay-states`` models from executed
instruction counts (``mamba3_step.tools.issue_model.REPLAY_STATES_EXECUTED``): the flagship rotary layer
(S = 32 angles, B/C biases, B/C shared by the heads) at K = 4, a bf16 state with stochastic rounding at
K = 4, an int8 state (stochastic rounding, per-row scales) at K = 2 and K = 4. For each form and batch
size, in pool mode with one row per lane:

1. Check: 2K + 1 steps from empty rings, replay (outputs replayed) against the stepwise kernel on twin
   inputs: every ``out`` bit for bit, and the rows bit for bit at each flush (scales and angles
   included); then the same with outputs from the checkpoint: a flush's ``out`` and rows bit for bit,
   an append's ``out`` within 5% of the stepwise ``out``'s largest magnitude (a different rounding: a
   stepwise 8-bit decode rounds every intermediate state to 8 bits, an append reads the checkpoint and
   the ring unrounded). The seed's offset advances every step, as ``decode_step`` advances it.
2. Timing, eager and CUDA-graph replay: the stepwise step, then replay with outputs replayed and from
   the checkpoint, rows' rings staggered (row r at position r % K). ``--min-ctas 3`` adds the replayed
   step at a launch bound of 3 CTAs an SM (outputs "replayed, 3 CTAs"), checked bit for bit first.

Prints microseconds per step, the speed-up over the stepwise step, the time over the stepwise step's
(``time x``: CUDA graph when timed, else eager) and beside it the issue model's predicted time ratio for
H200 (``replay_states_issue_model``: the larger of memory and issue time). Each form's table is printed
as soon as it is timed (most of a form's time on a GPU is compiling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import _util

from mamba3_step import mamba3_step_fn, new_ring
from mamba3_step.tools.issue_model import GPUS, REPLAY_STATES_EXECUTED, replay_states_issue_model, replay_states_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, inputs_for

from .common import Run, int_list
from .replay import bounded_replay, stagger_ring
from .timing import Timer, add_speedups, eager_and_graph_us

NAME = "replay-states"
BATCHES = "256"
#: command-line name -> the REPLAY_STATES_EXECUTED entry (its replayed form; "<entry>, from the checkpoint" the other)
FORMS = {"rotary": "rotary", "bf16-sr": "bf16 state, stochastic rounding", "int8": "int8 state",
         "int8-F4": "int8 state, F = 4"}
#: the fields a step's inputs change each step (the rest: rows, weights, the seed)
LANE_FIELDS = ("A", "B", "C", "x", "dt", "trap", "z", "angle_proj")


@dataclass
class Options:
    run: Run
    batches: tuple[int, ...]
    entries: tuple[str, ...]
    min_ctas: tuple[int, ...]


def add_arguments(parser) -> None:
    group = parser.add_argument_group("suite replay-states")
    group.add_argument("--forms", default=",".join(FORMS), help=f"which forms (default {','.join(FORMS)})")


def configure(args, run: Run) -> Options:
    names = args.forms.split(",")
    unknown = [f for f in names if f not in FORMS]
    if unknown:
        raise ValueError(f"--forms: expected some of {','.join(FORMS)}, got {unknown}")
    entries = tuple(FORMS[f] for f in names)
    assert all(e in REPLAY_STATES_EXECUTED for e in entries)
    return Options(run, run.batches_or(BATCHES), entries, int_list(args.min_ctas, "--min-ctas", allow_empty=True))


class Layer:
    """One form's pools (rows = lanes), weights, lane inputs and a ring, on ``device``."""

    def __init__(self, entry: str, batch: int, heads: int, device, seed: int):
        self.spec, self.K = replay_states_spec(entry)
        inputs = inputs_for(self.spec, batch, batch, H=heads, seed=seed, device=device)
        self.t = StepTensors(**{k: v for k, v in inputs.items() if k in StepTensors._fields},
                             out=torch.empty(batch, heads, self.spec.headdim, dtype=torch.bfloat16, device=device),
                             state_batch_indices=torch.arange(batch, dtype=torch.int32, device=device))
        t, s = self.t, self.spec
        self.ring = new_ring(batch, self.K, s.mimo, heads, s.dstate, s.headdim, kv_dtype=t.Bstate.dtype,
                             x_dtype=t.Xstate.dtype, stochastic=s.stochastic_rounding, rope_angles=s.rope_angles,
                             device=device)

    def rows(self) -> dict:
        return {k: getattr(self.t, k) for k in ("state", "Bstate", "Xstate", "angle_state", "state_scale")
                if getattr(self.t, k) is not None}

    def stepwise(self):
        return mamba3_step_fn(**self.t._asdict(), update_kv_state=True,
                              stochastic_rounding=self.spec.stochastic_rounding)

    def replay(self, from_checkpoint: bool = False, min_ctas: int = 0):
        return bounded_replay(self.t, self.ring, self.K, from_checkpoint, min_ctas=min_ctas)

    def advance(self) -> None:
        """The seed's offset moves on one token, as ``decode_step`` moves it."""
        if self.t.rand_seed is not None:
            self.t.rand_seed[1:].add_(1)

    def stagger(self) -> "Layer":
        """Row r's ring at position r % K, so that a step costs the average over positions."""
        stagger_ring(self.ring, self.K)
        return self


def check_one(entry: str, batch: int, heads: int, device, from_checkpoint: bool, min_ctas: int = 0) -> str | None:
    """What differs between a replay decode (at the launch bound ``min_ctas``, else none) and a stepwise
    decode of 2K + 1 steps, or None (module doc)."""
    a, b = Layer(entry, batch, heads, device, seed=batch), Layer(entry, batch, heads, device, seed=batch)
    what = (f"{entry}, B={batch}" + (", from the checkpoint" if from_checkpoint else "")
            + (f", at {min_ctas} CTAs an SM" if min_ctas else ""))
    for step in range(2 * a.K + 1):
        fresh = inputs_for(a.spec, batch, batch, H=heads, seed=1000 + step, device=device)
        for layer in (a, b):
            for k in LANE_FIELDS:
                if getattr(layer.t, k) is not None:
                    getattr(layer.t, k).copy_(fresh[k])
        got, want = a.replay(from_checkpoint, min_ctas).clone(), b.stepwise()
        a.advance(), b.advance()
        flushed = int(a.ring.length[0, 0]) == 0
        if flushed or not from_checkpoint:
            if not bits_equal(got, want):
                return f"{what} step {step}: out differs from the stepwise kernel's"
        elif float((got.float() - want.float()).abs().max()) > 0.05 * float(want.float().abs().max()):
            return f"{what} step {step}: an append's out is not within 5% of the stepwise kernel's largest"
        if flushed and not all(bits_equal(a.rows()[k], b.rows()[k]) for k in a.rows()):
            return f"{what} step {step}: the flushed rows differ from stepwise decoding"
    return None


def check(opts: Options) -> list[str]:
    """The first failure of every variant :func:`measure` times ([] when none)."""
    for entry in opts.entries:
        for batch in opts.batches:
            for fc, bound in [(False, 0), (True, 0)] + [(False, m) for m in opts.min_ctas]:
                problem = check_one(entry, batch, opts.run.heads, opts.run.device, fc, bound)
                if problem:
                    return [problem]
    return []


def bench(entry: str, batch: int, heads: int, device, graphs: bool, target_s: float, min_ctas=()) -> list[dict]:
    """Timed rows: the stepwise step, replay with outputs replayed, from the checkpoint, and replayed at
    each launch bound of ``min_ctas`` (outputs "replayed, 3 CTAs")."""
    timer = Timer(device)
    rows = []
    runs = [("stepwise", None, 0), ("replay", False, 0), ("replay", True, 0)] + [("replay", False, m) for m in min_ctas]
    for name, fc, bound in runs:
        layer = Layer(entry, batch, heads, device, seed=1).stagger()
        model_entry = entry + (", from the checkpoint" if fc else "")
        if name == "stepwise":
            fn, modelled = layer.stepwise, 1.0
        else:
            fn = (lambda layer=layer, fc=fc, m=bound: layer.replay(fc, m))
            modelled = replay_states_issue_model(model_entry, GPUS["H200"], batch, heads)["time"]
        outputs = None if fc is None else ("from checkpoint" if fc else "replayed")
        rows.append({"form": entry, "batch": batch, "heads": heads, "step": name, "K": None if fc is None else layer.K,
                     "outputs": f"{outputs}, {bound} CTAs" if bound else outputs,
                     "modelled_h200": modelled, **eager_and_graph_us(timer, fn, graphs, target_s)})
    rows = add_speedups(rows)
    kind = "us_graph" if "us_graph" in rows[0] else "us_eager"
    for row in rows:  # the measured counterpart of modelled_h200: time over the stepwise step's
        row["time_x"] = row[kind] / rows[0][kind]
    return rows


def measure(opts: Options) -> dict:
    run, rows = opts.run, []
    pairs = [(entry, batch) for entry in opts.entries for batch in opts.batches]
    for entry, batch in pairs:
        mine = bench(entry, batch, run.heads, run.device, run.graphs, run.target_s(200.0, 50.0), opts.min_ctas)
        if len(pairs) > 1:  # a long suite: each form's rows as soon as they are timed
            print(f"suite replay-states, {entry}, B={batch}:\n{_table(mine)}", flush=True)
        rows += mine
    return {"what": "step times, replay kernel with rotary / stochastic rounding / int8 states vs the stepwise "
                    "kernel; model time x: the issue model's ratio for H200", "heads": run.heads, "rows": rows}


COLUMNS = [("form", "form", "<"), ("batch", "B", ">d"), ("step", "step", "<"), ("K", "K", ">d"),
           ("outputs", "append outputs", "<"), ("modelled_h200", "model time x (H200)", ">.2f"),
           ("time_x", "time x", ">.2f"),
           ("us_eager", "eager us", ">.1f"), ("speedup_eager", "eager speed-up", ">.2f"),
           ("us_graph", "graph us", ">.1f"), ("speedup_graph", "graph speed-up", ">.2f")]


def _table(rows: list[dict]) -> str:
    return _util.format_table(rows, [c for c in COLUMNS if any(c[0] in r for r in rows)])


def report(result: dict) -> str:
    return (f"replay with the other states vs stepwise, flagship, H={result['heads']} (model time x: the issue "
            f"model's ratio for H200)\n" + _table(result["rows"]))
