"""Replay's entry point: :func:`replay_step_fn`, one step of a pool kept as checkpoints and rings.

CUDA tensors run the step kernel's replay specialisation (``StepSpec.replay_ring``: one launch
replays each row's committed ring tokens in registers, steps this token, and writes the state
every K-th token, else appends to the ring); CPU tensors run :func:`mamba3_step.replay.replay_step`
with ``exact_outputs=True``, the kernel's rule. docs/contract.md, "Replay".

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank;
K the flush length, L the ring's entries.
"""

from __future__ import annotations

from typing import Optional

import torch

from .launch import kernel_for
from .replay import Ring, check_ring, replay_step
from .spec import StepSpec, replay_problem
from .tensors import RING_FIELDS, StepTensors, kernel_arguments
from .tiling import tiling_problem
from .validation import check_step_inputs, checks

__all__ = ["replay_kernel_spec", "replay_step_fn"]


def replay_step_fn(tensors: StepTensors, ring: Ring, K: int, *, accepted: Optional[torch.Tensor] = None,
                   rotate_pairwise: bool = False, from_checkpoint: bool = False, tile_D: Optional[int] = None,
                   num_warps: Optional[int] = None) -> torch.Tensor:
    """One decode step with replay and flush length ``K``; returns ``out`` (allocated when None).

    ``tensors`` is a pool-mode step with ``update_kv_state`` semantics (``state`` the checkpoints,
    ``Bstate``/``Xstate`` the tokens before the rings), ``ring`` the layer's
    :class:`~mamba3_step.replay.Ring`. On CUDA: the replay kernel (what it takes:
    :func:`replay_kernel_spec`), on the current stream, no allocation but ``out``, no
    synchronisation, so a CUDA graph can capture it (the ring lengths move on the device). On CPU:
    the CPU path, which also takes verify steps, ``accepted``, destinations, rotary and stochastic
    rounding. Every ``out`` is stepwise decoding's, bit for bit, on both; with ``from_checkpoint`` an
    append's ``out`` comes from the checkpoint and the ring instead (docs/design.md, "Replay": no state
    update; the step's accuracy rule), a flush's is still stepwise decoding's.

    Raises:
        TypeError, ValueError: invalid inputs, naming the argument; on CUDA also what the replay
            kernel does not take yet.
    """
    if not tensors.x.is_cuda:
        return replay_step(tensors, ring, K, accepted=accepted, rotate_pairwise=rotate_pairwise,
                           exact_outputs=not from_checkpoint)
    spec = replay_kernel_spec(tensors, ring, K, accepted=accepted, rotate_pairwise=rotate_pairwise,
                              from_checkpoint=from_checkpoint, tile_D=tile_D, num_warps=num_warps)
    t = tensors.with_out()
    out = t.out
    t = t.one_token_squeezed()
    if t.batch:
        kernel_for(spec, t.x)(*kernel_arguments(t, ring))
    return out


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
    if accepted is not None:
        raise ValueError("replay_step_fn: accepted (committing a verify step's drafts) is taken by the CPU path "
                         "only so far; the replay kernel runs one-token plain steps")
    spec = check_step_inputs(tensors, update_kv_state=True, rotate_pairwise=rotate_pairwise,
                             stochastic_rounding=tensors.rand_seed is not None)
    check_ring(tensors, ring, K)
    _check_ring_memory(tensors, ring)
    if type(from_checkpoint) is not bool:
        raise TypeError(f"replay_step_fn: from_checkpoint must be a bool, got {type(from_checkpoint).__name__}")
    spec = spec.replace(replay_ring=K, replay_from_checkpoint=from_checkpoint, tile_D=tile_D or 0,
                        num_warps=num_warps or 0)
    problem = replay_problem(spec)
    if problem is None:
        spec = spec.with_default_tiling()
        problem = replay_problem(spec) or tiling_problem(spec)
    if problem is not None:
        raise ValueError(f"replay_step_fn: the replay kernel: {problem}")
    return spec


def _check_ring_memory(t: StepTensors, ring: Ring) -> None:
    """The ring's tensors are written in place: writable, unit innermost stride, 32-bit inner offsets,
    no element sharing memory, no byte shared with another ring tensor or any argument."""
    written = dict(zip(RING_FIELDS, (ring.B, ring.x, ring.coef, ring.length)))
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
