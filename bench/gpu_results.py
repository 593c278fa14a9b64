"""Reading a ``bench/gpu_bench.py`` result (its ``gpu_bench.json``) back: each replay suite's measured time
over its stepwise step's, for the models that set a measurement beside their prediction
(``bench/model_bench.py --measured``, ``bench/issue_model.py --measured``).

A time ratio is CUDA-graph replay time over the stepwise step's graph time in the same run, at one
batch size (default 256), at each step's default tiling (rows timed at ``--replay-warps``,
``--checkpoint-warps`` or ``--min-ctas`` are left out); a suite the file does not hold, or one timed
without graphs, gives an empty dict.
"""

from __future__ import annotations

import json
from pathlib import Path


def load(path) -> dict:
    """The JSON at ``path``; a ValueError naming the file when it is missing or not a gpu_bench.py result."""
    try:
        payload = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--measured: no such file {str(path)!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--measured: {str(path)!r} is not JSON ({e})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("suites"), dict):
        raise ValueError(f"--measured: expected a bench/gpu_bench.py result (a 'suites' object), got {str(path)!r}")
    return payload


def describe(payload: dict) -> str:
    """Where and when the result was measured: ``"<device>, <date>"``."""
    env = payload.get("environment", {})
    return f"{env.get('device', '?')}, {env.get('date_utc', '?')}"


def _graph_rows(payload: dict, suite: str, batch: int) -> list[dict]:
    rows = payload["suites"].get(suite, {}).get("rows", [])
    return [r for r in rows if r["batch"] == batch and "us_graph" in r]


def replay_times(payload: dict, batch: int = 256) -> dict:
    """``{(K, from_checkpoint): replay graph time / stepwise graph time}`` from suite ``replay``."""
    rows = _graph_rows(payload, "replay", batch)
    base = next((r["us_graph"] for r in rows if r["step"] == "stepwise"), None)
    return {} if base is None else {
        (r["K"], r["outputs"] == "from checkpoint"): r["us_graph"] / base for r in rows
        if r["K"] is not None and r.get("num_warps") is None and r.get("min_ctas") is None}


def verify_times(payload: dict, batch: int = 256, from_checkpoint: bool = False) -> dict:
    """``{K: replay verify graph time / today's verify graph time}`` from suite ``replay-verify``, for the
    drafts' output form ``from_checkpoint``."""
    rows = _graph_rows(payload, "replay-verify", batch)
    base = next((r["us_graph"] for r in rows if r["K"] is None), None)
    return {} if base is None else {r["K"]: r["us_graph"] / base for r in rows
                                    if r["K"] is not None and r["from_checkpoint"] == from_checkpoint}


def states_times(payload: dict, batch: int = 256) -> dict:
    """``{REPLAY_STATES_EXECUTED entry: replay graph time / its form's stepwise graph time}`` from suite
    ``replay-states`` (an entry: the form, with ``", from the checkpoint"`` for that output form)."""
    rows = _graph_rows(payload, "replay-states", batch)
    stepwise = {r["form"]: r["us_graph"] for r in rows if r["step"] == "stepwise"}
    suffix = {"replayed": "", "from checkpoint": ", from the checkpoint"}
    return {r["form"] + suffix[r["outputs"]]: r["us_graph"] / stepwise[r["form"]] for r in rows
            if r["step"] == "replay" and r["outputs"] in suffix and r["form"] in stepwise}
