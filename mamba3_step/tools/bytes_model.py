"""How many bytes one decode step must move through HBM, and what that costs in time.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size (dstate),
R MIMO rank.

The model counts *compulsory* traffic: every byte a step must read or write at least once,
each counted once (a tensor read by several CTAs, e.g. ``xproj``, is counted once: L2
serves the repeats). A kernel that reaches HBM bandwidth on these bytes is as fast as the
step can be; ``predicted_seconds`` divides by the bandwidth. It is a model, not a
measurement (``bench/gpu_bench.py`` measures).

Per step, with ``Bl`` live lanes (all ``B`` lanes unless ``live_lanes`` says otherwise) and
``sb``, ``kb``, ``xb``, ``pb`` the byte sizes of the state, B/C/Bstate, x/z/Xstate/out and
projection dtypes:

=============================  ===================================  ===========================
entry                          bytes                                 note
=============================  ===================================  ===========================
``state``                      2 * Bl * H * D * N * sb              read row src, write row dst
``Bstate``                     Bl * R * H * N * kb  (x2 with kv)    read (+ write B into dst)
``Xstate``                     Bl * H * D * xb      (x2 with kv)    read (+ write x into dst)
``B``, ``C``                   Bl * R * H * N * kb each
``x``                          Bl * H * D * xb
``z``                          Bl * H * D * xb                      with z only
``out``                        B * H * D * xb  (outproj)            every lane writes out
                               B * R * H * D * xb (no outproj)      (padding lanes: zeros)
``A``, ``dt``, ``trap``        Bl * H * 4 each
``D``                          H * 4                                once per step
``xproj``, ``zproj``,          R * H * D * pb each                  once per step; zproj with
``outproj``                                                          z, outproj with outproj
``state_batch_indices``        B * 4                                pool mode (one entry a lane)
``dst_state_batch_indices``    B * 4                                pool mode with dst
``num_accepted_tokens``        B * 4                                with num_accepted
``angle_state``                2 * Bl * H * S * 8                   rotary: read row src, write
                                                                    row dst (int64 angles)
``angle_proj``                 Bl * H * S * 4                       rotary
``B_bias``, ``C_bias``         R * H * N * 4 each                   once per step; has_bc_bias
``state_scale``                (1 + w) * Bl * H * D * 4             8-bit state: its scales, read
                                                                    and written like the state
``rand_seed``                  16                                   stochastic rounding (the
                                                                    seed and offset, read once a
                                                                    thread; counted once)
``rand_rows``                  B * 4                                dense mode with rand_rows
=============================  ===================================  ===========================

With ``shared_bc`` (B and C have a head axis of 1: one (R, N) row per lane, read by every head)
the ``B`` and ``C`` entries are ``Bl * R * N * kb`` each: the model counts DRAM bytes and
assumes that of the H CTAs of a lane reading that row, the first brings it into L2 and the
others hit there. These are the *unique* bytes, which is also what the PTX tier's executed
count (``ptx.analysis.bytes_touched``) measures per tensor. What the CTAs *load* (each CTA of a
live lane loads its lane's whole (R, N) B and C rows per token, whether shared or not) is
:func:`bc_load_bytes`: H times the DRAM count when shared.

"with kv" means ``update_kv_state``. A padding lane (pool mode) reads its index and writes
zeros to ``out``; it moves nothing else.

A T-token step (``spec.tokens``) reads the state, Bstate, Xstate (and angle) rows once and every
per-lane input and ``out`` T times; it writes each live lane's rows once, or T times with a
destination per token (``dst_per_token``: then ``dst_state_batch_indices`` is read T times
per live lane). :func:`token_saving` compares it with T one-token steps.

``mode="gather_scatter"`` is what a server does without pool indexing: gather the batch's
rows out of the pool into dense tensors, run the dense kernel, scatter the new state
(and with ``update_kv_state`` the new B/x rows) back. On top of the dense kernel's bytes
(entries prefixed ``kernel:``) it moves, per gathered/scattered tensor, one read and one
write of every row (``gather:state`` = 2 * B * H * D * N * sb, ...) plus the index vector
each gather/scatter reads (``gather/scatter indices`` = 4 * B per operation). For the
fp32 state this is the triple round trip of the largest tensor that docs/contract.md ("Why the
step exists") describes: gather, kernel, scatter. With rotary the angle rows are gathered and
scattered too (the step always writes the angle).

:func:`upstream_pipeline_bytes` models upstream's rotary decode (``Mamba3.step`` of
state-spaces/mamba): a separate rotary launch, the dense step, three state copies, and, with
pools, the gather and scatter of the four state tensors.

:func:`replay_bytes` models replay (docs/design/replay.md; its CPU path is
``mamba3_step.replay``, its kernel ``StepSpec.replay_ring``): per step the state row is read, written only by a flush;
the ring's committed entries are read and this step's tokens appended.
"""

