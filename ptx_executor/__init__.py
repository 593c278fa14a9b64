"""Execute a kernel's PTX on the CPU: the project's PTX execution tier.

No GPU is needed: the PTX text the DSL hands to ``ptxas`` is parsed
(:mod:`.parse`), each instruction compiled to a numpy closure (:mod:`.isa` and its
families), and the whole grid run SIMT-style, vectorised over threads and CTAs
(:mod:`.machine`), against CPU tensors registered as global memory (:mod:`.memory`),
with PTX's rounding rules (:mod:`.numerics`). Every global access is bounds-, alignment-
and writability-checked and logged; :mod:`.analysis` turns the log and the issue counts
into executed facts (instruction mix, sectors per request, bank conflicts, bytes, races).

What this proves, and what it does not, is in ``docs/ptx-tier.md``: the semantics of the
PTX the compiler emitted, executed; not ``ptxas``'s translation to SASS, not the GPU's
memory model between CTAs, not timing.

Public API::

    module = parse_module(ptx_text)
    memory = GlobalMemory(); memory.add("x", x_tensor, writable=False); ...
    result = run(module, grid=(gx, gy, gz), block=(bx, 1, 1), params=[b"...", ...],
                 memory=memory, dynamic_smem=nbytes)
"""

from __future__ import annotations

from .errors import (AsyncCopyError, BarrierError, BulkCopyError, ExecutionFault, MemoryFault, PTXError,
                     PTXSyntaxError, UnsupportedInstruction, WarpSyncError)
from .machine import Machine, Program, RunResult
from .memory import GlobalMemory
from .host import host_signature, launch_config
from .params import LType, pack, parse_llvm_type
from .ir import Module
from .parse import parse_module

__all__ = [
    "AsyncCopyError", "BarrierError", "BulkCopyError", "ExecutionFault", "GlobalMemory", "LType", "Machine",
    "MemoryFault", "Module",
    "PTXError", "PTXSyntaxError", "Program", "RunResult", "UnsupportedInstruction", "WarpSyncError", "host_signature",
    "launch_config", "pack",
    "parse_llvm_type", "parse_module", "run",
]


def run(module: Module | str, *, grid: tuple, block: tuple, params: list, memory: GlobalMemory,
        entry: str | None = None, dynamic_smem: int = 0, record: bool = True,
        record_shared: bool = False, async_copies: str = "modelled", cluster: tuple | None = None) -> RunResult:
    """Execute one launch of ``entry`` (the module's only entry by default).

    Args:
        module: parsed module or PTX text.
        grid, block: launch dimensions (up to 3 each).
        params: one ``bytes`` per ``.param`` of the entry, in order, each exactly the
            declared size (:func:`pack` builds structs).
        memory: the global regions the kernel may touch.
        dynamic_smem: bytes of dynamic shared memory.
        record: log every global access (needed by :mod:`.analysis`).
        record_shared: log shared accesses too (bank-conflict analysis).
        async_copies: ``"modelled"`` (default): a ``cp.async`` lands in shared memory at the
            ``cp.async.wait_group``/``wait_all`` that completes it, and touching its bytes
            before that raises :class:`AsyncCopyError`; ``"immediate"``: every copy lands
            when it is issued (no pending state, no findings); the same for bulk copies
            (``cp.async.bulk``), whose mbarrier phases and tx-counts run in both modes.
        cluster: CTAs per thread-block cluster ``(cx, cy, cz)``, dividing the grid (default: none,
            each CTA alone); ``barrier.cluster`` runs over them (:mod:`.isa_cluster`).
    """
    if isinstance(module, str):
        module = parse_module(module)
    e = module.entry(entry)
    if len(params) != len(e.params):
        raise PTXError(f".entry {e.name} takes {len(e.params)} parameters, got {len(params)}")
    by_name = {}
    for p, value in zip(e.params, params):
        if len(value) != p.size:
            raise PTXError(f"parameter {p.name}: the PTX declares {p.size} bytes, got {len(value)}")
        by_name[p.name] = bytes(value)
    program = Program(module, e, by_name)
    machine = Machine(program, memory, by_name, dynamic_smem=dynamic_smem, record=record,
                      record_shared=record_shared, async_copies=async_copies)
    return machine.run(grid, block, cluster)
