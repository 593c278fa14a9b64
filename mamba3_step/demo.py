"""``python -m mamba3_step demo``: a toy multi-layer decode over a state pool, checked each step.

Requests join and leave between steps (slots allocated, reset, forked from a cached prefix
and freed); each step's live lanes are shuffled, padded up to a batch-size bucket and run,
layer after layer, through :class:`~mamba3_step.serving.CudaGraphStepRunner` (pool mode of
``mamba3_step_fn``: CUDA graphs and the CuteDSL kernel on a GPU, the PyTorch path on CPU).
A second copy of the pool is driven by the gather -> dense -> scatter baseline; after every
layer and step the outputs, every pool row and the untouched rows are compared bit for bit,
and the outputs are compared with a float64 reference for an error figure.

Letters: B lanes, P pool rows (slots), H heads, D head dim, N state size, R MIMO rank,
L layers. Exit status 0 when parity held everywhere and the error is within tolerance.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

import torch

from .contract import DTYPES
from .serving import CudaGraphStepRunner, StatePool, choose_bucket, gather_scatter_step
from .reference import step_math
from .tensors import StepTensors
from .testing import bits_equal, lane_inputs, layer_weights, poison_pool

_DTYPES = {name: d.torch for name, d in DTYPES.items()}


# ---- the toy decode ----------------------------------------------------------------------
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
    if device.type != "cuda":
        return "PyTorch CPU path (mamba3_step.reference, float32)"
    try:
        from . import kernel  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the GPU stack
        return f"PyTorch reference on CUDA (CuteDSL kernel unavailable: {e})"
    return "CuteDSL kernel"


def run_toy_decode(
    *,
    steps: int = 8,
    layers: int = 2,
    slots: int = 16,
    max_batch: int = 6,
    buckets=(1, 2, 4, 8),
    H: int = 4,
    D: int = 32,
    N: int = 32,
    R: int = 2,
    state_dtype=torch.float32,
    kv_dtype=torch.bfloat16,
    null_slot: bool = False,
    seed: int = 0,
    device="cpu",
    use_cuda_graph: bool | None = None,
    log=None,
) -> DemoResult:
    """Run the toy decode and compare it, step by step, with gather -> dense -> scatter.

    Each step: some live requests leave (their slot is freed, or kept as a cached prefix),
    new ones join (fresh zeroed slot, or a slot that reads a cached prefix's row as ``src``
    on its first step and writes its own row as ``dst``: prefix caching). Layer ``l + 1``'s
    ``x`` is layer ``l``'s ``out``. Both pools start from the same random poison, so a stray
    write anywhere shows up in the whole-pool comparison.
    """
    device = torch.device(device)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    x_dtype = kv_dtype
    pool = StatePool(
        layers, slots, H, D, N, R, state_dtype=state_dtype, kv_dtype=kv_dtype, device=device,
        reserve_null_slot=null_slot,
    )
    poison_pool(pool, g)
    # the baseline's pool: plain tensors, same contents
    base = [tuple(t.clone() for t in pool.layer_tensors(l)) for l in range(layers)]
    weights = [layer_weights(H, D, R, device=device, generator=g) for _ in range(layers)]
    runners = [
        CudaGraphStepRunner(pool, l, buckets=buckets, with_dst=True, use_cuda_graph=use_cuda_graph, **weights[l])
        for l in range(layers)
    ]
    if runners[0].use_cuda_graph:
        for r in runners:
            r.capture()
    result = DemoResult(str(device), _kernel_name(device), runners[0].use_cuda_graph)

    live: list[int] = []  # slots of live requests
    cached: list[int] = []  # slots holding a cached prefix (allocated, not live)
    for step in range(steps):
        # -- leave: finished requests free their slot, some become cached prefixes --------
        left = 0
        for s in list(live):
            if len(live) > 1 and rng.random() < 0.3:
                live.remove(s)
                left += 1
                if rng.random() < 0.5 and len(cached) < 2:
                    cached.append(s)
                else:
                    pool.free([s])
        # -- join: fresh requests and forks from a cached prefix ----------------------------
        want = rng.randint(1, 3) if step else rng.randint(2, 4)
        room = min(max_batch - len(live), pool.num_free)
        joined = forked = 0
        src_of: dict[int, int] = {}
        for _ in range(max(0, min(want, room))):
            s = int(pool.alloc(1)[0])
            if cached and rng.random() < 0.6:
                src_of[s] = cached.pop(0)  # prefix caching: read cached row, write own row
                forked += 1
            else:
                pool.reset([s])
                for l in range(layers):
                    for t in base[l]:
                        t[s] = 0
            live.append(s)
            joined += 1
        rng.shuffle(live)
        n = len(live)
        dst = torch.tensor(live, dtype=torch.int32)
        src = torch.tensor([src_of.get(s, s) for s in live], dtype=torch.int32)
        bucket = choose_bucket(n, runners[0].buckets)

        parity = True
        err = err32 = 0.0
        x = None
        x_base = None
        for l in range(layers):
            inp = lane_inputs(n, H, D, N, R, kv_dtype=kv_dtype, x_dtype=x_dtype, device=device, generator=g)
            if l:
                inp["x"], inp_base_x = x, x_base
            else:
                inp_base_x = inp["x"]
            before = [t.clone() for t in pool.layer_tensors(l)]
            st, bs, xs = base[l]
            src_dev = src.to(device)
            gathered = (st[src_dev.long()].clone(), bs[src_dev.long()].clone(), xs[src_dev.long()].clone())
            out = runners[l].step(src, dst_slots=dst, **inp)
            out_base = gather_scatter_step(
                st, bs, xs, inp["A"], inp["B"], inp["C"], weights[l]["D"], inp_base_x, inp["dt"],
                inp["trap"], weights[l]["xproj"], weights[l]["outproj"], z=inp["z"],
                zproj=weights[l]["zproj"], slots=src_dev, dst_slots=dst.to(device),
                null_slot_id=pool.null_slot_id, update_kv_state=True,
            )
            checks = {"out": bits_equal(out, out_base)}
            for name, a, b in zip(("state", "Bstate", "Xstate"), pool.layer_tensors(l), base[l]):
                checks[f"{name} pool"] = bits_equal(a, b)
            untouched = torch.ones(slots, dtype=torch.bool)
            untouched[dst.long()] = False
            ut = untouched.to(device)
            for name, a, b in zip(("state", "Bstate", "Xstate"), pool.layer_tensors(l), before):
                checks[f"{name} untouched rows"] = bits_equal(a[ut], b[ut])
            for what, ok in checks.items():
                if not ok:
                    parity = False
                    result.failures.append(f"step {step} layer {l}: {what} differs from the baseline")
            # float64 reference (and the float32 PyTorch computation, for scale)
            cpu = StepTensors(*(t.cpu() for t in gathered), **{k: (None if v is None else v.cpu())
                                                                for k, v in {**inp, **weights[l]}.items()})
            _, y64 = step_math(cpu, compute_dtype=torch.float64)
            _, y32 = step_math(cpu, compute_dtype=torch.float32)
            err = max(err, (out.cpu().double() - y64).abs().max().item())
            err32 = max(err32, (y32.to(out.dtype).double() - y64).abs().max().item())
            x, x_base = out, out_base
        # prefix rows consumed by forks this step are released
        for s in src_of.values():
            pool.free([s])
        rec = StepRecord(step, n, bucket, joined, left, forked, parity, err, err32)
        result.records.append(rec)
        if log:
            log(rec)
    return result


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m mamba3_step demo",
        description="Toy multi-layer pool-mode decode, checked each step against gather -> dense -> scatter.",
    )
    p.add_argument("--steps", type=int, default=8, help="decode steps (default 8)")
    p.add_argument("--layers", type=int, default=2, help="Mamba-3 layers (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    p.add_argument("--slots", type=int, default=16, help="pool rows P (default 16)")
    p.add_argument("--max-batch", type=int, default=6, help="most live requests at once (default 6)")
    p.add_argument("--buckets", default="1,2,4,8", help="CUDA-graph batch buckets (default 1,2,4,8)")
    p.add_argument("--heads", type=int, default=4, help="H (default 4)")
    p.add_argument("--headdim", type=int, default=32, help="D (default 32)")
    p.add_argument("--dstate", type=int, default=32, help="N (default 32)")
    p.add_argument("--mimo", type=int, default=2, help="R (default 2)")
    p.add_argument("--state-dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--kv-dtype", default="bfloat16", choices=sorted(_DTYPES), help="B/x dtype")
    p.add_argument("--null-slot", action="store_true", help="reserve row 0 as a null block (pad with 0)")
    p.add_argument("--no-graphs", action="store_true", help="on CUDA, run the padded steps eagerly")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    return p.parse_args(argv)


def cli_main(argv: list[str]) -> int:
    try:
        args = _parse(argv)
    except SystemExit as e:  # --help, or an argparse error (already printed)
        return e.code if isinstance(e.code, int) else 2
    if args.device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            print("demo: --device cuda asked for, but no CUDA device is available")
            return 2
    try:
        buckets = tuple(int(b) for b in args.buckets.split(","))
    except ValueError:
        print(f"demo: --buckets expects comma-separated ints, got {args.buckets!r}")
        return 2
    for name in ("steps", "layers", "slots", "heads"):
        if getattr(args, name) < 1:
            print(f"demo: --{name} must be >= 1, got {getattr(args, name)}")
            return 2
    from .tiling import shape_problem

    problem = shape_problem(args.dstate, args.headdim, args.mimo)
    if problem:
        print(f"demo: unsupported shape: {problem}")
        return 2
    if args.max_batch > args.slots - (1 if args.null_slot else 0) or args.max_batch < 1:
        print(f"demo: --max-batch must be in [1, usable slots], got {args.max_batch}")
        return 2

    lines = []

    def log(rec: StepRecord) -> None:
        if args.quiet:
            return
        if not lines:
            print("step  live  bucket  padded  joined  left  forked  parity  max|out - fp64|")
        lines.append(rec)
        bucket = "eager" if rec.bucket is None else str(rec.bucket)
        padded = 0 if rec.bucket is None else rec.bucket - rec.live
        print(
            f"{rec.step:>4}  {rec.live:>4}  {bucket:>6}  {padded:>6}  {rec.joined:>6}  {rec.left:>4}  "
            f"{rec.forked:>6}  {'ok' if rec.parity else 'FAIL':>6}  {rec.max_err:.3e}"
        )

    t0 = time.perf_counter()
    dev = torch.device(device)
    print(
        f"mamba3_step demo: device={dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}), "
        f"kernel: {_kernel_name(dev)}"
    )
    print(
        f"pool: L={args.layers} layers x P={args.slots} slots, H={args.heads} D={args.headdim} "
        f"N={args.dstate} R={args.mimo}, state {args.state_dtype}, B/x {args.kv_dtype}, "
        f"pad id {0 if args.null_slot else -1}" + (" (row 0 reserved as null slot)" if args.null_slot else "")
    )
    res = run_toy_decode(
        steps=args.steps, layers=args.layers, slots=args.slots, max_batch=args.max_batch,
        buckets=buckets, H=args.heads, D=args.headdim, N=args.dstate, R=args.mimo,
        state_dtype=_DTYPES[args.state_dtype], kv_dtype=_DTYPES[args.kv_dtype],
        null_slot=args.null_slot, seed=args.seed, device=dev,
        use_cuda_graph=False if args.no_graphs else None, log=log,
    )
    dt = time.perf_counter() - t0
    lanes = sum(r.live for r in res.records)
    padded = sum((r.bucket - r.live) for r in res.records if r.bucket is not None)
    # error tolerance: the kernel may be off the float64 reference by about what the float32
    # PyTorch computation is (plus one rounding of the output dtype)
    eps = torch.finfo(_DTYPES[args.kv_dtype]).eps
    tol = 2 * res.max_err_fp32 + eps
    err_ok = res.max_err <= tol
    print(f"CUDA graphs: {'yes (replayed per bucket)' if res.graphs else 'no (padded steps run eagerly)'}")
    print(
        f"{len(res.records)} steps x {args.layers} layers: {lanes} live lanes, {padded} padded lanes; "
        f"max |out - float64 reference| = {res.max_err:.3e} (float32 PyTorch: {res.max_err_fp32:.3e}, "
        f"tolerance {tol:.3e})"
    )
    for f in res.failures[:10]:
        print("  " + f)
    ok = res.parity and err_ok
    verdict = "PARITY HELD" if res.parity else "PARITY FAILED"
    print(
        f"{verdict}: pool mode vs gather -> dense -> scatter is "
        f"{'byte-identical' if res.parity else 'NOT byte-identical'} (out, every pool row, untouched rows); "
        f"error vs float64 {'within' if err_ok else 'OUTSIDE'} tolerance  [{dt:.1f} s]"
    )
    return 0 if ok else 1
