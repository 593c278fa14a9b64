"""Angle benchmark (runs anywhere, CPU, under a minute): how precisely four ways of storing
Mamba-3's rotary angle keep it over 10^3 .. 10^6 decode steps.

    python bench/angle_bench.py [--out DIR] [--steps 1000000] [--trials 8] [--no-plot]

Every step advances the angle by ``tanh(angle_proj) * dt * pi`` radians; ``w = tanh(angle_proj)
* dt`` is computed in fp32 (torch), the same ``w`` for every representation:

* ``fp32 unreduced (upstream)``: ``angle += w * pi`` in fp32, never reduced (upstream's
  ``angle_dt_state``; its Triton kernel computes ``tanh`` as ``2 sigmoid(2x) - 1``, here
  ``torch.tanh``);
* ``fp32 reduced``: the same, then ``angle -= 2pi * rint(angle / 2pi)`` in fp32 (2pi rounded to
  fp32) every step, so it stays in [-pi, pi];
* ``int32 fixed point``: 2**-32 turn units, ``2 rint(w_frac 2**30)`` added with wrap-around
  (``w_frac`` = ``w`` less its whole turns; fp32 arithmetic, as a kernel would);
* ``int64 fixed point (ours)``: ``mamba3_step.rotary.angle_increment`` (2**-64 turn units), summed
  with wrap-around.

Error: the largest ``|cos - cos_ref|``, ``|sin - sin_ref|`` over the trials, with cos/sin of the
*stored* angle evaluated in float64 (what the storage costs), and in float32 (what a kernel gets:
adds the float32 rounding of cos/sin, ~6e-8). Reference: ``pi`` times the exact sum of the same
fp32 ``w`` (``math.fsum``, whole turns removed before the one rounding: ~4e-16 rad). Regimes:
``angle_proj`` N(0, 1) (both signs) or ``|N(0, 1)|`` (one sign), ``dt`` softplus(N(-4, 1)) (the
angle turns ~0.05 rad a step); ``adversarial``: the same small increment every step (dt = 0.0025,
``angle_proj`` in [0.3, 0.7] per trial: ~2.3e-3 to 4.7e-3 rad a step).

Prints a table, writes ``angle_bench.json`` (and ``angle_bench.png`` with matplotlib) to
``bench/results/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mamba3_step.rotary import angle_cos_sin, angle_increment  # noqa: E402

METHODS = ("fp32 unreduced (upstream)", "fp32 reduced", "int32 fixed point", "int64 fixed point (ours)")
REGIMES = ("both signs", "one sign", "adversarial")
CHECKPOINTS = (10**3, 10**4, 10**5, 10**6)
_PI32 = np.float32(math.pi)


def layer_inputs(regime: str, trials: int, steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(angle_proj, dt)``, (trials, steps) fp32 each, drawn as a layer makes them (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    if regime == "adversarial":
        p = torch.linspace(0.3, 0.7, trials)[:, None].expand(trials, steps).contiguous()
        return p, torch.full((trials, steps), 0.0025)
    p = torch.randn(trials, steps, generator=g)
    dt = F.softplus(torch.randn(trials, steps, generator=g) - 4.0)
    return (p.abs() if regime == "one sign" else p), dt


def exact_half_turns(w: np.ndarray) -> float:
    """The exact sum of ``w`` (float64 copies of fp32 values; a unit is half a turn) less a whole
    number of turns, rounded once: ``math.fsum`` with ``-2k`` appended (any integer ``k`` works)."""
    k = round(float(np.sum(w)) / 2)
    return math.fsum(np.append(w, -2.0 * k))


def fp32_unreduced(inc: np.ndarray) -> np.ndarray:
    """Upstream's fp32 angle after each step: a sequential float32 running sum (``np.cumsum`` with a
    float32 accumulator adds in order, one rounding per step; checked in :func:`self_check`)."""
    return np.cumsum(inc, axis=1, dtype=np.float32)


def fp32_reduced(inc_row: np.ndarray, checkpoints) -> list:
    """The reduced fp32 angle of one trial at ``checkpoints``: ``a = fl(a + inc)``, then
    ``a = fl(a - fl(m 2pi))`` with ``m = rint(fl(a / 2pi))`` (a no-op while m = 0). Runs between
    reductions are float32 running sums (exactly the per-step loop, many steps per numpy call)."""
    two_pi, inv = np.float32(2 * math.pi), np.float32(1 / (2 * math.pi))
    a, k, n, width, out = np.float32(0.0), 0, len(inc_row), 64, {}
    wanted = sorted(c - 1 for c in checkpoints if c <= n)
    while k < n:
        seg = np.cumsum(np.concatenate(([a], inc_row[k:k + width])), dtype=np.float32)[1:]
        m = np.rint(seg * inv)
        hit = np.flatnonzero(m != 0)
        j = int(hit[0]) if hit.size else len(seg) - 1
        width = 64 if hit.size else min(2 * width, 8192)
        a = np.float32(seg[j] - np.float32(m[j] * two_pi)) if hit.size else seg[j]
        for step in wanted:
            if k <= step < k + j:
                out[step] = seg[step - k]
            elif step == k + j:
                out[step] = a
        k += j + 1
    return [out[s] for s in wanted]


def fixed_point_units(p: torch.Tensor, dt: torch.Tensor, w: torch.Tensor, bits: int) -> np.ndarray:
    """Per-step increments in 2**-64 turn units (int64, wrapping): ours from
    ``mamba3_step.rotary.angle_increment``; ``bits=32``: ``2 rint(w_frac 2**30)`` units of 2**-32
    turn in fp32 (the same scheme with an int32 angle), shifted up by 32 bits (exact)."""
    if bits == 64:
        return angle_increment(p[..., None], dt)[..., 0].numpy()
    w_frac = w - 2 * torch.round(w * 0.5)
    units32 = torch.round(w_frac * 2.0**30).to(torch.int64) * 2  # |units32| <= 2**31
    return (units32.numpy().view(np.uint64) << np.uint64(32)).view(np.int64)


def wrapping_prefix_sums(units: np.ndarray, checkpoints) -> np.ndarray:
    """(trials, len(checkpoints)): each row's first c increments summed modulo 2**64 (unsigned
    arithmetic, where wrap-around is defined), as int64 angles."""
    u = units.view(np.uint64)
    return np.stack([u[:, :c].sum(axis=1, dtype=np.uint64) for c in checkpoints], 1).view(np.int64)


def self_check(inc: np.ndarray, steps: int = 2000) -> None:
    """The vectorised fp32 emulations against the per-step loop they stand for (first ``steps``
    steps of trial 0), bit for bit; raises AssertionError otherwise."""
    two_pi, inv = np.float32(2 * math.pi), np.float32(1 / (2 * math.pi))
    row = inc[0, :steps]
    plain, red = np.float32(0.0), np.float32(0.0)
    want_plain, want_red = [], []
    for x in row:
        plain = np.float32(plain + x)
        red = np.float32(red + x)
        red = np.float32(red - np.float32(np.rint(np.float32(red * inv)) * two_pi))
        want_plain.append(plain)
        want_red.append(red)
    assert np.array_equal(fp32_unreduced(inc[:1, :steps])[0], np.array(want_plain, np.float32))
    every = range(1, steps + 1)
    assert np.array_equal(np.array(fp32_reduced(row, every), np.float32), np.array(want_red, np.float32))


def _errors(cos_sin64, cos_sin32, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Largest |cos - cos_ref|, |sin - sin_ref| per checkpoint (max over trials): float64 and
    float32 evaluations of the stored angles; ``ref`` (trials, checkpoints) radians."""
    rc, rs = np.cos(ref), np.sin(ref)
    out = []
    for c, s in (cos_sin64, cos_sin32):
        c, s = np.asarray(c, np.float64), np.asarray(s, np.float64)
        out.append(np.maximum(np.abs(c - rc), np.abs(s - rs)).max(axis=0))
    return out[0], out[1]


