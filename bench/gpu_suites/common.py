"""What every suite of ``bench/gpu_bench.py`` shares: the run's settings (device, heads, batches, graphs,
time per measurement), the device's description, and the parsing of comma-separated options."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Run:
    """The settings every suite reads.

    Attributes:
        device: ``"cuda"``, or ``"cpu"`` (the CPU path with perf_counter timing: a smoke test of the
            plumbing, not a benchmark).
        heads: H.
        batches: the batch sizes given with ``--batches``, or None: each suite's own default.
        graphs: time CUDA-graph replay beside eager calls (on CUDA only).
        target_ms: time per measurement repetition given with ``--target-ms``, or None: each suite's own.
        env: where and when the run ran (``_util.environment`` and the device's name, capability, L2).
    """

    device: str
    heads: int
    batches: tuple[int, ...] | None
    graphs: bool
    target_ms: float | None
    env: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def batches_or(self, default: str) -> tuple[int, ...]:
        return self.batches if self.batches is not None else int_list(default, "--batches")

    def target_s(self, cuda_ms: float, cpu_ms: float) -> float:
        """Seconds per measurement repetition: ``--target-ms`` when given, else the suite's default."""
        if self.target_ms is not None:
            return self.target_ms / 1e3
        return (cuda_ms if self.cuda else cpu_ms) / 1e3


def int_list(text: str, option: str, *, positive: bool = True, allow_empty: bool = False) -> tuple[int, ...]:
    """``"1,64,256"`` -> ``(1, 64, 256)``; a ValueError naming ``option`` for anything else (a value below
    1 with ``positive``; nothing at all unless ``allow_empty``)."""
    try:
        out = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated ints, got {text!r}") from None
    if not out and not allow_empty:
        raise ValueError(f"{option}: expected comma-separated ints, got {text!r}")
    if positive and any(v < 1 for v in out):
        raise ValueError(f"{option}: expected positive ints, got {text!r}")
    return out


def device_environment(device: str, base: dict) -> dict:
    """``base`` with the device's name, and on CUDA its capability, L2 size and CUDA version."""
    env = dict(base)
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device"] = torch.cuda.get_device_name(device)
        env["capability"] = "sm_%d%d" % torch.cuda.get_device_capability(device)
        env["l2_bytes"] = int(getattr(props, "L2_cache_size", 50 << 20))
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = "cpu (smoke test of the benchmark's plumbing, not a benchmark)"
        env["l2_bytes"] = 0
    return env
