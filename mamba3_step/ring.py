"""The replay ring: its layout (:class:`Ring`, declared in :mod:`mamba3_step.tensors`), its allocation (:func:`new_ring`, every argument checked
by name: :func:`checked_int`, :func:`checked_dtype`, :func:`checked_device`) and what replay's entry points
and ``fork_row`` check of their arguments before anything runs or is written (:func:`check_replay_arguments`,
:func:`check_ring`, :func:`check_fork_row`). The CPU path that steps a ring is :mod:`mamba3_step.replay`; the rules are
docs/contract.md, "Replay".

Letters (docs/contract.md): P pool rows, T draft tokens, H heads, D head dim, N state size, R MIMO
rank, S rotary angles; F the flush length, L = F - 1 + draft the ring's entries.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from .contract import (INT32_MAX, KV_DTYPES, MAX_GRID_Y, SUPPORTED_D, SUPPORTED_N, SUPPORTED_R, X_DTYPES,
                       as_torch_dtype, dtype_name, shown)
from .spec import StepSpec
from .tensors import Ring, StepTensors
from .validation import checks
from .validation.step import check_step_inputs

__all__ = ["Ring", "check_accepted", "check_fork_row", "check_replay_arguments", "check_replay_step", "check_ring",
           "checked_device", "checked_dtype", "checked_int", "new_ring"]

Tensor = torch.Tensor


def new_ring(rows: int, flush_length: int, mimo: int, heads: int, dstate: int, headdim: int, *,
             kv_dtype: torch.dtype, x_dtype: torch.dtype, draft: int = 0, stochastic: bool = False,
             rope_angles: int = 0, device=None) -> Ring:
    """An empty ring for ``rows`` pool rows, flush length ``F`` (2 to 16) and room for verify steps of
    up to ``draft`` tokens (0 to 16): ``F - 1 + draft`` entries; ``stochastic`` (a bool): with the offsets
    a stochastically rounded state's flush draws at; ``rope_angles`` S (0 to ``dstate / 2``) > 0: with
    each token's angle. ``mimo``, ``dstate``, ``headdim`` are sizes the step supports, ``kv_dtype`` /
    ``x_dtype`` dtypes of B's and x's groups (torch dtypes or their names), ``device`` one this process
    can use (None: the default device). Every argument is checked before anything is allocated:
    ValueError (TypeError for a dtype or ``stochastic``) naming it, with what was expected and got."""
    rows = checked_int("rows", rows, 1, INT32_MAX, " (pool rows: int32 slot ids)")
    heads = checked_int("heads", heads, 1, MAX_GRID_Y, " (the step's most heads)")
    flush_length = checked_int("flush_length", flush_length, 2, 16, " (the flush length)")
    for name, value, sizes in (("mimo", mimo, SUPPORTED_R), ("dstate", dstate, SUPPORTED_N),
                               ("headdim", headdim, SUPPORTED_D)):
        if checked_int(name, value, 1) not in sizes:
            raise ValueError(f"{name}: expected one of {sizes} (the sizes the step supports), got {shown(value)}")
    draft = checked_int("draft", draft, 0, 16, " (the most draft tokens of a verify step)")
    rope_angles = checked_int("rope_angles", rope_angles, 0, dstate // 2, " (rotary angles per head)")
    kv_dtype, x_dtype = checked_dtype(kv_dtype, "kv_dtype", KV_DTYPES), checked_dtype(x_dtype, "x_dtype", X_DTYPES)
    checks.check_bool_option("stochastic", stochastic)
    device = None if device is None else checked_device(device)
    L = flush_length - 1 + draft
    return Ring(torch.zeros(rows, L, mimo, heads, dstate, dtype=kv_dtype, device=device),
                torch.zeros(rows, L, heads, headdim, dtype=x_dtype, device=device),
                torch.zeros(rows, L, heads, 3, dtype=torch.float32, device=device),
                torch.zeros(rows, heads, dtype=torch.int32, device=device),
                torch.zeros(rows, L, heads, dtype=torch.int64, device=device) if stochastic else None,
                torch.zeros(rows, L, heads, dtype=torch.int32, device=device) if stochastic else None,
                torch.zeros(rows, L, heads, rope_angles, dtype=torch.int64, device=device) if rope_angles else None)


def checked_int(name: str, v, low: int, high: Optional[int] = None, what: str = "") -> int:
    """``v`` (a Python or numpy integer, not a bool) in ``[low, high]`` as an int; ValueError naming ``name``."""
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low or (high is not None and v > high):
        expected = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
        raise ValueError(f"{name}: expected {expected}{what}, got {shown(v)}")
    return int(v)


def checked_dtype(dtype, name: str, group: tuple[str, ...]) -> torch.dtype:
    """``dtype`` (a name or a torch dtype) as a torch dtype of ``group``; TypeError naming ``name`` otherwise."""
    if not isinstance(dtype, (str, torch.dtype)):  # nothing else is compared (a freed tensor cannot be)
        raise TypeError(f"{name}: expected a torch dtype or its name, got {shown(dtype)}")
    t = as_torch_dtype(dtype, name)
    if dtype_name(t) not in group:
        raise TypeError(f"{name}: expected one of {', '.join('torch.' + g for g in group)}, got {t}")
    return t


def checked_device(device) -> torch.device:
    """``device`` as a torch.device that exists here, a CUDA device with its index; ValueError naming it otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {shown(device)} "
                         f"({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: expected a device this process can use, got {shown(device)}, but CUDA "
                             f"is not available (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: expected a CUDA device index below {torch.cuda.device_count()} "
                             f"(the visible GPUs), got {shown(device)}")
        if dev.index is None:
            # Tensors made on "cuda" live on the current device, and their .device names its index:
            # keep the form they report, so that comparisons with them hold.
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


