"""Plan once, run many: the step for servers, validated once per call signature.

Letters (docs/contract.md): B lanes, T tokens, P pool rows, H heads, D head dim, N state size,
R MIMO rank, K candidate source rows.

::

    plan = plan_step(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, out=out,
                     z=z, zproj=zproj, state_batch_indices=slots, null_slot_id=0,
                     update_kv_state=True)              # mamba3_step_fn's arguments: validated in full
    ...
    out = plan.run(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, out=out,
                   z=z, zproj=zproj, state_batch_indices=slots, null_slot_id=0)   # every step

:func:`plan_step` takes a call's arguments (a first step's tensors, or any tensors of the same
shapes, strides, dtypes and device), validates them as :func:`mamba3_step.mamba3_step_fn` does and
keeps the result as a :class:`~mamba3_step.validation.CheckedSignature`; on CUDA it also fetches
the compiled kernel (compiling or loading it now, not during serving). :meth:`StepPlan.run` takes
the tensor arguments again (the options are the plan's) and does, per call, only what can change
between a server's steps: a guard that every tensor still has the planned type, shape, strides,
dtype, device and ``requires_grad`` (and the planned arguments are None), that no written tensor
is an inference tensor outside inference mode, that ``state``/``state_out`` start on 16 bytes and
that no written tensor shares a byte with another argument (all of it one call of the C check
where ``setup.py`` built it; what that costs: docs/performance.md, "Host overhead"). Then it launches the kernel (or runs
the PyTorch path for CPU tensors) exactly as ``mamba3_step_fn`` would.

A replay plan (``replay_ring`` given: the step's replay mode, docs/contract.md, "Replay") is the
same plan: validated by :func:`mamba3_step.replay_validation.check_replay_inputs`, its ``spec`` the
replay specialisation, its flush length and ``replay_from_checkpoint`` among the plan's options;
each ``run`` takes ``replay_ring`` again, and besides the step's guard checks the ring's fields'
signatures and that no written ring byte is another argument's (:class:`~mamba3_step.ring_guard.RingGuard`).
One plan serves every layer whose rings and rows share the signature.

A call the guard does not admit is validated in full first, so bad input gets exactly
``mamba3_step_fn``'s named TypeError/ValueError and changes nothing. A *valid* call of another
signature (another B, another ``null_slot_id``, a tensor with other strides, a different
``torch.inference_mode`` state ...) raises :class:`StepPlanMismatch` (a ValueError) naming every
argument that changed, planned vs got: a plan never falls back silently to the slow path. Make
one plan per signature (per batch size, for instance); a signature shared by all the layers of
a model needs one plan for all of them.

``run`` allocates nothing but ``out`` when the plan was made without one (as ``mamba3_step_fn``
does) and never synchronises (unless the plan was made with ``validate_indices=True``, the debug
check, which synchronises and refuses CUDA-graph capture as ``mamba3_step_fn`` does), so it can
be captured in a CUDA graph. A plan is immutable: threads may share it. Plans are for eager
serving loops; under ``torch.compile`` call ``mamba3_step_fn`` (it becomes the custom op).
"""

from __future__ import annotations


import torch

from .api import check_index_values, host_step, runs_kernel
from .contract import new_out, out_shape
from .launch import kernel_for
from .replay_validation import check_replay_inputs, is_replay_call
from .ring_guard import RingGuard
from .spec import StepSpec
from .signature import STEP_SIGNATURE, StepOptions, make_binder, split_call, validated_options
from .tensors import Ring, StepTensors, kernel_arguments
from .validation import CheckedSignature, check_options, check_step_inputs
from .validation.cache import ADMIT

__all__ = ["StepPlan", "StepPlanMismatch", "plan_step"]

_OUT = StepTensors._fields.index("out")
_bind_plan = make_binder("plan_step", STEP_SIGNATURE)
_X = StepTensors._fields.index("x")
_RING = StepTensors._fields.index("replay_ring")
#: the options a plan reports (:attr:`StepPlan.options`), besides validate_indices
_REPORTED = ("update_kv_state", "tile_D", "num_warps", "rotate_pairwise", "stochastic_rounding",
             "replay_flush_length", "replay_from_checkpoint")


