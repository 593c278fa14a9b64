"""The scheduler: SIMT execution of a whole grid, vectorised over threads and CTAs.

Threads are kept in *groups*: sets of threads at the same program counter. The group with
the lowest PC runs next, so threads that branched apart meet again at the first
instruction both paths reach (the immediate post-dominator of structured code, which is
what the compiler's layout makes every join) and are merged there; a loop's early
leavers wait at the exit for the rest. This is "min-PC" reconvergence; it never runs a
thread ahead of a barrier its CTA has not passed.

* ``bra`` splits a group by its guard; ``bra.uni`` must be uniform per warp (checked).
* ``ret``/``exit`` retire the executing threads (none may have ``cp.async`` copies or bulk
  stores in flight: :mod:`ptx_executor.isa_async`, :mod:`ptx_executor.isa_bulk`).
* ``bar.sync``/``barrier.sync`` (an immediate id, an optional thread count) park a group until
  no group can run; then every barrier whose CTA has as many threads parked at it as its count
  (all of the CTA's threads without one) is released, warps not split across barrier
  instructions. ``mbarrier.try_wait``/``test_wait`` park a thread that spins on a phase that has
  not completed (:mod:`ptx_executor.isa_mbar`) until the mbarrier completes a phase; it then
  re-executes the wait. When nothing can run and no barrier can be released,
  :class:`~ptx_executor.errors.BarrierError` names the CTA and the threads that never arrived,
  or the mbarrier (address, phase, counts) and the threads waiting on it: a deadlock (a hang on
  a GPU is an error here).
* ``barrier.cluster.wait`` parks a group until every live thread of its cluster has arrived
  (:mod:`ptx_executor.isa_cluster`); a launch with a cluster runs chunks of whole clusters.
* Everything else is an instruction closure from :mod:`ptx_executor.isa`.

The grid runs in chunks of consecutive CTAs (bounded register-file memory); chunks run
one after another, which is one of the orders a GPU may choose. Every executed
instruction adds the number of warps of its group to that instruction's issue count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import (isa_alu, isa_async, isa_bits, isa_bulk, isa_cluster, isa_cvt, isa_griddep, isa_mbar,  # noqa: F401
               isa_mem, isa_warp)
from .deadlock import check_warps, barrier_deadlock
from .errors import BarrierError, PTXError, WarpSyncError
from .frame import Frame, storage_of
from .isa import Context, compile_instruction, unsupported
from .memory import AccessLog, GlobalMemory, VarLayout
from .ir import Entry, Imm, Module, Sym

#: how ``cp.async`` copies complete (:mod:`ptx_executor.isa_async`)
ASYNC_MODES = ("modelled", "immediate")

#: register-file bytes one chunk of CTAs may use (chunks hold at least one CTA)
CHUNK_REGISTER_BYTES = 96 << 20


@dataclass
class _Op:
    kind: str  # "op", "bra", "exit", "bar", "mwait"
    ins: object
    fn: object = None
    target: int = 0
    uniform: bool = False
    barrier: int = 0
    count: int = 0  # bar.sync thread count, 0 = every thread of the CTA


@dataclass(eq=False)
class _Group:
    pc: int
    idx: object  # None = every thread of the chunk, else sorted int64 thread indices
    warps: int
    waiting: bool = False
    barrier: int = -1
    count: int = 0
    kind: str = "bar"  # what a waiting group waits for: "bar" (bar.sync), "mbar" (an mbarrier phase), "cluster"


@dataclass
class RunResult:
    """What one launch did: issue counts per instruction and the memory logs."""
    entry: Entry
    issued: np.ndarray  # warp-instructions issued per instruction index
    log: AccessLog | None
    shared_log: AccessLog | None  # shared accesses (addresses are per-CTA window offsets)
    grid: tuple
    block: tuple
    chunks: int = 0
    extra: dict = field(default_factory=dict)


class Program:
    """An entry compiled against one launch's parameters: a closure per instruction."""

    def __init__(self, module: Module, entry: Entry, params: dict):
        self.module = module
        self.entry = entry
        ctx = Context(entry, params)
        self.ops = [self._compile(ins, ctx) for ins in entry.instructions]
        #: bulk copies or mbarriers: the chunk tracks their state from the first instruction
        self.uses_bulk = any(i.opcode.startswith(("cp.async.bulk", "mbarrier")) for i in entry.instructions)
        #: griddepcontrol: the access log says which accesses came after the wait (:mod:`.isa_griddep`)
        self.uses_griddep = any(i.base == "griddepcontrol" for i in entry.instructions)

    def _compile(self, ins, ctx) -> _Op:
        base, mods = ins.base, ins.mods
        if base == "bra":
            (target,) = ins.operands
            if not isinstance(target, Sym) or target.name not in self.entry.labels:
                raise unsupported(ins, "branch target is not a label of this entry")
            return _Op("bra", ins, target=self.entry.labels[target.name], uniform="uni" in mods)
        if base in ("ret", "exit"):
            return _Op("exit", ins)
        if base == "barrier" and mods[:1] == ("cluster",):
            if "wait" in mods:
                isa_cluster.check_wait(ins)
                return _Op("cwait", ins)
            return _Op("op", ins, fn=isa_cluster.compile_arrive(ins))
        if base in ("bar", "barrier") and "warp" not in mods:
            return self._barrier(ins)
        if base == "mbarrier" and mods and mods[0] in ("try_wait", "test_wait"):
            return _Op("mwait", ins, fn=isa_mbar.compile_wait(ins))
        return _Op("op", ins, fn=compile_instruction(ins, ctx))

    @staticmethod
    def _barrier(ins) -> _Op:
        rest = set(ins.mods) - {"sync", "aligned", "cta"}
        if "sync" not in ins.mods or rest:
            raise unsupported(ins, "only bar.sync / barrier.sync (no arrive/red)")
        if ins.guard is not None:
            raise unsupported(ins, "a predicated barrier")
        ops = ins.operands
        if not ops or len(ops) > 2 or not all(isinstance(o, Imm) and isinstance(o.value, int) for o in ops):
            raise unsupported(ins, "only an immediate barrier id and an optional immediate thread count")
        count = int(ops[1].value) if len(ops) == 2 else 0
        if len(ops) == 2 and (count <= 0 or count % 32):
            raise unsupported(ins, "a barrier thread count must be a positive multiple of 32")
        return _Op("bar", ins, barrier=int(ops[0].value), count=count)


