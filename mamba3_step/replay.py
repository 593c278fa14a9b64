"""Replay: a pool row as a checkpoint of the state and a ring of the inputs since (the CPU path).

docs/design/replay.md, has the design and the model that picks F; docs/contract.md, "Replay",
the rules. The kernel's replay specialisation (``StepSpec.replay_ring``: one-token plain steps and
verify steps; outputs replayed, or from the checkpoint) is held to this module.

Letters (docs/contract.md): P pool rows, B lanes, T draft tokens, H heads, D head dim, N state
size, R MIMO rank; F the flush length, L = F - 1 + draft the ring's entries.

A row's current state is the checkpoint (``state``, with ``Bstate``/``Xstate`` the token before
the ring) advanced by the ``ring.length`` committed tokens in the ring. With ``accepted``, a step
first commits that many of the row's pending drafts. Then, for a live lane whose row holds ``m``
committed tokens:

* one token, ``m < F - 1`` (append): ``out`` from the checkpoint and the ring without the new
  state (:func:`output_from_checkpoint`; with ``exact_outputs`` the replayed state's); the token's
  B, x, A, dt, trap go to entry ``m``; ``length = m + 1``. The state row is not written.
* one token, ``m >= F - 1`` (flush): the committed tokens and this one replayed on the checkpoint
  with the step's math and storage rounding (the T-token CPU path: T one-token steps bit for bit);
  the new checkpoint, this token's B/x as ``Bstate``/``Xstate``, ``length = 0``; the stepwise ``out``.
* T draft tokens (verify): if ``m >= F`` the committed tokens are flushed first; each draft's
  ``out`` from the checkpoint (the flush's new one, if it flushed), the committed tokens since and
  the drafts before it (with ``exact_outputs`` the replayed state's); the drafts go to the entries
  after the committed ones, uncommitted (``length = m``): rollback is not accepting them.

The rotary angle, destination rows, stochastic rounding and 8-bit states follow docs/contract.md,
"Replay". Padding lanes write zeros to ``out`` and touch no row of any pool.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .contract import lane_is_live, shown
from .reference import epilogue, mamba3_step_reference, rotated_bc
from .rotary import advance_angle
from .rounding import dequantize_rows
from .ring import Ring, check_fork_row, check_replay_arguments, check_replay_step, check_ring, new_ring
from .tensors import StepTensors
from .validation import checks

# Ring, new_ring and the checks (fork_row's too): mamba3_step.ring
__all__ = ["Current", "Ring", "check_fork_row", "check_materialize", "check_replay_arguments", "check_replay_step",
           "check_ring", "fork_row", "materialize", "new_ring", "output_from_checkpoint", "replay_step",
           "rotated_output_from_checkpoint"]

Tensor = torch.Tensor


class Current(NamedTuple):
    """A row's current state, as stepwise decoding holds it (:func:`materialize`)."""

    state: Tensor
    Bstate: Tensor
    Xstate: Tensor
    state_scale: Optional[Tensor] = None  # with an 8-bit state
    angle_state: Optional[Tensor] = None  # with rotary


def _ring_tokens(ring: Ring, rows: Tensor, count: int) -> dict:
    """The first ``count`` ring tokens of ``rows`` as per-lane inputs with a token axis."""
    coef = ring.coef[rows, :count]  # (n, count, H, 3)
    tokens = {"A": coef[..., 0], "dt": coef[..., 1], "trap": coef[..., 2], "B": ring.B[rows, :count],
              "x": ring.x[rows, :count]}
    if ring.offset is not None:
        # one value per (row, entry), held by every head: head 0's
        tokens["offset"], tokens["drawn_for"] = ring.offset[rows, :count, 0], ring.drawn_for[rows, :count, 0]
    if ring.angle is not None:
        tokens["angle"] = ring.angle[rows, :count]
    return tokens


