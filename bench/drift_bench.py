"""Drift benchmark (CPU, about a minute): how far a recurrent state stored in fewer bits drifts from the
unrounded trajectory over a long decode.

    python bench/drift_bench.py [--out DIR] [--steps 8192] [--heads 4] [--seed 0] [--no-plot]

One request decodes ``--steps`` tokens with the step math of docs/contract.md in float64 (this file's
vectorised loop, checked against ``mamba3_step.reference.step_math`` at float64 before the run). After
every step the new state (rounded to fp32 first, as the kernel holds it) is stored in each format and
read back by the next step:

* ``fp32``; ``bf16``/``fp16`` ``nearest`` (torch's cast: round to nearest even) and ``stochastic``
  (:func:`mamba3_step.rounding.stochastic_round`);
* ``int8``/``e4m3`` with a per-(row, head, d) fp32 scale over N (:func:`mamba3_step.rounding.quantize_rows`),
  ``stochastic`` and ``nearest`` (the same rule with every draw 2**15: round half away from zero).

The random bits are the kernel's: :func:`mamba3_step.rounding.state_bits` with ``offset`` = the step and
the row = the regime (every stochastic format uses the same bits). The reference is the float64
state carried unrounded. Error: ``||s - s_ref|| / ||s_ref||`` per head (over D x N) for the stored
state and per head (over D) for ``out``, at steps 1, 64, 1024, 8192.

Inputs drawn like a trained layer's: A = -exp(linspace(log 0.05, log 8, H)) (log-uniform, slowest head
-0.05, fastest -8), B and C RMS-normed over N, x, z ~ N(0, 1), trap = sigmoid(N(0, 1)), projections
1 + 0.3 N(0, 1), D = 1; N = 128, D = 64, R = 4; the state, Bstate, Xstate start at zero (a new request).
Regimes:

* ``fresh``: a new random token every step, dt = softplus(log(expm1(0.01)) + 0.5 N(0, 1)) (median 0.01);
* ``stagnation``: one token repeated, dt = 0.0025 for every head (on the slowest head the state
  grows by about 1e-4 of itself per step: below half a bf16 ulp). From a zero state the state stays
  a multiple of one (D, N) pattern, which a per-row scale follows exactly: easy for the 8-bit formats;
* ``stagnation from a prompt``: the same, from a state N(0, 1) (as a prefill would leave it, stored in
  each format): the state turns slowly from the prompt's pattern to the token's, by updates far below
  an 8-bit step.

Also prints each format's modelled bytes per decode step at the flagship (H=48, D=64, N=128, R=4,
B=256, pool mode with update_kv_state; ``mamba3_step.tools.bytes_model``; the 8-bit formats add the scale
pool, read and written like the state). Writes ``drift_bench.json`` (and ``drift_bench.png`` with
matplotlib) to ``bench/results/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mamba3_step.tools.bytes_model import bytes_per_step  # noqa: E402
from mamba3_step.reference import step_math  # noqa: E402
from mamba3_step.rounding import dequantize_rows, quantize_rows, state_bits, stochastic_round  # noqa: E402
from mamba3_step.spec import flagship_spec  # noqa: E402
from mamba3_step.tensors import StepTensors  # noqa: E402

FORMATS = ("fp32", "bf16 nearest", "bf16 stochastic", "fp16 nearest", "fp16 stochastic",
           "int8+scale nearest", "int8+scale stochastic", "e4m3+scale nearest", "e4m3+scale stochastic")
REGIMES = ("fresh", "stagnation", "stagnation from a prompt")
CHECKPOINTS = (1, 64, 1024, 8192)
SIZES = dict(D=64, N=128, R=4)
A_RANGE = (-0.05, -8.0)
STAGNATION_DT = 0.0025
BLOCK = 64  # steps whose inputs and random bits are drawn at once
_HALF = 0x8000  # the draw that makes the stochastic rule round to nearest (ties away from zero)


def layer_constants(H: int, g: torch.Generator) -> dict:
    """A (H), D (H), xproj/zproj/outproj (R, H, D), float64."""
    R, D = SIZES["R"], SIZES["D"]
    A = -torch.exp(torch.linspace(math.log(-A_RANGE[0]), math.log(-A_RANGE[1]), H, dtype=torch.float64))
    proj = [1 + 0.3 * torch.randn(R, H, D, generator=g, dtype=torch.float64) for _ in range(3)]
    return dict(A=A, Dskip=torch.ones(H, dtype=torch.float64), xproj=proj[0], zproj=proj[1], outproj=proj[2])


def _rms_normed(shape, g) -> torch.Tensor:
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    return v / v.pow(2).mean(-1, keepdim=True).sqrt()


def draw_tokens(K: int, H: int, g: torch.Generator) -> dict:
    """K fresh tokens: x, z (K, H, D); B, C (K, R, H, N); dt, trap (K, H), float64."""
    R, D, N = SIZES["R"], SIZES["D"], SIZES["N"]
    dt_bias = math.log(math.expm1(0.01))
    return dict(x=torch.randn(K, H, D, generator=g, dtype=torch.float64),
                z=torch.randn(K, H, D, generator=g, dtype=torch.float64),
                B=_rms_normed((K, R, H, N), g), C=_rms_normed((K, R, H, N), g),
                dt=F.softplus(dt_bias + 0.5 * torch.randn(K, H, generator=g, dtype=torch.float64)),
                trap=torch.sigmoid(torch.randn(K, H, generator=g, dtype=torch.float64)))


def regime_tokens(K: int, H: int, g: torch.Generator, repeated: dict) -> dict:
    """The next K tokens of every regime, stacked on a regime axis after the step axis: (K, 3, ...)
    (both stagnation regimes repeat the same token)."""
    fresh = draw_tokens(K, H, g)
    stag = {k: v.expand(K, *v.shape[1:]) for k, v in repeated.items()}
    return {k: torch.stack([fresh[k], stag[k], stag[k]], 1) for k in fresh}


def repeated_token(H: int, g: torch.Generator) -> dict:
    tok = draw_tokens(1, H, g)
    tok["dt"] = torch.full_like(tok["dt"], STAGNATION_DT)
    return tok


def initial_rows(H: int, g: torch.Generator, repeated: dict, seed: int) -> tuple[torch.Tensor, dict]:
    """The state (G, 1 + formats, H, D, N) and previous B/x at step 0: zeros for a new request (``fresh``,
    ``stagnation``); for ``stagnation from a prompt`` a state N(0, 1) as a prefill would leave it (each
    format holds it as it would store it: stochastic formats with the bits of offset -1) and the
    repeated token as the previous one."""
    G, D, N, R = len(REGIMES), SIZES["D"], SIZES["N"], SIZES["R"]
    S = torch.zeros(G, len(FORMATS) + 1, H, D, N, dtype=torch.float64)  # index 0: the float64 reference
    prev = dict(B=torch.zeros(G, R, H, N, dtype=torch.float64), x=torch.zeros(G, H, D, dtype=torch.float64))
    p = REGIMES.index("stagnation from a prompt")
    S0 = torch.randn(H, D, N, generator=g, dtype=torch.float64)
    bits = state_bits(seed, -1, [p], H, D, N)[0]
    S[p] = torch.stack([S0] + [store(S0, f, bits) for f in FORMATS])
    prev["B"][p], prev["x"][p] = repeated["B"][0], repeated["x"][0]
    return S, prev


def step(S: torch.Tensor, tok: dict, prev: dict, c: dict, want_out: bool = True) -> tuple:
    """One step of docs/contract.md's math in float64 for G lanes and F stored states each.

    S (G, F, H, D, N); tok and prev (the previous token's B, x): per-lane tensors with a leading G axis.
    Returns (new (G, F, H, D, N), out (G, F, H, D), or None without ``want_out``)."""
    alpha = torch.exp(c["A"] * tok["dt"])  # (G, H)
    beta = (1 - tok["trap"]) * tok["dt"] * alpha
    gamma = tok["trap"] * tok["dt"]
    xr = tok["x"][:, None] * c["xproj"]  # (G, R, H, D)
    xsr = prev["x"][:, None] * c["xproj"]
    U = torch.einsum("grhd,grhn->ghdn", gamma[:, None, :, None] * xr, tok["B"])
    U = U + torch.einsum("grhd,grhn->ghdn", beta[:, None, :, None] * xsr, prev["B"])
    new = alpha[:, None, :, None, None] * S + U[:, None]
    if not want_out:
        return new, None
    y = torch.einsum("gfhdn,grhn->gfrhd", new, tok["C"]) + (c["Dskip"][:, None] * xr)[:, None]
    y = y * F.silu(tok["z"][:, None] * c["zproj"])[:, None]
    return new, (y * c["outproj"]).sum(2)


def store(new: torch.Tensor, fmt: str, r: torch.Tensor) -> torch.Tensor:
    """``new`` (float64) as the format stores it, read back as float64 (fp32 first, as the kernel holds it)."""
    x = new.float()
    if fmt == "fp32":
        return x.double()
    kind, how = fmt.split(" ")
    draws = r if how == "stochastic" else torch.full_like(r, _HALF)
    if kind in ("bf16", "fp16"):
        dtype = torch.bfloat16 if kind == "bf16" else torch.float16
        return (x.to(dtype) if how == "nearest" else stochastic_round(x, r, dtype)).double()
    q, scale = quantize_rows(x, draws, "int8" if kind.startswith("int8") else "float8_e4m3fn")
    return dequantize_rows(q, scale).double()


def _rel(err: torch.Tensor, ref: torch.Tensor, dims) -> torch.Tensor:
    return err.pow(2).sum(dims).sqrt() / ref.pow(2).sum(dims).sqrt().clamp(min=1e-300)


def record_steps(steps: int) -> list[int]:
    """The checkpoints that fit plus about 60 log-spaced steps (for the plot)."""
    grid = {int(round(10 ** (i * math.log10(steps) / 60))) for i in range(61)}
    return sorted(grid | {c for c in CHECKPOINTS if c <= steps} | {steps})


def run(steps: int, H: int, seed: int = 0) -> dict:
    """Both regimes, every format: ``{"steps": [...], regime: {format: {"state": [[err per head] per
    recorded step], "out": [...]}}}``. Runs on one intra-op thread: the tensors are small (a few
    hundred thousand elements), and on the development machine every multi-threaded op then cost
    about 16 ms of thread wake-up against 30 us on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(steps, H, seed)
    finally:
        torch.set_num_threads(threads)


def _run(steps: int, H: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    c = layer_constants(H, g)
    repeated = repeated_token(H, g)
    G, D, N = len(REGIMES), SIZES["D"], SIZES["N"]
    S, prev = initial_rows(H, g, repeated, seed)
    wanted = set(record_steps(steps))
    res = {"steps": [], **{rg: {f: {"state": [], "out": []} for f in FORMATS} for rg in REGIMES}}
    for k0 in range(0, steps, BLOCK):
        K = min(BLOCK, steps - k0)
        toks = regime_tokens(K, H, g, repeated)
        bits = state_bits(seed, torch.arange(k0, k0 + K), list(range(G)), H, D, N)  # (K, G, H, D, N)
        for k in range(K):
            tok = {n: v[k] for n, v in toks.items()}
            t = k0 + k + 1
            S, out = step(S, tok, prev, c, want_out=t in wanted)
            for i, f in enumerate(FORMATS):
                S[:, i + 1] = store(S[:, i + 1], f, bits[k])
            prev = dict(B=tok["B"], x=tok["x"])
            if out is not None:
                _record(res, t, S, out)
    return res


def _record(res: dict, t: int, S: torch.Tensor, out: torch.Tensor) -> None:
    es = _rel(S[:, 1:] - S[:, :1], S[:, :1], (-2, -1))  # (G, F, H)
    eo = _rel(out[:, 1:] - out[:, :1], out[:, :1], (-1,))
    res["steps"].append(t)
    for gi, rg in enumerate(REGIMES):
        for fi, f in enumerate(FORMATS):
            res[rg][f]["state"].append(es[gi, fi].tolist())
            res[rg][f]["out"].append(eo[gi, fi].tolist())


def check_against_reference(H: int = 3, seed: int = 1) -> float:
    """Two steps of :func:`step` against ``step_math`` at float64 (one lane per regime); returns the
    largest relative difference and raises AssertionError above 1e-12."""
    g = torch.Generator().manual_seed(seed)
    c = layer_constants(H, g)
    toks = regime_tokens(2, H, g, repeated_token(H, g))
    L = len(REGIMES)
    S = torch.randn(L, 1, H, SIZES["D"], SIZES["N"], generator=g, dtype=torch.float64)
    prev = dict(B=torch.randn(L, SIZES["R"], H, SIZES["N"], generator=g, dtype=torch.float64),
                x=torch.randn(L, H, SIZES["D"], generator=g, dtype=torch.float64))
    worst = 0.0
    for k in range(2):
        tok = {n: v[k] for n, v in toks.items()}
        new, out = step(S, tok, prev, c)
        t = StepTensors(state=S[:, 0], Bstate=prev["B"], Xstate=prev["x"], A=c["A"].expand(L, H), B=tok["B"],
                        C=tok["C"], D=c["Dskip"], x=tok["x"], dt=tok["dt"], trap=tok["trap"], xproj=c["xproj"],
                        outproj=c["outproj"], z=tok["z"], zproj=c["zproj"])
        ref_state, ref_out = step_math(t, compute_dtype=torch.float64)
        for a, b in ((new[:, 0], ref_state), (out[:, 0], ref_out)):
            worst = max(worst, float((a - b).abs().max() / b.abs().max()))
        S, prev = new, dict(B=tok["B"], x=tok["x"])
    assert worst < 1e-12, f"drift_bench's float64 step differs from step_math by {worst:.2e}"
    return worst


def flagship_bytes(batch: int = 256, heads: int = 48) -> list[dict]:
    """Modelled bytes per decode step at the flagship for each storage format (bytes_model: the 8-bit
    formats' entries include their fp32 scale pool (rows, H, D), read + written like the state)."""
    rows = []
    base = None
    for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                        ("int8 + scale", "int8"), ("e4m3 + scale", "float8_e4m3fn")):
        b = bytes_per_step(flagship_spec(state_dtype=dtype, stochastic_rounding=dtype != "float32"), batch, heads)
        base = base or b["total"]
        rows.append({"format": name, "state_mib": b["state"] / 2**20, "scale_mib": b["state_scale"] / 2**20,
                     "total_mib": b["total"] / 2**20, "vs_fp32": b["total"] / base, "bytes": b["total"]})
    return rows


def checkpoint_rows(res: dict) -> list[dict]:
    """One row per (regime, format): errors at the checkpoints, slowest / fastest head."""
    rows = []
    for rg in REGIMES:
        for f in FORMATS:
            row = {"regime": rg, "format": f}
            for c in CHECKPOINTS:
                if c in res["steps"]:
                    i = res["steps"].index(c)
                    for what in ("state", "out"):
                        e = res[rg][f][what][i]
                        row[f"{what}_{c}"] = f"{e[0]:.1e} / {e[-1]:.1e}"
            rows.append(row)
    return rows


def plot(res: dict, path) -> bool:
    """State error against steps: a panel per (regime, slowest / fastest head), a line per format."""
    plt = _util.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(len(REGIMES), 2, figsize=(11, 3.8 * len(REGIMES)), squeeze=False)
    for r, rg in enumerate(REGIMES):
        for col, (head, label) in enumerate(((0, "slowest head (A = -0.05)"), (-1, "fastest head (A = -8)"))):
            ax = axes[r][col]
            for f in FORMATS:
                ys = [max(e[head], 1e-17) for e in res[rg][f]["state"]]
                ax.plot(res["steps"], ys, label=f, linestyle="--" if "nearest" in f else "-")
            _util.log_panel(ax, f"{rg}: {label}")
        axes[r][0].set_ylabel("relative state error")
    axes[0][0].legend(fontsize=7)
    _util.save_figure(plt, fig, path)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--steps", type=int, default=8192, help="decode steps (default 8192)")
    ap.add_argument("--heads", type=int, default=4, help="heads, A log-spaced from -0.05 to -8 (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.heads < 2:
        ap.error("--steps must be >= 1 and --heads >= 2")
    start = time.perf_counter()
    worst = check_against_reference()
    res = run(args.steps, args.heads, args.seed)
    seconds = time.perf_counter() - start
    rows = checkpoint_rows(res)
    cps = [c for c in CHECKPOINTS if c in res["steps"]]
    print(f"state drift, {args.steps} steps, H={args.heads} (A {A_RANGE[0]} .. {A_RANGE[1]}), D={SIZES['D']}, "
          f"N={SIZES['N']}, R={SIZES['R']}; float64 math (matches step_math to {worst:.0e}); measured on the CPU")
    for what in ("state", "out"):
        print(f"\nrelative error of the {what} (slowest head / fastest head)")
        cols = [("regime", "regime", "<"), ("format", "format", "<")] + [
            (f"{what}_{c}", f"step {c}", ">") for c in cps]
        print(_util.format_table(rows, cols))
    brows = flagship_bytes()
    print("\nmodelled bytes per decode step, flagship (H=48, D=64, N=128, R=4, B=256, pool, update_kv_state)")
    print(_util.format_table(brows, [("format", "state format", "<"), ("state_mib", "state MiB", ">.1f"),
                                     ("scale_mib", "scale MiB", ">.1f"), ("total_mib", "total MiB", ">.1f"),
                                     ("vs_fp32", "vs fp32", ">.3f")]))
    out = _util.results_dir(args.out)
    payload = {"what": "measured on the CPU: relative error of a state stored in each format after every step "
                       "against the unrounded float64 trajectory (bench/drift_bench.py docstring)",
               "environment": _util.environment(), "steps": args.steps, "heads": args.heads, "seed": args.seed,
               "sizes": SIZES, "A": layer_constants(args.heads, torch.Generator())["A"].tolist(),
               "checkpoints": cps, "formats": list(FORMATS), "rows": rows, "results": res,
               "flagship_bytes": brows, "seconds": seconds}
    print(f"\nwrote {_util.write_json(out / 'drift_bench.json', payload)} ({seconds:.1f} s)")
    if not args.no_plot:
        _util.write_plot(lambda png: plot(res, png), out / "drift_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
