"""mbarriers and the helpers pipelines use with them: ``mbarrier.*``, ``elect.sync``, ``mapa``.

An mbarrier is a 64-bit object in shared memory (PTX ISA, "Parallel Synchronization and
Communication Instructions: mbarrier"). Its state is a *phase*, a *pending arrival count* and a
*transaction count* (tx-count). ``mbarrier.init`` sets the expected arrival count, the pending
count to it, the phase to 0 and the tx-count to 0. An arrive-on operation decrements the pending
count (by ``count``, default 1); an expect-tx operation adds bytes to the tx-count and a
complete-tx operation (``mbarrier.complete_tx``, or a bulk copy completing) subtracts them
(``arrive.expect_tx`` is the expect-tx, then the arrive-on). The current phase completes when the
pending count is 0 and the tx-count is 0; the next phase then starts with the pending count reset
to the expected count. ``mbarrier.test_wait``/``try_wait`` return whether a phase completed:
``.parity p`` the phase of parity ``p`` (true iff the current phase's parity differs from ``p``),
with a state operand the phase that was current when ``mbarrier.arrive`` returned the state.

The executor keeps the objects beside shared memory (:class:`Mbarriers`, per CTA and address);
a returned state is the number of the phase current at the arrive. The phase numbers also drive
the scheduler (:mod:`.machine`): a thread whose wait fails twice in a row at the same instruction
on the same phase (a spin loop) is parked there until that mbarrier completes a phase, then
re-executes the wait; a CTA whose live threads are all parked with no phase able to complete is a
deadlock, reported with the mbarrier, its phase and counts, and the waiting threads.

Findings (:class:`~ptx_executor.errors.BulkCopyError`): an arrive, expect-tx, complete-tx or wait
on an mbarrier never initialised (or invalidated); an ``mbarrier.init`` of one whose current
phase has arrivals or transactions pending; more arrivals, or more completed transaction bytes,
than the current phase expects. Misaligned or out-of-allocation mbarrier addresses are a
:class:`~ptx_executor.errors.MemoryFault`.

Every launch is a cluster of one CTA: ``mapa`` maps an address to CTA rank 0 only (itself),
``.shared::cluster`` mbarrier operands name the CTA's own objects. Refused by name:
``mbarrier.pending_count``, ``.noComplete`` arrives and every other form.
"""

from __future__ import annotations

import numpy as np

from .errors import BulkCopyError, MemoryFault
from .ir import Mem, Pair, Reg, Sym
from .isa import handler, unsupported
from .isa_mem import GENERIC_SHARED, _address
from .isa_warp import _mask_operand
from .memory import fault

UNINITIALISED = "mbarrier used before its mbarrier.init (or after mbarrier.inval)"
REINIT_PENDING = "mbarrier.init of an mbarrier whose current phase has arrivals or transactions pending"
OVER_ARRIVAL = "more arrivals on an mbarrier than its current phase expects"
OVER_COMPLETE = "more transaction bytes completed on an mbarrier than its current phase expects"

_SPACES = frozenset({"shared", "shared::cta", "shared::cluster"})
_ORDER = frozenset({"release", "acquire", "relaxed", "cta", "cluster"})


class _Bar:
    """One mbarrier address, its state in every CTA of the chunk."""

    def __init__(self, n_cta: int):
        self.init = np.zeros(n_cta, bool)
        self.expected = np.zeros(n_cta, np.int64)
        self.pending = np.zeros(n_cta, np.int64)
        self.tx = np.zeros(n_cta, np.int64)
        self.phase = np.zeros(n_cta, np.int64)  # number of the current phase (its parity is phase & 1)


