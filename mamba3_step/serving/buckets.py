"""Batch-size buckets of the CUDA-graph runner: choosing one, checking a list, padding into one.

Letters (docs/contract.md): ``n`` live lanes, ``P`` pool rows (slots).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..contract import shown

__all__ = ["DEFAULT_BUCKETS", "check_buckets", "choose_bucket", "pad_lanes", "pad_slots"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def choose_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket ``>= n``, or None when ``n`` exceeds the largest (run eagerly)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected a non-negative int, got {shown(n)}")
    for b in sorted(buckets):
        if b >= n:
            return b
    return None


def check_buckets(buckets) -> tuple[int, ...]:
    """``buckets`` as a sorted tuple of distinct positive ints; ValueError naming ``buckets`` otherwise."""
    bs = tuple(buckets)
    if not bs:
        raise ValueError("buckets: expected at least one batch size, got none")
    for b in bs:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"buckets: expected positive ints, got {shown(b)}")
    if len(set(bs)) != len(bs):
        raise ValueError(f"buckets: expected distinct batch sizes, got {bs}")
    return tuple(sorted(bs))


def pad_slots(slots: torch.Tensor, bucket: int, pad_id: int) -> torch.Tensor:
    """``(bucket,)`` int32: ``slots`` followed by ``pad_id`` (a new tensor on ``slots``' device)."""
    n = slots.shape[0]
    if n > bucket:
        raise ValueError(f"slots: expected at most bucket={bucket} slots, got {n}")
    padded = torch.full((bucket,), pad_id, dtype=torch.int32, device=slots.device)
    padded[:n] = slots
    return padded


def pad_lanes(t: torch.Tensor, bucket: int) -> torch.Tensor:
    """``t`` (``(n, ...)``) padded with zero lanes to ``(bucket, ...)`` (a new tensor)."""
    n = t.shape[0]
    if n > bucket:
        raise ValueError(f"expected at most bucket={bucket} lanes, got {n}")
    padded = torch.zeros((bucket,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:n] = t
    return padded
