"""Deadlock reports of the scheduler (:mod:`ptx_executor.machine`) and the aligned-barrier check."""

from __future__ import annotations

import numpy as np

from .errors import BarrierError


def barrier_deadlock(ops: list, F, groups: list, parked, at_pc, bar_id) -> BarrierError:
    """The error for a chunk where no group can run and no barrier can be released."""
    waiting = [g for g in groups if g.kind == "mbar"]
    if waiting:
        g = waiting[0]
        t = F.threads(g.idx)
        mb = F.mbarriers
        addr, cta_local = int(mb.fail_addr[t[0]]), int(F.cta_local[t[0]])
        same = t[(F.cta_local[t] == cta_local) & (mb.fail_addr[t] == addr)]
        members = np.arange(cta_local * F.nt, (cta_local + 1) * F.nt)
        other = sum(int(((F.cta_local[x] == cta_local) & (mb.fail_addr[x] != addr)).sum())
                    for x in (F.threads(w.idx) for w in waiting))
        elsewhere = (f"{int(parked[members].sum())} at bar.sync, {other} waiting on other mbarriers, "
                     f"{int(F.exited[members].sum())} exited")
        names = ", ".join(str(F.who(int(x))[1]) for x in same[:4]) + (" ..." if len(same) > 4 else "")
        want = int(mb.fail_want[t[0]])
        cta, tid = F.who(int(t[0]))
        return BarrierError(
            f"deadlock: {len(same)} thread(s) ({names}) wait for the {mb.describe(addr, cta_local)} to complete "
            f"the phase they wait for (parity {want & 1}), and no thread of the CTA can make progress (of its "
            f"other threads: {elsewhere}); on a GPU this hangs", line=ops[g.pc].ins.line,
            instruction=ops[g.pc].ins.text, cta=cta, thread=tid)
    c = int(F.cta_local[parked][0])
    members = np.arange(c * F.nt, (c + 1) * F.nt)
    ins = ops[int(at_pc[members[parked[members]][0]])].ins
    ids = np.unique(bar_id[members[parked[members]]])
    missing = members[~parked[members]]
    if len(ids) > 1 and not len(missing):
        cta, tid = F.who(int(members[0]))
        return BarrierError(f"threads of one CTA wait at different barrier ids {ids.tolist()}: a deadlock",
                            line=ins.line, instruction=ins.text, cta=cta, thread=tid)
    cta, tid = F.who(int(missing[0]))
    state = "exited" if F.exited[missing[0]] else "never arrived"
    return BarrierError(
        f"{len(missing)} of the CTA's {F.nt} threads never reach this barrier (thread {tid} "
        f"{state}); on a GPU this hangs or is undefined", line=ins.line, instruction=ins.text, cta=cta, thread=tid)


def check_warps(F, at, at_pc, ins) -> None:
    """An aligned barrier: every warp's threads waiting at it wait at one instruction."""
    w = F.warp[at]
    first = np.full(F.n_warps, -1, np.int64)
    first[w[::-1]] = at_pc[at][::-1]
    split = first[w] != at_pc[at]
    if split.any():
        cta, tid = F.who(int(F.warp_base[at[np.flatnonzero(split)[0]]]))
        raise BarrierError("a warp reaches the aligned barrier at two different instructions",
                           line=ins.line, instruction=ins.text, cta=cta, thread=tid)
