"""Executed facts from a :class:`~ptx_executor.RunResult`: what the kernel really did.

* :func:`instruction_mix` - warp-instructions issued, by class (FFMA, shuffle, shared,
  global, integer, other). Counted on PTX instructions: ``ptxas`` folds some away
  (parameter loads become constant-bank operands, moves vanish) and expands others
  (``div.rn``), so these are a close proxy for SASS issue slots, not equal to them.
* :func:`bytes_touched` - unique bytes read and written per global region.
* :func:`coalescing` - per global memory instruction: warp-level requests, 32-byte
  sectors touched, and the minimum sectors the same unique bytes need.
* :func:`bank_conflicts` - per shared memory instruction: requests, wavefronts and the
  minimum, with the standard model (32 four-byte banks; a 32-bit warp access is one phase,
  a 64-bit one two half-warp phases, a 128-bit one four quarter-warp phases; in a phase the
  bank holding the most distinct words sets the wavefronts, equal words broadcast).
* :func:`cta_races` - bytes written by two CTAs, or written by one and read by another:
  the executor runs CTAs in one order, a GPU in any, so such bytes make results depend on
  scheduling; unless the CTAs share a cluster whose barrier orders the two accesses.
* :func:`intra_cta_races` - bytes two threads of one CTA touch (one writing) between the
  same two barriers, in global or shared memory.
* :func:`pre_wait_accesses` - global bytes threads touched before ``griddepcontrol.wait``.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from . import isa_cluster
from .memory import GlobalMemory
from .machine import RunResult

CLASSES = ("FFMA", "shuffle", "shared", "global", "integer", "other")
_INT_TYPES = {"s8", "u8", "b8", "s16", "u16", "b16", "s32", "u32", "b32", "s64", "u64", "b64"}


def classify(opcode: str) -> str:
    """The class of a PTX opcode (see the module docstring)."""
    parts = opcode.split(".")
    base, mods = parts[0], set(parts[1:])
    if base in ("fma", "mad") and ("f32" in mods or "f32x2" in mods):
        return "FFMA"
    if base == "shfl":
        return "shuffle"
    if base == "cp":  # cp.async: a global read (its shared write is the same request); commit/wait: other
        return "global" if "global" in mods else "other"
    if base in ("ld", "st", "atom", "red", "ldu"):
        if "shared" in mods:
            return "shared"
        if "global" in mods or not mods & {"param", "local", "const"}:
            return "global"
        return "other"
    if base in ("add", "sub", "mul", "mad", "and", "or", "xor", "not", "shl", "shr", "min", "max", "neg",
                "abs", "div", "rem", "popc", "clz", "bfe", "bfi", "prmt", "lop3", "shf", "selp", "setp", "set"):
        typ = parts[-1]
        return "integer" if typ in _INT_TYPES else "other"
    if base == "cvt" and len(parts) >= 3 and parts[-1] in _INT_TYPES and parts[-2] in _INT_TYPES:
        return "integer"
    return "other"


def instruction_mix(result: RunResult, ctas: int | None = None) -> dict:
    """Warp-instructions issued per class (and ``total``), divided by ``ctas`` when given."""
    out = dict.fromkeys(CLASSES, 0)
    for ins, n in zip(result.entry.instructions, result.issued):
        out[classify(ins.opcode)] += int(n)
    out["total"] = sum(out[c] for c in CLASSES)
    if ctas:
        return {k: v / ctas for k, v in out.items()}
    return out


def _flat(result: RunResult, shared: bool = False) -> dict:
    log = result.shared_log if shared else result.log
    if log is None:
        raise ValueError("the run was not recorded (record=True / record_shared=True)")
    return log.arrays()


def _warp_ids(result: RunResult, thread: np.ndarray) -> np.ndarray:
    nt = result.block[0] * result.block[1] * result.block[2]
    wpc = (nt + 31) // 32
    return (thread // nt) * wpc + (thread % nt) // 32


def cta_of(result: RunResult, thread: np.ndarray) -> np.ndarray:
    """Linear CTA index of global thread ids."""
    nt = result.block[0] * result.block[1] * result.block[2]
    return thread // nt


def _byte_ranges(addr: np.ndarray, width: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every byte address of every access, with the access index it belongs to."""
    reps = width.astype(np.int64)
    owner = np.repeat(np.arange(len(addr)), reps)
    offs = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    return addr[owner] + offs.astype(np.uint64), owner