class Mbarriers:
    """The chunk's mbarriers, and each thread's last failed wait (what parks spin loops)."""

    def __init__(self, F):
        self.n_cta = F.n_cta
        self.bars: dict = {}
        self.fail_pc = np.full(F.n, -1, np.int64)  # instruction of the thread's last failed wait
        self.fail_addr = np.zeros(F.n, np.int64)
        self.fail_phase = np.zeros(F.n, np.int64)  # the mbarrier's phase at that failure
        self.fail_want = np.zeros(F.n, np.int64)  # parity (or state) the wait asked for
        self.completions = 0  # phases completed so far in the chunk

    def bar(self, addr: int) -> _Bar:
        b = self.bars.get(addr)
        if b is None:
            b = self.bars[addr] = _Bar(self.n_cta)
        return b

    def phase_of(self, cta: np.ndarray, addr: np.ndarray) -> np.ndarray:
        out = np.zeros(len(cta), np.int64)
        for a in np.unique(addr).tolist():
            sel = addr == a
            out[sel] = self.bar(int(a)).phase[cta[sel]]
        return out

    # ------------------------------------------------------------------ operations
    def init(self, F, ins, threads, addr, count) -> None:
        for a, sel in _by_address(addr):
            b, cta = self.bar(a), F.cta_local[threads[sel]]
            busy = b.init[cta] & ((b.pending[cta] != b.expected[cta]) | (b.tx[cta] != 0))
            if busy.any():
                _finding(F, ins, REINIT_PENDING + self._state(a, int(cta[np.flatnonzero(busy)[0]])),
                         threads[sel], addr[sel], busy)
            c = count[sel]
            b.init[cta], b.expected[cta], b.pending[cta], b.tx[cta] = True, c, c, 0
            b.phase[cta] = 0

    def inval(self, F, ins, threads, addr) -> None:
        for a, sel in _by_address(addr):
            self._checked(F, ins, a, threads[sel], addr[sel])
            self.bar(a).init[F.cta_local[threads[sel]]] = False

    def arrive(self, F, ins, threads, addr, count, tx, drop: bool = False) -> np.ndarray:
        """Expect-tx of ``tx`` bytes, then arrive-on with ``count``, per thread; the states returned."""
        state = np.zeros(len(threads), np.uint64)
        for a, sel in _by_address(addr):
            b, cta = self._checked(F, ins, a, threads[sel], addr[sel])
            state[sel] = b.phase[cta].astype(np.uint64)
            np.add.at(b.tx, cta, tx[sel])
            if drop:  # arrive_drop: the later phases expect fewer arrivals
                np.subtract.at(b.expected, cta, count[sel])
            ctas, inv = np.unique(cta, return_inverse=True)
            rem = np.bincount(inv, weights=count[sel]).astype(np.int64)
            first = threads[sel][np.unique(inv, return_index=True)[1]]
            self._arrivals(F, ins, a, b, ctas, rem, first)
        return state

    def _arrivals(self, F, ins, a, b, ctas, rem, first) -> None:
        while len(ctas):
            take = np.minimum(rem, b.pending[ctas])
            b.pending[ctas] -= take
            rem = rem - take
            done = (b.pending[ctas] == 0) & (b.tx[ctas] == 0)
            over = (rem > 0) & ~done
            if over.any():
                _finding(F, ins, OVER_ARRIVAL + self._state(a, int(ctas[np.flatnonzero(over)[0]])), first,
                         np.full(len(first), a, np.uint64), over)
            self._complete(F, b, ctas[done])
            keep = rem > 0
            ctas, rem, first = ctas[keep], rem[keep], first[keep]

    def add_tx(self, F, ins, threads, addr, nbytes, sign: int) -> None:
        """Expect-tx (``sign`` +1) or complete-tx (-1) of ``nbytes`` per thread."""
        for a, sel in _by_address(addr):
            b, cta = self._checked(F, ins, a, threads[sel], addr[sel])
            np.add.at(b.tx, cta, sign * nbytes[sel])
            ctas = np.unique(cta)
            bad = (b.pending[ctas] == 0) & (b.tx[ctas] < 0)
            if bad.any():
                k = int(np.flatnonzero(bad)[0])
                t = threads[sel][np.flatnonzero(cta == ctas[k])[:1]]
                _finding(F, ins, OVER_COMPLETE + self._state(a, int(ctas[k])), t, np.array([a], np.uint64),
                         np.array([True]))
            self._complete(F, b, ctas[(b.pending[ctas] == 0) & (b.tx[ctas] == 0)])

    def _complete(self, F, b: _Bar, ctas) -> None:
        if not len(ctas):
            return
        b.phase[ctas] += 1
        b.pending[ctas] = b.expected[ctas]
        b.tx[ctas] = 0
        self.completions += 1
        F.epoch += 1  # threads that observe the completion are ordered after what preceded it

    def wait(self, F, ins, pc: int, threads, addr, want, parity: bool):
        """``(done, park)`` per thread: whether the phase completed, and whether the thread spins
        (failed here before on the same phase) and parks instead of executing the wait."""
        done = np.zeros(len(threads), bool)
        now = np.zeros(len(threads), np.int64)
        for a, sel in _by_address(addr):
            b, cta = self._checked(F, ins, a, threads[sel], addr[sel])
            now[sel] = b.phase[cta]
        done = ((now & 1) != want) if parity else (now > want)
        if done.any() and F.bulk_state is not None:
            F.bulk_state.land(F, F.cta_local[threads[done]], addr[done].astype(np.int64))
        failed = ~done
        again = failed & (self.fail_pc[threads] == pc) & (self.fail_addr[threads] == addr.astype(np.int64)) \
            & (self.fail_phase[threads] == now)
        first = failed & ~again
        t = threads[first]
        self.fail_pc[t], self.fail_addr[t], self.fail_phase[t], self.fail_want[t] = pc, addr[first], now[first], \
            np.broadcast_to(want, done.shape)[first]
        self.fail_pc[threads[done]] = -1
        return done, again

    def ready(self, F, threads) -> np.ndarray:
        """Which parked threads' mbarriers completed a phase since they parked."""
        now = self.phase_of(F.cta_local[threads], self.fail_addr[threads])
        return now != self.fail_phase[threads]

    # ------------------------------------------------------------------ helpers
    def _checked(self, F, ins, a: int, threads, addr):
        b, cta = self.bar(a), F.cta_local[threads]
        bad = ~b.init[cta]
        if bad.any():
            _finding(F, ins, UNINITIALISED, threads, addr, bad)
        return b, cta

    def _state(self, a: int, cta: int) -> str:
        b = self.bar(a)
        return (f" (phase {int(b.phase[cta])}, {int(b.pending[cta])} of {int(b.expected[cta])} arrivals "
                f"pending, tx-count {int(b.tx[cta])})")

    def describe(self, a: int, cta: int) -> str:
        return f"mbarrier at shared address {a:#x}{self._state(a, cta)}"


