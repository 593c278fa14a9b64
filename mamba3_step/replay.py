"""Replay: a pool row as a checkpoint of the state and a ring of the inputs since (the CPU path).

docs/design.md, "Replay", has the design and the model that picks K; docs/contract.md, "Replay",
the rules. The kernel is not built yet: this module is the reference it will be held to.

Letters (docs/contract.md): P pool rows, B lanes, H heads, D head dim, N state size, R MIMO rank;
K the flush length (a row's state is written every K tokens), L = K - 1 the ring's entries.

A row's current state is the checkpoint (``state``, with ``Bstate``/``Xstate`` the token before
the ring) advanced by the ``ring.length`` committed tokens in the ring. A step of a live lane:

* ``length < K - 1`` (append): ``out`` from the checkpoint and the ring without the new state
  (:func:`append_output`); this token's B, x, A, dt, trap go to ring entry ``length``;
  ``length + 1``. The state row is read, never written.
* ``length == K - 1`` (flush): the ring's tokens and this one replayed on the checkpoint with the
  step's math and storage rounding (the T-token CPU path, which equals T one-token steps bit for
  bit); the new checkpoint, this token's B/x as ``Bstate``/``Xstate``, ``length = 0``. ``out`` is
  the stepwise one.

Padding lanes (docs/contract.md) write zeros to ``out`` and touch no row of any pool.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .contract import lane_is_live
from .reference import epilogue, mamba3_step_reference
from .tensors import StepTensors
from .validation.step import check_step_inputs

__all__ = ["Ring", "append_output", "fork_row", "materialize", "new_ring", "replay_step"]

Tensor = torch.Tensor


class Ring(NamedTuple):
    """One layer's ring pools: entry ``j < length[p]`` of row ``p`` is the ``j``-th token after the
    checkpoint of row ``p``."""

    B: Tensor  # (P, L, R, H, N), B's dtype: the token's B (per head, a shared B expanded)
    x: Tensor  # (P, L, H, D), x's dtype
    coef: Tensor  # (P, L, H, 3) float32: the token's A, dt, trap
    length: Tensor  # (P,) int32: committed tokens

    @property
    def K(self) -> int:
        """The flush length: the ring holds K - 1 tokens, the K-th flushes."""
        return self.B.shape[1] + 1


def new_ring(rows: int, K: int, mimo: int, heads: int, dstate: int, headdim: int, *,
             kv_dtype: torch.dtype, x_dtype: torch.dtype, device=None) -> Ring:
    """An empty ring for ``rows`` pool rows with flush length ``K`` (2 to 16)."""
    if not isinstance(K, int) or not 2 <= K <= 16:
        raise ValueError(f"new_ring: K must be an int in [2, 16], got {K!r}")
    L = K - 1
    return Ring(torch.zeros(rows, L, mimo, heads, dstate, dtype=kv_dtype, device=device),
                torch.zeros(rows, L, heads, headdim, dtype=x_dtype, device=device),
                torch.zeros(rows, L, heads, 3, dtype=torch.float32, device=device),
                torch.zeros(rows, dtype=torch.int32, device=device))


def _check(t: StepTensors, ring: Ring) -> None:
    """What this CPU path takes: pool mode, one token, the state written back to its source."""
    unsupported = {"dst_state_batch_indices": t.dst_state_batch_indices, "num_accepted_tokens": t.num_accepted_tokens,
                   "angle_state": t.angle_state, "rand_seed": t.rand_seed, "state_scale": t.state_scale,
                   "state_out": t.state_out}
    for name, v in unsupported.items():
        if v is not None:
            raise ValueError(f"replay_step: {name} is not supported with replay yet (docs/contract.md, 'Replay')")
    if not t.pool:
        raise ValueError("replay_step: replay is a pool-mode step: state_batch_indices is required")
    if t.x.dim() != 3:
        raise ValueError(f"replay_step: one token per lane (x of shape (B, H, D)), got x {tuple(t.x.shape)}")
    P, H, D, N = t.state.shape
    R = t.xproj.shape[0]
    want = {"B": (P, ring.K - 1, R, H, N), "x": (P, ring.K - 1, H, D), "coef": (P, ring.K - 1, H, 3), "length": (P,)}
    dtypes = {"B": t.Bstate.dtype, "x": t.Xstate.dtype, "coef": torch.float32, "length": torch.int32}
    for name, shape in want.items():
        got = getattr(ring, name)
        if tuple(got.shape) != shape or got.dtype != dtypes[name] or got.device != t.state.device:
            raise ValueError(f"replay_step: ring.{name} must be {dtypes[name]} of shape {shape} on {t.state.device}, "
                             f"got {got.dtype} {tuple(got.shape)} on {got.device}")


def _tokens(ring: Ring, rows: Tensor, count: int, heads: int) -> dict:
    """The first ``count`` ring tokens of ``rows`` as per-lane inputs with a token axis."""
    coef = ring.coef[rows, :count]  # (n, count, H, 3)
    return {"A": coef[..., 0], "dt": coef[..., 1], "trap": coef[..., 2], "B": ring.B[rows, :count],
            "x": ring.x[rows, :count]}


def _with_token(tokens: dict, t: StepTensors, lanes: Tensor, heads: int) -> dict:
    """``tokens`` with this step's token of ``lanes`` appended on the token axis."""
    now = {"A": t.A[lanes], "dt": t.dt[lanes], "trap": t.trap[lanes], "x": t.x[lanes],
           "B": t.B[lanes].expand(-1, -1, heads, -1)}
    return {f: torch.cat([tokens[f], now[f][:, None].to(tokens[f].dtype)], 1) for f in tokens}


