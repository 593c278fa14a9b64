"""Dependent global round trips read from a kernel's SASS (part 2 of :mod:`.latency_model`, static, no GPU).

Along the straight-line path of a live CTA (:func:`live_path`: conditional branches fall through, up to
the first unconditional ``EXIT``), each global load (``LDG``/``LDGSTS``) and the first instruction that
reads or overwrites its destination register (where the scoreboard makes the warp wait). A *round
trip* is the set of loads issued between two such waits (:func:`global_round_trips`).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

__all__ = ["GLOBAL_LOADS", "Instr", "LoadTrips", "global_round_trips", "issued_path", "live_path", "sass_instructions"]

_INSTR = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s+(?P<guard>@!?U?P[0-9T]+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)\s*"
                    r"(?P<args>[^;]*);")
_REG = re.compile(r"(?<![A-Za-z0-9_])(U?R)(\d+)(\.64)?\b")
_PRED = re.compile(r"(?<![A-Za-z0-9_])(U?P[0-6])\b")
_WIDTH = {"U8": 1, "S8": 1, "U16": 1, "S16": 1, "64": 2, "128": 4}
GLOBAL_LOADS = ("LDG", "LDGSTS")
_STORES = ("STG", "STS", "ST", "STL", "RED", "REDG")
_NO_DEST = _STORES + ("BAR", "BRA", "EXIT", "NOP", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "MEMBAR", "FENCE", "CCTL",
                      "ERRBAR", "YIELD", "BSSY", "BSYNC", "CALL", "RET", "LDGSTS", "ARRIVES", "SYNCS")
_PREDICATE_DEST = ("ISETP", "FSETP", "DSETP", "HSETP2", "PLOP3", "R2P", "UISETP", "UPLOP3")


@dataclass(frozen=True)
class Instr:
    line: int
    text: str
    base: str
    mods: tuple  # e.g. ("E", "128")
    guard: str  # "" or e.g. "@!P0"
    writes: frozenset  # registers written, by name ("R5", "UR4")
    reads: frozenset  # registers read
    pred_writes: frozenset  # predicates written ("P0", "UP1")
    pred_reads: frozenset


def _width(base: str, mods: list[str]) -> int:
    """Registers per data operand (1, 2 or 4): a memory access's width, or ``.64`` (``LDC.64``, ``MOV.64``)."""
    return next((_WIDTH[m] for m in mods if m in _WIDTH), 1)


def _regs(operand: str, span: int) -> set[str]:
    out = set()
    for m in _REG.finditer(operand):
        n = 2 if m.group(3) else span
        out.update(f"{m.group(1)}{k}" for k in range(int(m.group(2)), int(m.group(2)) + n))
    return out


def _is_predicate(operand: str) -> bool:
    bare = operand.lstrip("!")
    return bare in ("PT", "UPT") or bool(_PRED.fullmatch(bare))


def _parse(line_no: int, m) -> Instr:
    op, args = m.group("op"), m.group("args").strip()
    parts = op.rstrip(".").split(".")
    base, mods = parts[0], parts[1:]
    ops = [a.strip() for a in args.split(",")] if args else []
    width = _width(base, mods)
    dest_at = None if base in _NO_DEST or base in _PREDICATE_DEST else (1 if base == "SHFL" else 0)
    # predicates written: a compare's leading predicates, or those right after the destination (IADD3 R5, P0, ...)
    first = 0 if base in _PREDICATE_DEST else (None if dest_at is None else dest_at + 1)
    pred_dest = set()
    while first is not None and first < len(ops) and _is_predicate(ops[first]):
        pred_dest.add(first)
        first += 1
    writes, reads, pw, pr = set(), set(), set(), set()
    for i, operand in enumerate(ops):
        if _is_predicate(operand):
            (pw if i in pred_dest else pr).update(_PRED.findall(operand))
        elif i == dest_at:
            writes |= _regs(operand, 2 if "WIDE" in mods else width)
        else:
            last_wide = "WIDE" in mods and i == len(ops) - 1
            data = base in _STORES and "[" not in operand
            reads |= _regs(operand, 2 if last_wide else (width if data else 1))
    guard = (m.group("guard") or "").strip()
    pr.update(_PRED.findall(guard))
    return Instr(line_no, m.group(0).strip(), base, tuple(mods), guard, frozenset(writes), frozenset(reads),
                 frozenset(pw), frozenset(pr))


def sass_instructions(sass_text: str) -> list[Instr]:
    """Every instruction of an ``nvdisasm`` listing, with the registers it reads and writes."""
    out = []
    for i, line in enumerate(sass_text.splitlines()):
        m = _INSTR.match(line)
        if m:
            out.append(_parse(i, m))
    return out


def _conditional(ins: Instr) -> bool:
    return ins.base in ("BRA", "EXIT") and (ins.guard not in ("", "@PT", "@UPT") or bool(ins.pred_reads))


def live_path(sass_text: str) -> list[Instr]:
    """The straight-line path of a live CTA: from the top, conditional branches and exits fall
    through, up to and including the first unconditional ``EXIT``."""
    path = []
    for ins in sass_instructions(sass_text):
        path.append(ins)
        if ins.base == "EXIT" and not _conditional(ins):
            break
    return path


_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_TARGET = re.compile(r"\.(L_x_\d+)")