def _step_tokens(t: StepTensors, lanes: Tensor, rows: Tensor, angle: Optional[Tensor], cd) -> dict:
    """This step's tokens of ``lanes`` (rows ``rows``) in the ring's form, with a token axis (T = 1
    without one); with stochastic rounding each token's offset and the row it draws for; with rotary
    the angle after each token, advanced from ``angle`` (the lanes' current angles)."""
    H = t.state.shape[1]
    fields = ("A", "dt", "trap", "B", "x") + (("angle_proj",) if angle is not None else ())
    picked = {f: getattr(t, f)[lanes] for f in fields}
    if t.x.dim() == 3:
        picked = {f: v[:, None] for f, v in picked.items()}
    if angle is not None:
        angles = []
        for j in range(picked["x"].shape[1]):
            angle = advance_angle(angle, picked["angle_proj"][:, j], picked["dt"][:, j], cd)
            angles.append(angle)
        picked["angle"] = torch.stack(angles, 1)
        del picked["angle_proj"]
    picked["B"] = picked["B"].expand(-1, -1, -1, H, -1)
    if t.rand_seed is not None:  # token t draws at offset + t (int64 wrap)
        T = picked["x"].shape[1]
        offset = t.rand_seed[1].to(torch.int64) + torch.arange(T, device=t.x.device)
        picked["offset"] = offset.expand(lanes.numel(), T)
        picked["drawn_for"] = rows.to(torch.int32)[:, None].expand(-1, T)  # the row the state is stored to
    return picked


def _rotated(t: StepTensors, tokens: dict, pairwise: bool, cd) -> dict:
    """Without rotary ``tokens``; with it their B replaced by B~ (B plus its bias, rotated by the
    token's angle, in ``cd``: what the step updates the state with) and ``B_prev`` the B~ rounded to
    ``Bstate``'s dtype (what the next token reads)."""
    if "angle" not in tokens:
        return tokens
    B = torch.stack([rotated_bc(t._replace(B=tokens["B"][:, j], C=tokens["B"][:, j]), tokens["angle"][:, j],
                                pairwise, cd)[0] for j in range(tokens["x"].shape[1])], 1)
    return {**tokens, "B": B, "B_prev": B.to(t.Bstate.dtype).to(cd)}


def _rotated_C(t: StepTensors, C: Tensor, tokens: dict, i: int, pairwise: bool, cd) -> Tensor:
    """Token ``i``'s C as its output reads it: with rotary C~ (``C`` plus its bias, rotated by the
    token's angle, in ``cd``)."""
    if "angle" not in tokens:
        return C
    return rotated_bc(t._replace(B=C, C=C), tokens["angle"][:, i], pairwise, cd)[1]


def _cat(first: dict, second: dict, upto: Optional[int] = None) -> dict:
    """Two token dicts joined on the token axis (the second's first ``upto`` tokens)."""
    return {f: torch.cat([first[f], second[f][:, :upto].to(first[f].dtype)], 1) for f in first if f in second}


def _base(t: StepTensors, rows: Tensor) -> tuple:
    """The checkpoints of ``rows``: ``(state, Bstate, Xstate, state_scale or None)``."""
    scale = None if t.state_scale is None else t.state_scale[rows]
    return t.state[rows], t.Bstate[rows], t.Xstate[rows], scale


def _replay(t: StepTensors, base: tuple, tokens: dict, C: Tensor, z: Optional[Tensor],
            compute_dtype: torch.dtype) -> tuple:
    """``tokens`` (T per lane) replayed on the checkpoints ``base`` (:func:`_base`) with the CPU path
    (dense, ``update_kv_state``): ``(state, Bstate, Xstate, state_scale, out)`` after the last token,
    ``out`` that token's (its ``C``/``z``; zeros stand in for the others', not needed). Without
    stochastic rounding one T-token step; with it one step per lane and token, drawing at the
    token's ``offset`` for the row it was stored to (``drawn_for``: a forked row's pending tokens
    drew for the row they were decoded in), as the stepwise step drew."""
    n, T = tokens["x"].shape[:2]
    C_all = torch.zeros((n, T) + tuple(C.shape[1:]), dtype=C.dtype, device=C.device)
    C_all[:, -1] = C
    z_all = None
    if z is None and t.zproj is not None:  # materialize: no token's output is needed
        z = torch.zeros(tokens["x"][:, 0].shape, dtype=tokens["x"].dtype, device=C.device)
    if z is not None:
        z_all = torch.zeros((n, T) + tuple(z.shape[1:]), dtype=z.dtype, device=z.device)
        z_all[:, -1] = z
    scale = None if base[3] is None else base[3].clone()
    dense = StepTensors(base[0].clone(), base[1].clone(), base[2].clone(), tokens["A"], tokens["B"], C_all, t.D,
                        tokens["x"], tokens["dt"], tokens["trap"], t.xproj, outproj=t.outproj, z=z_all,
                        zproj=t.zproj, state_scale=scale)
    if "offset" not in tokens:
        out = mamba3_step_reference(dense, update_kv_state=True, compute_dtype=compute_dtype)[:, -1]
        return dense.state, dense.Bstate, dense.Xstate, dense.state_scale, out
    outs = []
    for b in range(n):
        lane = slice(b, b + 1)
        for j in range(T):
            one = dense._replace(**{f: getattr(dense, f)[lane, j] for f in ("A", "B", "C", "x", "dt", "trap")},
                                 z=None if z_all is None else z_all[lane, j],
                                 state=dense.state[lane], Bstate=dense.Bstate[lane], Xstate=dense.Xstate[lane],
                                 state_scale=None if scale is None else scale[lane],
                                 rand_seed=torch.stack([t.rand_seed[0], tokens["offset"][b, j]]),
                                 rand_rows=tokens["drawn_for"][lane, j])
            last = mamba3_step_reference(one, update_kv_state=True, stochastic_rounding=True,
                                         compute_dtype=compute_dtype)[0]
        outs.append(last)
    return dense.state, dense.Bstate, dense.Xstate, dense.state_scale, torch.stack(outs)


