"""``decode_step``: one layer's pool-mode step over a :class:`~mamba3_step.serving.pool.StatePool`.

Letters (docs/contract.md): ``B`` lanes this step, ``T`` tokens per lane, ``K`` candidate source
rows per lane, ``P`` pool rows (slots), ``H`` heads, ``D`` head dim, ``N`` state size, ``R`` MIMO rank.
"""

from __future__ import annotations

from inspect import Parameter

import torch

from ..api import check_index_values, run_step
from ..contract import dtype_name, lane_is_live, source_rows
from ..replay_validation import check_replay_inputs
from ..signature import StepOptions, View, make_binder, view_fields, view_signature
from ..tensors import StepTensors
from ..tiling import default_tiling, kv_split_fits, thread_layout
from ..validation import check_options
from ..validation.checks import check_write_target
from .pool import StatePool

__all__ = ["check_pool_step", "decode_step", "kv_update_in_kernel"]


def kv_update_in_kernel(headdim: int, dstate: int, mimo: int, state_dtype, tile_D: int | None,
                        tokens: int = 1) -> bool:
    """Whether ``update_kv_state``'s precondition holds: ``tile_D >= headdim``, or at most
    ``tiling.MAX_CLUSTER_CTAS`` D-tiles a (lane, head), launched as one cluster (``tiling.kv_split_fits``).

    ``tile_D=None`` means the per-configuration default (:func:`tiling.default_tiling`); with
    ``tokens`` > 1 the whole-head default must also keep the state in registers across the
    tokens (N=256 D=128 R=8 fp32 cannot: its T-token default halves tile_D, and the B/x rows are
    then stored by the hook).
    """
    if tile_D is None:
        name = dtype_name(state_dtype)
        tile_D, num_warps = default_tiling(dstate, headdim, mimo, name, tokens, whole_head=True)
        if tokens > 1 and not thread_layout(dstate, tile_D, num_warps, name, mimo, tokens).preload:
            return False
    return kv_split_fits(headdim, tile_D)


#: what the pool supplies: its layer's rows (the angle's and an 8-bit state's scales too), its null
#: slot; the hook decides update_kv_state
POOL_SUPPLIED = frozenset({"state", "Bstate", "Xstate", "angle_state", "state_scale", "state_out", "null_slot_id",
                           "update_kv_state"})
_VIEW = View(
    leading=(Parameter("pool", Parameter.POSITIONAL_OR_KEYWORD, annotation="StatePool"),
             Parameter("layer", Parameter.POSITIONAL_OR_KEYWORD, annotation="int")),
    promoted=("state_batch_indices",), supplied=POOL_SUPPLIED,
    renamed={"state_batch_indices": "slots", "dst_state_batch_indices": "dst_slots"})
#: the declared name of each decode_step parameter after pool and layer
_FIELDS = view_fields(_VIEW)[2:]
_bind = make_binder("decode_step", view_signature(_VIEW))


