"""A replay plan's per-run check of its ring: :class:`RingGuard` (:class:`mamba3_step.plan.StepPlan`).

A server passes the same ring every step. Per run the plan checks, besides the step's own guard,
only what can change: each ring field given or None as planned, each given one with its planned
signature (type, shape, strides, dtype, device, ``requires_grad``; inference-ness outside inference
mode), and no byte of a written ring tensor shared with another written ring tensor or with any
step tensor (each span placed from its data pointer and the planned extent, which the admitted
signatures fix). Anything else sends the call to the full validation. Letters: none.
"""

from __future__ import annotations

import torch

from .tensors import Ring, StepTensors
from .validation import checks
from .validation.cache import make_guard, tensor_signature

__all__ = ["RingGuard"]

_WRITTEN = ("B", "x", "coef", "length")  # the ring tensors every replay step writes: Ring's first fields
assert Ring._fields[:len(_WRITTEN)] == _WRITTEN
_RING = StepTensors._fields.index("replay_ring")


class RingGuard:
    """The planned ring of a validated replay call ``tensors`` (its ``replay_ring``), for :meth:`admits`."""

    __slots__ = ("_present", "_sigs", "_guard", "_inference", "_step_extents", "_ring_extents")

    def __init__(self, tensors: StepTensors):
        ring = tensors.replay_ring
        self._present = tuple(v is not None for v in ring)
        self._sigs = tuple(None if v is None else tensor_signature(v) for v in ring)
        self._guard = make_guard(tuple(v for v in ring if v is not None))
        self._inference = torch.is_inference_mode_enabled()
        # byte extents, fixed by the signatures: a run places each span from its data pointer
        self._step_extents = _extents(tensors)
        self._ring_extents = _extents(ring[:len(_WRITTEN)])

    def admits(self, call) -> bool:
        """Whether the ring of ``call`` (laid out like :class:`StepTensors`, its step admitted by the
        plan's own guard) is the planned one and shares no written byte with any argument."""
        ring = call[_RING]
        if type(ring) is not Ring or tuple(v is not None for v in ring) != self._present:
            return False
        given = tuple(v for v in ring if v is not None)
        if not all(isinstance(t, torch.Tensor) and not t.is_nested for t in given):
            return False  # torch's guard aborts the process on a nested tensor: the full check names it
        if not self._guard(*given):
            return False
        if not self._inference and any(t.is_inference() for t in given):
            return False
        return self._disjoint(call, ring)

    def _disjoint(self, call, ring) -> bool:
        """No byte of a written ring tensor is a byte of another written ring tensor or a step tensor."""
        spans = [(v.data_ptr(), e) for v, e in zip(ring, self._ring_extents) if e]
        if any(lo == 0 for lo, _ in spans):
            return False  # a storage freed under the ring: the full check names it
        others = [(v.data_ptr(), e) for v, e in zip(call, self._step_extents) if e]
        for k, (lo, e) in enumerate(spans):
            hi = lo + e
            for olo, oe in others:
                if olo < hi and lo < olo + oe:
                    return False
            for olo, oe in spans[k + 1:]:
                if olo < hi and lo < olo + oe:
                    return False
        return True

    def differences(self, ring) -> list[str]:
        """What differs between ``ring`` and the planned ring, one phrase per field (messages)."""
        changed = []
        for field, want, value in zip(Ring._fields, self._sigs, ring):
            got = None if value is None else tensor_signature(value)
            if got != want:
                changed.append(f"replay_ring.{field}: planned {_shown(want)}, got {_shown(got)}")
        return changed


def _extents(values) -> tuple:
    """Each value's byte extent (0: not a tensor, or empty)."""
    out = []
    for v in values:
        span = checks.byte_span(v) if isinstance(v, torch.Tensor) else None
        out.append(0 if span is None else span[1] - span[0])
    return tuple(out)


def _shown(signature) -> str:
    if signature is None:
        return "None"
    kind, shape, strides, dtype, device = signature[:5]
    return f"{kind.__qualname__} {tuple(shape)} strides {strides} {dtype} on {device}"