def regime_errors(regime: str, trials: int, steps: int, seed: int = 0) -> dict:
    """``{method: {"f64": [error per checkpoint], "f32": [...]}}`` plus ``"_ref"`` facts for one
    regime (checkpoints up to ``steps``)."""
    cps = [c for c in CHECKPOINTS if c <= steps] or [steps]
    p, dt = layer_inputs(regime, trials, steps, seed)
    w = (torch.tanh(p[..., None]) * dt[..., None])[..., 0]  # the fp32 w of angle_increment
    w64 = w.double().numpy()
    ref = np.pi * np.array([[exact_half_turns(w64[t, :c]) for c in cps] for t in range(trials)])
    inc = w.numpy() * _PI32  # upstream: (tanh(p) dt) pi, in fp32
    if steps >= 10:
        self_check(inc, min(steps, 2000))
    out = {}
    plain = fp32_unreduced(inc)[:, [c - 1 for c in cps]]
    reduced = np.array([fp32_reduced(inc[t], cps) for t in range(trials)], np.float32)
    for name, a in (("fp32 unreduced (upstream)", plain), ("fp32 reduced", reduced)):
        t32 = torch.from_numpy(a)
        e64, e32 = _errors((np.cos(a.astype(np.float64)), np.sin(a.astype(np.float64))),
                           (torch.cos(t32).numpy(), torch.sin(t32).numpy()), ref)
        out[name] = {"f64": e64.tolist(), "f32": e32.tolist()}
    for name, bits in (("int32 fixed point", 32), ("int64 fixed point (ours)", 64)):
        q = torch.from_numpy(wrapping_prefix_sums(fixed_point_units(p, dt, w, bits), cps))
        e64, e32 = _errors(angle_cos_sin(q, torch.float64), angle_cos_sin(q, torch.float32), ref)
        out[name] = {"f64": e64.tolist(), "f32": e32.tolist()}
    out["_ref"] = {"checkpoints": cps, "mean_abs_step_rad": float(np.pi * np.abs(w64).mean()),
                   "fp32_unreduced_mean_abs_angle_rad": np.abs(plain).mean(axis=0).astype(float).tolist()}
    return out