def _replay(t: StepTensors, rows: Tensor, tokens: dict, C: Tensor, z: Optional[Tensor],
            compute_dtype: torch.dtype) -> tuple:
    """``tokens`` (T per lane) replayed on the checkpoints of ``rows`` with the T-token CPU path
    (dense, ``update_kv_state``): ``(state, Bstate, Xstate, out)`` after the last token, ``out``
    that token's (its ``C``/``z``; the others' outputs are not needed: zeros stand in for theirs)."""
    n, T = tokens["x"].shape[:2]
    C_all = torch.zeros((n, T) + tuple(C.shape[1:]), dtype=C.dtype, device=C.device)
    C_all[:, -1] = C
    z_all = None
    if z is None and t.zproj is not None:  # materialize: no token's output is needed
        z = torch.zeros(tokens["x"][:, 0].shape, dtype=tokens["x"].dtype, device=C.device)
    if z is not None:
        z_all = torch.zeros((n, T) + tuple(z.shape[1:]), dtype=z.dtype, device=z.device)
        z_all[:, -1] = z
    dense = StepTensors(t.state[rows].clone(), t.Bstate[rows].clone(), t.Xstate[rows].clone(), tokens["A"],
                        tokens["B"], C_all, t.D, tokens["x"], tokens["dt"], tokens["trap"], t.xproj,
                        outproj=t.outproj, z=z_all, zproj=t.zproj)
    out = mamba3_step_reference(dense, update_kv_state=True, compute_dtype=compute_dtype)
    return dense.state, dense.Bstate, dense.Xstate, out[:, -1]


