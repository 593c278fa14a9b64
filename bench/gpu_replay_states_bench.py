"""GPU benchmark of replay with Mamba-3's other per-request states, measured against the stepwise step.

    python bench/gpu_replay_states_bench.py [--batches 256] [--heads 48] [--forms rotary,bf16-sr,int8,int8-K4]
                                            [--min-ctas 3] [--out DIR] [--no-graph]

Without a CUDA device it prints "no CUDA device: GPU replay-states benchmark not run" and exits 0
(``--device cpu`` runs the plumbing on the CPU path: a smoke test, not a benchmark).

The forms are those whose cost ``bench/issue_model.py --replay-states`` models from executed
instruction counts (``mamba3_step.tools.issue_model.REPLAY_STATES_EXECUTED``, docs/performance.md 3d): the
flagship rotary layer (S = 32 angles, B/C biases, B/C shared by the heads) at K = 4, a bf16 state
with stochastic rounding at K = 4, an int8 state (stochastic rounding, per-row scales) at K = 2 and
K = 4. For each form and batch size, in pool mode with one row per lane:

1. Correctness first: 2K + 1 steps from empty rings, replay (outputs replayed) against the stepwise
   kernel on twin inputs: every ``out`` bit for bit, and the rows bit for bit at each flush (scales
   and angles included); then the same with outputs from the checkpoint: a flush's ``out`` and rows
   bit for bit, an append's ``out`` within 5% of the stepwise ``out``'s largest magnitude (a different
   rounding: a stepwise 8-bit decode rounds every intermediate state to 8 bits, an append reads the
   checkpoint and the ring unrounded; 1-3% seen on the CPU path at K = 4). The seed's offset advances
   every step, as ``decode_step`` advances it. If anything differs it prints what and exits 1.
2. Timing with CUDA events, eager and CUDA-graph replay: the stepwise step, then replay with outputs
   replayed and from the checkpoint, rows' rings staggered (row r at position r % K) so that a step
   costs the average over positions. ``--min-ctas 3`` adds the replayed step at a launch bound of 3
   CTAs an SM (``StepSpec.min_ctas_per_sm``; outputs "replayed, 3 CTAs"), checked bit for bit first.

Prints microseconds per step, the speed-up over the stepwise step, the time over the stepwise
step's (``time x``: CUDA graph when timed, else eager) and beside it the issue model's predicted
time ratio for H200 (``replay_states_issue_model``: the larger of memory and issue time);
``gpu_replay_states_bench.json`` in ``bench/results/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

from gpu_bench import Timer, add_speedups, eager_and_graph_us  # noqa: E402
from gpu_replay_bench import add_min_ctas_argument, bounded_replay  # noqa: E402

from mamba3_step import mamba3_step_fn, new_ring  # noqa: E402
from mamba3_step.tools.issue_model import GPUS, REPLAY_STATES_EXECUTED, replay_states_issue_model, replay_states_spec
from mamba3_step.spec import FLAGSHIP_HEADS  # noqa: E402
from mamba3_step.tensors import StepTensors  # noqa: E402
from mamba3_step.testing import bits_equal, inputs_for  # noqa: E402

NO_CUDA_MESSAGE = "no CUDA device: GPU replay-states benchmark not run"
#: command-line name -> the REPLAY_STATES_EXECUTED entry (its replayed form; "<entry>, from the checkpoint" the other)
FORMS = {"rotary": "rotary", "bf16-sr": "bf16 state, stochastic rounding", "int8": "int8 state",
         "int8-K4": "int8 state, K = 4"}
#: the fields a step's inputs change each step (the rest: rows, weights, the seed)
LANE_FIELDS = ("A", "B", "C", "x", "dt", "trap", "z", "angle_proj")


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
        positions = torch.arange(self.ring.length.shape[0], device=self.ring.length.device) % self.K
        self.ring.length.copy_(positions[:, None].to(torch.int32).expand_as(self.ring.length))
        return self


def check(entry: str, batch: int, heads: int, device, from_checkpoint: bool, min_ctas: int = 0) -> str | None:
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


COLUMNS = [("form", "form", "<"), ("batch", "B", ">d"), ("step", "step", "<"), ("K", "K", ">d"),
           ("outputs", "append outputs", "<"), ("modelled_h200", "model time x (H200)", ">.2f"),
           ("time_x", "time x", ">.2f"),
           ("us_eager", "eager us", ">.1f"), ("speedup_eager", "eager speed-up", ">.2f"),
           ("us_graph", "graph us", ">.1f"), ("speedup_graph", "graph speed-up", ">.2f")]


#: the H200 run whose printed tables ``measured_times`` reads by default (the fifth, 2026-11-28: its
#: time limits stopped two of the three calls before they wrote their JSON, so the logs are the record)
MEASURED_LOGS = tuple(sorted((_util.REPO / "docs" / "measured" / "2026-11-28-h200").glob("states_bench*.log")))
_TABLE_ROW = re.compile(r"^(?P<form>\S.*?)\s+(?P<batch>\d+)\s+(?P<step>stepwise|replay)\s+(?:-|\d+)\s+"
                        r"(?P<outputs>-|replayed|from checkpoint)\s+(?P<numbers>[\d.\s]+)$")


def measured_times(paths=MEASURED_LOGS, batch: int = 256) -> dict:
    """``{REPLAY_STATES_EXECUTED entry: replay graph time / its stepwise step's}`` at ``batch``, read from
    this benchmark's printed tables in ``paths`` (a table's graph microseconds: the second number from
    the end; tables without graph timing are skipped); empty when none is there."""
    stepwise, replay = {}, {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            m = _TABLE_ROW.match(line.strip())
            numbers = m["numbers"].split() if m else []
            if not m or int(m["batch"]) != batch or len(numbers) < 5:
                continue
            if m["step"] == "stepwise":
                stepwise[m["form"]] = float(numbers[-2])
            else:
                name = m["form"] + (", from the checkpoint" if m["outputs"] == "from checkpoint" else "")
                replay[name] = (m["form"], float(numbers[-2]))
    return {name: us / stepwise[form] for name, (form, us) in replay.items() if form in stepwise}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _util.add_gpu_bench_arguments(p, "256", FLAGSHIP_HEADS)
    p.add_argument("--forms", default=",".join(FORMS), help=f"which forms (default {','.join(FORMS)})")
    add_min_ctas_argument(p)
    args = p.parse_args(argv)
    try:
        batches = [int(v) for v in args.batches.split(",")]
        min_ctas = [int(v) for v in args.min_ctas.split(",") if v]
    except ValueError:
        p.error(f"--batches/--min-ctas: expected comma-separated ints, got {args.batches!r} / {args.min_ctas!r}")
    unknown = [f for f in args.forms.split(",") if f not in FORMS]
    if unknown:
        p.error(f"--forms: expected some of {','.join(FORMS)}, got {unknown}")
    entries = [FORMS[f] for f in args.forms.split(",")]
    assert all(e in REPLAY_STATES_EXECUTED for e in entries)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    rows = []
    for entry in entries:
        for batch in batches:
            for fc, bound in [(False, 0), (True, 0)] + [(False, m) for m in min_ctas]:
                problem = check(entry, batch, args.heads, args.device, fc, bound)
                if problem:
                    print(f"CORRECTNESS FAILURE, no timing: {problem}")
                    return 1
            rows += bench(entry, batch, args.heads, args.device, not args.no_graph,
                          0.05 if args.device == "cpu" else 0.2, min_ctas)
            print(_util.format_table(rows[-3 - len(min_ctas):], [c for c in COLUMNS if any(c[0] in r for r in rows)]),
                  flush=True)
    print(f"replay with the other states vs stepwise, flagship, H={args.heads}, {args.device} (measured; "
          f"model time x: the issue model's ratio for H200)")
    print(_util.format_table(rows, [c for c in COLUMNS if any(c[0] in r for r in rows)]))
    out = _util.results_dir(args.out)
    payload = {"what": "measured step times (CUDA events), replay kernel with rotary / stochastic rounding / "
               "int8 states vs the stepwise kernel" if args.device == "cuda"
               else "CPU smoke run of the plumbing: not a benchmark", "environment": _util.environment(), "rows": rows}
    print(f"wrote {_util.write_json(out / 'gpu_replay_states_bench.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
