"""Loads, stores and address conversion: ``ld``, ``st``, ``cvta``.

State spaces: ``.global`` (the registered tensors; bounds, alignment and writability
checked, every access logged), ``.shared`` (the CTA's array; bounds against the
variables' allocations), ``.local`` (the thread's array), ``.param`` (the launch's
parameter bytes, read-only) and generic addresses (``ld``/``st`` without a space), which
resolve through the windows ``cvta`` maps shared and local addresses into.

While ``cp.async`` copies are in flight (``F.async_pending``), shared accesses and global
stores are checked against them (:mod:`.isa_async`); with none in flight the check is one
integer test. Kernels with bulk copies check them against the bulk copies in flight and record
generic shared writes for the ``fence.proxy.async`` check (``F.bulk_hooks``, :mod:`.isa_bulk`).
"""

from __future__ import annotations

import numpy as np

from .errors import MemoryFault
from .frame import VIEW
from .isa import check_mods, handler, unsupported
from .memory import fault
from .ir import Mem, Reg, Sym, Vec

GENERIC_SHARED = np.uint64(1 << 60)  # generic addresses of the shared window start here
GENERIC_LOCAL = np.uint64((1 << 60) + (1 << 56))
_WINDOW = np.uint64(1 << 32)
_SPACES = ("global", "shared", "local", "param")


def _parse_access(ins):
    """(space or 'generic', vector length, element type) of an ld/st."""
    mods = [m for m in ins.mods if m not in ("nc",)]
    space = next((m for m in mods if m in _SPACES), "generic")
    vec = next((int(m[1:]) for m in mods if m in ("v2", "v4", "v8")), 1)
    t = ins.mods[-1]
    allowed = {space, t, "v2", "v4", "v8", "nc"} if space != "generic" else {t, "v2", "v4", "v8"}
    check_mods(ins, allowed)
    if t not in VIEW or t == "pred":
        raise unsupported(ins, f"type .{t}")
    return space, vec, t


def _address(F, mem: Mem, idx, space: str) -> np.ndarray:
    off = np.uint64(mem.offset & 0xFFFFFFFFFFFFFFFF)
    n = F.n if idx is None else len(idx)
    if mem.base is None:
        base = np.full(n, 0, np.uint64)
    elif isinstance(mem.base, Reg):
        raw = F.regs[mem.base.name]
        base = (raw if idx is None else raw[idx]).astype(np.uint64)
    elif isinstance(mem.base, Sym):
        base = np.full(n, F.symbol_address(mem.base.name), np.uint64)
    else:
        raise AssertionError(mem)
    with np.errstate(over="ignore"):
        addr = base + off
    if space == "shared":
        addr = addr & np.uint64(0xFFFFFFFF)
    return addr


def _check_window(F, ins, space, addr, width, threads):
    kind = F.layout.locate(space, addr, width)
    bad = kind < 0
    if bad.any():
        fault(f"{space} access of {width} bytes outside every {space} allocation",
              f"allocations {getattr(F.layout, space)}", ins, threads, addr, bad, F.who)
    bad = addr % np.uint64(width) != 0
    if bad.any():
        fault("misaligned access", f"a {width}-byte {space} access needs {width}-byte alignment",
              ins, threads, addr, bad, F.who)


def _check_global(F, ins, addr, width, threads, write: bool) -> np.ndarray:
    where = F.memory.locate(addr, width)
    bad = where < 0
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        fault("global access outside every tensor", F.memory.describe(int(addr[k])), ins, threads, addr, bad, F.who)
    bad = addr % np.uint64(width) != 0
    if bad.any():
        fault("misaligned access", f"a {width}-byte global access needs {width}-byte alignment",
              ins, threads, addr, bad, F.who)
    if write:
        ro = np.array([not F.memory.regions[k].writable for k in range(len(F.memory.regions))])[where]
        if ro.any():
            k = int(np.flatnonzero(ro)[0])
            fault("write to a read-only tensor", f"{F.memory.regions[where[k]].name} is an input of this launch",
                  ins, threads, addr, ro, F.who)
    return where


def _generic_split(addr):
    """Masks of generic addresses in the shared window, the local window, and global."""
    sh = (addr >= GENERIC_SHARED) & (addr < GENERIC_SHARED + _WINDOW)
    lo = (addr >= GENERIC_LOCAL) & (addr < GENERIC_LOCAL + _WINDOW)
    return sh, lo, ~(sh | lo)


def load_bytes(F, ins, space, addr, width, threads) -> np.ndarray:
    """``(n, width)`` uint8 of an access at ``addr`` per thread, checked and logged."""
    if space == "global":
        where = _check_global(F, ins, addr, width, threads, write=False)
        out = np.empty((len(addr), width), np.uint8)
        for k in np.unique(where):
            sel = where == k
            r = F.memory.regions[k]
            out[sel] = r.buf[F.memory.byte_index(r, addr[sel], width)]
        if F.log is not None:
            F.log.append(ins.line, F.serial, F.first_thread + threads, addr, width, False, F.epoch)
        return out
    if space in ("shared", "local"):
        _check_window(F, ins, space, addr, width, threads)
        cols = addr.astype(np.int64)[:, None] + np.arange(width)[None, :]
        if space == "shared":
            if F.async_pending:
                F.async_state.shared_access(F, ins, addr, width, threads, write=False)
            if F.bulk_hooks:
                F.bulk_state.shared_access(F, ins, addr, width, threads, write=False)
            if F.log_shared is not None:
                F.log_shared.append(ins.line, F.serial, F.first_thread + threads, addr, width, False, F.epoch)
            return F.shared[F.cta_local[threads][:, None], cols]
        return F.local[threads[:, None], cols]
    return _generic(F, ins, addr, width, threads, None)


