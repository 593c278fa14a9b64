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
  mode, pool mode with padding lanes, separate destination rows, ``update_kv_state`` and
  multi-token steps (speculative decoding: per-token destinations, accepted-token sources).
  ``mamba3_step_fn`` runs it on CPU tensors (in float32); tests run it in float64.

Both take the step's tensors as one :class:`~mamba3_step.tensors.StepTensors`. Neither
validates its inputs: ``mamba3_step_fn`` does that first
(:func:`mamba3_step.validation.check_step_inputs`).
"""

from __future__ import annotations

import torch

from .contract import ROUNDED_STATE_DTYPES, SCALED_STATE_DTYPES, dtype_name, lane_is_live, source_rows
from .rotary import advance_angle, angle_cos_sin, rotate_pairs
from .rounding import dequantize_rows, quantize_rows, state_bits, stochastic_round
from .tensors import LANE_FIELDS, StepTensors

__all__ = ["epilogue", "rotated_bc", "step_math", "mamba3_step_reference", "token_rows"]


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
    if (t.z is None) != (t.zproj is None):
        raise ValueError("step_math: z and zproj must be given together")
    cd = compute_dtype

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.to(cd)

    R = t.xproj.shape[0]
    state_c, Bstate_c, B_c, C_c = f(t.state), f(t.Bstate), f(t.B), f(t.C)
    x_c, Xstate_c, xproj_c = f(t.x), f(t.Xstate), f(t.xproj)
    A_c, dt_c, trap_c = f(t.A), f(t.dt), f(t.trap)

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

    ys = [(new_state * C_c[:, r, :, None, :]).sum(-1) for r in range(R)]  # R tensors of (B, H, D)
    return new_state, epilogue(ys, xr, t, cd)


def epilogue(ys: list, xr: list, t: StepTensors, compute_dtype: torch.dtype) -> torch.Tensor:
    """From the R contractions ``ys[r] = sum_n new[d, n] C[r, n]`` (B, H, D) to ``out``:
    ``+ D xr[r]``, the z gate, the outproj sum (docs/contract.md, "The math"), in ``compute_dtype``."""
    D_c = t.D.to(compute_dtype)
    ys = [y + D_c[None, :, None] * x for y, x in zip(ys, xr)]
    if t.z is not None:
        z_c, zproj_c = t.z.to(compute_dtype), t.zproj.to(compute_dtype)
        ys = [y * torch.nn.functional.silu(z_c * zproj_c[r]) for r, y in enumerate(ys)]
    if t.outproj is None:
        return torch.stack(ys, dim=1)  # (B, R, H, D)
    outproj_c = t.outproj.to(compute_dtype)
    out = ys[0] * outproj_c[0]
    for r in range(1, len(ys)):
        out = out + ys[r] * outproj_c[r]
    return out


def rotated_bc(t: StepTensors, angle: torch.Tensor, pairwise: bool, compute_dtype) -> tuple:
    """``(B~, C~)``: ``t.B``/``t.C`` (L, R, H or 1, N) plus their biases, rotated by the fixed-point
    ``angle`` (L, H, S) (docs/contract.md, "Rotary angle"), in ``compute_dtype``, (L, R, H, N)."""
    cos, sin = angle_cos_sin(angle, compute_dtype)
    cos, sin = cos[:, None], sin[:, None]  # (L, 1, H, S): the same angle for every rank
    H = angle.shape[1]
    out = []
    for v, bias in ((t.B, t.B_bias), (t.C, t.C_bias)):
        v = v.to(compute_dtype).expand(-1, -1, H, -1)
        if bias is not None:
            v = v + bias.to(compute_dtype)
        out.append(rotate_pairs(v, cos, sin, pairwise))
    return tuple(out)


def mamba3_step_reference(
    tensors: StepTensors,
    *,
    update_kv_state: bool = False,
    rotate_pairwise: bool = False,
    stochastic_rounding: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The full in-place contract of ``mamba3_step_fn``, in PyTorch (no validation).

    Shapes and dtypes are those of ``mamba3_step_fn`` (see its docstring and docs/contract.md).

    Tokens: with T-less per-lane inputs (``x`` (B, H, D)) this is one step; with a token axis
    (``x`` (B, T, H, D), ...) the T tokens run in order, token t's "previous B/x" being token
    t-1's (the ``Bstate``/``Xstate`` row for t = 0) and the state carrying over, stored
    precision between tokens (so T tokens equal T single steps bit for bit).

    Dense mode (``state_batch_indices is None``): lane b reads row b of ``state`` (B, H, D, N),
    ``Bstate`` (B, R, H, N) and ``Xstate`` (B, H, D); the final state goes to ``state_out`` if
    given, else into ``state`` in place; with ``update_kv_state`` the last token's ``B``/``x``
    are stored into row b of ``Bstate``/``Xstate``.

    Pool mode: ``state`` is (P, H, D, N), ``Bstate`` (P, R, H, N), ``Xstate`` (P, H, D). Lane b
    reads row ``src`` (:func:`mamba3_step.contract.source_rows`: ``state_batch_indices[b]``, or
    the accepted entry of a (B, K) tensor); it is padding unless ``src`` is a real row
    (:func:`mamba3_step.contract.lane_is_live`): its ``out`` is written as exact zeros and it
    reads and writes no pool row. A live lane writes the final state (cast to ``state``'s dtype)
    to row ``dst = dst_state_batch_indices[b]`` (default ``src``) when that is a real row, with
    ``update_kv_state`` the last token's ``B``/``x`` into ``Bstate[dst]``/``Xstate[dst]``; with a
    (B, T) ``dst_state_batch_indices`` the state after token t (and token t's B/x) go to row
    ``dst[b, t]`` instead. All reads happen before any write.

    Rotary (``angle_state`` given): each token first advances the lane's angle row and rotates
    its B and C (:func:`rotated_bc`; ``rotate_pairwise`` picks the pairs); the step runs with the
    rotated, unrounded B~ and C~; the angle is written where the state is, and B~ (rounded to
    Bstate's dtype, which is also what the next token reads as its previous B) where B would be.

    Stochastic rounding (``rand_seed`` given): each token's new state is rounded to the state's
    16-bit dtype by :func:`mamba3_step.rounding.stochastic_round` (from its float32 value) with
    the bits :func:`mamba3_step.rounding.state_bits` draws for ``[seed, offset + t]``, the lane's
    row for that token (its destination for the token, else its final destination, else its
    source; the lane in dense mode) as an unsigned 32-bit value, the head, d and n. An 8-bit
    state (int8, float8_e4m3fn) is read as ``q * state_scale`` and stored by
    :func:`mamba3_step.rounding.quantize_rows` with the same bits: its values to ``state``, its
    scales to ``state_scale``, at the same rows.

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
        rounding = _RoundingRule(t, stochastic_rounding)
        writes = _step_writes(t, update_kv_state, rotate_pairwise, rounding, compute_dtype)
        # Commit, in order (a later write to a row wins): every value is computed and cast;
        # nothing below allocates a result or can fail on validated inputs, so a failure above
        # leaves every tensor as it was.
        for target, rows, value in writes:
            if rows is None:
                target.copy_(value)
            else:
                target[rows] = value
    return t.out


class _RoundingRule:
    """How a token's new state is stored: cast to the state's dtype, stochastically rounded with the
    bits of ``[seed, offset + t]`` and each lane's row (docs/contract.md, "Stochastic rounding"), or
    quantised to 8 bits with a scale per (row, head, d) ("8-bit states").

    A stored state is a pair ``(value, scale)``: ``value`` in the state's dtype, ``scale`` the
    (L, H, D) fp32 scales of an 8-bit state (else None). :meth:`load` turns it into what the next
    token's math reads."""

    def __init__(self, t: StepTensors, stochastic: bool):
        self.dtype = t.state.dtype
        self.format = dtype_name(self.dtype) if dtype_name(self.dtype) in SCALED_STATE_DTYPES else None
        # a wider state (the float64 test reference) stores the value as it is
        stochastic = stochastic and dtype_name(self.dtype) in ROUNDED_STATE_DTYPES
        self.seed_offset = [int(v) for v in t.rand_seed.tolist()] if stochastic else None
        self.rows = None  # per token: the rows the bits are drawn for, one per live lane

    def load(self, value: torch.Tensor, scale) -> torch.Tensor:
        """The state a token's math reads: an 8-bit state dequantised (``q * scale`` in fp32)."""
        # the float64 test reference widens the scales: they hold fp32 values, narrowed exactly
        return value if self.format is None else dequantize_rows(value, scale.to(torch.float32))

    def store(self, new_state: torch.Tensor, k: int) -> tuple:
        """Token ``k``'s new state (compute dtype) as stored: ``(value, scale or None)``."""
        if self.seed_offset is None:
            return new_state.to(self.dtype), None
        seed, offset = self.seed_offset
        rows = self.rows[k].to(torch.int64) & 0xFFFFFFFF
        _, H, D, N = new_state.shape
        bits = state_bits(seed, (offset + k + 2**63) % 2**64 - 2**63, rows.cpu(), H, D, N).to(new_state.device)
        if self.format is not None:
            return quantize_rows(new_state.to(torch.float32), bits, self.format)
        return stochastic_round(new_state.to(torch.float32), bits, self.dtype), None


