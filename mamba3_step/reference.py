"""PyTorch implementation of the Mamba-3 MIMO decode step: the CPU path and the test reference.

Letters (as in SPEC.md): B batch lanes, P pool rows, H heads, D head dim, N state size
(dstate), R MIMO rank.

Two layers:

* :func:`step_math` is the dense math of SPEC.md for a batch of lanes, computed in one
  compute dtype (float32 by default, float64 for the test reference). It is written so that
  each lane's result depends only on that lane's inputs, never on which other lanes share the
  batch: only element-wise broadcasting, explicit loops over the small R dimension and
  ``.sum(-1)`` over N (whose summation order depends on N alone). No matmul / einsum / bmm,
  whose blocking (and so rounding) may change with the batch size.
* :func:`mamba3_step_reference` is the full in-place contract of ``mamba3_step_fn``: dense
  mode, pool mode with padding lanes, separate destination rows and ``update_kv_state``.
  ``mamba3_step_fn`` runs it on CPU tensors (in float32); tests run it in float64.

Neither function validates its inputs: ``mamba3_step_fn`` does that first
(:func:`mamba3_step.validation.check_step_inputs`).
"""

from __future__ import annotations

import torch

__all__ = ["step_math", "mamba3_step_reference", "live_lane_mask"]


def step_math(
    state: torch.Tensor,  # (B, H, D, N)
    Bstate: torch.Tensor,  # (B, R, H, N)
    Xstate: torch.Tensor,  # (B, H, D)
    A: torch.Tensor,  # (B, H)
    B: torch.Tensor,  # (B, R, H, N)
    C: torch.Tensor,  # (B, R, H, N)
    D: torch.Tensor,  # (H,)
    x: torch.Tensor,  # (B, H, D)
    dt: torch.Tensor,  # (B, H)
    trap: torch.Tensor,  # (B, H)
    xproj: torch.Tensor,  # (R, H, D)
    outproj: torch.Tensor | None = None,  # (R, H, D)
    z: torch.Tensor | None = None,  # (B, H, D)
    zproj: torch.Tensor | None = None,  # (R, H, D)
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a dense batch of lanes, computed entirely in ``compute_dtype``.

    Per lane b and head h (SPEC.md, "Math")::

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
        state, Bstate, Xstate: the lanes' recurrent rows (already gathered in pool mode).
        A, dt, trap: per (lane, head) scalars; D: per-head skip weight.
        B, C: this step's input/output projections of the state; x, z: this step's inputs.
        xproj, zproj, outproj: per (rank, head, d) weights.
        z and zproj must be given together (or both None).
        compute_dtype: torch.float32 (the CPU path) or torch.float64 (the test reference).

    Returns:
        ``(new_state, out)``: new_state (B, H, D, N) and out (B, H, D) with outproj, else
        (B, R, H, D), both in ``compute_dtype``; the caller casts them to storage dtypes.
        Nothing is written to the inputs.
    """
    if (z is None) != (zproj is None):
        raise ValueError("step_math: z and zproj must be given together")
    cd = compute_dtype

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.to(cd)

    R = xproj.shape[0]
    state_c, Bstate_c, B_c, C_c = f(state), f(Bstate), f(B), f(C)
    x_c, Xstate_c, xproj_c = f(x), f(Xstate), f(xproj)
    A_c, dt_c, trap_c, D_c = f(A), f(dt), f(trap), f(D)

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


def live_lane_mask(
    indices: torch.Tensor, P: int, null_slot_id: int | None = None
) -> torch.Tensor:
    """Bool (B,) mask of lanes whose pool index is a real row: ``0 <= idx < P`` and ``idx != null_slot_id``.

    Everything else (negative, ``>= P``, the null slot) is padding (SPEC.md, "Pool mode").
    """
    idx = indices.to(torch.int64)
    live = (idx >= 0) & (idx < P)
    if null_slot_id is not None:
        live &= idx != int(null_slot_id)
    return live


def out_shape(x: torch.Tensor, xproj: torch.Tensor, has_outproj: bool) -> tuple[int, ...]:
    """Shape of ``out``: (B, H, D) with outproj, else (B, R, H, D); x (B, H, D), xproj (R, H, D)."""
    nb, H, D = x.shape
    return (nb, H, D) if has_outproj else (nb, xproj.shape[0], H, D)


def mamba3_step_reference(
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
    update_kv_state: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The full in-place contract of ``mamba3_step_fn``, in PyTorch (no validation).

    Shapes and dtypes are those of ``mamba3_step_fn`` (see its docstring and SPEC.md).

    Dense mode (``state_batch_indices is None``): lane b reads row b of ``state`` (B, H, D, N),
    ``Bstate`` (B, R, H, N) and ``Xstate`` (B, H, D); the new state goes to ``state_out`` if
    given, else into ``state`` in place; with ``update_kv_state`` this step's ``B``/``x`` are
    stored into row b of ``Bstate``/``Xstate``.

    Pool mode: ``state`` is (P, H, D, N), ``Bstate`` (P, R, H, N), ``Xstate`` (P, H, D).
    Lane b is live when ``src = state_batch_indices[b]`` satisfies ``0 <= src < P`` and
    ``src != null_slot_id``; otherwise it is padding: its ``out`` is written as exact zeros
    and it reads and writes no pool row. A live lane computes from row ``src`` and writes the
    new state (cast to ``state``'s dtype) to row ``dst = dst_state_batch_indices[b]``
    (default ``src``) when ``dst`` is itself a real row; with ``update_kv_state`` it also
    stores ``B[b]`` into ``Bstate[dst]`` and ``x[b]`` into ``Xstate[dst]`` (cast). All
    reads happen before any write, so a (racy) dst that is another lane's src reads the old row.

    Args:
        compute_dtype: float32 (what the CPU path of ``mamba3_step_fn`` uses) or float64.
        out: optional preallocated output, (B, H, D) with outproj else (B, R, H, D); results
            are cast to its dtype. Allocated with x's dtype/device when None.

    Returns:
        ``out``.
    """
    nb = x.shape[0]
    if out is None:
        out = torch.empty(out_shape(x, xproj, outproj is not None), dtype=x.dtype, device=x.device)
    if nb == 0:
        return out

    if state_batch_indices is None:
        new_state, y = step_math(
            state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, z, zproj,
            compute_dtype=compute_dtype,
        )
        out.copy_(y)
        (state_out if state_out is not None else state).copy_(new_state)
        if update_kv_state:
            Bstate.copy_(B)
            Xstate.copy_(x)
        return out

    P = state.shape[0]
    src = state_batch_indices.to(device=x.device, dtype=torch.int64)
    dst = src if dst_state_batch_indices is None else dst_state_batch_indices.to(
        device=x.device, dtype=torch.int64
    )
    live = live_lane_mask(src, P, null_slot_id)
    writes = live & live_lane_mask(dst, P, null_slot_id)
    lanes = live.nonzero().squeeze(1)  # live lanes, in batch order
    rows = src[lanes]

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[lanes]

    new_state, y = step_math(
        state[rows], Bstate[rows], Xstate[rows], take(A), take(B), take(C), D, take(x),
        take(dt), take(trap), xproj, outproj, take(z), zproj,
        compute_dtype=compute_dtype,
    )
    result = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
    result[lanes] = y.to(out.dtype)
    out.copy_(result)

    sel = writes[lanes]  # which live lanes also write
    wrows = dst[lanes][sel]
    state[wrows] = new_state[sel].to(state.dtype)
    if update_kv_state:
        wlanes = lanes[sel]
        Bstate[wrows] = B[wlanes].to(Bstate.dtype)
        Xstate[wrows] = x[wlanes].to(Xstate.dtype)
    return out