def decode_step(*args, **kwargs) -> torch.Tensor:
    """One Mamba-3 decode step of one layer over the pool, in place; ``T`` tokens per lane optional.

    Args:
        pool: the :class:`StatePool`; layer ``layer``'s rows are read and updated.
        slots: ``(B,)`` int32 on the pool's device: lane ``b`` reads (and by default writes)
            row ``slots[b]``; or ``(B, K)`` with ``num_accepted_tokens``: lane ``b`` reads row
            ``slots[b, num_accepted_tokens[b] - 1]`` (a speculative verify step,
            ``StatePool.spec_indices``). Padding lanes (a source ``< 0``, ``>= P``, the pool's null
            slot, or a count outside ``[1, K]``) give zero ``out`` and touch no row.
        A, dt, trap: ``(B, H)`` fp32.  B, C: ``(B, R, H, N)`` ``pool.kv_dtype`` (or ``(B, R, 1, N)``,
            shared by the heads).  D: ``(H,)`` fp32.
        x, z: ``(B, H, D)`` ``pool.x_dtype``.  xproj, zproj, outproj: ``(R, H, D)``.
            With ``T`` tokens per lane the per-lane inputs carry a token axis after the lane
            axis: ``(B, T, H)``, ``(B, T, R, H, N)``, ``(B, T, H, D)`` (token ``t``'s previous B/x
            is token ``t - 1``'s; ``T`` is compile-time: one kernel specialisation per ``T``).
        angle_proj: ``(B, [T,] H, S)`` fp32, exactly when the pool has rotary angles
            (``rope_angles=S``): each token advances the lane's angle row (which the pool supplies)
            and rotates B and C by it (docs/contract.md).
        B_bias, C_bias: optional ``(R, H, N)`` fp32, together, with the angles (added before the rotation).
        rotate_pairwise: which element pairs rotate (upstream's ``rotate_pairwise``).
        stochastic_rounding, rand_seed: ``True`` and an int64 ``(2,)`` ``[seed, offset]`` on the pool's
            device, required with an 8-bit pool (``state_dtype`` int8 / float8_e4m3fn, whose
            ``state_scale`` rows the pool supplies), optional with a bf16/fp16 one, refused with fp32.
        dst_slots: optional int32 destination rows: ``(B,)`` (the final state; prefix caching:
            read a cached prefix row, write the request's own row) or, with a token axis,
            ``(B, T)`` (the state after token ``t`` to row ``dst_slots[b, t]``; a padding entry
            skips that token's write).
        num_accepted_tokens: ``(B,)`` int32, with ``(B, K)`` ``slots`` (see above); on a replay pool
            (:class:`~mamba3_step.serving.ReplayStatePool`) with ``(B,)`` ``slots``: the drafts of each
            lane's last verify step to commit first, before a verify step or a one-token step
            (docs/contract.md, "Replay").
        out: optional output buffer, ``(B, [T,] H, D)`` with ``outproj``, else ``(B, [T,] R, H, D)``.
        tile_D, num_warps: kernel tiling, passed through unchanged (None = default).

    Effects: layer ``layer``'s ``state`` rows ``dst`` get the new state and its
    ``Bstate``/``Xstate`` rows ``dst`` get this step's ``B``/``x`` (next step's "previous"; per
    token with a ``(B, T)`` ``dst_slots``, else the last token's; with rotary the rotated B); with
    rotary angles its ``angle_state`` rows ``dst`` get the advanced angle, with an 8-bit state its
    ``state_scale`` rows ``dst`` the new state's scales. When ``tile_D >= headdim``
    (the default) or ``headdim / tile_D <= 8`` (a cluster of D-tiles) the kernel stores B/x itself
    (``update_kv_state=True``); otherwise the hook
    keeps the user's ``tile_D`` and follows the step with a masked scatter (graph-capturable:
    padded lanes and padding tokens go to a hidden scratch row). With ``stochastic_rounding`` the
    hook then advances ``rand_seed``'s offset by ``T`` in place, on its device (so the next step, or
    the next replay of a captured one, draws fresh bits). A replay pool's rows are checkpoints: the
    step goes through the step's replay mode (the state written every F tokens, the rest to the ring;
    a token axis is a verify step whose drafts stay in the ring). Returns ``out``.
    """
    values = _bind(*args, **kwargs)
    pool, layer, call = values[0], values[1], dict(zip(_FIELDS, values[2:]))
    rows = pool.layer_rows(layer)
    # the options first: the hook reads tile_D itself before the step's validation sees it
    check_options(tile_D=call["tile_D"], num_warps=call["num_warps"], validate_indices=call["validate_indices"])
    tensors = StepTensors(**{name: call.get(name) for name in StepTensors._fields if name not in POOL_SUPPLIED},
                          **rows, null_slot_id=pool.null_slot_id)
    if pool.replay_ring:
        return _replay_step(pool, layer, tensors, call)
    x = call["x"]
    tokens = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 4 else 1
    in_kernel = kv_update_in_kernel(pool.headdim, pool.dstate, pool.mimo, pool.state_dtype, call["tile_D"], tokens)
    check_pool_step(pool, layer, tensors, call["stochastic_rounding"], in_kernel)
    options = StepOptions(**{name: call.get(name) for name in StepOptions._fields if name not in POOL_SUPPLIED},
                          update_kv_state=in_kernel)
    out = run_step(tensors, options)
    if not in_kernel:
        _masked_kv_scatter(pool, layer, tensors)
    if options.stochastic_rounding is True:  # validated: rand_seed is an int64 (2,) tensor
        tensors.rand_seed[1:].add_(tokens)  # on its device: a captured step advances it at each replay
    return out


