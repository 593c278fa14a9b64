"""Serving pieces around ``mamba3_step_fn``'s pool mode: a state pool with a slot allocator,
a one-call decode hook, a CUDA-graph step runner with batch-size buckets, and the
gather -> dense -> scatter baseline that pool mode must match byte for byte.

Letters (as in SPEC.md): ``B`` lanes this step, ``P`` pool rows (slots), ``H`` heads,
``D`` head dim, ``N`` state size, ``R`` MIMO rank, ``L`` layers.

A server's Mamba-3 layer step becomes::

    pool = StatePool(num_layers=L, num_slots=P, nheads=H, headdim=D, dstate=N, mimo=R,
                     state_dtype=torch.float32, kv_dtype=torch.bfloat16, device="cuda")
    slots = pool.alloc(1, zero=True)          # when a request arrives
    ...
    out = decode_step(pool, layer, step_slots, A, B, C, Dskip, x, dt, trap, xproj, outproj,
                      z=z, zproj=zproj)        # every decode step, every Mamba-3 layer
    ...
    pool.free(slots)                           # when it finishes

See docs/integration.md for the full wiring (null block, prefix caching, CUDA graphs).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import torch

from .api import mamba3_step_fn
from .reference import out_shape
from .tiling import default_tiling

PAD_SLOT_ID = -1  # the same value as mamba3_step.PAD_SLOT_ID
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class SlotError(ValueError):
    """A slot handed to the allocator is unknown, reserved, or not allocated (double free)."""


class PoolExhaustedError(RuntimeError):
    """``alloc(n)`` asked for more slots than are free."""


def _as_dtype(dtype, name: str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in _DTYPES:
            raise TypeError(f"{name}: expected one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype.removeprefix("torch.")]
    if dtype not in _DTYPES.values():
        raise TypeError(f"{name}: expected one of torch.float32/bfloat16/float16, got {dtype!r}")
    return dtype


def _slot_list(slots, name: str) -> list[int]:
    """Slots as a Python list of ints (accepts int, sequence, or an integer tensor)."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor of slots, got dtype {slots.dtype}")
        if slots.dim() > 1:
            raise ValueError(f"{name}: expected a 0-d or 1-d tensor of slots, got shape {tuple(slots.shape)}")
        return [int(v) for v in slots.reshape(-1).tolist()]
    if isinstance(slots, bool):
        raise TypeError(f"{name}: expected slot ints, got bool")
    if isinstance(slots, int):
        return [slots]
    if isinstance(slots, Iterable):
        out = []
        for v in slots:
            if isinstance(v, bool) or not isinstance(v, int):
                if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.dtype.is_floating_point:
                    v = int(v)
                else:
                    raise TypeError(f"{name}: expected slot ints, got element {v!r}")
            out.append(int(v))
        return out
    raise TypeError(f"{name}: expected an int, a sequence of ints or an integer tensor, got {type(slots).__name__}")


