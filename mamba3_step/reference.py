"""PyTorch implementation of the Mamba-3 MIMO decode step: the CPU path and the test reference.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size
(dstate), R MIMO rank.

Two layers:

* :func:`step_math` is the dense math of docs/contract.md for a batch of lanes, computed in one
  compute dtype (float32 by default, float64 for the test reference). It is written so that
  each lane's result depends only on that lane's inputs, never on which other lanes share the
  batch: only element-wise broadcasting, explicit loops over the small R dimension and
  ``.sum(-1)`` over N (whose summation order depends on N alone). No matmul / einsum / bmm,
  whose blocking (and so rounding) may change with the batch size.
* :func:`mamba3_step_reference` is the full in-place contract of ``mamba3_step_fn``: dense
  mode, pool mode with padding lanes, separate destination rows and ``update_kv_state``.
  ``mamba3_step_fn`` runs it on CPU tensors (in float32); tests run it in float64.

Both take the step's tensors as one :class:`~mamba3_step.tensors.StepTensors`. Neither
validates its inputs: ``mamba3_step_fn`` does that first
(:func:`mamba3_step.validation.check_step_inputs`).
"""

from __future__ import annotations

import torch

from .contract import lane_is_live
from .tensors import StepTensors

__all__ = ["step_math", "mamba3_step_reference"]


def step_math(t: StepTensors, compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a dense batch of lanes, computed entirely in ``compute_dtype``.

    Per lane b and head h (docs/contract.md, "The math")::

        alpha = exp(A * dt);  beta = (1 - trap) * dt * alpha;  gamma = trap * dt
        xr[r, d]  = x[d] * xproj[r, d];     xsr[r, d] = Xstate[d] * xproj[r, d]
        new_state[d, n] = alpha * state[d, n] + sum_r gamma * xr[r, d] * B[r, n]
                                              + sum_r beta * xsr[r, d] * Bstate[r, n]
        y[r, d] = sum_n new_state[d, n] * C[r, n] + D * xr[r, d]
        y[r, d] *= silu(z[d] * zproj[r, d])               (when z is given)
        out[d] = sum_r y[r, d] * outproj[r, d]            (when outproj is given; else out = y)

    Every input is first converted to ``compute_dtype`` (exact for the supported input
    dtypes when ``compute_dtype`` is float32 or float64). ``y`` uses the unrounded
    ``new_state``, before it is cast to the state's storage dtype.

    Args:
        t: the lanes' tensors; ``state``, ``Bstate``, ``Xstate`` hold one row per lane (already
            gathered in pool mode). ``out``, ``state_out`` and the indices are not read. ``z``
            and ``zproj`` must be given together (or both None).
        compute_dtype: torch.float32 (the CPU path) or torch.float64 (the test reference).

    Returns:
        ``(new_state, out)``: new_state (B, H, D, N) and out (B, H, D) with outproj, else
        (B, R, H, D), both in ``compute_dtype``; the caller casts them to storage dtypes.
        Nothing is written to the inputs.
    """
    z, zproj, outproj = t.z, t.zproj, t.outproj
    if (z is None) != (zproj is None):
        raise ValueError("step_math: z and zproj must be given together")
    cd = compute_dtype

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.to(cd)

    R = t.xproj.shape[0]
    state_c, Bstate_c, B_c, C_c = f(t.state), f(t.Bstate), f(t.B), f(t.C)
    x_c, Xstate_c, xproj_c = f(t.x), f(t.Xstate), f(t.xproj)
    A_c, dt_c, trap_c, D_c = f(t.A), f(t.dt), f(t.trap), f(t.D)

    alpha = torch.exp(A_c * dt_c)  # (B, H)
    beta = (1 - trap_c) * dt_c * alpha  # (B, H)
    gamma = trap_c * dt_c  # (B, H)
    alpha4 = alpha[:, :, None, None]  # (B, H, 1, 1)
    beta3 = beta[:, :, None]  # (B, H, 1)
    gamma3 = gamma[:, :, None]  # (B, H, 1)

    # xr / xsr per rank: (B, H, D) each
    xr = [x_c * xproj_c[r] for r in range(R)]
    xsr = [Xstate_c * xproj_c[r] for r in range(R)]

    new_state = alpha4 * state_c  # (B, H, D, N)
    for r in range(R):
        new_state = new_state + (gamma3 * xr[r])[..., None] * B_c[:, r, :, None, :]
    for r in range(R):
        new_state = new_state + (beta3 * xsr[r])[..., None] * Bstate_c[:, r, :, None, :]

    ys = []  # R tensors of (B, H, D)
    for r in range(R):
        y = (new_state * C_c[:, r, :, None, :]).sum(-1) + D_c[None, :, None] * xr[r]
        if z is not None:
            y = y * torch.nn.functional.silu(f(z) * f(zproj)[r])
        ys.append(y)

    if outproj is not None:
        outproj_c = f(outproj)
        out = ys[0] * outproj_c[0]
        for r in range(1, R):
            out = out + ys[r] * outproj_c[r]
    else:
        out = torch.stack(ys, dim=1)  # (B, R, H, D)
    return new_state, out


def mamba3_step_reference(
    tensors: StepTensors,
    *,
    update_kv_state: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The full in-place contract of ``mamba3_step_fn``, in PyTorch (no validation).

    Shapes and dtypes are those of ``mamba3_step_fn`` (see its docstring and docs/contract.md).

    Dense mode (``state_batch_indices is None``): lane b reads row b of ``state`` (B, H, D, N),
    ``Bstate`` (B, R, H, N) and ``Xstate`` (B, H, D); the new state goes to ``state_out`` if
    given, else into ``state`` in place; with ``update_kv_state`` this step's ``B``/``x`` are
    stored into row b of ``Bstate``/``Xstate``.

    Pool mode: ``state`` is (P, H, D, N), ``Bstate`` (P, R, H, N), ``Xstate`` (P, H, D).
    Lane b is live when ``src = state_batch_indices[b]`` is a real row
    (:func:`mamba3_step.contract.lane_is_live`); otherwise it is padding: its ``out`` is written
    as exact zeros and it reads and writes no pool row. A live lane computes from row ``src``
    and writes the new state (cast to ``state``'s dtype) to row
    ``dst = dst_state_batch_indices[b]`` (default ``src``) when ``dst`` is itself a real row;
    with ``update_kv_state`` it also stores ``B[b]`` into ``Bstate[dst]`` and ``x[b]`` into
    ``Xstate[dst]`` (cast). All reads happen before any write, so a (racy) dst that is another
    lane's src reads the old row.

    Runs under ``torch.no_grad()`` (no output carries a ``grad_fn``) and computes every written
    value before writing any, so an error part-way leaves the tensors unchanged.

    Args:
        tensors: the step's tensors; ``out`` (optional) receives the result cast to its dtype
            and is allocated with x's dtype/device when None.
        compute_dtype: float32 (what the CPU path of ``mamba3_step_fn`` uses) or float64.

    Returns:
        ``out``.
    """
    t = tensors.with_out()
    if t.batch == 0:
        return t.out
    with torch.no_grad():  # in-place writes of a step: no autograd graph, no grad_fn on any output
        writes = _pool_writes(t, update_kv_state, compute_dtype) if t.pool else \
            _dense_writes(t, update_kv_state, compute_dtype)
        # Commit: every value is computed and cast; nothing below allocates a result or can fail
        # on validated inputs, so a failure above leaves every tensor as it was.
        for target, rows, value in writes:
            if rows is None:
                target.copy_(value)
            else:
                target[rows] = value
    return t.out


