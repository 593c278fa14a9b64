"""What a slot argument is, and the allocator's errors (shared by ``pool`` and ``speculative``).

Letters (docs/contract.md): ``P`` pool rows (slots), ``T`` tokens (rows of a speculative group).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import torch

from ..contract import shown
from ..validation.checks import check_is_tensor

#: the tensor dtypes whose values are slot numbers or counts
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

__all__ = ["PoolExhaustedError", "SlotError", "check_int_tensor", "int_list", "is_int"]


class SlotError(ValueError):
    """A slot handed to the allocator is unknown, reserved, or not allocated (double free)."""


class PoolExhaustedError(RuntimeError):
    """``alloc(n)`` asked for more slots than are free."""


def is_int(v) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_int_tensor(name: str, t: torch.Tensor, what: str = "slot") -> None:
    """``t`` holds integers this process can read (``.tolist()``): a strided tensor whose storage
    holds it, of an integer dtype, not a meta tensor. TypeError/ValueError naming ``name``."""
    check_is_tensor(name, t)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: expected an integer tensor of {what}s, got dtype {t.dtype}")
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor holding {what}s, got a meta tensor")


def int_list(values, name: str, what: str = "slot") -> list[int]:
    """``values`` as a Python list of ints (accepts an int, a sequence of ints, or an integer tensor
    of at most one dimension; numpy integers and arrays count as ints). ``what`` names one value in
    the messages ("slot", "count")."""
    if isinstance(values, torch.Tensor):
        check_int_tensor(name, values, what)
        if values.dim() > 1:
            raise ValueError(f"{name}: expected a 0-d or 1-d tensor of {what}s, got shape {tuple(values.shape)}")
        return [int(v) for v in values.reshape(-1).tolist()]
    if isinstance(values, bool):
        raise TypeError(f"{name}: expected {what} ints, got bool")
    if is_int(values):
        return [int(values)]
    if isinstance(values, Iterable):
        out = []
        for v in values:
            if not is_int(v):
                if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.dtype.is_floating_point \
                        and v.dtype != torch.bool:
                    v = int(v)
                else:
                    raise TypeError(f"{name}: expected {what} ints, got element {shown(v)}")
            out.append(int(v))
        return out
    raise TypeError(f"{name}: expected an int, a sequence of ints or an integer tensor, got {type(values).__name__}")
