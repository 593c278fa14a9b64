"""Timing shared by every suite of ``bench/gpu_bench.py``: CUDA events on a GPU (perf_counter on the
CPU), rounds sized to a target time, CUDA-graph capture, speed-ups over a suite's first row, and the
device-to-device copy bandwidth."""

from __future__ import annotations

import math
import statistics
import time

import torch


class GraphUnavailable(RuntimeError):
    """CUDA-graph capture or replay raised: graph timings are skipped, eager ones go on."""


class Timer:
    """Seconds for ``n`` calls of ``fn``: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn, n: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t0


def capture(fn, warmup_restore=None):
    """A CUDA graph of ``fn()`` (warmed up on a side stream first, as capture requires); with
    ``warmup_restore``, called between the warm-up and the capture (to undo the warm-up's writes)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    if warmup_restore is not None:
        warmup_restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def n_sets(bytes_per_set: int, l2_bytes: int, max_sets: int, min_sets: int = 2) -> int:
    """How many distinct input sets one timing round cycles through: enough that a round
    touches at least 4x the L2 cache, at least ``min_sets`` and at most ``max_sets``."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be positive, got {bytes_per_set}")
    want = math.ceil(4 * l2_bytes / bytes_per_set)
    return max(1, min(max_sets, max(min_sets, want)))


def time_round(timer: Timer, round_fn, calls_per_round: int, target_s: float, reps: int = 3) -> float:
    """Median seconds per call of ``round_fn`` (one call = ``calls_per_round`` steps), with as
    many rounds per repetition as fit ``target_s`` (at least 2)."""
    round_fn()  # warm-up
    est = max(timer(round_fn, 1), 1e-7)
    n = max(2, min(10_000, int(target_s / est)))
    samples = [timer(round_fn, n) / (n * calls_per_round) for _ in range(reps)]
    return statistics.median(samples)


def eager_and_graph_us(timer: Timer, fn, graphs: bool, target_s: float) -> dict:
    """``{"us_eager": ...}`` microseconds per call of ``fn``, plus ``"us_graph"`` from a CUDA graph of
    it when ``graphs`` and the timer is on CUDA."""
    row = {"us_eager": time_round(timer, fn, 1, target_s) * 1e6}
    if graphs and timer.cuda:
        row["us_graph"] = time_round(timer, capture(fn).replay, 1, target_s) * 1e6
    return row


def add_speedups(rows: list[dict]) -> list[dict]:
    """Each row's ``speedup_eager``/``speedup_graph``: the first row's time over its own."""
    for row in rows:
        for kind in ("eager", "graph"):
            if f"us_{kind}" in row:
                row[f"speedup_{kind}"] = rows[0][f"us_{kind}"] / row[f"us_{kind}"]
    return rows


def copy_bandwidth(device, nbytes: int = 1 << 30, timer: Timer | None = None) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written per second)."""
    timer = timer or Timer(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(7)
    dst = torch.empty_like(src)
    t = time_round(timer, lambda: dst.copy_(src), 1, target_s=0.2 if timer.cuda else 0.05)
    return 2 * nbytes / t