from __future__ import annotations

from ..contract import DTYPE_BYTES, SCALED_STATE_DTYPES
from ..spec import StepSpec

__all__ = [
    "MODES",
    "HBM_BANDWIDTH",
    "bc_load_bytes",
    "bytes_per_step",
    "predicted_seconds",
    "replay_bytes",
    "predicted_speedup",
    "token_saving",
    "upstream_pipeline_bytes",
]

MODES = ("pool", "gather_scatter", "dense")

#: Peak HBM bandwidth in bytes/s, from NVIDIA's datasheets:
#: H100 SXM5 80 GB (HBM3): 3.35 TB/s  -- "NVIDIA H100 Tensor Core GPU" datasheet;
#: H200 SXM 141 GB (HBM3e): 4.8 TB/s  -- "NVIDIA H200 Tensor Core GPU" datasheet;
#: GH200 with 96 GB HBM3: 4.0 TB/s    -- "NVIDIA GH200 Grace Hopper Superchip" datasheet
#: (the 144 GB HBM3e version lists 4.9 TB/s).
HBM_BANDWIDTH = {
    "H100": 3.35e12,
    "H200": 4.8e12,
    "GH200": 4.0e12,
}

_F32 = 4
_I32 = 4
_I64 = 8


def _check(spec: StepSpec, batch: int, heads: int, live_lanes, mode: str) -> int:
    if not isinstance(spec, StepSpec):
        raise TypeError(f"spec must be a StepSpec, got {type(spec).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, v in (("batch", batch), ("heads", heads)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    if live_lanes is None:
        return batch
    if not isinstance(live_lanes, int) or isinstance(live_lanes, bool) or not 0 <= live_lanes <= batch:
        raise ValueError(f"live_lanes must be an int in [0, batch={batch}], got {live_lanes!r}")
    if mode != "pool" and live_lanes != batch:
        raise ValueError(
            f"live_lanes (padding lanes) exist in pool mode only; mode={mode!r} needs "
            f"live_lanes == batch={batch}, got {live_lanes}"
        )
    return live_lanes


def _kernel_bytes(spec: StepSpec, batch: int, live: int, heads: int, pool: bool) -> dict:
    """Per-tensor bytes of one launch of the step kernel (dense or pool mode)."""
    N, D, R, H, T = spec.dstate, spec.headdim, spec.mimo, heads, spec.tokens
    sb = DTYPE_BYTES[spec.state_dtype]
    kb = DTYPE_BYTES[spec.kv_dtype]
    xb = DTYPE_BYTES[spec.x_dtype]
    pb = DTYPE_BYTES[spec.proj_dtype]
    writes = T if spec.dst_per_token else 1  # rows each live lane writes
    kv = 1 + writes if spec.update_kv_state else 1
    S = spec.rope_angles
    hbc = 1 if spec.shared_bc else H  # B/C's head axis: shared rows are read from DRAM once
    bias = R * H * N * _F32 if spec.has_bc_bias else 0
    out = {
        "state": (1 + writes) * live * H * D * N * sb,
        "Bstate": kv * live * R * H * N * kb,
        "Xstate": kv * live * H * D * xb,
        "B": T * live * R * hbc * N * kb,
        "C": T * live * R * hbc * N * kb,
        "x": T * live * H * D * xb,
        "z": T * live * H * D * xb if spec.has_z else 0,
        "out": T * batch * H * D * xb if spec.has_outproj else T * batch * R * H * D * xb,
        "A": T * live * H * _F32,
        "dt": T * live * H * _F32,
        "trap": T * live * H * _F32,
        "D": H * _F32,
        "xproj": R * H * D * pb,
        "zproj": R * H * D * pb if spec.has_z else 0,
        "outproj": R * H * D * pb if spec.has_outproj else 0,
        "state_batch_indices": batch * _I32 if pool else 0,
        "dst_state_batch_indices": (T * live if spec.dst_per_token else batch) * _I32 if pool and spec.has_dst else 0,
        "num_accepted_tokens": batch * _I32 if pool and spec.num_accepted else 0,
        "angle_state": (1 + writes) * live * H * S * _I64,
        "angle_proj": T * live * H * S * _F32,
        "B_bias": bias,
        "C_bias": bias,
        "state_scale": (1 + writes) * live * H * D * _F32 if spec.state_dtype in SCALED_STATE_DTYPES else 0,
        "rand_seed": 2 * _I64 if spec.stochastic_rounding else 0,
        "rand_rows": batch * _I32 if spec.has_rand_rows else 0,
    }
    return out


def bytes_per_step(
    spec: StepSpec,
    batch: int,
    heads: int,
    live_lanes: int | None = None,
    mode: str | None = None,
) -> dict:
    """Bytes one decode step moves, per tensor and in total (see the module docstring).

    Args:
        spec: the specialisation (dims, dtypes, ``update_kv_state``, ``has_z``,
            ``has_outproj``, ``has_dst``).
        batch: B, lanes in the step.
        heads: H.
        live_lanes: lanes that are not padding (pool mode only; default ``batch``).
        mode: ``"pool"``, ``"gather_scatter"`` or ``"dense"``; default ``"pool"`` when
            ``spec.pool`` else ``"dense"``. It overrides ``spec.pool``.

    Returns:
        ``{entry: bytes, ..., "total": bytes}`` (ints). Pool and dense modes name the
        tensors (``"state"``, ``"Bstate"``, ...); gather_scatter prefixes the dense
        kernel's entries with ``"kernel:"`` and adds ``"gather:<t>"``, ``"scatter:<t>"``
        and ``"gather/scatter indices"``. Entries that do not apply are 0.
    """
    if mode is None:
        mode = "pool" if getattr(spec, "pool", False) else "dense"
    live = _check(spec, batch, heads, live_lanes, mode)
    if mode in ("pool", "dense"):
        out = _kernel_bytes(spec, batch, live, heads, pool=(mode == "pool"))
    elif spec.tokens > 1:
        raise ValueError(f"mode='gather_scatter' models one-token steps, got tokens={spec.tokens} "
                         f"(compare T-token steps with token_saving)")
    else:
        out = _gather_scatter_bytes(spec, batch, heads)
    out["total"] = sum(out.values())
    return out


def _batch_rows(spec: StepSpec, batch: int, heads: int, angle_bytes: int = _I64) -> dict:
    """Bytes of ``batch`` rows of each state tensor (the angle's at ``angle_bytes`` an angle; the
    scales of an 8-bit state)."""
    N, D, R, H = spec.dstate, spec.headdim, spec.mimo, heads
    rows = {
        "state": batch * H * D * N * DTYPE_BYTES[spec.state_dtype],
        "Bstate": batch * R * H * N * DTYPE_BYTES[spec.kv_dtype],
        "Xstate": batch * H * D * DTYPE_BYTES[spec.x_dtype],
        "angle_state": batch * H * spec.rope_angles * angle_bytes,
    }
    if spec.state_dtype in SCALED_STATE_DTYPES:
        rows["state_scale"] = batch * H * D * _F32
    return rows


def _gather_scatter_bytes(spec: StepSpec, batch: int, heads: int) -> dict:
    """gather -> dense kernel -> scatter (module docstring): per gathered tensor a read of the
    pool rows and a write of the dense copy, per scattered one the reverse, index reads."""
    rows = _batch_rows(spec, batch, heads)
    extra = (("angle_state",) if spec.rope_angles else ()) + (("state_scale",) if "state_scale" in rows else ())
    gathered = ("state", "Bstate", "Xstate") + extra
    scattered = ("state",) + (("Bstate", "Xstate") if spec.update_kv_state else ()) + extra
    out = {}
    for t in rows:
        out[f"gather:{t}"] = 2 * rows[t] if t in gathered else 0  # read pool rows, write dense copies
    for k, v in _kernel_bytes(spec, batch, batch, heads, pool=False).items():
        out[f"kernel:{k}"] = v
    for t in rows:
        out[f"scatter:{t}"] = 2 * rows[t] if t in scattered else 0  # read dense, write pool
    out["gather/scatter indices"] = (len(gathered) + len(scattered)) * batch * _I32
    return out


def predicted_seconds(total_bytes: int, gpu: str = "H100") -> float:
    """``total_bytes`` / peak HBM bandwidth of ``gpu`` (a key of :data:`HBM_BANDWIDTH`):
    the time of a kernel that moves those bytes at full bandwidth (a lower bound)."""
    if gpu not in HBM_BANDWIDTH:
        raise ValueError(f"gpu must be one of {tuple(HBM_BANDWIDTH)}, got {gpu!r}")
    return total_bytes / HBM_BANDWIDTH[gpu]


def predicted_speedup(spec: StepSpec, batch: int, heads: int) -> float:
    """Modelled speed-up of pool mode over gather -> dense -> scatter: the ratio of their
    bytes (both at the same bandwidth; launch overheads are not modelled)."""
    pool = bytes_per_step(spec, batch, heads, mode="pool")["total"]
    gs = bytes_per_step(spec, batch, heads, mode="gather_scatter")["total"]
    return gs / pool if pool else float("nan")


def token_saving(spec: StepSpec, batch: int, heads: int) -> dict:
    """Bytes of one T-token step (``spec``, ``spec.tokens`` = T) next to T one-token steps doing
    the same work (each reading and writing the state rows; with a destination per token the
    one-token steps write the same rows, else only the last writes, the others update in place
    a scratch row: counted as a full step each, which is what a server without the T-token
    step pays). Returns ``{"tokens", "t_token_bytes", "one_token_steps_bytes", "ratio"}``."""
    T = spec.tokens
    one = spec.replace(tokens=1, dst_per_token=False)
    t_bytes = bytes_per_step(spec, batch, heads)["total"]
    singles = T * bytes_per_step(one, batch, heads)["total"]
    return {"tokens": T, "t_token_bytes": t_bytes, "one_token_steps_bytes": singles,
            "ratio": singles / t_bytes if t_bytes else float("nan")}


def bc_load_bytes(spec: StepSpec, batch: int, heads: int, live_lanes: int | None = None) -> dict:
    """Bytes of ``B`` and ``C`` the step's CTAs load, all CTAs together: each CTA of a live lane
    (H heads x ceil(D / tile_D) CTAs) loads its lane's whole (R, N) B and C rows once per token.

    This is the traffic L2 serves to the SMs, not the DRAM count: :func:`bytes_per_step` counts
    each byte once (with ``shared_bc`` the H heads' CTAs read one row, from DRAM once, then L2),
    so here ``B`` is ``H x ceil(D / tile_D)`` times its entry there with ``shared_bc``, and
    ``ceil(D / tile_D)`` times without. ``tile_D`` 0 means the default tiling.
    Returns ``{"B": bytes, "C": bytes}``."""
    live = _check(spec, batch, heads, live_lanes, "pool")
    tile_D = spec.tile_D or spec.with_default_tiling().tile_D
    ctas = heads * -(-spec.headdim // tile_D)
    row = spec.mimo * spec.dstate * DTYPE_BYTES[spec.kv_dtype]
    loads = spec.tokens * live * ctas * row
    return {"B": loads, "C": loads}


def upstream_pipeline_bytes(spec: StepSpec, batch: int, heads: int, pools: bool = True) -> dict:
    """Bytes of upstream's rotary decode step (``Mamba3.step``, state-spaces/mamba e9594ce) for
    ``spec``'s sizes (``rope_angles`` > 0, one token), every lane live. In launch order:

    * ``gather:<t>`` (``pools``): the four state rows (state, ``k_state`` = Bstate, ``v_state`` =
      Xstate, the angle as fp32 radians) copied from the pool into dense batch tensors (read +
      write);
    * ``rotary:<t>``: ``apply_rotary_qk_inference_fwd(inplace=False)``: reads B and C (a stride-0
      expand over the heads with ``shared_bc``: DRAM once per lane, as in :func:`bytes_per_step`),
      the biases (fp32; rearranged ``h r n -> r h n`` and made contiguous by the wrapper, a copy
      of each per call when R > 1 and H > 1: ``rotary:bias relayout``, read + write), the angle,
      ``angle_proj`` ((B, S) in the in_proj output's dtype, taken as ``x_dtype``, expanded over
      the heads), ``dt``; writes rotated ``B~``/``C~`` as full (B, R, H, N) tensors in the
      input dtype (``kv_dtype``: ``empty_like`` of the expanded inputs) and the new angle (fp32);
    * ``step:<t>``: upstream's ``mamba3_step_fn`` on the dense tensors: this package's dense step
      without rotary and without ``update_kv_state`` (it updates ssm_state in place, reads
      k_state/v_state, does not write them), B~/C~ per head;
    * ``copy:<t>``: ``angle_state.copy_(new angle)``, ``k_state.copy_(B~)``,
      ``v_state.copy_(x)`` (read + write each);
    * ``scatter:<t>`` (``pools``): the four dense tensors back to the pool rows (read + write),
      and ``gather/scatter indices``: an index vector read per gather/scatter.

    Returns ``{entry: bytes, ..., "total": bytes}``."""
    _check(spec, batch, heads, None, "dense")
    if not spec.rope_angles or spec.tokens != 1:
        raise ValueError(f"upstream_pipeline_bytes models a one-token rotary step: needs rope_angles > 0 and "
                         f"tokens == 1, got rope_angles={spec.rope_angles}, tokens={spec.tokens}")
    N, R, H, S = spec.dstate, spec.mimo, heads, spec.rope_angles
    kb, xb = DTYPE_BYTES[spec.kv_dtype], DTYPE_BYTES[spec.x_dtype]
    rows = _batch_rows(spec, batch, heads, angle_bytes=_F32)  # upstream's angle: fp32 radians
    bias = R * H * N * _F32 if spec.has_bc_bias else 0
    bc_in = batch * R * (1 if spec.shared_bc else H) * N * kb
    out = {f"gather:{t}": 2 * v if pools else 0 for t, v in rows.items()}
    out.update({
        "rotary:B": bc_in, "rotary:C": bc_in,
        "rotary:bias relayout": 2 * 2 * bias if R > 1 and H > 1 else 0,
        "rotary:B_bias": bias, "rotary:C_bias": bias,
        "rotary:angle_state": rows["angle_state"],
        "rotary:angle_proj": batch * S * xb,
        "rotary:dt": batch * H * _F32,
        "rotary:B~": batch * R * H * N * kb, "rotary:C~": batch * R * H * N * kb,
        "rotary:new angle": rows["angle_state"],
    })
    dense = spec.replace(pool=False, has_dst=False, dst_per_token=False, num_accepted=False, has_state_out=False,
                         update_kv_state=False, rope_angles=0, rotate_pairwise=False, has_bc_bias=False,
                         shared_bc=False)
    out.update({f"step:{k}": v for k, v in _kernel_bytes(dense, batch, batch, heads, pool=False).items()})
    out.update({f"copy:{t}": 2 * rows[t] for t in ("angle_state", "Bstate", "Xstate")})
    out.update({f"scatter:{t}": 2 * v if pools else 0 for t, v in rows.items()})
    out["gather/scatter indices"] = 2 * len(rows) * batch * _I32 if pools else 0
    out["total"] = sum(out.values())
    return out


def replay_bytes(spec: StepSpec, flush_length: int, batch: int, heads: int, position: int | None = None) -> dict:
    """Bytes of one pool-mode step with replay (docs/design/replay.md), every lane live, at ring
    ``position`` (committed tokens before the step; None: the average over positions 0..F-1, each
    as often, as requests at every position share a batch). ``spec`` is the stepwise step's
    (``update_kv_state``; ``spec.tokens`` = T > 1 a verify step, its destinations not used).

    Per live lane and head, on top of the step's inputs, ``out``, weights and indices (as
    :func:`bytes_per_step`): the state and ``Bstate``/``Xstate`` rows read; ``position`` ring entries
    read and T entries written (an entry: B ``R N`` kv bytes, x ``D`` x bytes, A/dt/trap 12); the
    ring length, one per head, read and written (4 + 4 a lane and head). A one-token step at position F - 1 flushes: it
    writes the state and ``Bstate``/``Xstate`` rows and no entry. A verify step (T drafts) pays the
    flushes its accepted tokens cause, at most one per F tokens: ``min(1, T / F)`` of a state,
    Bstate and Xstate write. Returns ``{entry: bytes, "total": bytes}``."""
    if not isinstance(flush_length, int) or not 2 <= flush_length <= 16:
        raise ValueError(f"flush_length must be an int in [2, 16], got {flush_length!r}")
    if position is None:
        rows = [replay_bytes(spec, flush_length, batch, heads, m) for m in range(flush_length)]
        return {k: sum(r[k] for r in rows) / flush_length for k in rows[0]}
    if not isinstance(position, int) or not 0 <= position <= flush_length - 1:
        raise ValueError(f"position must be an int in [0, F - 1], got {position!r}")
    T = spec.tokens
    step = _kernel_bytes(spec.replace(update_kv_state=False, has_dst=False, dst_per_token=False), batch, batch,
                         heads, pool=True)
    N, D, R, H = spec.dstate, spec.headdim, spec.mimo, heads
    row = {"state": H * D * N * DTYPE_BYTES[spec.state_dtype], "Bstate": R * H * N * DTYPE_BYTES[spec.kv_dtype],
           "Xstate": H * D * DTYPE_BYTES[spec.x_dtype]}
    entry = H * (R * N * DTYPE_BYTES[spec.kv_dtype] + D * DTYPE_BYTES[spec.x_dtype] + 3 * _F32)
    flush = (1.0 if position == flush_length - 1 else 0.0) if T == 1 else min(1.0, T / flush_length)
    for name, b in row.items():
        step[name] = batch * b * (1 + flush)
    appended = 0 if (T == 1 and position == flush_length - 1) else T
    step["ring"] = batch * entry * (position + appended)
    step["ring.length"] = batch * H * 2 * _I32
    step["total"] = sum(step.values())
    return step