_RING_HINTS = dict(offset=" (stochastic rounding: new_ring(..., stochastic=True))", angle=" (rotary: new_ring(..., "
                   "rope_angles=S))", drawn_for=" (stochastic rounding: new_ring(..., stochastic=True))")


def check_replay_arguments(tensors, ring, flush_length, who: str = "replay_step", from_checkpoint: bool = False) -> None:
    """``tensors`` is a :class:`StepTensors` and ``ring`` (``replay_ring``) a :class:`Ring` whose
    required fields are strided tensors and optional ones strided tensors or None (``TypeError``
    naming the argument, ``who`` the entry point); ``F`` (``replay_flush_length``) an int in [2, 16]
    and ``from_checkpoint`` (``replay_from_checkpoint``) a bool: run on every call, before anything
    reads a ring tensor's shape or strides or the scalars' values. What the tensors hold (storage
    included) is :func:`check_ring`'s to judge."""
    if not isinstance(tensors, StepTensors):
        raise TypeError(f"{who}: tensors must be a mamba3_step.tensors.StepTensors, got {type(tensors).__name__}")
    if not isinstance(ring, Ring):
        raise TypeError(f"{who}: replay_ring must be a mamba3_step.Ring (mamba3_step.new_ring), got "
                        f"{type(ring).__name__}")
    for field, value in zip(Ring._fields, ring):  # cheap enough for every call; the storage: check_ring
        if value is None and field in Ring._field_defaults:
            continue
        if not isinstance(value, Tensor) or value.is_nested or value.layout is not torch.strided:
            checks.check_is_tensor(f"replay_ring.{field}", value, optional=field in Ring._field_defaults)
    if type(flush_length) is not int or not 2 <= flush_length <= 16:
        raise ValueError(f"{who}: replay_flush_length must be an int in [2, 16], got {shown(flush_length)}")
    checks.check_bool_option("replay_from_checkpoint", from_checkpoint)


def check_ring(t: StepTensors, ring: Ring, flush_length: int) -> None:
    """What replay takes: pool mode, the state written back to its source, a ring that fits ``t`` and the
    flush length ``F`` (refused by name, ``ValueError``), after :func:`check_replay_arguments`."""
    unsupported = {"num_accepted_tokens": t.num_accepted_tokens, "state_out": t.state_out}
    for name, v in unsupported.items():
        if v is not None:
            raise ValueError(f"{name}: expected None with replay_ring (not supported with replay yet; "
                             f"docs/contract.md, 'Replay'), got a tensor")
    if not t.pool:
        raise ValueError("state_batch_indices: expected a tensor with replay_ring (replay is a pool-mode step), "
                         "got None")
    if t.dst_state_batch_indices is not None and t.x.dim() == 4:
        raise ValueError("dst_state_batch_indices with a verify step (T tokens) and replay_ring: replay keeps the "
                         "drafts in the ring, not in destination rows")
    P, H, D, N = t.state.shape
    R, L = t.xproj.shape[0], ring.B.shape[1]
    drafts = t.tokens if t.x.dim() == 4 else 0
    if L < flush_length - 1 + drafts:
        raise ValueError(f"replay_ring: the ring holds {L} entries; replay_flush_length = {flush_length} with {drafts}-token "
                         f"drafts needs {flush_length - 1 + drafts} (new_ring(..., draft={drafts}))")
    S = 0 if t.angle_state is None else t.angle_state.shape[-1]
    want = {"B": (P, L, R, H, N), "x": (P, L, H, D), "coef": (P, L, H, 3), "length": (P, H), "offset": (P, L, H),
            "drawn_for": (P, L, H), "angle": (P, L, H, S)}
    dtypes = {"B": t.Bstate.dtype, "x": t.Xstate.dtype, "coef": torch.float32, "length": torch.int32,
              "offset": torch.int64, "drawn_for": torch.int32, "angle": torch.int64}
    optional = {"offset": t.rand_seed, "drawn_for": t.rand_seed, "angle": t.angle_state}
    for name, shape in want.items():
        got = getattr(ring, name)
        if got is None and name in optional and optional[name] is None:
            continue
        if got is not None:
            checks.check_storage(f"replay_ring.{name}", got)  # a storage freed under the ring: no kernel may write it
        if got is None or tuple(got.shape) != shape or got.dtype != dtypes[name] or got.device != t.state.device:
            got = "None" if got is None else f"{got.dtype} {tuple(got.shape)} on {got.device}"
            raise ValueError(f"replay_ring.{name} must be {dtypes[name]} of shape {shape} on {t.state.device}"
                             f"{_RING_HINTS.get(name, '')}, got {got}")


