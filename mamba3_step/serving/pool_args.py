"""The checks of ``StatePool``'s constructor arguments: sizes, dtypes (by group), the device.

Each returns the argument in its canonical form or raises naming it (``ValueError`` for a value,
``TypeError`` for a dtype), before anything is allocated.
"""

from __future__ import annotations

import torch

from ..contract import as_torch_dtype, dtype_name, shown
from .slots import is_int

__all__ = ["checked_device", "checked_dtype", "checked_size"]


def checked_size(name: str, v, supported=None) -> int:
    """``v`` as a positive int (one of ``supported`` when given); ValueError naming ``name`` otherwise."""
    if not is_int(v) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {shown(v)}")
    if supported is not None and v not in supported:
        raise ValueError(f"{name}: expected one of {supported} (the sizes the step supports), got {shown(v)}")
    return int(v)


def checked_dtype(dtype, name: str, group: tuple[str, ...]) -> torch.dtype:
    """``dtype`` (a name or a torch dtype) as a torch dtype of ``group``; TypeError naming ``name`` otherwise."""
    t = as_torch_dtype(dtype, name)
    if dtype_name(t) not in group:
        raise TypeError(f"{name}: expected one of {', '.join('torch.' + g for g in group)}, got {t}")
    return t


def checked_device(device) -> torch.device:
    """``device`` as a torch.device that exists here, a CUDA device with its index; ValueError naming it otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {shown(device)} ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: expected a device this process can use, got {shown(device)}, but CUDA "
                             f"is not available (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: expected a CUDA device index below {torch.cuda.device_count()} "
                             f"(the visible GPUs), got {shown(device)}")
        if dev.index is None:
            # Tensors made on "cuda" live on the current device, and their .device names its index:
            # keep the pool's device in that form so that comparisons with them hold.
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev
