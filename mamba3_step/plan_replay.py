"""Plan once, run many, for replay: :func:`plan_replay_step` validates a replay call signature once;
:meth:`ReplayStepPlan.run` checks only what can change between a server's steps and then does
exactly what :func:`mamba3_step.replay_step_fn` does.

Letters (docs/contract.md): B lanes, T tokens, P pool rows, H heads, D head dim, N state size,
R MIMO rank; K the flush length, L the ring's entries.

::

    plan = plan_replay_step(tensors, ring, K, accepted=accepted)   # replay_step_fn's arguments: validated in full
    ...
    out = plan.run(tensors, ring, accepted=accepted)               # every step (the options are the plan's)

The planned signature is :class:`mamba3_step.plan.StepPlan`'s for the step's tensors (types,
shapes, strides, dtypes, device, ``requires_grad``, which are None, ``null_slot_id``, inference
mode) plus the ring's: each :class:`~mamba3_step.replay.Ring` field's signature (or None), and
whether ``accepted`` is given and its signature. ``K`` and the options (``rotate_pairwise``,
``from_checkpoint``, ``tile_D``, ``num_warps``) are the plan's. Per run, besides the step's guard,
the ring's tensors must match their planned signatures and share no byte with each other, with a
step tensor or with ``accepted`` (the kernel writes the ring; a ring aliasing an argument is
refused by name, as ``replay_step_fn`` refuses it). A call the guards do not admit is validated in
full first (bad input: ``replay_step_fn``'s named error, nothing changed); a valid call of another
signature raises :class:`~mamba3_step.plan.StepPlanMismatch` naming what changed. One plan serves
every layer whose rings and rows share the signature (a :class:`~mamba3_step.serving.ReplayStatePool`'s
layers do).

On CUDA ``run`` launches the planned kernel (no allocation but ``out``, no synchronisation: a
CUDA graph can capture it); on CPU it runs replay's CPU path (which re-validates: the CPU path is
the contract's reference, not a serving path).
"""

from __future__ import annotations

from typing import Optional

import torch

from .api import runs_kernel
from .api_replay import replay_kernel_spec
from .launch import kernel_for
from .plan import StepPlanMismatch
from .replay import Ring, check_replay_arguments, check_replay_step, replay_step
from .spec import StepSpec
from .tensors import StepTensors, kernel_arguments
from .validation import CheckedSignature, checks
from .validation.cache import ADMIT, make_guard, tensor_signature

__all__ = ["ReplayStepPlan", "plan_replay_step"]

_WRITTEN = ("B", "x", "coef", "length")  # the ring tensors the step writes: Ring's first fields
assert Ring._fields[:len(_WRITTEN)] == _WRITTEN


