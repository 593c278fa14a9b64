"""``python -m mamba3_step demo``: a toy multi-layer decode over a state pool, checked each step.

Each layer is a :class:`~mamba3_step.layer.Mamba3DecodeLayer` (upstream Mamba-3's MIMO
parameterisation, random weights): hidden states in, hidden states out, with in_proj, the
element-wise preparation, one pool-mode ``mamba3_step_fn`` call (which also advances the rotary
angle and rotates B/C) and out_proj; layer ``l + 1`` reads layer ``l``'s output. Requests join and
leave between steps (slots allocated, reset, forked from a cached prefix and freed); each step's
live lanes are shuffled, padded up to a batch-size bucket and run, layer after layer (on a GPU each
bucket's decode is captured once in a CUDA graph and replayed; on CPU the PyTorch path runs the
same padded batches). A second copy of the pool is driven by the gather -> dense -> scatter
baseline on the same prepared inputs; after every layer and step the step's outputs, every pool
row (state, B, x and the angle) and the untouched rows are compared bit for bit, and the step's
outputs are compared with a float64 reference for an error figure.

Then a speculative-decoding round (:mod:`mamba3_step.tools.demo.speculative`): each request owns a
group of T rows, verifies T tokens (its last token and T - 1 random drafts) in one T-token step
per layer, accepts a random number of them and continues from the accepted state (by index,
nothing copied); every accepted token's ``out`` and state rows must equal one-token-at-a-time
decoding of the accepted tokens, bit for bit.

Letters (docs/contract.md): B lanes, P pool rows (slots), H heads, D head dim, N state size,
R MIMO rank, S rotary angles per head, L layers. The specialisation is named like everywhere else
(``--config``, dtype flags; default: the flagship); the mode is the server's (pool mode, destination
rows, update_kv_state, the rotary angle). Exit status 0 when parity held everywhere and the error is
within tolerance.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .speculative import SpecRecord, SpecResult, run_speculative_decode
from .replay import run_replay_decode
from ...layer import LayerDtypes, LayerPools, Mamba3DecodeLayer, StepInputs
from ...reference import mamba3_step_reference
from ...serving import StatePool, check_buckets, choose_bucket, gather_dense_scatter
from ...spec import MAX_TOKENS
from ...specsets import add_spec_arguments, parse_spec_args
from ...tensors import StepTensors
from ...testing import LayerShape, bits_equal, poison_pool

__all__ = ["DemoResult", "HELP", "SpecRecord", "SpecResult", "StepRecord", "add_arguments", "run",
           "run_speculative_decode", "run_toy_decode"]

HELP = "run a small pool-mode decode and check it against gather -> dense -> scatter"


@dataclass
class StepRecord:
    step: int
    live: int
    bucket: int | None
    joined: int
    left: int
    forked: int
    parity: bool
    max_err: float
    max_err_fp32: float


@dataclass
class DemoResult:
    device: str
    kernel: str
    graphs: bool
    records: list[StepRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def parity(self) -> bool:
        return not self.failures and all(r.parity for r in self.records)

    @property
    def max_err(self) -> float:
        return max((r.max_err for r in self.records), default=0.0)

    @property
    def max_err_fp32(self) -> float:
        return max((r.max_err_fp32 for r in self.records), default=0.0)


def _kernel_name(device: torch.device) -> str:
    return "CuteDSL kernel" if device.type == "cuda" else "PyTorch CPU path (mamba3_step.reference, float32)"


class _Requests:
    """The toy server's requests: which slots are live, which hold a cached prefix."""

    def __init__(self, pool: StatePool, base: list, rng: random.Random, max_batch: int):
        self.pool, self.base, self.rng, self.max_batch = pool, base, rng, max_batch
        self.live: list[int] = []  # slots of live requests
        self.cached: list[int] = []  # slots holding a cached prefix (allocated, not live)

    def leave(self) -> int:
        """Finished requests free their slot; some become cached prefixes."""
        left = 0
        for s in list(self.live):
            if len(self.live) > 1 and self.rng.random() < 0.3:
                self.live.remove(s)
                left += 1
                if self.rng.random() < 0.5 and len(self.cached) < 2:
                    self.cached.append(s)
                else:
                    self.pool.free([s])
        return left

    def join(self, first: bool) -> tuple[int, dict]:
        """Fresh requests (zeroed slot) and forks (read a cached prefix's row, write their own)."""
        want = self.rng.randint(2, 4) if first else self.rng.randint(1, 3)
        room = min(self.max_batch - len(self.live), self.pool.num_free)
        src_of: dict[int, int] = {}
        for _ in range(max(0, min(want, room))):
            s = int(self.pool.alloc(1)[0])
            if self.cached and self.rng.random() < 0.6:
                src_of[s] = self.cached.pop(0)
            else:
                self.pool.reset([s])
                for layer in self.base:
                    for t in layer:
                        t[s] = 0
            self.live.append(s)
        return max(0, min(want, room)), src_of


