"""One check per property of one argument; each raises a message that names the argument and says
what was expected and what was got (docs/contract.md, "Errors").

Dtype problems raise TypeError, everything else ValueError. These read metadata only: shapes,
strides, dtypes, flags and data pointers; each is a pure function of its arguments (the one global
that matters, whether inference mode is on, is passed in). A tensor without memory of its own
(``meta``, or a FakeTensor while tracing) has no address: the checks that compare addresses skip it.
"""

from __future__ import annotations

import numbers

import torch
from torch._subclasses.fake_tensor import is_fake

from ..contract import INT32_MAX, VECTOR_BYTES, dtype_name, shown

__all__ = [
    "byte_span", "check_bool_option", "check_disjoint", "check_dtype", "check_int_option", "check_is_tensor",
    "check_no_internal_overlap", "check_rank", "check_shape", "check_inner_offsets_int32",
    "check_unit_inner_stride", "check_vector_aligned", "check_write_target", "data_address",
]


def check_is_tensor(name: str, t, optional: bool = False) -> None:
    """A strided tensor whose storage holds it (or None when ``optional``): checked before anything
    else reads a shape or a stride, which a nested tensor cannot answer."""
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        what = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name}: expected {what}, got {type(t).__name__}")
    if t.is_nested or t.layout is not torch.strided:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise TypeError(f"{name}: expected a strided (dense) tensor, got a {kind} tensor")
    check_storage(name, t)


def check_storage(name: str, t: torch.Tensor) -> None:
    """The storage holds every element ``t`` addresses: a storage freed or resized under the tensor
    (``untyped_storage().resize_(0)``) does not, and reading it would read memory it no longer owns.
    Meta and fake tensors have no bytes to check."""
    if t.device.type == "meta" or is_fake(t) or t.numel() == 0:
        return
    last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    need = (last + 1) * t.element_size()
    have = t.untyped_storage().nbytes()
    if have < need:
        raise ValueError(f"{name}: expected a tensor whose storage holds its elements ({need} bytes), got a "
                         f"storage of {have} bytes (freed or resized under the tensor?)")


def check_rank(name: str, t: torch.Tensor, letters: str, why: str = "") -> None:
    """``t`` has one dimension per letter; ``why`` (e.g. " (x is 4-D: ...)") follows the expectation."""
    rank = len(letters.split())
    if t.dim() != rank:
        raise ValueError(
            f"{name}: expected a {rank}-D tensor of shape ({', '.join(letters.split())}){why}, "
            f"got {t.dim()}-D with shape {tuple(t.shape)}"
        )


def check_shape(name: str, t: torch.Tensor, letters: str, dims: tuple[int, ...]) -> None:
    check_rank(name, t, letters)
    if tuple(t.shape) != tuple(dims):
        shape = f"({', '.join(letters.split())}) = {tuple(dims)}"
        raise ValueError(
            f"{name}: expected shape {shape}, got {tuple(t.shape)} "
            f"(B, T, H, D are taken from x, R and N from B, P from state, K from state_batch_indices)"
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
    ptr = data_address(t)
    if ptr is not None and ptr % VECTOR_BYTES:
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


def check_bool_option(name: str, value) -> bool:
    """A flag must be a real ``bool`` (not 1, "no" or a numpy bool)."""
    if not isinstance(value, bool):
        kind = type(value).__qualname__
        module = type(value).__module__
        kind = kind if module == "builtins" else f"{module}.{kind}"
        raise TypeError(f"{name}: expected a bool, got {kind} {shown(value)} (pass True or False)")
    return value


def data_address(t: torch.Tensor) -> int | None:
    """``t``'s data pointer, or None when it has no memory (a meta tensor, a FakeTensor)."""
    if t.is_meta or (type(t) is not torch.Tensor and is_fake(t)):
        return None
    return t.data_ptr()


def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first, end)``: the bytes ``t``'s elements lie in (None: empty or without memory)."""
    if t.numel() == 0:
        return None
    start = data_address(t)
    if start is None:
        return None
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))  # strides are >= 0
    return start, start + (extent + 1) * t.element_size()


def check_write_target(name: str, t: torch.Tensor, inference_mode: bool) -> None:
    """The step writes ``t`` in place: refuse what PyTorch would refuse halfway through."""
    if t.requires_grad:
        raise ValueError(
            f"{name}: expected a tensor that does not require grad (the step writes it in place and "
            f"has no autograd formula; decode is inference-only), got requires_grad=True"
        )
    if t.is_inference() and not inference_mode:
        raise ValueError(
            f"{name}: expected a tensor that can be written here, got an inference tensor (made under "
            f"torch.inference_mode()) outside inference mode; call the step inside "
            f"torch.inference_mode() or pass a tensor made outside it"
        )


def check_no_internal_overlap(name: str, t: torch.Tensor) -> None:
    """No two elements of a written ``t`` may share memory (e.g. stride 0 from ``expand``).

    Proven from the strides alone: taken from the smallest up, each stride must exceed the span
    of the dimensions below it. A layout that only an element-by-element walk could clear is
    refused too.
    """
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            why = " (stride 0: a broadcast view, e.g. from expand)" if stride == 0 else ""
            raise ValueError(
                f"{name}: expected a tensor whose elements do not overlap in memory (the step writes "
                f"it), got shape {tuple(t.shape)} with strides {tuple(t.stride())}{why}; pass a "
                f"tensor with its own memory per element (e.g. .clone())"
            )
        span += (size - 1) * stride


def check_disjoint(name: str, span: tuple[int, int] | None, other_name: str, other_span: tuple[int, int] | None,
                   other_written: bool) -> None:
    """A written tensor may not share a byte with another argument (read or written).

    ``span``/``other_span`` are the tensors' :func:`byte_span`. Conservative: byte ranges are
    compared, so two views that interleave without sharing an element are refused too.
    """
    a, b = span, other_span
    if a is None or b is None or a[1] <= b[0] or b[1] <= a[0]:
        return
    verb = "writes" if other_written else "reads"
    raise ValueError(
        f"{name}: expected memory disjoint from {other_name} (the step writes {name} and {verb} "
        f"{other_name}), got overlapping bytes [{a[0]:#x}, {a[1]:#x}) and [{b[0]:#x}, {b[1]:#x}); "
        f"pass separate tensors (e.g. {other_name}.clone())"
    )