def _by_address(addr):
    for a in np.unique(addr).tolist():
        yield int(a), addr == a


def _finding(F, ins, message, threads, addrs, bad):
    k = int(np.flatnonzero(bad)[0])
    cta, tid = F.who(int(threads[k]))
    raise BulkCopyError(message, line=ins.line, instruction=ins.text, cta=cta, thread=tid,
                        address=None if addrs is None else int(addrs[k]))


def mbarriers(F) -> Mbarriers:
    if F.mbarriers is None:
        F.mbarriers = Mbarriers(F)
    return F.mbarriers


# ------------------------------------------------------------------ operands

def _space(ins, mods, allowed=_SPACES):
    spaces = [m for m in mods if m in _SPACES]
    if len(spaces) > 1 or (spaces and spaces[0] not in allowed):
        raise unsupported(ins, f"state space {spaces}")
    return spaces[0] if spaces else "generic"


def mbar_address(F, ins, mem: Mem, idx, space: str) -> np.ndarray:
    """Shared-window address of an mbarrier operand, checked (8-byte aligned, inside an allocation)."""
    threads = F.threads(idx)
    if space == "generic":
        raw = _address(F, mem, idx, "global")
        bad = (raw < GENERIC_SHARED) | (raw >= GENERIC_SHARED + np.uint64(1 << 32))
        if bad.any():
            fault("mbarrier address outside the shared window", "an mbarrier lives in shared memory", ins,
                  threads, raw, bad, F.who)
        addr = raw - GENERIC_SHARED
    else:
        addr = _address(F, mem, idx, "shared")
    bad = (F.layout.locate("shared", addr, 8) < 0) | (addr % np.uint64(8) != 0)
    if bad.any():
        fault("misaligned or out-of-allocation mbarrier", "an mbarrier is 8 bytes, 8-byte aligned, inside a shared "
              f"allocation {F.layout.shared}", ins, threads, addr, bad, F.who)
    return addr


