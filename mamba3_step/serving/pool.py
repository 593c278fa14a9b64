"""``StatePool``: per-layer recurrent-state pools of ``P`` slots and their slot allocator.

Letters (docs/contract.md): ``P`` pool rows (slots), ``H`` heads, ``D`` head dim, ``N`` state
size, ``R`` MIMO rank, ``L`` layers.
"""

from __future__ import annotations

import heapq
import numbers
import threading
from collections.abc import Iterable

import torch

from ..contract import PAD_SLOT_ID, SUPPORTED_D, SUPPORTED_N, SUPPORTED_R, as_torch_dtype

__all__ = ["PoolExhaustedError", "SlotError", "StatePool"]


class SlotError(ValueError):
    """A slot handed to the allocator is unknown, reserved, or not allocated (double free)."""


class PoolExhaustedError(RuntimeError):
    """``alloc(n)`` asked for more slots than are free."""


def _is_int(v) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _slot_list(slots, name: str) -> list[int]:
    """Slots as a Python list of ints (accepts an int, a sequence of ints, or an integer tensor;
    numpy integers and arrays count as ints)."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor of slots, got dtype {slots.dtype}")
        if slots.dim() > 1:
            raise ValueError(f"{name}: expected a 0-d or 1-d tensor of slots, got shape {tuple(slots.shape)}")
        return [int(v) for v in slots.reshape(-1).tolist()]
    if isinstance(slots, bool):
        raise TypeError(f"{name}: expected slot ints, got bool")
    if _is_int(slots):
        return [int(slots)]
    if isinstance(slots, Iterable):
        out = []
        for v in slots:
            if not _is_int(v):
                if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.dtype.is_floating_point \
                        and v.dtype != torch.bool:
                    v = int(v)
                else:
                    raise TypeError(f"{name}: expected slot ints, got element {v!r}")
            out.append(int(v))
        return out
    raise TypeError(f"{name}: expected an int, a sequence of ints or an integer tensor, got {type(slots).__name__}")


def _checked_size(name: str, v, supported=None) -> int:
    if not _is_int(v) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if supported is not None and v not in supported:
        raise ValueError(f"{name}: expected one of {supported} (the sizes the step supports), got {v!r}")
    return int(v)


def _checked_device(device) -> torch.device:
    """``device`` as a torch.device that exists here; ValueError naming it otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda', got {device!r} ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: expected a device this process can use, got {device!r}, but CUDA "
                             f"is not available (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: expected a CUDA device index below {torch.cuda.device_count()} "
                             f"(the visible GPUs), got {device!r}")
    return dev


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
    ``free(slots)`` returns them. The allocator is thread-safe: ``alloc``, ``free``, ``reset``,
    ``copy``, ``fork`` and the counts hold one re-entrant lock per pool, so scheduler threads may
    share a pool (the tensors themselves are not locked: steps on them are the caller's to order). Freeing a slot twice, an unknown slot (out of range) or the
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
        num_layers, num_slots, nheads = (_checked_size(n, v) for n, v in (
            ("num_layers", num_layers), ("num_slots", num_slots), ("nheads", nheads)))
        headdim = _checked_size("headdim", headdim, SUPPORTED_D)
        dstate = _checked_size("dstate", dstate, SUPPORTED_N)
        mimo = _checked_size("mimo", mimo, SUPPORTED_R)
        if not isinstance(reserve_null_slot, bool):
            raise TypeError(f"reserve_null_slot: expected a bool, got {type(reserve_null_slot).__name__} "
                            f"{reserve_null_slot!r}")
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
        self.state_dtype = as_torch_dtype(state_dtype, "state_dtype")
        self.kv_dtype = as_torch_dtype(kv_dtype, "kv_dtype")
        self.x_dtype = self.kv_dtype if x_dtype is None else as_torch_dtype(x_dtype, "x_dtype")
        self.device = _checked_device(device)
        self.reserve_null_slot = reserve_null_slot

        L, P, H, D, N, R = num_layers, num_slots, nheads, headdim, dstate, mimo
        self._state = torch.zeros((L, P, H, D, N), dtype=self.state_dtype, device=self.device)
        # one hidden scratch row (index P) for masked B/x scatters of padded lanes
        self._Bstate = torch.zeros((L, P + 1, R, H, N), dtype=self.kv_dtype, device=self.device)
        self._Xstate = torch.zeros((L, P + 1, H, D), dtype=self.x_dtype, device=self.device)

        first = 1 if self.reserve_null_slot else 0
        self._lock = threading.RLock()  # guards the free list and the allocated flags
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
        if not _is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

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
            return _is_int(slot) and 0 <= slot < self.num_slots and bool(self._allocated[slot])

    def allocated_slots(self) -> list[int]:
        with self._lock:
            return [i for i, a in enumerate(self._allocated) if a]

    def alloc(self, n: int, *, zero: bool = False) -> torch.Tensor:
        """Allocate ``n`` slots (the lowest free ones). Returns ``(n,)`` int32 on the CPU.

        With ``zero=True`` their rows are reset (all layers) before returning. Raises
        :class:`PoolExhaustedError` (allocating nothing) when fewer than ``n`` are free.
        Thread-safe (like every allocator method): the pool's lock is held throughout.
        """
        if not _is_int(n) or n < 0:
            raise ValueError(f"n: expected a non-negative int, got {n!r}")
        n = int(n)
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
        reserved null slot, a slot that is not allocated (double free) or one listed twice
        raises :class:`SlotError` and frees nothing. Rows keep their contents.
        """
        with self._lock:
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
        with self._lock:  # the slots stay allocated (to their owner) until the rows are zeroed
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
            for t in (self._state, self._Bstate, self._Xstate):
                t.index_copy_(1, di, t.index_select(1, si))

    def fork(self, src: int, n: int) -> torch.Tensor:
        """Allocate ``n`` slots holding copies of slot ``src``'s rows (parallel sampling)."""
        with self._lock:
            self._checked_allocated(src, "src", what="fork")
            new = self.alloc(n)
            if len(new):
                self.copy(src, new)
            return new

    def __repr__(self) -> str:
        return (
            f"StatePool(L={self.num_layers}, P={self.num_slots}, H={self.nheads}, D={self.headdim}, "
            f"N={self.dstate}, R={self.mimo}, state={self.state_dtype}, kv={self.kv_dtype}, "
            f"x={self.x_dtype}, device={self.device}, null_slot={self.null_slot_id}, "
            f"free={self.num_free}, {self.total_bytes / 2**20:.1f} MiB)"
        )
