"""The checks of ``StatePool``'s constructor arguments: sizes, dtypes (by group), the device (the last two
shared with :func:`mamba3_step.ring.new_ring`, which defines them).

Each returns the argument in its canonical form or raises naming it (``ValueError`` for a value,
``TypeError`` for a dtype), before anything is allocated.
"""

from __future__ import annotations

from ..contract import shown
from ..ring import checked_device, checked_dtype
from .slots import is_int

__all__ = ["checked_device", "checked_dtype", "checked_size"]


def checked_size(name: str, v, supported=None, top=None) -> int:
    """``v`` as a positive int (one of ``supported`` when given, at most ``top`` when given); ValueError naming
    ``name`` otherwise."""
    if not is_int(v) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {shown(v)}")
    if top is not None and v > top:
        raise ValueError(f"{name}: expected a positive int of at most {top}, got {shown(v)}")
    if supported is not None and v not in supported:
        raise ValueError(f"{name}: expected one of {supported} (the sizes the step supports), got {shown(v)}")
    return int(v)
