"""The step's tensors as one bundle, :class:`StepTensors`, and the kernel's argument order.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.

Every layer below the public flat signatures (``mamba3_step_fn``, ``mamba3_step_op``, the custom
op, ``serving.decode_step``) passes a :class:`StepTensors`: validation, the PyTorch path, the
launcher, the gather -> dense -> scatter baseline. Its fields are the public signature's tensor
arguments in the public positional order, so ``StepTensors(*args, **kwargs)`` packs a call.
The kernel's arguments are another bundle, :class:`KernelArgs`, filled from this one by
:func:`kernel_arguments`.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, NamedTuple, Optional

import torch

from .contract import new_out, out_shape

__all__ = ["KERNEL_ARGUMENT_NAMES", "KernelArgs", "LANE_FIELDS", "RING_FIELDS", "ROW_FIELDS", "Ring", "StepTensors",
           "TOKEN_FIELDS", "WEIGHT_FIELDS", "kernel_arguments", "ring_arguments"]

Tensor = torch.Tensor

#: fields with one row per pool row (pool mode) or per lane (dense mode)
ROW_FIELDS = ("state", "Bstate", "Xstate", "angle_state", "state_scale")
#: this step's per-lane inputs (first dimension B)
LANE_FIELDS = ("A", "B", "C", "x", "dt", "trap", "z", "angle_proj")
#: the layer's weights (no lane dimension)
WEIGHT_FIELDS = ("D", "xproj", "zproj", "outproj", "B_bias", "C_bias")
#: fields with a token axis after the lane axis when T > 1: (B, T, ...)
TOKEN_FIELDS = ("A", "B", "C", "x", "dt", "trap", "z", "angle_proj", "out")


class Ring(NamedTuple):
    """One layer's replay ring (docs/contract.md, "Replay"; allocate it with
    :func:`mamba3_step.new_ring`): entry ``j < length[p]`` of row ``p`` is the ``j``-th token after
    the checkpoint of row ``p``; entries past ``length`` are a verify step's uncommitted drafts.
    L = flush length - 1 + draft room entries; S rotary angles."""

    B: Tensor  # (P, L, R, H, N), B's dtype: the token's B (per head, a shared B expanded)
    x: Tensor  # (P, L, H, D), x's dtype
    coef: Tensor  # (P, L, H, 3) float32: the token's A, dt, trap
    length: Tensor  # (P, H) int32: committed tokens, one value per row (each head holds it: a kernel CTA owns one)
    # with stochastic rounding, the same at every head (each kernel CTA owns one head's: no CTA reads an entry
    # another writes): the rand_seed offset the token drew at (int64), the row it drew for (int32)
    offset: Optional[Tensor] = None  # (P, L, H) int64
    drawn_for: Optional[Tensor] = None  # (P, L, H) int32
    angle: Optional[Tensor] = None  # (P, L, H, S) int64, with rotary: the angle after the token


class StepTensors(NamedTuple):
    """The tensors of one step (shapes: docs/contract.md, "Tensors"), plus ``null_slot_id``.

    ``null_slot_id`` is the one non-tensor: the runtime value that, with the two index tensors,
    decides which lanes are padding; ``replay_ring`` the one bundle (a :class:`Ring` of tensors).
    Optional fields are None when absent.
    """

    state: Tensor  # (P|B, H, D, N), updated in place
    Bstate: Tensor  # (P|B, R, H, N)
    Xstate: Tensor  # (P|B, H, D)
    A: Tensor  # (B, H) fp32
    B: Tensor  # (B, R, H, N), or (B, R, 1, N) shared by the heads
    C: Tensor  # (B, R, H, N), or (B, R, 1, N) shared by the heads
    D: Tensor  # (H,) fp32
    x: Tensor  # (B, H, D)
    dt: Tensor  # (B, H) fp32
    trap: Tensor  # (B, H) fp32
    xproj: Tensor  # (R, H, D)
    outproj: Optional[Tensor] = None  # (R, H, D)
    state_out: Optional[Tensor] = None  # (B, H, D, N), dense mode only
    out: Optional[Tensor] = None  # (B, H, D) with outproj, else (B, R, H, D)
    z: Optional[Tensor] = None  # (B, H, D)
    zproj: Optional[Tensor] = None  # (R, H, D)
    state_batch_indices: Optional[Tensor] = None  # (B,) or with num_accepted_tokens (B, K) int32: pool mode
    dst_state_batch_indices: Optional[Tensor] = None  # (B,) or (B, T) int32
    null_slot_id: Optional[int] = None
    num_accepted_tokens: Optional[Tensor] = None  # (B,) int32, with a (B, K) state_batch_indices
    angle_state: Optional[Tensor] = None  # (P|B, H, S) int64 rotary angle (turns / 2**64), updated in place
    angle_proj: Optional[Tensor] = None  # (B, H, S) fp32, with angle_state
    B_bias: Optional[Tensor] = None  # (R, H, N) fp32, with angle_state and C_bias
    C_bias: Optional[Tensor] = None  # (R, H, N) fp32, with angle_state and B_bias
    rand_seed: Optional[Tensor] = None  # (2,) int64 [seed, offset]: stochastic rounding's bits
    rand_rows: Optional[Tensor] = None  # (B,) int32, dense mode: the row each lane's bits are drawn for
    state_scale: Optional[Tensor] = None  # (P|B, H, D) fp32 with an 8-bit state: its scales, updated in place
    replay_ring: Optional[Ring] = None  # replay: the layer's ring, updated in place (None: a stepwise step)

    @property
    def batch(self) -> int:
        """B, the number of lanes (from ``x``)."""
        return self.x.shape[0]

    @property
    def pool(self) -> bool:
        """Pool mode: ``state_batch_indices`` given."""
        return self.state_batch_indices is not None

    @property
    def tokens(self) -> int:
        """T, tokens per lane: the second dimension of a (B, T, H, D) ``x``; 1 for (B, H, D)."""
        return self.x.shape[1] if self.x.dim() == 4 else 1

    def token(self, t: int) -> "StepTensors":
        """Token ``t``'s per-lane inputs (and ``out``) without the token axis; the rows, weights and
        indices unchanged. A T-less bundle is its own token 0."""
        if self.x.dim() != 4:
            return self
        picked = {f: (None if getattr(self, f) is None else getattr(self, f)[:, t]) for f in TOKEN_FIELDS}
        return self._replace(**picked)

    def one_token_squeezed(self) -> "StepTensors":
        """The kernel's form of a one-token step given with a token axis: ``x`` (B, 1, H, D) and the
        other per-lane tensors (and ``out``) viewed without the axis, a (B, 1)
        ``dst_state_batch_indices`` as (B,). Views: writing through them writes the caller's
        tensors. Any other bundle is returned as it is."""
        if self.x.dim() != 4 or self.x.shape[1] != 1:
            return self
        picked = {f: (None if getattr(self, f) is None else getattr(self, f).select(1, 0)) for f in TOKEN_FIELDS}
        dst = self.dst_state_batch_indices
        if dst is not None and dst.dim() == 2:
            picked["dst_state_batch_indices"] = dst.select(1, 0)
        return self._replace(**picked)

    def with_out(self) -> "StepTensors":
        """This bundle with ``out`` allocated (x's dtype and device) when it is None."""
        if self.out is not None:
            return self
        x = self.x
        out = new_out(x, out_shape(x, self.xproj, self.outproj is not None))
        return tuple.__new__(StepTensors, self[:_OUT] + (out,) + self[_OUT + 1:])  # a fast _replace

    def dense_lanes(self, lanes: Tensor, rows: Tensor) -> "StepTensors":
        """A dense-mode bundle of lanes ``lanes`` reading pool rows ``rows`` (gathered copies).

        Per-lane inputs are indexed with ``lanes``, the row tensors with ``rows``, weights are
        shared; ``out``, ``state_out``, the indices and ``null_slot_id`` are dropped.
        """
        picked = {f: (None if getattr(self, f) is None else getattr(self, f).index_select(0, rows))
                  for f in ROW_FIELDS}
        for f in LANE_FIELDS:
            t = getattr(self, f)
            picked[f] = None if t is None else t.index_select(0, lanes)
        weights = {f: getattr(self, f) for f in WEIGHT_FIELDS}
        return StepTensors(**picked, **weights)


_OUT = StepTensors._fields.index("out")


class KernelArgs(NamedTuple):
    """The compiled kernel's runtime arguments, in launch order: the one declaration of them.

    ``Mamba3StepKernel`` takes them as this bundle (its launcher's flat parameters are generated
    from these fields, :func:`mamba3_step.kernel.fake_arguments` returns one, the PTX tier packs
    one), and :func:`kernel_arguments` fills one from a call. The names are the public argument
    names; an absent optional tensor is None (it specialises the kernel away). ``null_slot`` is
    ``null_slot_id`` as an int32, -1 for none.
    """

    state: Any  # (P|B, H, D, N) state dtype, updated in place
    Bstate: Any  # (P|B, R, H, N) kv dtype
    Xstate: Any  # (P|B, H, D) x dtype
    A: Any  # (B[, T], H) fp32; a token axis T only in a T-token specialisation
    B: Any  # (B[, T], R, H, N) kv dtype; (B[, T], R, 1, N) when shared by the heads
    C: Any  # (B[, T], R, H, N) kv dtype; (B[, T], R, 1, N) when shared by the heads
    D: Any  # (H,) fp32, the skip parameter
    x: Any  # (B[, T], H, D) x dtype
    dt: Any  # (B[, T], H) fp32
    trap: Any  # (B[, T], H) fp32
    xproj: Any  # (R, H, D) proj dtype
    zproj: Any  # (R, H, D) proj dtype, or None
    outproj: Any  # (R, H, D) proj dtype, or None
    z: Any  # (B[, T], H, D) x dtype, or None
    out: Any  # (B[, T], H, D) with outproj, else (B[, T], R, H, D), x dtype
    state_out: Any  # (B, H, D, N) state dtype, dense mode only, or None
    state_batch_indices: Any  # (B,) int32, or (B, K) with num_accepted_tokens; None: dense mode
    dst_state_batch_indices: Any  # (B,) or (B, T) int32, or None
    num_accepted_tokens: Any  # (B,) int32, or None
    angle_state: Any  # (P|B, H, S) int64 rotary angle, updated in place, or None
    angle_proj: Any  # (B[, T], H, S) fp32, or None
    B_bias: Any  # (R, H, N) fp32, or None
    C_bias: Any  # (R, H, N) fp32, or None
    rand_seed: Any  # (2,) int64 [seed, offset] with stochastic rounding, or None
    rand_rows: Any  # (B,) int32 in dense mode: each lane's row for the draw, or None (the lane)
    state_scale: Any  # (P|B, H, D) fp32, an 8-bit state's scales, updated in place, or None
    ring_B: Any  # (P, L, R, H, N) kv dtype with replay: the ring's B per entry, or None
    ring_x: Any  # (P, L, H, D) x dtype with replay: the ring's x per entry, or None
    ring_coef: Any  # (P, L, H, 3) fp32 with replay: the ring's A, dt, trap per entry, or None
    ring_length: Any  # (P, H) int32 with replay: committed entries per (row, head), or None
    ring_angle: Any  # (P, L, H, S) int64 with replay and rotary: the angle after each entry's token, or None
    ring_offset: Any  # (P, L, H) int64 with replay and stochastic rounding: each entry's draw offset, or None
    ring_drawn_for: Any  # (P, L, H) int32 with replay and stochastic rounding: the row each entry drew for, or None
    null_slot: Any  # int32: pool rows equal to it are padding (-1: none)


#: the kernel's runtime argument names, in launch order (the last, ``null_slot``, is a scalar)
KERNEL_ARGUMENT_NAMES = KernelArgs._fields
#: the kernel arguments a replay step adds: the fields of its ring (mamba3_step.replay.Ring)
RING_FIELDS = ("ring_B", "ring_x", "ring_coef", "ring_length", "ring_angle", "ring_offset", "ring_drawn_for")
#: the kernel's tensors, picked from a call laid out like StepTensors
_KERNEL_TENSORS = itemgetter(*(StepTensors._fields.index(name) for name in KERNEL_ARGUMENT_NAMES[:-1]
                               if name not in RING_FIELDS))


def kernel_arguments(tensors, ring=None) -> KernelArgs:
    """The compiled kernel's runtime arguments for a validated call, as a :class:`KernelArgs`
    (launch with ``compiled(*kernel_arguments(tensors))``; no stream: tvm-ffi launches on the
    current one).

    ``tensors`` is a :class:`StepTensors`, or any tuple laid out like one. A validated call
    names exactly the optional tensors its specialisation has (validation ties each flag of
    :class:`~mamba3_step.spec.StepSpec` to whether its tensor is given), so the absent ones are
    None here as they are in the compiled signature. Free of cutlass: launching a cached kernel
    never imports the DSL. The ring (``ring``, else the call's ``replay_ring``; a replay step): its
    ``B``, ``x``, ``coef``, ``length``, ``angle`` (None without rotary), ``offset`` and
    ``drawn_for`` (None without stochastic rounding) fill the ring fields (:data:`RING_FIELDS`),
    else None.
    """
    null = tensors[_NULL]
    if ring is None:
        ring = tensors[_RING]
    rings = _NO_RING if ring is None else ring_arguments(ring)
    return tuple.__new__(KernelArgs, _KERNEL_TENSORS(tensors) + rings + (-1 if null is None else int(null),))


def ring_arguments(ring) -> tuple:
    """A :class:`~mamba3_step.replay.Ring`'s tensors in :data:`RING_FIELDS` order (None where the ring
    has no such field: angles without rotary, offsets and rows without stochastic rounding)."""
    return (ring.B, ring.x, ring.coef, ring.length, ring.angle, ring.offset, ring.drawn_for)


_NULL = StepTensors._fields.index("null_slot_id")
_RING = StepTensors._fields.index("replay_ring")
_NO_RING = (None,) * len(RING_FIELDS)
