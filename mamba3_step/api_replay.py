"""Replay's entry point: :func:`replay_step_fn`, one step of a pool kept as checkpoints and rings.

CUDA tensors run the step kernel's replay specialisation (``StepSpec.replay_ring``: one launch
replays each row's committed ring tokens in registers, steps this token, or a verify step's drafts,
and writes the state every K-th token, else appends to the ring); CPU tensors run
:func:`mamba3_step.replay.replay_step` with ``exact_outputs=True``, the kernel's rule. While
``torch.compile`` traces it, a call is one ``torch.ops.mamba3_step.replay_step``
(:func:`replay_through_op`). docs/contract.md, "Replay".

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank;
K the flush length, L the ring's entries.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import torch

from .api import runs_kernel
from .launch import kernel_for
from .replay import Ring, check_replay_arguments, check_ring, replay_step
from .ring import check_accepted
from .signature import OP_ORDER, StepOptions
from .spec import MAX_TOKENS, StepSpec, replay_problem
from .tensors import RING_FIELDS, StepTensors, kernel_arguments, ring_arguments
from .tiling import tiling_problem
from .validation import check_step_inputs_cached, checks
from .validation.cache import tensor_signature
from .validation.step import check_tiling_options

__all__ = ["REPLAY_OP_ORDER", "check_accepted", "checked_replay_spec", "replay_kernel_spec", "replay_step_fn",
           "replay_through_op"]


def replay_step_fn(tensors: StepTensors, ring: Ring, K: int, *, accepted: Optional[torch.Tensor] = None,
                   rotate_pairwise: bool = False, from_checkpoint: bool = False, tile_D: Optional[int] = None,
                   num_warps: Optional[int] = None) -> torch.Tensor:
    """One decode step with replay and flush length ``K``; returns ``out`` (allocated when None).

    ``tensors`` is a pool-mode step with ``update_kv_state`` semantics (``state`` the checkpoints,
    ``Bstate``/``Xstate`` the tokens before the rings), one token per lane or T drafts (a verify
    step: x (B, T, H, D), the drafts kept in the ring uncommitted), ``ring`` the layer's
    :class:`~mamba3_step.replay.Ring`; ``accepted`` (B,) int32 first commits that many of each
    lane's pending drafts. On CUDA: the replay kernel (what it takes: :func:`replay_kernel_spec`),
    on the current stream, no allocation but ``out``, no synchronisation, so a CUDA graph can
    capture it (the ring lengths move on the device); it takes destinations, the rotary angle,
    stochastic rounding and 8-bit states. On CPU: the CPU path. Every ``out`` is stepwise
    decoding's, bit for bit, on both; with ``from_checkpoint`` an append's ``out`` comes from the
    checkpoint and the ring instead (docs/design.md, "Replay": no state update; the step's accuracy
    rule), a flush's is still stepwise decoding's, and a verify step's drafts (no rotary on CUDA)
    come from the checkpoint (a flush's, or the row's) and the ring tokens since, none stepped.

    Raises:
        TypeError, ValueError: invalid inputs, naming the argument; on CUDA also what the replay
            kernel does not take yet.
    """
    if torch.compiler.is_compiling():  # one call of torch.ops.mamba3_step.replay_step, checked in its fake
        return replay_through_op(tensors, ring, K, accepted=accepted, rotate_pairwise=rotate_pairwise,
                                 from_checkpoint=from_checkpoint, tile_D=tile_D, num_warps=num_warps)
    check_replay_arguments(tensors, ring, K, "replay_step_fn", from_checkpoint)
    if not runs_kernel(tensors.x):  # the CPU path checks the rest itself
        return replay_step(tensors, ring, K, accepted=accepted, rotate_pairwise=rotate_pairwise,
                           exact_outputs=not from_checkpoint)
    spec = _kernel_spec(tensors, ring, K, accepted, rotate_pairwise, from_checkpoint, tile_D, num_warps)
    t = tensors.with_out()
    out = t.out
    t = t.one_token_squeezed()._replace(num_accepted_tokens=accepted)  # replay's kernel reads it there
    if t.batch:
        kernel_for(spec, t.x)(*kernel_arguments(t, ring))
    return out


def _replay_op_order() -> tuple:
    step = OP_ORDER[:-len(StepOptions._fields)]
    cut = step.index("out") + 1
    ring = tuple(f"ring_{f}" for f in Ring._fields)
    optional = tuple(f"ring_{f}" for f in Ring._field_defaults)
    return (step[:cut] + tuple(r for r in ring if r not in optional) + ("K",) + step[cut:] + optional
            + ("accepted", "rotate_pairwise", "from_checkpoint", "tile_D", "num_warps"))


#: ``mamba3_step::replay_step``'s arguments (mamba3_step.ops_replay), the required ones first: the step
#: op's required tensors and ``out``, the ring's required fields as ``ring_<field>`` and ``K``; then the
#: step op's optional tensors, the ring's optional fields, and replay's options
REPLAY_OP_ORDER = _replay_op_order()


def replay_through_op(tensors: StepTensors, ring: Ring, K: int, *, accepted: Optional[torch.Tensor] = None,
                      rotate_pairwise: bool = False, from_checkpoint: bool = False, tile_D: Optional[int] = None,
                      num_warps: Optional[int] = None) -> torch.Tensor:
    """The replay step as one call of ``torch.ops.mamba3_step.replay_step`` (what a tracer records;
    registered by :mod:`mamba3_step.ops_replay`); returns ``out``, allocated when None. Arguments by
    position, in :data:`REPLAY_OP_ORDER`."""
    t = tensors.with_out()
    call = {**t._asdict(), **{f"ring_{f}": v for f, v in zip(Ring._fields, ring)}, "K": K, "accepted": accepted,
            "rotate_pairwise": rotate_pairwise, "from_checkpoint": from_checkpoint, "tile_D": tile_D,
            "num_warps": num_warps}
    torch.ops.mamba3_step.replay_step(*[call[name] for name in REPLAY_OP_ORDER])
    return t.out


def replay_kernel_spec(tensors: StepTensors, ring: Ring, K: int, *, accepted: Optional[torch.Tensor] = None,
                       rotate_pairwise: bool = False, from_checkpoint: bool = False, tile_D: Optional[int] = None,
                       num_warps: Optional[int] = None) -> StepSpec:
    """The replay kernel's specialisation for a call, after every check: the step's (with
    ``update_kv_state``), the ring's (:func:`mamba3_step.replay.check_ring`; its tensors written in
    place, disjoint from each other and from every argument), and what the kernel takes
    (:func:`mamba3_step.spec.replay_problem`). Runs on any device (no GPU needed to validate).

    Raises:
        TypeError, ValueError: as :func:`replay_step_fn`.
    """
    check_replay_arguments(tensors, ring, K, "replay_step_fn", from_checkpoint)
    return _kernel_spec(tensors, ring, K, accepted, rotate_pairwise, from_checkpoint, tile_D, num_warps)


def _kernel_spec(tensors: StepTensors, ring: Ring, K, accepted, rotate_pairwise, from_checkpoint, tile_D,
                 num_warps) -> StepSpec:
    """:func:`replay_kernel_spec` after :func:`check_replay_arguments` (which ``replay_step_fn`` has run)."""
    step_spec = check_step_inputs_cached(tensors, update_kv_state=True, rotate_pairwise=rotate_pairwise,
                                         stochastic_rounding=tensors.rand_seed is not None)
    if accepted is not None:
        check_accepted(tensors, accepted)
        step_spec = step_spec.replace(num_accepted=True)
    # the kernel reads accepted as num_accepted_tokens: checked there against the ring like any argument
    read = tensors if accepted is None else tensors._replace(num_accepted_tokens=accepted)
    key = _ring_key(step_spec, tensors, ring, K, from_checkpoint, tile_D, num_warps)
    checked = _RING_CHECKS.get(key) if key is not None else None
    if checked is not None and _disjoint_from_step(checked.spans, read):
        return checked.spec
    spec = checked_replay_spec(step_spec, tensors, read, ring, K, from_checkpoint, tile_D, num_warps)
    if key is not None:
        _remember(key, _CheckedRing(spec, _ring_spans(ring)))
    return spec


def checked_replay_spec(step_spec: StepSpec, tensors: StepTensors, read: StepTensors, ring: Ring, K: int,
                        from_checkpoint: bool = False, tile_D=None, num_warps=None) -> StepSpec:
    """The ring's checks and the replay kernel's, after the step's (``step_spec``): the specialisation
    with flush length ``K``, or the named error. ``read``: ``tensors`` as the kernel reads them (with
    ``accepted``), which no ring byte may be. ``K`` is not range-checked here (``replay_step_fn``'s
    is in [2, 16]; :mod:`mamba3_step.materialize`'s flush form is a verify step with ``K = 1``)."""
    check_ring(tensors, ring, K)
    _check_ring_memory(read, ring)
    tile_D, num_warps = check_tiling_options(tile_D, num_warps)
    spec = step_spec.replace(replay_ring=K, replay_from_checkpoint=from_checkpoint, tile_D=tile_D or 0,
                             num_warps=num_warps or 0, replay_draft=_ring_draft(step_spec, ring, K))
    problem = replay_problem(spec)
    if problem is None:
        spec = spec.with_default_tiling()
        problem = replay_problem(spec) or tiling_problem(spec)
    if problem is not None:
        raise ValueError(f"replay_step_fn: the replay kernel: {problem}")
    return spec


def _ring_draft(step_spec: StepSpec, ring: Ring, K: int) -> int:
    """``StepSpec.replay_draft`` of a step that commits drafts (``num_accepted``): the ring's draft
    room when it exceeds what the step itself needs (T drafts, none for one token), else 0."""
    if not step_spec.num_accepted:
        return 0
    room = ring.B.shape[1] - (K - 1)
    if room > MAX_TOKENS:
        raise ValueError(f"ring: the replay kernel commits drafts of rings of at most K - 1 + {MAX_TOKENS} = "
                         f"{K - 1 + MAX_TOKENS} entries (new_ring(..., draft <= {MAX_TOKENS})), got {ring.B.shape[1]}")
    return room if room > step_spec.draft_need else 0


# --------------------------------------------------------------------------- checked rings
# A server calls replay_kernel_spec with the same ring (same tensors, same addresses) every step;
# only the lane inputs move. What checked_replay_spec reads of the ring, beyond the step's own (cached)
# validation, is the ring tensors' metadata and addresses, K and the options, the step's
# specialisation (which tensors the step names, T, S), the state's shape, whether x has a token
# axis, and whether inference mode is on: all of it is the key below. The one check that also reads the lane inputs'
# addresses, that no ring byte is another argument's, runs on every call (_disjoint_from_step);
# when it fails the full check runs and raises its named error. Failures are never kept.


class _CheckedRing(NamedTuple):
    spec: StepSpec  # the replay specialisation checked_replay_spec returned
    spans: tuple  # the written ring tensors' byte spans [first, end), the empty ones left out


#: at most this many checked (ring, call signature) pairs are kept; the table is cleared when full
_RING_CHECKS_MAX = 64
_RING_CHECKS: dict = {}
_RING_CHECKS_LOCK = threading.Lock()
#: the option types a key may hold (anything else goes to the full check, uncached)
_KEY_OPTION_TYPES = (int, bool, type(None))


def _ring_key(step_spec: StepSpec, t: StepTensors, ring, K, from_checkpoint, tile_D, num_warps):
    """What :func:`checked_replay_spec` reads besides the lane inputs' addresses, or None when the call is
    not one to cache (not a :class:`Ring` of plain tensors, or a step on meta or fake tensors)."""
    if type(ring) is not Ring or type(t.x) is not torch.Tensor or t.x.is_meta:
        return None
    if any(type(v) not in _KEY_OPTION_TYPES for v in (K, from_checkpoint, tile_D, num_warps)):
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
    return (step_spec, tuple(t.state.shape), t.state.device, t.x.dim(), tuple(fields),
            K, type(K), from_checkpoint, type(from_checkpoint), tile_D, type(tile_D), num_warps, type(num_warps),
            torch.is_inference_mode_enabled())


def _remember(key, checked: _CheckedRing) -> None:
    with _RING_CHECKS_LOCK:
        if len(_RING_CHECKS) >= _RING_CHECKS_MAX:
            _RING_CHECKS.clear()
        _RING_CHECKS[key] = checked


def _ring_spans(ring: Ring) -> tuple:
    spans = (checks.byte_span(v) for v in _written_ring(ring).values())
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


def _written_ring(ring: Ring) -> dict:
    """The ring tensors the kernel writes, by argument name (:data:`RING_FIELDS`; the angles with rotary,
    the draws' offsets and rows with stochastic rounding)."""
    return {name: value for name, value in zip(RING_FIELDS, ring_arguments(ring)) if value is not None}


def _check_ring_memory(t: StepTensors, ring: Ring) -> None:
    """The ring's tensors are written in place: writable, unit innermost stride, 32-bit inner offsets,
    no element sharing memory, no byte shared with another ring tensor or any argument."""
    written = _written_ring(ring)
    inference_mode = torch.is_inference_mode_enabled()
    for name, value in written.items():
        checks.check_write_target(name, value, inference_mode)
        checks.check_unit_inner_stride(name, value)
        checks.check_inner_offsets_int32(name, value)
        checks.check_no_internal_overlap(name, value)
    # check_ring refused a step's own num_accepted_tokens: here it is replay_step_fn's accepted
    others = {("accepted" if name == "num_accepted_tokens" else name): value for name, value in t._asdict().items()
              if isinstance(value, torch.Tensor)}
    for name, value in written.items():
        span = checks.byte_span(value)
        for other, other_value in {**others, **written}.items():
            if other != name:
                checks.check_disjoint(name, span, other, checks.byte_span(other_value), other in written)
