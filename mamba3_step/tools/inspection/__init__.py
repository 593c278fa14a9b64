"""What the compiler made of a step kernel, read from the cubin; no GPU needed.

(Named ``inspection`` rather than ``inspect``, which would shadow the standard library's module.)

Library API (the compile tests and ``bench/static_bench.py`` use it):

* :func:`kernel_facts` -- ``compiled`` (the ``cute.compile`` result, e.g. from
  :func:`mamba3_step.kernel.compile_step_kernel`) -> :class:`KernelFacts`: registers per
  thread, stack frame, spill bytes, shared memory per CTA, threads per CTA, a SASS
  histogram and the raw SASS text.
* :func:`cubins_from_compiled` -- the ELF cubin(s) embedded in ``compiled.ir_module``.
* :func:`sass_histogram` / :func:`count_sass` -- classify SASS text into instruction counts,
  global/shared/local memory accesses split by width and by predication.
* :func:`theoretical_occupancy` -- CTAs and warps per SM from registers, threads and
  shared memory, for the architectures in :data:`ARCH_LIMITS`.

Layers: ``elf`` (fatbin, ELF, ``.nv.info``, launch constants) and ``sass`` (nvdisasm,
histogram) read; ``occupancy`` computes; ``facts`` combines them into :class:`KernelFacts`;
``report`` is the ``inspect`` subcommand (compile, report, bytes per step).
"""

from ...arch import sm_number
from .elf import InspectError, cubins_from_compiled, cubins_from_fatbin, elf_facts
from .facts import KernelFacts, kernel_facts
from .occupancy import ARCH_LIMITS, theoretical_occupancy
from .report import format_report, inspect_spec
from .sass import MEMORY_OPS, count_sass, disassemble, find_nvdisasm, parse_sass, sass_histogram

__all__ = [
    "ARCH_LIMITS", "InspectError", "KernelFacts", "MEMORY_OPS", "count_sass", "cubins_from_compiled",
    "cubins_from_fatbin", "disassemble", "elf_facts", "find_nvdisasm", "format_report", "inspect_spec",
    "kernel_facts", "parse_sass", "sass_histogram", "sm_number", "theoretical_occupancy",
]
