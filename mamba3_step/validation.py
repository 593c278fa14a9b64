"""Input validation for ``mamba3_step_fn``: every bad input gets a ValueError/TypeError that names
the argument and says what was expected and what was got (SPEC.md, "Inputs that must get a
clear error").

Letters (as in SPEC.md): B batch lanes, P pool rows, H heads, D head dim, N state size
(dstate), R MIMO rank.

* :func:`check_step_inputs` reads only metadata (shapes, dtypes, devices, strides, pointers):
  it never synchronises, so it is safe under CUDA-graph capture. It returns the complete
  :class:`~mamba3_step.spec.StepSpec` the call compiles to, tiling included.
* :func:`check_indices` is the opt-in debug check of the index *values* (range, duplicate
  destinations, destination/source overlap). It copies the indices to the host, so it
  synchronises, and it refuses to run during CUDA-graph capture.

Dtype problems raise TypeError, everything else ValueError.
"""

from __future__ import annotations

import numbers

import torch

from .spec import KV_DTYPES, PROJ_DTYPES, STATE_DTYPES, X_DTYPES, StepSpec
from .tiling import shape_problem, tiling_problem

__all__ = ["check_step_inputs", "check_indices", "MAX_GRID_X", "MAX_GRID_Y"]

#: the kernel's grid is (B, H, D / tile_D): CUDA limits grid.x to 2**31 - 1 and grid.y to 65535
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
_VECTOR_BYTES = 16  # state / state_out are read and written with 16-byte vector accesses
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_str(dims: tuple[int, ...], letters: str) -> str:
    return f"({', '.join(letters.split())}) = {tuple(dims)}"


def _check_is_tensor(name: str, t, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        what = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name}: expected {what}, got {type(t).__name__}")


def _check_rank(name: str, t: torch.Tensor, letters: str) -> None:
    rank = len(letters.split())
    if t.dim() != rank:
        raise ValueError(
            f"{name}: expected a {rank}-D tensor of shape ({', '.join(letters.split())}), "
            f"got {t.dim()}-D with shape {tuple(t.shape)}"
        )


def _check_shape(name: str, t: torch.Tensor, letters: str, dims: tuple[int, ...]) -> None:
    _check_rank(name, t, letters)
    if tuple(t.shape) != tuple(dims):
        raise ValueError(
            f"{name}: expected shape {_shape_str(dims, letters)}, got {tuple(t.shape)} "
            f"(B, H, D are taken from x, R and N from B, P from state)"
        )


def _check_dtype_in(name: str, t: torch.Tensor, allowed: tuple[str, ...]) -> str:
    got = _dtype_name(t.dtype)
    if got not in allowed:
        raise TypeError(
            f"{name}: expected dtype one of {', '.join(allowed)} (supported), got {got}"
        )
    return got


def _check_dtype_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{name}: expected dtype {_dtype_name(ref.dtype)} (the same as {ref_name}), "
            f"got {_dtype_name(t.dtype)}"
        )


def _check_unit_inner_stride(name: str, t: torch.Tensor) -> None:
    # A dimension of size 0 or 1 is never stepped along, so its stride does not matter.
    if t.numel() == 0 or t.dim() == 0 or t.shape[-1] <= 1:
        return
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected innermost stride 1 (contiguous last dimension), got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}"
        )


def _check_vector_aligned(name: str, t: torch.Tensor) -> None:
    """``state``/``state_out`` are moved with 16-byte vectors: base and outer strides must allow it."""
    if t.numel() == 0:
        return
    ptr = t.data_ptr()
    if ptr % _VECTOR_BYTES:
        raise ValueError(
            f"{name}: expected a data pointer aligned to {_VECTOR_BYTES} bytes (the kernel "
            f"moves the state with {_VECTOR_BYTES}-byte vectors), got address {ptr:#x} "
            f"(offset {ptr % _VECTOR_BYTES} bytes); pass a tensor that starts on a 16-byte boundary"
        )
    esize = t.element_size()
    for dim in range(t.dim() - 1):
        stride_bytes = t.stride(dim) * esize
        if stride_bytes % _VECTOR_BYTES:
            raise ValueError(
                f"{name}: expected every stride except the innermost to be a multiple of "
                f"{_VECTOR_BYTES} bytes (16-byte vector accesses), got stride {t.stride(dim)} "
                f"elements = {stride_bytes} bytes in dimension {dim} (strides "
                f"{tuple(t.stride())}, {_dtype_name(t.dtype)})"
            )