def _branch_targets(sass_text: str, instrs: list[Instr]) -> dict[int, int]:
    """Index in ``instrs`` of a ``BRA``'s target label's first instruction, for each ``BRA`` to a label."""
    lines = [ins.line for ins in instrs]
    first_after = {m.group(1): bisect.bisect_right(lines, i) for i, line in enumerate(sass_text.splitlines())
                   if (m := _LABEL.match(line))}
    return {k: first_after[m.group(1)] for k, ins in enumerate(instrs)
            if ins.base == "BRA" and (m := _TARGET.search(ins.text)) and m.group(1) in first_after}


def issued_path(sass_text: str) -> list[Instr]:
    """The instructions each warp of a live CTA issues for one (lane, head) slab, ``NOP`` aside.

    A kernel without a backward branch (one slab a CTA) issues :func:`live_path`. A persistent kernel
    (the slab pipeline) issues its slab loop once a slab: the backward branch whose body holds the most
    ``FFMA``, walked from its head to that branch with conditional branches falling through (a
    forward one skips a padding lane's or another warp's work; a backward one retries a wait that
    succeeds at once) and unconditional forward ones followed. Its prologue is not counted: a
    persistent CTA walks many slabs."""
    instrs = sass_instructions(sass_text)
    targets = _branch_targets(sass_text, instrs)
    loops = [(sum(ins.base == "FFMA" for ins in instrs[t:k]), t, k) for k, t in targets.items() if t <= k]
    loops = [loop for loop in loops if loop[0]]  # the self-branch after the last EXIT holds none
    if not loops:
        return [ins for ins in live_path(sass_text) if ins.base != "NOP"]
    _, k, back = max(loops)
    path = []
    while k != back:
        ins = instrs[k]
        path.append(ins)
        if k in targets and not _conditional(ins):
            if targets[k] <= k:
                raise ValueError(f"an unconditional backward branch inside the slab loop: {ins.text}")
            k = targets[k]
            continue
        if ins.base == "EXIT" and not _conditional(ins):
            raise ValueError(f"an unconditional EXIT inside the slab loop: {ins.text}")
        k += 1
    path.append(instrs[back])
    return [ins for ins in path if ins.base != "NOP"]


@dataclass
class LoadTrips:
    """The global loads of a live CTA's path, grouped into round trips (:func:`global_round_trips`).

    Attributes:
        trips: per round trip, in order: ``loads`` (count), ``bytes_per_thread`` (the loads' widths
            summed), ``by_width`` (bytes -> count) and ``waited_at`` (the instruction whose use of a
            loaded register closes the trip; None for a trip no instruction waits on).
        dependence_depth: the longest chain load -> address or branch predicate -> load.
        loads: every global load on the path as ``(line, text, trip number from 1, depth)``.
    """

    trips: list = field(default_factory=list)
    dependence_depth: int = 0
    loads: list = field(default_factory=list)

    @property
    def round_trips(self) -> int:
        return len(self.trips)

    def bytes_before_first_wait(self, threads: int) -> int:
        """Bytes a CTA of ``threads`` threads has in flight when it first waits (its largest trip
        after the index's: the state loads; the index's alone if it has one trip)."""
        return max(t["bytes_per_thread"] for t in self.trips[1:] or self.trips) * threads


_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def _load_bytes(ins: Instr) -> int:
    """Bytes one thread's load moves (4 unless a width modifier says otherwise)."""
    return next((_BYTES[m] for m in ins.mods if m in _BYTES), 4)


def global_round_trips(sass_text: str) -> LoadTrips:
    """Round trips and dependence depth of the global loads on :func:`live_path` of a listing.

    An ``LDGSTS`` (copy to shared memory) stays outstanding until the next ``DEPBAR``; any other
    load until an instruction reads or overwrites one of its destination registers."""
    out = LoadTrips()
    depth: dict = {}  # register ("R5", "P0") -> depth of the loads its value derives from
    control = 0  # depth of the predicates of the conditional branches passed so far
    pending: dict = {}  # register -> load number (or "LDGSTS" -> list) of the open trip
    current = {"loads": 0, "bytes_per_thread": 0, "by_width": {}, "waited_at": None}
    for ins in live_path(sass_text):
        touched = ins.reads | ins.writes
        waits = bool(touched & set(pending)) or (ins.base == "DEPBAR" and "LDGSTS" in pending)
        if waits and current["loads"]:
            current["waited_at"] = ins.text
            out.trips.append(current)
            current = {"loads": 0, "bytes_per_thread": 0, "by_width": {}, "waited_at": None}
            pending.clear()
        src = max([depth.get(r, 0) for r in ins.reads | ins.pred_reads] + [control])
        if _conditional(ins):
            control = src
        if ins.base in GLOBAL_LOADS:
            src += 1
            nbytes = _load_bytes(ins)
            current["loads"] += 1
            current["bytes_per_thread"] += nbytes
            current["by_width"][nbytes] = current["by_width"].get(nbytes, 0) + 1
            out.loads.append((ins.line, ins.text, len(out.trips) + 1, src))
            out.dependence_depth = max(out.dependence_depth, src)
            pending.update(dict.fromkeys(ins.writes, 1) if ins.base == "LDG" else {"LDGSTS": 1})
        for r in ins.writes | ins.pred_writes:
            depth[r] = src
    if current["loads"]:
        out.trips.append(current)
    return out
