"""The table of rules for the step's tensor arguments: one row per argument.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.

A row says the argument's shape in letters, the dtypes it may have (a group of the contract, or
"the same as" another argument), whether it is required, and whether the kernel moves it with
16-byte vectors (then its base and outer strides must be 16-byte aligned). ``S`` in a shape is
the rows letter of the pool tensors: ``P`` in pool mode, ``B`` in dense mode. A letter in
brackets is an axis only some calls have (:class:`Layout` says which): ``[R]`` without
``outproj``; ``[T]`` when the call has a token axis (``x`` (B, T, H, D): T tokens per lane);
``[K]`` with ``num_accepted_tokens`` (``state_batch_indices`` (B, K): K candidate source rows);
``[Tdst]`` when ``dst_state_batch_indices`` has a row per token (resolved to ``T``). ``A`` is
the number of rotary angles (docs/contract.md's ``S``: the letter ``S`` is taken here), ``Hbc``
the head axis of ``B``/``C``: ``H``, or 1 when the heads share them. The order
of the rows is the order of the checks (the letter sources ``x`` and ``B`` first), so which of
several problems is reported first is decided here.

A row also says when the step writes the argument (``written``): ``out`` and ``state_out``
always, ``state`` unless ``state_out`` takes the new state, ``Bstate``/``Xstate`` with
``update_kv_state``. Every other argument is only read. A written tensor must be writable in
place and may share no memory with any other argument (docs/contract.md, "Written tensors and
aliasing").

A new tensor argument is one row here (and one field of ``StepTensors``).
"""

from __future__ import annotations

from typing import NamedTuple

from ..contract import ANGLE_DTYPES, KV_DTYPES, PROJ_DTYPES, STATE_DTYPES, X_DTYPES

__all__ = ["Layout", "RULES", "RULE_BY_NAME", "Rule", "LETTER_SOURCES", "WRITE_ALWAYS", "WRITE_KV", "WRITE_UNLESS_STATE_OUT",
           "is_written", "shape_letters"]

#: values of ``Rule.written``: when the step writes the argument
WRITE_ALWAYS = "always"
WRITE_UNLESS_STATE_OUT = "unless state_out"
WRITE_KV = "update_kv_state"


class Rule(NamedTuple):
    name: str
    letters: str  # shape letters, e.g. "S R H N"
    dtypes: tuple = ()  # the allowed dtype names (a group, or exactly one)
    same_as: str = ""  # ... or: the dtype of this other argument
    required: bool = False
    vector_aligned: bool = False
    hint: str = ""  # appended to a single-dtype message, e.g. how to convert
    written: str = ""  # when the step writes it (WRITE_*); "" = only read


RULES = (
    Rule("x", "B [T] H D", X_DTYPES, required=True),
    Rule("B", "B [T] R Hbc N", KV_DTYPES, required=True),
    Rule("state", "S H D N", STATE_DTYPES, required=True, vector_aligned=True, written=WRITE_UNLESS_STATE_OUT),
    Rule("state_out", "B H D N", same_as="state", vector_aligned=True, written=WRITE_ALWAYS),
    Rule("Bstate", "S R H N", same_as="B", required=True, written=WRITE_KV),
    Rule("Xstate", "S H D", same_as="x", required=True, written=WRITE_KV),
    Rule("A", "B [T] H", ("float32",), required=True),
    Rule("dt", "B [T] H", ("float32",), required=True),
    Rule("trap", "B [T] H", ("float32",), required=True),
    Rule("C", "B [T] R Hbc N", same_as="B", required=True),
    Rule("D", "H", ("float32",), required=True),
    Rule("xproj", "R H D", PROJ_DTYPES, required=True),
    Rule("zproj", "R H D", same_as="xproj"),
    Rule("outproj", "R H D", same_as="xproj"),
    Rule("z", "B [T] H D", same_as="x"),
    Rule("out", "B [T] [R] H D", same_as="x", written=WRITE_ALWAYS),
    Rule("state_batch_indices", "B [K]", ("int32",), hint=" (convert with .to(torch.int32))"),
    Rule("dst_state_batch_indices", "B [Tdst]", ("int32",), hint=" (convert with .to(torch.int32))"),
    Rule("num_accepted_tokens", "B", ("int32",), hint=" (convert with .to(torch.int32))"),
    Rule("angle_state", "S H A", ANGLE_DTYPES, written=WRITE_ALWAYS,
         hint=" (fixed-point turns: convert radians with mamba3_step.angle_from_radians)"),
    Rule("angle_proj", "B [T] H A", ("float32",)),
    Rule("B_bias", "R H N", ("float32",)),
    Rule("C_bias", "R H N", ("float32",)),
    Rule("rand_seed", "2", ("int64",), hint=" ([seed, offset])"),
    Rule("rand_rows", "B", ("int32",), hint=" (convert with .to(torch.int32))"),
    Rule("state_scale", "S H D", ("float32",), written=WRITE_UNLESS_STATE_OUT),
)

#: the arguments the letters are read from (their ranks are checked first): B, T, H, D from
#: ``x``; R, N from ``B`` (then P from ``state``, K from ``state_batch_indices``)
LETTER_SOURCES = ("x", "B")
#: the rules by argument name
RULE_BY_NAME = {rule.name: rule for rule in RULES}


class Layout(NamedTuple):
    """Which optional axes a call has (decided from ranks before any shape is compared)."""

    pool: bool  # state_batch_indices given: S is P
    has_outproj: bool  # out has no R axis
    tokens: bool = False  # x is (B, T, H, D): the per-lane tensors and out have a T axis
    per_token_dst: bool = False  # dst_state_batch_indices is (B, T)
    accepted: bool = False  # num_accepted_tokens given: state_batch_indices is (B, K)
    shared_bc: bool = False  # B and C have a head axis of 1: every head reads the same B/C


def shape_letters(rule: Rule, layout: Layout) -> str:
    """The rule's shape letters for this call: ``S`` resolved, each bracketed axis kept or dropped."""
    kept = {"[R]": not layout.has_outproj, "[T]": layout.tokens, "[K]": layout.accepted,
            "[Tdst]": layout.per_token_dst}
    letters = [c for c in rule.letters.split() if kept.get(c, True)]
    names = {"S": "P" if layout.pool else "B", "[R]": "R", "[T]": "T", "[K]": "K", "[Tdst]": "T",
             "Hbc": "1" if layout.shared_bc else "H", "A": "S"}
    return " ".join(names.get(c, c) for c in letters)


def is_written(rule: Rule, has_state_out: bool, update_kv_state: bool) -> bool:
    """Whether a call with these options writes the rule's argument."""
    if rule.written == WRITE_ALWAYS:
        return True
    if rule.written == WRITE_UNLESS_STATE_OUT:
        return not has_state_out
    if rule.written == WRITE_KV:
        return update_kv_state
    return False
