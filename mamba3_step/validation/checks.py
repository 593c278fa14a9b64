"""One check per property of one argument; each raises a message that names the argument and says
what was expected and what was got (docs/contract.md, "Errors").

Dtype problems raise TypeError, everything else ValueError. These read metadata only.
"""

from __future__ import annotations

import numbers

import torch

from ..contract import INT32_MAX, VECTOR_BYTES, dtype_name

__all__ = [
    "check_dtype", "check_int_option", "check_is_tensor", "check_rank", "check_shape",
    "check_inner_offsets_int32", "check_unit_inner_stride", "check_vector_aligned",
]


def check_is_tensor(name: str, t, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        what = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name}: expected {what}, got {type(t).__name__}")


def check_rank(name: str, t: torch.Tensor, letters: str) -> None:
    rank = len(letters.split())
    if t.dim() != rank:
        raise ValueError(
            f"{name}: expected a {rank}-D tensor of shape ({', '.join(letters.split())}), "
            f"got {t.dim()}-D with shape {tuple(t.shape)}"
        )


def check_shape(name: str, t: torch.Tensor, letters: str, dims: tuple[int, ...]) -> None:
    check_rank(name, t, letters)
    if tuple(t.shape) != tuple(dims):
        shape = f"({', '.join(letters.split())}) = {tuple(dims)}"
        raise ValueError(
            f"{name}: expected shape {shape}, got {tuple(t.shape)} "
            f"(B, H, D are taken from x, R and N from B, P from state)"
        )


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[str, ...], hint: str = "") -> str:
    """``t``'s dtype name, which must be in ``allowed`` (a group, or exactly one name)."""
    got = dtype_name(t.dtype)
    if got not in allowed:
        if len(allowed) == 1:
            raise TypeError(f"{name}: expected dtype {allowed[0]}{hint}, got {got}")
        raise TypeError(f"{name}: expected dtype one of {', '.join(allowed)} (supported), got {got}")
    return got


def check_dtype_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{name}: expected dtype {dtype_name(ref.dtype)} (the same as {ref_name}), "
            f"got {dtype_name(t.dtype)}"
        )


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(
            f"{name}: expected a tensor on {device} (the device of x; all tensors must be "
            f"on one device), got {t.device}"
        )


def check_unit_inner_stride(name: str, t: torch.Tensor) -> None:
    # A dimension of size 0 or 1 is never stepped along, so its stride does not matter.
    if t.numel() == 0 or t.dim() == 0 or t.shape[-1] <= 1:
        return
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected innermost stride 1 (contiguous last dimension), got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}"
        )


def check_vector_aligned(name: str, t: torch.Tensor) -> None:
    """The kernel moves ``t`` with 16-byte vectors: base and outer strides must allow it."""
    if t.numel() == 0:
        return
    ptr = t.data_ptr()
    if ptr % VECTOR_BYTES:
        raise ValueError(
            f"{name}: expected a data pointer aligned to {VECTOR_BYTES} bytes (the kernel "
            f"moves the state with {VECTOR_BYTES}-byte vectors), got address {ptr:#x} "
            f"(offset {ptr % VECTOR_BYTES} bytes); pass a tensor that starts on a 16-byte boundary"
        )
    esize = t.element_size()
    for dim in range(t.dim() - 1):
        stride_bytes = t.stride(dim) * esize
        if stride_bytes % VECTOR_BYTES:
            raise ValueError(
                f"{name}: expected every stride except the innermost to be a multiple of "
                f"{VECTOR_BYTES} bytes (16-byte vector accesses), got stride {t.stride(dim)} "
                f"elements = {stride_bytes} bytes in dimension {dim} (strides "
                f"{tuple(t.stride())}, {dtype_name(t.dtype)})"
            )


def check_inner_offsets_int32(name: str, t: torch.Tensor) -> None:
    """The kernel addresses below a tensor's first dimension with 32-bit offsets (only the first
    dimension's stride is 64-bit: a pool may exceed 2**31 elements, one row never does)."""
    if t.dim() < 2 or t.numel() == 0:
        return
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape[1:], t.stride()[1:]))
    if span > INT32_MAX:
        raise ValueError(
            f"{name}: expected the elements below the first dimension to lie within 2**31 - 1 "
            f"elements of each other (the kernel indexes them with 32-bit offsets), got a span of "
            f"{span} elements (shape {tuple(t.shape)}, strides {tuple(t.stride())})"
        )


def check_int_option(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    return int(value)
