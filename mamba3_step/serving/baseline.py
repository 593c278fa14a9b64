"""The gather -> dense -> scatter baseline that pool mode must match byte for byte.

Letters (docs/contract.md): ``B`` lanes this step, ``P`` pool rows, ``H`` heads, ``D`` head dim,
``N`` state size, ``R`` MIMO rank.

This is what a server does without pool indexing, and the definition the parity tests, the demo
and the GPU suite compare pool mode against: gather the live lanes' rows out of the pool, run a
dense step on them, scatter the new rows back for lanes whose destination is a real row, and
give padding lanes an ``out`` of exact zeros. With rotary angles the angle rows travel with the
state rows (gathered, advanced by the dense step, scattered back to the same destinations), and so
do an 8-bit state's scale rows (``state_scale``).
"""

from __future__ import annotations

import torch

from ..api import mamba3_step_fn
from ..reference import token_rows
from ..contract import lane_is_live, out_shape, source_rows
from ..tensors import StepTensors
from .hook import kv_update_in_kernel

__all__ = ["gather_dense_scatter", "gather_scatter_step"]


def gather_dense_scatter(tensors: StepTensors, *, update_kv_state: bool = True, step_fn=None,
                         tile_D: int | None = None, num_warps: int | None = None,
                         rotate_pairwise: bool = False) -> torch.Tensor:
    """Run a pool-mode step the slow way, in place on ``tensors``' pools; returns a fresh ``out``.

    ``tensors`` is a pool-mode bundle (``state`` (P, H, D, N), ``Bstate`` (P, R, H, N),
    ``Xstate`` (P, H, D), ``state_batch_indices`` given); its ``out`` is not used. The rows of
    live lanes whose destination is a real row get the dense step's new state (and with
    ``update_kv_state`` this step's B/x); every other row is untouched. ``step_fn`` (default
    ``mamba3_step_fn``) runs the dense step and takes ``mamba3_step_fn``'s keyword arguments.
    ``tile_D``/``num_warps`` pick the dense kernel's tiling (compare like with like); when
    ``tile_D < headdim`` the B/x rows are stored by a copy after the dense step instead of by the
    kernel's ``update_kv_state``. It synchronises (boolean masking): for tests, demos, debugging.

    With ``angle_state`` (P, H, S) (and ``angle_proj``, the biases; ``rotate_pairwise`` passed on)
    the live lanes' angle rows are gathered with the state rows, the dense step advances them and
    rotates B/C, and they are scattered back wherever the state goes, with or without
    ``update_kv_state`` (the angle is always written); the B rows stored are the rotated B.
    ``rotate_pairwise`` reaches ``step_fn`` only when True (a ``step_fn`` with it bound keeps it).

    With ``rand_seed`` (stochastic rounding) each dense step draws the pool step's bits: it is given
    ``rand_rows``, each gathered lane's destination row, and ``offset + t`` for token t. An 8-bit
    state's ``state_scale`` (P, H, D) rows are gathered and scattered with the state rows (every
    ``ROW_FIELDS`` row is gathered; ``rand_seed`` is not advanced: the caller's, as for the pool step).

    A T-token bundle (``x`` (B, T, H, D); ``state_batch_indices`` (B, K) with
    ``num_accepted_tokens``; ``dst_state_batch_indices`` (B,) or (B, T)) runs as T one-token
    dense steps on the gathered rows, token t's B/x becoming token t + 1's previous B/x; with a
    (B, T) destination the rows are scattered after each token, else after the last.
    """
    step_fn = mamba3_step_fn if step_fn is None else step_fn
    t = tensors
    P = t.state.shape[0]
    src = source_rows(t.state_batch_indices, t.num_accepted_tokens)
    live = lane_is_live(src, P, t.null_slot_id)
    out = torch.zeros(out_shape(t.x, t.xproj, t.outproj is not None), dtype=t.x.dtype, device=t.x.device)
    lanes = torch.nonzero(live).flatten()
    if lanes.numel() == 0:
        return out
    dense = t.dense_lanes(lanes, src[lanes])  # the gathered rows are copies
    in_kernel = kv_update_in_kernel(t.x.shape[-1], t.B.shape[-1], t.B.shape[-3], t.state.dtype, tile_D)
    dst = t.dst_state_batch_indices
    for k in range(t.tokens):
        token = _with_draw(t, dense.token(k), lanes, k)
        # the copies always take this token's B/x: the next token's previous B/x
        o = step_fn(**token._asdict(), update_kv_state=in_kernel, tile_D=tile_D, num_warps=num_warps,
                    **({"rotate_pairwise": rotate_pairwise} if rotate_pairwise else {}),
                    **({"stochastic_rounding": True} if t.rand_seed is not None else {}))
        if not in_kernel:
            token.Bstate.copy_(token.B)
            token.Xstate.copy_(token.x)
        (out[:, k] if t.x.dim() == 4 else out).index_copy_(0, lanes, o)
        if dst is not None and dst.dim() == 2:
            _scatter(t, dense, lanes, dst[:, k], update_kv_state)
    if dst is None or dst.dim() == 1:
        _scatter(t, dense, lanes, src if dst is None else dst, update_kv_state)
    return out