class StatePool:
    """Per-layer recurrent-state pools of ``P`` slots for ``L`` layers, plus a slot allocator.

    Per layer ``l`` it holds (row ``p`` belongs to the request that owns slot ``p``):

    * ``state(l)``  ``(P, H, D, N)``  ``state_dtype`` (fp32 / bf16 / fp16)
    * ``Bstate(l)`` ``(P, R, H, N)``  ``kv_dtype``    (previous step's B)
    * ``Xstate(l)`` ``(P, H, D)``     ``x_dtype``     (previous step's x; defaults to ``kv_dtype``)

    These are contiguous views into one allocation per tensor kind, ``(L, P, ...)``, so
    ``reset`` and ``copy`` touch every layer with one indexing op. ``Bstate``/``Xstate``
    carry one hidden scratch row after the ``P`` visible ones (never handed to the kernel,
    never allocated); the decode hook sends padded lanes' B/x there when it has to scatter
    B/x itself (``tile_D < headdim``). The pool is zero-initialised.

    Allocator: ``alloc(n)`` hands out the ``n`` lowest free slots as a CPU int32 tensor;
    ``free(slots)`` returns them. Freeing a slot twice, an unknown slot (out of range) or the
    reserved null slot raises :class:`SlotError`; asking for more slots than are free raises
    :class:`PoolExhaustedError` and allocates nothing.

    ``reserve_null_slot=True`` keeps row 0 out of the allocator for servers that pad with
    ``0`` rather than ``-1``: then ``null_slot_id == pad_id == 0`` and the kernel treats a
    lane addressing row 0 as padding (reads and writes nothing). Otherwise ``null_slot_id``
    is None and ``pad_id`` is ``-1``.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        nheads: int,
        headdim: int,
        dstate: int,
        mimo: int,
        *,
        state_dtype=torch.float32,
        kv_dtype=torch.bfloat16,
        x_dtype=None,
        device="cpu",
        reserve_null_slot: bool = False,
    ):
        for name, v in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("nheads", nheads),
            ("headdim", headdim),
            ("dstate", dstate),
            ("mimo", mimo),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if reserve_null_slot and num_slots < 2:
            raise ValueError(
                f"num_slots: reserve_null_slot=True needs at least 2 slots (row 0 is reserved), got {num_slots}"
            )
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.nheads = nheads
        self.headdim = headdim
        self.dstate = dstate
        self.mimo = mimo
        self.state_dtype = _as_dtype(state_dtype, "state_dtype")
        self.kv_dtype = _as_dtype(kv_dtype, "kv_dtype")
        self.x_dtype = self.kv_dtype if x_dtype is None else _as_dtype(x_dtype, "x_dtype")
        self.device = torch.device(device)
        self.reserve_null_slot = bool(reserve_null_slot)

        L, P, H, D, N, R = num_layers, num_slots, nheads, headdim, dstate, mimo
        self._state = torch.zeros((L, P, H, D, N), dtype=self.state_dtype, device=self.device)
        # one hidden scratch row (index P) for masked B/x scatters of padded lanes
        self._Bstate = torch.zeros((L, P + 1, R, H, N), dtype=self.kv_dtype, device=self.device)
        self._Xstate = torch.zeros((L, P + 1, H, D), dtype=self.x_dtype, device=self.device)

        first = 1 if self.reserve_null_slot else 0
        self._free_heap: list[int] = list(range(first, P))
        heapq.heapify(self._free_heap)
        self._allocated = bytearray(P)  # 1 where the slot is allocated

    # ---- geometry -----------------------------------------------------------------
    @property
    def null_slot_id(self) -> int | None:
        """``0`` with ``reserve_null_slot``, else None: pass it to ``mamba3_step_fn``."""
        return 0 if self.reserve_null_slot else None

    @property
    def pad_id(self) -> int:
        """The id a server pads a step's slot list with: 0 with a null slot, else -1."""
        return 0 if self.reserve_null_slot else PAD_SLOT_ID

    def state(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s state pool, ``(P, H, D, N)``, ``state_dtype``, contiguous view."""
        return self._state[self._layer(layer)]

    def Bstate(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s B-state pool, ``(P, R, H, N)``, ``kv_dtype``, contiguous view."""
        return self._Bstate[self._layer(layer), : self.num_slots]

    def Xstate(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s x-state pool, ``(P, H, D)``, ``x_dtype``, contiguous view."""
        return self._Xstate[self._layer(layer), : self.num_slots]

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(state, Bstate, Xstate)`` of one layer (views, see above)."""
        return self.state(layer), self.Bstate(layer), self.Xstate(layer)

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    @property
    def bytes_per_slot_per_layer(self) -> int:
        """Bytes one slot occupies in one layer (state + Bstate + Xstate rows)."""
        H, D, N, R = self.nheads, self.headdim, self.dstate, self.mimo
        return (
            H * D * N * self.state_dtype.itemsize
            + R * H * N * self.kv_dtype.itemsize
            + H * D * self.x_dtype.itemsize
        )

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot (one request) occupies across all ``L`` layers."""
        return self.num_layers * self.bytes_per_slot_per_layer

    @property
    def total_bytes(self) -> int:
        """Bytes the pool allocated: ``P * bytes_per_slot`` plus the B/x scratch rows."""
        return sum(t.numel() * t.element_size() for t in (self._state, self._Bstate, self._Xstate))

    # ---- allocator ----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_allocated(self) -> int:
        return sum(self._allocated)

    @property
    def capacity(self) -> int:
        """Slots a server can hold at once (``P``, minus the null slot when reserved)."""
        return self.num_slots - (1 if self.reserve_null_slot else 0)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._allocated[slot])

    def allocated_slots(self) -> list[int]:
        return [i for i, a in enumerate(self._allocated) if a]

    def alloc(self, n: int, *, zero: bool = False) -> torch.Tensor:
        """Allocate ``n`` slots (the lowest free ones). Returns ``(n,)`` int32 on the CPU.

        With ``zero=True`` their rows are reset (all layers) before returning. Raises
        :class:`PoolExhaustedError` (allocating nothing) when fewer than ``n`` are free.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected a non-negative int, got {n!r}")
        if n > len(self._free_heap):
            raise PoolExhaustedError(
                f"StatePool exhausted: asked for {n} slot(s), {len(self._free_heap)} free of "
                f"{self.capacity} (num_slots={self.num_slots}"
                + (", row 0 reserved as the null slot)" if self.reserve_null_slot else ")")
            )
        got = [heapq.heappop(self._free_heap) for _ in range(n)]
        for s in got:
            self._allocated[s] = 1
        slots = torch.tensor(got, dtype=torch.int32)
        if zero and n:
            self.reset(slots)
        return slots

    def free(self, slots) -> None:
        """Return ``slots`` (int, sequence or integer tensor) to the allocator.

        All slots are checked before any is freed: an unknown slot (outside ``[0, P)``), the
        reserved null slot, a slot that is not allocated (double free) or one listed twice
        raises :class:`SlotError` and frees nothing. Rows keep their contents.
        """
        lst = self._checked_allocated(slots, "slots", what="free")
        for s in lst:
            self._allocated[s] = 0
            heapq.heappush(self._free_heap, s)

    def _checked_allocated(self, slots, name: str, *, what: str, unique: bool = True) -> list[int]:
        lst = _slot_list(slots, name)
        seen = set()
        for i, s in enumerate(lst):
            if not 0 <= s < self.num_slots:
                raise SlotError(
                    f"{name}[{i}]: cannot {what} unknown slot {s}: expected a slot in [0, {self.num_slots})"
                )
            if self.reserve_null_slot and s == 0:
                raise SlotError(f"{name}[{i}]: cannot {what} slot 0: it is the reserved null slot")
            if not self._allocated[s]:
                hint = " (double free?)" if what == "free" else ""
                raise SlotError(f"{name}[{i}]: cannot {what} slot {s}: it is not allocated{hint}")
            if unique and s in seen:
                raise SlotError(f"{name}[{i}]: slot {s} is listed twice")
            seen.add(s)
        return lst

    def _index(self, lst: list[int]) -> torch.Tensor:
        return torch.tensor(lst, dtype=torch.long, device=self.device)

    # ---- row operations -------------------------------------------------------------
    def reset(self, slots) -> None:
        """Zero the rows of ``slots`` (allocated slots) in every layer: state, Bstate, Xstate."""
        lst = self._checked_allocated(slots, "slots", what="reset")
        if not lst:
            return
        idx = self._index(lst)
        self._state.index_fill_(1, idx, 0)
        self._Bstate.index_fill_(1, idx, 0)
        self._Xstate.index_fill_(1, idx, 0)

    def copy(self, src, dst) -> None:
        """Fork rows: every layer's ``state``/``Bstate``/``Xstate`` row ``dst[i]`` := row ``src[i]``.

        ``src`` has one slot (broadcast to every ``dst``: parallel sampling) or ``len(dst)``
        slots (beam search reordering). All slots must be allocated; ``dst`` must not repeat.
        Sources are read before any destination is written, so ``src`` and ``dst`` may overlap.
        """
        s = self._checked_allocated(src, "src", what="copy from", unique=False)
        d = self._checked_allocated(dst, "dst", what="copy to")
        if len(s) == 1 and len(d) != 1:
            s = s * len(d)
        if len(s) != len(d):
            raise ValueError(f"src: expected 1 or len(dst)={len(d)} slots, got {len(s)}")
        if not d:
            return
        si, di = self._index(s), self._index(d)
        for t in (self._state, self._Bstate, self._Xstate):
            t.index_copy_(1, di, t.index_select(1, si))

    def fork(self, src: int, n: int) -> torch.Tensor:
        """Allocate ``n`` slots holding copies of slot ``src``'s rows (parallel sampling)."""
        self._checked_allocated(src, "src", what="fork")
        new = self.alloc(n)
        if n:
            self.copy(src, new)
        return new

    def __repr__(self) -> str:
        return (
            f"StatePool(L={self.num_layers}, P={self.num_slots}, H={self.nheads}, D={self.headdim}, "
            f"N={self.dstate}, R={self.mimo}, state={self.state_dtype}, kv={self.kv_dtype}, "
            f"x={self.x_dtype}, device={self.device}, null_slot={self.null_slot_id}, "
            f"free={self.num_free}, {self.total_bytes / 2**20:.1f} MiB)"
        )


# ---- the decode hook -------------------------------------------------------------------
def kv_update_in_kernel(headdim: int, dstate: int, mimo: int, state_dtype, tile_D: int | None) -> bool:
    """Whether ``update_kv_state``'s precondition (``tile_D >= headdim``) holds.

    ``tile_D=None`` means the per-configuration default (:func:`tiling.default_tiling`).
    """
    if tile_D is None:
        name = str(state_dtype).removeprefix("torch.")
        tile_D, _ = default_tiling(dstate, headdim, mimo, name)
    return tile_D >= headdim


def lane_is_live(slots: torch.Tensor, num_slots: int, null_slot_id: int | None) -> torch.Tensor:
    """``(B,)`` bool: which entries of an int32 slot tensor address a pool row (SPEC padding rule)."""
    live = (slots >= 0) & (slots < num_slots)
    if null_slot_id is not None:
        live &= slots != null_slot_id
    return live


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


# ---- the gather -> dense -> scatter baseline --------------------------------------------
def gather_scatter_step(
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
    *,
    z: torch.Tensor | None = None,
    zproj: torch.Tensor | None = None,
    slots: torch.Tensor,
    dst_slots: torch.Tensor | None = None,
    null_slot_id: int | None = None,
    update_kv_state: bool = True,
    tile_D: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """What a server does without pool indexing: gather rows -> dense step -> scatter rows.

    Same arguments and effects as pool-mode ``mamba3_step_fn`` (``state`` ``(P, H, D, N)``,
    ``Bstate`` ``(P, R, H, N)``, ``Xstate`` ``(P, H, D)`` updated in place at rows ``dst`` of
    live lanes; padding lanes give zero ``out``), done the slow way with the dense kernel.
    It synchronises (boolean masking) and is meant for tests, the demo and debugging.
    ``tile_D``/``num_warps`` pick the dense kernel's tiling (compare like with like); when
    ``tile_D < headdim`` the B/x rows are stored by a copy after the dense step instead of by
    the kernel's ``update_kv_state``. Returns a fresh ``out``.
    """
    P = state.shape[0]
    live = lane_is_live(slots, P, null_slot_id)
    dst = slots if dst_slots is None else dst_slots
    write = live & (lane_is_live(dst, P, null_slot_id) if dst_slots is not None else live)
    out = torch.zeros(out_shape(x, xproj, outproj is not None), dtype=x.dtype, device=x.device)
    lanes = torch.nonzero(live).flatten()
    if lanes.numel() == 0:
        return out
    src_rows = slots[lanes].long()
    st = state.index_select(0, src_rows)
    bs = Bstate.index_select(0, src_rows)
    xs = Xstate.index_select(0, src_rows)
    sel = lambda t: None if t is None else t.index_select(0, lanes)  # noqa: E731
    in_kernel = kv_update_in_kernel(x.shape[2], B.shape[3], B.shape[1], state.dtype, tile_D)
    o = mamba3_step_fn(
        st, bs, xs, sel(A), sel(B), sel(C), D, sel(x), sel(dt), sel(trap), xproj, outproj,
        None, None, sel(z), zproj, update_kv_state=update_kv_state and in_kernel,
        tile_D=tile_D, num_warps=num_warps,
    )
    if update_kv_state and not in_kernel:
        bs.copy_(sel(B))
        xs.copy_(sel(x))
    out.index_copy_(0, lanes, o)
    wsel = write[lanes]
    wl = torch.nonzero(wsel).flatten()
    if wl.numel():
        rows = dst[lanes[wl]].long()
        state.index_copy_(0, rows, st.index_select(0, wl))
        if update_kv_state:
            Bstate.index_copy_(0, rows, bs.index_select(0, wl))
            Xstate.index_copy_(0, rows, xs.index_select(0, wl))
    return out


# ---- buckets and padding ------------------------------------------------------------------
def choose_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket ``>= n``, or None when ``n`` exceeds the largest (run eagerly)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected a non-negative int, got {n!r}")
    for b in sorted(buckets):
        if b >= n:
            return b
    return None


def _check_buckets(buckets) -> tuple[int, ...]:
    bs = tuple(buckets)
    if not bs:
        raise ValueError("buckets: expected at least one batch size, got none")
    for b in bs:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"buckets: expected positive ints, got {b!r}")
    if len(set(bs)) != len(bs):
        raise ValueError(f"buckets: expected distinct batch sizes, got {bs}")
    return tuple(sorted(bs))


def pad_slots(slots: torch.Tensor, bucket: int, pad_id: int) -> torch.Tensor:
    """``(bucket,)`` int32: ``slots`` followed by ``pad_id`` (a new tensor on ``slots``' device)."""
    n = slots.shape[0]
    if n > bucket:
        raise ValueError(f"slots: expected at most bucket={bucket} slots, got {n}")
    padded = torch.full((bucket,), pad_id, dtype=torch.int32, device=slots.device)
    padded[:n] = slots
    return padded


def pad_lanes(t: torch.Tensor, bucket: int) -> torch.Tensor:
    """``t`` (``(n, ...)``) padded with zero lanes to ``(bucket, ...)`` (a new tensor)."""
    n = t.shape[0]
    if n > bucket:
        raise ValueError(f"expected at most bucket={bucket} lanes, got {n}")
    padded = torch.zeros((bucket,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[:n] = t
    return padded


class CudaGraphStepRunner:
    """Runs :func:`decode_step` for one layer at a fixed set of batch-size buckets.

    On CUDA (``use_cuda_graph`` default: the pool is on CUDA) each bucket's step is captured
    once into a CUDA graph over static buffers; :meth:`step` copies the live lanes' inputs
    into the smallest bucket ``>= n``, pads the slot list with ``pool.pad_id`` and the
    inputs with zeros, replays, and returns the first ``n`` lanes of ``out``. Padded lanes
    are padding to the kernel (``-1``, or the reserved null slot), so they touch no pool row.
    A step larger than the largest bucket runs eagerly, unpadded. On CPU the same static
    buffers and padding are used, without graphs, so server logic is testable anywhere.

    The layer's weights (``D`` ``(H,)`` fp32; ``xproj``/``zproj``/``outproj`` ``(R, H, D)``) are
    fixed at construction (the graph reads their storage: update them in place). Per-step
    inputs: ``A``, ``dt``, ``trap`` ``(n, H)`` fp32; ``B``, ``C`` ``(n, R, H, N)``; ``x`` (and ``z``
    when ``zproj`` is given) ``(n, H, D)``. With ``with_dst=True`` a static destination-slot
    buffer is captured too and :meth:`step` takes ``dst_slots`` (prefix caching).
    Capture happens lazily on first use of a bucket, or eagerly with :meth:`capture`.
    """

    def __init__(
        self,
        pool: StatePool,
        layer: int,
        *,
        D: torch.Tensor,
        xproj: torch.Tensor,
        outproj: torch.Tensor | None = None,
        zproj: torch.Tensor | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        with_dst: bool = False,
        tile_D: int | None = None,
        num_warps: int | None = None,
        use_cuda_graph: bool | None = None,
        graph_pool=None,
    ):
        pool._layer(layer)
        self.pool = pool
        self.layer = layer
        self.D, self.xproj, self.outproj, self.zproj = D, xproj, outproj, zproj
        self.buckets = _check_buckets(buckets)
        self.with_dst = bool(with_dst)
        self.tile_D, self.num_warps = tile_D, num_warps
        is_cuda = pool.device.type == "cuda"
        if use_cuda_graph is None:
            use_cuda_graph = is_cuda
        if use_cuda_graph and not is_cuda:
            raise ValueError(f"use_cuda_graph: CUDA graphs need a CUDA pool, got device {pool.device}")
        self.use_cuda_graph = bool(use_cuda_graph)
        self.graph_pool = graph_pool
        if self.use_cuda_graph and self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        self._static: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    # static buffers -------------------------------------------------------------------
    def _make_static(self, bucket: int) -> dict[str, torch.Tensor]:
        p, dev = self.pool, self.pool.device
        H, Dh, N, R = p.nheads, p.headdim, p.dstate, p.mimo
        f32 = torch.float32
        s = {
            "slots": torch.full((bucket,), p.pad_id, dtype=torch.int32, device=dev),
            "A": torch.zeros((bucket, H), dtype=f32, device=dev),
            "dt": torch.zeros((bucket, H), dtype=f32, device=dev),
            "trap": torch.zeros((bucket, H), dtype=f32, device=dev),
            "B": torch.zeros((bucket, R, H, N), dtype=p.kv_dtype, device=dev),
            "C": torch.zeros((bucket, R, H, N), dtype=p.kv_dtype, device=dev),
            "x": torch.zeros((bucket, H, Dh), dtype=p.x_dtype, device=dev),
        }
        if self.zproj is not None:
            s["z"] = torch.zeros((bucket, H, Dh), dtype=p.x_dtype, device=dev)
        if self.with_dst:
            s["dst"] = torch.full((bucket,), p.pad_id, dtype=torch.int32, device=dev)
        lane_shape = (bucket, H, Dh) if self.outproj is not None else (bucket, R, H, Dh)
        s["out"] = torch.zeros(lane_shape, dtype=p.x_dtype, device=dev)
        return s

    def _run(self, s: dict[str, torch.Tensor]) -> torch.Tensor:
        return decode_step(
            self.pool, self.layer, s["slots"], s["A"], s["B"], s["C"], self.D, s["x"], s["dt"],
            s["trap"], self.xproj, self.outproj, z=s.get("z"), zproj=self.zproj,
            dst_slots=s.get("dst"), out=s["out"], tile_D=self.tile_D, num_warps=self.num_warps,
        )

    def capture(self, buckets: Sequence[int] | None = None) -> None:
        """Build static buffers (and, on CUDA, capture graphs) for ``buckets`` (default: all).

        During capture every slot is the pad id, so the warm-up and capture runs touch no
        pool row. The warm-up runs outside the graph (it compiles the kernel).
        """
        for b in self.buckets if buckets is None else buckets:
            if b not in self.buckets:
                raise ValueError(f"buckets: {b} is not one of this runner's buckets {self.buckets}")
            if b in self._static:
                continue
            s = self._make_static(b)
            if self.use_cuda_graph:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._run(s)  # warm-up: compiles the kernel, all lanes padding
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.graph_pool):
                    self._run(s)
                self._graphs[b] = g
            self._static[b] = s

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs if self.use_cuda_graph else self._static))

    def step(
        self,
        slots: torch.Tensor,
        *,
        A: torch.Tensor,
        dt: torch.Tensor,
        trap: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        x: torch.Tensor,
        z: torch.Tensor | None = None,
        dst_slots: torch.Tensor | None = None,
        clone: bool = True,
    ) -> torch.Tensor:
        """One padded step for ``n = len(slots)`` live lanes; returns their ``out`` ``(n, ...)``.

        ``slots`` (and ``dst_slots``) are ``(n,)`` int32, on any device (copied into the
        static buffer). With ``clone=False`` the result is a view of the static output
        buffer, overwritten by the next step of the same bucket.
        """
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1:
            raise ValueError(f"slots: expected a 1-d int32 tensor, got {getattr(slots, 'shape', type(slots))}")
        if slots.dtype != torch.int32:
            raise TypeError(f"slots: expected dtype torch.int32, got {slots.dtype}")
        if (z is None) != (self.zproj is None):
            raise ValueError(
                "z: expected a (n, H, D) tensor because the runner has zproj"
                if z is None
                else "z: this runner was built without zproj, so z must be None"
            )
        if dst_slots is not None and not self.with_dst:
            raise ValueError("dst_slots: this runner was built with with_dst=False; pass with_dst=True")
        n = slots.shape[0]
        inputs = {"A": A, "dt": dt, "trap": trap, "B": B, "C": C, "x": x}
        if z is not None:
            inputs["z"] = z
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor) or t.shape[:1] != (n,):
                raise ValueError(f"{name}: expected {n} lanes (len(slots)), got shape {tuple(getattr(t, 'shape', ()))}")
        if dst_slots is not None:
            if dst_slots.dtype != torch.int32 or tuple(dst_slots.shape) != (n,):
                raise ValueError(f"dst_slots: expected ({n},) int32, got {tuple(dst_slots.shape)} {dst_slots.dtype}")
        bucket = choose_bucket(n, self.buckets)
        if bucket is None:  # too big for any bucket: run eagerly, unpadded
            dev = self.pool.device
            return decode_step(
                self.pool, self.layer, slots.to(dev), A, B, C, self.D, x, dt, trap, self.xproj,
                self.outproj, z=z, zproj=self.zproj,
                dst_slots=None if not self.with_dst else (slots if dst_slots is None else dst_slots).to(dev),
                tile_D=self.tile_D, num_warps=self.num_warps,
            )
        if bucket not in self._static:
            self.capture([bucket])
        s = self._static[bucket]
        s["slots"][:n].copy_(slots)
        s["slots"][n:].fill_(self.pool.pad_id)
        if self.with_dst:
            s["dst"][:n].copy_(slots if dst_slots is None else dst_slots)
            s["dst"][n:].fill_(self.pool.pad_id)
        for name, t in inputs.items():
            s[name][:n].copy_(t)
            s[name][n:].zero_()
        if self.use_cuda_graph:
            self._graphs[bucket].replay()
        else:
            self._run(s)
        res = s["out"][:n]
        return res.clone() if clone else res
