"""``decode_step``: one layer's pool-mode step over a :class:`~mamba3_step.serving.pool.StatePool`.

Letters (docs/contract.md): ``B`` lanes this step, ``P`` pool rows (slots), ``H`` heads,
``D`` head dim, ``N`` state size, ``R`` MIMO rank.
"""

from __future__ import annotations

import torch

from ..api import mamba3_step_fn
from ..contract import dtype_name, lane_is_live
from ..tiling import default_tiling
from .pool import StatePool

__all__ = ["decode_step", "kv_update_in_kernel"]


def kv_update_in_kernel(headdim: int, dstate: int, mimo: int, state_dtype, tile_D: int | None) -> bool:
    """Whether ``update_kv_state``'s precondition (``tile_D >= headdim``) holds.

    ``tile_D=None`` means the per-configuration default (:func:`tiling.default_tiling`).
    """
    if tile_D is None:
        tile_D, _ = default_tiling(dstate, headdim, mimo, dtype_name(state_dtype))
    return tile_D >= headdim


def decode_step(
    pool: StatePool,
    layer: int,
    slots: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    trap: torch.Tensor,
    xproj: torch.Tensor,
    outproj: torch.Tensor | None = None,
    *,
    z: torch.Tensor | None = None,
    zproj: torch.Tensor | None = None,
    dst_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tile_D: int | None = None,
    num_warps: int | None = None,
    validate_indices: bool = False,
) -> torch.Tensor:
    """One Mamba-3 decode step of one layer over the pool, in place.

    Args:
        pool: the :class:`StatePool`; layer ``layer``'s rows are read and updated.
        slots: ``(B,)`` int32 on the pool's device: lane ``b`` reads (and by default writes)
            row ``slots[b]``. Padding lanes (``< 0``, ``>= P``, or the pool's null slot) give
            zero ``out`` and touch no row.
        A, dt, trap: ``(B, H)`` fp32.  B, C: ``(B, R, H, N)`` ``pool.kv_dtype``.  D: ``(H,)`` fp32.
        x, z: ``(B, H, D)`` ``pool.x_dtype``.  xproj, zproj, outproj: ``(R, H, D)``.
        dst_slots: optional ``(B,)`` int32 destination rows (prefix caching: read a cached
            prefix row, write the request's own row).
        out: optional output buffer, ``(B, H, D)`` with ``outproj``, else ``(B, R, H, D)``.
        tile_D, num_warps: kernel tiling, passed through unchanged (None = default).

    Effects: layer ``layer``'s ``state`` rows ``dst`` get the new state and its
    ``Bstate``/``Xstate`` rows ``dst`` get this step's ``B``/``x`` (next step's "previous").
    When ``tile_D >= headdim`` (the default) the kernel stores B/x itself
    (``update_kv_state=True``); otherwise the hook keeps the user's ``tile_D`` and follows
    the step with a masked scatter (graph-capturable: padded lanes go to a hidden scratch
    row). Returns ``out``.
    """
    state, Bstate, Xstate = pool.layer_tensors(layer)
    in_kernel = kv_update_in_kernel(pool.headdim, pool.dstate, pool.mimo, pool.state_dtype, tile_D)
    out = mamba3_step_fn(
        state,
        Bstate,
        Xstate,
        A,
        B,
        C,
        D,
        x,
        dt,
        trap,
        xproj,
        outproj,
        None,
        out,
        z,
        zproj,
        state_batch_indices=slots,
        dst_state_batch_indices=dst_slots,
        null_slot_id=pool.null_slot_id,
        update_kv_state=in_kernel,
        tile_D=tile_D,
        num_warps=num_warps,
        validate_indices=validate_indices,
    )
    if not in_kernel:
        _masked_kv_scatter(pool, layer, slots, dst_slots, B, x)
    return out


def _masked_kv_scatter(pool: StatePool, layer: int, slots, dst_slots, B, x) -> None:
    """Store B/x into rows ``dst`` of live lanes; padded lanes write the hidden scratch row."""
    P = pool.num_slots
    live = lane_is_live(slots, P, pool.null_slot_id)
    target = slots if dst_slots is None else dst_slots
    if dst_slots is not None:
        live &= lane_is_live(dst_slots, P, pool.null_slot_id)
    rows = torch.where(live, target.to(torch.long), torch.full_like(target, P, dtype=torch.long))
    pool._Bstate[layer].index_copy_(0, rows, B.to(pool.kv_dtype))
    pool._Xstate[layer].index_copy_(0, rows, x.to(pool.x_dtype))
