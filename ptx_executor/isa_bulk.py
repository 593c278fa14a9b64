"""Bulk asynchronous copies (``cp.async.bulk``), their groups, and ``fence.proxy.async``.

Forms (PTX ISA, "Data Movement and Conversion Instructions: cp.async.bulk"): a load
``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size, [mbar]``
(or ``.shared::cta`` destination; a cluster of one CTA, so ``dst`` is the CTA's own shared
memory), a store ``cp.async.bulk.global.shared::cta.bulk_group [dst], [src], size``,
``cp.async.bulk.commit_group`` and ``cp.async.bulk.wait_group{.read} N``. Both addresses must be
16-byte aligned and ``size`` a multiple of 16; the global side must lie inside one tensor
(writable for a store), the shared side inside one allocation: a
:class:`~ptx_executor.errors.MemoryFault` otherwise, before any byte moves. The global side is
logged like an ``ld.global``/``st.global`` of ``size`` bytes.

**A load's data lands at the first wait that observes the mbarrier phase it signals complete.**
Its ``size`` bytes count against the mbarrier's tx-count when it is issued (the copy completes
as early as it may), so the phase can complete then; the bytes are read from global memory and
written to shared memory when a thread's ``mbarrier.try_wait``/``test_wait`` on that mbarrier
succeeds for a later phase (logged as a shared write of the issuing thread under the copy's line).
Until then (:class:`~ptx_executor.errors.BulkCopyError`):

1. a read of a byte it fills (``ld.shared``, a generic load, a bulk store's source):
   :data:`READ_BEFORE_LANDED`;
2. a write to such a byte (``st.shared``, a generic store, another copy's destination):
   :data:`WRITE_WHILE_FILLING`; a global store to its source: :data:`SOURCE_OVERWRITTEN`.

**A store reads its shared source until the wait_group that completes its bulk group.** Its
global bytes are written (and logged) at issue. Groups are per thread, as for ``cp.async``:
``commit_group`` closes the open group, ``wait_group N`` (and ``.read N``) completes all but the
``N`` most recent committed groups. Findings:

3. a write to shared bytes a store still reads: :data:`WRITE_WHILE_READING`;
4. a store of shared bytes some thread last wrote through the generic proxy (``st.shared``, a
   generic store) without executing a ``fence.proxy.async`` (``.shared::cta``, ``.shared::cluster``
   or no space: all cover shared memory; ``.global`` does not) after that write:
   :data:`MISSING_FENCE`;
5. a thread exiting with stores not completed by a wait_group: :data:`EXIT_IN_FLIGHT`.

``async_copies="immediate"`` lands every load at issue and tracks no store, group or fence (no
findings 1-5); the mbarrier phases and the tx-counts are the same. Refused by name: multicast,
shared-to-shared-cluster copies, tensor-map copies (``cp.async.bulk.tensor``), ``.cp_mask``,
``cp.async.bulk.prefetch`` and reductions. The cache-policy operand (``.L2::cache_hint``) is
accepted and ignored (a hint).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import BulkCopyError
from .ir import Imm, Mem, Reg
from .isa import handler, unsupported
from .isa_mbar import mbar_address, mbarriers
from .isa_mem import _address
from .memory import fault

READ_BEFORE_LANDED = "read of shared memory before the bulk copy filling it completed"
WRITE_WHILE_FILLING = "write to shared memory a bulk copy is still filling"
SOURCE_OVERWRITTEN = "write to global memory an in-flight bulk copy reads"
WRITE_WHILE_READING = "write to shared memory a bulk store is still reading (its wait_group.read has not run)"
MISSING_FENCE = "missing fence.proxy.async: a bulk store reads shared memory written through the generic proxy"
EXIT_IN_FLIGHT = "thread exits with bulk stores in flight"


@dataclass
class _Copies:
    """The copies one execution of a bulk instruction issued, one element per issuing thread."""
    ins: object
    serial: int
    epoch: int
    threads: np.ndarray
    cta: np.ndarray
    shared: np.ndarray  # the shared side (int64)
    size: np.ndarray  # bytes (int64)
    live: np.ndarray
    src: np.ndarray = None  # load: global source (uint64)
    region: np.ndarray = None  # load: source tensor region
    mbar: np.ndarray = None  # load: mbarrier address (int64)
    phase: np.ndarray = None  # load: the mbarrier phase it signals
    group: np.ndarray = None  # store: the thread's bulk group


class BulkState:
    """Bulk copies in flight, bulk groups, and generic-proxy writes not yet fenced, for one chunk."""

    def __init__(self, F):
        self.filling = np.zeros(F.shared.shape, np.int32)  # pending loads per byte
        self.reading = np.zeros(F.shared.shape, np.int32)  # pending stores per byte
        self.unfenced = np.zeros(F.shared.shape, np.int64)  # 1 + thread of an unfenced generic write, or 0
        self.loads: list = []
        self.stores: list = []
        self.committed = np.zeros(F.n, np.int64)
        self.in_flight = np.zeros(F.n, np.int64)  # stores per thread

    # ------------------------------------------------------------------ hooks of ordinary accesses
    def shared_access(self, F, ins, addr, width, threads, write: bool) -> None:
        cta = F.cta_local[threads]
        cols = addr.astype(np.int64)[:, None] + np.arange(width)[None, :]
        self._check_marks(F, ins, cta, cols, threads, write)
        if write:
            self.unfenced[cta[:, None], cols] = threads[:, None] + 1

    def _check_marks(self, F, ins, cta, cols, threads, write: bool, what=None) -> None:
        hit = self.filling[cta[:, None], cols] > 0
        if hit.any():
            k = int(np.flatnonzero(hit.any(axis=1))[0])
            byte = int(cols[k][hit[k]][0])
            msg = what or (WRITE_WHILE_FILLING if write else READ_BEFORE_LANDED)
            _finding(F, ins, f"{msg}; {self._owner(F, self.loads, int(cta[k]), byte)}", threads[k:k + 1], byte)
        if write:
            hit = self.reading[cta[:, None], cols] > 0
            if hit.any():
                k = int(np.flatnonzero(hit.any(axis=1))[0])
                byte = int(cols[k][hit[k]][0])
                msg = f"{WRITE_WHILE_READING}; {self._owner(F, self.stores, int(cta[k]), byte)}"
                _finding(F, ins, msg, threads[k:k + 1], byte)

    def global_write(self, F, ins, addr, width, threads) -> None:
        lo, hi = addr, addr + np.uint64(width)
        for c in self.loads:
            for j in np.flatnonzero(c.live).tolist():
                s, e = c.src[j], c.src[j] + np.uint64(c.size[j])
                bad = (lo < e) & (hi > s)
                if bad.any():
                    _, tid = F.who(int(c.threads[j]))
                    k = int(np.flatnonzero(bad)[0])
                    _finding(F, ins, f"{SOURCE_OVERWRITTEN}; the copy: PTX line {c.ins.line} `{c.ins.text}` by thread "
                                     f"{tid}", threads[k:k + 1], int(addr[k]))

    def fence(self, F, threads) -> None:
        rows = np.unique(F.cta_local[threads])
        sub = self.unfenced[rows]
        sub[np.isin(sub, threads + 1)] = 0
        self.unfenced[rows] = sub

    # ------------------------------------------------------------------ loads
    def issue_load(self, F, ins, c: _Copies) -> None:
        for cols, sel in _columns(c.shared, c.size):
            self._check_marks(F, ins, c.cta[sel], cols, c.threads[sel], True)
            np.add.at(self.filling, (c.cta[sel][:, None], cols), 1)
        self.loads.append(c)

    def land(self, F, cta, mbar) -> None:
        """Land the loads whose mbarrier (of ``cta``, at ``mbar``) has completed their phase."""
        keys = np.unique(cta * (1 << 32) + mbar)
        mb = F.mbarriers
        for c in self.loads:
            sel = c.live & np.isin(c.cta * (1 << 32) + c.mbar, keys)
            if sel.any():
                sel &= c.phase < mb.phase_of(c.cta, c.mbar)
            if sel.any():
                _write_load(F, c, sel, self.filling)
        self.loads = [c for c in self.loads if c.live.any()]

    # ------------------------------------------------------------------ stores
    def issue_store(self, F, ins, c: _Copies) -> None:
        for cols, sel in _columns(c.shared, c.size):
            cta, threads = c.cta[sel], c.threads[sel]
            self._check_marks(F, ins, cta, cols, threads, False)
            writer = self.unfenced[cta[:, None], cols]
            if writer.any():
                k = int(np.flatnonzero(writer.any(axis=1))[0])
                byte = int(cols[k][writer[k] > 0][0])
                _, tid = F.who(int(writer[k][writer[k] > 0][0]) - 1)
                _finding(F, ins, f"{MISSING_FENCE} by thread {tid} without a fence.proxy.async after the write",
                         threads[k:k + 1], byte)
            np.add.at(self.reading, (cta[:, None], cols), 1)
        c.group = self.committed[c.threads].copy()
        np.add.at(self.in_flight, c.threads, 1)
        self.stores.append(c)

    def wait_group(self, F, threads, keep: int) -> None:
        limit = np.full(F.n, -1, np.int64)
        limit[threads] = self.committed[threads] - keep
        for c in self.stores:
            sel = c.live & (c.group < limit[c.threads])
            if sel.any():
                for cols, s in _columns(c.shared[sel], c.size[sel]):
                    np.subtract.at(self.reading, (c.cta[sel][s][:, None], cols), 1)
                np.subtract.at(self.in_flight, c.threads[sel], 1)
                c.live[sel] = False
        self.stores = [c for c in self.stores if c.live.any()]

    def exiting(self, F, ins, threads, fell_off: bool = False) -> None:
        bad = self.in_flight[threads] > 0
        if bad.any():
            t = int(threads[np.flatnonzero(bad)[0]])
            oldest = next(c for c in self.stores if (c.live & (c.threads == t)).any())
            how = " (by running past the entry's last instruction)" if fell_off else ""
            msg = (f"{EXIT_IN_FLIGHT}{how}: {int(self.in_flight[t])} not completed by a cp.async.bulk.wait_group, "
                   f"the oldest issued at PTX line {oldest.ins.line} `{oldest.ins.text}`")
            _finding(F, ins, msg, np.array([t]), None)

    @staticmethod
    def _owner(F, copies, cta: int, byte: int) -> str:
        for c in copies:
            hit = c.live & (c.cta == cta) & (c.shared <= byte) & (byte < c.shared + c.size)
            if hit.any():
                _, tid = F.who(int(c.threads[np.flatnonzero(hit)[0]]))
                return f"the copy: PTX line {c.ins.line} `{c.ins.text}` by thread {tid}"
        return "the copy is unknown"


def _finding(F, ins, message, threads, address):
    cta, tid = F.who(int(threads[0]))
    raise BulkCopyError(message, line=ins.line, instruction=ins.text, cta=cta, thread=tid, address=address)


def _columns(start, size):
    """``(byte columns, selection)`` per distinct size."""
    for w in np.unique(size).tolist():
        sel = size == w
        yield start[sel][:, None] + np.arange(w)[None, :], sel


def _write_load(F, c: _Copies, sel, filling) -> None:
    for cols, s in _columns(c.shared[sel], c.size[sel]):
        idx = np.flatnonzero(sel)[s]
        data = np.empty(cols.shape, np.uint8)
        for k in np.unique(c.region[idx]).tolist():
            part = c.region[idx] == k
            r = F.memory.regions[k]
            data[part] = r.buf[F.memory.byte_index(r, c.src[idx][part], cols.shape[1])]
        F.shared[c.cta[idx][:, None], cols] = data
        if filling is not None:
            np.subtract.at(filling, (c.cta[idx][:, None], cols), 1)
        if F.log_shared is not None:
            # in the issue's epoch: the bytes land before the phase they signal completes, and every thread that
            # observes that completion is in a later epoch (Mbarriers._complete); an access in the issue's epoch
            # by another thread is a race, one between the issue and the landing a finding of this model
            F.log_shared.append(c.ins.line, c.serial, F.first_thread + c.threads[idx], c.shared[idx].astype(
                np.uint64), cols.shape[1], True, c.epoch)
    c.live[sel] = False


def bulk_state(F) -> BulkState:
    if F.bulk_state is None:
        F.bulk_state = BulkState(F)
        F.bulk_hooks = F.async_copies != "immediate"
    return F.bulk_state


# ------------------------------------------------------------------ checks shared by loads and stores

def _sizes(F, ins, op, idx, threads) -> np.ndarray:
    size = np.broadcast_to(np.asarray(F.read(op, np.uint32, idx)).astype(np.int64), threads.shape).copy()
    bad = (size % 16 != 0) | (size <= 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        cta, tid = F.who(int(threads[k]))
        raise BulkCopyError(f"bulk copy size {int(size[k])} is not a positive multiple of 16", line=ins.line,
                            instruction=ins.text, cta=cta, thread=tid)
    return size


def _global_side(F, ins, addr, size, threads, write: bool) -> np.ndarray:
    region = np.full(len(addr), -1, np.int64)
    for w in np.unique(size).tolist():
        sel = size == w
        bad = addr[sel] % np.uint64(16) != 0
        if bad.any():
            fault("misaligned access", "a bulk copy's global address needs 16-byte alignment", ins, threads[sel],
                  addr[sel], bad, F.who)
        where = F.memory.locate(addr[sel], w)
        bad = where < 0
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            fault("global access outside every tensor", F.memory.describe(int(addr[sel][k])), ins, threads[sel],
                  addr[sel], bad, F.who)
        if write:
            ro = np.array([not r.writable for r in F.memory.regions])[where]
            if ro.any():
                k = int(np.flatnonzero(ro)[0])
                fault("write to a read-only tensor", f"{F.memory.regions[where[k]].name} is an input of this launch",
                      ins, threads[sel], addr[sel], ro, F.who)
        region[sel] = where
        if F.log is not None:
            F.log.append(ins.line, F.serial, F.first_thread + threads[sel], addr[sel], w, write, F.epoch)
    return region


def _shared_side(F, ins, addr, size, threads) -> np.ndarray:
    for w in np.unique(size).tolist():
        sel = size == w
        bad = (F.layout.locate("shared", addr[sel], w) < 0) | (addr[sel] % np.uint64(16) != 0)
        if bad.any():
            fault(f"shared access of {w} bytes outside every shared allocation or not 16-byte aligned",
                  f"allocations {F.layout.shared}", ins, threads[sel], addr[sel], bad, F.who)
    return addr.astype(np.int64)


# ------------------------------------------------------------------ the instructions

def compile_bulk(ins, ctx):
    """``cp.async.bulk.*`` (called by the ``cp`` handler of :mod:`.isa_async`)."""
    rest = ins.mods[2:]
    if "tensor" in rest or "prefetch" in rest:
        raise unsupported(ins, "bulk tensor-map (TMA) copies and bulk prefetches are not implemented")
    if any(m.startswith("multicast") for m in rest) or "cp_mask" in rest:
        raise unsupported(ins, "multicast bulk copies and .cp_mask are not implemented (a cluster of one CTA)")
    if rest == ("commit_group",):
        return _commit(ins)
    if rest[:1] == ("wait_group",):
        return _wait(ins)
    dst = rest[0] if rest else ""
    src = rest[1] if len(rest) > 1 else ""
    tail = set(rest[2:]) - {"L2::cache_hint"}
    if dst in ("shared::cluster", "shared::cta") and src == "global" and tail == {"mbarrier::complete_tx::bytes"}:
        return _load(ins)
    if dst == "global" and src in ("shared::cta", "shared") and tail == {"bulk_group"}:
        return _store(ins)
    raise unsupported(ins, "of the bulk copies only global -> shared with an mbarrier and shared::cta -> global "
                           "with a bulk group are implemented (no copies between CTAs of a cluster)")


def _operands(ins, n: int):
    ops = ins.operands
    hint = "L2::cache_hint" in ins.mods
    if len(ops) != n + hint or not all(isinstance(o, Mem) for o in ops[:2]) or not isinstance(ops[2], (Reg, Imm)):
        raise unsupported(ins, "expected [dst], [src], size" + (", [mbar]" if n == 4 else "")
                          + (", cache-policy" if hint else ""))
    if n == 4 and not isinstance(ops[3], Mem):
        raise unsupported(ins, "the mbarrier operand must be a memory operand")
    return ops


def _load(ins):
    dst_op, src_op, size_op, mbar_op = _operands(ins, 4)[:4]

    def run(F, idx):
        threads = F.threads(idx)
        size = _sizes(F, ins, size_op, idx, threads)
        src = _address(F, src_op, idx, "global")
        dst = _shared_side(F, ins, _address(F, dst_op, idx, "shared"), size, threads)
        mbar = mbar_address(F, ins, mbar_op, idx, "shared")
        region = _global_side(F, ins, src, size, threads, write=False)
        state, mb = bulk_state(F), mbarriers(F)
        cta = F.cta_local[threads]
        phase = mb.phase_of(cta, mbar.astype(np.int64)) if mb.bars else np.zeros(len(threads), np.int64)
        c = _Copies(ins, F.serial, F.epoch, threads, cta, dst, size, np.ones(len(threads), bool), src=src,
                    region=region, mbar=mbar.astype(np.int64), phase=phase)
        if F.bulk_hooks:
            state.issue_load(F, ins, c)
        else:
            _write_load(F, c, c.live.copy(), None)
        mb.add_tx(F, ins, threads, mbar, size, -1)
    return run


def _store(ins):
    dst_op, src_op, size_op = _operands(ins, 3)[:3]

    def run(F, idx):
        threads = F.threads(idx)
        size = _sizes(F, ins, size_op, idx, threads)
        dst = _address(F, dst_op, idx, "global")
        src = _shared_side(F, ins, _address(F, src_op, idx, "shared"), size, threads)
        state = bulk_state(F)
        c = _Copies(ins, F.serial, F.epoch, threads, F.cta_local[threads], src, size, np.ones(len(threads), bool))
        if F.bulk_hooks:
            state.issue_store(F, ins, c)
        region = _global_side(F, ins, dst, size, threads, write=True)
        for cols, sel in _columns(src, size):
            if F.async_pending:
                F.async_state.global_write(F, ins, dst[sel], cols.shape[1], threads[sel])
            if F.bulk_hooks:
                state.global_write(F, ins, dst[sel], cols.shape[1], threads[sel])
            data = F.shared[c.cta[sel][:, None], cols]
            for k in np.unique(region[sel]).tolist():
                part = region[sel] == k
                r = F.memory.regions[k]
                r.buf[F.memory.byte_index(r, dst[sel][part], cols.shape[1])] = data[part]
            if F.log_shared is not None:
                F.log_shared.append(ins.line, F.serial, F.first_thread + threads[sel], src[sel].astype(np.uint64),
                                    cols.shape[1], False, F.epoch)
    return run


def _commit(ins):
    if ins.operands:
        raise unsupported(ins, "cp.async.bulk.commit_group takes no operands")

    def run(F, idx):
        bulk_state(F).committed[F.threads(idx)] += 1
    return run


def _wait(ins):
    if set(ins.mods[3:]) - {"read"}:
        raise unsupported(ins, "only cp.async.bulk.wait_group{.read} N")
    n = ins.operands[0] if len(ins.operands) == 1 else None
    if not isinstance(n, Imm) or not isinstance(n.value, int) or n.value < 0:
        raise unsupported(ins, "cp.async.bulk.wait_group takes one non-negative integer constant")

    def run(F, idx):
        if F.bulk_state is not None:
            F.bulk_state.wait_group(F, F.threads(idx), n.value)
    return run


@handler("fence")
def _fence(ins, ctx):
    """``fence.proxy.async{.space}`` ends the generic-proxy writes' need for a fence (for the bulk
    store check); every other fence (``fence.mbarrier_init``, ``fence.acq_rel``, ``fence.sc``,
    ``fence.proxy.alias``/``tensormap``) only orders and has no effect on a sequential executor."""
    mods = ins.mods
    if mods[:2] != ("proxy", "async"):
        return lambda F, idx: None
    if set(mods[2:]) - {"shared::cta", "shared::cluster", "global"} or len(mods) > 3:
        raise unsupported(ins, "only fence.proxy.async{.shared::cta,.shared::cluster,.global}")
    covers_shared = "global" not in mods

    def run(F, idx):
        if covers_shared and F.bulk_hooks:
            F.bulk_state.fence(F, F.threads(idx))
    return run