decode_step.__signature__ = view_signature(_VIEW).replace(return_annotation="torch.Tensor")


#: what a replay pool's verify step refuses, the reason after the name (a one-token step takes dst_slots: a
#: lane moving to another slot flushes into it)
_NOT_WITH_REPLAY_VERIFY = {("dst_slots", "dst_state_batch_indices"): "a verify step keeps its drafts in its row's ring"}


def check_pool_step(pool: StatePool, layer: int, tensors: StepTensors, stochastic_rounding, in_kernel: bool) -> bool:
    """What a pool's step takes beyond the step's own validation, checked before anything is written (by
    :func:`decode_step`, and by the graph runner before it copies a byte into its buffers): with a replay
    pool, the step it can run (no ``dst_slots`` with a verify step, no more drafts than ``replay_draft``,
    ``stochastic_rounding`` with ``rand_seed`` exactly, on a pool whose rings keep draw offsets); and what
    the hook writes itself writable here (``rand_seed``, whose offset it advances; ``Bstate``/``Xstate``
    when it scatters B/x, ``in_kernel`` False): not an inference tensor outside ``torch.inference_mode``.
    ValueError naming the argument. Returns whether the step rounds stochastically."""
    x = tensors.x
    token_axis = isinstance(x, torch.Tensor) and x.dim() == 4
    if pool.replay_ring:
        stochastic = _check_replay_call(pool, layer, tensors, stochastic_rounding, token_axis)
    else:
        stochastic = stochastic_rounding is True
    inference_mode = torch.is_inference_mode_enabled()
    if stochastic and isinstance(tensors.rand_seed, torch.Tensor):
        check_write_target("rand_seed", tensors.rand_seed, inference_mode)
    if not in_kernel and not pool.replay_ring:
        for name, rows in (("Bstate", pool._Bstate), ("Xstate", pool._Xstate)):
            check_write_target(name, rows, inference_mode)
    return stochastic


def _check_replay_call(pool: StatePool, layer: int, tensors: StepTensors, stochastic_rounding,
                       token_axis: bool) -> bool:
    """A replay pool's refusals (:func:`check_pool_step`); returns ``stochastic_rounding`` as a bool."""
    tokens = tensors.x.shape[1] if token_axis else 1
    for (name, field), why in _NOT_WITH_REPLAY_VERIFY.items():
        if token_axis and getattr(tensors, field) is not None:
            raise ValueError(f"{name}: expected None with a replay pool's verify step (replay_ring={pool.replay_ring}): "
                             f"{why}")
    if token_axis and tokens > pool.replay_draft:
        raise ValueError(f"x: a verify step of {tokens} tokens needs a ring with room for them "
                         f"(ReplayStatePool(..., replay_draft >= {tokens})), this pool has replay_draft="
                         f"{pool.replay_draft}")
    stochastic = check_options(stochastic_rounding=stochastic_rounding)["stochastic_rounding"]  # named errors
    if stochastic != (tensors.rand_seed is not None):
        raise ValueError(f"stochastic_rounding: expected {tensors.rand_seed is not None} with "
                         f"{'a' if tensors.rand_seed is not None else 'no'} rand_seed on a replay pool, got {stochastic}")
    if stochastic and pool.ring(layer).offset is None:
        raise ValueError(f"stochastic_rounding: a replay pool with a {dtype_name(pool.state_dtype)} state takes no "
                         f"stochastic rounding (its rings keep no draw offsets; an 8-bit pool's do)")
    return stochastic