def _step_writes(t: StepTensors, update_kv_state: bool, rotate_pairwise: bool, rounding: _RoundingRule,
                 compute_dtype) -> list:
    """``(target, rows or None, value)`` for each tensor the step writes, in write order."""
    if t.pool:
        src = source_rows(t.state_batch_indices.to(t.x.device), t.num_accepted_tokens)
        lanes = lane_is_live(src, t.state.shape[0], t.null_slot_id).nonzero().squeeze(1)  # in batch order
        rows = src[lanes]
    else:
        lanes = rows = torch.arange(t.batch, device=t.x.device)
    rounding.rows = token_rows(t, lanes)
    result, states = _run_tokens(t, t.dense_lanes(lanes, rows), lanes, rotate_pairwise, rounding, compute_dtype)
    writes = [(t.out, None, result)]
    if not t.pool:
        (state, scale), B, x, angle = states[-1]
        target = t.state_out if t.state_out is not None else t.state
        writes.append((target, None, state.to(target.dtype)))
        if scale is not None:
            writes.append((t.state_scale, None, scale))
        if update_kv_state:
            writes += [(t.Bstate, None, B.to(t.Bstate.dtype)), (t.Xstate, None, x.to(t.Xstate.dtype))]
        if angle is not None:
            writes.append((t.angle_state, None, angle))
        return writes
    dst = t.dst_state_batch_indices
    if dst is not None and dst.dim() == 2:  # a row per token
        for k, finals in enumerate(states):
            targets = dst[:, k].to(device=t.x.device, dtype=torch.int64)
            writes += _row_writes(t, targets[lanes], *finals, update_kv_state)
    else:
        targets = src if dst is None else dst.to(device=t.x.device, dtype=torch.int64)
        writes += _row_writes(t, targets[lanes], *states[-1], update_kv_state)
    return writes


