"""Asynchronous global-to-shared copies: ``cp.async``, ``cp.async.commit_group``,
``cp.async.wait_group N``, ``cp.async.wait_all``.

The model follows the PTX ISA's per-thread rules. A thread's ``cp.async`` joins the thread's
open *group*; ``commit_group`` closes it (an empty group when the thread issued nothing);
``wait_group N`` completes every committed group of the thread except its ``N`` most recent
ones; ``wait_all`` is ``commit_group`` then ``wait_group 0``. Copies not yet committed are not
completed by ``wait_group``.

**A copy's data lands in shared memory at the wait that completes its group, not before.**
At issue the global source is checked like an ``ld.global`` of the copy's width (bounds
against the tensors, alignment to cp-size, the same :class:`~ptx_executor.errors.MemoryFault`)
and logged as a global read, the shared destination is checked like an ``ld.shared`` (inside
a shared allocation, aligned to cp-size), and the copy is recorded as pending. At the
completing wait the source's first src-size bytes are read (the rest of the cp-size bytes
are zeros), written to shared memory and logged as a shared write of the issuing thread in
the current barrier epoch, so :func:`ptx_executor.analysis.intra_cta_races` sees it; when a
barrier was passed between the issue and the wait it is logged in the issue's epoch too (the
write may happen any time in between: an access by another thread before the issue in that
epoch is a race, one after the issue a finding below).

While a copy is pending, :class:`~ptx_executor.errors.AsyncCopyError` is raised by

1. a read of a shared byte it fills (``ld.shared``, or a generic load into the shared window);
2. a write to such a byte (``st.shared``, a generic store, another ``cp.async``'s destination);
3. a global store to a byte it reads (its source's first src-size bytes);
4. its thread exiting (``ret``/``exit``, or running past the last instruction) with copies
   in flight, committed or not.

With ``async_copies="immediate"`` (:func:`ptx_executor.run`) every copy lands when it is
issued: no pending state, no findings. Its checks and logs are otherwise the same.

Not modelled: timing, caches (``.ca``/``.cg`` and the ``.L2::64B``/``128B``/``256B`` prefetch
sizes are accepted and have no effect). Refused with
:class:`~ptx_executor.errors.UnsupportedInstruction`: the ``ignore-src`` predicate operand,
the cache-policy operand (``.L2::cache_hint``), ``.shared::cluster`` destinations, mbarrier
completion (``cp.async.mbarrier.arrive``) and every other ``cp`` form. Bulk copies
(``cp.async.bulk*``) are :mod:`.isa_bulk`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import AsyncCopyError
from .ir import Imm, Mem, Reg
from .isa import handler, unsupported
from .isa_bulk import compile_bulk
from .isa_mem import _address, _check_window, store_bytes
from .memory import fault

_PREFETCH = frozenset({"L2::64B", "L2::128B", "L2::256B"})
_SHARED = frozenset({"shared", "shared::cta"})

READ_BEFORE_LANDED = "read of shared memory before the cp.async filling it completed (its wait_group has not run)"
WRITE_WHILE_FILLING = "write to shared memory a cp.async is still filling"
SOURCE_OVERWRITTEN = "write to global memory an in-flight cp.async reads"
EXIT_IN_FLIGHT = "thread exits with cp.async copies in flight"


@dataclass
class _Batch:
    """The copies one execution of a ``cp.async`` issued, one element per issuing thread."""
    ins: object
    serial: int  # execution serial of the issue
    epoch: int  # barrier epoch of the issue
    cp: int  # cp-size in bytes
    threads: np.ndarray  # chunk thread indices (int64)
    dst: np.ndarray  # shared-window addresses (uint64)
    src: np.ndarray  # global addresses (uint64)
    region: np.ndarray  # global region of the source, -1 where src-size is 0 (int64)
    src_size: np.ndarray  # bytes read from the source (int64)
    group: np.ndarray  # the thread's group number the copy belongs to (int64)
    live: np.ndarray  # not yet landed (bool)


def _finding(F, ins, message, threads, addrs, bad):
    k = int(np.flatnonzero(bad)[0])
    cta, tid = F.who(int(threads[k]))
    raise AsyncCopyError(message, line=ins.line, instruction=ins.text, cta=cta, thread=tid,
                         address=None if addrs is None else int(addrs[k]))


class InFlight:
    """The pending copies of one chunk of CTAs (``F.async_state``)."""

    def __init__(self, F):
        self.marks = np.zeros(F.shared.shape, np.int16)  # pending copies filling each shared byte
        self.committed = np.zeros(F.n, np.int64)  # groups each thread has committed
        self.count = np.zeros(F.n, np.int64)  # copies each thread has in flight
        self.batches: list[_Batch] = []
        self._sources = None  # (sorted source starts, running max of their ends), built on demand

    # ------------------------------------------------------------------ issue, commit, wait
    def issue(self, F, ins, cp, threads, dst, src, region, src_size) -> None:
        """Record the copies of one execution of ``ins`` as pending, in each thread's open group."""
        b = _Batch(ins, F.serial, F.epoch, cp, threads.copy(), dst, src, region, src_size, self.committed[threads].copy(),
                   np.ones(len(threads), bool))
        cta = F.cta_local[b.threads]
        cols = b.dst.astype(np.int64)[:, None] + np.arange(cp)[None, :]
        np.add.at(self.marks, (cta[:, None], cols), 1)
        np.add.at(self.count, b.threads, 1)
        self.batches.append(b)
        F.async_pending += len(b.threads)
        self._sources = None

    def commit(self, threads) -> None:
        self.committed[threads] += 1

    def wait(self, F, threads, keep: int) -> None:
        """Complete the copies of ``threads``' committed groups but the ``keep`` most recent."""
        limit = np.full(F.n, -1, np.int64)
        limit[threads] = self.committed[threads] - keep
        for b in self.batches:
            sel = b.live & (b.group < limit[b.threads])
            if sel.any():
                self._land(F, b, sel)
        self.batches = [b for b in self.batches if b.live.any()]

    def _land(self, F, b: _Batch, sel) -> None:
        threads, dst = b.threads[sel], b.dst[sel]
        data = _read_sources(F, b.region[sel], b.src[sel], b.src_size[sel], b.cp)
        cta = F.cta_local[threads]
        cols = dst.astype(np.int64)[:, None] + np.arange(b.cp)[None, :]
        F.shared[cta[:, None], cols] = data
        np.subtract.at(self.marks, (cta[:, None], cols), 1)
        np.subtract.at(self.count, threads, 1)
        b.live[sel] = False
        F.async_pending -= len(threads)
        self._sources = None
        if F.log_shared is not None:  # the write may happen in any epoch from the issue to the wait
            for epoch in sorted({b.epoch, F.epoch}):
                F.log_shared.append(b.ins.line, b.serial, F.first_thread + threads, dst, b.cp, True, epoch)

    # ------------------------------------------------------------------ the findings
    def shared_access(self, F, ins, addr, width, threads, write: bool) -> None:
        """Findings 1 and 2: a shared access touching bytes a pending copy fills."""
        cta = F.cta_local[threads]
        cols = addr.astype(np.int64)[:, None] + np.arange(width)[None, :]
        hit = self.marks[cta[:, None], cols] > 0
        bad = hit.any(axis=1)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            byte = int(cols[k][hit[k]][0])
            what = WRITE_WHILE_FILLING if write else READ_BEFORE_LANDED
            msg = f"{what}; {self._owner(F, int(cta[k]), byte)}"
            _finding(F, ins, msg, threads[k:k + 1], np.array([byte], np.uint64), np.array([True]))

    def distinct(self, F, ins, dst, threads) -> None:
        """Finding 2 within one issue: two threads' copies fill the same shared bytes (the copies
        of one instruction have one size and are aligned to it, so they coincide or are disjoint)."""
        key = F.cta_local[threads] * F.shared.shape[1] + dst.astype(np.int64)
        order = np.argsort(key, kind="stable")
        same = np.flatnonzero(key[order][1:] == key[order][:-1])
        if len(same):
            first, second = int(order[same[0]]), int(order[same[0] + 1])
            _, tid = F.who(int(threads[first]))
            msg = f"{WRITE_WHILE_FILLING}; the copy of thread {tid} by the same instruction fills it too"
            _finding(F, ins, msg, threads[second:second + 1], dst[second:second + 1], np.array([True]))

    def global_write(self, F, ins, addr, width, threads) -> None:
        """Finding 3: a global store to bytes a pending copy reads."""
        if self._sources is None:
            starts, ends = [], []
            for b in self.batches:
                sel = b.live & (b.src_size > 0)
                starts.append(b.src[sel])
                ends.append(b.src[sel] + b.src_size[sel].astype(np.uint64))
            s = np.concatenate(starts) if starts else np.zeros(0, np.uint64)
            e = np.concatenate(ends) if ends else np.zeros(0, np.uint64)
            order = np.argsort(s, kind="stable")
            self._sources = (s[order], np.maximum.accumulate(e[order]) if len(e) else e)
        starts, reach = self._sources
        if not len(starts):
            return
        j = np.searchsorted(starts, addr + np.uint64(width), side="left")  # sources starting before the store ends
        bad = (j > 0) & (reach[np.maximum(j - 1, 0)] > addr)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            lo, hi = int(addr[k]), int(addr[k]) + width
            who = ""
            for b in self.batches:
                over = b.live & (b.src < np.uint64(hi)) & (b.src + b.src_size.astype(np.uint64) > np.uint64(lo))
                if over.any():
                    i = int(np.flatnonzero(over)[0])
                    _, tid = F.who(int(b.threads[i]))
                    who = f"; the copy: PTX line {b.ins.line} `{b.ins.text}` by thread {tid}"
                    break
            _finding(F, ins, SOURCE_OVERWRITTEN + who, threads, addr, bad)

    def exiting(self, F, ins, threads, fell_off: bool = False) -> None:
        """Finding 4: exiting threads with copies in flight."""
        bad = self.count[threads] > 0
        if bad.any():
            t = int(threads[np.flatnonzero(bad)[0]])
            oldest = next(b for b in self.batches if (b.live & (b.threads == t)).any())
            how = " (by running past the entry's last instruction)" if fell_off else ""
            msg = (f"{EXIT_IN_FLIGHT}{how}: {int(self.count[t])} of its copies not completed by a wait, the "
                   f"oldest issued at PTX line {oldest.ins.line} `{oldest.ins.text}`")
            _finding(F, ins, msg, threads, None, bad)

    def _owner(self, F, cta: int, byte: int) -> str:
        for b in self.batches:
            d = b.dst.astype(np.int64)
            hit = b.live & (F.cta_local[b.threads] == cta) & (d <= byte) & (byte < d + b.cp)
            if hit.any():
                _, tid = F.who(int(b.threads[np.flatnonzero(hit)[0]]))
                return f"the copy: PTX line {b.ins.line} `{b.ins.text}` by thread {tid}"
        return "the copy is unknown"  # not reached: every marked byte has a live copy