def _with_draw(t: StepTensors, token: StepTensors, lanes: torch.Tensor, k: int) -> StepTensors:
    """With stochastic rounding, token ``k``'s dense step draws what the pool step draws: at
    ``offset + k``, each lane for the row its state goes to (``rand_rows``:
    :func:`mamba3_step.reference.token_rows`, the rule the pool step draws by)."""
    if t.rand_seed is None:
        return token
    seed = t.rand_seed + torch.tensor([0, k], dtype=torch.int64, device=t.rand_seed.device)
    return token._replace(rand_seed=seed, rand_rows=token_rows(t, lanes)[k].to(torch.int32).contiguous())


def _scatter(t: StepTensors, dense: StepTensors, lanes: torch.Tensor, targets: torch.Tensor,
             update_kv_state: bool) -> None:
    """The dense rows of ``lanes`` to pool rows ``targets[lanes]`` (padding targets skipped); the
    angle and scale rows always (when present), the B/x rows with ``update_kv_state``."""
    rows = targets[lanes].long()
    keep = torch.nonzero(lane_is_live(rows, t.state.shape[0], t.null_slot_id)).flatten()
    if keep.numel() == 0:
        return
    rows = rows[keep]
    names = ("state", "angle_state", "state_scale") + (("Bstate", "Xstate") if update_kv_state else ())
    for name in names:  # the state and the optional rows that travel with it, then B/x
        pool, new = getattr(t, name), getattr(dense, name)
        if pool is None:
            continue
        if pool.dtype == torch.float8_e4m3fn:  # as its bytes: PyTorch's index_copy_ takes no float8
            pool, new = pool.view(torch.uint8), new.view(torch.uint8)
        pool.index_copy_(0, rows, new.index_select(0, keep))


def gather_scatter_step(*args, slots: torch.Tensor, dst_slots: torch.Tensor | None = None,
                        null_slot_id: int | None = None, num_accepted_tokens: torch.Tensor | None = None,
                        update_kv_state: bool = True, tile_D: int | None = None, num_warps: int | None = None,
                        rotate_pairwise: bool = False, **kwargs) -> torch.Tensor:
    """:func:`gather_dense_scatter` with ``mamba3_step_fn``'s flat arguments.

    ``args``/``kwargs`` are ``mamba3_step_fn``'s tensors (``state``, ``Bstate``, ``Xstate``, ``A``,
    ``B``, ``C``, ``D``, ``x``, ``dt``, ``trap``, ``xproj``, ``outproj``, ``z=``, ``zproj=``, and the
    rotary ``angle_state=``, ``angle_proj=``, ``B_bias=``, ``C_bias=``, an 8-bit state's ``state_scale=``
    and ``rand_seed=``);
    ``slots``/``dst_slots`` are the pool indices. Same effects; returns a fresh ``out``.
    """
    tensors = StepTensors(*args, **kwargs, state_batch_indices=slots, dst_state_batch_indices=dst_slots,
                          null_slot_id=null_slot_id, num_accepted_tokens=num_accepted_tokens)
    return gather_dense_scatter(tensors, update_kv_state=update_kv_state, tile_D=tile_D, num_warps=num_warps,
                                rotate_pairwise=rotate_pairwise)