def check_accepted(t: StepTensors, num_accepted_tokens, name: str = "num_accepted_tokens") -> None:
    """``accepted`` (called ``name``): a (B,) int32 tensor with unit stride on the step's device (its
    values are the kernel's to judge: a count that leaves the ring makes the lane padding,
    docs/contract.md, "Replay"). ``t`` is validated already."""
    checks.check_is_tensor(name, num_accepted_tokens)
    checks.check_shape(name, num_accepted_tokens, "B", (t.batch,))
    checks.check_dtype(name, num_accepted_tokens, ("int32",))
    checks.check_device(name, num_accepted_tokens, t.x.device)
    checks.check_unit_inner_stride(name, num_accepted_tokens)


def check_replay_step(tensors, ring, flush_length, num_accepted_tokens=None, rotate_pairwise: bool = False,
                      who: str = "replay_step") -> StepSpec:
    """Everything the CPU path checks before it computes, in the kernel path's order: the arguments'
    types (:func:`check_replay_arguments`), the step's (with ``update_kv_state``), ``accepted``, the
    ring's (:func:`check_ring`). Returns the step's validated spec."""
    check_replay_arguments(tensors, ring, flush_length, who)
    spec = check_step_inputs(tensors, update_kv_state=True, rotate_pairwise=rotate_pairwise,
                             stochastic_rounding=tensors.rand_seed is not None)
    if num_accepted_tokens is not None:
        check_accepted(tensors, num_accepted_tokens)
    check_ring(tensors, ring, flush_length)
    return spec


def check_fork_row(tensors: StepTensors, ring: Ring, src, dst) -> list:
    """:func:`mamba3_step.replay.fork_row`'s checks; returns the row tensors it copies (every present one)."""
    if not isinstance(tensors, StepTensors):
        raise TypeError(f"tensors: expected a mamba3_step.tensors.StepTensors, got {type(tensors).__name__}")
    if not isinstance(ring, Ring):
        raise TypeError(f"ring: expected a mamba3_step.Ring (mamba3_step.new_ring), got {type(ring).__name__}")
    named = [(name, getattr(tensors, name)) for name in ("state", "Bstate", "Xstate", "state_scale", "angle_state")]
    named += [(f"ring.{field}", value) for field, value in zip(Ring._fields, ring)]
    optional = {"state_scale", "angle_state"} | {f"ring.{f}" for f in Ring._field_defaults}
    for name, value in named:
        checks.check_is_tensor(name, value, optional=name in optional)
    state = tensors.state
    if state.dim() == 0:
        raise ValueError(f"state: expected a (P, H, D, N) pool, got shape {tuple(state.shape)}")
    P, inference_mode = state.shape[0], torch.is_inference_mode_enabled()
    pools = [(name, value) for name, value in named if value is not None]
    for name, value in pools:
        if value.dim() == 0 or value.shape[0] != P or value.device != state.device:
            raise ValueError(f"{name}: expected a tensor of P = {P} rows (state's) on {state.device}, got shape "
                             f"{tuple(value.shape)} on {value.device}")
        checks.check_storage(name, value)
        checks.check_write_target(name, value, inference_mode)
    null = tensors.null_slot_id
    if null is not None and (not isinstance(null, numbers.Integral) or isinstance(null, bool)):
        raise TypeError(f"null_slot_id: expected None or an int, got {shown(null)}")
    for name, row in (("src", src), ("dst", dst)):
        if not isinstance(row, numbers.Integral) or isinstance(row, bool):
            raise TypeError(f"{name}: expected an int (a pool row), got {shown(row)}")
        if not 0 <= row < P or row == null:
            raise ValueError(f"{name}: expected a real row in [0, {P})" + ("" if null is None else f" other than the "
                             f"null slot {null}") + f", got {row} (a padding id names no row)")
    return [value for _, value in pools]