def _replay_step(pool: StatePool, layer: int, tensors: StepTensors, call: dict) -> torch.Tensor:
    """A step of a replay pool (:class:`~mamba3_step.serving.ReplayStatePool`): the step's replay mode on the
    layer's rows and ring (``replay_ring``), with every ``out`` stepwise decoding's, bit for bit. A verify step (x with
    a token axis of at most ``pool.replay_draft`` drafts) keeps its drafts in the ring; ``num_accepted_tokens``
    (B,) commits that many of each lane's last drafts first (``slots`` stays (B,): no speculative groups).
    A one-token step's ``dst_slots`` (B,): a lane whose destination is another slot flushes into it (the
    source slot keeps its checkpoint and ring). Refused by name, before anything is written: what
    :func:`check_pool_step` refuses (``dst_slots`` with a verify step, more drafts than the ring has room for)
    and what the step's replay mode refuses."""
    accepted = tensors.num_accepted_tokens  # with a ring: the drafts to commit
    tensors = tensors._replace(replay_ring=pool.ring(layer))
    x = tensors.x
    tokens = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 4 else 1
    stochastic = check_pool_step(pool, layer, tensors, call["stochastic_rounding"], True)
    options = StepOptions(update_kv_state=True, tile_D=call["tile_D"], num_warps=call["num_warps"],
                          rotate_pairwise=call["rotate_pairwise"], stochastic_rounding=stochastic,
                          replay_flush_length=pool.replay_ring)
    if call["validate_indices"]:
        check_replay_inputs(tensors, options)  # every check (the step's own, named alike) before the values are read
        check_index_values(tensors.with_out().one_token_squeezed())
        _check_accepted_values(pool, accepted)
    out = run_step(tensors, options)
    if stochastic:
        tensors.rand_seed[1:].add_(tokens)
    return out


def _check_accepted_values(pool: StatePool, accepted) -> None:
    """With ``validate_indices``: each accepted count in ``[0, replay_draft]`` (the kernel makes a lane
    whose count leaves its ring padding; this says so by name instead)."""
    if accepted is None or accepted.numel() == 0:
        return
    bad = (accepted < 0) | (accepted > pool.replay_draft)
    if bool(bad.any()):
        lanes = bad.nonzero().flatten().tolist()
        raise ValueError(f"num_accepted_tokens: expected counts in [0, replay_draft={pool.replay_draft}] with a replay "
                         f"pool, got {accepted[bad].tolist()} at lanes {lanes}")


def _masked_kv_scatter(pool: StatePool, layer: int, tensors: StepTensors) -> None:
    """Store B/x into the rows ``dst`` of live lanes (per token with a ``(B, T)`` ``dst_slots``, else
    the last token's into the final row), in token order; padding goes to the hidden scratch row.
    A B shared by the heads (a head axis of 1) is stored into every head's row. Never with rotary
    (its rotated B is the kernel's to store: ``tile_D < headdim`` is refused with angles)."""
    P = pool.num_slots
    slots, dst_slots, B, x = tensors.state_batch_indices, tensors.dst_state_batch_indices, tensors.B, tensors.x
    num_accepted_tokens = tensors.num_accepted_tokens
    src = source_rows(slots, num_accepted_tokens)
    live = lane_is_live(src, P, pool.null_slot_id)
    if dst_slots is not None and dst_slots.dim() == 2:  # a row per token
        writes = [(dst_slots[:, t].to(torch.long), B[:, t], x[:, t]) for t in range(x.shape[1])]
    else:
        final = src if dst_slots is None else dst_slots.to(torch.long)
        writes = [(final, B[:, -1], x[:, -1]) if x.dim() == 4 else (final, B, x)]
    for rows, b, xt in writes:
        keep = live & lane_is_live(rows, P, pool.null_slot_id)
        rows = torch.where(keep, rows, torch.full_like(rows, P))
        pool._Bstate[layer].index_copy_(0, rows, b.to(pool.kv_dtype).expand(-1, -1, pool.nheads, -1))
        pool._Xstate[layer].index_copy_(0, rows, xt.to(pool.x_dtype))
