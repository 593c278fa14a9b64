"""Parse PTX text (as the DSL's NVVM backend emits it) into entries and decoded instructions.

The parser understands the subset of PTX the project's kernels are made of, and says so
when it meets anything else (:class:`~ptx_executor.errors.PTXSyntaxError` naming the
line): module directives, ``.entry`` functions with their ``.param`` list and launch-bound
directives, ``.reg`` / ``.shared`` / ``.local`` declarations (module- or function-level,
including the DSL's ``.extern .shared`` dynamic shared-memory symbol), labels, nested
``{ }`` scopes (inline-asm blocks, whose registers are renamed so they cannot collide with
the enclosing ones) and instructions with an optional ``@p`` / ``@!p`` guard.

Operands are decoded once here into the forms of :mod:`.ir` (``Reg``, ``Imm``, ``Sym``,
``Mem``, ``Vec``, ``Pair``, ``Special``); the executor compiles each ``Instruction`` into a
closure over its operands.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Optional

from .errors import PTXSyntaxError
from .ir import Entry, Imm, Instruction, Mem, Module, Operand, Pair, Param, Reg, Special, Sym, Variable, Vec

# ------------------------------------------------------------------------------ lexing

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_INT = re.compile(r"^-?(0[xX][0-9a-fA-F]+|0[bB][01]+|0[0-7]*|[1-9][0-9]*)U?$")
_FLOAT_HEX = re.compile(r"^0([fFdD])([0-9a-fA-F]+)$")
_FLOAT_DEC = re.compile(r"^-?[0-9]+\.[0-9]*([eE][-+]?[0-9]+)?$|^-?[0-9]+[eE][-+]?[0-9]+$")
_SPECIAL = re.compile(r"^%(tid|ntid|ctaid|nctaid|clusterid|nclusterid|cluster_ctaid|cluster_nctaid)\.[xyz]$|"
                      r"^%(laneid|warpid|nwarpid|smid|nsmid|"
                      r"lanemask_(eq|le|lt|ge|gt)|clock|clock64|globaltimer|dynamic_smem_size|"
                      r"total_smem_size|cluster_ctarank|cluster_nctarank|is_explicit_cluster)$")
_REG_DECL = re.compile(r"^\.reg\s+(\.v[24]\s+)?(\.\w+)\s+(.+)$")
_RANGE = re.compile(r"^(%[A-Za-z_$][\w$]*)<(\d+)>$")
_VAR_DECL = re.compile(r"^(\.extern\s+|\.visible\s+)?\.(shared|local)\s+(.*?)\s*([A-Za-z_$%][\w$]*)\s*(\[\s*(\d*)\s*\])?$")
_ALIGN = re.compile(r"\.align\s+(\d+)")
_TYPE_SIZE = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
              "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8,
              "f16x2": 4, "bf16x2": 4}


def type_size(ptx_type: str) -> int:
    t = ptx_type.lstrip(".")
    if t not in _TYPE_SIZE:
        raise PTXSyntaxError(f"unknown PTX type .{t}")
    return _TYPE_SIZE[t]


_LINE_DIRECTIVES = (".version", ".target", ".address_size")


def _statements(text: str):
    """Yield ``(kind, line, text)``: kind is 'stmt', 'label', '{' or '}'.

    A ``{`` opens a scope when it starts a statement or follows a directive (an ``.entry``
    header); inside an instruction it opens a vector operand.
    """
    # blank out comments but keep newlines so line numbers stay right
    text = _COMMENT.sub(lambda m: "".join(c if c == "\n" else " " for c in m.group(0)), text)
    line, buf, buf_line = 1, [], 0
    depth_paren = depth_vec = 0
    for c in text:
        pending = "".join(buf).strip()
        if c == "\n":
            if pending.startswith(_LINE_DIRECTIVES):  # these end at the line's end, not at ';'
                yield ("stmt", buf_line, pending)
                buf = []
            else:
                buf.append(" ")
            line += 1
            continue
        if c == "(":
            depth_paren += 1
        elif c == ")":
            depth_paren -= 1
        elif c == "{" and depth_paren == 0:
            if not pending or pending.startswith("."):
                if pending:
                    yield ("stmt", buf_line, pending)
                buf = []
                yield ("{", line, c)
                continue
            depth_vec += 1
        elif c == "}" and depth_paren == 0:
            if depth_vec == 0:
                if pending:
                    raise PTXSyntaxError(f"line {buf_line}: statement without ';' before '}}': {pending[:80]!r}")
                buf = []
                yield ("}", line, c)
                continue
            depth_vec -= 1
        elif c == ";" and depth_paren == 0 and depth_vec == 0:
            if pending:
                yield ("stmt", buf_line, pending)
            buf = []
            continue
        elif c == ":" and depth_paren == 0 and re.fullmatch(r"[A-Za-z_$][\w$]*", pending):
            yield ("label", buf_line, pending)
            buf = []
            continue
        if not pending and not c.isspace():
            buf_line = line
        buf.append(c)
    if "".join(buf).strip():
        raise PTXSyntaxError(f"line {buf_line}: unterminated statement {''.join(buf).strip()[:80]!r}")


# ------------------------------------------------------------------------------ parsing


class _Scopes:
    """Register declarations, innermost scope last; nested names get a unique suffix."""

    def __init__(self):
        self.stack: list[tuple[dict, dict, str]] = []  # (explicit names, ranges, suffix)
        self.types: dict = {}
        self.counter = 0

    def push(self):
        suffix = "" if not self.stack else f"@{self.counter}"
        self.counter += 1
        self.stack.append(({}, {}, suffix))

    def pop(self):
        self.stack.pop()

    def declare(self, name: str, ptx_type: str, line: int):
        names, ranges, suffix = self.stack[-1]
        m = _RANGE.match(name)
        if m:
            ranges[m.group(1)] = (int(m.group(2)), ptx_type)
        else:
            names[name] = ptx_type
            self.types[name + suffix] = ptx_type

    def declared(self, name: str) -> bool:
        """Whether ``name`` is an explicitly declared register of an open scope (inline asm declares
        registers without a ``%``, e.g. ``.reg .pred P1;``)."""
        return any(name in names for names, _, _ in self.stack)

    def resolve(self, name: str, line: int) -> str:
        for names, ranges, suffix in reversed(self.stack):
            if name in names:
                return name + suffix
            m = re.match(r"^(%[A-Za-z_$]*?[A-Za-z_$])(\d+)$", name)
            if m and m.group(1) in ranges and int(m.group(2)) < ranges[m.group(1)][0]:
                self.types.setdefault(name + suffix, ranges[m.group(1)][1])
                return name + suffix
        raise PTXSyntaxError(f"line {line}: register {name} is not declared")


def _split_operands(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for c in s:
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _int_literal(tok: str) -> int:
    t = tok.rstrip("U")
    neg = t.startswith("-")
    t = t.lstrip("-")
    if t[:2] in ("0x", "0X"):
        v = int(t[2:], 16)
    elif t[:2] in ("0b", "0B"):
        v = int(t[2:], 2)
    elif len(t) > 1 and t.startswith("0"):
        v = int(t, 8)
    else:
        v = int(t)
    return -v if neg else v


def _operand(tok: str, scopes: _Scopes, line: int) -> Operand:
    tok = tok.strip()
    if tok.startswith("{"):
        items = tuple(None if x == "_" else _operand(x, scopes, line) for x in _split_operands(tok[1:-1]))
        return Vec(items)
    if tok.startswith("["):
        inner = tok[1:-1].strip()
        m = re.match(r"^([^+\-]+?)\s*(?:\+\s*(-?\s*\w+)|-\s*(\w+))?$", inner)
        if not m:
            raise PTXSyntaxError(f"line {line}: cannot parse address {tok!r}")
        base_s = m.group(1).strip()
        off = 0
        if m.group(2):
            off = _int_literal(m.group(2).replace(" ", ""))
        elif m.group(3):
            off = -_int_literal(m.group(3))
        if _INT.match(base_s):
            return Mem(None, _int_literal(base_s) + off)
        base = Reg(scopes.resolve(base_s, line)) if base_s.startswith("%") or scopes.declared(base_s) \
            else Sym(base_s)
        return Mem(base, off)
    if "|" in tok:
        a, b = tok.split("|")
        return Pair(Reg(scopes.resolve(a.strip(), line)), Reg(scopes.resolve(b.strip(), line)))
    if _SPECIAL.match(tok):
        return Special(tok)
    if tok.startswith("%") or scopes.declared(tok):
        return Reg(scopes.resolve(tok, line))
    m = _FLOAT_HEX.match(tok)
    if m:
        width = 32 if m.group(1) in "fF" else 64
        return Imm(0.0, bits=int(m.group(2), 16), bits_width=width)
    if _INT.match(tok):
        return Imm(_int_literal(tok))
    if _FLOAT_DEC.match(tok):
        return Imm(float(tok))
    if re.match(r"^[A-Za-z_$][\w$]*$", tok):
        return Sym(tok)
    raise PTXSyntaxError(f"line {line}: cannot parse operand {tok!r}")


def _instruction(line: int, text: str, scopes: _Scopes) -> Instruction:
    norm = " ".join(text.split())
    guard = None
    m = re.match(r"^@(!?)(%?[A-Za-z_$][\w$]*)\s+(.*)$", norm)
    rest = norm
    if m:
        guard = (Reg(scopes.resolve(m.group(2), line)), m.group(1) == "!")
        rest = m.group(3)
    parts = rest.split(None, 1)
    opcode = parts[0]
    operands = tuple(_operand(t, scopes, line) for t in _split_operands(parts[1])) if len(parts) > 1 else ()
    return Instruction(line, norm, guard, opcode, operands)


def _variable(text: str, line: int) -> Variable:
    m = _VAR_DECL.match(" ".join(text.split()))
    if not m:
        raise PTXSyntaxError(f"line {line}: cannot parse declaration {text!r}")
    attrs, name = m.group(3), m.group(4)
    align_m = _ALIGN.search(attrs)
    elem = re.findall(r"\.(b8|u8|s8|b16|u16|s16|f16|b32|u32|s32|f32|b64|u64|s64|f64)\b", attrs)
    esize = type_size(elem[-1]) if elem else 1
    align = int(align_m.group(1)) if align_m else esize
    if m.group(5) is None:
        size: Optional[int] = esize
    elif m.group(6):
        size = int(m.group(6)) * esize
    else:
        size = None  # extern, sized at launch
    return Variable(name, m.group(2), align, size)


def _param(text: str, line: int) -> Param:
    s = " ".join(text.split())
    m = re.match(r"^\.param\s+(.*?)\s*([A-Za-z_$][\w$]*)\s*(\[\s*(\d+)\s*\])?$", s)
    if not m:
        raise PTXSyntaxError(f"line {line}: cannot parse parameter {text!r}")
    attrs, name = m.group(1), m.group(2)
    align_m = _ALIGN.search(attrs)
    types = re.findall(r"\.(b8|u8|s8|b16|u16|s16|f16|b32|u32|s32|f32|b64|u64|s64|f64)\b", attrs)
    if not types:
        raise PTXSyntaxError(f"line {line}: parameter {name} has no type")
    esize = type_size(types[0])
    count = int(m.group(4)) if m.group(4) else 1
    align = int(align_m.group(1)) if align_m else esize
    return Param(name, esize * count, align, None if m.group(3) else "." + types[0])


def _dims(text: str) -> tuple:
    vals = [int(v) for v in re.findall(r"\d+", text)]
    return tuple(vals + [1] * (3 - len(vals)))


def parse_module(text: str) -> Module:
    """Parse a whole PTX module (see the module docstring for what is understood)."""
    mod = Module(version="", target="", address_size=64)
    stmts = list(_statements(text))
    i = 0
    while i < len(stmts):
        kind, line, s = stmts[i]
        if kind != "stmt":
            raise PTXSyntaxError(f"line {line}: unexpected {s!r} at module level")
        head = s.split(None, 1)
        if head[0] == ".version":
            mod.version = head[1]
        elif head[0] == ".target":
            mod.target = head[1]
        elif head[0] == ".address_size":
            mod.address_size = int(head[1])
        elif re.match(r"^(\.extern\s+|\.visible\s+)?\.shared\b", s):
            mod.variables.append(_variable(s, line))
        elif re.match(r"^(\.visible\s+|\.weak\s+)?\.entry\b", s):
            i = _parse_entry(stmts, i, mod)
            continue
        elif re.match(r"^(\.visible\s+|\.weak\s+|\.extern\s+)?\.func\b", s):
            raise PTXSyntaxError(f"line {line}: device functions (.func) are not supported: {s[:80]!r}")
        else:
            raise PTXSyntaxError(f"line {line}: unsupported module-level statement {s[:80]!r}")
        i += 1
    return mod


def _scope_labels(stmts: list, i: int) -> list:
    """The labels defined directly in each ``{ }`` scope of the body starting at ``stmts[i]``,
    scopes numbered in order of their opening."""
    out, stack = [], []
    while i < len(stmts):
        kind, _, s = stmts[i]
        i += 1
        if kind == "{":
            stack.append(len(out))
            out.append(set())
        elif kind == "}":
            stack.pop()
            if not stack:
                break
        elif kind == "label":
            out[stack[-1]].add(s)
    return out


def _label_name(name: str, open_scopes: list, labels_in: list) -> str:
    """A label's entry-wide name: labels of nested scopes (inline-asm blocks, which the DSL repeats
    with the same names) are local to their scope, so they get the scope's number."""
    for sid in reversed(open_scopes[1:]):
        if name in labels_in[sid]:
            return f"{name}@{sid}"
    return name


