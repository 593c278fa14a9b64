"""The decoded form of a PTX module: operands, instructions, entries (what :mod:`.parse` builds
and the executor compiles)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from .errors import PTXSyntaxError

# --------------------------------------------------------------------------------- operands


@dataclass(frozen=True)
class Reg:
    """A register, by its unique (scope-resolved) name."""
    name: str


@dataclass(frozen=True)
class Special:
    """A special register such as ``%tid.x`` or ``%laneid``."""
    name: str


@dataclass(frozen=True)
class Imm:
    """An immediate. ``value`` is an int, or for float literals the float itself; ``bits``
    is set for hex float literals (``0f...`` 32-bit, ``0d...`` 64-bit)."""
    value: Union[int, float]
    bits: Optional[int] = None
    bits_width: int = 0


@dataclass(frozen=True)
class Sym:
    """A symbol: a label, a ``.param`` name or a shared/local variable."""
    name: str


@dataclass(frozen=True)
class Mem:
    """A memory operand ``[base+offset]``; ``base`` is a Reg, a Sym or None (absolute)."""
    base: Union[Reg, Sym, None]
    offset: int


@dataclass(frozen=True)
class Vec:
    """A vector operand ``{a, b, ...}``; an item is None for the sink ``_``."""
    items: tuple


@dataclass(frozen=True)
class Pair:
    """A two-destination operand ``p|q`` (setp, shfl.sync)."""
    first: Reg
    second: Reg


Operand = Union[Reg, Special, Imm, Sym, Mem, Vec, Pair]

# ---------------------------------------------------------------------------- structures


@dataclass(frozen=True)
class Instruction:
    line: int  # 1-based line of the statement in the PTX text
    text: str  # the statement, whitespace-normalised
    guard: Optional[tuple]  # (Reg, negated) or None
    opcode: str  # e.g. "fma.rn.f32"
    operands: tuple

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def mods(self) -> tuple:
        return tuple(self.opcode.split(".")[1:])


@dataclass(frozen=True)
class Param:
    name: str
    size: int  # bytes
    align: int
    scalar_type: Optional[str]  # ".u32" etc. for scalar params, None for byte arrays


@dataclass(frozen=True)
class Variable:
    """A ``.shared`` / ``.local`` variable; ``size`` None for the extern (dynamic) array."""
    name: str
    space: str
    align: int
    size: Optional[int]


@dataclass
class Entry:
    name: str
    params: list
    instructions: list
    labels: dict  # label -> instruction index
    reg_types: dict  # unique register name -> PTX type (".b32", ".pred", ...)
    variables: list  # function-level .shared/.local variables
    reqntid: Optional[tuple] = None
    maxntid: Optional[tuple] = None


@dataclass
class Module:
    version: str
    target: str
    address_size: int
    entries: dict = field(default_factory=dict)
    variables: list = field(default_factory=list)  # module-level .shared variables

    def entry(self, name: Optional[str] = None) -> Entry:
        if name is None:
            if len(self.entries) != 1:
                raise PTXSyntaxError(f"expected exactly one .entry, found {sorted(self.entries)}; name one")
            return next(iter(self.entries.values()))
        if name not in self.entries:
            raise PTXSyntaxError(f"no .entry named {name!r} (entries: {sorted(self.entries)})")
        return self.entries[name]
