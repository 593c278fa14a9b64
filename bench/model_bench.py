"""Model benchmark (runs anywhere, no GPU): bytes one decode step moves and the time that
costs at HBM bandwidth, for pool mode, gather -> dense -> scatter and dense mode; and for
speculative decoding, one T-token step against T one-token steps.

    python bench/model_bench.py [--out DIR] [--heads 48] [--no-plot]

Prints a table per configuration and the T-token table, writes ``model_bench.json`` and
``model_bench.png`` to ``bench/results/`` (or ``--out``). Every number here is *modelled* (``mamba3_step.bytes_model``:
compulsory bytes / peak HBM bandwidth), not measured; ``bench/gpu_bench.py`` measures.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _util  # noqa: E402  (also puts the repository on sys.path)

from mamba3_step.bytes_model import HBM_BANDWIDTH, MODES, bytes_per_step, token_saving  # noqa: E402
from mamba3_step.spec import FLAGSHIP_HEADS, flagship_spec  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
GPUS = tuple(HBM_BANDWIDTH)  # H100, H200, GH200


def configurations() -> dict:
    """name -> StepSpec; the flagship first (pool mode with update_kv_state, as a server runs it)."""
    return {
        "flagship (N=128 D=64 R=4, fp32 state)": flagship_spec(),
        "bf16 state (N=128 D=64 R=4)": flagship_spec(state_dtype="bfloat16"),
        "N=64 D=64 R=2, fp32 state": flagship_spec(dstate=64, mimo=2),
        "flagship without update_kv_state": flagship_spec(update_kv_state=False),
    }


def model_rows(configs: dict | None = None, batches=BATCHES, heads: int = FLAGSHIP_HEADS) -> list[dict]:
    """One row per (configuration, batch): bytes per mode, predicted microseconds per mode and
    GPU, and the predicted speed-up of pool mode over gather -> dense -> scatter."""
    configs = configurations() if configs is None else configs
    rows = []
    for name, spec in configs.items():
        for batch in batches:
            row = {"config": name, "batch": batch, "heads": heads}
            for mode in MODES:
                b = bytes_per_step(spec, batch, heads, mode=mode)
                row[f"bytes_{mode}"] = b["total"]
                row[f"breakdown_{mode}"] = b
                for gpu in GPUS:
                    row[f"us_{mode}_{gpu}"] = b["total"] / HBM_BANDWIDTH[gpu] * 1e6
            row["speedup_pool_vs_gather_scatter"] = row["bytes_gather_scatter"] / row["bytes_pool"]
            rows.append(row)
    return rows


TOKENS = (1, 2, 3, 4, 6, 8)
TOKEN_BATCHES = (1, 64, 256)


def token_rows(batches=TOKEN_BATCHES, tokens=TOKENS, heads: int = FLAGSHIP_HEADS) -> list[dict]:
    """The flagship's speculative verify step (T tokens, (B, K) sources, a row per token, update_kv_state)
    against T one-token steps: bytes and predicted microseconds on each GPU."""
    rows = []
    for batch in batches:
        for T in tokens:
            spec = flagship_spec(tokens=T, has_dst=True, dst_per_token=T > 1, num_accepted=True)
            s = token_saving(spec, batch, heads)
            row = {"batch": batch, "tokens": T, "heads": heads, "mib_t_token": s["t_token_bytes"] / 2**20,
                   "mib_one_token_steps": s["one_token_steps_bytes"] / 2**20, "saving": s["ratio"]}
            for gpu in GPUS:
                row[f"us_t_token_{gpu}"] = s["t_token_bytes"] / HBM_BANDWIDTH[gpu] * 1e6
                row[f"us_one_token_steps_{gpu}"] = s["one_token_steps_bytes"] / HBM_BANDWIDTH[gpu] * 1e6
            rows.append(row)
    return rows


TOKEN_COLUMNS = [("batch", "B", ">d"), ("tokens", "T", ">d"), ("mib_t_token", "T-token MiB", ">.1f"),
                 ("mib_one_token_steps", "T x 1-token MiB", ">.1f")] + [
    (f"us_{k}_H100", f"H100 {label} us", ">.1f") for k, label in (("t_token", "T-token"),
                                                                   ("one_token_steps", "T x 1-token"))
] + [("saving", "saving", ">.2f")]


TABLE_COLUMNS = [
    ("batch", "B", ">d"),
    ("mib_pool", "pool MiB", ">.1f"),
    ("mib_gather_scatter", "g/s MiB", ">.1f"),
    ("mib_dense", "dense MiB", ">.1f"),
] + [
    (f"us_{mode}_{gpu}", f"{gpu} {label} us", ">.1f")
    for gpu in GPUS
    for mode, label in (("pool", "pool"), ("gather_scatter", "g/s"))
] + [("speedup_pool_vs_gather_scatter", "speed-up", ">.2f")]


def format_tables(rows: list[dict]) -> str:
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        sub = []
        for r in rows:
            if r["config"] != name:
                continue
            t = dict(r)
            for mode in MODES:
                t[f"mib_{mode}"] = r[f"bytes_{mode}"] / 2**20
            sub.append(t)
        out.append(f"{name}, H={sub[0]['heads']}: modelled (compulsory bytes / peak HBM bandwidth); "
                   "g/s = gather -> dense -> scatter; dense-mode times are in the JSON")
        out.append(_util.format_table(sub, TABLE_COLUMNS))
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path) -> bool:
    """Two panels: the flagship's predicted step time per mode (H100 solid, GH200 dashed), and
    the predicted speed-up per configuration. False when matplotlib is missing."""
    plt = _util.pyplot()
    if plt is None:
        return False
    names = list(dict.fromkeys(r["config"] for r in rows))
    flag = [r for r in rows if r["config"] == names[0]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    colors = _util.MODE_COLORS
    labels = {"pool": "pool mode", "gather_scatter": "gather -> dense -> scatter", "dense": "dense mode"}
    xs = [r["batch"] for r in flag]
    # pool and dense mode move almost the same bytes: pool is drawn wide, dense thin on top
    width = {"pool": 4.0, "gather_scatter": 1.6, "dense": 1.0}
    marker = {"pool": None, "gather_scatter": "o", "dense": "x"}
    for mode in ("gather_scatter", "pool", "dense"):
        for gpu, style in (("H100", "-"), ("GH200", "--")):
            ax1.plot(xs, [r[f"us_{mode}_{gpu}"] for r in flag], style, marker=marker[mode], ms=4,
                     lw=width[mode], alpha=0.45 if mode == "pool" else 1.0,
                     color=colors[mode], label=f"{labels[mode]}, {gpu}")
    ax1.set_yscale("log")
    ax1.set_ylabel("predicted step time (us, one layer)")
    ax1.set_title(f"{names[0]}, H={flag[0]['heads']}\nmodelled: bytes / peak HBM bandwidth "
                  "(pool and dense nearly coincide)", fontsize=10)
    ax1.legend(fontsize=8)
    markers = ["o", "s", "^", "v", "D", "P"]
    styles = ["-", "--", ":", "-."]
    for i, name in enumerate(names):
        sub = [r for r in rows if r["config"] == name]
        ax2.plot([r["batch"] for r in sub], [r["speedup_pool_vs_gather_scatter"] for r in sub],
                 styles[i % len(styles)], marker=markers[i % len(markers)], ms=5, label=name)
    ax2.set_ylim(1.0, 3.2)
    ax2.set_ylabel("predicted speed-up (bytes ratio)")
    ax2.set_title("pool mode over gather -> dense -> scatter\n(modelled; same on every GPU)", fontsize=10)
    ax2.legend(fontsize=8, loc="lower right")
    _util.save_batch_plot(plt, fig, (ax1, ax2), xs, path)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (default bench/results)")
    p.add_argument("--heads", type=int, default=FLAGSHIP_HEADS, help="H (default 48)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    if args.heads < 1:
        p.error(f"--heads must be >= 1, got {args.heads}")
    rows = model_rows(heads=args.heads)
    print(format_tables(rows))
    tokens = token_rows(heads=args.heads)
    print(f"speculative verify step, flagship, H={args.heads}: one T-token step ((B, K) sources, a row per token, "
          "update_kv_state) vs T one-token steps; modelled (bytes / peak HBM bandwidth)")
    print(_util.format_table(tokens, TOKEN_COLUMNS))
    out = _util.results_dir(args.out)
    payload = {
        "what": "modelled, not measured: compulsory HBM bytes per decode step (mamba3_step.bytes_model) "
                "divided by peak HBM bandwidth",
        "environment": _util.environment(),
        "hbm_bandwidth_bytes_per_s": HBM_BANDWIDTH,
        "configs": {name: spec.as_dict() for name, spec in configurations().items()},
        "rows": rows,
        "tokens": tokens,
    }
    print(f"wrote {_util.write_json(out / 'model_bench.json', payload)}")
    if not args.no_plot:
        png = out / "model_bench.png"
        if plot(rows, png):
            print(f"wrote {png}")
        else:
            print("matplotlib not installed: no plot (pip install mamba3-step[bench])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