def _values(F, op, idx, n) -> np.ndarray:
    return np.broadcast_to(np.asarray(F.read(op, np.uint32, idx)).astype(np.int64), (n,)).copy()


def _check(ins, mods, extra=frozenset()):
    bad = [m for m in mods if m not in _SPACES | _ORDER | {"b64"} | extra]
    if bad or not mods or mods[-1] != "b64":
        raise unsupported(ins, f"modifier(s) {['.' + m for m in bad]} not implemented" if bad else "expected .b64")


# ------------------------------------------------------------------ the instructions

@handler("mbarrier")
def _mbarrier(ins, ctx):
    kind, mods = ins.mods[0] if ins.mods else "", ins.mods[1:]
    if kind in ("init", "inval"):
        return _init(ins, kind, mods)
    if kind in ("arrive", "arrive_drop"):
        return _arrive(ins, kind, mods)
    if kind in ("expect_tx", "complete_tx"):
        return _tx(ins, kind, mods)
    if kind in ("try_wait", "test_wait"):
        raise unsupported(ins, "a wait outside the scheduler")  # Program compiles waits (compile_wait)
    raise unsupported(ins, f"mbarrier.{kind} is not implemented")


def _init(ins, kind, mods):
    _check(ins, mods)
    space = _space(ins, mods, {"shared", "shared::cta"})
    if set(mods) & _ORDER:
        raise unsupported(ins, "ordering qualifiers on mbarrier.init")
    ops = ins.operands
    if kind == "init" and (len(ops) != 2 or not isinstance(ops[0], Mem)) or kind == "inval" and len(ops) != 1:
        raise unsupported(ins, "expected [addr], count" if kind == "init" else "expected [addr]")

    def run(F, idx):
        threads = F.threads(idx)
        addr = mbar_address(F, ins, ops[0], idx, space)
        if kind == "inval":
            mbarriers(F).inval(F, ins, threads, addr)
            return
        count = _values(F, ops[1], idx, len(threads))
        bad = (count < 1) | (count > (1 << 20) - 1)
        if bad.any():
            _finding(F, ins, "mbarrier.init count outside [1, 2^20 - 1]", threads, addr, bad)
        mbarriers(F).init(F, ins, threads, addr, count)
    return run


def _arrive(ins, kind, mods):
    expect = "expect_tx" in mods
    if "noComplete" in mods:
        raise unsupported(ins, ".noComplete arrives are not implemented")
    _check(ins, mods, {"expect_tx"})
    space = _space(ins, mods)
    ops = ins.operands
    if len(ops) < 2 or not isinstance(ops[1], Mem) or len(ops) > 3 or (expect and len(ops) != 3):
        raise unsupported(ins, "expected state, [addr]" + (", txCount" if expect else "{, count}"))
    state_op = None if isinstance(ops[0], Sym) and ops[0].name == "_" else ops[0]
    if state_op is not None and not isinstance(state_op, Reg):
        raise unsupported(ins, "the state operand must be a register or _")

    def run(F, idx):
        threads = F.threads(idx)
        n = len(threads)
        addr = mbar_address(F, ins, ops[1], idx, space)
        extra = _values(F, ops[2], idx, n) if len(ops) == 3 else None
        count = np.ones(n, np.int64) if expect or extra is None else extra
        tx = extra if expect else np.zeros(n, np.int64)
        state = mbarriers(F).arrive(F, ins, threads, addr, count, tx, drop=kind == "arrive_drop")
        F.write(state_op, state, np.uint64, idx)
    return run


