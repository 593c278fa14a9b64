"""Batch-size buckets of the CUDA-graph runner: choosing one, checking a list, padding into one, the shape
and dtype of a per-lane static buffer.

Letters (docs/contract.md): ``n`` live lanes, ``P`` pool rows (slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..contract import shown
from ..validation.table import RULE_BY_NAME

if TYPE_CHECKING:
    from .pool import StatePool

__all__ = ["DEFAULT_BUCKETS", "check_buckets", "checked_capture_buckets", "choose_bucket", "lane_buffer", "pad_lanes",
           "pad_slots"]

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


def checked_capture_buckets(buckets, allowed: tuple[int, ...]) -> list[int]:
    """``buckets`` (None: every one of ``allowed``) as a list, each one of ``allowed``; TypeError/ValueError
    naming ``buckets``, before any is captured."""
    if buckets is None:
        return list(allowed)
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise TypeError(f"buckets: expected a sequence of this runner's buckets {allowed} or None, "
                        f"got {shown(buckets)}")
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, int) or b not in allowed:
            raise ValueError(f"buckets: {shown(b)} is not one of this runner's buckets {allowed}")
    return [int(b) for b in buckets]


#: the pool attribute holding the dtype of a rule's dtype group (the rule named, or its ``same_as``)
_POOL_DTYPES = {"x": "x_dtype", "B": "kv_dtype"}


def lane_buffer(pool: StatePool, name: str, shared_bc: bool = False) -> tuple[tuple[int, ...], torch.dtype]:
    """A per-lane input's shape after the lane (and token) axes, and its dtype, for ``pool``'s
    layers: read from the argument's row in ``validation.table`` (its letters; float32, or the
    pool's dtype of its group). ``shared_bc``: B and C with a head axis of 1."""
    rule = RULE_BY_NAME[name]
    sizes = {"H": pool.nheads, "D": pool.headdim, "N": pool.dstate, "R": pool.mimo,
             "Hbc": 1 if shared_bc else pool.nheads, "A": pool.rope_angles}
    shape = tuple(sizes[c] for c in rule.letters.split()[1:] if not c.startswith("["))
    if rule.dtypes == ("float32",):
        return shape, torch.float32
    return shape, getattr(pool, _POOL_DTYPES[rule.same_as or name])