def rows_of(results: dict) -> list[dict]:
    """One table row per (regime, method, evaluation): the error at each checkpoint."""
    rows = []
    for regime, res in results.items():
        for ev in ("f64", "f32"):
            for method in METHODS:
                row = {"regime": regime, "method": method, "eval": ev}
                for c, e in zip(res["_ref"]["checkpoints"], res[method][ev]):
                    row[f"err_{c}"] = e
                rows.append(row)
    return rows


def format_tables(rows: list[dict], checkpoints) -> str:
    cols = [("regime", "regime", "<"), ("method", "method", "<")] + [
        (f"err_{c}", f"{c:.0e} steps".replace("+0", ""), ">.1e") for c in checkpoints]
    out = []
    for ev, what in (("f64", "cos/sin of the stored angle in float64: what the storage costs"),
                     ("f32", "cos/sin in float32, as a kernel evaluates them (adds ~6e-8 of float32 rounding)")):
        out.append(f"largest |cos - cos_ref|, |sin - sin_ref| over the trials; {what}")
        out.append(_util.format_table([r for r in rows if r["eval"] == ev], cols))
        out.append("")
    return "\n".join(out)


def plot(results: dict, path) -> bool:
    """One panel per regime: error (float64 evaluation) against steps, a line per method."""
    plt = _util.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.2), squeeze=False)
    for ax, (regime, res) in zip(axes[0], results.items()):
        cps = res["_ref"]["checkpoints"]
        for method, marker in zip(METHODS, "osv^"):
            ax.plot(cps, [max(e, 1e-17) for e in res[method]["f64"]], marker=marker, label=method)
        _util.log_panel(ax, regime)
    axes[0][0].set_ylabel("cos/sin error (float64 evaluation)")
    axes[0][0].legend(fontsize=8)
    _util.save_figure(plt, fig, path)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--steps", type=int, default=10**6, help="decode steps (default 10^6)")
    ap.add_argument("--trials", type=int, default=8, help="independent angles per regime (default 8)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.trials < 1:
        ap.error("--steps and --trials must be >= 1")
    start = time.perf_counter()
    results = {regime: regime_errors(regime, args.trials, args.steps, seed=i) for i, regime in enumerate(REGIMES)}
    rows = rows_of(results)
    cps = results[REGIMES[0]]["_ref"]["checkpoints"]
    print(f"rotary angle precision, {args.trials} trials per regime; measured on the CPU (exact emulation of "
          "each format's arithmetic), not on a GPU")
    print(format_tables(rows, cps))
    for regime, res in results.items():
        print(f"{regime}: mean |step| {res['_ref']['mean_abs_step_rad']:.2e} rad; upstream's unreduced fp32 "
              f"angle reaches {res['_ref']['fp32_unreduced_mean_abs_angle_rad'][-1]:.3g} rad (mean |angle|)")
    seconds = time.perf_counter() - start
    out = _util.results_dir(args.out)
    payload = {"what": "measured on the CPU: cos/sin error of four rotary-angle formats against the exact sum "
                       "of the same fp32 increments (bench/angle_bench.py docstring)",
               "environment": _util.environment(), "steps": args.steps, "trials": args.trials,
               "checkpoints": cps, "methods": list(METHODS), "regimes": results, "rows": rows,
               "seconds": seconds}
    print(f"wrote {_util.write_json(out / 'angle_bench.json', payload)} ({seconds:.1f} s)")
    if not args.no_plot:
        _util.write_plot(lambda png: plot(results, png), out / "angle_bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
