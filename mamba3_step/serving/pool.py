"""``StatePool``: per-layer recurrent-state pools of ``P`` slots and their slot allocator.

Letters (docs/contract.md): ``P`` pool rows (slots), ``H`` heads, ``D`` head dim, ``N`` state
size, ``R`` MIMO rank, ``L`` layers.
"""

from __future__ import annotations

import heapq
import threading

import torch

from ..contract import (INT32_MAX, KV_DTYPES, MAX_GRID_Y, PAD_SLOT_ID, SCALED_STATE_DTYPES, STATE_DTYPES,
                        SUPPORTED_D, SUPPORTED_N, SUPPORTED_R, X_DTYPES, dtype_name, shown)
from ..spec import MAX_TOKENS
from ..validation.checks import check_bool_option
from .pool_args import checked_device, checked_dtype, checked_size
from .slots import PoolExhaustedError, SlotError, int_list, is_int
from .speculative import SpecGroups, SpecIndices

__all__ = ["PoolExhaustedError", "SlotError", "SpecIndices", "StatePool"]


class StatePool:
    """Per-layer recurrent-state pools of ``P`` slots for ``L`` layers, plus a slot allocator.

    Per layer ``l`` it holds (row ``p`` belongs to the request that owns slot ``p``):

    * ``state(l)``  ``(P, H, D, N)``  ``state_dtype`` (fp32 / bf16 / fp16, or 8-bit: int8 / float8_e4m3fn)
    * ``state_scale(l)`` ``(P, H, D)`` fp32, with an 8-bit ``state_dtype`` only (else None): the
      state row's scales, element ``(h, d, n)`` reading as ``state * state_scale[h, d]``
    * ``Bstate(l)`` ``(P, R, H, N)``  ``kv_dtype``    (previous step's B)
    * ``Xstate(l)`` ``(P, H, D)``     ``x_dtype``     (previous step's x; defaults to ``kv_dtype``)
    * ``angle_state(l)`` ``(P, H, S)`` int64 (the rotary angle, fixed-point turns), with ``rope_angles=S``
      (rotary angles per head, in ``[1, N/2]``; default 0: no angle pool, ``angle_state(l)`` is None)
    * with replay (:class:`~mamba3_step.serving.replay_pool.ReplayStatePool`) a ring per layer

    These are contiguous views into one allocation per tensor kind, ``(L, P, ...)``, so
    ``reset`` and ``copy`` touch every layer with one indexing op, and every kind alike (a reset
    angle is 0, a reset 8-bit row zero codes with scale 0, reading as exact zeros; a copied row
    holds the source's bits, its scales too). ``Bstate``/``Xstate`` carry one hidden scratch row
    after the ``P`` visible ones (never handed to the kernel, never allocated); the decode hook
    sends padded lanes' B/x there when it has to scatter B/x itself (``tile_D < headdim``). The
    pool is zero-initialised.

    Allocator: ``alloc(n)`` hands out the ``n`` lowest free slots as a CPU int32 tensor;
    ``free(slots)`` returns them. The allocator is thread-safe: ``alloc``, ``free``, ``reset``,
    ``copy``, ``fork`` and the counts hold one re-entrant lock per pool, so scheduler threads may
    share a pool (the tensors themselves are not locked: steps on them are the caller's to order).
    Freeing a slot twice, an unknown slot (out of range) or the reserved null slot raises
    :class:`SlotError`; asking for more slots than are free raises :class:`PoolExhaustedError` and
    allocates nothing.

    Speculative decoding (``T`` tokens per verify step, vLLM's convention): ``alloc_spec(n, T)``
    gives each of ``n`` requests a *group* of ``T`` rows, ``(n, T)``; ``spec_indices(groups)`` builds
    a verify step's ``(B, T)`` sources with ``num_accepted_tokens`` and its ``(B, T)`` per-token
    destinations; ``commit_accepted(groups, accepted)`` records how many tokens stood, by index (the
    request continues from row ``groups[b, accepted[b] - 1]``; nothing is copied);
    ``current_rows(groups)`` says which row that is; ``free_spec(groups)`` returns whole groups.
    These hold the same lock, check everything before changing anything, and raise
    :class:`SlotError` / ``ValueError`` / ``TypeError`` naming the argument.

    ``reserve_null_slot=True`` keeps row 0 out of the allocator for servers that pad with
    ``0`` rather than ``-1``: then ``null_slot_id == pad_id == 0`` and the kernel treats a
    lane addressing row 0 as padding (reads and writes nothing). Otherwise ``null_slot_id``
    is None and ``pad_id`` is ``-1``.
    """

    replay_ring = 0  #: F, the flush length of a replay pool (ReplayStatePool); 0: the state rows are current

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
        rope_angles: int = 0,
    ):
        num_layers, num_slots, nheads = (checked_size(n, v, top=top) for n, v, top in (  # rows: int32 slot ids
            ("num_layers", num_layers, None), ("num_slots", num_slots, INT32_MAX), ("nheads", nheads, MAX_GRID_Y)))
        headdim = checked_size("headdim", headdim, SUPPORTED_D)
        dstate = checked_size("dstate", dstate, SUPPORTED_N)
        mimo = checked_size("mimo", mimo, SUPPORTED_R)
        if not is_int(rope_angles) or not 0 <= rope_angles <= dstate // 2:
            raise ValueError(f"rope_angles: expected an int in [0, dstate/2 = {dstate // 2}] (rotary angles per head, "
                             f"each rotating one pair of B/C's dstate elements; 0: none), got {shown(rope_angles)}")
        if not isinstance(reserve_null_slot, bool):
            raise TypeError(f"reserve_null_slot: expected a bool, got {type(reserve_null_slot).__name__} "
                            f"{shown(reserve_null_slot)}")
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
        self.rope_angles = int(rope_angles)
        self.state_dtype = checked_dtype(state_dtype, "state_dtype", STATE_DTYPES)
        self.kv_dtype = checked_dtype(kv_dtype, "kv_dtype", KV_DTYPES)
        self.x_dtype = self.kv_dtype if x_dtype is None else checked_dtype(x_dtype, "x_dtype", X_DTYPES)
        self.device = checked_device(device)
        self.reserve_null_slot = reserve_null_slot

        L, P, H, D, N, R = num_layers, num_slots, nheads, headdim, dstate, mimo
        self._state = torch.zeros((L, P, H, D, N), dtype=self.state_dtype, device=self.device)
        # one hidden scratch row (index P) for masked B/x scatters of padded lanes
        self._Bstate = torch.zeros((L, P + 1, R, H, N), dtype=self.kv_dtype, device=self.device)
        self._Xstate = torch.zeros((L, P + 1, H, D), dtype=self.x_dtype, device=self.device)
        S = self.rope_angles
        self._angle_state = torch.zeros((L, P, H, S), dtype=torch.int64, device=self.device) if S else None
        scaled = dtype_name(self.state_dtype) in SCALED_STATE_DTYPES  # 8-bit: a scale per (row, head, d)
        self._state_scale = torch.zeros((L, P, H, D), dtype=torch.float32, device=self.device) if scaled else None
        self._ring = None  # with replay (ReplayStatePool): the (L, P, ...) allocation of each Ring field

        first = 1 if self.reserve_null_slot else 0
        self._lock = threading.RLock()  # guards the free list and the allocated flags
        self._free_heap: list[int] = list(range(first, P))
        heapq.heapify(self._free_heap)
        self._allocated = bytearray(P)  # 1 where the slot is allocated
        self._groups = SpecGroups()  # speculative groups among the allocated slots

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

    def angle_state(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s rotary-angle pool, ``(P, H, S)`` int64, contiguous view; None without ``rope_angles``."""
        layer = self._layer(layer)
        return None if self._angle_state is None else self._angle_state[layer]

    def state_scale(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s state-scale pool, ``(P, H, D)`` fp32, contiguous view; None unless the state is 8-bit."""
        layer = self._layer(layer)
        return None if self._state_scale is None else self._state_scale[layer]

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(state, Bstate, Xstate)`` of one layer (views, see above); the angle: :meth:`layer_rows`."""
        return self.state(layer), self.Bstate(layer), self.Xstate(layer)

    def layer_rows(self, layer: int) -> dict[str, torch.Tensor | None]:
        """Every row tensor of one layer by its step argument name (``tensors.ROW_FIELDS``): ``state``,
        ``Bstate``, ``Xstate``, ``angle_state`` (None without ``rope_angles``) and, with an 8-bit state
        only, ``state_scale`` (absent otherwise: splatted into a step, it is then its default, None).
        What a step supplies."""
        state, Bstate, Xstate = self.layer_tensors(layer)
        rows = dict(state=state, Bstate=Bstate, Xstate=Xstate, angle_state=self.angle_state(layer))
        return rows if self._state_scale is None else dict(rows, state_scale=self.state_scale(layer))

    def _pools(self) -> tuple[torch.Tensor, ...]:
        """The ``(L, P[+1], ...)`` allocations whose rows belong to the slots (every kind a row op touches);
        a float8 one as its bytes (PyTorch's index ops take no float8; bytes copy and zero alike)."""
        kinds = (self._state, self._Bstate, self._Xstate, self._angle_state, self._state_scale, *(self._ring or ()))
        return tuple(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in kinds if t is not None)

    def _layer(self, layer: int) -> int:
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {shown(layer)}")
        return int(layer)

    @property
    def bytes_per_slot_per_layer(self) -> int:
        """Bytes one slot occupies in one layer (state + Bstate + Xstate rows, the angle and scale rows, the
        ring's entries and length)."""
        H, D, N, R = self.nheads, self.headdim, self.dstate, self.mimo
        ring = 0 if self._ring is None else sum(t[0, 0].numel() * t.element_size() for t in self._ring if t is not None)
        return (
            H * D * N * self.state_dtype.itemsize
            + R * H * N * self.kv_dtype.itemsize
            + H * D * self.x_dtype.itemsize
            + H * self.rope_angles * 8
            + (0 if self._state_scale is None else H * D * 4)
            + ring
        )

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot (one request) occupies across all ``L`` layers."""
        return self.num_layers * self.bytes_per_slot_per_layer

    @property
    def total_bytes(self) -> int:
        """Bytes the pool allocated: ``P * bytes_per_slot`` plus the B/x scratch rows."""
        return sum(t.numel() * t.element_size() for t in self._pools())

    # ---- allocator ----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free_heap)

    @property
    def num_allocated(self) -> int:
        with self._lock:
            return sum(self._allocated)

    @property
    def capacity(self) -> int:
        """Slots a server can hold at once (``P``, minus the null slot when reserved)."""
        return self.num_slots - (1 if self.reserve_null_slot else 0)

    def is_allocated(self, slot: int) -> bool:
        with self._lock:
            return is_int(slot) and 0 <= slot < self.num_slots and bool(self._allocated[slot])

    def allocated_slots(self) -> list[int]:
        with self._lock:
            return [i for i, a in enumerate(self._allocated) if a]

    def alloc(self, n: int, *, zero: bool = False) -> torch.Tensor:
        """Allocate ``n`` slots (the lowest free ones). Returns ``(n,)`` int32 on the CPU.

        With ``zero=True`` (a bool) their rows are reset (all layers) before returning. Raises
        :class:`PoolExhaustedError` (allocating nothing) when fewer than ``n`` are free.
        Thread-safe (like every allocator method): the pool's lock is held throughout.
        """
        if not is_int(n) or n < 0:
            raise ValueError(f"n: expected a non-negative int, got {shown(n)}")
        n, zero = int(n), check_bool_option("zero", zero)
        with self._lock:
            return self._alloc_locked(n, zero)

    def _alloc_locked(self, n: int, zero: bool) -> torch.Tensor:
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
        reserved null slot, a slot that is not allocated (double free), one listed twice or a
        row of a speculative group (free the whole group with :meth:`free_spec`) raises
        :class:`SlotError` and frees nothing. Rows keep their contents.
        """
        with self._lock:
            lst = self._checked_allocated(slots, "slots", what="free")
            for i, s in enumerate(lst):
                group = self._groups.group_of(s)
                if group is not None:
                    raise SlotError(f"slots[{i}]: cannot free slot {s}: it is a row of the speculative group "
                                    f"{list(group)}; free the whole group with free_spec")
            self._release(lst)

    def _release(self, lst: list[int]) -> None:
        for s in lst:
            self._allocated[s] = 0
            heapq.heappush(self._free_heap, s)

    def _checked_allocated(self, slots, name: str, *, what: str, unique: bool = True) -> list[int]:
        lst = int_list(slots, name)
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
        """Zero the rows of ``slots`` (allocated slots) in every layer: state, Bstate, Xstate, angle, scale,
        and with replay the ring rows (an empty ring: the zero checkpoint is the current state)."""
        with self._lock:  # the slots stay allocated (to their owner) until the rows are zeroed
            lst = self._checked_allocated(slots, "slots", what="reset")
            if not lst:
                return
            idx = self._index(lst)
            for t in self._pools():
                t.index_fill_(1, idx, 0)

    def copy(self, src, dst) -> None:
        """Fork rows: every layer's ``state``/``Bstate``/``Xstate`` (angle, scale, ring with its length) row
        ``dst[i]`` := row ``src[i]`` (with replay the checkpoint and the ring as they are: nothing replayed).

        ``src`` has one slot (broadcast to every ``dst``: parallel sampling) or ``len(dst)``
        slots (beam search reordering). All slots must be allocated; ``dst`` must not repeat.
        Sources are read before any destination is written, so ``src`` and ``dst`` may overlap.
        """
        with self._lock:
            s = self._checked_allocated(src, "src", what="copy from", unique=False)
            d = self._checked_allocated(dst, "dst", what="copy to")
            if len(s) == 1 and len(d) != 1:
                s = s * len(d)
            if len(s) != len(d):
                raise ValueError(f"src: expected 1 or len(dst)={len(d)} slots, got {len(s)}")
            if not d:
                return
            si, di = self._index(s), self._index(d)
            for t in self._pools():
                t.index_copy_(1, di, t.index_select(1, si))

    def fork(self, src: int, n: int) -> torch.Tensor:
        """Allocate ``n`` slots holding copies of slot ``src``'s rows (parallel sampling).

        ``src`` is one allocated slot (an int, or a one-element sequence or tensor). A refused fork
        takes no slot and writes no row.
        """
        with self._lock:
            s = self._checked_allocated(src, "src", what="fork")
            if len(s) != 1:
                raise ValueError(f"src: expected one slot to fork, got {len(s)}")
            new = self.alloc(n)
            try:
                if len(new):
                    self.copy(s, new)
            except BaseException:
                self.free(new)  # all or nothing
                raise
            return new

    # ---- speculative groups (docs/integration.md, "Speculative decoding") -------------
    def alloc_spec(self, n: int, T: int, *, zero: bool = False) -> torch.Tensor:
        """Allocate ``n`` speculative groups of ``T`` rows: ``(n, T)`` int32 on the CPU, one row per request.

        Request ``b`` owns rows ``groups[b]``: a verify step of ``T`` tokens writes the state after
        token ``t`` to ``groups[b, t]``. A new group's committed row is ``groups[b, 0]`` (count 1):
        write the request's prefill state there (or ``copy`` a cached prefix into it). With
        ``zero=True`` the ``n * T`` rows are reset first. Raises ``ValueError`` for ``n``/``T``
        (``1 <= T <= MAX_TOKENS``) and :class:`PoolExhaustedError` (allocating nothing) when fewer
        than ``n * T`` slots are free.
        """
        if not is_int(n) or n < 0:
            raise ValueError(f"n: expected a non-negative int (the number of requests), got {shown(n)}")
        if not is_int(T) or not 1 <= T <= MAX_TOKENS:
            raise ValueError(f"T: expected an int in [1, {MAX_TOKENS}] (tokens per verify step), got {shown(T)}")
        n, T, zero = int(n), int(T), check_bool_option("zero", zero)
        with self._lock:
            if n * T > len(self._free_heap):
                raise PoolExhaustedError(f"StatePool exhausted: asked for {n} speculative group(s) of T={T} rows "
                                         f"({n * T} slots), {len(self._free_heap)} free of {self.capacity}")
            groups = self._alloc_locked(n * T, zero).view(n, T)
            self._groups.add([tuple(r) for r in groups.tolist()])
            return groups

    def free_spec(self, groups) -> None:
        """Return whole groups (``(T,)`` or ``(n, T)``, as :meth:`alloc_spec` gave them) to the allocator.

        Every group is checked before any row is freed: rows that are not one group in its order,
        a group listed twice or freed before (double free) raise :class:`SlotError`, freeing nothing.
        """
        with self._lock:
            gids = self._groups.resolve(groups, "groups", self.is_allocated)
            rows = [r for g in gids for r in self._groups.rows(g)]
            self._groups.remove(gids)
            self._release(rows)

    def commit_accepted(self, groups, num_accepted_tokens) -> None:
        """After a verify step: request ``b`` continues from row ``groups[b, num_accepted_tokens[b] - 1]``.

        Index remapping, no copy: the rows are not touched; the pool records the counts, which
        :meth:`spec_indices` hands the next step as ``num_accepted_tokens`` (the kernel then reads
        that row) and :meth:`current_rows` reports. ``num_accepted_tokens`` is ``(n,)`` ints (a
        sequence or an integer tensor on any device: host bookkeeping, it synchronises), each in
        ``[1, T]``. Everything is checked first: a bad group (:class:`SlotError`), a wrong count
        of counts or a count outside ``[1, T]`` (``ValueError``), non-integers (``TypeError``)
        change nothing.
        """
        with self._lock:
            gids = self._groups.resolve(groups, "groups", self.is_allocated)
            counts = self._groups.checked_counts(gids, num_accepted_tokens, "num_accepted_tokens")
            self._groups.commit(gids, counts)

    def spec_indices(self, groups, *, device=None) -> SpecIndices:
        """A verify step's indices for requests ``groups`` (``(B, T)``, one ``T`` for the batch).

        Returns :class:`SpecIndices`: ``state_batch_indices`` ``(B, T)`` (the groups),
        ``num_accepted_tokens`` ``(B,)`` (their committed counts) and ``dst_state_batch_indices``
        ``(B, T)`` (the groups again), int32 on ``device`` (default: the pool's). Each lane reads
        its committed row and writes its own ``T`` rows: race-free, the one row it overwrites
        being the one it read.
        """
        with self._lock:
            gids = self._groups.resolve(groups, "groups", self.is_allocated)
            T = self._groups.same_size(gids, "groups")
            rows = torch.tensor([self._groups.rows(g) for g in gids], dtype=torch.int32).view(len(gids), T)
            nat = torch.tensor([self._groups.accepted(g) for g in gids], dtype=torch.int32)
        dev = self.device if device is None else checked_device(device)
        return SpecIndices(rows.to(dev), nat.to(dev), rows.clone().to(dev))

    def current_rows(self, groups) -> torch.Tensor:
        """``(n,)`` int32 on the CPU: the row each group's request continues from (its committed row).

        For a one-token step of those requests (``decode_step(pool, l, current_rows(groups), ...)``
        updates that row in place), or to ``copy`` a cached prefix in or a request's state out.
        """
        with self._lock:
            gids = self._groups.resolve(groups, "groups", self.is_allocated)
            return torch.tensor([self._groups.rows(g)[self._groups.accepted(g) - 1] for g in gids],
                                dtype=torch.int32)

    def __repr__(self) -> str:
        return (
            f"StatePool(L={self.num_layers}, P={self.num_slots}, H={self.nheads}, D={self.headdim}, "
            f"N={self.dstate}, R={self.mimo}, S={self.rope_angles}, state={self.state_dtype}"
            f"{'' if self._state_scale is None else ' (state_scale=torch.float32)'}, kv={self.kv_dtype}, "
            f"x={self.x_dtype}, device={self.device}, null_slot={self.null_slot_id}, "
            f"free={self.num_free}, {self.total_bytes / 2**20:.1f} MiB)"
        )