def _check_int_option(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    return int(value)


def check_step_inputs(
    state,
    Bstate,
    Xstate,
    A,
    B,
    C,
    D,
    x,
    dt,
    trap,
    xproj,
    outproj=None,
    state_out=None,
    out=None,
    z=None,
    zproj=None,
    *,
    state_batch_indices=None,
    dst_state_batch_indices=None,
    null_slot_id=None,
    update_kv_state=False,
    tile_D=None,
    num_warps=None,
) -> StepSpec:
    """Check every input of ``mamba3_step_fn`` (metadata only) and return its complete StepSpec.

    The arguments are those of ``mamba3_step_fn``; see its docstring for shapes and dtypes.
    ``out`` may be None (the caller allocates it). Reads no tensor data, so it never
    synchronises.

    Returns:
        The :class:`StepSpec` of this call with ``tile_D``/``num_warps`` filled: the user's
        values where given, the per-configuration default otherwise.

    Raises:
        TypeError: a non-tensor where a tensor belongs; an unsupported or mismatched dtype;
            indices that are not int32; a non-int ``null_slot_id``/``tile_D``/``num_warps``.
        ValueError: wrong ranks or shapes; unsupported N/D/R; tensors on different devices;
            a non-unit innermost stride; ``state``/``state_out`` not 16-byte aligned;
            ``state_out`` in pool mode; ``dst_state_batch_indices`` without
            ``state_batch_indices``; ``null_slot_id`` without pool mode; ``z`` without
            ``zproj`` or the reverse; a batch or head count too large for the launch grid;
            an impossible ``tile_D``/``num_warps`` (including ``update_kv_state`` with
            ``tile_D < headdim``).
    """
    # -- argument kinds ---------------------------------------------------------------------
    required = dict(state=state, Bstate=Bstate, Xstate=Xstate, A=A, B=B, C=C, D=D, x=x, dt=dt,
                    trap=trap, xproj=xproj)
    optional = dict(outproj=outproj, state_out=state_out, out=out, z=z, zproj=zproj,
                    state_batch_indices=state_batch_indices,
                    dst_state_batch_indices=dst_state_batch_indices)
    for name, t in required.items():
        _check_is_tensor(name, t)
    for name, t in optional.items():
        _check_is_tensor(name, t, optional=True)
    null_slot_id = _check_int_option("null_slot_id", null_slot_id)
    tile_D = _check_int_option("tile_D", tile_D)
    num_warps = _check_int_option("num_warps", num_warps)
    if not isinstance(update_kv_state, bool):
        raise TypeError(f"update_kv_state: expected a bool, got {type(update_kv_state).__name__}")

    # -- mode flags -------------------------------------------------------------------------
    pool = state_batch_indices is not None
    if dst_state_batch_indices is not None and not pool:
        raise ValueError(
            "dst_state_batch_indices: expected None without state_batch_indices (a separate "
            "destination only exists in pool mode), got a tensor"
        )
    if pool and state_out is not None:
        raise ValueError(
            "state_out: expected None in pool mode (state_batch_indices given: the new state "
            "goes to the pool rows dst_state_batch_indices, default state_batch_indices), got a tensor"
        )
    if null_slot_id is not None and not pool:
        raise ValueError(
            f"null_slot_id: expected None without state_batch_indices (it marks padding lanes "
            f"in pool mode only), got {null_slot_id}"
        )
    if null_slot_id is not None and not _INT32_MIN <= null_slot_id <= _INT32_MAX:
        raise ValueError(f"null_slot_id: expected an int32 value, got {null_slot_id}")
    if (z is None) != (zproj is None):
        missing, given = ("zproj", "z") if zproj is None else ("z", "zproj")
        raise ValueError(f"{missing}: expected a tensor because {given} is given (z and zproj come together), got None")

    # -- ranks, then the letters, then every shape -----------------------------------------
    _check_rank("x", x, "B H D")
    _check_rank("B", B, "B R H N")
    nb, H, Dh = x.shape
    R, N = B.shape[1], B.shape[3]
    _check_rank("state", state, "P H D N" if pool else "B H D N")
    rows = state.shape[0] if pool else nb
    rl = "P" if pool else "B"  # the letter of the pool/batch dimension of state, Bstate, Xstate
    _check_shape("B", B, "B R H N", (nb, R, H, N))
    _check_shape("state", state, f"{rl} H D N", (rows, H, Dh, N))
    if state_out is not None:
        _check_shape("state_out", state_out, "B H D N", (nb, H, Dh, N))
    _check_shape("Bstate", Bstate, f"{rl} R H N", (rows, R, H, N))
    _check_shape("Xstate", Xstate, f"{rl} H D", (rows, H, Dh))
    for name, t in (("A", A), ("dt", dt), ("trap", trap)):
        _check_shape(name, t, "B H", (nb, H))
    _check_shape("C", C, "B R H N", (nb, R, H, N))
    _check_shape("D", D, "H", (H,))
    for name, t in (("xproj", xproj), ("zproj", zproj), ("outproj", outproj)):
        if t is not None:
            _check_shape(name, t, "R H D", (R, H, Dh))
    if z is not None:
        _check_shape("z", z, "B H D", (nb, H, Dh))
    if out is not None:
        if outproj is not None:
            _check_shape("out", out, "B H D", (nb, H, Dh))
        else:
            _check_shape("out", out, "B R H D", (nb, R, H, Dh))
    for name, t in (("state_batch_indices", state_batch_indices),
                    ("dst_state_batch_indices", dst_state_batch_indices)):
        if t is not None:
            _check_shape(name, t, "B", (nb,))

    problem = shape_problem(N, Dh, R)
    if problem:
        raise ValueError(f"unsupported shape (from x (B, H, D) and B (B, R, H, N)): {problem}")

    # -- dtypes ------------------------------------------------------------------------------
    state_dtype = _check_dtype_in("state", state, STATE_DTYPES)
    if state_out is not None:
        _check_dtype_same("state_out", state_out, "state", state)
    kv_dtype = _check_dtype_in("B", B, KV_DTYPES)
    _check_dtype_same("C", C, "B", B)
    _check_dtype_same("Bstate", Bstate, "B", B)
    x_dtype = _check_dtype_in("x", x, X_DTYPES)
    for name, t in (("z", z), ("Xstate", Xstate), ("out", out)):
        if t is not None:
            _check_dtype_same(name, t, "x", x)
    proj_dtype = _check_dtype_in("xproj", xproj, PROJ_DTYPES)
    for name, t in (("zproj", zproj), ("outproj", outproj)):
        if t is not None:
            _check_dtype_same(name, t, "xproj", xproj)
    for name, t in (("A", A), ("dt", dt), ("trap", trap), ("D", D)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype float32, got {_dtype_name(t.dtype)}")
    for name, t in (("state_batch_indices", state_batch_indices),
                    ("dst_state_batch_indices", dst_state_batch_indices)):
        if t is not None and t.dtype != torch.int32:
            raise TypeError(
                f"{name}: expected dtype int32 (convert with .to(torch.int32)), got "
                f"{_dtype_name(t.dtype)}"
            )

    # -- devices, strides, alignment ---------------------------------------------------------
    tensors = {**required, **optional}
    device = x.device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(
                f"{name}: expected a tensor on {device} (the device of x; all tensors must be "
                f"on one device), got {t.device}"
            )
    for name, t in tensors.items():
        if t is not None:
            _check_unit_inner_stride(name, t)
    _check_vector_aligned("state", state)
    if state_out is not None:
        _check_vector_aligned("state_out", state_out)

    # -- launch grid (B, H, D / tile_D) ------------------------------------------------------
    if nb > MAX_GRID_X:
        raise ValueError(
            f"x: batch B={nb} is too large for the launch grid (grid.x = B must be at most "
            f"{MAX_GRID_X}); split the batch"
        )
    if H > MAX_GRID_Y:
        raise ValueError(
            f"state: H={H} heads is too many for the launch grid (grid.y = H must be at most "
            f"{MAX_GRID_Y})"
        )

    # -- the specialisation and its tiling ---------------------------------------------------
    for name, value in (("tile_D", tile_D), ("num_warps", num_warps)):
        if value is not None and value <= 0:
            raise ValueError(f"{name}: expected a positive int or None (the default), got {value}")
    spec = StepSpec(
        dstate=N,
        headdim=Dh,
        mimo=R,
        state_dtype=state_dtype,
        kv_dtype=kv_dtype,
        x_dtype=x_dtype,
        proj_dtype=proj_dtype,
        tile_D=tile_D or 0,
        num_warps=num_warps or 0,
        pool=pool,
        has_dst=dst_state_batch_indices is not None,
        update_kv_state=update_kv_state,
        has_z=z is not None,
        has_outproj=outproj is not None,
        has_state_out=state_out is not None,
    ).with_default_tiling()
    if update_kv_state and spec.tile_D < spec.headdim:
        raise ValueError(
            f"tile_D: update_kv_state=True needs tile_D >= headdim (exactly one CTA owns each "
            f"(lane, head) B/x row, or the store races), expected tile_D={spec.headdim} or None, "
            f"got tile_D={spec.tile_D}; the tile is never changed silently"
        )
    problem = tiling_problem(spec)
    if problem:
        raise ValueError(
            f"tile_D/num_warps: {problem} (leave tile_D and num_warps None for the "
            f"per-configuration default)"
        )
    return spec


def _lanes_str(lanes: list[int], limit: int = 10) -> str:
    shown = ", ".join(str(v) for v in lanes[:limit])
    count = f"{len(lanes)} lane{'' if len(lanes) == 1 else 's'}"
    return f"[{shown}{', ...' if len(lanes) > limit else ''}] ({count})"


def check_indices(
    state_batch_indices: torch.Tensor,  # (B,) int32
    dst_state_batch_indices: torch.Tensor | None,  # (B,) int32
    P: int,
    null_slot_id: int | None = None,
) -> None:
    """Debug check of pool index values (``validate_indices=True``); synchronises the device.

    Negative indices and ``null_slot_id`` are legitimate padding. Raises ValueError listing
    the offending lanes for:

    * an index ``>= P`` in ``state_batch_indices`` or ``dst_state_batch_indices`` (the kernel
      would treat it as padding, but outside a padded graph replay it is almost always a bug);
    * two live lanes writing the same destination row (a race);
    * a live lane's destination equal to another live lane's source (a read/write race).

    A lane is live when its source is a real row; a live lane whose destination is padding
    writes nothing, so it cannot collide.

    Raises:
        RuntimeError: called during CUDA-graph capture (it would synchronise the stream).
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "validate_indices=True copies the indices to the host and synchronises, which is "
            "not allowed while a CUDA graph is being captured; validate outside capture or "
            "pass validate_indices=False"
        )
    src = state_batch_indices.detach().to("cpu", torch.int64).tolist()
    dst = src if dst_state_batch_indices is None else (
        dst_state_batch_indices.detach().to("cpu", torch.int64).tolist()
    )
    dst_name = "state_batch_indices" if dst_state_batch_indices is None else "dst_state_batch_indices"

    def is_row(v: int) -> bool:
        return 0 <= v < P and v != null_slot_id

    problems = []
    for name, values in (("state_batch_indices", src), ("dst_state_batch_indices", dst)):
        if name == "dst_state_batch_indices" and dst_state_batch_indices is None:
            continue
        bad = [b for b, v in enumerate(values) if v >= P]
        if bad:
            problems.append(
                f"{name}: lanes {_lanes_str(bad)} hold indices >= P={P} "
                f"(values {[values[b] for b in bad[:10]]}); padding must be negative"
                f"{' or null_slot_id' if null_slot_id is not None else ''}"
            )

    live = [b for b, v in enumerate(src) if is_row(v)]
    writers: dict[int, list[int]] = {}
    for b in live:
        if is_row(dst[b]):
            writers.setdefault(dst[b], []).append(b)
    dup = sorted(b for lanes in writers.values() if len(lanes) > 1 for b in lanes)
    if dup:
        problems.append(
            f"{dst_name}: live lanes {_lanes_str(dup)} share a destination row (rows "
            f"{sorted(r for r, lanes in writers.items() if len(lanes) > 1)[:10]}): a write race"
        )
    readers: dict[int, list[int]] = {}
    for b in live:
        readers.setdefault(src[b], []).append(b)
    overlap = sorted(
        b for r, lanes in writers.items() for b in lanes
        if any(other != b for other in readers.get(r, ()))
    )
    if overlap:
        problems.append(
            f"{dst_name}: live lanes {_lanes_str(overlap)} write a row that another live lane "
            f"reads (its state_batch_indices): a read/write race"
        )
    if problems:
        raise ValueError("invalid pool indices: " + "; ".join(problems))
