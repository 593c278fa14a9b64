"""Memory of an executed kernel: global regions over torch CPU tensors, shared, local.

Global memory is the caller's own CPU tensors, addressed by their real ``data_ptr``s: the
kernel's parameter structs carry those pointers, so the address arithmetic the PTX does
(strides, 64-bit offsets, vector widths) lands on the same bytes a GPU's would. Each
tensor registered with :meth:`GlobalMemory.add` is one *region*: the bytes its view spans,
``[data_ptr, data_ptr + span)``. Every global access must lie entirely inside one region
and be aligned to its full width (a 16-byte vector access to a 16-byte boundary), or it
fails with :class:`~ptx_executor.errors.MemoryFault` before any byte moves. Bytes outside
every region (guard zones, other rows of a storage that were not passed) are unreachable.

Shared memory is one zero-initialised byte array per CTA, laid out from offset 1024 (the
first kilobyte of the shared window is reserved on sm_80+), static variables first, then
the dynamic (``extern``) array of the size the launch passes. Local memory is a byte
array per thread.

Every global access can be logged (:class:`AccessLog`): instruction, execution serial,
thread, address, width, read/write. The analyses (bytes touched, sectors per request,
races between CTAs) run on that log (:mod:`ptx_executor.analysis`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import MemoryFault

SHARED_BASE = 1024  # first shared-window address handed out (sm_80+ reserve the first 1 KiB)


def tensor_span(t: torch.Tensor) -> tuple[int, int]:
    """``(lowest address, one past the highest byte)`` of the elements a tensor view can reach."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    es = t.element_size()
    return t.data_ptr() + lo * es, t.data_ptr() + (hi + 1) * es


@dataclass
class Region:
    name: str
    start: int
    end: int
    buf: np.ndarray  # uint8 view of the storage bytes, index 0 = address ``base``
    base: int
    writable: bool = True


class GlobalMemory:
    """The global address space of one launch: named regions over CPU tensors' storage."""

    def __init__(self):
        self.regions: list[Region] = []
        self._starts = np.zeros(0, np.uint64)
        self._ends = np.zeros(0, np.uint64)

    def add(self, name: str, t: torch.Tensor, writable: bool = True) -> Region:
        """Register tensor ``t`` (CPU, any dtype/strides) as region ``name``."""
        if t.device.type != "cpu":
            raise ValueError(f"{name}: the PTX executor runs on CPU tensors, got a tensor on {t.device}")
        storage = t.untyped_storage()
        sbase = storage.data_ptr()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        start, end = tensor_span(t)
        region = Region(name, start, end, raw.numpy(), sbase, writable)
        self.regions.append(region)
        self._starts = np.array([r.start for r in self.regions], np.uint64)
        self._ends = np.array([r.end for r in self.regions], np.uint64)
        return region

    def locate(self, addr: np.ndarray, width: int) -> np.ndarray:
        """Region index of every access ``[addr, addr + width)``, -1 where none holds it whole."""
        out = np.full(addr.shape, -1, np.int64)
        if not self.regions:
            return out
        end = addr + np.uint64(width)
        for k in range(len(self.regions)):
            inside = (addr >= self._starts[k]) & (end <= self._ends[k]) & (out < 0)
            out[inside] = k
            if (out >= 0).all():
                break
        return out

    def byte_index(self, region: Region, addr: np.ndarray, width: int) -> np.ndarray:
        off = (addr - np.uint64(region.base)).astype(np.int64)
        return off[:, None] + np.arange(width, dtype=np.int64)[None, :]

    def describe(self, addr: int) -> str:
        """Where ``addr`` is relative to the regions (for fault messages)."""
        best = None
        for r in self.regions:
            if r.start <= addr < r.end:
                return f"inside {r.name} [{r.start:#x}, {r.end:#x}) but the access runs past its end"
            d = addr - r.end if addr >= r.end else r.start - addr
            if best is None or d < best[0]:
                best = (d, r)
        if best is None:
            return "no regions are registered"
        d, r = best
        side = "past the end of" if addr >= r.end else "before the start of"
        return f"{d} bytes {side} {r.name} [{r.start:#x}, {r.end:#x}), the nearest region"


