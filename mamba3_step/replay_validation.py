"""What a step with a replay ring checks before anything runs, on every device: :func:`check_replay_inputs`.

The CPU path and the kernel path of :func:`mamba3_step.mamba3_step_fn` (and ``plan_step``, the
custom op and its fake, ``serving.decode_step`` on a replay pool) call the same function, so a call
the kernel path refuses is refused on the CPU with the same named error, before the first write.
docs/contract.md, "Replay".

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank;
L the ring's entries. The flush length is ``replay_flush_length``.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from .ring import check_accepted, check_replay_arguments, check_ring
from .spec import MAX_TOKENS, StepSpec, replay_problem
from .tensors import RING_FIELDS, Ring, StepTensors, ring_arguments
from .tiling import tiling_problem
from .validation import check_step_inputs_cached, checks
from .validation.cache import tensor_signature
from .validation.step import check_tiling_options

__all__ = ["check_replay_inputs", "checked_replay_spec", "is_replay_call"]


def is_replay_call(tensors: StepTensors, options) -> bool:
    """Whether a call names the replay mode: ``replay_ring`` given, or a replay option set (a call
    that sets an option without the ring is refused by :func:`check_replay_inputs`, by name)."""
    return (tensors.replay_ring is not None or options.replay_flush_length is not None
            or options.replay_from_checkpoint is not False)


def check_replay_inputs(tensors: StepTensors, options, who: str = "mamba3_step_fn") -> StepSpec:
    """Every check of a replay step, in this order, before anything is written: the replay arguments'
    kinds (``replay_ring`` a :class:`~mamba3_step.tensors.Ring` of strided tensors,
    ``replay_flush_length`` an integer in [2, 16], ``replay_from_checkpoint`` a bool), ``update_kv_state``
    True, the step's checks (:func:`mamba3_step.validation.check_step_inputs`, without
    ``num_accepted_tokens``, which replay reads as drafts to commit), ``num_accepted_tokens`` (B,) int32,
    the ring against the step (:func:`mamba3_step.ring.check_ring`), the ring's memory (written in
    place: writable here, unit inner stride, no element or byte shared with another ring tensor or any
    argument), ``tile_D``/``num_warps``, then what the replay kernel takes
    (:func:`mamba3_step.spec.replay_problem`). ``options`` is a
    :class:`~mamba3_step.signature.StepOptions`. Returns the replay specialisation at its tiling:
    what the kernel path compiles, on any device.

    Raises:
        TypeError, ValueError: naming the argument (``who`` the entry point).
    """
    ring, flush_length = tensors.replay_ring, options.replay_flush_length
    if ring is None:
        name = "replay_flush_length" if flush_length is not None else "replay_from_checkpoint"
        raise ValueError(f"{name}: expected {'None' if name == 'replay_flush_length' else 'False'} without "
                         f"replay_ring (a replay option needs the ring it replays), got "
                         f"{flush_length if name == 'replay_flush_length' else options.replay_from_checkpoint!r}")
    flush_length = checks.check_int_option("replay_flush_length", flush_length)  # a numpy integer: its int
    check_replay_arguments(tensors, ring, flush_length, who, options.replay_from_checkpoint)
    if checks.check_bool_option("update_kv_state", options.update_kv_state) is not True:
        raise ValueError("update_kv_state: expected True with replay_ring (a replay step stores its token's B and x: "
                         "in the ring, or in Bstate/Xstate at a flush), got False")
    accepted = tensors.num_accepted_tokens
    step = tensors if accepted is None else tensors._replace(num_accepted_tokens=None)
    step_spec = check_step_inputs_cached(step, update_kv_state=True, rotate_pairwise=options.rotate_pairwise,
                                         stochastic_rounding=options.stochastic_rounding)
    if accepted is not None:
        check_accepted(step, accepted, "num_accepted_tokens")
        step_spec = step_spec.replace(num_accepted=True)
    key = _ring_key(step_spec, tensors, ring, flush_length, options)
    checked = _RING_CHECKS.get(key) if key is not None else None
    if checked is not None and _disjoint_from_step(checked.spans, tensors):
        return checked.spec
    spec = checked_replay_spec(step_spec, step, tensors, ring, flush_length, options.replay_from_checkpoint,
                               options.tile_D, options.num_warps, who)
    if key is not None:
        _remember(key, _CheckedRing(spec, _ring_spans(ring)))
    return spec


def checked_replay_spec(step_spec: StepSpec, tensors: StepTensors, read: StepTensors, ring: Ring, flush_length: int,
                        from_checkpoint: bool = False, tile_D=None, num_warps=None,
                        who: str = "mamba3_step_fn") -> StepSpec:
    """The ring's checks and the replay kernel's, after the step's (``step_spec``): the specialisation
    with ``replay_ring = flush_length``, or the named error. ``tensors``: the step without
    ``num_accepted_tokens``; ``read``: the step as the kernel reads it (with them), which no ring byte
    may be. ``flush_length`` is not range-checked here (:func:`check_replay_inputs`' is in [2, 16];
    :mod:`mamba3_step.materialize`'s flush form is a verify step with a flush length of 1)."""
    check_ring(tensors, ring, flush_length)
    _check_ring_memory(read, ring)
    tile_D, num_warps = check_tiling_options(tile_D, num_warps)
    spec = step_spec.replace(replay_ring=flush_length, replay_from_checkpoint=from_checkpoint, tile_D=tile_D or 0,
                             num_warps=num_warps or 0, replay_draft=_ring_draft(step_spec, ring, flush_length))
    problem = replay_problem(spec)
    if problem is None:
        spec = spec.with_default_tiling()
        problem = replay_problem(spec) or tiling_problem(spec)
    if problem is not None:
        raise ValueError(f"{who}: replay_ring: {problem}")
    return spec


def _ring_draft(step_spec: StepSpec, ring: Ring, flush_length: int) -> int:
    """``StepSpec.replay_draft`` of a step that commits drafts (``num_accepted``): the ring's draft
    room when it exceeds what the step itself needs (T drafts, none for one token), else 0."""
    if not step_spec.num_accepted:
        return 0
    room = ring.B.shape[1] - (flush_length - 1)
    if room > MAX_TOKENS:
        raise ValueError(f"replay_ring: drafts are committed in rings of at most replay_flush_length - 1 + "
                         f"{MAX_TOKENS} = {flush_length - 1 + MAX_TOKENS} entries (new_ring(..., draft <= "
                         f"{MAX_TOKENS})), got {ring.B.shape[1]}")
    return room if room > step_spec.draft_need else 0


# --------------------------------------------------------------------------- checked rings
# A server passes the same ring (same tensors, same addresses) every step; only the lane inputs move.
# What checked_replay_spec reads of the ring, beyond the step's own (cached) validation, is the ring
# tensors' metadata and addresses, the flush length and the options, the step's specialisation (which
# tensors the step names, T, S), the state's shape, whether x has a token axis, and whether inference
# mode is on: all of it is the key below. The one check that also reads the lane inputs' addresses,
# that no ring byte is another argument's, runs on every call (_disjoint_from_step); when it fails the
# full check runs and raises its named error. Failures are never kept.


class _CheckedRing(NamedTuple):
    spec: StepSpec  # the replay specialisation checked_replay_spec returned
    spans: tuple  # the written ring tensors' byte spans [first, end), the empty ones left out


#: at most this many checked (ring, call signature) pairs are kept; the table is cleared when full
_RING_CHECKS_MAX = 64
_RING_CHECKS: dict = {}
_RING_CHECKS_LOCK = threading.Lock()
#: the option types a key may hold (anything else goes to the full check, uncached)
_KEY_OPTION_TYPES = (int, bool, type(None))


def _ring_key(step_spec: StepSpec, t: StepTensors, ring, flush_length, options):
    """What :func:`checked_replay_spec` reads besides the lane inputs' addresses, or None when the call is
    not one to cache (not a :class:`Ring` of plain tensors, or a step on meta or fake tensors)."""
    if type(ring) is not Ring or type(t.x) is not torch.Tensor or t.x.is_meta:
        return None
    scalars = (flush_length, options.replay_from_checkpoint, options.tile_D, options.num_warps)
    if any(type(v) not in _KEY_OPTION_TYPES for v in scalars):
        return None  # e.g. a list: unhashable; the full check names what is wrong with it
    fields = []
    for value in ring:
        if value is None:
            fields.append(None)
        elif type(value) is not torch.Tensor:
            return None
        else:
            fields.append((tensor_signature(value), value.data_ptr()))
    # which tensors the step names, T, S and the angle pool's shape are the step's specialisation's
    # (validated against the state's); the pool size P and a one-token step's token axis are not
    return (step_spec, tuple(t.state.shape), t.state.device, t.x.dim(), tuple(fields), scalars,
            tuple(type(v) for v in scalars), torch.is_inference_mode_enabled())


def _remember(key, checked: _CheckedRing) -> None:
    with _RING_CHECKS_LOCK:
        if len(_RING_CHECKS) >= _RING_CHECKS_MAX:
            _RING_CHECKS.clear()
        _RING_CHECKS[key] = checked


def _ring_spans(ring: Ring) -> tuple:
    spans = (checks.byte_span(v) for v in written_ring(ring).values())
    return tuple(span for span in spans if span is not None)


def _disjoint_from_step(spans: tuple, t: StepTensors) -> bool:
    """True when no byte of ``spans`` (the written ring tensors) is a byte of a tensor argument of ``t``;
    False also for an argument it cannot place (then the full check decides). The spans are
    :func:`checks.byte_span`'s, computed inline for plain tensors: this runs on every call, and the
    general helper's checks for meta and fake tensors doubled the call's cost (20 -> 35 us)."""
    for value in t:
        if type(value) is not torch.Tensor:
            if isinstance(value, torch.Tensor):
                return False  # a subclass: the full check's byte_span knows how to read it
            continue
        if value.is_contiguous():
            n = value.numel()
            if n == 0:
                continue
            first = value.data_ptr()
            end = first + n * value.element_size()
        else:
            span = checks.byte_span(value)
            if span is None:
                continue
            first, end = span
        for lo, hi in spans:
            if first < hi and lo < end:
                return False
    return True


def written_ring(ring: Ring) -> dict:
    """The ring tensors a replay step writes, by argument name (:data:`RING_FIELDS`; the angles with
    rotary, the draws' offsets and rows with stochastic rounding)."""
    return {name: value for name, value in zip(RING_FIELDS, ring_arguments(ring)) if value is not None}


def _check_ring_memory(t: StepTensors, ring: Ring) -> None:
    """The ring's tensors are written in place: writable, unit innermost stride, 32-bit inner offsets,
    no element sharing memory, no byte shared with another ring tensor or any argument."""
    written = written_ring(ring)
    inference_mode = torch.is_inference_mode_enabled()
    for name, value in written.items():
        checks.check_write_target(name, value, inference_mode)
        checks.check_unit_inner_stride(name, value)
        checks.check_inner_offsets_int32(name, value)
        checks.check_no_internal_overlap(name, value)
    others = {name: value for name, value in t._asdict().items() if isinstance(value, torch.Tensor)}
    for name, value in written.items():
        span = checks.byte_span(value)
        for other, other_value in {**others, **written}.items():
            if other != name:
                checks.check_disjoint(name, span, other, checks.byte_span(other_value), other in written)