class StepPlanMismatch(ValueError):
    """A valid call whose signature is not the plan's; the message names what changed."""


class StepPlan:
    """A validated call signature and what running it needs (see the module docstring).

    Attributes:
        spec: the :class:`~mamba3_step.spec.StepSpec` the planned calls compile to (a replay
            plan's: the replay specialisation, on every device).
        options: ``update_kv_state``, ``tile_D``, ``num_warps``, ``rotate_pairwise``,
            ``stochastic_rounding``, ``replay_flush_length``, ``replay_from_checkpoint``,
            ``validate_indices`` as planned.
    """

    __slots__ = ("spec", "options", "_options", "_sig", "_ring", "_inference", "_out_shape", "_trivial",
                 "_kernel", "_null", "_fast", "_validate_indices")

    def __init__(self, tensors: StepTensors, options: StepOptions = StepOptions()):
        validate_indices = check_options(validate_indices=options.validate_indices)["validate_indices"]
        if is_replay_call(tensors, options):
            spec = check_replay_inputs(tensors, options, "plan_step")
        else:
            spec = check_step_inputs(tensors, **validated_options(options))
        opts = check_options(**{name: getattr(options, name) for name in _REPORTED})
        self.spec: StepSpec = spec
        self.options = {**{name: opts[name] for name in _REPORTED}, "validate_indices": validate_indices}
        self._options = StepOptions(**self.options)
        self._sig = CheckedSignature.from_call(spec, tensors)
        # a replay plan's ring: its signature, guarded per run (None: a stepwise plan, whose runs take no ring)
        self._ring = None if tensors.replay_ring is None else RingGuard(tensors)
        self._inference = torch.is_inference_mode_enabled()
        x = tensors.x
        self._out_shape = torch.Size(out_shape(x, tensors.xproj, tensors.outproj is not None))
        self._trivial = x.shape[0] == 0 or x.is_meta
        self._validate_indices = validate_indices
        if validate_indices and tensors.pool and x.is_meta:
            check_index_values(tensors)  # raises: meta tensors hold no index values
        self._null = -1 if tensors.null_slot_id is None else int(tensors.null_slot_id)
        self._kernel = kernel_for(spec, x) if not self._trivial and runs_kernel(x) else None
        one_token_axis = x.dim() == 4 and x.shape[1] == 1
        self._fast = self._kernel is not None and not one_token_axis and not validate_indices

    def run(self, state: torch.Tensor, Bstate: torch.Tensor, Xstate: torch.Tensor, A: torch.Tensor,
            B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
            trap: torch.Tensor, xproj: torch.Tensor, outproj: torch.Tensor | None = None,
            state_out: torch.Tensor | None = None, out: torch.Tensor | None = None, z: torch.Tensor | None = None,
            zproj: torch.Tensor | None = None, *, state_batch_indices: torch.Tensor | None = None,
            dst_state_batch_indices: torch.Tensor | None = None, null_slot_id: int | None = None,
            num_accepted_tokens: torch.Tensor | None = None, angle_state: torch.Tensor | None = None,
            angle_proj: torch.Tensor | None = None, B_bias: torch.Tensor | None = None,
            C_bias: torch.Tensor | None = None, rand_seed: torch.Tensor | None = None,
            rand_rows: torch.Tensor | None = None, state_scale: torch.Tensor | None = None,
            replay_ring: Ring | None = None) -> torch.Tensor:
        """One step of the planned signature: ``mamba3_step_fn``'s tensor arguments (shapes: its
        docstring; ``replay_ring`` for a replay plan), without its options. Returns ``out``
        (allocated when None, like ``mamba3_step_fn``). The parameters are written out (the per-step
        path binds no call; tests/contract/test_declaration.py holds them to the declaration).

        Raises:
            TypeError, ValueError: bad input, exactly as ``mamba3_step_fn`` raises it.
            StepPlanMismatch: a valid call of another signature (the message names what changed).
        """
        call = (state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj,
                state_batch_indices, dst_state_batch_indices, null_slot_id, num_accepted_tokens, angle_state,
                angle_proj, B_bias, C_bias, rand_seed, rand_rows, state_scale, replay_ring)
        out = call[_OUT]
        if (torch.is_inference_mode_enabled() is not self._inference or self._sig.admits(call) != ADMIT
                or (call[_RING] is not None if self._ring is None else not self._ring.admits(call))):
            self._recheck(call)
        if out is None:
            out = new_out(call[_X], self._out_shape)
            call = call[:_OUT] + (out,) + call[_OUT + 1:]
        if self._fast:
            self._kernel(*kernel_arguments(call))
            return out
        return self._execute(call, out)

    __call__ = run

    def _execute(self, call: tuple, out: torch.Tensor) -> torch.Tensor:
        """What ``mamba3_step_fn`` does after its validation, for an admitted call with ``out``."""
        tensors = StepTensors(*call)
        if tensors.null_slot_id is not None:
            tensors = tensors._replace(null_slot_id=self._null)  # e.g. a numpy integer
        tensors = tensors.one_token_squeezed()
        if self._validate_indices:
            check_index_values(tensors)
        if self._trivial:
            return out
        if self._kernel is not None:
            self._kernel(*kernel_arguments(tensors))
        else:
            host_step(self.spec, tensors)
        return out

    def _recheck(self, call: tuple) -> None:
        """A call the guards did not admit: full validation (raising ``mamba3_step_fn``'s error for
        bad input), then :class:`StepPlanMismatch` listing what differs from the plan. A call that
        differs in nothing validation reads (e.g. a thread with other dispatch state) returns: it
        has just been validated in full. A call in the other mode (a ring where the plan has none,
        or none where it has one) is a StepPlanMismatch at once: the plan's options are not its."""
        tensors = StepTensors(*call)
        ring = tensors.replay_ring
        if (ring is None) != (self._ring is None):
            raise StepPlanMismatch(
                f"plan: this call is not the planned signature (replay_ring: planned "
                f"{'None' if self._ring is None else 'a Ring'}, got {'None' if ring is None else type(ring).__name__}); "
                f"make a plan for it with mamba3_step.plan_step(...) or call mamba3_step_fn")
        if ring is None:
            check_step_inputs(tensors, **validated_options(self._options))
        else:
            check_replay_inputs(tensors, self._options)
        changed = self._sig.differences(call)
        mode = torch.is_inference_mode_enabled()
        if mode is not self._inference:
            changed.insert(0, f"torch.inference_mode: planned {'on' if self._inference else 'off'}, "
                              f"got {'on' if mode else 'off'}")
        if self._ring is not None:
            changed += self._ring.differences(ring)
        if changed:
            raise StepPlanMismatch(
                "plan: this call is valid but is not the planned signature (" + "; ".join(changed) + "); make "
                "a plan for it with mamba3_step.plan_step(...) or call mamba3_step_fn")

    def __repr__(self) -> str:
        flush = self.options["replay_flush_length"]
        return f"StepPlan({self.spec.key()}, out {tuple(self._out_shape)}{'' if flush is None else f', replay_flush_length={flush}'})"


def plan_step(*args, **kwargs) -> StepPlan:
    """A :class:`StepPlan` for calls with this signature: ``mamba3_step_fn``'s arguments (shapes,
    dtypes, options: its docstring; B lanes, T tokens, P pool rows, H heads, D head dim, N state
    size, R MIMO rank). The tensors are validated in full, as ``mamba3_step_fn`` validates them,
    and nothing is computed or written; on CUDA the kernel is compiled or loaded now.

    ``out`` None plans calls without ``out`` (each run allocates it); a given ``out`` plans calls
    with an ``out`` of its signature. ``null_slot_id`` is part of the signature.

    Raises:
        TypeError, ValueError: what ``mamba3_step_fn`` raises for these arguments.
    """
    return StepPlan(*split_call(_bind_plan(*args, **kwargs)))


plan_step.__signature__ = STEP_SIGNATURE.replace(return_annotation="StepPlan")