class ReplayStepPlan:
    """A validated replay call signature and what running it needs (the module docstring).

    Attributes:
        spec: the replay kernel's :class:`~mamba3_step.spec.StepSpec` (CUDA), or the step's
            validated spec (CPU: the CPU path runs).
        K: the flush length.
        options: ``rotate_pairwise``, ``from_checkpoint``, ``tile_D``, ``num_warps`` as planned.
    """

    __slots__ = ("spec", "K", "options", "_sig", "_inference", "_ring_present", "_ring_sigs", "_ring_guard",
                 "_accepted", "_kernel", "_extents")

    def __init__(self, tensors: StepTensors, ring: Ring, K: int, accepted: Optional[torch.Tensor] = None,
                 **options):
        check_replay_arguments(tensors, ring, K, "plan_replay_step", options.get("from_checkpoint", False))
        self.K, self.options = K, dict(options)
        self._inference = torch.is_inference_mode_enabled()
        kernel_path = runs_kernel(tensors.x)
        self.spec: StepSpec = _validated(tensors, ring, K, accepted, kernel_path, self.options)
        step_spec = self.spec.replace(replay_ring=0, replay_from_checkpoint=False, replay_draft=0, num_accepted=False)
        self._sig = CheckedSignature.from_call(step_spec, tensors)
        self._ring_present = tuple(v is not None for v in ring)
        self._ring_sigs = tuple(None if v is None else tensor_signature(v) for v in ring)
        self._accepted = None if accepted is None else tensor_signature(accepted)
        self._ring_guard = make_guard(_guarded(ring, accepted))
        # byte extents, fixed by the signatures: a run places each span from its data pointer
        self._extents = (_extents(tensors), _extents(ring[:len(_WRITTEN)]), _extents((accepted,)))
        batch = tensors.x.shape[0]
        self._kernel = kernel_for(self.spec, tensors.x) if kernel_path and batch and not tensors.x.is_meta else None

    def run(self, tensors: StepTensors, ring: Ring, accepted: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One replay step of the planned signature; returns ``out`` (allocated when None).

        Raises:
            TypeError, ValueError: bad input, exactly as ``replay_step_fn`` raises it.
            StepPlanMismatch: a valid call of another signature (the message names what changed).
        """
        if not self._admits(tensors, ring, accepted):
            self._recheck(tensors, ring, accepted)
        if self._kernel is None:
            if runs_kernel(tensors.x):  # an empty batch: nothing to launch
                return tensors.with_out().out
            return replay_step(tensors, ring, self.K, accepted=accepted,
                               rotate_pairwise=self.options.get("rotate_pairwise", False),
                               exact_outputs=not self.options.get("from_checkpoint", False))
        t = tensors.with_out()
        out = t.out
        t = t.one_token_squeezed()._replace(num_accepted_tokens=accepted)  # the kernel reads it there
        self._kernel(*kernel_arguments(t, ring))
        return out

    __call__ = run

    def _admits(self, tensors, ring, accepted) -> bool:
        """The per-run guard: the step's signature (the stepwise plan's check), the ring's and
        ``accepted``'s, and no written ring byte shared with another argument."""
        if type(tensors) is not StepTensors or type(ring) is not Ring:
            return False
        if torch.is_inference_mode_enabled() is not self._inference or self._sig.admits(tensors) != ADMIT:
            return False
        if tuple(v is not None for v in ring) != self._ring_present or (accepted is None) != (self._accepted is None):
            return False
        guarded = _guarded(ring, accepted)
        if not all(isinstance(t, torch.Tensor) and not t.is_nested for t in guarded):
            return False  # torch's guard aborts the process on a nested tensor: the full check names it
        if not self._ring_guard(*guarded):
            return False
        if not self._inference and any(t.is_inference() for t in guarded):
            return False
        return self._ring_disjoint(tensors, ring, accepted)

    def _ring_disjoint(self, tensors, ring, accepted) -> bool:
        """No byte of a written ring tensor is a byte of another written ring tensor, a step tensor
        or ``accepted``: each span placed from its data pointer and the planned extent (the
        signatures the guards admitted fix the extents)."""
        step, written, acc = self._extents
        spans = [(v.data_ptr(), e) for v, e in zip(ring, written) if e]
        if any(lo == 0 for lo, _ in spans):
            return False  # a storage freed under the ring: the full check names it
        others = [(v.data_ptr(), e) for v, e in zip(tensors, step) if e]
        if accepted is not None and acc[0]:
            others.append((accepted.data_ptr(), acc[0]))
        for k, (lo, e) in enumerate(spans):
            hi = lo + e
            for olo, oe in others:
                if olo < hi and lo < olo + oe:
                    return False
            for olo, oe in spans[k + 1:]:
                if olo < hi and lo < olo + oe:
                    return False
        return True

    def _recheck(self, tensors, ring, accepted) -> None:
        """A call the guards did not admit: full validation (``replay_step_fn``'s named error for bad
        input), then :class:`StepPlanMismatch` listing what differs from the plan."""
        check_replay_arguments(tensors, ring, self.K, "replay_step_fn", self.options.get("from_checkpoint", False))
        _validated(tensors, ring, self.K, accepted, runs_kernel(tensors.x), self.options)
        changed = self._sig.differences(tensors)
        mode = torch.is_inference_mode_enabled()
        if mode is not self._inference:
            changed.insert(0, f"torch.inference_mode: planned {'on' if self._inference else 'off'}, "
                              f"got {'on' if mode else 'off'}")
        for field, want, value in zip(Ring._fields, self._ring_sigs, ring):
            got = None if value is None else tensor_signature(value)
            if got != want:
                changed.append(f"ring.{field}: planned {_shown(want)}, got {_shown(got)}")
        got = None if accepted is None else tensor_signature(accepted)
        if got != self._accepted:
            changed.append(f"accepted: planned {_shown(self._accepted)}, got {_shown(got)}")
        if changed:
            raise StepPlanMismatch(
                "plan_replay_step: this call is valid but is not the planned signature (" + "; ".join(changed)
                + "); make a plan for it with mamba3_step.plan_replay_step(...) or call replay_step_fn")

    def __repr__(self) -> str:
        return f"ReplayStepPlan({self.spec.key()}, K={self.K})"


def plan_replay_step(tensors: StepTensors, ring: Ring, K: int, *, accepted: Optional[torch.Tensor] = None,
                     rotate_pairwise: bool = False, from_checkpoint: bool = False, tile_D: Optional[int] = None,
                     num_warps: Optional[int] = None) -> ReplayStepPlan:
    """A :class:`ReplayStepPlan` for calls with this signature: :func:`mamba3_step.replay_step_fn`'s
    arguments (shapes and meaning: its docstring and docs/contract.md, "Replay"). Everything is
    validated in full, as ``replay_step_fn`` validates it, and nothing is computed or written; on
    CUDA the replay kernel is compiled or loaded now. ``accepted`` None plans calls without it.

    Raises:
        TypeError, ValueError: what ``replay_step_fn`` raises for these arguments.
    """
    return ReplayStepPlan(tensors, ring, K, accepted, rotate_pairwise=rotate_pairwise,
                          from_checkpoint=from_checkpoint, tile_D=tile_D, num_warps=num_warps)


def _validated(tensors, ring, K, accepted, kernel_path: bool, options: dict) -> StepSpec:
    """What ``replay_step_fn`` checks before it runs: the replay kernel's specialisation on the kernel
    path, the step's and the ring's checks on the CPU path (which takes more: rotary, 8-bit ...)."""
    if kernel_path:
        return replay_kernel_spec(tensors, ring, K, accepted=accepted, **options)
    return check_replay_step(tensors, ring, K, accepted, options.get("rotate_pairwise", False), who="replay_step_fn")


def _guarded(ring: Ring, accepted) -> tuple:
    """The tensors the ring guard compares: the ring's given fields, then ``accepted`` if given."""
    return tuple(v for v in ring if v is not None) + (() if accepted is None else (accepted,))


def _extents(values) -> tuple:
    """Each value's byte extent (0: not a tensor, or empty)."""
    out = []
    for v in values:
        span = checks.byte_span(v) if isinstance(v, torch.Tensor) else None
        out.append(0 if span is None else span[1] - span[0])
    return tuple(out)


def _shown(signature) -> str:
    if signature is None:
        return "None"
    kind, shape, strides, dtype, device = signature[:5]
    return f"{kind.__qualname__} {tuple(shape)} strides {strides} {dtype} on {device}"
