"""The replay ring: its layout (:class:`Ring`, declared in :mod:`mamba3_step.tensors`), its allocation (:func:`new_ring`) and what replay's
entry points check of their arguments before anything runs (:func:`check_replay_arguments`,
:func:`check_ring`). The CPU path that steps a ring is :mod:`mamba3_step.replay`; the rules are
docs/contract.md, "Replay".

Letters (docs/contract.md): P pool rows, T draft tokens, H heads, D head dim, N state size, R MIMO
rank, S rotary angles; K the flush length, L = K - 1 + draft the ring's entries.
"""

from __future__ import annotations

import torch

from .contract import shown
from .spec import StepSpec
from .tensors import Ring, StepTensors
from .validation import checks
from .validation.step import check_step_inputs

__all__ = ["Ring", "check_accepted", "check_replay_arguments", "check_replay_step", "check_ring", "new_ring"]

Tensor = torch.Tensor


def new_ring(rows: int, K: int, mimo: int, heads: int, dstate: int, headdim: int, *,
             kv_dtype: torch.dtype, x_dtype: torch.dtype, draft: int = 0, stochastic: bool = False,
             rope_angles: int = 0, device=None) -> Ring:
    """An empty ring for ``rows`` pool rows, flush length ``K`` (2 to 16) and room for verify steps of
    up to ``draft`` tokens (0 to 16): ``K - 1 + draft`` entries; ``stochastic``: with the offsets a
    stochastically rounded state's flush draws at; ``rope_angles`` S > 0: with each token's angle."""
    if not isinstance(K, int) or not 2 <= K <= 16:
        raise ValueError(f"new_ring: K must be an int in [2, 16], got {shown(K)}")
    if not isinstance(draft, int) or not 0 <= draft <= 16:
        raise ValueError(f"new_ring: draft must be an int in [0, 16], got {draft!r}")
    L = K - 1 + draft
    return Ring(torch.zeros(rows, L, mimo, heads, dstate, dtype=kv_dtype, device=device),
                torch.zeros(rows, L, heads, headdim, dtype=x_dtype, device=device),
                torch.zeros(rows, L, heads, 3, dtype=torch.float32, device=device),
                torch.zeros(rows, heads, dtype=torch.int32, device=device),
                torch.zeros(rows, L, heads, dtype=torch.int64, device=device) if stochastic else None,
                torch.zeros(rows, L, heads, dtype=torch.int32, device=device) if stochastic else None,
                torch.zeros(rows, L, heads, rope_angles, dtype=torch.int64, device=device) if rope_angles else None)


_RING_HINTS = dict(offset=" (stochastic rounding: new_ring(..., stochastic=True))", angle=" (rotary: new_ring(..., "
                   "rope_angles=S))", drawn_for=" (stochastic rounding: new_ring(..., stochastic=True))")


def check_replay_arguments(tensors, ring, K, who: str = "replay_step", from_checkpoint: bool = False) -> None:
    """``tensors`` is a :class:`StepTensors` and ``ring`` (``replay_ring``) a :class:`Ring` whose
    required fields are strided tensors and optional ones strided tensors or None (``TypeError``
    naming the argument, ``who`` the entry point); ``K`` (``replay_flush_length``) an int in [2, 16]
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
    if type(K) is not int or not 2 <= K <= 16:
        raise ValueError(f"{who}: replay_flush_length must be an int in [2, 16], got {shown(K)}")
    checks.check_bool_option("replay_from_checkpoint", from_checkpoint)


def check_ring(t: StepTensors, ring: Ring, K: int) -> None:
    """What replay takes: pool mode, the state written back to its source, a ring that fits ``t`` and the
    flush length ``K`` (refused by name, ``ValueError``), after :func:`check_replay_arguments`."""
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
    if L < K - 1 + drafts:
        raise ValueError(f"replay_ring: the ring holds {L} entries; replay_flush_length = {K} with {drafts}-token "
                         f"drafts needs {K - 1 + drafts} (new_ring(..., draft={drafts}))")
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


def check_accepted(t: StepTensors, accepted, name: str = "accepted") -> None:
    """``accepted`` (called ``name``): a (B,) int32 tensor with unit stride on the step's device (its
    values are the kernel's to judge: a count that leaves the ring makes the lane padding,
    docs/contract.md, "Replay"). ``t`` is validated already."""
    checks.check_is_tensor(name, accepted)
    checks.check_shape(name, accepted, "B", (t.batch,))
    checks.check_dtype(name, accepted, ("int32",))
    checks.check_device(name, accepted, t.x.device)
    checks.check_unit_inner_stride(name, accepted)


def check_replay_step(tensors, ring, K, accepted=None, rotate_pairwise: bool = False,
                      who: str = "replay_step") -> StepSpec:
    """Everything the CPU path checks before it computes, in the kernel path's order: the arguments'
    types (:func:`check_replay_arguments`), the step's (with ``update_kv_state``), ``accepted``, the
    ring's (:func:`check_ring`). Returns the step's validated spec."""
    check_replay_arguments(tensors, ring, K, who)
    spec = check_step_inputs(tensors, update_kv_state=True, rotate_pairwise=rotate_pairwise,
                             stochastic_rounding=tensors.rand_seed is not None)
    if accepted is not None:
        check_accepted(tensors, accepted)
    check_ring(tensors, ring, K)
    return spec