def token_rows(t: StepTensors, lanes) -> list:
    """Per token, the row each live lane's state is stored to (or would be, when that is padding):
    its destination for the token, else its final destination, else its source; in dense mode
    ``rand_rows[b]``, else the lane."""
    if not t.pool:
        return [lanes if t.rand_rows is None else t.rand_rows.to(t.x.device)[lanes]] * t.tokens
    dst = t.dst_state_batch_indices
    if dst is not None and dst.dim() == 2:
        return [dst[:, k].to(t.x.device)[lanes] for k in range(t.tokens)]
    rows = source_rows(t.state_batch_indices.to(t.x.device), t.num_accepted_tokens) if dst is None else dst
    return [rows.to(t.x.device)[lanes]] * t.tokens


def _run_tokens(t: StepTensors, dense: StepTensors, lanes, rotate_pairwise: bool, rounding, compute_dtype) -> tuple:
    """Run the T tokens of the live ``lanes`` (``dense``: their gathered rows and inputs).

    Returns ``out``'s new value (zeros for padding lanes) and, per token, the live lanes'
    ``(stored, B, x, angle)`` after it (``stored``: the state as it is kept between tokens, a
    ``(value, scale)`` pair of :class:`_RoundingRule`; B rotated and in Bstate's dtype with
    rotary; angle None without)."""
    stored = (dense.state, dense.state_scale)
    Bprev, xprev, angle = dense.Bstate, dense.Xstate, dense.angle_state
    result = torch.zeros(t.out.shape, dtype=t.out.dtype, device=t.out.device)
    states = []
    for k in range(t.tokens):
        tok = t.token(k)
        lane_inputs = {f: (None if getattr(tok, f) is None else getattr(tok, f).index_select(0, lanes))
                       for f in LANE_FIELDS}
        step = dense._replace(state=rounding.load(*stored), Bstate=Bprev, Xstate=xprev, **lane_inputs)
        if angle is not None:
            angle = advance_angle(angle, step.angle_proj, step.dt, compute_dtype)
            B_rot, C_rot = rotated_bc(step, angle, rotate_pairwise, compute_dtype)
            step = step._replace(B=B_rot, C=C_rot)
        new_state, y = step_math(step, compute_dtype=compute_dtype)
        (result[:, k] if t.x.dim() == 4 else result)[lanes] = y.to(result.dtype)
        stored = rounding.store(new_state, k)
        Bprev, xprev = step.B.to(t.Bstate.dtype), lane_inputs["x"]
        states.append((stored, Bprev, xprev, angle))
    return result, states


def _row_writes(t: StepTensors, targets, stored, B, x, angle, update_kv_state: bool) -> list:
    """Writes of the ``stored`` state (and its scales, B/x, the angle) to rows ``targets``, one per
    live lane (padding targets skipped)."""
    write = lane_is_live(targets, t.state.shape[0], t.null_slot_id)
    rows = targets[write]
    state, scale = stored
    writes = [(t.state, rows, state[write].to(t.state.dtype))]
    if scale is not None:
        writes.append((t.state_scale, rows, scale[write]))
    if update_kv_state:
        writes += [(t.Bstate, rows, B[write].to(t.Bstate.dtype)), (t.Xstate, rows, x[write].to(t.Xstate.dtype))]
    if angle is not None:
        writes.append((t.angle_state, rows, angle[write]))
    return writes
