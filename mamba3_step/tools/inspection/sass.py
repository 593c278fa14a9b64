"""SASS: disassembling a cubin with ``nvdisasm`` and classifying its instructions.

``nvdisasm`` comes from the pip package ``nvidia-cuda-nvdisasm`` (located through the package's
file list), else from ``PATH``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from importlib import metadata

from .elf import InspectError

__all__ = ["MEMORY_OPS", "SassInstr", "count_sass", "disassemble", "find_nvdisasm", "listing_arch",
           "parse_sass", "sass_for_kernel", "sass_histogram"]


def find_nvdisasm() -> str | None:
    """Path of ``nvdisasm``: the pip package ``nvidia-cuda-nvdisasm`` first, then PATH."""
    try:
        files = metadata.files("nvidia-cuda-nvdisasm") or []
        for f in files:
            if f.name == "nvdisasm":
                path = str(f.locate())
                if os.path.isfile(path) and os.access(path, os.X_OK):
                    return path
    except Exception:  # package not installed
        pass
    return shutil.which("nvdisasm")


def disassemble(elf: bytes, nvdisasm: str | None = None) -> str:
    """SASS text of a cubin (``nvdisasm -c``). Raises InspectError without nvdisasm."""
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise InspectError(
            "nvdisasm not found: pip install nvidia-cuda-nvdisasm (the 'bench'/'test' extra)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(elf)
        proc = subprocess.run([tool, "-c", path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise InspectError(f"nvdisasm failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
    return proc.stdout


#: memory opcodes whose histogram keys carry the access width and predication
MEMORY_OPS = ("LDG", "STG", "LDGSTS", "LDS", "STS", "LDL", "STL", "LD", "ST",
              "LDSM", "ATOMG", "ATOMS", "ATOM", "RED", "REDG")
_WIDTH_TOKENS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "32": 32, "64": 64, "128": 128}
_INSTR_RE = re.compile(
    r"^\s*/\*[0-9a-fA-F]+\*/\s+(?P<guard>@!?U?P[0-9T]+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)"
)


@dataclass(frozen=True)
class SassInstr:
    opcode: str  # base opcode, e.g. "STG"
    modifiers: tuple  # e.g. ("E", "128")
    predicated: bool  # guarded by a predicate other than PT
    width: int | None  # access width in bits for memory opcodes, else None


def parse_sass(sass_text: str) -> list[SassInstr]:
    """Every instruction of an ``nvdisasm`` listing, in order (NOPs included)."""
    out = []
    for line in sass_text.splitlines():
        m = _INSTR_RE.match(line)
        if not m:
            continue
        parts = m.group("op").rstrip(".").split(".")
        base, mods = parts[0], tuple(parts[1:])
        guard = (m.group("guard") or "").strip()
        predicated = bool(guard) and guard not in ("@PT", "@UPT")
        width = None
        if base in MEMORY_OPS:
            width = 32
            for tok in mods:
                if tok in _WIDTH_TOKENS:
                    width = _WIDTH_TOKENS[tok]
        out.append(SassInstr(base, mods, predicated, width))
    return out


def sass_histogram(sass_text: str) -> dict[str, int]:
    """Instruction counts of an ``nvdisasm`` listing (static counts, not executed counts).

    Keys:

    * memory opcodes (:data:`MEMORY_OPS`): ``"<OP>.<bits>"`` for unpredicated and
      ``"@P <OP>.<bits>"`` for predicated instructions, e.g. ``"LDG.128"`` for
      ``LDG.E.128``, ``"@P STG.128"`` for ``@!P0 STG.E.128``, ``"LDG.32"`` for ``LDG.E``,
      ``"LDGSTS.128"`` for ``LDGSTS.E.BYPASS.LTC128B.128``, ``"STG.16"`` for ``STG.E.U16``;
    * every other opcode by its base name (``"SHFL"``, ``"FFMA"``, ``"BAR"``, ``"EXIT"``),
      predicated or not;
    * ``"NOP"``: alignment padding, not part of ``"total"``;
    * ``"total"``: all instructions except NOPs.

    ``@PT`` (always true) does not count as a predicate.
    """
    hist: Counter = Counter()
    for ins in parse_sass(sass_text):
        if ins.opcode == "NOP":
            hist["NOP"] += 1
            continue
        if ins.width is not None:
            key = f"{ins.opcode}.{ins.width}"
            if ins.predicated:
                key = "@P " + key
        else:
            key = ins.opcode
        hist[key] += 1
        hist["total"] += 1
    hist.setdefault("total", 0)
    return dict(sorted(hist.items()))


def count_sass(hist: dict, op: str, width: int | None = None, predicated: bool | None = None) -> int:
    """Sum of histogram counts for opcode ``op`` (e.g. "STG"), optionally one width (bits)
    and/or only predicated (True) / unpredicated (False) instructions."""
    total = 0
    for key, n in hist.items():
        pred = key.startswith("@P ")
        k = key[3:] if pred else key
        kop, _, kwidth = k.partition(".")
        if kop != op:
            continue
        if width is not None and kwidth != str(width):
            continue
        if predicated is not None and pred != predicated:
            continue
        total += n
    return total


def listing_arch(listing: str) -> str | None:
    """The target of an nvdisasm listing: ``.target sm_90a``, or for the DSL's older ELF
    format the header flags ``EF_CUDA_SM90`` (+ ``EF_CUDA_ACCELERATORS`` for the "a")."""
    m = re.search(r"^\s*\.target\s+(sm_\w+)", listing, re.M)
    if m:
        return m.group(1)
    m = re.search(r"^\s*\.headerflags\s+(.*)$", listing, re.M)
    if m:
        sm = re.search(r"EF_CUDA_SM(\d+)", m.group(1))
        if sm:
            return f"sm_{sm.group(1)}" + ("a" if "EF_CUDA_ACCELERATORS" in m.group(1) else "")
    return None


def sass_for_kernel(sass_text: str, kernel: str) -> str:
    """The part of a multi-kernel listing that belongs to ``.text.<kernel>``."""
    marker = re.compile(r"^\s*\.section\s+\.text\.(\S+?),", re.M)
    spans = [(m.start(), m.group(1)) for m in marker.finditer(sass_text)]
    if len(spans) <= 1:
        return sass_text
    for i, (start, name) in enumerate(spans):
        if name == kernel:
            end = spans[i + 1][0] if i + 1 < len(spans) else len(sass_text)
            return sass_text[start:end]
    return sass_text
