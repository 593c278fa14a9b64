"""A replay row's current state on any device: :func:`materialize_fn` (docs/contract.md, "Replay").

CPU tensors take the CPU path (:func:`mamba3_step.replay.materialize`). On CUDA the state comes
from the replay kernel itself, so that it is the stepwise kernel's bit for bit (PyTorch's math on
the device orders its multiply-adds differently): the kernel's **flush form** is a verify step
with flush length ``F = 1`` run on copies of the rows. Every row with committed entries flushes
them (``c >= 1``) into its copy with the step's math and storage rounding, as a verify step at a
flush does; two drafts of zero inputs follow (the kernel has no verify step without drafts) and
are discarded with their ring entries. ``accepted`` is zero, given so that the ring may hold more
entries than the two drafts (``StepSpec.replay_draft``).

A verify step replays at most ``F - 1 + 16`` entries (the draft room is at most 16), so rows with
more than 16 committed entries (rings of more than 16 entries: ``F - 1 + T_max > 16``) go to a
second launch with ``F = L - 15``. The copies are the returned tensors: pool rows ``0 .. n - 1``
of the launches.

Letters: n rows asked for, b rows of one launch, H heads, D head dim, N state size, R MIMO rank,
S rotary angles, L the ring's entries, L' the copy's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .api import runs_kernel
from .contract import KV_DTYPES, X_DTYPES
from .launch import kernel_for
from .replay import Current, Ring, check_materialize, materialize
from .replay_validation import checked_replay_spec
from .ring import check_replay_arguments, check_ring
from .spec import FLUSH_DRAFTS, StepSpec, flush_entries, flush_groups
from .tensors import StepTensors, kernel_arguments
from .validation import check_step_inputs, checks

__all__ = ["FlushLaunch", "flush_form", "materialize_fn"]


#: the tensors of ``materialize_fn``'s bundle it reads: required, and optional ones
_REQUIRED = ("state", "Bstate", "Xstate", "xproj", "D")
_OPTIONAL = ("angle_state", "state_scale", "rand_seed", "B_bias", "C_bias")


class FlushLaunch(NamedTuple):
    """One launch of the flush form: its specialisation, its verify step on the copies (with
    ``num_accepted_tokens`` zero) and the copies' ring."""

    spec: StepSpec
    tensors: StepTensors
    ring: Ring


def materialize_fn(tensors: StepTensors, ring: Ring, rows, *, rotate_pairwise: bool = False) -> Current:
    """The current state of pool ``rows`` (an int, ints, or an integer tensor; rows in ``[0, P)``), a
    :class:`~mamba3_step.replay.Current` of new tensors: each row's checkpoint advanced by its
    ring's committed entries. On CPU tensors :func:`mamba3_step.replay.materialize`; on CUDA the
    replay kernel's flush form (module docstring), equal bit for bit to what the stepwise kernel
    holds after the same tokens. Reads ``tensors``' rows and weights (``xproj``, ``D``, the rotary
    biases, ``rand_seed``'s seed); its per-lane inputs are not read. Writes nothing else.

    Raises:
        TypeError, ValueError: naming the argument, before anything is launched: rows out of range,
            a length outside ``[0, L]`` or differing between a row's heads, a ring that does not fit
            the rows, a ring with offsets without ``rand_seed``, weights of another shape or dtype.
    """
    rows, length = _checked(tensors, ring, rows, rotate_pairwise)
    if not runs_kernel(tensors.state):
        return materialize(tensors, ring, rows, rotate_pairwise=rotate_pairwise)
    current, launches = _flush_form(tensors, ring, rows, length, rotate_pairwise)
    for launch in launches:
        kernel_for(launch.spec, launch.tensors.x)(*kernel_arguments(launch.tensors, launch.ring))
    return current


def flush_form(tensors: StepTensors, ring: Ring, rows, *, rotate_pairwise: bool = False) -> tuple:
    """``(current, launches)``: copies of ``rows``' checkpoints (a :class:`Current`, which rows with
    an empty ring already hold) and the :class:`FlushLaunch` es that flush the others' rings into
    them, each validated by the replay kernel's checks, after :func:`materialize_fn`'s. Any device
    (the PTX tier runs the launches on the CPU)."""
    rows, length = _checked(tensors, ring, rows, rotate_pairwise)
    return _flush_form(tensors, ring, rows, length, rotate_pairwise)


def _checked(tensors: StepTensors, ring: Ring, rows, rotate_pairwise) -> tuple:
    """``(rows, lengths)`` after every check of a call, on both routes: the arguments' types, the rows
    and lengths (:func:`~mamba3_step.replay.check_materialize`), the pools, weights and ring."""
    check_replay_arguments(tensors, ring, 2, "materialize_fn")
    for name in _REQUIRED + _OPTIONAL:  # before the probe's lanes read their shapes and dtypes
        checks.check_is_tensor(name, getattr(tensors, name), optional=name in _OPTIONAL)
    for name, allowed in (("Bstate", KV_DTYPES), ("Xstate", X_DTYPES)):  # the lanes' dtypes
        checks.check_dtype(name, getattr(tensors, name), allowed)
    for name, letters in (("state", "P H D N"), ("xproj", "R H D"), ("angle_state", "P H S")):  # the lanes' shapes
        if getattr(tensors, name) is not None:
            checks.check_rank(name, getattr(tensors, name), letters)
    _check_rows_and_ring(tensors, ring, rotate_pairwise)
    return check_materialize(tensors, ring, rows, "materialize_fn")


