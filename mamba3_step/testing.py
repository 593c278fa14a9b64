"""Random inputs and bit-level comparison for tests, the demo and benchmarks: the one input factory.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.

* :func:`make_inputs`: a whole step's arguments, keyed like ``mamba3_step_fn``'s parameters;
  built from the three parts a server keeps apart, each also usable alone:
  :func:`row_tensors` (state, Bstate, Xstate: the pool or dense rows), :func:`lane_inputs`
  (this step's A, B, C, x, dt, trap, z) and :func:`layer_weights` (D, xproj, zproj, outproj).
* :class:`LayerShape`: one layer's sizes and dtypes, as the demos take them.
* :func:`poison_`: random bit patterns (NaN, inf, huge, tiny, -0.0) in place; :func:`poison_pool`:
  random finite values in every row of a ``StatePool``.
* :func:`bits` / :func:`bits_equal`: NaN-safe bit-for-bit comparison.
* :func:`padded_indices`: race-free pool indices whose padding lanes hold every padding kind
  (-1, INT32_MIN, P, INT32_MAX, the null slot), for the PTX tier's tests and ``verify``;
  :func:`speculative_indices`: the same for a T-token step (candidate source rows, accepted
  counts, a destination row per token); :func:`step_indices`: either, in the form a given
  specialisation takes (and :func:`pool_rows`, the pool size it needs).

Values are O(1), like a normalised model's, so that chained layers (the demo feeds one layer's
``out`` to the next) stay O(1): state, Xstate, x, z, D ~ N(0, 1); B, C, Bstate ~ N(0, 0.5^2);
A = -exp(N(0, 0.5^2)) (decay); dt in [0.01, 0.51); trap in [0, 1); projections ~ N(0, 0.5^2).
Data are drawn in float32 on the CPU from the generator, then cast and moved, so a seed gives
the same values on every device.
Dtypes are given by name (``"bfloat16"``) or as torch dtypes.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch

from .contract import INT32_MAX, INT32_MIN, SCALED_STATE_DTYPES, as_torch_dtype, dtype_name, source_rows
from .rounding import quantize_rows

__all__ = ["INPUT_DTYPES", "LayerShape", "inputs_for", "with_rotary", "SPECULATIVE_PAD_KINDS", "bits", "bits_equal", "lane_inputs",
           "layer_weights", "make_inputs", "padded_indices", "poison_", "poison_pool", "pool_rows", "rotary_angles",
           "rotary_biases", "rotary_rates", "row_tensors", "speculative_indices", "step_indices"]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK_ELEMENTS = 1 << 26  # values drawn on the host at once (a benchmark pool is GBs)


class _Draw:
    """Draws from one CPU generator and places the result (dtype, device)."""

    def __init__(self, generator: torch.Generator | None, device):
        self.g = generator if generator is not None else torch.Generator().manual_seed(0)
        self.device = device

    def normal(self, *shape, dtype="float32", scale=1.0) -> torch.Tensor:
        """N(0, scale^2) values; drawn in pieces of rows so that a large pool needs little host memory."""
        out = torch.empty(shape, dtype=as_torch_dtype(dtype, "dtype"), device=self.device)
        rows = max(1, _CHUNK_ELEMENTS // max(1, out[:1].numel()))
        for r0 in range(0, max(1, shape[0]), rows):
            piece = out[r0:r0 + rows]
            piece.copy_((torch.randn(piece.shape, generator=self.g) * scale).to(out.dtype))
        return out

    def uniform(self, *shape, lo: float, hi: float) -> torch.Tensor:
        return (torch.rand(*shape, generator=self.g) * (hi - lo) + lo).to(self.device)


def row_tensors(rows, H, D, N, R, *, state_dtype="float32", kv_dtype="bfloat16", x_dtype="bfloat16",
                generator=None, device="cpu") -> dict:
    """``state`` (rows, H, D, N), ``Bstate`` (rows, R, H, N), ``Xstate`` (rows, H, D); with an 8-bit
    ``state_dtype`` also ``state_scale`` (rows, H, D): a normal fp32 state quantised with random bits
    (every code of the format in use, scales of the normal rows' absmax)."""
    d = _Draw(generator, device)
    name = dtype_name(as_torch_dtype(state_dtype, "state_dtype"))
    if name in SCALED_STATE_DTYPES:
        full = d.normal(rows, H, D, N).cpu()
        r = torch.randint(0, 1 << 16, full.shape, generator=d.g, dtype=torch.int64)
        q, scale = quantize_rows(full, r, name)
        state = dict(state=q.to(device), state_scale=scale.to(device))
    else:
        state = dict(state=d.normal(rows, H, D, N, dtype=state_dtype))
    return dict(**state, Bstate=d.normal(rows, R, H, N, dtype=kv_dtype, scale=0.5),
                Xstate=d.normal(rows, H, D, dtype=x_dtype))


def lane_inputs(B, H, D, N, R, *, kv_dtype="bfloat16", x_dtype="bfloat16", has_z=True, tokens=None,
                generator=None, device="cpu") -> dict:
    """This step's per-lane inputs for ``B`` lanes: ``A``, ``dt``, ``trap`` (B, H) fp32; ``B``,
    ``C`` (B, R, H, N); ``x``, ``z`` (B, H, D) (``z`` None without ``has_z``). With ``tokens=T``
    each gets a token axis after the lane axis: (B, T, H), (B, T, R, H, N), (B, T, H, D)."""
    d = _Draw(generator, device)
    L = (B,) if tokens is None else (B, tokens)
    return dict(
        A=-torch.exp(d.normal(*L, H, scale=0.5)), B=d.normal(*L, R, H, N, dtype=kv_dtype, scale=0.5),
        C=d.normal(*L, R, H, N, dtype=kv_dtype, scale=0.5), x=d.normal(*L, H, D, dtype=x_dtype),
        dt=d.uniform(*L, H, lo=0.01, hi=0.51), trap=d.uniform(*L, H, lo=0.0, hi=1.0),
        z=d.normal(*L, H, D, dtype=x_dtype) if has_z else None,
    )


def layer_weights(H, D, R, *, proj_dtype="bfloat16", has_z=True, has_outproj=True, generator=None,
                  device="cpu") -> dict:
    """One layer's weights: ``D`` (H,) fp32; ``xproj``, ``zproj``, ``outproj`` (R, H, D)
    (``zproj`` None without ``has_z``, ``outproj`` None without ``has_outproj``)."""
    d = _Draw(generator, device)

    def proj():
        return d.normal(R, H, D, dtype=proj_dtype, scale=0.5)

    return dict(D=d.normal(H), xproj=proj(), zproj=proj() if has_z else None,
                outproj=proj() if has_outproj else None)


#: the dtype names :func:`make_inputs` takes in ``dtypes``, with their defaults
INPUT_DTYPES = dict(state_dtype="float32", kv_dtype="bfloat16", x_dtype="bfloat16", proj_dtype="bfloat16")


def make_inputs(B: int, P: int | None = None, H: int = 2, D: int = 32, N: int = 32, R: int = 2, *,
                dtypes=None, has_z: bool = True, has_outproj: bool = True, tokens: int | None = None,
                seed: int | torch.Generator = 0, device="cpu") -> dict:
    """Fresh random inputs for one step, as a dict of ``mamba3_step_fn`` keyword arguments.

    ``P`` is the number of rows of ``state``, ``Bstate`` and ``Xstate``; ``P=None`` means dense
    mode (rows = B). ``dtypes`` maps any of ``state_dtype``, ``kv_dtype``, ``x_dtype`` and
    ``proj_dtype`` to a dtype; a missing one takes its default in :data:`INPUT_DTYPES` (float32
    state, bfloat16 otherwise). Keys ``outproj``, ``z``, ``zproj`` are None when disabled.
    ``tokens=T`` gives the per-lane inputs a token axis (a T-token step, :func:`lane_inputs`).
    ``seed`` is an int or a CPU ``torch.Generator`` (drawn from as is).

    Raises TypeError for a key of ``dtypes`` that is not one of the four.
    """
    unknown = sorted(set(dtypes or {}) - set(INPUT_DTYPES))
    if unknown:
        raise TypeError(f"dtypes: unknown keys {unknown}, expected some of {sorted(INPUT_DTYPES)}")
    dt = {**INPUT_DTYPES, **(dtypes or {})}
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    rows = B if P is None else P
    return {
        **row_tensors(rows, H, D, N, R, state_dtype=dt["state_dtype"], kv_dtype=dt["kv_dtype"],
                      x_dtype=dt["x_dtype"], generator=g, device=device),
        **lane_inputs(B, H, D, N, R, kv_dtype=dt["kv_dtype"], x_dtype=dt["x_dtype"], has_z=has_z, tokens=tokens,
                      generator=g, device=device),
        **layer_weights(H, D, R, proj_dtype=dt["proj_dtype"], has_z=has_z, has_outproj=has_outproj, generator=g,
                        device=device),
    }


def with_rotary(inputs: dict, S: int, *, shared_bc: bool = False, bias: bool = True,
                seed: int | torch.Generator = 0) -> dict:
    """``inputs`` (a :func:`make_inputs` dict) with the rotary tensors added: ``angle_state``
    (rows, H, S) int64 random angles over the whole turn, ``angle_proj`` (B, [T,] H, S) fp32,
    ``B_bias``/``C_bias`` (R, H, N) fp32 around 1 (upstream's initial value) unless ``bias`` is
    False; with ``shared_bc`` ``B``/``C`` keep only head 0 (a head axis of 1). A new dict."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    device = inputs["x"].device
    rows, H = inputs["state"].shape[0], inputs["state"].shape[1]
    R, N = inputs["B"].shape[-3], inputs["B"].shape[-1]
    out = dict(inputs)
    out["angle_state"] = rotary_angles(rows, H, S, generator=g, device=device)
    out["angle_proj"] = rotary_rates(inputs["x"].shape[:-2], H, S, generator=g, device=device)  # lanes (B[, T])
    out.update(rotary_biases(R, H, N, generator=g, device=device) if bias else dict(B_bias=None, C_bias=None))
    if shared_bc:
        out["B"], out["C"] = inputs["B"][..., :1, :].clone(), inputs["C"][..., :1, :].clone()
    return out


def rotary_angles(rows: int, H: int, S: int, *, generator=None, device="cpu") -> torch.Tensor:
    """``angle_state`` rows (rows, H, S) int64: random angles over the whole turn."""
    g = _Draw(generator, device).g
    return torch.randint(INT64_MIN, INT64_MAX, (rows, H, S), generator=g, dtype=torch.int64).to(device)


def rotary_rates(lanes: tuple, H: int, S: int, *, generator=None, device="cpu") -> torch.Tensor:
    """``angle_proj`` (*lanes, H, S) fp32: N(0, 1.5^2), so tanh spans most of (-1, 1)."""
    return _Draw(generator, device).normal(*lanes, H, S, scale=1.5)


def rotary_biases(R: int, H: int, N: int, *, generator=None, device="cpu") -> dict:
    """``B_bias`` and ``C_bias`` (R, H, N) fp32 around 1 (upstream's initial value)."""
    d = _Draw(generator, device)
    return dict(B_bias=1 + d.normal(R, H, N, scale=0.3), C_bias=1 + d.normal(R, H, N, scale=0.3))


def inputs_for(spec, B: int, P: int | None = None, H: int = 2, seed: int = 0, device="cpu") -> dict:
    """Fresh inputs of a call that ``spec`` (a :class:`~mamba3_step.spec.StepSpec`) compiles to:
    :func:`make_inputs` with its sizes, dtypes, optional tensors and token axis, its rotary tensors
    (:func:`with_rotary`, seed ``seed + 1``), B and C with a head axis of 1 with ``shared_bc`` and,
    with stochastic rounding, a ``rand_seed``. No
    indices (``P``: pool rows, None for dense mode)."""
    dtypes = dict(state_dtype=spec.state_dtype, kv_dtype=spec.kv_dtype, x_dtype=spec.x_dtype,
                  proj_dtype=spec.proj_dtype)
    inputs = make_inputs(B, P, H, spec.headdim, spec.dstate, spec.mimo, dtypes=dtypes, has_z=spec.has_z,
                         has_outproj=spec.has_outproj, tokens=spec.tokens if spec.tokens > 1 else None, seed=seed,
                         device=device)
    if spec.rope_angles:
        inputs = with_rotary(inputs, spec.rope_angles, shared_bc=spec.shared_bc, bias=spec.has_bc_bias,
                             seed=seed + 1)
    elif spec.shared_bc:  # B and C of one head, read by every head (a head axis of 1)
        inputs["B"], inputs["C"] = inputs["B"][..., :1, :].clone(), inputs["C"][..., :1, :].clone()
    if spec.stochastic_rounding:
        inputs["rand_seed"] = torch.tensor([seed * 7919 + 1, seed], dtype=torch.int64, device=device)
    return inputs


#: the int64 range (rotary angles are drawn over all of it)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class LayerShape(NamedTuple):
    """One layer's sizes and dtypes, as the demos take them: H heads, D head dim, N state size,
    R MIMO rank and the storage dtypes (``x_dtype`` None: ``kv_dtype``). Defaults: the flagship's
    D, N, R and dtypes, H=4."""

    H: int = 4
    D: int = 64
    N: int = 128
    R: int = 4
    state_dtype: str | torch.dtype = "float32"
    kv_dtype: str | torch.dtype = "bfloat16"
    x_dtype: str | torch.dtype | None = None
    proj_dtype: str | torch.dtype = "bfloat16"

    @property
    def storage_dtypes(self) -> dict:
        """``state_dtype``, ``kv_dtype`` and ``x_dtype`` (None resolved to ``kv_dtype``), as keywords."""
        return dict(state_dtype=self.state_dtype, kv_dtype=self.kv_dtype,
                    x_dtype=self.kv_dtype if self.x_dtype is None else self.x_dtype)


def poison_(t: torch.Tensor, seed: int = 1234, generator=None) -> torch.Tensor:
    """Fill ``t`` in place with random bit patterns (NaN, inf, huge, tiny, negative zero...).

    For int tensors the values are random ints. Returns ``t``.
    """
    if t.numel() == 0:
        return t
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    iv = _INT_VIEW[t.element_size()]
    info = torch.iinfo(iv)
    noise = torch.randint(info.min, info.max, t.shape, generator=g, dtype=torch.int64).to(iv)
    if t.is_floating_point():
        t.copy_(noise.view(t.dtype).to(t.device))
    else:
        t.copy_(noise.to(t.dtype).to(t.device))
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as an integer tensor of the same shape (NaN-safe equality)."""
    if t.is_floating_point():
        return t.contiguous().view(_INT_VIEW[t.element_size()])
    return t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe): same shape, dtype and bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(bits(a), bits(b))


def poison_pool(pool, generator=None) -> None:
    """Fill every row of every layer of a ``StatePool`` (the null row and the scratch rows too)
    with random finite values, so a stray write or a wrong read shows up in a comparison. An 8-bit
    state gets random codes with positive random scales: a normal fp32 state quantised with random
    bits (every code of the format in use, never NaN), each scale then times a random factor in
    ``[0.5, 2)`` (a scale need not be its row's absmax / Q: the step reads ``code * scale``)."""
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    scales = getattr(pool, "_state_scale", None)
    if scales is not None:  # 8-bit codes and their scales
        full = torch.randn(pool._state.shape, generator=g)
        bits16 = torch.randint(0, 1 << 16, full.shape, generator=g, dtype=torch.int64)
        q, scale = quantize_rows(full, bits16, dtype_name(pool._state.dtype))
        pool._state.copy_(q)
        scales.copy_(scale * torch.exp2(torch.rand(scale.shape, generator=g) * 2 - 1))
    for t in ((pool._state,) if scales is None else ()) + (pool._Bstate, pool._Xstate):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    if pool._angle_state is not None:  # random angles over the whole turn
        pool._angle_state.copy_(torch.randint(INT64_MIN, INT64_MAX, pool._angle_state.shape, generator=g,
                                              dtype=torch.int64))


def padded_indices(B: int, P: int, *, null_slot_id: int | None = None, with_dst: bool = False,
                   layout: str = "interleaved", seed: int = 0, device="cpu"):
    """Pool indices for ``B`` lanes whose padding lanes hold every padding kind.

    Up to five lanes are padding, with the sources ``-1``, ``INT32_MIN`` (kind ``"negative"``),
    ``P``, ``INT32_MAX`` (``"oob"``) and ``null_slot_id`` (``"null"``, when given), at least one
    lane stays live. Live lanes write distinct rows; without ``with_dst`` they update in place,
    with it they read rows nobody writes, and one of them (kind ``"live_nodst"``) has a padding
    destination. ``layout`` is ``"trailing"`` (padding last, a padded CUDA-graph batch) or
    ``"interleaved"`` (shuffled with ``seed``). Returns ``(src, dst, kinds)``: int32 (B,) tensors
    (``dst`` None without ``with_dst``) and the lane kinds.

    Raises ValueError when the pool is too small for the live lanes' rows.
    """
    pads = [(-1, "negative"), (INT32_MIN, "negative"), (P, "oob"), (INT32_MAX, "oob")]
    if null_slot_id is not None:
        pads.append((null_slot_id, "null"))
    pads = pads[: max(0, B - 1)]
    live = B - len(pads)
    kinds = ["live"] * live
    if with_dst and live > 1:
        kinds[0] = "live_nodst"
    writers = kinds.count("live")
    rows = [r for r in range(P) if r != null_slot_id]
    need = writers + (live if with_dst else 0)
    if need > len(rows):
        raise ValueError(f"P={P}: a pool of {len(rows)} usable rows is too small for {need} live rows")
    rng = random.Random(seed)
    rng.shuffle(rows)
    dst_rows, src_rows = rows[:writers], rows[writers:]
    src, dst = [], []
    for k in kinds:
        if k == "live":
            d = dst_rows.pop()
            dst.append(d)
            src.append(src_rows.pop() if with_dst else d)
        else:  # live_nodst: reads a row nobody writes, writes nothing
            src.append(src_rows.pop())
            dst.append(INT32_MAX)
    for value, kind in pads:
        kinds.append(kind)
        src.append(value)
        dst.append(rng.choice([value, -1, 0]))
    order = list(range(B))
    if layout == "interleaved":
        rng.shuffle(order)
    elif layout != "trailing":
        raise ValueError(f"layout: expected 'trailing' or 'interleaved', got {layout!r}")
    src_t = torch.tensor([src[i] for i in order], dtype=torch.int32, device=device)
    dst_t = torch.tensor([dst[i] for i in order], dtype=torch.int32, device=device) if with_dst else None
    return src_t, dst_t, [kinds[i] for i in order]



#: lane kinds of :func:`speculative_indices` that are padding (they touch no pool row)
SPECULATIVE_PAD_KINDS = ("count_zero", "count_over", "negative", "oob", "null")


def speculative_indices(B: int, P: int, T: int, *, null_slot_id: int | None = None, layout: str = "shared",
                        kinds: list | None = None, K: int | None = None, seed: int = 0, device="cpu"):
    """Race-free indices of a T-token (speculative) step whose padding lanes hold every kind.

    Each live lane owns T rows, its destinations: the state after token t goes to its row t.
    ``layout="shared"`` is how a server lays out speculative state (the source candidates are
    the same rows, K = T: the lane continues from the row of its last accepted token);
    ``"separate"`` gives each lane K (default T) candidate rows nobody writes. By default up to
    five lanes are padding, in a shuffled order: accepted count 0 (``"count_zero"``) or K + 1
    (``"count_over"``; both refused by ``validate_indices``), a selected source of -1 or
    INT32_MIN (``"negative"``), P or INT32_MAX (``"oob"``), or the null slot (``"null"``); a
    live lane of kind ``"live_gaps"`` has padding destinations for every other token, cycling
    through -1, INT32_MIN, P, INT32_MAX and the null slot. ``kinds`` (one per lane, in order)
    overrides the mix. Returns ``(state_batch_indices (B, K), num_accepted_tokens (B,),
    dst_state_batch_indices (B, T), kinds)``, int32.

    Raises ValueError for an unknown layout or kind, or when the pool is too small.
    """
    if layout not in ("shared", "separate"):
        raise ValueError(f"layout: expected 'shared' or 'separate', got {layout!r}")
    K = T if K is None or layout == "shared" else K
    rng = random.Random(seed)
    if kinds is None:
        pads = ["count_zero", "count_over", "negative", "oob"] + (["null"] if null_slot_id is not None else [])
        pads = pads[: max(0, B - 1)]
        kinds = ["live"] * (B - len(pads)) + pads
        if len(kinds) - len(pads) > 1:
            kinds[0] = "live_gaps"
        rng.shuffle(kinds)
    unknown = set(kinds) - {"live", "live_gaps", *SPECULATIVE_PAD_KINDS}
    if len(kinds) != B or unknown or ("null" in kinds and null_slot_id is None):
        raise ValueError(f"kinds: expected {B} of live, live_gaps, {', '.join(SPECULATIVE_PAD_KINDS)} ('null' "
                         f"with a null_slot_id), got {kinds!r}")
    rows = [r for r in range(P) if r != null_slot_id]
    per_lane = T if layout == "shared" else T + K
    if per_lane * B > len(rows):
        raise ValueError(f"P={P}: a pool of {len(rows)} usable rows is too small for {B} lanes of {per_lane} rows")
    rng.shuffle(rows)
    gaps = [-1, INT32_MIN, P, INT32_MAX] + ([null_slot_id] if null_slot_id is not None else [])
    src, nat, dst = [], [], []
    for kind in kinds:
        mine, rows = rows[:per_lane], rows[per_lane:]
        d = mine[:T]
        cand = list(d) if layout == "shared" else mine[T:]
        n = rng.randint(1, K)
        if kind == "live_gaps":
            d = [r if t % 2 == 0 else gaps[(t // 2) % len(gaps)] for t, r in enumerate(d)]
        elif kind == "count_zero":
            n = 0
        elif kind == "count_over":
            n = K + 1
        elif kind in ("negative", "oob", "null"):
            cand[n - 1] = {"negative": rng.choice([-1, INT32_MIN]), "oob": rng.choice([P, INT32_MAX]),
                           "null": null_slot_id}[kind]
        src.append(cand)
        nat.append(n)
        dst.append(d)

    def tensor(values, width=None):
        t = torch.tensor(values, dtype=torch.int32, device=device)
        return t if width is None else t.reshape(B, width)

    return tensor(src, K), tensor(nat), tensor(dst, T), list(kinds)


def step_indices(spec, B: int, P: int, *, null_slot_id: int | None = None, layout: str | None = None,
                 live_only: bool = False, seed: int = 0, device="cpu") -> tuple[dict, list]:
    """Pool indices in the form a specialisation takes, with every padding kind: the one index
    factory of the PTX tier's tests and ``verify``.

    ``spec`` is a pool-mode :class:`~mamba3_step.spec.StepSpec`. One-token specialisations get
    :func:`padded_indices` (``layout`` "interleaved" or "trailing"); multi-token ones, or those
    with ``num_accepted``, get :func:`speculative_indices` (``layout`` "separate" or "shared")
    reduced to the specialisation's form: (B,) sources (the accepted entry; a count outside
    [1, K] becomes a -1 source) without ``num_accepted``, the last token's row as a (B,)
    destination without ``dst_per_token``, none without ``has_dst``. ``live_only``: every lane
    live, on rows of its own (for byte counts). Returns the keyword arguments
    (``state_batch_indices``, ``dst_state_batch_indices``, ``num_accepted_tokens``,
    ``null_slot_id``) and the lane kinds. :func:`pool_rows` says how large P must be.
    """
    if spec.tokens == 1 and not spec.num_accepted:
        if live_only:
            src = torch.arange(B, dtype=torch.int32, device=device)
            dst = src + B if spec.has_dst else None
            kinds = ["live"] * B
        else:
            src, dst, kinds = padded_indices(B, P, null_slot_id=null_slot_id, with_dst=spec.has_dst,
                                             layout=layout or "interleaved", seed=seed, device=device)
        return dict(state_batch_indices=src, dst_state_batch_indices=dst, num_accepted_tokens=None,
                    null_slot_id=null_slot_id), kinds
    sbi, nat, dst, kinds = speculative_indices(B, P, spec.tokens, null_slot_id=null_slot_id,
                                               layout=layout or "separate", kinds=["live"] * B if live_only else None,
                                               seed=seed, device=device)
    if not spec.num_accepted:
        sbi, nat = source_rows(sbi, nat).to(torch.int32), None
        kinds = ["negative" if k in ("count_zero", "count_over") else k for k in kinds]
    if not spec.dst_per_token:
        dst = dst[:, -1].contiguous() if spec.has_dst else None
    return dict(state_batch_indices=sbi, dst_state_batch_indices=dst, num_accepted_tokens=nat,
                null_slot_id=null_slot_id), kinds


def pool_rows(spec, B: int) -> int:
    """A pool size P that :func:`step_indices` can fill for ``B`` lanes of ``spec`` (any layout)."""
    if spec.tokens == 1 and not spec.num_accepted:
        return 2 * B + 4
    return 2 * spec.tokens * B + 4