# ------------------------------------------------------------------ global sources

def _check_sources(F, ins, src, src_size, cp, threads) -> np.ndarray:
    """Region of every copy's source bytes (-1 where src-size is 0: nothing is read); faults
    like an ``ld.global`` of cp-size bytes where the bytes read leave every tensor or the
    source is not aligned to cp-size."""
    reading = src_size > 0
    where = np.full(len(src), -1, np.int64)
    for w in np.unique(src_size[reading]).tolist():
        sel = reading & (src_size == w)
        where[sel] = F.memory.locate(src[sel], w)
    bad = reading & (where < 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        fault("global access outside every tensor", F.memory.describe(int(src[k])), ins, threads, src, bad, F.who)
    bad = reading & (src % np.uint64(cp) != 0)
    if bad.any():
        fault("misaligned access", f"a {cp}-byte global access needs {cp}-byte alignment",
              ins, threads, src, bad, F.who)
    return where


def _log_reads(F, ins, src, src_size, threads) -> None:
    if F.log is None:
        return
    for w in np.unique(src_size[src_size > 0]).tolist():
        sel = src_size == w
        F.log.append(ins.line, F.serial, F.first_thread + threads[sel], src[sel], w, False, F.epoch)


def _read_sources(F, region, src, src_size, cp) -> np.ndarray:
    """``(n, cp)`` uint8: each copy's first src-size source bytes, then zeros."""
    out = np.zeros((len(src), cp), np.uint8)
    for w in np.unique(src_size[src_size > 0]).tolist():
        for k in np.unique(region[src_size == w]).tolist():
            sel = (src_size == w) & (region == k)
            r = F.memory.regions[k]
            out[sel, :w] = r.buf[F.memory.byte_index(r, src[sel], w)]
    return out


# ------------------------------------------------------------------ the instructions

@handler("cp")
def _cp(ins, ctx):
    mods = ins.mods
    if not mods or mods[0] != "async":
        raise unsupported(ins, "of the cp family only cp.async is implemented")
    rest = mods[1:]
    if rest == ("commit_group",):
        return _commit(ins)
    if rest in (("wait_group",), ("wait_all",)):
        return _wait(ins)
    if rest[:1] == ("bulk",):
        return compile_bulk(ins, ctx)
    if {"bulk", "mbarrier"} & set(rest) or any(m.startswith("mbarrier") for m in rest):
        raise unsupported(ins, "mbarrier completion of cp.async (cp.async.mbarrier.arrive) and other bulk forms "
                               "are not implemented")
    return _copy(ins, ctx)


def _copy(ins, ctx):
    rest = ins.mods[1:]
    if "L2::cache_hint" in rest:
        raise unsupported(ins, "the cache-policy operand (.L2::cache_hint) is not implemented")
    if "shared::cluster" in rest:
        raise unsupported(ins, "a .shared::cluster destination is not implemented")
    bad = [m for m in rest if m not in _SHARED | _PREFETCH | {"ca", "cg", "global"}]
    if bad:
        raise unsupported(ins, f"modifier(s) {['.' + m for m in bad]} not implemented")
    cache = [m for m in rest if m in ("ca", "cg")]
    if len(cache) != 1 or not _SHARED & set(rest) or "global" not in rest:
        raise unsupported(ins, "only cp.async.{ca,cg}.shared.global is implemented")
    ops = ins.operands
    if len(ops) < 3 or not isinstance(ops[0], Mem) or not isinstance(ops[1], Mem) or not isinstance(ops[2], Imm):
        raise unsupported(ins, "expected [shared dst], [global src], cp-size")
    cp = ops[2].value
    if cp not in ((16,) if cache == ["cg"] else (4, 8, 16)):
        raise unsupported(ins, f"cp-size {cp}: .ca takes 4, 8 or 16, .cg only 16")
    size_op = None
    if len(ops) >= 4:
        size_op = ops[3]
        if isinstance(size_op, Reg) and ctx.entry.reg_types.get(size_op.name, "").lstrip(".") == "pred":
            raise unsupported(ins, "the ignore-src predicate operand is not implemented")
        if not isinstance(size_op, (Reg, Imm)) or (isinstance(size_op, Imm) and not isinstance(size_op.value, int)):
            raise unsupported(ins, "src-size must be an integer immediate or register")
    if len(ops) > 4:
        raise unsupported(ins, "a cache-policy operand is not implemented")
    dst_mem, src_mem = ops[0], ops[1]

    def run(F, idx):
        threads = F.threads(idx)
        n = len(threads)
        if size_op is None:
            src_size = np.full(n, cp, np.int64)
        else:
            src_size = np.broadcast_to(np.asarray(F.read(size_op, np.uint32, idx)).astype(np.int64), (n,)).copy()
            bad = src_size > cp
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                _finding(F, ins, f"src-size {int(src_size[k])} is larger than the cp-size {cp}", threads, None, bad)
        src = _address(F, src_mem, idx, "global")
        dst = _address(F, dst_mem, idx, "shared")
        region = _check_sources(F, ins, src, src_size, cp, threads)
        _check_window(F, ins, "shared", dst, cp, threads)
        if F.async_copies == "immediate":
            _log_reads(F, ins, src, src_size, threads)
            store_bytes(F, ins, "shared", dst, cp, threads, _read_sources(F, region, src, src_size, cp))
            return
        if F.async_state is None:
            F.async_state = InFlight(F)
        state = F.async_state
        if F.async_pending:
            state.shared_access(F, ins, dst, cp, threads, write=True)
        if F.bulk_hooks:
            F.bulk_state.shared_access(F, ins, dst, cp, threads, write=True)
        state.distinct(F, ins, dst, threads)
        _log_reads(F, ins, src, src_size, threads)
        state.issue(F, ins, cp, threads, dst, src, region, src_size)
    return run


def _commit(ins):
    if ins.operands:
        raise unsupported(ins, "cp.async.commit_group takes no operands")

    def run(F, idx):
        if F.async_state is not None:  # before the first copy, groups are empty and need no count
            F.async_state.commit(F.threads(idx))
    return run


def _wait(ins):
    wait_all = ins.mods[-1] == "wait_all"
    if wait_all:
        if ins.operands:
            raise unsupported(ins, "cp.async.wait_all takes no operands")
        keep = 0
    else:
        n = ins.operands[0] if len(ins.operands) == 1 else None
        if not isinstance(n, Imm) or not isinstance(n.value, int) or n.value < 0:
            raise unsupported(ins, "cp.async.wait_group takes one non-negative integer constant")
        keep = n.value

    def run(F, idx):
        state = F.async_state
        if state is None:
            return
        threads = F.threads(idx)
        if wait_all:
            state.commit(threads)
        if F.async_pending:
            state.wait(F, threads, keep)
    return run
