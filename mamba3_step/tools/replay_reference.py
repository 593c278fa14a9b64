"""The float64 (or any ``cd``) references of replay's outputs from the checkpoint, lane by lane, for
the checks that hold the executed kernel to the accuracy contract (docs/contract.md, "Replay"):
an append's from the stored checkpoint and the ring, a verify step's drafts from the checkpoint (a
flush's, or the row's) and the ring tokens since. Both evaluate
:func:`mamba3_step.replay.output_from_checkpoint`, the CPU path's algebra, in the precision asked.

Letters (docs/contract.md): B lanes, T draft tokens, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import torch

from ..replay import output_from_checkpoint, rotated_output_from_checkpoint
from ..tensors import StepTensors

__all__ = ["append_reference", "draft_references"]


def append_reference(t: StepTensors, base: tuple, ring: dict, row: int, b: int, cd, angle=None,
                     pairwise: bool = False) -> torch.Tensor:
    """Lane ``b``'s ``out`` of an append from the checkpoint, in ``cd``: from row ``row``'s checkpoint
    ``base`` (state, Bstate, Xstate and, for an 8-bit state, state_scale as they were) and ``ring``
    (the ring's ``B``, ``x``, ``coef``, ``length`` and, with rotary, ``angle`` as they were), then
    ``t``'s token, whose angle is ``angle`` (H, S) with rotary (the one the step stored with its
    entry) (``mamba3_step.replay.rotated_output_from_checkpoint``)."""
    c, H = int(ring["length"][row, 0]), t.state.shape[1]
    now = {f: getattr(t, f)[b][None] for f in ("A", "dt", "trap", "x")}
    now["B"] = t.B[b][None].expand(-1, -1, H, -1)
    past = _ring_tokens(ring, row, c)
    if angle is not None:
        now["angle"], past["angle"] = angle[None], ring["angle"][row, :c]
    tokens = {f: torch.cat([past[f].to(v.dtype), v])[None] for f, v in now.items()}
    rows = tuple(v[row:row + 1] for v in base) + (None,) * (4 - len(base))
    z = None if t.z is None else t.z[b:b + 1]
    return rotated_output_from_checkpoint(t._replace(x=t.x[b:b + 1]), rows, tokens, t.C[b:b + 1], z, cd,
                                          pairwise)[0]


def draft_references(t: StepTensors, base: tuple, ring: dict, count: int, row: int, b: int, cd) -> torch.Tensor:
    """Lane ``b``'s drafts' ``out`` (T, ...) of a verify step with outputs from the checkpoint, in
    ``cd``: each from row ``row``'s checkpoint ``base`` (state, Bstate, Xstate and, for an 8-bit
    state, state_scale: the row's, or after a flush the new one, which is stepwise decoding's state
    after the committed tokens), the first ``count`` tokens of ``ring`` (its ``B``, ``x``, ``coef``
    as they were; 0 after a flush) and the drafts before it (``t``: the step's call, x (B, T, H, D);
    no rotary)."""
    H = t.state.shape[1]
    rows = tuple(v[row:row + 1] for v in base) + (None,) * (4 - len(base))
    past = {f: v[None] for f, v in _ring_tokens(ring, row, count).items()}
    drafts = {f: getattr(t, f)[b:b + 1] for f in ("A", "dt", "trap", "x")}
    drafts["B"] = t.B[b:b + 1].expand(-1, -1, -1, H, -1)
    outs = []
    for i in range(t.x.shape[1]):
        z = None if t.z is None else t.z[b:b + 1, i]
        tokens = {f: torch.cat([past[f].to(v.dtype), v[:, :i + 1]], 1) for f, v in drafts.items()}
        outs.append(output_from_checkpoint(t._replace(x=t.x[b:b + 1, i]), rows, tokens, t.C[b:b + 1, i], z, cd)[0])
    return torch.stack(outs)


def _ring_tokens(ring: dict, row: int, count: int) -> dict:
    """Row ``row``'s first ``count`` ring tokens (``ring``: its ``B``, ``x``, ``coef``) as token inputs
    (``A``, ``dt``, ``trap``, ``x``, ``B``, each with the token axis first)."""
    coef = ring["coef"][row, :count]
    return {"A": coef[..., 0], "dt": coef[..., 1], "trap": coef[..., 2], "x": ring["x"][row, :count],
            "B": ring["B"][row, :count]}