def output_from_checkpoint(t: StepTensors, base: tuple, tokens: dict, C: Tensor, z: Optional[Tensor],
                           compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """``out`` of the last of ``tokens`` (tokens 1..k after the checkpoints ``base``, :func:`_base`:
    an 8-bit state read as ``q * scale``; its ``C`` (n, R, H, N) and ``z``), without the new state (docs/design/replay.md,
    the algebra)::

        y_k[r, d] = P_k sum_n s_0[d, n] C_k[r, n]
                  + sum_{j=0..k} w_j sum_r' xr_j[r', d] sum_n B_j[r', n] C_k[r, n]  +  D xr_k[r, d]
        P_k = alpha_1 ... alpha_k,   w_j = gamma_j alpha_{j+1} ... alpha_k + beta_{j+1} alpha_{j+2} ... alpha_k

    token 0 being the one before the ring (``Bstate``/``Xstate``); then the z gate and outproj as the
    step. In ``compute_dtype``, the checkpoint term first, then the others in token order."""
    cd = compute_dtype
    H, R = t.state.shape[1], t.xproj.shape[0]
    A, dt, trap = (tokens[f].to(cd) for f in ("A", "dt", "trap"))  # (n, k, H): tokens 1..k
    alpha = torch.exp(A * dt)
    beta = (1 - trap) * dt * alpha
    gamma = trap * dt
    k = A.shape[1]
    suffix = [torch.ones_like(alpha[:, 0])] * (k + 1)  # suffix[j] = alpha_{j+1} ... alpha_k (token j, 0..k)
    for j in range(k - 1, -1, -1):
        suffix[j] = alpha[:, j] * suffix[j + 1]
    own = [None] + [tokens["B"][:, j].to(cd) for j in range(k)]  # tokens 1..k: (n, R, H, N), B~ with rotary
    prev = [base[1].to(cd)] + [tokens.get("B_prev", tokens["B"])[:, j].to(cd) for j in range(k)]  # as read next
    xs = [base[2].to(cd)] + [tokens["x"][:, j].to(cd) for j in range(k)]  # (n, H, D)
    xproj = t.xproj.to(cd)
    C = C.to(cd).expand(-1, -1, H, -1)  # (n, R, H, N)
    s0 = (base[0] if base[3] is None else dequantize_rows(base[0], base[3].to(torch.float32))).to(cd)
    ys = [suffix[0][..., None] * (s0 * C[:, r, :, None, :]).sum(-1) for r in range(R)]  # (n, H, D)
    for j in range(k + 1):
        terms = []  # (weight, B): token j's own update and, one token later, the trapezoid's previous term
        if j >= 1:
            terms.append((gamma[:, j - 1] * suffix[j], own[j]))
        if j + 1 <= k:
            terms.append((beta[:, j] * suffix[j + 1], prev[j]))
        if len(terms) == 2 and "B_prev" not in tokens:  # the same B in both: one contraction
            terms = [(terms[0][0] + terms[1][0], own[j])]
        for w, Bj in terms:
            for r in range(R):
                acc = None
                for rp in range(R):
                    term = (xs[j] * xproj[rp]) * (Bj[:, rp] * C[:, r]).sum(-1)[..., None]
                    acc = term if acc is None else acc + term
                ys[r] = ys[r] + w[..., None] * acc
    xr = [xs[k] * xproj[r] for r in range(R)]
    return epilogue(ys, xr, t._replace(z=z), cd)


def rotated_output_from_checkpoint(t: StepTensors, base: tuple, tokens: dict, C: Tensor, z: Optional[Tensor],
                                   compute_dtype: torch.dtype = torch.float32, pairwise: bool = False) -> Tensor:
    """:func:`output_from_checkpoint` of ``tokens`` as the ring keeps them (B as received): with rotary
    (``tokens["angle"]``, (n, k, H, S), the angle after each token) each token's B~ and rounded B~,
    and the last token's C~, first."""
    C_k = _rotated_C(t, C, tokens, tokens["x"].shape[1] - 1, pairwise, compute_dtype)
    return output_from_checkpoint(t, base, _rotated(t, tokens, pairwise, compute_dtype), C_k, z, compute_dtype)


def _row_lengths(ring: Ring, rows: Tensor, who: str) -> Tensor:
    """The ring lengths of ``rows`` (int64, one per row), refused by name when a row's heads disagree."""
    lengths = ring.length[rows].to(torch.int64)  # (n, H)
    split = (lengths != lengths[:, :1]).any(1)
    if bool(split.any()):
        raise ValueError(f"{who}: ring.length must hold one value per row (the same at every head), got "
                         f"{lengths[split].tolist()} at rows {rows[split].tolist()}")
    return lengths[:, 0]


def _committed(ring: Ring, rows: Tensor, lanes: Tensor, num_accepted_tokens: Optional[Tensor]) -> Tensor:
    """Each live lane's committed ring length after ``accepted`` (B,) of its row's drafts are taken;
    refused by name when it leaves ``[0, capacity]`` or the heads of a row disagree."""
    m = _row_lengths(ring, rows, "replay_step")
    if num_accepted_tokens is not None:
        if not isinstance(num_accepted_tokens, torch.Tensor) or num_accepted_tokens.dtype != torch.int32 or num_accepted_tokens.dim() != 1:
            raise TypeError("replay_step: accepted must be an int32 tensor of shape (B,)")
        m = m + num_accepted_tokens.to(device=m.device, dtype=torch.int64)[lanes]
    bad = (m < 0) | (m > ring.B.shape[1])
    if bool(bad.any()):
        raise ValueError(f"replay_step: ring.length (plus accepted) must be in [0, {ring.B.shape[1]}] at the lanes' "
                         f"rows, got {m[bad].tolist()} at rows {rows[bad].tolist()}")
    return m


def _lane_writes(t: StepTensors, ring: Ring, flush_length: int, ln: Tensor, rw: Tensor, m: int, cd, pairwise: bool,
                 dst: Optional[Tensor] = None, exact: bool = False) -> tuple:
    """``(out, writes)`` of the live lanes ``ln`` (rows ``rw``) whose rows hold ``m`` committed tokens;
    a one-token step with ``dst`` (live rows other than ``rw``) flushes into ``dst``; ``exact``: every
    ``out`` from the replayed state (stepwise decoding's), else from the checkpoint algebra."""
    base = _base(t, rw)
    angle = None
    if t.angle_state is not None:  # the angle after the committed tokens
        angle = ring.angle[rw, m - 1] if m > 0 else t.angle_state[rw]
    now = _step_tokens(t, ln, rw if dst is None else dst, angle, cd)
    committed = _ring_tokens(ring, rw, m)
    one = t.x.dim() == 3
    C = t.C[ln][:, None] if one else t.C[ln]  # (n, T, R, H or 1, N)
    z = None if t.z is None else (t.z[ln][:, None] if one else t.z[ln])
    writes = []
    T = now["x"].shape[1]
    if (one and (m >= flush_length - 1 or dst is not None)) or (not one and m >= flush_length):  # flush the committed (and this) tokens
        tokens = _cat(committed, now) if one else committed
        C_last = _rotated_C(t, C[:, -1], tokens, tokens["x"].shape[1] - 1, pairwise, cd) if one else C[:, -1]
        *flushed, out = _replay(t, base, _rotated(t, tokens, pairwise, cd), C_last,
                                None if z is None else z[:, -1], cd)
        to = rw if dst is None else dst
        writes += [(pool, to, v) for pool, v in zip((t.state, t.Bstate, t.Xstate, t.state_scale), flushed)
                   if pool is not None]
        writes.append((ring.length, to, torch.zeros_like(to, dtype=torch.int32)[:, None]))
        if angle is not None:
            writes.append((t.angle_state, to, tokens["angle"][:, -1]))
        if one:
            return out, writes
        base, m, committed = (*flushed[:3], flushed[3]), 0, _ring_tokens(ring, rw, 0)
    outs = []
    for i in range(T):
        tokens = _cat(committed, now, i + 1)
        C_i = _rotated_C(t, C[:, i], tokens, tokens["x"].shape[1] - 1, pairwise, cd)
        z_i = None if z is None else z[:, i]
        rotated = _rotated(t, tokens, pairwise, cd)
        outs.append(_replay(t, base, rotated, C_i, z_i, cd)[-1] if exact
                    else output_from_checkpoint(t, base, rotated, C_i, z_i, cd))
    coef = torch.stack([now["A"], now["dt"], now["trap"]], -1)
    at = (rw[:, None], torch.arange(m, m + T, device=rw.device))
    writes += [(ring.B, at, now["B"]), (ring.x, at, now["x"]), (ring.coef, at, coef),
               (ring.length, rw, torch.full_like(rw, m + 1 if one else m, dtype=torch.int32)[:, None])]
    for field in ("offset", "drawn_for", "angle"):
        if field in now:
            value = now[field] if field == "angle" else now[field][..., None].expand(-1, -1, ring.length.shape[1])
            writes.append((getattr(ring, field), at, value))
    return (outs[0] if one else torch.stack(outs, 1)), writes


def replay_step(tensors: StepTensors, ring: Ring, flush_length: int, *,
                num_accepted_tokens: Optional[Tensor] = None, rotate_pairwise: bool = False, exact_outputs: bool = False,
                compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """One decode step of a pool with replay and flush length ``F`` (module docstring; docs/contract.md,
    "Replay").

    ``tensors`` is a pool-mode step (``state`` the checkpoints, ``Bstate``/``Xstate`` the tokens before
    the rings), one token per lane, or T draft tokens (a verify step: their outputs, the drafts
    stored after the committed entries, uncommitted). ``accepted`` (B,) int32 first commits that many
    of each lane's pending drafts. ``exact_outputs``: every ``out`` is stepwise decoding's, bit for bit
    (the state replayed, as the kernel does), else an append's is the checkpoint algebra's. Updates
    ``state``, ``Bstate``, ``Xstate`` (flushing lanes) and the ring in place and returns ``out``; every
    value is computed, and whatever is refused is refused by name, before anything is written.
    """
    check_replay_step(tensors, ring, flush_length, num_accepted_tokens, rotate_pairwise)
    t = tensors.with_out()
    P = t.state.shape[0]
    src = t.state_batch_indices.to(device=t.x.device, dtype=torch.int64)
    lanes = lane_is_live(src, P, t.null_slot_id).nonzero().squeeze(1)
    rows = src[lanes]
    m = _committed(ring, rows, lanes, num_accepted_tokens)
    # 0: written back to its row; 1: flushed into another live row; 2: a padding destination, nothing written
    kind = torch.zeros_like(rows)
    dst = rows
    if t.dst_state_batch_indices is not None:
        dst = t.dst_state_batch_indices.to(device=t.x.device, dtype=torch.int64)[lanes]
        kind = torch.where(lane_is_live(dst, P, t.null_slot_id), (dst != rows).long(), torch.full_like(rows, 2))
    if t.x.dim() == 4:
        room = torch.where(m >= flush_length, 0, m) + t.tokens > ring.B.shape[1]
        if bool(room.any()):
            raise ValueError(f"replay_step: no room for {t.tokens} drafts after {m[room].tolist()} committed tokens "
                             f"at rows {rows[room].tolist()} (ring of {ring.B.shape[1]} entries)")
    result = torch.zeros(t.out.shape, dtype=t.out.dtype, device=t.out.device)
    writes = []
    with torch.no_grad():
        for count in range(ring.B.shape[1] + 1):
            for k in range(3):
                pick = ((m == count) & (kind == k)).nonzero().squeeze(1)
                if pick.numel():
                    out, lane_writes = _lane_writes(t, ring, flush_length, lanes[pick], rows[pick], count, compute_dtype,
                                                    rotate_pairwise, dst[pick] if k == 1 else None, exact_outputs)
                    result[lanes[pick]] = out.to(result.dtype)
                    writes += lane_writes if k < 2 else []
        t.out.copy_(result)
        for target, index, value in writes:
            target[index] = value.to(target.dtype)
    return t.out


#: the integer dtypes ``rows`` may have (not bool, floating, complex or quantized ones)
_ROW_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _rows(rows, device) -> Tensor:
    """``rows`` as an int64 vector on ``device``, or the named TypeError."""
    if isinstance(rows, Tensor):
        checks.check_is_tensor("rows", rows)
        if rows.is_meta or rows.dtype not in _ROW_DTYPES or rows.dim() > 1:
            raise TypeError(f"rows: expected an integer tensor of at most one dimension holding data, got "
                            f"{rows.dtype} of shape {tuple(rows.shape)} on {rows.device}")
        return rows.to(device=device, dtype=torch.int64).reshape(-1)
    items = [rows] if isinstance(rows, int) else rows
    if not isinstance(items, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in items):
        raise TypeError(f"rows: expected an int, a list or tuple of ints, or an integer tensor, got {shown(rows)}")
    return torch.tensor(items, dtype=torch.int64, device=device).reshape(-1)


def check_materialize(tensors: StepTensors, ring: Ring, rows, who: str) -> tuple:
    """``(rows, lengths)`` (int64 tensors on the pools' device) of a materialize call (``who``), after
    its checks: rows in ``[0, P)``, each row's length one value in ``[0, L]``, ``rand_seed`` given
    with offsets (``ValueError`` naming them); ``rows`` an int, a sequence of ints or an integer tensor
    of at most one dimension (``TypeError`` otherwise)."""
    rows = _rows(rows, tensors.state.device)
    P = tensors.state.shape[0]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= P):
        raise ValueError(f"{who}: rows must be in [0, {P}), got {rows.tolist()}")
    length = _row_lengths(ring, rows, who)
    if bool(((length < 0) | (length > ring.B.shape[1])).any()):
        raise ValueError(f"{who}: ring.length must be in [0, {ring.B.shape[1]}], got {length.tolist()}")
    if ring.offset is not None and tensors.rand_seed is None:
        raise ValueError(f"{who}: a ring with offsets (stochastic rounding) needs tensors.rand_seed (its seed)")
    return rows, length


def materialize(tensors: StepTensors, ring: Ring, rows, *, rotate_pairwise: bool = False,
                compute_dtype: torch.dtype = torch.float32) -> Current:
    """The current state of pool ``rows`` (a list or int tensor of real rows), a :class:`Current`: the
    checkpoint advanced by the ring's committed tokens with the flush's math (with stochastic
    rounding, ``tensors.rand_seed``'s seed and each token's recorded offset), equal bit for bit to
    what stepwise decoding holds. Reads ``tensors``' rows, seed and weights (its per-lane inputs are
    not read); writes nothing."""
    rows, length = check_materialize(tensors, ring, rows, "materialize")
    current = [None if v is None else v.clone() for v in _base(tensors, rows)]
    current.append(None if tensors.angle_state is None else tensors.angle_state[rows].clone())
    with torch.no_grad():
        for count in range(1, ring.B.shape[1] + 1):
            pick = (length == count).nonzero().squeeze(1)
            if pick.numel() == 0:
                continue
            rw = rows[pick]
            tokens = _ring_tokens(ring, rw, count)
            C = torch.zeros(tokens["B"][:, 0].shape, dtype=torch.float32, device=rw.device)
            flushed = _replay(tensors, _base(tensors, rw), _rotated(tensors, tokens, rotate_pairwise, compute_dtype), C,
                              None, compute_dtype)[:4]
            flushed += (tokens["angle"][:, -1] if "angle" in tokens else None,)
            for held, v in zip(current, flushed):
                if held is not None:
                    held[pick] = v
    return Current(*current)


def fork_row(tensors: StepTensors, ring: Ring, src: int, dst: int) -> None:
    """Row ``dst`` becomes a copy of row ``src``: the checkpoint, ``Bstate``/``Xstate`` (the scale and angle
    rows with them) and the ring with its length (no replay: the ring is copied as it is).

    Checked before any row is written (:func:`check_fork_row`): ``tensors`` a :class:`StepTensors` and ``ring``
    a :class:`Ring` whose row tensors are strided tensors of ``P`` rows (``state``'s) on ``state``'s device,
    writable here; ``src``/``dst`` ints naming real rows (in ``[0, P)``, not ``tensors.null_slot_id``: a
    padding id names no row). TypeError/ValueError naming the argument."""
    pools = check_fork_row(tensors, ring, src, dst)
    for pool in pools:
        pool[dst] = pool[src]
