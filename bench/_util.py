"""Helpers shared by the benchmarks in ``bench/``: repository import path, results folder,
plain-text tables, JSON output, optional matplotlib."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/x.py` from a checkout, package not installed
    sys.path.insert(0, str(REPO))

#: default output folder (git-ignored)
RESULTS = REPO / "bench" / "results"


def results_dir(path: str | os.PathLike | None = None) -> Path:
    out = Path(path) if path is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    return out


def add_gpu_bench_arguments(parser, batches: str, heads: int) -> None:
    """The arguments the GPU replay benchmarks share: ``--batches`` (default ``batches``), ``--heads``,
    ``--device`` (``cpu``: a smoke test of the plumbing), ``--no-graph`` and ``--out``."""
    parser.add_argument("--batches", default=batches, help=f"batch sizes (default {batches})")
    parser.add_argument("--heads", type=int, default=heads, help=f"H (default {heads})")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of the plumbing")
    parser.add_argument("--no-graph", action="store_true", help="eager timing only")
    parser.add_argument("--out", default=None, help="output folder (default bench/results)")


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width text table.

    Args:
        rows: one dict per row.
        columns: ``(key, header, format)`` per column; ``format`` is a ``str.format`` spec
            such as ``">10,d"`` or ``">8.1f"`` (``""`` for str). Missing / None values
            print as ``-``.
    """
    cells = []
    for row in rows:
        line = []
        for key, _, fmt in columns:
            v = row.get(key)
            if v is None:
                line.append("-")
            else:
                try:
                    line.append(format(v, fmt.lstrip("<>^")) if fmt else str(v))
                except (ValueError, TypeError):
                    line.append(str(v))
        cells.append(line)
    widths = [len(h) for _, h, _ in columns]
    for line in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, line)]
    left = [fmt.startswith("<") or fmt == "" for _, _, fmt in columns]

    def render(line):
        return "  ".join(c.ljust(w) if lft else c.rjust(w) for c, w, lft in zip(line, widths, left)).rstrip()

    header = render([h for _, h, _ in columns])
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([header, rule] + [render(line) for line in cells])


def environment() -> dict:
    """Where and when a benchmark ran (for the JSON files)."""
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    try:
        from importlib import metadata

        info["nvidia-cutlass-dsl"] = metadata.version("nvidia-cutlass-dsl")
    except Exception:  # pragma: no cover
        pass
    return info


def write_json(path: Path, payload) -> Path:
    path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    return path


def write_plot(draw, png: Path) -> None:
    """``draw(png)`` (True when it wrote the plot, False without matplotlib), with the line a
    benchmark prints either way."""
    print(f"wrote {png}" if draw(png) else "matplotlib not installed: no plot (pip install mamba3-step[bench])")


def log_panel(ax, title: str) -> None:
    """A log-log panel of error against decode steps (the drift and angle benchmarks)."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("decode steps")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def save_figure(plt, fig, path, dpi: int = 110) -> None:
    """Lay out, write and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is missing
    (``pip install mamba3-step[bench]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


#: one colour per step mode, the same in every plot
MODE_COLORS = {"pool": "tab:green", "gather_scatter": "tab:red", "dense": "tab:blue", "pool_padded": "tab:olive",
               "pool_dense_rows": "tab:purple", "pool_async_copy": "tab:orange", "upstream": "tab:gray",
               "pool_early_epilogue": "tab:cyan", "pool_late_epilogue": "tab:pink",
               "pool_unpinned_loads": "tab:brown"}


def save_batch_plot(plt, fig, axes, batches, path) -> None:
    """Label the x axes of ``axes`` with the batch sizes ``batches`` (log2 scale), save, close."""
    from matplotlib.ticker import FixedLocator, FuncFormatter  # matplotlib is optional (see pyplot)

    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch B (lanes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.xaxis.set_major_locator(FixedLocator(list(batches)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v)}"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
