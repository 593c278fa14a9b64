"""Warp-synchronous instructions: ``shfl.sync``, ``vote.sync``, ``activemask``, ``bar.warp.sync``.

The executing threads of an instruction are the threads of the scheduler's group that are
at it together (:mod:`.machine`), after the guard. For every executing thread, each lane
named in its ``membermask`` must be executing the same instruction now, and the thread
itself must be in its mask; otherwise :class:`~ptx_executor.errors.WarpSyncError` names
the instruction, the thread and the missing lanes. A shuffle's source lane (after PTX's
clamp/segment rules) must be executing too.
"""

from __future__ import annotations

import numpy as np

from .errors import WarpSyncError
from .isa import check_mods, handler, unsupported
from .ir import Imm, Pair

_FULL = 0xFFFFFFFF


def _executing(F, threads) -> np.ndarray:
    active = np.zeros(F.n, bool)
    active[threads] = True
    return active


def _warp_bits(F, active) -> np.ndarray:
    """Per-thread bitmask of the executing lanes of its warp."""
    lanes = np.flatnonzero(active)
    bits = np.zeros(F.n, np.uint64)
    np.bitwise_or.at(bits, F.warp_base[lanes], np.uint64(1) << F.lane[lanes].astype(np.uint64))
    return bits[F.warp_base]


def check_converged(F, ins, threads, mask) -> np.ndarray:
    """Raise unless every lane of every executing thread's member mask executes ``ins`` too.

    Returns the per-thread bitmask of executing lanes in its warp (for the instruction).
    """
    active = _executing(F, threads)
    lane_bits = _warp_bits(F, active)[threads]
    mask = np.broadcast_to(np.asarray(mask, np.uint64) & np.uint64(_FULL), threads.shape)
    own = np.uint64(1) << F.lane[threads].astype(np.uint64)
    missing = mask & ~lane_bits
    bad = (missing != 0) | ((mask & own) == 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        cta, tid = F.who(int(threads[k]))
        lanes = [i for i in range(32) if int(missing[k]) >> i & 1]
        why = (f"lanes {lanes} of member mask {int(mask[k]):#010x} are not executing it"
               if lanes else f"the thread's own lane is not in member mask {int(mask[k]):#010x}")
        raise WarpSyncError(why, line=ins.line, instruction=ins.text, cta=cta, thread=tid)
    return lane_bits


def _mask_operand(F, op, idx):
    if isinstance(op, Imm):
        return np.uint64(op.value & _FULL)
    return np.asarray(F.read(op, np.uint32, idx)).astype(np.uint64)


@handler("shfl")
def _shfl(ins, ctx):
    mods = check_mods(ins, {"sync", "up", "down", "bfly", "idx", "b32"})
    mode = next((m for m in ("up", "down", "bfly", "idx") if m in mods), None)
    if "sync" not in ins.mods or mode is None:
        raise unsupported(ins, "only shfl.sync.{up,down,bfly,idx}.b32")
    d, a, b, c, m = ins.operands
    dst, pdst = (d.first, d.second) if isinstance(d, Pair) else (d, None)

    def run(F, idx):
        threads = F.threads(idx)
        check_converged(F, ins, threads, _mask_operand(F, m, idx))
        lane = F.lane[threads]
        bval = np.asarray(F.read(b, np.uint32, idx)).astype(np.int64) & 31
        cval = np.asarray(F.read(c, np.uint32, idx)).astype(np.int64)
        clamp, seg = cval & 31, (cval >> 8) & 31
        max_lane = (lane & seg) | (clamp & ~seg)
        min_lane = lane & seg
        if mode == "up":
            j = lane - bval
            ok = j >= max_lane
        elif mode == "down":
            j = lane + bval
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bval
            ok = j <= max_lane
        else:
            j = min_lane | (bval & ~seg)
            ok = j <= max_lane
        j = np.where(ok, j, lane)
        src = F.warp_base[threads] + j
        active = _executing(F, threads)
        bad = ~active[np.minimum(src, F.n - 1)] | (j >= F.warp_size[threads])
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            cta, tid = F.who(int(threads[k]))
            raise WarpSyncError(f"source lane {int(j[k])} is not executing the shuffle", line=ins.line,
                                instruction=ins.text, cta=cta, thread=tid)
        F.write(dst, F.read(a, np.uint32, src), np.uint32, idx)
        if pdst is not None:
            F.write(pdst, ok, np.bool_, idx)
    return run


@handler("vote")
def _vote(ins, ctx):
    mods = check_mods(ins, {"sync", "all", "any", "uni", "ballot", "pred", "b32"})
    kind = next((k for k in ("all", "any", "uni", "ballot") if k in mods), None)
    if "sync" not in ins.mods or kind is None:
        raise unsupported(ins, "only vote.sync")
    d, p, m = ins.operands
    negate = False

    def run(F, idx):
        threads = F.threads(idx)
        mask = _mask_operand(F, m, idx)
        check_converged(F, ins, threads, mask)
        pv = np.asarray(F.read(p, np.bool_, idx)) ^ negate
        bits = np.zeros(F.n, np.uint64)
        np.bitwise_or.at(bits, F.warp_base[threads], pv.astype(np.uint64) << F.lane[threads].astype(np.uint64))
        ballot = bits[F.warp_base[threads]] & np.broadcast_to(mask, threads.shape)
        if kind == "ballot":
            F.write(d, ballot.astype(np.uint32), np.uint32, idx)
            return
        mk = np.broadcast_to(mask, threads.shape)
        r = {"all": ballot == mk, "any": ballot != 0, "uni": (ballot == 0) | (ballot == mk)}[kind]
        F.write(d, r, np.bool_, idx)
    return run


@handler("activemask")
def _activemask(ins, ctx):
    check_mods(ins, {"b32"})
    (d,) = ins.operands

    def run(F, idx):
        threads = F.threads(idx)
        F.write(d, _warp_bits(F, _executing(F, threads))[threads].astype(np.uint32), np.uint32, idx)
    return run


@handler("bar")
def _bar_warp(ins, ctx):
    """``bar.warp.sync mask`` (the CTA barriers ``bar.sync``/``barrier.sync`` are the scheduler's)."""
    if ins.mods[:2] != ("warp", "sync"):
        raise unsupported(ins, "only bar.warp.sync here; bar.sync is a scheduler instruction")
    (m,) = ins.operands

    def run(F, idx):
        check_converged(F, ins, F.threads(idx), _mask_operand(F, m, idx))
    return run
