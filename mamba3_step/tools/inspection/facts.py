"""``kernel_facts``: what the compiler made of one kernel (registers, stack, spills, shared memory,
threads, SASS), read from what the DSL produced; nothing guessed.

* ``spill_store_bytes`` / ``spill_load_bytes``: the widths of the local-memory stores
  (``STL``) and loads (``LDL``) in the SASS, summed over the instructions. Spills are the
  only local-memory traffic a kernel without local arrays has, so these equal ptxas's
  "bytes spill stores / loads"; ``spill_bytes`` is their sum (0 means no spill at all).
* ``smem_static_bytes``: the size of ``.nv.shared.<kernel>``, less the 1 KiB that sm_90
  and later place at its start for the system (ptxas 13 includes it in the section, and
  excludes it from the "bytes smem" it prints). The DSL's dynamic shared memory symbol is
  1024-byte aligned, so a kernel with static data pads it to that alignment.
* ``smem_dynamic_bytes``: the constant stored into the ``sharedMem`` field of the launch
  configuration in the host code of ``ir_module`` (0 when the launch requests none).
* ``threads``: ``EIATTR_REQNTID`` (0x10, the ``.reqntid`` the DSL emits from the constant
  block size), else ``EIATTR_MAX_THREADS`` (0x05), else the constant block size stored
  into the launch configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...arch import sm_number
from ptx_executor.host import launch_config
from .elf import InspectError, cubins_from_compiled, cubins_from_fatbin, elf_facts
from .occupancy import theoretical_occupancy
from .sass import count_sass, disassemble, listing_arch, parse_sass, sass_for_kernel, sass_histogram

__all__ = ["KernelFacts", "SM90_SHARED_RESERVED_IN_SECTION", "kernel_facts"]

#: bytes at the start of ``.nv.shared.<kernel>`` reserved for the system on sm_90 and later
SM90_SHARED_RESERVED_IN_SECTION = 1024


@dataclass
class KernelFacts:
    """What the compiler made of one kernel.

    Attributes:
        name: the kernel's entry symbol.
        arch: the target the SASS was generated for, e.g. ``"sm_90a"``.
        registers: registers per thread (EIATTR_REGCOUNT).
        stack_bytes: stack frame per thread in bytes (EIATTR_FRAME_SIZE).
        spill_store_bytes / spill_load_bytes: bytes of local-memory stores/loads in the
            SASS (static sum of access widths; what ptxas reports as spill stores/loads).
        spill_bytes: ``spill_store_bytes + spill_load_bytes``.
        smem_static_bytes / smem_dynamic_bytes / smem_bytes: shared memory per CTA
            (static, requested at launch, total).
        threads: threads per CTA (None when neither the ELF nor the launch tells).
        sass: :func:`sass_histogram` of the kernel's SASS.
        code_bytes: size of the kernel's code section.
        sass_text: the ``nvdisasm`` listing (omitted from :meth:`as_dict`).
    """

    name: str
    arch: str
    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    spill_bytes: int
    smem_static_bytes: int
    smem_dynamic_bytes: int
    smem_bytes: int
    threads: int | None
    code_bytes: int
    sass: dict = field(default_factory=dict)
    sass_text: str = field(default="", repr=False)

    def count(self, op: str, width: int | None = None, predicated: bool | None = None) -> int:
        """:func:`count_sass` on this kernel's histogram."""
        return count_sass(self.sass, op, width, predicated)

    def occupancy(self, arch: str | None = None) -> dict | None:
        """:func:`theoretical_occupancy` on ``arch`` (default: the compiled target)."""
        if self.threads is None:
            return None
        return theoretical_occupancy(self.registers, self.threads, self.smem_bytes, arch or self.arch)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("sass_text")
        return d


def kernel_facts(compiled, kernel: str | None = None, nvdisasm: str | None = None) -> KernelFacts:
    """Read registers, stack, spills, shared memory, threads and SASS of a compiled kernel.

    Args:
        compiled: a ``cute.compile`` result (``JitCompiledFunction``) with ``.ir_module``;
            or the bytes of a cubin / fatbin.
        kernel: which entry function when the cubin holds several (default: the only one;
            InspectError if there are several and none is named).
        nvdisasm: path of nvdisasm (default: :func:`find_nvdisasm`).

    Needs no GPU. Raises InspectError when the object holds no readable cubin or nvdisasm
    is missing.
    """
    if isinstance(compiled, (bytes, bytearray)):
        cubins = cubins_from_fatbin(bytes(compiled))
        launch = {"smem": [], "block": []}
    else:
        cubins = cubins_from_compiled(compiled)
        launch = launch_config(str(compiled.ir_module))
    found = []
    for elf in cubins:
        for facts in elf_facts(elf):
            found.append((elf, facts))
    if not found:
        raise InspectError("the cubin contains no kernel")
    if kernel is None:
        if len(found) > 1:
            names = [f["name"] for _, f in found]
            raise InspectError(f"several kernels in the cubin, name one of {names}")
        elf, facts = found[0]
    else:
        matches = [(e, f) for e, f in found if f["name"] == kernel]
        if not matches:
            raise ValueError(f"kernel must be one of {[f['name'] for _, f in found]}, got {kernel!r}")
        elf, facts = matches[0]
    if facts["registers"] is None:
        raise InspectError(f"no register count (EIATTR_REGCOUNT) for {facts['name']}")

    listing = disassemble(elf, nvdisasm)
    arch = listing_arch(listing) or f"sm_{facts['sm']}"
    sass_text = sass_for_kernel(listing, facts["name"])
    instrs = parse_sass(sass_text)
    spill_st = sum(i.width // 8 for i in instrs if i.opcode == "STL")
    spill_ld = sum(i.width // 8 for i in instrs if i.opcode == "LDL")

    section = facts["shared_section_bytes"]
    reserved = SM90_SHARED_RESERVED_IN_SECTION if sm_number(arch) >= 90 else 0
    smem_static = max(0, section - reserved)
    # one kernel per module: every constant launch of it requests the same amount
    smem_dynamic = max(launch["smem"]) if launch["smem"] else 0

    threads = None
    for dims in (facts["reqntid"], facts["max_threads"]):
        if dims:
            threads = dims[0] * dims[1] * dims[2]
            break
    if threads is None and len(set(launch["block"])) == 1:
        x, y, z = launch["block"][0]
        threads = x * y * z

    return KernelFacts(
        name=facts["name"],
        arch=arch,
        registers=facts["registers"],
        stack_bytes=facts["stack_bytes"],
        spill_store_bytes=spill_st,
        spill_load_bytes=spill_ld,
        spill_bytes=spill_st + spill_ld,
        smem_static_bytes=smem_static,
        smem_dynamic_bytes=smem_dynamic,
        smem_bytes=smem_static + smem_dynamic,
        threads=threads,
        code_bytes=facts["code_bytes"],
        sass=sass_histogram(sass_text),
        sass_text=sass_text,
    )
