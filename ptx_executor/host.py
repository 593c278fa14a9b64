"""What the compiled host launcher says about a launch, read from its printed IR (the
``ir_module`` of a CuteDSL compile): the kernel parameter structs' types and the launch
configuration's constants (block size, dynamic shared memory). No cutlass import: the IR is
text here.
"""

from __future__ import annotations

import re

from .errors import PTXError
from .params import LType, parse_llvm_type

__all__ = ["host_signature", "launch_config"]


def host_signature(ir_text: str, function_name: str) -> list[LType]:
    """Argument types of the compiled host launcher ``function_name`` in the printed IR."""
    m = re.search(r"llvm\.func @" + re.escape(function_name) + r"\((.*?)\) -> ", ir_text)
    if not m:
        raise PTXError(f"host function {function_name} not found in the compiled module")
    args, depth, cur = [], 0, []
    for c in m.group(1):
        depth += c in "<("
        depth -= c in ">)"
        if c == "," and depth == 0:
            args.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    args.append("".join(cur))
    return [parse_llvm_type(a.split(":", 1)[1].strip()) for a in args if a.strip()]


# the launch configuration struct the DSL lowers to: (grid[3], block[3], sharedMem, stream, attrs, numAttrs)
_LAUNCH_CONFIG_TYPE = "struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def launch_config(ir_text: str) -> dict:
    """Constants stored into launch configurations: {'smem': [..], 'block': [(x,y,z)..]}.

    Each host launch stores into a ``(grid, block, sharedMem, ...)`` struct; this reads the
    constant ``sharedMem`` (field 2) and block dims (field 1) from the printed host IR,
    function by function (SSA names are per function). Values that are not compile-time
    constants are skipped.
    """
    smem, blocks = [], []
    const_re = re.compile(r"^\s*(%[\w.]+) = llvm\.mlir\.constant\((-?\d+) : i\d+\)")
    gep_re = re.compile(r"^\s*(%[\w.]+) = llvm\.getelementptr (%[\w.]+)\[([0-9, ]+)\]")
    store_re = re.compile(r"^\s*llvm\.store (%[\w.]+), (%[\w.]+) :")
    constants: dict = {}
    gep: dict = {}
    block_dims: dict = {}

    def flush():
        for dims in block_dims.values():
            if len(dims) == 3:
                blocks.append((dims[0], dims[1], dims[2]))

    for line in ir_text.splitlines():
        if line.lstrip().startswith("llvm.func "):
            flush()
            constants, gep, block_dims = {}, {}, {}
            continue
        m = const_re.match(line)
        if m:
            constants[m.group(1)] = int(m.group(2))
            continue
        if _LAUNCH_CONFIG_TYPE in line:
            m = gep_re.match(line)
            if m:
                gep[m.group(1)] = (m.group(2), tuple(int(x) for x in m.group(3).split(",")))
            continue
        m = store_re.match(line)
        if m and m.group(2) in gep and m.group(1) in constants:
            base, idx = gep[m.group(2)]
            value = constants[m.group(1)]
            if idx == (0, 2):
                smem.append(value)
            elif len(idx) == 3 and idx[:2] == (0, 1):
                block_dims.setdefault(base, {})[idx[2]] = value
    flush()
    return {"smem": smem, "block": blocks}
