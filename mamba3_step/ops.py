"""``mamba3_step_fn`` as a PyTorch custom op: ``torch.ops.mamba3_step.step``.

Importing this module registers the op (``torch.library.custom_op``) with its schema, the
tensors it mutates and a fake (meta) implementation, so a model compiled with
``torch.compile(fullgraph=True)`` calls the step without a graph break, on CPU and CUDA::

    import mamba3_step.ops  # registers torch.ops.mamba3_step.step
    from mamba3_step.ops import mamba3_step_op

    out = mamba3_step_op(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj,
                         z=z, zproj=zproj, state_batch_indices=slots, update_kv_state=True)

Design: a custom op may not return (an alias of) one of its inputs, and ``mamba3_step_fn``
writes ``out`` in place. So the registered op takes ``out`` as a **required, mutated**
argument and returns nothing; :func:`mamba3_step_op` is the convenience wrapper that
allocates ``out`` when it is not given (the ``torch.empty`` is traced into the graph) and
returns it. The op declares as mutated every tensor the step may write: ``state``,
``Bstate``, ``Xstate`` (``update_kv_state``), ``state_out`` (optional) and ``out``.
Declaring ``Bstate``/``Xstate`` even when ``update_kv_state`` is False is a safe
over-approximation (the compiler just does not reorder reads of them around the op).

Shapes, dtypes and semantics are those of ``mamba3_step_fn`` (docs/contract.md); letters B P H D N R.
The op has no autograd formula (decode is inference-only). Its schema is generated from the
declared arguments (:func:`mamba3_step.signature.op_schema`): the required tensors and ``out``,
then the optional ones in the public order (``replay_ring`` as its tensors ``replay_ring_B``,
``replay_ring_x``, ... :data:`~mamba3_step.signature.OP_RING_ARGS`, each mutated), then the options
(pass those by keyword). A replay step is one call of this op, like any other step.

The op refuses what ``mamba3_step_fn`` refuses, with the same named errors: its real
implementation is ``mamba3_step_fn`` and its fake implementation runs the same validation
(``validation.check_step_inputs``) on the fake tensors. The non-tensor options are declared as
``Scalar`` in the schema so that the dispatcher passes them on as given: with ``int``/``bool``
types it would turn ``null_slot_id=True`` into 1 and ``update_kv_state=1`` into True before
the validation could see them. ``mamba3_step_fn`` itself is traceable too: while compiling it
calls this op (``api.step_through_op``).
"""

from __future__ import annotations

from inspect import Parameter, Signature

import torch

from .api import run_step, step_through_op
from .replay_validation import check_replay_inputs, is_replay_call
from .signature import (OP_MUTATED, OP_ORDER, OP_RING_ARGS, STEP_SIGNATURE, from_op_values, make_binder, op_schema,
                        split_call, validated_options)
from .validation import check_options, check_step_inputs

__all__ = ["mamba3_step_op", "step"]


def _op_parameter(name: str) -> Parameter:
    """The op's parameter ``name``: the declared one (``out`` required), or a ring tensor (None by default)."""
    if name in OP_RING_ARGS:
        return Parameter(name, Parameter.POSITIONAL_OR_KEYWORD, default=None)
    p = STEP_SIGNATURE.parameters[name]
    return p.replace(kind=Parameter.POSITIONAL_OR_KEYWORD, default=Parameter.empty if name == "out" else p.default)


#: the op's arguments by name, in OP_ORDER, from what the dispatcher passes
_bind_op = make_binder("step", Signature([_op_parameter(name) for name in OP_ORDER]))


def _split(args, kwargs) -> tuple:
    """The op's call (``OP_ORDER``) -> ``(StepTensors, StepOptions)``."""
    return from_op_values(dict(zip(OP_ORDER, _bind_op(*args, **kwargs))))


def _op_step(*args, **kwargs) -> None:
    """The step, in place (see ``mamba3_step_fn``). ``out`` is required and written."""
    run_step(*_split(args, kwargs))


def _op_fake(*args, **kwargs) -> None:
    # Everything is written in place into caller-provided tensors: no new outputs. The checks are
    # the real ones, the replay mode's included (metadata only; address comparisons are skipped for
    # fake tensors and happen when the real implementation runs).
    tensors, options = _split(args, kwargs)
    check_options(validate_indices=options.validate_indices)
    if is_replay_call(tensors, options):
        check_replay_inputs(tensors, options)
    else:
        check_step_inputs(tensors, **validated_options(options))
    return None


step = torch.library.custom_op("mamba3_step::step", _op_step, mutates_args=OP_MUTATED, schema=op_schema())
step.register_fake(_op_fake)

_bind_public = make_binder("mamba3_step_op", STEP_SIGNATURE)


def mamba3_step_op(*args, **kwargs) -> torch.Tensor:
    """Same signature and effects as ``mamba3_step_fn``, through ``torch.ops.mamba3_step.step``.

    Allocates ``out`` (x's dtype and device; ``(B, H, D)`` with outproj, else ``(B, R, H, D)``)
    when it is None, and returns it. Safe to call inside ``torch.compile(fullgraph=True)``.
    """
    tensors, options = split_call(_bind_public(*args, **kwargs))
    return step_through_op(tensors, options)


mamba3_step_op.__signature__ = STEP_SIGNATURE.replace(return_annotation="torch.Tensor")
