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
The op has no autograd formula (decode is inference-only).

The op refuses what ``mamba3_step_fn`` refuses, with the same named errors: its real
implementation is ``mamba3_step_fn`` and its fake implementation runs the same validation
(``validation.check_step_inputs``) on the fake tensors. The non-tensor options are declared as
``Scalar`` in the schema so that the dispatcher passes them on as given: with ``int``/``bool``
types it would turn ``null_slot_id=True`` into 1 and ``update_kv_state=1`` into True before
the validation could see them. ``mamba3_step_fn`` itself is traceable too: while compiling it
calls this op (``api.step_through_op``).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .api import mamba3_step_fn, step_through_op
from .tensors import StepTensors
from .validation import check_options, check_step_inputs

__all__ = ["mamba3_step_op", "step"]

_MUTATED = ("state", "Bstate", "Xstate", "state_out", "out")
#: schema type ``Scalar``: keeps bool and int apart (the validation refuses True for an int, 1 for a bool)
Scalar = Union[int, float, bool]


@torch.library.custom_op("mamba3_step::step", mutates_args=_MUTATED)
def step(
    state: torch.Tensor,
    Bstate: torch.Tensor,
    Xstate: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    xproj: torch.Tensor,
    out: torch.Tensor,
    outproj: Optional[torch.Tensor] = None,
    state_out: Optional[torch.Tensor] = None,
    z: Optional[torch.Tensor] = None,
    zproj: Optional[torch.Tensor] = None,
    state_batch_indices: Optional[torch.Tensor] = None,
    dst_state_batch_indices: Optional[torch.Tensor] = None,
    null_slot_id: Optional[Scalar] = None,
    update_kv_state: Scalar = False,
    tile_D: Optional[Scalar] = None,
    num_warps: Optional[Scalar] = None,
    validate_indices: Scalar = False,
    num_accepted_tokens: Optional[torch.Tensor] = None,  # last: positional callers of the T-less schema still fit
) -> None:
    """The step, in place (see ``mamba3_step_fn``). ``out`` is required and written.

    state (B|P, H, D, N); Bstate (B|P, R, H, N); Xstate (B|P, H, D); A, dt, trap (B, H) fp32;
    B, C (B, R, H, N); D (H,) fp32; x, z (B, H, D); xproj, zproj, outproj (R, H, D);
    out (B, H, D) with outproj else (B, R, H, D); indices (B,) int32. A T-token step puts a
    token axis after B in A, dt, trap, B, C, x, z and out; state_batch_indices may be (B, K)
    with num_accepted_tokens (B,), dst_state_batch_indices (B, T).
    """
    mamba3_step_fn(
        state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj,
        state_batch_indices=state_batch_indices,
        dst_state_batch_indices=dst_state_batch_indices,
        null_slot_id=null_slot_id,
        num_accepted_tokens=num_accepted_tokens,
        update_kv_state=update_kv_state,
        tile_D=tile_D,
        num_warps=num_warps,
        validate_indices=validate_indices,
    )


@step.register_fake
def _step_fake(
    state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, out, outproj=None, state_out=None,
    z=None, zproj=None, state_batch_indices=None, dst_state_batch_indices=None,
    null_slot_id=None, update_kv_state=False, tile_D=None, num_warps=None, validate_indices=False,
    num_accepted_tokens=None,
) -> None:
    # Everything is written in place into caller-provided tensors: no new outputs. The checks are
    # the real ones (metadata only; address comparisons are skipped for fake tensors and happen
    # when the real implementation runs).
    check_options(validate_indices=validate_indices)
    check_step_inputs(
        StepTensors(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj,
                    state_batch_indices, dst_state_batch_indices, null_slot_id, num_accepted_tokens),
        update_kv_state=update_kv_state, tile_D=tile_D, num_warps=num_warps,
    )
    return None


def mamba3_step_op(
    state: torch.Tensor,
    Bstate: torch.Tensor,
    Xstate: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    xproj: torch.Tensor,
    outproj: torch.Tensor | None = None,
    state_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    zproj: torch.Tensor | None = None,
    *,
    state_batch_indices: torch.Tensor | None = None,
    dst_state_batch_indices: torch.Tensor | None = None,
    null_slot_id: int | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    update_kv_state: bool = False,
    tile_D: int | None = None,
    num_warps: int | None = None,
    validate_indices: bool = False,
) -> torch.Tensor:
    """Same signature and effects as ``mamba3_step_fn``, through ``torch.ops.mamba3_step.step``.

    Allocates ``out`` (x's dtype and device; ``(B, H, D)`` with outproj, else ``(B, R, H, D)``)
    when it is None, and returns it. Safe to call inside ``torch.compile(fullgraph=True)``.
    """
    tensors = StepTensors(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj,
                          state_batch_indices, dst_state_batch_indices, null_slot_id, num_accepted_tokens)
    return step_through_op(tensors, update_kv_state=update_kv_state, tile_D=tile_D, num_warps=num_warps,
                           validate_indices=validate_indices)
