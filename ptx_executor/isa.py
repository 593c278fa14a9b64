"""The instruction table: every supported opcode's compiler, and how an instruction is decoded.

An opcode family registers a *compiler* with :func:`handler`: it receives the decoded
:class:`~ptx_executor.parse.Instruction` and the launch :class:`Context`, and returns a
closure ``fn(frame, idx)`` that executes the instruction for the threads ``idx`` (guard
already applied; see :mod:`ptx_executor.frame`). Compilers reject modifiers they do not
implement with :class:`~ptx_executor.errors.UnsupportedInstruction`, so a kernel using
one fails before it runs, never computes something else silently.

The families live in :mod:`.isa_alu` (integer, float, conversion, comparison), :mod:`.isa_mem`
(ld/st/cvta), :mod:`.isa_async` (``cp.async`` and its groups), :mod:`.isa_bulk` (bulk copies,
``fence``), :mod:`.isa_mbar` (mbarriers, ``elect.sync``, ``mapa``) and :mod:`.isa_warp`
(shfl/vote/activemask). Control flow and barriers (``bra``, ``ret``/``exit``, ``bar.sync``)
are the scheduler's (:mod:`.machine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import UnsupportedInstruction
from .frame import VIEW
from .ir import Entry, Instruction

HANDLERS: dict[str, Callable] = {}

#: modifiers that only steer caches, ordering or scope: no effect on a sequential executor
IGNORED_MODS = frozenset({
    "ca", "cg", "cs", "lu", "cv", "wb", "wt", "nc", "volatile", "relaxed", "weak", "acquire", "release",
    "cta", "gpu", "sys", "cluster", "aligned", "sync", "uni",
    "L1::evict_normal", "L1::evict_unchanged", "L1::evict_first", "L1::evict_last", "L1::no_allocate",
    "L2::evict_normal", "L2::evict_first", "L2::evict_last", "L2::64B", "L2::128B", "L2::256B",
})

#: control-flow and barrier opcodes the scheduler implements itself
CONTROL = frozenset({"bra", "ret", "exit", "bar", "barrier"})


@dataclass
class Context:
    """What compilers may need beyond the instruction: the entry and its launch parameters."""
    entry: Entry
    params: dict  # parameter name -> bytes


def handler(*bases: str):
    def register(fn):
        for b in bases:
            HANDLERS[b] = fn
        return fn
    return register


def unsupported(ins: Instruction, why: str = "") -> UnsupportedInstruction:
    extra = f" ({why})" if why else ""
    return UnsupportedInstruction(f"PTX line {ins.line}: unsupported instruction `{ins.opcode}`{extra}: {ins.text}")


def compile_instruction(ins: Instruction, ctx: Context):
    """The closure for ``ins``; raises UnsupportedInstruction naming the opcode."""
    fn = HANDLERS.get(ins.base)
    if fn is None:
        raise unsupported(ins, "no such opcode in the executor")
    return fn(ins, ctx)


def type_of(ins: Instruction) -> str:
    """The instruction's data type: its last modifier (``add.rn.f32`` -> ``f32``)."""
    return ins.mods[-1] if ins.mods else ""


def check_mods(ins: Instruction, allowed: set) -> set:
    """The instruction's modifiers minus ignorable ones; raises on one not in ``allowed``."""
    mods = set(ins.mods) - IGNORED_MODS
    bad = mods - allowed
    if bad:
        raise unsupported(ins, f"modifier(s) {sorted('.' + m for m in bad)} not implemented")
    return mods


# ------------------------------------------------------------------ shared by the families

def bit_width(t: str) -> int:
    return np.dtype(VIEW[t]).itemsize * 8


def unsigned_of(t: str):
    return {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[bit_width(t)]


def unary_op(ins, t, fn):
    d, a = ins.operands

    def run(F, idx):
        F.write(d, fn(F.read(a, VIEW[t], idx)), VIEW[t], idx)
    return run


def binary_op(ins, t, fn, out_t=None):
    d, a, b = ins.operands[:3]
    out = VIEW[out_t or t]

    def run(F, idx):
        F.write(d, fn(F.read(a, VIEW[t], idx), F.read(b, VIEW[t], idx)), out, idx)
    return run


def ternary_op(ins, t, fn, out_t=None):
    d, a, b, c = ins.operands
    out = VIEW[out_t or t]

    def run(F, idx):
        F.write(d, fn(F.read(a, VIEW[t], idx), F.read(b, VIEW[t], idx), F.read(c, VIEW[t], idx)), out, idx)
    return run
