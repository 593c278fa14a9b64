"""GPU benchmark of replay's verify steps against today's speculative verify step, measured.

    python bench/gpu_replay_verify_bench.py [--batches 1,64,256] [--heads 48] [--ks 2,4,8] [--tokens 4]
                                            [--outputs replayed,checkpoint] [--out DIR] [--no-graph]
                                            [--device cpu]

Without a CUDA device it prints "no CUDA device: GPU replay verify benchmark not run" and exits 0
(``--device cpu`` runs the plumbing on the CPU path: a smoke test, not a benchmark).

At the flagship configuration (N=128, D=64, R=4, fp32 state, bf16 B/C/x/z and projections, pool mode
with update_kv_state), for every batch size, T draft tokens a lane:

* **stepwise** (today's verify): one T-token step of ``mamba3_step_fn`` from the row after the accepted
  drafts (``state_batch_indices`` (B, T): the lane's T rows, ``num_accepted_tokens`` (B,)), writing the
  state after each draft to its own row (``dst_state_batch_indices`` (B, T)): T state rows a step.
* **replay K**: ``mamba3_step_fn``'s replay mode with x (B, T, H, D) and ``num_accepted_tokens`` (B,): the committed ring tokens
  and the drafts stepped on the checkpoint in registers, the drafts kept in the ring, the state written
  only when the committed tokens reach K.
* **replay K, from the checkpoint** (``from_checkpoint=True``): no draft stepped; the committed tokens
  replayed only when they flush, each draft's ``out`` by the algebra from the checkpoint and the
  tokens since (docs/contract.md, "Replay").

Every step accepts all T drafts of the step before (the steady state of a draft model that is always
right: the stepwise step reads row T - 1, replay commits T tokens).

1. Correctness first: 2K / T + 3 steps on twin pools from equal states, every draft's ``out``
   bit-identical between the two (from the checkpoint: within 1% of the largest ``|out|``, a
   sanity bound; the contract's accuracy rule is the PTX tier's), and every flushed row equal to the
   stepwise row T - 1 bit for bit. If not, it prints what failed and no timing, and exits 1.
2. Timing with CUDA events, eager and CUDA-graph replay, the rows' ring lengths staggered (row r at
   r % K) so that a step costs the average over positions; each timed call moves the rings as a
   server's would.

Reports microseconds per step, the speed-up over the stepwise step and the bytes model's ratio
(``mamba3_step.bytes_model``) beside it; ``gpu_replay_verify_bench.json`` in ``bench/results/`` (or
``--out``).
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
from mamba3_step.bytes_model import bytes_per_step, replay_bytes  # noqa: E402
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_spec  # noqa: E402
from mamba3_step.tensors import StepTensors  # noqa: E402
from mamba3_step.testing import bits_equal, lane_inputs, layer_weights, row_tensors  # noqa: E402

NO_CUDA_MESSAGE = "no CUDA device: GPU replay verify benchmark not run"
D, N, R = 64, 128, 4
POOLS = ("state", "Bstate", "Xstate")


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
        positions = torch.arange(self.ring.length.shape[0], device=self.ring.length.device) % self.K
        self.ring.length.copy_(positions[:, None].to(torch.int32).expand_as(self.ring.length))
        self.accepted.fill_(self.T)
        return self


def check(batch: int, heads: int, K: int, T: int, device, from_checkpoint: bool = False) -> str | None:
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


COLUMNS = [("batch", "B", ">d"), ("tokens", "T", ">d"), ("step", "step", "<"), ("bytes_ratio", "bytes x", ">.3f"),
           ("us_eager", "eager us", ">.1f"), ("speedup_eager", "eager speed-up", ">.2f"),
           ("us_graph", "graph us", ">.1f"), ("speedup_graph", "graph speed-up", ">.2f")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _util.add_gpu_bench_arguments(p, "1,64,256", FLAGSHIP_HEADS)
    p.add_argument("--ks", default="2,4,8",
                   help="flush lengths K (default 2,4,8: K = 2, the plain step's measured winner, too)")
    p.add_argument("--tokens", type=int, default=4, help="draft tokens T a lane (default 4)")
    p.add_argument("--outputs", default="replayed,checkpoint",
                   help="the drafts' output forms to time: replayed (stepped), checkpoint (from the checkpoint)")
    args = p.parse_args(argv)
    names = args.outputs.split(",")
    if not names or any(n not in ("replayed", "checkpoint") for n in names):
        p.error(f"--outputs: expected a comma-separated subset of replayed,checkpoint, got {args.outputs!r}")
    forms = tuple(n == "checkpoint" for n in names)
    try:
        batches = [int(v) for v in args.batches.split(",")]
        Ks = [int(v) for v in args.ks.split(",")]
    except ValueError:
        p.error(f"--batches/--ks: expected comma-separated ints, got {args.batches!r} / {args.ks!r}")
    if not 2 <= args.tokens <= 16:
        p.error(f"--tokens: expected an int in [2, 16], got {args.tokens}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    target_s = 0.05 if args.device == "cpu" else 0.2
    for batch in batches:
        for K, fc in ((K, fc) for K in Ks for fc in forms):
            problem = check(batch, args.heads, K, args.tokens, args.device, fc)
            if problem:
                print(f"CORRECTNESS FAILURE, no timing: {problem}")
                return 1
    rows = [r for batch in batches for r in bench(batch, args.heads, Ks, args.tokens, args.device,
                                                  not args.no_graph, target_s, forms)]
    print(f"replay verify vs today's verify (a row per draft), flagship, H={args.heads}, T={args.tokens}, "
          f"{args.device} (measured; bytes x: the model's ratio)")
    print(_util.format_table(rows, [c for c in COLUMNS if any(c[0] in r for r in rows)]))
    out = _util.results_dir(args.out)
    payload = {"what": "measured step times (CUDA events), replay verify step vs stepwise verify step"
               if args.device == "cuda" else "CPU smoke run of the plumbing: not a benchmark",
               "environment": _util.environment(), "rows": rows}
    print(f"wrote {_util.write_json(out / 'gpu_replay_verify_bench.json', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
