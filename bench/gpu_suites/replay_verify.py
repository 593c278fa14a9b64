"""Suite ``replay-verify``: replay's verify steps against today's speculative verify step, at the flagship
configuration (N=128, D=64, R=4, fp32 state, bf16 B/C/x/z and projections, pool mode with
update_kv_state), per batch size, T draft tokens a lane:

* **stepwise** (today's verify): one T-token step of ``mamba3_step_fn`` from the row after the accepted
  drafts (``state_batch_indices`` (B, T): the lane's T rows, ``num_accepted_tokens`` (B,)), writing the
  state after each draft to its own row (``dst_state_batch_indices`` (B, T)): T state rows a step.
* **replay K**: ``mamba3_step_fn``'s replay mode with x (B, T, H, D) and ``num_accepted_tokens`` (B,): the committed ring tokens
  and the drafts stepped on the checkpoint in registers, the drafts kept in the ring, the state written
  only when the committed tokens reach K.
* **replay K, from the checkpoint** (``from_checkpoint=True``): no draft stepped; the committed tokens
  replayed only when they flush, each draft's ``out`` by the algebra from the checkpoint and the tokens
  since (docs/contract.md, "Replay").

Every step accepts all T drafts of the step before (a draft model that is always right: the stepwise
step reads row T - 1, replay commits T tokens).

1. Check: 2K / T + 3 steps on twin pools from equal states, every draft's ``out`` bit-identical between
   the two (from the checkpoint: within 1% of the largest ``|out|``, a sanity bound; the contract's
   accuracy rule is the PTX tier's), and every flushed row equal to the stepwise row T - 1 bit for bit.
2. Timing, eager and CUDA-graph replay, the rows' ring lengths staggered (row r at r % K).

Reports microseconds per step, the speed-up over the stepwise step and the bytes model's ratio
(``mamba3_step.tools.bytes_model``) beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import _util

from mamba3_step import mamba3_step_fn, new_ring
from mamba3_step.tools.bytes_model import bytes_per_step, replay_bytes
from mamba3_step.spec import flagship_spec
from mamba3_step.tensors import StepTensors
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors

from .common import Run, int_list
from .replay import stagger_ring
from .timing import Timer, add_speedups, eager_and_graph_us

NAME = "replay-verify"
BATCHES = "1,64,256"
D, N, R = 64, 128, 4
POOLS = ("state", "Bstate", "Xstate")
OUTPUT_FORMS = {"replayed": False, "checkpoint": True}


@dataclass
class Options:
    run: Run
    batches: tuple[int, ...]
    ks: tuple[int, ...]
    tokens: int
    forms: tuple[bool, ...]


def add_arguments(parser) -> None:
    group = parser.add_argument_group("suite replay-verify")
    group.add_argument("--tokens", type=int, default=4, help="draft tokens T a lane (default 4)")
    group.add_argument("--outputs", default="replayed,checkpoint",
                       help="the drafts' output forms to time: replayed (stepped), checkpoint (from the checkpoint)")


def configure(args, run: Run) -> Options:
    names = args.outputs.split(",")
    if any(n not in OUTPUT_FORMS for n in names):
        raise ValueError(f"--outputs: expected a comma-separated subset of replayed,checkpoint, got {args.outputs!r}")
    if not 2 <= args.tokens <= 16:
        raise ValueError(f"--tokens: expected an int in [2, 16], got {args.tokens}")
    return Options(run, run.batches_or(BATCHES), int_list(args.ks, "--ks"), args.tokens,
                   tuple(OUTPUT_FORMS[n] for n in names))


class Layer:
    """One layer on ``device``: replay pools (a row per lane) with a ring of room for T drafts, stepwise
    pools (T rows per lane, all holding the lane's state at first), weights and one T-token lane-input set."""

    def __init__(self, batch: int, heads: int, K: int, T: int, device, seed: int, from_checkpoint: bool = False):
        g = torch.Generator().manual_seed(seed)
        rows = row_tensors(batch, heads, D, N, R, generator=g, device=device)
        self.w = layer_weights(heads, D, R, generator=g, device=device)
        self.lane = lane_inputs(batch, heads, D, N, R, tokens=T, generator=g, device=device)
        self.replay_pools = {k: v.clone() for k, v in rows.items()}
        self.stepwise_pools = {k: v.repeat_interleave(T, 0) for k, v in rows.items()}  # lane b: rows bT .. bT + T - 1
        self.ring = new_ring(batch, K, R, heads, N, D, kv_dtype=torch.bfloat16, x_dtype=torch.bfloat16, draft=T,
                             device=device)
        self.index = torch.arange(batch, dtype=torch.int32, device=device)
        self.group = torch.arange(batch * T, dtype=torch.int32, device=device).view(batch, T)
        self.accepted = torch.zeros(batch, dtype=torch.int32, device=device)  # replay: nothing pending at first
        self.last = torch.full((batch,), T, dtype=torch.int32, device=device)  # stepwise: row T - 1, all accepted
        self.out = torch.empty(batch, T, heads, D, dtype=torch.bfloat16, device=device)
        self.K, self.T, self.from_checkpoint = K, T, from_checkpoint

    def call(self, pools: dict, index: torch.Tensor) -> StepTensors:
        p, w, x = pools, self.w, self.lane
        return StepTensors(p["state"], p["Bstate"], p["Xstate"], x["A"], x["B"], x["C"], w["D"], x["x"], x["dt"],
                           x["trap"], w["xproj"], outproj=w["outproj"], out=self.out, z=x["z"], zproj=w["zproj"],
                           state_batch_indices=index)

    def stepwise(self):
        t = self.call(self.stepwise_pools, self.group)._replace(dst_state_batch_indices=self.group,
                                                                  num_accepted_tokens=self.last)
        return mamba3_step_fn(**t._asdict(), update_kv_state=True)

    def replay(self):
        t = self.call(self.replay_pools, self.index)._replace(replay_ring=self.ring, num_accepted_tokens=self.accepted)
        out = mamba3_step_fn(**t._asdict(), update_kv_state=True, replay_flush_length=self.K,
                             replay_from_checkpoint=self.from_checkpoint)
        self.accepted.fill_(self.T)  # the next step commits every draft of this one
        return out

    def stagger(self) -> "Layer":
        """Row r's ring at r % K committed tokens, T drafts pending: a step costs the average over positions."""
        stagger_ring(self.ring, self.K)
        self.accepted.fill_(self.T)
        return self


def check_one(batch: int, heads: int, K: int, T: int, device, from_checkpoint: bool = False) -> str | None:
    """What differs between replay's and today's verify steps over 2K / T + 3 steps, or None."""
    layer = Layer(batch, heads, K, T, device, seed=batch, from_checkpoint=from_checkpoint)
    g = torch.Generator().manual_seed(K)
    last = layer.group[:, T - 1].long()
    for step in range(2 * K // T + 3):
        for k, v in lane_inputs(batch, heads, D, N, R, tokens=T, generator=g, device=device).items():
            layer.lane[k].copy_(v)
        committed = layer.ring.length[:, 0] + layer.accepted
        held = {k: layer.stepwise_pools[k][last].clone() for k in POOLS}  # the state after the committed tokens
        got = layer.replay().clone()
        want = layer.stepwise()
        if not (_near(got, want) if from_checkpoint else bits_equal(got, want)):
            return f"B={batch} K={K} T={T} step {step}: a draft's out differs from the stepwise verify step's"
        flushed = (committed >= K).nonzero().flatten()
        if not all(bits_equal(layer.replay_pools[k][flushed], held[k][flushed]) for k in POOLS):
            return f"B={batch} K={K} T={T} step {step}: a flushed row differs from stepwise decoding"
    return None


def _near(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Outputs from the checkpoint against the stepwise step's: within 1% of the largest ``|want|``."""
    return float((got.float() - want.float()).abs().max()) <= 0.01 * float(want.float().abs().max())


def check(opts: Options) -> list[str]:
    """The first failure of every variant :func:`measure` times ([] when none)."""
    for batch in opts.batches:
        for K, fc in ((K, fc) for K in opts.ks for fc in opts.forms):
            problem = check_one(batch, opts.run.heads, K, opts.tokens, opts.run.device, fc)
            if problem:
                return [problem]
    return []


def bench(batch: int, heads: int, Ks, T: int, device, graphs: bool, target_s: float,
          forms=(False,)) -> list[dict]:
    """Timed rows: today's verify step, then replay's at each K and output form (``forms``: from the
    checkpoint or not)."""
    timer = Timer(device)
    today = flagship_spec(tokens=T, has_dst=True, dst_per_token=True, num_accepted=True)
    base_bytes = bytes_per_step(today, batch, heads)["total"]
    rows = []
    for name, K, fc in [("stepwise", None, False)] + [
            (f"replay K={K}" + (" from the checkpoint" if fc else ""), K, fc) for fc in forms for K in Ks]:
        layer = Layer(batch, heads, K or 2, T, device, seed=1, from_checkpoint=fc).stagger()
        fn = layer.stepwise if K is None else layer.replay
        row = {"batch": batch, "heads": heads, "tokens": T, "step": name, "K": K, "from_checkpoint": fc,
               "bytes_ratio": 1.0 if K is None else replay_bytes(today, K, batch, heads)["total"] / base_bytes,
               **eager_and_graph_us(timer, fn, graphs, target_s)}
        rows.append(row)
    return add_speedups(rows)


def measure(opts: Options) -> dict:
    run = opts.run
    rows = [r for batch in opts.batches for r in bench(batch, run.heads, opts.ks, opts.tokens, run.device,
                                                       run.graphs, run.target_s(200.0, 50.0), opts.forms)]
    return {"what": "step times, replay verify step vs stepwise verify step; bytes x: the bytes model's ratio",
            "heads": run.heads, "tokens": opts.tokens, "rows": rows}


COLUMNS = [("batch", "B", ">d"), ("tokens", "T", ">d"), ("step", "step", "<"), ("bytes_ratio", "bytes x", ">.3f"),
           ("us_eager", "eager us", ">.1f"), ("speedup_eager", "eager speed-up", ">.2f"),
           ("us_graph", "graph us", ">.1f"), ("speedup_graph", "graph speed-up", ">.2f")]


def report(result: dict) -> str:
    rows = result["rows"]
    return (f"replay verify vs today's verify (a row per draft), flagship, H={result['heads']}, "
            f"T={result['tokens']} (bytes x: the model's ratio)\n"
            + _util.format_table(rows, [c for c in COLUMNS if any(c[0] in r for r in rows)]))