class _Decoded(NamedTuple):
    """One layer's decode of a padded batch (B = the bucket, or n when run unpadded)."""

    out: torch.Tensor  # (n, d_model) the layer's output for the live lanes
    step_out: torch.Tensor  # (B, H, D) the step's out, padding lanes included
    inputs: StepInputs  # (B, ...) what the step read
    src: torch.Tensor  # (B,) int32 source rows, padding ids after the live lanes
    dst: torch.Tensor  # (B,) int32 destination rows


class _LayerRunner:
    """One layer's :meth:`~mamba3_step.layer.Mamba3DecodeLayer.decode` at batch-size buckets: the live lanes
    are copied into a bucket's static buffers (the rest: pad ids, zero hidden states) and the bucket's
    decode runs (replayed from its CUDA graph with ``use_cuda_graph``); past the largest bucket, eagerly."""

    def __init__(self, layer: Mamba3DecodeLayer, pools: LayerPools, buckets, pool: StatePool, use_cuda_graph: bool,
                 graph_pool=None):
        self.layer, self.pools, self.buckets = layer, pools, buckets
        self.pad_id, self.null_slot_id = pool.pad_id, pool.null_slot_id
        self.use_cuda_graph, self.graph_pool = use_cuda_graph, graph_pool
        self.static, self.graphs = {}, {}  # per bucket: its buffers, its CUDA graph

    def _run(self, s: dict) -> None:
        trace = self.layer.decode_traced(s["hidden"], self.pools, s["src"], s["dst"], null_slot_id=self.null_slot_id,
                                         step_out=s.get("y"))
        s["out"], s["y"], s["inputs"] = trace

    def capture(self) -> None:
        """Static buffers for every bucket (and on CUDA its graph; the warm-up compiles, all lanes padding)."""
        dev, layer = self.layer.D.device, self.layer
        for b in self.buckets:
            s = {"hidden": torch.zeros(b, layer.d_model, device=dev),
                 "src": torch.full((b,), self.pad_id, dtype=torch.int32, device=dev),
                 "y": torch.zeros(b, layer.nheads, layer.headdim, dtype=layer.dtypes.x, device=dev)}
            s["dst"] = s["src"].clone()
            if self.use_cuda_graph:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._run(s)
                torch.cuda.current_stream().wait_stream(side)
                self.graphs[b] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graphs[b], pool=self.graph_pool):
                    self._run(s)
            self.static[b] = s

    def decode(self, hidden: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> _Decoded:
        n = hidden.shape[0]
        bucket = choose_bucket(n, self.buckets)
        if bucket is None:
            s = {"hidden": hidden, "src": src, "dst": dst}
            self._run(s)
        else:
            s = self.static[bucket]
            for name, v, pad in (("hidden", hidden, 0), ("src", src, self.pad_id), ("dst", dst, self.pad_id)):
                s[name][:n].copy_(v)
                s[name][n:].fill_(pad)
            if self.use_cuda_graph:
                self.graphs[bucket].replay()
            else:
                self._run(s)
        return _Decoded(s["out"][:n].clone(), s["y"].clone(), StepInputs(*(t.clone() for t in s["inputs"])),
                        s["src"].clone(), s["dst"].clone())


def _baseline(layer: Mamba3DecodeLayer, base: LayerPools, d: _Decoded, null_slot_id) -> torch.Tensor:
    """The same step (the same inputs and rows) on the baseline's pools by gather -> dense -> scatter, the
    angle rows travelling with the state rows; returns its ``out``."""
    tensors = layer.step_tensors(d.inputs, base, d.src, d.dst, null_slot_id=null_slot_id)
    return gather_dense_scatter(tensors, rotate_pairwise=layer.rotate_pairwise)


def _check_layer(d: _Decoded, out_base, pools: LayerPools, base: LayerPools, before: LayerPools, dst,
                 slots) -> list[str]:
    """What differs between the pool run and the baseline (empty when parity held)."""
    checks = {"out": bits_equal(d.step_out, out_base)}
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[dst.long()] = False
    ut = untouched.to(d.step_out.device)
    for name, a, b, old in zip(LayerPools._fields, pools, base, before):
        checks[f"{name} pool"] = bits_equal(a, b)
        checks[f"{name} untouched rows"] = bits_equal(a[ut], old[ut])
    return [what for what, ok in checks.items() if not ok]


def _errors(gathered: StepTensors, out: torch.Tensor, rotate_pairwise: bool) -> tuple[float, float]:
    """Max |out - float64 reference| of the step and the float32 PyTorch computation's own, for scale."""
    def copy(dtype):  # CPU copies, the floating-point tensors in ``dtype`` (None: their own)
        return StepTensors(*[t.cpu().to(dtype if dtype and t.is_floating_point() else t.dtype, copy=True)
                             if isinstance(t, torch.Tensor) else t for t in gathered])

    y64 = mamba3_step_reference(copy(torch.float64), update_kv_state=True, rotate_pairwise=rotate_pairwise,
                                compute_dtype=torch.float64)
    y32 = mamba3_step_reference(copy(None), update_kv_state=True, rotate_pairwise=rotate_pairwise)
    return (out.cpu().double() - y64).abs().max().item(), (y32.double() - y64).abs().max().item()


def _make_layers(layers: int, shape: LayerShape, device, g: torch.Generator) -> list[Mamba3DecodeLayer]:
    """The model: ``layers`` MIMO layers of H heads of D, d_model = H D / 2 (upstream's expand=2), random weights."""
    dtypes = LayerDtypes.of(shape.state_dtype, shape.kv_dtype, shape.x_dtype, shape.proj_dtype)
    return [Mamba3DecodeLayer(shape.H * shape.D // 2, d_state=shape.N, expand=2, headdim=shape.D, mimo_rank=shape.R,
                              dtypes=dtypes, device=device).randomize_(g) for _ in range(layers)]


def run_toy_decode(*, steps: int = 8, layers: int = 2, slots: int = 16, max_batch: int = 6, buckets=(1, 2, 4, 8),
                   shape: LayerShape = LayerShape(), null_slot: bool = False, seed: int = 0, device="cpu",
                   use_cuda_graph: bool | None = None, log=None) -> DemoResult:
    """Run the toy decode and compare it, step by step, with gather -> dense -> scatter.

    Each step: some live requests leave (their slot is freed, or kept as a cached prefix),
    new ones join (fresh zeroed slot, or a slot that reads a cached prefix's row as ``src``
    on its first step and writes its own row as ``dst``: prefix caching). Layer ``l + 1``'s
    hidden state is layer ``l``'s output, RMS-normalised. Both pools start from the same random poison, so a stray
    write anywhere shows up in the whole-pool comparison. ``shape`` gives every layer's H, D, N, R
    and dtypes (default :class:`~mamba3_step.testing.LayerShape`: the flagship's D, N, R and
    dtypes, H=4 heads).
    """
    device = torch.device(device)
    graphs = device.type == "cuda" if use_cuda_graph is None else bool(use_cuda_graph)
    if graphs and device.type != "cuda":
        raise ValueError(f"use_cuda_graph: CUDA graphs need a CUDA device, got {device}")
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    model = _make_layers(layers, shape, device, g)
    pool = StatePool(layers, slots, shape.H, shape.D, shape.N, shape.R, **shape.storage_dtypes, device=device,
                     reserve_null_slot=null_slot, rope_angles=model[0].num_rope_angles)
    poison_pool(pool, g)
    for l in range(layers):
        angles = pool.angle_state(l)
        angles.copy_(torch.randint(-2**62, 2**62, angles.shape, generator=g))
    pools = [LayerPools(**pool.layer_rows(l)) for l in range(layers)]  # views of the pool's layers
    base = [p.clone() for p in pools]  # the baseline's pool
    graph_pool = torch.cuda.graph_pool_handle() if graphs else None
    runners = [_LayerRunner(model[l], pools[l], check_buckets(buckets), pool, graphs, graph_pool)
               for l in range(layers)]
    for r in runners:
        r.capture()
    result = DemoResult(str(device), _kernel_name(device), graphs)
    requests = _Requests(pool, base, rng, max_batch)
    for step in range(steps):
        left = requests.leave()
        joined, src_of = requests.join(first=step == 0)
        rng.shuffle(requests.live)
        n = len(requests.live)
        dst = torch.tensor(requests.live, dtype=torch.int32)
        src = torch.tensor([src_of.get(s, s) for s in requests.live], dtype=torch.int32)
        failures, err, err32 = [], 0.0, 0.0
        hidden = torch.randn(n, model[0].d_model, generator=g).to(device)
        for l in range(layers):
            before = pools[l].clone()
            d = runners[l].decode(hidden, src.to(device), dst.to(device))
            gathered = model[l].step_tensors(d.inputs, before, d.src, d.dst).dense_lanes(
                torch.arange(n, device=device), src.to(device).long())
            out_base = _baseline(model[l], base[l], d, pool.null_slot_id)
            failures += [f"step {step} layer {l}: {what} differs from the baseline"
                         for what in _check_layer(d, out_base, pools[l], base[l], before, dst, slots)]
            e, e32 = _errors(gathered, d.step_out[:n], model[l].rotate_pairwise)
            err, err32 = max(err, e), max(err32, e32)
            hidden = d.out * torch.rsqrt(d.out.square().mean(-1, keepdim=True) + 1e-6)  # a pre-norm block's norm
        for s in src_of.values():  # prefix rows consumed by forks this step are released
            pool.free([s])
        result.failures += failures
        rec = StepRecord(step, n, choose_bucket(n, runners[0].buckets), joined, left, len(src_of), not failures,
                         err, err32)
        result.records.append(rec)
        if log:
            log(rec)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Toy multi-layer pool-mode decode, checked each step against gather -> dense -> scatter."
    p.add_argument("--steps", type=int, default=8, help="decode steps (default 8)")
    p.add_argument("--layers", type=int, default=2, help="Mamba-3 layers (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--slots", type=int, default=16, help="pool rows P (default 16)")
    p.add_argument("--max-batch", type=int, default=6, help="most live requests at once (default 6)")
    p.add_argument("--buckets", default="1,2,4,8", help="CUDA-graph batch buckets (default 1,2,4,8)")
    p.add_argument("--heads", type=int, default=4, help="H (default 4)")
    p.add_argument("--null-slot", action="store_true", help="reserve row 0 as a null block (pad with 0)")
    p.add_argument("--no-graphs", action="store_true", help="on CUDA, run the padded steps eagerly")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    p.add_argument("--spec-tokens", type=int, default=4,
                   help="T of the speculative-decoding round: tokens per verify step (default 4; 0 skips it)")
    p.add_argument("--spec-rounds", type=int, default=4, help="verify steps of the speculative round (default 4)")
    add_spec_arguments(p, modes=False, arch=False)


#: the demo's integer options and their ranges (a larger demo is a benchmark's job)
_RANGES = {"steps": (1, 100_000), "layers": (1, 64), "slots": (1, 4096), "heads": (1, 256),
           "seed": (-(2**63), 2**63 - 1), "spec_rounds": (1, 100_000)}


def _settings(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """(device, buckets, spec) from the flags; ``parser.error`` (exit 2) on a bad one."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        parser.error(f"--device expects auto, cpu, cuda or cuda:N, got {args.device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but no CUDA device is available")
    try:
        buckets = check_buckets(int(b) for b in args.buckets.split(","))
    except ValueError as e:
        parser.error(f"--buckets expects distinct positive comma-separated ints, got {args.buckets!r} ({e})")
    for name, (least, most) in _RANGES.items():
        if not least <= getattr(args, name) <= most:
            parser.error(f"--{name.replace('_', '-')} must be in [{least}, {most}], got {getattr(args, name)}")
    if max(buckets) > _RANGES["slots"][1]:
        parser.error(f"--buckets: at most {_RANGES['slots'][1]} lanes a bucket, got {max(buckets)}")
    if not 0 <= args.spec_tokens <= MAX_TOKENS:
        parser.error(f"--spec-tokens must be in [0, {MAX_TOKENS}] (0 skips the round), got {args.spec_tokens}")
    if not 1 <= args.max_batch <= args.slots - (1 if args.null_slot else 0):
        parser.error(f"--max-batch must be in [1, usable slots], got {args.max_batch}")
    specs, _ = parse_spec_args(args, parser)
    if len(specs) != 1:
        parser.error(f"the demo runs one specialisation, --config names {len(specs)}")
    return torch.device(device), buckets, specs[0]


def _layer_shape(args: argparse.Namespace, spec) -> LayerShape:
    """The demo's layer: ``--heads`` heads of the specialisation's D, N, R and dtypes."""
    return LayerShape(H=args.heads, D=spec.headdim, N=spec.dstate, R=spec.mimo, state_dtype=spec.state_dtype,
                      kv_dtype=spec.kv_dtype, x_dtype=spec.x_dtype, proj_dtype=spec.proj_dtype)


def _log_row(rec: StepRecord, first: bool) -> None:
    if first:
        print("step  live  bucket  padded  joined  left  forked  parity  max|out - fp64|")
    bucket = "eager" if rec.bucket is None else str(rec.bucket)
    padded = 0 if rec.bucket is None else rec.bucket - rec.live
    print(f"{rec.step:>4}  {rec.live:>4}  {bucket:>6}  {padded:>6}  {rec.joined:>6}  {rec.left:>4}  "
          f"{rec.forked:>6}  {'ok' if rec.parity else 'FAIL':>6}  {rec.max_err:.3e}")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    dev, buckets, spec = _settings(args, parser)
    t0 = time.perf_counter()
    print(f"mamba3_step demo: device={dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}), "
          f"kernel: {_kernel_name(dev)}")
    print(f"model: {args.layers} Mamba-3 MIMO layers (Mamba3DecodeLayer, d_model={args.heads * spec.headdim // 2}, "
          f"random weights): in_proj, one step launch (rotary fused), out_proj")
    print(f"pool: L={args.layers} layers x P={args.slots} slots, H={args.heads} D={spec.headdim} "
          f"N={spec.dstate} R={spec.mimo} S={spec.dstate // 4}, state {spec.state_dtype}, B {spec.kv_dtype}, "
          f"x {spec.x_dtype}, angle int64, pad id {0 if args.null_slot else -1}"
          + (" (row 0 reserved as null slot)" if args.null_slot else ""))
    res = run_toy_decode(
        steps=args.steps, layers=args.layers, slots=args.slots, max_batch=args.max_batch, buckets=buckets,
        shape=_layer_shape(args, spec), null_slot=args.null_slot, seed=args.seed, device=dev,
        use_cuda_graph=False if args.no_graphs else None,
        log=None if args.quiet else lambda rec: _log_row(rec, rec.step == 0),
    )
    lanes = sum(r.live for r in res.records)
    padded = sum((r.bucket - r.live) for r in res.records if r.bucket is not None)
    # the kernel may be off the float64 reference by about what the float32 PyTorch
    # computation is (plus one rounding of the output dtype)
    tol = 2 * res.max_err_fp32 + torch.finfo(getattr(torch, spec.x_dtype)).eps
    err_ok = res.max_err <= tol
    print(f"CUDA graphs: {'yes (replayed per bucket)' if res.graphs else 'no (padded steps run eagerly)'}")
    print(f"{len(res.records)} steps x {args.layers} layers: {lanes} live lanes, {padded} padded lanes; "
          f"max |out - float64 reference| = {res.max_err:.3e} (float32 PyTorch: {res.max_err_fp32:.3e}, "
          f"tolerance {tol:.3e})")
    for f in res.failures[:10]:
        print("  " + f)
    verdict = "PARITY HELD" if res.parity else "PARITY FAILED"
    print(f"{verdict}: pool mode vs gather -> dense -> scatter is "
          f"{'byte-identical' if res.parity else 'NOT byte-identical'} (the step's out, every state/B/x/angle row, "
          f"untouched rows); "
          f"error vs float64 {'within' if err_ok else 'OUTSIDE'} tolerance  [{time.perf_counter() - t0:.1f} s]")
    spec_ok = args.spec_tokens == 0 or _speculative_round(args, dev, buckets, spec)
    return 0 if res.parity and err_ok and spec_ok and _replay_round(args.seed) else 1


def _replay_round(seed: int) -> bool:
    """Run and report :func:`~mamba3_step.tools.demo.replay.run_replay_decode`; True when it held."""
    t0, res = time.perf_counter(), run_replay_decode(seed=seed)
    for f in res.failures[:10]:
        print("  " + f)
    ok = not res.failures
    print(f"replay (CPU path; K=4): {res.steps} plain and {res.rounds} verify steps of 3 requests, one "
          f"leaving and one joining; {res.flushes} lane-steps wrote the state, {res.appends} only appended to the "
          f"ring, {res.accepted} of {res.verified} draft tokens accepted (the rest rolled back by the cursor); "
          f"materialised state {'byte-identical' if ok else 'NOT byte-identical'} to stepwise decoding after every "
          f"step; max |out - stepwise out| = {res.max_out_diff:.1e} (appends round differently): "
          f"{'REPLAY CHECK PASSED' if ok else 'REPLAY CHECK FAILED'}  [{time.perf_counter() - t0:.1f} s]")
    return ok


def _speculative_round(args: argparse.Namespace, dev: torch.device, buckets, spec) -> bool:
    """Run and report :func:`run_speculative_decode`; True when it held."""
    t0, T = time.perf_counter(), args.spec_tokens
    res = run_speculative_decode(
        rounds=args.spec_rounds, tokens=T, layers=args.layers, buckets=buckets, shape=_layer_shape(args, spec),
        null_slot=args.null_slot, seed=args.seed, device=dev,
        use_cuda_graph=False if args.no_graphs else None, log=None if args.quiet else _log_spec_row,
    )
    for f in res.failures[:10]:
        print("  " + f)
    print(f"speculative decoding: {len(res.records)} verify steps x {args.layers} layers, T={T} tokens each "
          f"({T - 1} random drafts), {res.accepted} of {res.verified} tokens accepted, each request continuing "
          f"from its accepted row (by index, no copy); out of every accepted token and its state/B/x rows "
          f"{'byte-identical' if res.parity else 'NOT byte-identical'} to one-token-at-a-time decoding of the "
          f"accepted tokens, rows outside the requests' groups untouched: "
          f"{'SPECULATIVE CHECK PASSED' if res.parity else 'SPECULATIVE CHECK FAILED'}  "
          f"[{time.perf_counter() - t0:.1f} s]")
    return res.parity


def _log_spec_row(rec: SpecRecord) -> None:
    bucket = "eager" if rec.bucket is None else f"bucket {rec.bucket}, {rec.bucket - rec.live} padded"
    print(f"spec round {rec.round}: {rec.live} requests ({bucket}), joined {rec.joined}, left {rec.left}, "
          f"accepted {rec.accepted}: {'ok' if rec.parity else 'FAIL'}")