def _guarded(F: Frame, idx, guard):
    """Threads of ``idx`` whose guard holds: None (all of the chunk), or an index array."""
    if guard is None:
        return idx
    reg, neg = guard
    p = F.regs[reg.name]
    pv = p if idx is None else p[idx]
    if neg:
        pv = ~pv
    if idx is None:
        return None if pv.all() else np.flatnonzero(pv)
    return idx[pv]


def _size(F: Frame, idx) -> int:
    return F.n if idx is None else len(idx)


def _warps(F: Frame, idx) -> int:
    return F.n_warps if idx is None else int(np.unique(F.warp[idx]).size)


def _minus(F: Frame, idx, sub):
    full = F.threads(idx)
    keep = np.ones(F.n, bool)
    keep[F.threads(sub)] = False
    return full[keep[full]]


def _union(F: Frame, a, b):
    if a is None or b is None:
        return None
    u = np.union1d(a, b)
    return None if len(u) == F.n else u


class Machine:
    """Runs one compiled :class:`Program` over a grid (see the module docstring)."""

    def __init__(self, program: Program, memory: GlobalMemory, params: dict, *, dynamic_smem: int = 0,
                 record: bool = True, record_shared: bool = False, async_copies: str = "modelled"):
        self.program = program
        self.entry = program.entry
        self.memory = memory
        self.params = params
        self.layout = VarLayout.build(program.module.variables + self.entry.variables, dynamic_smem)
        self.record = record
        self.record_shared = record_shared
        if async_copies not in ASYNC_MODES:
            raise ValueError(f"async_copies must be one of {ASYNC_MODES}, got {async_copies!r}")
        self.async_copies = async_copies

    def run(self, grid: tuple, block: tuple, cluster: tuple | None = None) -> RunResult:
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        cluster = (1, 1, 1) if cluster is None else tuple(cluster) + (1,) * (3 - len(cluster))
        if any(c < 1 or g % c for g, c in zip(grid, cluster)):
            raise PTXError(f"the cluster {cluster} must divide the grid {grid}")
        if self.entry.reqntid and tuple(self.entry.reqntid) != block:
            raise PTXError(f".reqntid {self.entry.reqntid} of the entry does not match the launch block {block}")
        nt = block[0] * block[1] * block[2]
        n_cta = grid[0] * grid[1] * grid[2]
        per_thread = sum(np.dtype(storage_of(t)).itemsize for t in self.entry.reg_types.values()) + 64
        chunk = max(1, CHUNK_REGISTER_BYTES // max(1, per_thread * nt))
        # a chunk holds whole clusters: runs of consecutive CTAs that are unions of clusters
        unit = (cluster[0] if cluster[1:] == (1, 1) else grid[0] * cluster[1] if cluster[2] == 1
                else grid[0] * grid[1] * cluster[2])
        chunk = max(1, chunk // unit) * unit
        clustered = cluster != (1, 1, 1)
        relaxed, arrived = (np.zeros(n_cta * nt if clustered else 0, np.int64) for _ in range(2))
        waited = np.zeros(n_cta * nt if self.program.uses_griddep else 0, bool)
        issued = np.zeros(len(self.program.ops), np.int64)
        log = AccessLog() if self.record else None
        shared_log = AccessLog() if self.record_shared else None
        chunks = 0
        with np.errstate(over="ignore"):
            for first in range(0, n_cta, chunk):
                F = Frame(self.entry, first_cta=first, n_cta=min(chunk, n_cta - first), grid=grid, block=block,
                          memory=self.memory, layout=self.layout, params=self.params, log=log,
                          log_shared=shared_log, async_copies=self.async_copies, cluster=cluster)
                if self.program.uses_bulk:
                    isa_bulk.bulk_state(F)
                sources = {}
                if clustered:
                    cb = isa_cluster.state(F)
                    sources |= cb.log_sources(F)
                if self.program.uses_griddep:
                    sources |= isa_griddep.log_sources(F)
                for lg in (log, shared_log):
                    if lg is not None:
                        lg.tag_sources = sources
                self._run_chunk(F, issued)
                if self.program.uses_griddep:
                    waited[F.first_thread:F.first_thread + F.n] = isa_griddep.state(F)
                if clustered:
                    relaxed[F.first_thread:F.first_thread + F.n] = cb.relaxed
                    arrived[F.first_thread:F.first_thread + F.n] = cb.arrived
                chunks += 1
        result = RunResult(self.entry, issued, log, shared_log, grid, block, chunks)
        if clustered:
            result.extra["cluster"] = {"dims": cluster, "relaxed": relaxed, "arrived": arrived}
        if self.program.uses_griddep:
            result.extra["griddepcontrol"] = {"waited": waited}
        return result

    # ------------------------------------------------------------------ scheduling
    def _run_chunk(self, F: Frame, issued: np.ndarray) -> None:
        groups = [_Group(0, None, F.n_warps)]
        ops = self.program.ops
        seen = 0
        while groups:
            if F.mbarriers is not None and F.mbarriers.completions != seen:
                seen = F.mbarriers.completions
                groups = _wake(F, groups)
            runnable = [g for g in groups if not g.waiting]
            if not runnable:
                groups = self._release_any(F, groups)
                continue
            g = min(runnable, key=lambda x: x.pc)
            for other in [o for o in runnable if o is not g and o.pc == g.pc]:  # meet at a join
                g.idx = _union(F, g.idx, other.idx)
                groups.remove(other)
            if len(runnable) > 1:
                g.warps = _warps(F, g.idx)
            while True:
                if g.pc >= len(ops):  # fell off the end: an implicit exit
                    if F.async_pending:
                        F.async_state.exiting(F, ops[-1].ins, F.threads(g.idx), fell_off=True)
                    if F.bulk_hooks:
                        F.bulk_state.exiting(F, ops[-1].ins, F.threads(g.idx), fell_off=True)
                    F.exited[F.threads(g.idx)] = True
                    groups.remove(g)
                    break
                op = ops[g.pc]
                issued[g.pc] += g.warps
                F.serial += 1
                switch = False
                if op.kind == "op":
                    eff = _guarded(F, g.idx, op.ins.guard)
                    if eff is None or len(eff):
                        op.fn(F, eff)
                    g.pc += 1
                elif op.kind == "bra":
                    switch = self._branch(F, g, op, groups)
                elif op.kind == "mwait":
                    if _mbarrier_wait(F, g, op, groups):
                        break
                elif op.kind == "exit":
                    eff = _guarded(F, g.idx, op.ins.guard)
                    if eff is not None and not len(eff):
                        g.pc += 1
                    else:
                        if F.async_pending:
                            F.async_state.exiting(F, op.ins, F.threads(eff))
                        if F.bulk_hooks:
                            F.bulk_state.exiting(F, op.ins, F.threads(eff))
                        F.exited[F.threads(eff)] = True
                        rest = None if eff is None else _minus(F, g.idx, eff)
                        if rest is None or not len(rest):
                            groups.remove(g)
                            break
                        g.idx, g.warps, g.pc = rest, _warps(F, rest), g.pc + 1
                elif op.kind == "cwait":
                    g.waiting, g.kind = True, "cluster"
                    break
                else:  # barrier
                    g.waiting, g.barrier, g.count, g.kind = True, op.barrier, op.count, "bar"
                    break
                joined = [o for o in groups if o is not g and not o.waiting and o.pc == g.pc]
                for other in joined:
                    g.idx = _union(F, g.idx, other.idx)
                    groups.remove(other)
                if joined:
                    g.warps = _warps(F, g.idx)
                if switch and any(o.pc < g.pc for o in groups if not o.waiting and o is not g):
                    break

    def _branch(self, F: Frame, g: _Group, op: _Op, groups: list) -> bool:
        taken = _guarded(F, g.idx, op.ins.guard)
        if op.uniform and op.ins.guard is not None:
            self._check_uniform(F, g, op, taken)
        if taken is None or (g.idx is not None and len(taken) == len(g.idx)):
            g.pc = op.target
        elif not len(taken):
            g.pc += 1
            return False
        else:
            rest = _minus(F, g.idx, taken)
            there = [o for o in groups if o.pc == op.target and not o.waiting]
            if there:  # threads that branched there earlier: join them
                o = there[0]
                o.idx = _union(F, o.idx, taken)
                o.warps = _warps(F, o.idx)
            else:
                groups.append(_Group(op.target, taken, _warps(F, taken)))
            g.idx, g.warps = rest, _warps(F, rest)
            g.pc += 1
        return True

    @staticmethod
    def _check_uniform(F: Frame, g: _Group, op: _Op, taken) -> None:
        threads = F.threads(g.idx)
        took = np.zeros(F.n, bool)
        took[F.threads(taken)] = True
        w = F.warp[threads]
        mixed = np.zeros(F.n_warps, np.int64)
        np.add.at(mixed, w, took[threads].astype(np.int64) * 2 - 1)
        counts = np.bincount(w, minlength=F.n_warps)
        bad = np.abs(mixed[w]) != counts[w]
        if bad.any():
            cta, tid = F.who(int(threads[np.flatnonzero(bad)[0]]))
            raise WarpSyncError("bra.uni with a condition that differs inside a warp", line=op.ins.line,
                                instruction=op.ins.text, cta=cta, thread=tid)

    def _release_any(self, F: Frame, groups: list) -> list:
        """Nothing can run: complete the cluster waits that can complete (:mod:`.isa_cluster`), else
        release the CTA barriers that can be (:meth:`_release`), else it is a deadlock."""
        parked = [g for g in groups if g.kind == "cluster"]
        if not parked:
            return self._release(F, groups)
        t = np.concatenate([F.threads(g.idx) for g in parked])
        go = t[isa_cluster.ready(F, t)]
        if not len(go):
            if any(g.kind != "cluster" for g in groups):
                return self._release(F, groups)
            raise isa_cluster.deadlock(F, t, self.program.ops[parked[0].pc].ins)
        isa_cluster.complete(F, go)
        F.epoch += 1
        leave = np.zeros(F.n, bool)
        leave[go] = True
        out = [g for g in groups if g.kind != "cluster"]
        for g in parked:
            gt = F.threads(g.idx)
            stay, move = gt[~leave[gt]], gt[leave[gt]]
            if len(stay):
                out.append(_Group(g.pc, stay, _warps(F, stay), True, kind="cluster"))
            if len(move):
                out.append(_Group(g.pc + 1, move, _warps(F, move)))
        return out

    def _release(self, F: Frame, groups: list) -> list:
        """All runnable work waits: release every barrier of a CTA that its thread count (or the whole
        CTA) reached; if none can be released, nothing can progress: a deadlock (a hang on a GPU)."""
        parked = np.zeros(F.n, bool)
        at_pc = np.full(F.n, -1, np.int64)
        bar_id = np.full(F.n, -1, np.int64)
        count = np.zeros(F.n, np.int64)
        for g in groups:
            if g.kind == "bar":
                t = F.threads(g.idx)
                parked[t], at_pc[t], bar_id[t], count[t] = True, g.pc, g.barrier, g.count
        release = np.zeros(F.n, bool)
        for c in np.unique(F.cta_local[parked]).tolist():
            members = np.arange(c * F.nt, (c + 1) * F.nt)
            for b in np.unique(bar_id[members[parked[members]]]).tolist():
                at = members[parked[members] & (bar_id[members] == b)]
                ins = self.program.ops[int(at_pc[at[0]])].ins
                check_warps(F, at, at_pc, ins)
                counts = np.unique(count[at])
                expected = int(counts[0]) or F.nt
                if len(counts) > 1 or len(at) > expected:
                    cta, tid = F.who(int(at[0]))
                    raise BarrierError(f"{len(at)} threads wait at barrier {b} with thread counts {counts.tolist()}",
                                       line=ins.line, instruction=ins.text, cta=cta, thread=tid)
                if len(at) == expected:
                    release[at] = True
        if not release.any():
            raise barrier_deadlock(self.program.ops, F, groups, parked, at_pc, bar_id)
        F.epoch += 1
        out, merged = [], {}
        for g in groups:
            if g.kind != "bar":
                out.append(g)
                continue
            t = F.threads(g.idx)
            go, stay = t[release[t]], t[~release[t]]
            if len(stay):
                out.append(_Group(g.pc, stay, _warps(F, stay), True, g.barrier, g.count, "bar"))
            if len(go):
                pc = g.pc + 1
                merged[pc] = go if pc not in merged else _union(F, merged[pc], go)
        return out + [_Group(pc, None if idx is None or len(idx) == F.n else idx, _warps(F, idx))
                      for pc, idx in merged.items()]

def _mbarrier_wait(F: Frame, g: _Group, op: _Op, groups: list) -> bool:
    """Execute an mbarrier wait for ``g``; threads spinning on an incomplete phase park there (a new
    waiting group). True when none of ``g`` is left to run on."""
    eff = _guarded(F, g.idx, op.ins.guard)
    park = op.fn(F, eff, g.pc) if eff is None or len(eff) else None
    if park is None or not len(park):
        g.pc += 1
        return False
    groups.append(_Group(g.pc, park, _warps(F, park), True, kind="mbar"))
    rest = _minus(F, g.idx, park)
    if not len(rest):
        groups.remove(g)
        return True
    g.idx, g.warps, g.pc = rest, _warps(F, rest), g.pc + 1
    return False


def _wake(F: Frame, groups: list) -> list:
    """Groups parked on mbarriers whose mbarrier completed a phase run again (from their wait)."""
    out = []
    for g in groups:
        if g.kind != "mbar" or not g.waiting:
            out.append(g)
            continue
        t = F.threads(g.idx)
        ready = F.mbarriers.ready(F, t)
        if ready.any():
            out.append(_Group(g.pc, t[ready], _warps(F, t[ready])))
        if not ready.all():
            out.append(_Group(g.pc, t[~ready], _warps(F, t[~ready]), True, kind="mbar"))
    return out