def _parse_entry(stmts: list, i: int, mod: Module) -> int:
    kind, line, header = stmts[i]
    m = re.match(r"^(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$][\w$]*)\s*\((.*)\)\s*(.*)$", header, re.S)
    if not m:
        raise PTXSyntaxError(f"line {line}: cannot parse .entry header")
    name = m.group(1)
    params = [_param(p, line) for p in _split_operands(m.group(2))] if m.group(2).strip() else []
    entry = Entry(name, params, [], {}, {}, [])
    for directive, value in re.findall(r"\.(reqntid|maxntid)\s+([\d\s,]+)", m.group(3)):
        setattr(entry, directive, _dims(value))
    i += 1
    if i >= len(stmts) or stmts[i][0] != "{":
        raise PTXSyntaxError(f"line {line}: .entry {name} has no body")
    scopes = _Scopes()
    labels_in = _scope_labels(stmts, i)
    depth = 0
    open_scopes: list = []  # ids of the open { } scopes, numbered in order of their opening
    opened = 0
    while i < len(stmts):
        kind, line, s = stmts[i]
        i += 1
        if kind == "{":
            depth += 1
            scopes.push()
            open_scopes.append(opened)
            opened += 1
        elif kind == "}":
            depth -= 1
            scopes.pop()
            open_scopes.pop()
            if depth == 0:
                break
        elif kind == "label":
            entry.labels[_label_name(s, open_scopes, labels_in)] = len(entry.instructions)
        elif s.startswith(".reg"):
            rm = _REG_DECL.match(" ".join(s.split()))
            if not rm or rm.group(1):
                raise PTXSyntaxError(f"line {line}: unsupported register declaration {s!r}")
            for nm in _split_operands(rm.group(3)):
                scopes.declare(nm.strip(), rm.group(2), line)
        elif re.match(r"^\.(shared|local)\b", s):
            entry.variables.append(_variable(s, line))
        elif s.startswith((".pragma", ".loc", ".file")):
            pass
        elif s.startswith("."):
            raise PTXSyntaxError(f"line {line}: unsupported directive in a function body {s[:80]!r}")
        else:
            ins = _instruction(line, s, scopes)
            if ins.base == "bra" and ins.operands and isinstance(ins.operands[0], Sym):
                target = Sym(_label_name(ins.operands[0].name, open_scopes, labels_in))
                ins = replace(ins, operands=(target,) + ins.operands[1:])
            entry.instructions.append(ins)
    if depth != 0:
        raise PTXSyntaxError(f".entry {name}: unbalanced braces")
    entry.reg_types = dict(scopes.types)
    mod.entries[name] = entry
    return i
