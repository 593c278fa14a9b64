"""The replay suites' plot: per suite, each timed variant's speed-up over its stepwise step (CUDA graph
when timed, else eager), one bar per batch size."""

from __future__ import annotations

import _util


def variant(row: dict) -> str:
    """A row's variant, in words: its step (and form), output form, warps and launch bound."""
    parts = [row.get("form"), row["step"], row.get("outputs")]
    if row.get("num_warps"):
        parts.append(f"{row['num_warps']} warps")
    if row.get("min_ctas"):
        parts.append(f"{row['min_ctas']} CTAs")
    return ", ".join(p for p in parts if p)


def speedups(rows: list[dict]) -> dict:
    """``{variant: {batch: speed-up}}`` over the stepwise rows (graph speed-up where timed, else eager)."""
    out: dict = {}
    for row in rows:
        if row["step"] == "stepwise":
            continue
        value = row.get("speedup_graph", row.get("speedup_eager"))
        out.setdefault(variant(row), {})[row["batch"]] = value
    return out


def plot_speedups(results: dict, title: str, path) -> bool:
    """One panel per suite in ``results`` (``{suite name: its result}``); False without matplotlib."""
    plt = _util.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 3.6 * len(results)), squeeze=False)
    for ax, (name, result) in zip(axes[:, 0], results.items()):
        table = speedups(result["rows"])
        batches = sorted({b for per in table.values() for b in per})
        width = 0.8 / max(1, len(batches))
        for i, batch in enumerate(batches):
            xs = [j + (i - (len(batches) - 1) / 2) * width for j in range(len(table))]
            ax.bar(xs, [per.get(batch, 0.0) for per in table.values()], width, label=f"B={batch}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(table)), list(table), fontsize=7, rotation=20, ha="right")
        ax.set_ylabel("speed-up over stepwise\n(CUDA graph if timed, else eager)", fontsize=9)
        ax.set_title(f"suite {name}: {title}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    _util.save_figure(plt, fig, path)
    return True
