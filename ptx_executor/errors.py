"""Errors of the PTX execution tier.

Every error raised while a kernel executes names where it happened: the PTX line and its
text, and for per-thread faults the CTA, thread and address. :class:`PTXError` is the base
class; tests and ``verify`` catch it to report a failed specialisation.
"""

from __future__ import annotations


class PTXError(RuntimeError):
    """Base class: a PTX module that cannot be parsed or executed as written."""


class PTXSyntaxError(PTXError):
    """The text is not PTX this parser understands (names the line)."""


class UnsupportedInstruction(PTXError):
    """An opcode (or an opcode modifier) the executor does not implement.

    Never skipped silently: executing a kernel that contains one fails before the first
    instruction runs, naming the opcode and its line.
    """


class ExecutionFault(PTXError):
    """A runtime fault of the executed code: bad memory access, barrier or shuffle misuse.

    Attributes:
        line: 1-based PTX line of the faulting instruction.
        instruction: its text.
        cta: ``(x, y, z)`` block index of the first faulting thread, or None.
        thread: ``(x, y, z)`` thread index of the first faulting thread, or None.
        address: the faulting address, when the fault is a memory access.
    """

    def __init__(self, message: str, *, line: int = 0, instruction: str = "", cta=None, thread=None,
                 address: int | None = None):
        where = f"PTX line {line}: `{instruction}`" if line else ""
        who = ""
        if cta is not None:
            who = f" in CTA {tuple(cta)}, thread {tuple(thread)}"
        addr = f" at address {address:#x}" if address is not None else ""
        super().__init__(f"{where}{who}{addr}: {message}" if where else message)
        self.line = line
        self.instruction = instruction
        self.cta = cta
        self.thread = thread
        self.address = address


class MemoryFault(ExecutionFault):
    """A global or shared access outside every allocation, or misaligned for its width."""


class BarrierError(ExecutionFault):
    """A ``bar.sync`` that part of a CTA never reaches, or reached divergently inside a warp."""


class WarpSyncError(ExecutionFault):
    """A ``shfl.sync``/``vote.sync`` whose member mask names lanes not executing it."""


class AsyncCopyError(ExecutionFault):
    """A misuse of ``cp.async`` the asynchronous-copy model exposes: shared bytes read or written
    while a copy is still filling them, a global store to the source of a copy in flight, or a
    thread exiting with copies in flight (:mod:`ptx_executor.isa_async`)."""


class BulkCopyError(AsyncCopyError):
    """A misuse of bulk copies (``cp.async.bulk``) or mbarriers the asynchronous model exposes: shared
    bytes read or written before the bulk copy filling them completed, a bulk store's shared source
    written while it is still read, a bulk store of bytes written without ``fence.proxy.async``, an
    mbarrier used uninitialised or re-initialised mid-phase, or a thread exiting with bulk stores in
    flight (:mod:`ptx_executor.isa_bulk`, :mod:`ptx_executor.isa_mbar`)."""