@dataclass
class VarLayout:
    """Addresses of a launch's ``.shared`` and ``.local`` variables in their windows.

    Shared variables are placed from :data:`SHARED_BASE` in declaration order at their
    alignment (the dynamic ``extern`` array last, sized by the launch); local variables
    from 0 in each thread's own window.
    """
    offsets: dict  # variable name -> address in its window
    shared: list  # (name, start, end) of each shared allocation
    local: list  # (name, start, end) of each local allocation
    shared_size: int  # bytes of the shared window the CTA uses, from address 0
    local_size: int
    dynamic: int  # bytes of dynamic shared memory

    @classmethod
    def build(cls, variables: list, dynamic_smem: int) -> "VarLayout":
        offsets, shared, local = {}, [], []
        s_end, l_end = SHARED_BASE, 0
        for v in sorted(variables, key=lambda v: (v.space != "shared", v.size is None)):
            if v.space == "shared":
                start = -(-s_end // v.align) * v.align
                size = dynamic_smem if v.size is None else v.size
                shared.append((v.name, start, start + size))
                s_end = start + size
            else:
                start = -(-l_end // v.align) * v.align
                local.append((v.name, start, start + (v.size or 0)))
                l_end = start + (v.size or 0)
            offsets[v.name] = start
        return cls(offsets, shared, local, s_end, l_end, dynamic_smem)

    def locate(self, space: str, addr: np.ndarray, width: int) -> np.ndarray:
        """Allocation index of every ``[addr, addr + width)`` in ``space``, -1 if none holds it."""
        out = np.full(addr.shape, -1, np.int64)
        end = addr + width
        for k, (_, s, e) in enumerate(self.shared if space == "shared" else self.local):
            out[(addr >= s) & (end <= e) & (out < 0)] = k
        return out


@dataclass
class AccessLog:
    """Global accesses of one launch, appended per executed memory instruction."""
    instr: list = field(default_factory=list)  # PTX line of the instruction
    serial: list = field(default_factory=list)  # execution serial (one per warp-group execution)
    thread: list = field(default_factory=list)  # global linear thread id arrays
    addr: list = field(default_factory=list)  # address arrays (uint64)
    width: list = field(default_factory=list)
    write: list = field(default_factory=list)
    epoch: list = field(default_factory=list)  # barrier epoch of the chunk when it happened
    #: per-thread facts logged with each access, ``name -> callable(global thread ids) -> array``, set by the
    #: machine for each chunk: the cluster barrier's arrivals and completed waits (``arrived``, ``waited``:
    #: :mod:`.isa_cluster`), whether the thread passed ``griddepcontrol.wait`` (``after_dependency_wait``)
    tag_sources: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)  # name -> list of per-access arrays

    def append(self, instr: int, serial: int, thread: np.ndarray, addr: np.ndarray, width: int, write: bool,
               epoch: int = 0):
        for name, source in self.tag_sources.items():
            self.tags.setdefault(name, []).append(source(thread))
        self.instr.append(instr)
        self.serial.append(serial)
        self.thread.append(thread)
        self.addr.append(addr)
        self.width.append(width)
        self.write.append(write)
        self.epoch.append(epoch)

    def arrays(self) -> dict:
        """The log as flat arrays (one element per thread access)."""
        if not self.addr:
            e = np.zeros(0, np.int64)
            return dict(instr=e, serial=e, thread=e, addr=np.zeros(0, np.uint64), width=e, write=np.zeros(0, bool),
                        epoch=e)
        n = [len(a) for a in self.addr]
        tags = {name: np.concatenate(arrays) for name, arrays in self.tags.items()}
        return tags | dict(
            instr=np.repeat(np.array(self.instr, np.int64), n),
            serial=np.repeat(np.array(self.serial, np.int64), n),
            thread=np.concatenate(self.thread).astype(np.int64),
            addr=np.concatenate(self.addr).astype(np.uint64),
            width=np.repeat(np.array(self.width, np.int64), n),
            write=np.repeat(np.array(self.write, bool), n),
            epoch=np.repeat(np.array(self.epoch, np.int64), n),
        )


def fault(kind: str, msg: str, instr, thread_ids: np.ndarray, addrs: np.ndarray, bad: np.ndarray, locate):
    """Raise a MemoryFault for the first offending thread of an access."""
    k = int(np.flatnonzero(bad)[0])
    cta, tid = locate(int(thread_ids[k]))
    raise MemoryFault(f"{kind}: {msg}", line=instr.line, instruction=instr.text, cta=cta, thread=tid,
                      address=int(addrs[k]))