def _tx(ins, kind, mods):
    _check(ins, mods)
    space = _space(ins, mods)
    ops = ins.operands
    if len(ops) != 2 or not isinstance(ops[0], Mem):
        raise unsupported(ins, "expected [addr], txCount")

    def run(F, idx):
        threads = F.threads(idx)
        addr = mbar_address(F, ins, ops[0], idx, space)
        mbarriers(F).add_tx(F, ins, threads, addr, _values(F, ops[1], idx, len(threads)),
                            1 if kind == "expect_tx" else -1)
    return run


def compile_wait(ins):
    """``mbarrier.{try,test}_wait{.parity}``: a closure ``fn(F, idx, pc)`` that writes the result
    predicate of the threads that executed it and returns the threads that park instead (or None)."""
    mods = ins.mods[1:]
    parity = "parity" in mods
    _check(ins, mods, {"parity"})
    space = _space(ins, mods, {"shared", "shared::cta"})
    ops = ins.operands
    hint = 4 if ins.mods[0] == "try_wait" else 3
    if not (3 <= len(ops) <= hint) or not isinstance(ops[0], Reg) or not isinstance(ops[1], Mem):
        raise unsupported(ins, "expected waitComplete, [addr], " + ("phaseParity" if parity else "state")
                          + ("{, suspendTimeHint}" if hint == 4 else ""))
    d, mem, want_op = ops[:3]

    def run(F, idx, pc):
        threads = F.threads(idx)
        addr = mbar_address(F, ins, mem, idx, space)
        raw = np.asarray(F.read(want_op, np.uint64, idx)).astype(np.int64)
        want = (raw & 1) if parity else raw
        done, park = mbarriers(F).wait(F, ins, pc, threads, addr, np.broadcast_to(want, threads.shape), parity)
        if not park.any():
            F.write(d, done, np.bool_, idx)
            return None
        go = threads[~park]
        if len(go):
            F.write(d, done[~park], np.bool_, go)
        return threads[park]
    return run


@handler("elect")
def _elect(ins, ctx):
    """``elect.sync d|p, membermask``: the leader is the lowest lane of the warp that executes it and
    is in the mask (``d`` its lane id, ``p`` true in the leader). The DSL nests it (a pipeline's
    ``producer_acquire`` inside ``elect_one``), so a lane of the mask not executing it is not an
    error here: the leader is elected among the lanes that do, as the hardware does."""
    if ins.mods != ("sync",) or len(ins.operands) != 2 or not isinstance(ins.operands[0], Pair):
        raise unsupported(ins, "only elect.sync d|p, membermask")
    pair, m = ins.operands

    def run(F, idx):
        threads = F.threads(idx)
        mask = _mask_operand(F, m, idx)
        mask = np.broadcast_to(np.asarray(mask, np.uint64), threads.shape)
        member = (mask >> F.lane[threads].astype(np.uint64)) & np.uint64(1) == 1
        leader = np.full(F.n_warps, 32, np.int64)
        np.minimum.at(leader, F.warp[threads[member]], F.lane[threads[member]])
        lead = leader[F.warp[threads]]
        F.write(pair.first, lead.astype(np.uint32), np.uint32, idx)
        F.write(pair.second, F.lane[threads] == lead, np.bool_, idx)
    return run


@handler("mapa")
def _mapa(ins, ctx):
    t = ins.mods[-1] if ins.mods else ""
    rest = set(ins.mods[:-1])
    if t not in ("u32", "u64") or not rest <= {"shared::cluster"} or len(ins.operands) != 3:
        raise unsupported(ins, "only mapa{.shared::cluster}.{u32,u64} d, a, rank")
    d, a, rank = ins.operands
    dtype = np.uint32 if t == "u32" else np.uint64

    def run(F, idx):
        r = np.broadcast_to(np.asarray(F.read(rank, np.uint32, idx)), (len(F.threads(idx)),))
        bad = r != 0
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            cta, tid = F.who(int(F.threads(idx)[k]))
            raise MemoryFault(f"mapa to CTA rank {int(r[k])}: every launch here is a cluster of one CTA (rank 0); "
                              "clusters of more CTAs are not implemented", line=ins.line, instruction=ins.text,
                              cta=cta, thread=tid)
        F.write(d, F.read(a, dtype, idx), dtype, idx)
    return run