def append_output(t: StepTensors, ring: Ring, lanes: Tensor, rows: Tensor, count: int,
                  compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """``out`` of this step's token for ``lanes`` whose rows hold ``count`` ring tokens, from the
    checkpoint and the ring, without the new state (docs/design.md, "Replay", the algebra):

        y_k[r, d] = P_k sum_n s_0[d, n] C_k[r, n]
                  + sum_{j=0..k} w_j sum_r' xr_j[r', d] sum_n B_j[r', n] C_k[r, n]  +  D xr_k[r, d]
        P_k = alpha_1 ... alpha_k,   w_j = gamma_j alpha_{j+1} ... alpha_k + beta_{j+1} alpha_{j+2} ... alpha_k

    with token 0 the one before the ring (``Bstate``/``Xstate``), tokens 1..count the ring's and
    ``k = count + 1`` this one; then the z gate and outproj as the step. In ``compute_dtype``, the
    checkpoint term first, then the ring terms in token order."""
    cd = compute_dtype
    H = t.state.shape[1]
    R = t.xproj.shape[0]
    tokens = _with_token(_tokens(ring, rows, count, H), t, lanes, H)
    A, dt, trap = (tokens[f].to(cd) for f in ("A", "dt", "trap"))  # (n, k, H): tokens 1..k
    alpha = torch.exp(A * dt)
    beta = (1 - trap) * dt * alpha
    gamma = trap * dt
    k = count + 1
    suffix = [torch.ones_like(alpha[:, 0])] * (k + 1)  # suffix[j] = alpha_{j+1} ... alpha_k (token j, 0..k)
    for j in range(k - 1, -1, -1):
        suffix[j] = alpha[:, j] * suffix[j + 1]
    Bs = [t.Bstate[rows].to(cd)] + [tokens["B"][:, j].to(cd) for j in range(k)]  # tokens 0..k: (n, R, H, N)
    xs = [t.Xstate[rows].to(cd)] + [tokens["x"][:, j].to(cd) for j in range(k)]  # (n, H, D)
    xproj = t.xproj.to(cd)
    C = t.C[lanes].to(cd).expand(-1, -1, H, -1)  # (n, R, H, N)
    s0 = t.state[rows].to(cd)
    ys = [suffix[0][..., None] * (s0 * C[:, r, :, None, :]).sum(-1) for r in range(R)]  # (n, H, D)
    for j in range(k + 1):
        w = gamma[:, j - 1] * suffix[j] if j >= 1 else torch.zeros_like(suffix[0])
        if j + 1 <= k:
            w = w + beta[:, j] * suffix[j + 1]
        for r in range(R):
            acc = None
            for rp in range(R):
                term = (xs[j] * xproj[rp]) * (Bs[j][:, rp] * C[:, r]).sum(-1)[..., None]
                acc = term if acc is None else acc + term
            ys[r] = ys[r] + w[..., None] * acc
    xr = [xs[k] * xproj[r] for r in range(R)]
    return epilogue(ys, xr, t._replace(z=None if t.z is None else t.z[lanes]), cd)


def replay_step(tensors: StepTensors, ring: Ring, *, compute_dtype: torch.dtype = torch.float32) -> Tensor:
    """One decode step of a pool with replay (module docstring; docs/contract.md, "Replay").

    ``tensors`` is a one-token pool-mode step (``state`` the checkpoints, ``Bstate``/``Xstate`` the
    tokens before the rings), ``ring`` the rings of the same rows. Updates ``state``, ``Bstate``,
    ``Xstate`` (flushing lanes) and the ring (appending lanes) in place and returns ``out``. Every
    value is computed before anything is written; a ring length outside ``[0, K - 1]`` at a live
    lane is refused by name before anything is written.
    """
    check_step_inputs(tensors, update_kv_state=True)
    t = tensors.with_out()
    _check(t, ring)
    P, H = t.state.shape[:2]
    K = ring.K
    src = t.state_batch_indices.to(device=t.x.device, dtype=torch.int64)
    lanes = lane_is_live(src, P, t.null_slot_id).nonzero().squeeze(1)
    rows = src[lanes]
    length = ring.length[rows].to(torch.int64)
    bad = (length < 0) | (length > K - 1)
    if bool(bad.any()):
        raise ValueError(f"replay_step: ring.length must be in [0, K - 1] = [0, {K - 1}] at the lanes' rows, "
                         f"got {ring.length[rows[bad]].tolist()} at rows {rows[bad].tolist()}")
    result = torch.zeros(t.out.shape, dtype=t.out.dtype, device=t.out.device)
    writes = []
    with torch.no_grad():
        for count in range(K):
            pick = (length == count).nonzero().squeeze(1)
            if pick.numel() == 0:
                continue
            ln, rw = lanes[pick], rows[pick]
            if count < K - 1:  # append
                result[ln] = append_output(t, ring, ln, rw, count, compute_dtype).to(result.dtype)
                coef = torch.stack([t.A[ln], t.dt[ln], t.trap[ln]], -1)
                writes += [(ring.B, (rw, count), t.B[ln].expand(-1, -1, H, -1)), (ring.x, (rw, count), t.x[ln]),
                           (ring.coef, (rw, count), coef),
                           (ring.length, rw, torch.full_like(rw, count + 1, dtype=torch.int32))]
            else:  # flush
                tokens = _with_token(_tokens(ring, rw, count, H), t, ln, H)
                z = None if t.z is None else t.z[ln]
                state, Bstate, Xstate, out = _replay(t, rw, tokens, t.C[ln].expand(-1, -1, H, -1), z, compute_dtype)
                result[ln] = out.to(result.dtype)
                writes += [(t.state, rw, state), (t.Bstate, rw, Bstate), (t.Xstate, rw, Xstate),
                           (ring.length, rw, torch.zeros_like(rw, dtype=torch.int32))]
        t.out.copy_(result)
        for target, index, value in writes:
            target[index] = value.to(target.dtype)
    return t.out


def materialize(tensors: StepTensors, ring: Ring, rows, *, compute_dtype: torch.dtype = torch.float32) -> tuple:
    """The current ``(state, Bstate, Xstate)`` of pool ``rows`` (a list or int tensor of real rows): the
    checkpoint advanced by the ring's committed tokens with the flush's math, equal bit for bit to
    what stepwise decoding holds. Reads ``tensors``' ``state``, ``Bstate``, ``Xstate`` and weights
    (its per-lane inputs are not read); writes nothing."""
    rows = torch.as_tensor(rows, dtype=torch.int64, device=tensors.state.device).reshape(-1)
    P, H = tensors.state.shape[:2]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= P):
        raise ValueError(f"materialize: rows must be in [0, {P}), got {rows.tolist()}")
    length = ring.length[rows].to(torch.int64)
    if bool(((length < 0) | (length > ring.K - 1)).any()):
        raise ValueError(f"materialize: ring.length must be in [0, {ring.K - 1}], got {length.tolist()}")
    state, Bstate, Xstate = tensors.state[rows].clone(), tensors.Bstate[rows].clone(), tensors.Xstate[rows].clone()
    with torch.no_grad():
        for count in range(1, ring.K):
            pick = (length == count).nonzero().squeeze(1)
            if pick.numel() == 0:
                continue
            tokens = _tokens(ring, rows[pick], count, H)
            C = torch.zeros_like(tokens["B"][:, 0])
            state[pick], Bstate[pick], Xstate[pick], _ = _replay(tensors, rows[pick], tokens, C, None, compute_dtype)
    return state, Bstate, Xstate


def fork_row(tensors: StepTensors, ring: Ring, src: int, dst: int) -> None:
    """Row ``dst`` becomes a copy of row ``src``: the checkpoint, ``Bstate``/``Xstate`` and the ring
    with its length (no replay: the ring is copied as it is)."""
    for pool in (tensors.state, tensors.Bstate, tensors.Xstate, *ring):
        pool[dst] = pool[src]
