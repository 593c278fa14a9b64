"""The contract's constants and its small shared rules, in one place (docs/contract.md).

Letters (docs/contract.md, "Letters"): B lanes this step, P pool rows, H heads, D head dim,
N state size (dstate), R MIMO rank.

This is the bottom of the package: it imports nothing from it. Everything several layers need
to agree on lives here and only here:

* the supported sizes (:data:`SUPPORTED_N`, :data:`SUPPORTED_D`, :data:`SUPPORTED_R`);
* the one dtype table (:data:`DTYPES`: name -> torch dtype, bytes, CuteDSL type name) and the
  dtype group of every tensor (:data:`STATE_DTYPES` ...); adding a dtype is one row in
  :data:`DTYPES` plus its name in the groups that accept it;
* the padding rule (:func:`lane_is_live`) and the padding id (:data:`PAD_SLOT_ID`);
* the shape of ``out`` (:func:`out_shape`);
* the launch-grid limits and the state's vector width, which the input checks enforce.

The device-side form of the padding rule is ``Mamba3StepKernel.row_is_live`` (CuteDSL code
cannot call torch); it states the same three conditions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "ANGLE_DTYPES", "DTYPES", "DType", "DTYPE_BYTES", "KV_DTYPES", "MAX_GRID_X", "MAX_GRID_Y", "PAD_SLOT_ID",
    "PROJ_DTYPES", "ROUNDED_STATE_DTYPES", "SCALED_STATE_DTYPES", "STATE_DTYPES", "SUPPORTED_D", "SUPPORTED_N", "SUPPORTED_R", "VECTOR_BYTES",
    "X_DTYPES", "as_torch_dtype", "dtype_name", "lane_is_live", "source_rows", "out_shape", "shown",
]

#: the pool index a server pads a batch with (any negative index, any index >= P and
#: ``null_slot_id`` are padding too)
PAD_SLOT_ID = -1

SUPPORTED_N = (32, 64, 128, 256)
SUPPORTED_D = (32, 64, 128)
SUPPORTED_R = (1, 2, 4, 8)


class DType(NamedTuple):
    """One supported element type: its torch dtype, its size and its CuteDSL type's name."""

    torch: torch.dtype
    bytes: int
    cutlass: str  # attribute of the ``cutlass`` module (looked up by the kernel only)


#: the one dtype table; keys are torch names without the ``torch.`` prefix
DTYPES = {
    "float32": DType(torch.float32, 4, "Float32"),
    "bfloat16": DType(torch.bfloat16, 2, "BFloat16"),
    "float16": DType(torch.float16, 2, "Float16"),
    "int8": DType(torch.int8, 1, "Int8"),
    "float8_e4m3fn": DType(torch.float8_e4m3fn, 1, "Float8E4M3FN"),
}
#: dtype names accepted for each tensor group
STATE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")  # state, state_out
#: states stored in 8 bits with a per-(row, head, d) fp32 scale (``state_scale``), always with stochastic
#: rounding (docs/contract.md, "8-bit states")
SCALED_STATE_DTYPES = ("int8", "float8_e4m3fn")
#: states a store rounds stochastically with ``stochastic_rounding=True`` (16-bit ones optionally, 8-bit always)
ROUNDED_STATE_DTYPES = ("bfloat16", "float16") + SCALED_STATE_DTYPES
KV_DTYPES = ("bfloat16", "float16", "float32")  # B, C, Bstate
X_DTYPES = ("bfloat16", "float16", "float32")  # x, z, Xstate, out
PROJ_DTYPES = ("float32", "bfloat16", "float16")  # xproj, zproj, outproj
#: the rotary angle pool: a fixed-point fraction of a turn, 2**-64 turn per unit (mamba3_step.rotary)
ANGLE_DTYPES = ("int64",)  # angle_state
#: bytes per element by name (a view of :data:`DTYPES`)
DTYPE_BYTES = {name: d.bytes for name, d in DTYPES.items()}

#: the kernel's grid is (B, H, D / tile_D): CUDA limits grid.x to 2**31 - 1 and grid.y to 65535
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
#: ``state`` / ``state_out`` are read and written with vectors of this many bytes
VECTOR_BYTES = 16
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the keys of :data:`DTYPES`)."""
    return str(dtype).removeprefix("torch.")


def as_torch_dtype(dtype, name: str) -> torch.dtype:
    """A supported dtype given by name (``"bfloat16"``, ``"torch.bfloat16"``) or as a torch dtype.

    Raises TypeError naming the argument ``name`` for anything else.
    """
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key not in DTYPES:
            raise TypeError(f"{name}: expected one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[key].torch
    if not any(dtype == d.torch for d in DTYPES.values()):
        raise TypeError(f"{name}: expected one of {', '.join('torch.' + n for n in DTYPES)}, got {dtype!r}")
    return dtype


def shown(v) -> str:
    """``v`` for an error message: its repr, but never a tensor's values (a freed or meta tensor has
    none to read): its shape and dtype instead."""
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {'(nested)' if v.is_nested else tuple(v.shape)} and dtype {v.dtype}"
    return repr(v)


def lane_is_live(index, num_rows: int, null_slot_id: int | None = None):
    """The padding rule: is ``index`` a real pool row? ``0 <= index < num_rows`` and not the null slot.

    Works element-wise on an integer tensor (returns a bool tensor) and on a Python int (returns
    a bool). Everything else, negative, ``>= num_rows`` or ``null_slot_id``, is padding.
    """
    live = (index >= 0) & (index < num_rows)
    if null_slot_id is not None:
        live = live & (index != null_slot_id)
    return live


def source_rows(state_batch_indices, num_accepted_tokens=None):
    """Each lane's source row: ``state_batch_indices`` (B,), or with ``num_accepted_tokens`` (B,)
    the entry ``state_batch_indices[b, num_accepted_tokens[b] - 1]`` of a (B, K) tensor (the
    state after the accepted prefix of a speculative step). A count outside [1, K] gives -1:
    that lane is padding (whatever the count holds, nothing outside the index tensor is read).
    Returns an int64 tensor."""
    src = state_batch_indices.to(torch.int64)
    if num_accepted_tokens is None:
        return src
    k = num_accepted_tokens.to(device=src.device, dtype=torch.int64) - 1
    inside = (k >= 0) & (k < src.shape[1])
    picked = src.gather(1, k.clamp(0, max(src.shape[1] - 1, 0)).unsqueeze(1)).squeeze(1)
    return torch.where(inside, picked, torch.full_like(picked, -1))


def out_shape(x: torch.Tensor, xproj: torch.Tensor, has_outproj: bool) -> tuple[int, ...]:
    """Shape of ``out``: (B, H, D) with outproj, else (B, R, H, D); x (B, H, D), xproj (R, H, D).
    With a token axis, x (B, T, H, D): (B, T, H, D) or (B, T, R, H, D)."""
    shape = tuple(x.shape)
    return shape if has_outproj else shape[:-2] + (xproj.shape[0],) + shape[-2:]


def new_out(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out`` for a call that gives none: a plain tensor of ``shape`` (:func:`out_shape`),
    contiguous, x's dtype and device. Where ``shape`` is x's own (every call with outproj) and x
    is a plain tensor it is ``torch.empty_like(x)`` in contiguous format, which costs the host
    less than ``torch.empty`` (``bench/bench_host.py``, ``out=None`` columns); the tensor is the same either way (a subclass x would pass its type on through
    ``empty_like``, hence the type test)."""
    if type(x) is torch.Tensor and x.shape == shape:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.empty(shape, dtype=x.dtype, device=x.device)