def _flush_form(tensors: StepTensors, ring: Ring, rows: torch.Tensor, length: torch.Tensor,
                rotate_pairwise: bool) -> tuple:
    """:func:`flush_form` after its checks (``rows``, ``length``: int64 vectors)."""
    current = Current(*(None if t is None else t[rows].clone() for t in
                        (tensors.state, tensors.Bstate, tensors.Xstate, tensors.state_scale, tensors.angle_state)))
    L, launches = ring.B.shape[1], []
    for first, last, flush_length in flush_groups(L):
        pick = ((length >= first) & (length <= last)).nonzero().squeeze(1)
        if pick.numel():
            launches.append(_launch(tensors, ring, rows, current, pick, flush_length, rotate_pairwise))
    return current, launches


def _lanes(tensors: StepTensors, b: int) -> dict:
    """The flush form's per-lane inputs for ``b`` lanes: two drafts of zeros (A, dt, trap (b, 2, H);
    B, C (b, 2, R, H, N); x (b, 2, H, D); angle_proj (b, 2, H, S) with rotary) and ``out`` (b, 2,
    R, H, D)."""
    P, H, D, N = tensors.state.shape
    R, T, dev = tensors.xproj.shape[0], FLUSH_DRAFTS, tensors.state.device

    def zeros(shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=dev)

    lane = dict(A=zeros((b, T, H), torch.float32), dt=zeros((b, T, H), torch.float32),
                trap=zeros((b, T, H), torch.float32), B=zeros((b, T, R, H, N), tensors.Bstate.dtype),
                C=zeros((b, T, R, H, N), tensors.Bstate.dtype), x=zeros((b, T, H, D), tensors.Xstate.dtype),
                out=zeros((b, T, R, H, D), tensors.Xstate.dtype), num_accepted_tokens=zeros((b,), torch.int32))
    if tensors.angle_state is not None:
        lane["angle_proj"] = zeros((b, T, H, tensors.angle_state.shape[-1]), torch.float32)
    return lane


def _step(tensors: StepTensors, rows: dict, lane: dict, index: torch.Tensor) -> StepTensors:
    """The flush form's verify step on pool rows ``rows`` (state, Bstate, Xstate, state_scale,
    angle_state), lanes ``index``; the weights ``tensors``'."""
    return StepTensors(rows["state"], rows["Bstate"], rows["Xstate"], lane["A"], lane["B"], lane["C"], tensors.D,
                       lane["x"], lane["dt"], lane["trap"], tensors.xproj, out=lane["out"], state_batch_indices=index,
                       num_accepted_tokens=lane["num_accepted_tokens"], angle_state=rows["angle_state"],
                       angle_proj=lane.get("angle_proj"), B_bias=tensors.B_bias, C_bias=tensors.C_bias,
                       rand_seed=tensors.rand_seed, state_scale=rows["state_scale"])


def _check_rows_and_ring(tensors: StepTensors, ring: Ring, rotate_pairwise: bool) -> None:
    """The pools, weights and ring as the flush form reads them, by the step's and the ring's checks
    (a one-lane verify step on the pools themselves, never launched): named errors before any copy."""
    lane = _lanes(tensors, 1)
    index = torch.zeros(1, dtype=torch.int32, device=tensors.state.device)
    probe = _step(tensors, tensors._asdict(), lane, index)
    check_step_inputs(probe._replace(num_accepted_tokens=None), update_kv_state=True, rotate_pairwise=rotate_pairwise,
                      stochastic_rounding=tensors.rand_seed is not None)
    check_ring(probe._replace(num_accepted_tokens=None, x=probe.x[:, 0]), ring, 1)  # any L: the copy has the room


def _launch(tensors: StepTensors, ring: Ring, rows: torch.Tensor, current: Current, pick: torch.Tensor, flush_length: int,
            rotate_pairwise: bool) -> FlushLaunch:
    """The launch for the rows at positions ``pick`` of ``rows`` (their copies: ``current``'s rows
    ``pick``), flush length ``F``: a ring copy of ``L' = max(2, min(L, F - 1 + 16))`` entries."""
    L = ring.B.shape[1]
    entries = flush_entries(L, flush_length)
    kept = min(L, entries)
    copies = []
    for field, t in zip(Ring._fields, ring):
        if t is None or field == "length":
            copies.append(None if t is None else t[rows].clone())
            continue
        c = torch.zeros((rows.numel(), entries) + tuple(t.shape[2:]), dtype=t.dtype, device=t.device)
        c[:, :kept] = t[rows, :kept]
        copies.append(c)
    ring_copy = Ring(*copies)
    step = _step(tensors, current._asdict(), _lanes(tensors, pick.numel()), pick.to(torch.int32))
    kernel_view = step._replace(num_accepted_tokens=None)
    spec = check_step_inputs(kernel_view, update_kv_state=True, rotate_pairwise=rotate_pairwise,
                             stochastic_rounding=tensors.rand_seed is not None)
    spec = checked_replay_spec(spec.replace(num_accepted=True), kernel_view, step, ring_copy, flush_length, who="materialize_fn")
    return FlushLaunch(spec, step, ring_copy)