def bytes_touched(result: RunResult, memory: GlobalMemory) -> dict:
    """``{region name: {"read": unique bytes, "written": unique bytes}}``."""
    a = _flat(result)
    out = {r.name: {"read": 0, "written": 0} for r in memory.regions}
    for write, key in ((False, "read"), (True, "written")):
        sel = a["write"] == write
        if not sel.any():
            continue
        bytes_, _ = _byte_ranges(a["addr"][sel], a["width"][sel])
        bytes_ = np.unique(bytes_)
        for r in memory.regions:
            inside = (bytes_ >= np.uint64(r.start)) & (bytes_ < np.uint64(r.end))
            out[r.name][key] = int(inside.sum())
    return out


def coalescing(result: RunResult) -> dict:
    """``{ptx line: {"requests", "sectors", "ideal_sectors", "width", "write"}}`` for global accesses."""
    a = _flat(result)
    if not len(a["addr"]):
        return {}
    req = a["serial"] * (1 << 24) + _warp_ids(result, a["thread"])  # one warp-level request
    sector = (a["addr"] // np.uint64(32)).astype(np.int64)
    out = {}
    for line in np.unique(a["instr"]):
        sel = a["instr"] == line
        r, s, ad, w = req[sel], sector[sel], a["addr"][sel].astype(np.int64), int(a["width"][sel][0])
        n_req = len(np.unique(r))
        n_sec = len(np.unique(np.stack([r, s], 1), axis=0))
        ra = np.unique(np.stack([r, ad], 1), axis=0)  # unique addresses per request
        _, per_req = np.unique(ra[:, 0], return_counts=True)
        ideal = int(np.sum(-(-(per_req * w) // 32)))
        out[int(line)] = {"requests": n_req, "sectors": n_sec, "ideal_sectors": ideal, "width": w,
                          "write": bool(a["write"][sel][0])}
    return out


def _group_runs(*keys) -> tuple[np.ndarray, np.ndarray]:
    """Sort by ``keys`` (last is the primary) and return ``(order, run starts)`` of equal keys."""
    order = np.lexsort(keys)
    new = np.zeros(len(order), bool)
    new[:1] = True
    for k in keys:
        ks = k[order]
        new[1:] |= ks[1:] != ks[:-1]
    return order, np.flatnonzero(new)


def bank_conflicts(result: RunResult) -> dict:
    """``{ptx line: {"requests", "wavefronts", "ideal"}}`` for shared accesses (model above). Accesses wider
    than 16 bytes are bulk copies' (``cp.async.bulk``): the copy engine's, not a warp's request through the
    banks, so they are left out."""
    a = _flat(result, shared=True)
    narrow = a["width"] <= 16
    if not narrow.all():
        a = {k: v[narrow] for k, v in a.items()}
    if not len(a["addr"]):
        return {}
    nt = result.block[0] * result.block[1] * result.block[2]
    request = a["serial"] * (1 << 24) + _warp_ids(result, a["thread"])
    lane = (a["thread"] % nt) % 32
    words_per = np.maximum(1, a["width"] // 4)
    phase = lane // (32 // words_per)
    # one element per 4-byte word an access touches
    word, owner = _byte_ranges(a["addr"] // np.uint64(4), words_per)
    word = word.astype(np.int64)
    req, ph, line = request[owner], phase[owner], a["instr"][owner]
    bank = word % 32
    # distinct words per (request, phase, bank)
    order, starts = _group_runs(word, bank, ph, req)
    rq, pq, bq = req[order][starts], ph[order][starts], bank[order][starts]
    o2, s2 = _group_runs(bq, pq, rq)  # runs of equal (request, phase, bank) among distinct words
    ends = np.append(s2[1:], len(o2))
    per_bank = ends - s2
    rq2, pq2 = rq[o2][s2], pq[o2][s2]
    o3, s3 = _group_runs(pq2, rq2)  # (request, phase): wavefronts = busiest bank
    wave = np.maximum.reduceat(per_bank[o3], s3)
    req_of_phase = rq2[o3][s3]
    line_of_req = dict(zip(req.tolist(), line.tolist()))
    stats: dict = defaultdict(lambda: {"requests": 0, "wavefronts": 0, "ideal": 0})
    for r in np.unique(req_of_phase).tolist():
        stats[line_of_req[r]]["requests"] += 1
    for r, w in zip(req_of_phase.tolist(), wave.tolist()):
        st = stats[line_of_req[r]]
        st["wavefronts"] += int(w)
        st["ideal"] += 1
    return {k: dict(v) for k, v in stats.items()}


def cta_races(result: RunResult) -> list:
    """Global bytes shared between CTAs with at least one write: ``[(address, kind, (cta, cta))]``
    (at most 10; kind ``write/write`` or ``write/read``). With a cluster launch two accesses of CTAs
    of one cluster are no race when its barrier orders them (:func:`_cluster_races`)."""
    a = _flat(result)
    if "cluster" in result.extra and len(a["addr"]):
        return _cluster_races(result, a)
    if not len(a["addr"]):
        return []
    bytes_, owner = _byte_ranges(a["addr"], a["width"])
    b = bytes_.astype(np.int64)
    c = cta_of(result, a["thread"])[owner]
    wr = a["write"][owner]
    order = np.lexsort((c, b))
    b, c, wr = b[order], c[order], wr[order]
    starts = np.flatnonzero(np.append(True, b[1:] != b[:-1]))  # one run per byte
    big = np.iinfo(np.int64).max
    any_w = np.logical_or.reduceat(wr, starts)
    wmin = np.minimum.reduceat(np.where(wr, c, big), starts)
    wmax = np.maximum.reduceat(np.where(wr, c, -1), starts)
    rmin = np.minimum.reduceat(np.where(~wr, c, big), starts)
    rmax = np.maximum.reduceat(np.where(~wr, c, -1), starts)
    has_r = rmax >= 0
    ww = any_w & (wmin != wmax)
    wrr = any_w & ~ww & has_r & ((rmin != wmin) | (rmax != wmin))
    races = [(int(b[s]), "write/write", (int(lo), int(hi))) for s, lo, hi in
             zip(starts[ww][:10], wmin[ww][:10], wmax[ww][:10])]
    other = np.where(rmin != wmin, rmin, rmax)
    races += [(int(b[s]), "write/read", (int(w), int(r))) for s, w, r in
              zip(starts[wrr][:10], wmin[wrr][:10], other[wrr][:10])]
    return races[:10]


def _cluster_races(result: RunResult, a: dict) -> list:
    """:func:`cta_races` of a cluster launch: every pair of accesses of one byte by two CTAs, one a write,
    unless both CTAs are in one cluster and the barrier orders them: access ``x`` happens before ``y`` when
    ``x``'s thread made a release arrival after ``x`` (phase ``k``, :func:`isa_cluster.next_release`) and
    ``y``'s thread had completed its ``k``-th wait before ``y``."""
    info = result.extra["cluster"]
    bytes_, owner = _byte_ranges(a["addr"], a["width"])
    thread = a["thread"][owner]
    cta = cta_of(result, thread)
    gx, gy, _ = result.grid
    cx, cy, cz = info["dims"]
    cluster = (cta % gx) // cx + (gx // cx) * (((cta // gx) % gy) // cy + (gy // cy) * ((cta // (gx * gy)) // cz))
    release = isa_cluster.next_release(a["arrived"][owner], info["relaxed"][thread], info["arrived"][thread])
    waited, wr = a["waited"][owner], a["write"][owner]
    order = np.lexsort((cta, bytes_))
    b, cta, cluster, release, waited, wr = (v[order] for v in (bytes_, cta, cluster, release, waited, wr))
    races = []
    for off in range(1, len(b)):
        i = np.arange(len(b) - off)
        j = i + off
        same = b[i] == b[j]
        if not same.any():
            break
        i, j = i[same], j[same]
        ordered = (cluster[i] == cluster[j]) & ((release[i] <= waited[j]) | (release[j] <= waited[i]))
        bad = (cta[i] != cta[j]) & (wr[i] | wr[j]) & ~ordered
        for x, y in zip(i[bad][:10], j[bad][:10]):
            kind = "write/write" if wr[x] and wr[y] else "write/read"
            races.append((int(b[x]), kind, (int(cta[x]), int(cta[y]))))
        if len(races) >= 10:
            break
    return sorted(races)[:10]


def pre_wait_accesses(result: RunResult, memory: GlobalMemory) -> dict:
    """``{region name: {"read": unique bytes, "written": unique bytes}}`` that threads touched before they
    passed ``griddepcontrol.wait`` (:mod:`.isa_griddep`): every access, for a kernel without one."""
    a = _flat(result)
    before = ~a["after_dependency_wait"] if "after_dependency_wait" in a else np.ones(len(a["addr"]), bool)
    out: dict = {}
    for write in (False, True):
        sel = before & (a["write"] == write)
        if not sel.any():
            continue
        bytes_, _ = _byte_ranges(a["addr"][sel], a["width"][sel])
        unique = np.unique(bytes_)
        region = memory.locate(unique, 1)
        for k in np.unique(region).tolist():
            name = memory.regions[k].name if k >= 0 else "?"
            out.setdefault(name, {"read": 0, "written": 0})["written" if write else "read"] += int((region == k).sum())
    return out


#: accesses analysed at once by :func:`intra_cta_races` (whole CTAs per batch): each access
#: expands to one entry per byte and several int64 arrays, about 1 KiB per access in all
RACE_BATCH_ACCESSES = 1 << 20


def intra_cta_races(result: RunResult, shared: bool = False) -> list:
    """Bytes touched by two threads of one CTA between the same barriers, one of them writing:
    ``[(address, cta, threads)]`` (at most 10), in CTA order.

    A race is within one CTA, so the log is analysed a batch of whole CTAs at a time (about
    :data:`RACE_BATCH_ACCESSES` accesses): the memory stays bounded however large the launch.
    """
    a = _flat(result, shared)
    if not len(a["addr"]):
        return []
    cta = cta_of(result, a["thread"])
    order = np.argsort(cta, kind="stable")
    cta_sorted = cta[order]
    firsts = np.flatnonzero(np.r_[True, cta_sorted[1:] != cta_sorted[:-1]])  # first access of each CTA
    hits: list = []
    start = 0
    while start < len(order) and len(hits) < 10:
        # whole CTAs, up to the batch size (a CTA larger than it is a batch of its own)
        k = np.searchsorted(firsts, start + RACE_BATCH_ACCESSES, side="right") - 1
        stop = int(firsts[k]) if firsts[k] > start else int(firsts[k + 1]) if k + 1 < len(firsts) else len(order)
        sel = order[start:stop]
        hits += _races_in(a["addr"][sel], a["width"][sel], cta[sel], a["epoch"][sel], a["thread"][sel],
                          a["write"][sel])
        start = stop
    return hits[:10]


def _races_in(addr, width, cta, epoch, thread, write) -> list:
    """:func:`intra_cta_races` of the accesses given (flat arrays, whole CTAs)."""
    bytes_, owner = _byte_ranges(addr, width)
    cta, epoch, thread, wr = cta[owner], epoch[owner], thread[owner], write[owner]
    b = bytes_.astype(np.int64)
    order = np.lexsort((thread, b, epoch, cta))
    cta, epoch, b, thread, wr = cta[order], epoch[order], b[order], thread[order], wr[order]
    new_run = np.ones(len(b), bool)
    new_run[1:] = (cta[1:] != cta[:-1]) | (epoch[1:] != epoch[:-1]) | (b[1:] != b[:-1])
    starts = np.flatnonzero(new_run)
    any_write = np.logical_or.reduceat(wr, starts)
    changes = np.zeros(len(b), np.int64)
    changes[1:] = (thread[1:] != thread[:-1]) & ~new_run[1:]
    distinct = 1 + np.add.reduceat(changes, starts)
    hits = starts[any_write & (distinct > 1)][:10]
    ends = np.append(starts[1:], len(b))
    end_of = dict(zip(starts.tolist(), ends.tolist()))
    return [(int(b[s]), int(cta[s]), sorted(set(thread[s:end_of[int(s)]].tolist()))[:4]) for s in hits]


def race_count(result: RunResult) -> int:
    """The races of a run recorded with shared memory: between CTAs (global memory) and between the
    threads of a CTA (global and shared memory), each list's first 10 at most."""
    return len(cta_races(result)) + len(intra_cta_races(result)) + len(intra_cta_races(result, shared=True))