def _dense_writes(t: StepTensors, update_kv_state: bool, compute_dtype) -> list:
    """``(target, None, value)`` for each tensor a dense step writes."""
    new_state, y = step_math(t, compute_dtype=compute_dtype)
    target = t.state_out if t.state_out is not None else t.state
    writes = [(t.out, None, y.to(t.out.dtype)), (target, None, new_state.to(target.dtype))]
    if update_kv_state:
        writes += [(t.Bstate, None, t.B.to(t.Bstate.dtype)), (t.Xstate, None, t.x.to(t.Xstate.dtype))]
    return writes


def _pool_writes(t: StepTensors, update_kv_state: bool, compute_dtype) -> list:
    """``(target, rows or None, value)`` for each tensor a pool-mode step writes."""
    P = t.state.shape[0]
    src = t.state_batch_indices.to(device=t.x.device, dtype=torch.int64)
    dst = src if t.dst_state_batch_indices is None else t.dst_state_batch_indices.to(
        device=t.x.device, dtype=torch.int64
    )
    live = lane_is_live(src, P, t.null_slot_id)
    writes = live & lane_is_live(dst, P, t.null_slot_id)
    lanes = live.nonzero().squeeze(1)  # live lanes, in batch order

    new_state, y = step_math(t.dense_lanes(lanes, src[lanes]), compute_dtype=compute_dtype)
    result = torch.zeros(t.out.shape, dtype=t.out.dtype, device=t.out.device)
    result[lanes] = y.to(t.out.dtype)

    sel = writes[lanes]  # which live lanes also write
    wrows = dst[lanes][sel]
    todo = [(t.out, None, result), (t.state, wrows, new_state[sel].to(t.state.dtype))]
    if update_kv_state:
        wlanes = lanes[sel]
        todo += [(t.Bstate, wrows, t.B[wlanes].to(t.Bstate.dtype)), (t.Xstate, wrows, t.x[wlanes].to(t.Xstate.dtype))]
    return todo