def store_bytes(F, ins, space, addr, width, threads, data: np.ndarray) -> None:
    if space == "global":
        where = _check_global(F, ins, addr, width, threads, write=True)
        if F.async_pending:
            F.async_state.global_write(F, ins, addr, width, threads)
        if F.bulk_hooks:
            F.bulk_state.global_write(F, ins, addr, width, threads)
        for k in np.unique(where):
            sel = where == k
            r = F.memory.regions[k]
            r.buf[F.memory.byte_index(r, addr[sel], width)] = data[sel]
        if F.log is not None:
            F.log.append(ins.line, F.serial, F.first_thread + threads, addr, width, True, F.epoch)
        return
    if space in ("shared", "local"):
        _check_window(F, ins, space, addr, width, threads)
        cols = addr.astype(np.int64)[:, None] + np.arange(width)[None, :]
        if space == "shared":
            if F.async_pending:
                F.async_state.shared_access(F, ins, addr, width, threads, write=True)
            if F.bulk_hooks:
                F.bulk_state.shared_access(F, ins, addr, width, threads, write=True)
            if F.log_shared is not None:
                F.log_shared.append(ins.line, F.serial, F.first_thread + threads, addr, width, True, F.epoch)
            F.shared[F.cta_local[threads][:, None], cols] = data
        else:
            F.local[threads[:, None], cols] = data
        return
    _generic(F, ins, addr, width, threads, data)


def _generic(F, ins, addr, width, threads, data):
    sh, lo, gl = _generic_split(addr)
    out = None if data is not None else np.empty((len(addr), width), np.uint8)
    for mask, space, base in ((sh, "shared", GENERIC_SHARED), (lo, "local", GENERIC_LOCAL), (gl, "global", None)):
        if not mask.any():
            continue
        a = addr[mask] - base if base is not None else addr[mask]
        if data is None:
            out[mask] = load_bytes(F, ins, space, a, width, threads[mask])
        else:
            store_bytes(F, ins, space, a, width, threads[mask], data[mask])
    return out


def _param_bytes(F, ins, mem: Mem, width: int) -> np.ndarray:
    if not isinstance(mem.base, Sym) or mem.base.name not in F.params:
        raise MemoryFault("ld.param from something that is not a kernel parameter", line=ins.line,
                          instruction=ins.text)
    raw = F.params[mem.base.name]
    if mem.offset < 0 or mem.offset + width > len(raw):
        raise MemoryFault(f"ld.param of {width} bytes at offset {mem.offset} past the parameter's "
                          f"{len(raw)} bytes", line=ins.line, instruction=ins.text)
    return np.frombuffer(raw, np.uint8, count=width, offset=mem.offset)


@handler("ld", "ldu")
def _ld(ins, ctx):
    space, vec, t = _parse_access(ins)
    d, mem = ins.operands[:2]
    if len(ins.operands) != 2 or not isinstance(mem, Mem):
        raise unsupported(ins, "extra operands (cache policies) are not implemented")
    dtype = np.dtype(VIEW[t])
    width = dtype.itemsize * vec
    items = d.items if isinstance(d, Vec) else (d,)
    if len(items) != vec:
        raise unsupported(ins, "vector length does not match the destination")

    def run(F, idx):
        if space == "param":
            vals = _param_bytes(F, ins, mem, width).view(dtype)
            for k, item in enumerate(items):
                F.write(item, np.full(F.n if idx is None else len(idx), vals[k]), dtype, idx)
            return
        threads = F.threads(idx)
        raw = load_bytes(F, ins, space, _address(F, mem, idx, space), width, threads)
        vals = np.ascontiguousarray(raw).view(dtype).reshape(len(threads), vec)
        for k, item in enumerate(items):
            F.write(item, vals[:, k], dtype, idx)
    return run


@handler("st")
def _st(ins, ctx):
    space, vec, t = _parse_access(ins)
    if space == "param":
        raise unsupported(ins, "st.param (device-function calls) is not implemented")
    mem, src = ins.operands[:2]
    if len(ins.operands) != 2 or not isinstance(mem, Mem):
        raise unsupported(ins, "extra operands (cache policies) are not implemented")
    dtype = np.dtype(VIEW[t])
    width = dtype.itemsize * vec
    items = src.items if isinstance(src, Vec) else (src,)

    def run(F, idx):
        threads = F.threads(idx)
        n = len(threads)
        vals = np.empty((n, vec), dtype)
        for k, item in enumerate(items):
            vals[:, k] = F.read(item, dtype, idx)
        store_bytes(F, ins, space, _address(F, mem, idx, space), width, threads, vals.view(np.uint8).reshape(n, width))
    return run


@handler("cvta")
def _cvta(ins, ctx):
    to = "to" in ins.mods
    space = next((m for m in ins.mods if m in ("shared", "local", "global")), None)
    t = ins.mods[-1]
    check_mods(ins, {"to", space, t} if space else set())
    if space is None or t not in ("u32", "u64"):
        raise unsupported(ins)
    base = {"shared": GENERIC_SHARED, "local": GENERIC_LOCAL, "global": np.uint64(0)}[space]
    d, a = ins.operands

    def run(F, idx):
        x = np.asarray(F.read(a, VIEW[t], idx)).astype(np.uint64)
        with np.errstate(over="ignore"):
            r = x - base if to else x + base
        F.write(d, r.astype(VIEW[t]), VIEW[t], idx)
    return run
