"""The cluster barrier: ``barrier.cluster.arrive{.release|.relaxed}{.aligned}`` and
``barrier.cluster.wait{.acquire}{.aligned}`` over the CTAs of a thread-block cluster.

A launch with a cluster (``Machine.run(..., cluster=(cx, cy, cz))``) groups its CTAs by
``%ctaid / cluster``; a chunk always holds whole clusters. Each thread counts its arrivals and
its completed waits. Its ``k``-th wait completes once every thread of its cluster that has not
exited has arrived ``k`` times (the PTX ISA's rule: exited threads do not hold the barrier up);
a thread parks there until then, and when no thread of the chunk can run and no wait can
complete it is a deadlock (:class:`~ptx_executor.errors.BarrierError`). Arriving a second time
before waiting is an error too (the ISA leaves it undefined).

What the barrier orders is kept for :func:`ptx_executor.analysis.cta_races`: every logged global
access carries its thread's arrival and wait counts at that moment (:meth:`ClusterBarrier.log_sources`),
and each thread's relaxed arrivals are kept: a ``.relaxed`` arrival orders none of the thread's
earlier accesses, so an access of one CTA happens before another CTA's only when a release
arrival after it (phase ``k``) precedes the other's ``k``-th wait. The default ``arrive`` is a
release and ``wait`` an acquire.
"""

from __future__ import annotations

import numpy as np

from .errors import BarrierError
from .isa import unsupported

#: arrivals a thread may make (the relaxed ones are kept as bits of one int64)
MAX_PHASES = 62


class ClusterBarrier:
    """The cluster barrier of one chunk: per thread its cluster, arrivals, waits, relaxed phases."""

    def __init__(self, F):
        gx, gy, _ = F.grid
        cx, cy, cz = F.cluster
        cta = F.first_cta + F.cta_local
        x, y, z = cta % gx, (cta // gx) % gy, cta // (gx * gy)
        self.cluster = (x // cx + (gx // cx) * (y // cy + (gy // cy) * (z // cz))).astype(np.int64)
        self.arrived = np.zeros(F.n, np.int64)
        self.waited = np.zeros(F.n, np.int64)
        self.relaxed = np.zeros(F.n, np.int64)  # bit k: the thread's k-th arrival was relaxed

    def log_sources(self, F) -> dict:
        """The access log's tags (``AccessLog.tag_sources``): each global thread's arrivals and completed waits."""
        return {"arrived": lambda threads: self.arrived[np.asarray(threads, np.int64) - F.first_thread].copy(),
                "waited": lambda threads: self.waited[np.asarray(threads, np.int64) - F.first_thread].copy()}


def state(F) -> ClusterBarrier:
    if F.cluster_barrier is None:
        F.cluster_barrier = ClusterBarrier(F)
    return F.cluster_barrier


def compile_arrive(ins):
    """The closure of ``barrier.cluster.arrive``: each executing thread arrives once."""
    rest = set(ins.mods) - {"cluster", "arrive", "release", "relaxed", "aligned"}
    if rest or ins.operands or ins.guard is not None or {"release", "relaxed"} <= set(ins.mods):
        raise unsupported(ins, "barrier.cluster.arrive{.release|.relaxed}{.aligned}, unpredicated, no operands")
    relaxed = "relaxed" in ins.mods

    def arrive(F, idx):
        cb = state(F)
        t = F.threads(idx)
        twice = cb.arrived[t] > cb.waited[t]
        if twice.any():
            cta, tid = F.who(int(t[np.flatnonzero(twice)[0]]))
            raise BarrierError("a thread arrives at barrier.cluster again before it waited for its last arrival",
                               line=ins.line, instruction=ins.text, cta=cta, thread=tid)
        if (cb.arrived[t] >= MAX_PHASES).any():
            raise unsupported(ins, f"more than {MAX_PHASES} cluster barrier phases")
        cb.arrived[t] += 1
        if relaxed:
            cb.relaxed[t] |= np.int64(1) << cb.arrived[t]

    return arrive


def check_wait(ins) -> None:
    rest = set(ins.mods) - {"cluster", "wait", "acquire", "aligned"}
    if rest or ins.operands or ins.guard is not None:
        raise unsupported(ins, "barrier.cluster.wait{.acquire}{.aligned}, unpredicated, no operands")


def ready(F, waiting: np.ndarray) -> np.ndarray:
    """Which of the ``waiting`` threads' waits complete: every live thread of its cluster arrived for it."""
    cb = state(F)
    live = ~F.exited
    fewest = np.full(int(cb.cluster.max()) + 1, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(fewest, cb.cluster[live], cb.arrived[live])
    return fewest[cb.cluster[waiting]] >= cb.waited[waiting] + 1


def complete(F, threads: np.ndarray) -> None:
    cb = state(F)
    cb.waited[threads] += 1


def deadlock(F, waiting: np.ndarray, ins) -> BarrierError:
    """The error when threads wait at barrier.cluster and their clusters' missing arrivals never come."""
    cb = state(F)
    t0 = int(waiting[0])
    members = np.flatnonzero(cb.cluster == cb.cluster[t0])
    want = int(cb.waited[t0]) + 1
    missing = members[(cb.arrived[members] < want) & ~F.exited[members]]
    cta, tid = F.who(t0)
    who = F.who(int(missing[0])) if len(missing) else (cta, tid)
    return BarrierError(
        f"deadlock: {len(waiting)} thread(s) wait at barrier.cluster for arrival {want} of their cluster, and "
        f"{len(missing)} of its {len(members)} threads never arrive (first: CTA {who[0]} thread {who[1]}); "
        "on a GPU this hangs", line=ins.line, instruction=ins.text, cta=cta, thread=tid)


def next_release(arrived: np.ndarray, relaxed: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Per access: the phase of its thread's first release arrival after it (``arrived``: its arrivals
    at the access; ``relaxed``, ``total``: the thread's relaxed bits and arrivals in all), or a huge
    number when none follows."""
    k = arrived + 1
    for _ in range(MAX_PHASES + 1):
        skip = (k <= total) & (((relaxed >> np.minimum(k, 63)) & 1) == 1)
        if not skip.any():
            break
        k = np.where(skip, k + 1, k)
    return np.where(k <= total, k, np.iinfo(np.int64).max)
