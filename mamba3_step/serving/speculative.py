"""Speculative groups: the ``T`` pool rows a request owns for the states of a verify step.

Letters (docs/contract.md): ``B`` requests (lanes) in a step, ``T`` tokens per verify step (rows
per group), ``P`` pool rows (slots).

vLLM's convention for speculative decoding over recurrent state: a request that verifies ``T``
tokens per step (its last sampled token and ``T - 1`` drafts) owns ``T`` rows, its *group*. The
verify step reads the row the request continues from and writes the state after token ``t`` (and,
with ``update_kv_state``, token ``t``'s B/x) to the group's row ``t``; once the drafts are checked,
``accepted`` of the ``T`` tokens stand (``1 <= accepted <= T``: the first token always does), so the
request continues from row ``t = accepted - 1``. Nothing is copied: the next step passes the same
``(B, T)`` rows as ``state_batch_indices`` and the accepted counts as ``num_accepted_tokens``, and
the kernel picks the row (:class:`SpecIndices`). :class:`SpecGroups` is the bookkeeping behind
``StatePool.alloc_spec`` / ``commit_accepted`` / ``spec_indices`` / ``current_rows`` / ``free_spec``;
it has no lock of its own (the pool's lock guards it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .slots import SlotError, check_int_tensor, int_list, is_int

__all__ = ["SpecGroups", "SpecIndices", "group_rows"]


class SpecIndices(NamedTuple):
    """A verify step's pool indices for a batch of requests (``StatePool.spec_indices``)."""

    state_batch_indices: torch.Tensor  # (B, T) int32: each request's group, its candidate source rows
    num_accepted_tokens: torch.Tensor  # (B,) int32: the last committed count, picks the source row
    dst_state_batch_indices: torch.Tensor  # (B, T) int32: the group again: token t's state -> row t


def group_rows(groups, name: str) -> list[tuple[int, ...]]:
    """``groups`` as tuples of rows: a ``(T,)`` (one request) or ``(n, T)`` integer tensor, or a
    sequence of ints (one request) or of int sequences (one per request)."""
    if isinstance(groups, torch.Tensor):
        check_int_tensor(name, groups, "group row")
        if groups.dim() not in (1, 2):
            raise ValueError(f"{name}: expected a (T,) or (n, T) tensor of group rows (what alloc_spec returned), "
                             f"got shape {tuple(groups.shape)}")
        return [tuple(r) for r in (groups.unsqueeze(0) if groups.dim() == 1 else groups).tolist()]
    if isinstance(groups, Sequence) and not isinstance(groups, str) and groups and all(is_int(v) for v in groups):
        return [tuple(int(v) for v in groups)]
    if isinstance(groups, Sequence) and not isinstance(groups, str):
        return [tuple(int_list(g, f"{name}[{i}]")) for i, g in enumerate(groups)]
    raise TypeError(f"{name}: expected a (T,) or (n, T) integer tensor of group rows, got {type(groups).__name__}")


class SpecGroups:
    """Which rows form a group, in which order, and each group's committed count (1..T)."""

    def __init__(self):
        self._rows: dict[int, tuple[int, ...]] = {}  # group id (its first row) -> its rows
        self._group_of: dict[int, int] = {}  # row -> group id
        self._accepted: dict[int, int] = {}  # group id -> accepted count of its last committed step

    def add(self, groups: list[tuple[int, ...]]) -> None:
        for rows in groups:
            self._rows[rows[0]] = rows
            self._accepted[rows[0]] = 1
            for r in rows:
                self._group_of[r] = rows[0]

    def group_of(self, row: int) -> tuple[int, ...] | None:
        """The rows of the group ``row`` belongs to, or None."""
        gid = self._group_of.get(row)
        return None if gid is None else self._rows[gid]

    def resolve(self, groups, name: str, allocated: Callable[[int], bool]) -> list[int]:
        """The group ids of ``groups``; SlotError naming ``name[i]`` unless each is a whole group (its
        rows in the order ``alloc_spec`` returned) and none is listed twice."""
        gids: list[int] = []
        for i, rows in enumerate(group_rows(groups, name)):
            gid = self._group_of.get(rows[0]) if rows else None
            if gid is None or self._rows[gid] != rows:
                raise SlotError(f"{name}[{i}]: expected the rows of one speculative group, in the order alloc_spec "
                                f"returned them, got {list(rows)}: {self._why_not(rows, allocated)}")
            if gid in gids:
                raise SlotError(f"{name}[{i}]: the group {list(rows)} is listed twice")
            gids.append(gid)
        return gids

    def _why_not(self, rows: tuple[int, ...], allocated: Callable[[int], bool]) -> str:
        if not rows:
            return "an empty group"
        for r in rows:
            if not allocated(r):
                return f"slot {r} is not allocated (double free?)"
            if self._group_of.get(r) is None:
                return f"slot {r} is a plain slot (from alloc), not a group row"
        owners = sorted({self._rows[self._group_of[r]] for r in rows})
        return f"they are rows of the group(s) {[list(g) for g in owners]}"

    def same_size(self, gids: list[int], name: str) -> int:
        """The common T of ``gids`` (a step has one T); ValueError naming ``name`` otherwise."""
        sizes = sorted({len(self._rows[g]) for g in gids})
        if len(sizes) > 1:
            raise ValueError(f"{name}: expected groups of one size T (a verify step has one T), got sizes {sizes}")
        return sizes[0] if sizes else 0

    def checked_counts(self, gids: list[int], counts, name: str) -> list[int]:
        """``counts`` (one per group, each in [1, T of its group]) as ints; named errors otherwise."""
        values = int_list(counts, name, what="count")
        if len(values) != len(gids):
            raise ValueError(f"{name}: expected {len(gids)} counts (one per group), got {len(values)}")
        for i, (gid, n) in enumerate(zip(gids, values)):
            T = len(self._rows[gid])
            if not 1 <= n <= T:
                raise ValueError(f"{name}[{i}]: expected an accepted count in [1, T={T}] (the first token of a "
                                 f"verify step always stands), got {n}")
        return values

    def rows(self, gid: int) -> tuple[int, ...]:
        return self._rows[gid]

    def accepted(self, gid: int) -> int:
        return self._accepted[gid]

    def commit(self, gids: list[int], counts: list[int]) -> None:
        for gid, n in zip(gids, counts):
            self._accepted[gid] = n

    def remove(self, gids: list[int]) -> None:
        for gid in gids:
            for r in self._rows.pop(gid):
                del self._group_of[r]
            del self._accepted[gid]
