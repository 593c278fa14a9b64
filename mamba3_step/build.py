"""How the step kernel is built, as the compile cache needs to know it, without importing cutlass.

The cache compiles through a :class:`KernelBuilder`: a name, a compile function and the source
files whose bytes define the compiled code. :func:`default_builder` is the project's kernel:
its sources are computed, never listed by hand: the kernel package ``mamba3_step/kernel/`` (its
``__init__`` imports every part) and every package module it imports, transitively
(:func:`kernel_sources`), so a new helper module the kernel imports changes the disk cache's key
by itself.

:func:`compile_kernel` is the only place that imports :mod:`mamba3_step.kernel` (and with it
cutlass, about 0.6 s): lazily, on the first compile. A disk-cache hit, the CPU path and
``import mamba3_step`` never import the DSL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .sources import PACKAGE, PACKAGE_ROOT, closure
from .spec import StepSpec

__all__ = ["KERNEL_MODULE", "KernelBuilder", "argument_masks", "compile_kernel", "default_builder", "kernel_sources"]

#: the module that defines the compiled code; the root of the fingerprinted sources
KERNEL_MODULE = f"{PACKAGE}.kernel"


@dataclass(frozen=True)
class KernelBuilder:
    """What the cache compiles with (injectable, so tests can substitute a small kernel).

    Attributes:
        name: short identifier; part of the disk key.
        compile: ``(spec, arch) -> compiled``; ``compiled`` is a CuteDSL tvm-ffi
            ``JitCompiledFunction`` with ``export_to_c`` when ``exportable``.
        sources: absolute paths of the source files that define the compiled code; their
            bytes are hashed into the disk key.
        exportable: False keeps this builder's kernels in memory only.
    """

    name: str
    compile: Callable[[StepSpec, str], Any]
    sources: tuple = ()
    exportable: bool = True


def kernel_sources(root=PACKAGE_ROOT) -> tuple[str, ...]:
    """The kernel package's files and those of every package module they import, transitively.

    ``root`` is the package directory to read (default: this package).
    """
    return tuple(str(p) for p in closure(KERNEL_MODULE, root))


def compile_kernel(spec: StepSpec, arch: str, *, extra_options: str = ""):
    """:func:`mamba3_step.kernel.compile_step_kernel`, importing the kernel module on first use."""
    from . import kernel  # the one lazy import: cutlass only when something is compiled

    return kernel.compile_step_kernel(spec, arch, extra_options=extra_options)


def argument_masks(spec: StepSpec):
    """:func:`mamba3_step.kernel.argument_masks`: the compile-time signature's dynamic modes per
    runtime argument, as a :class:`~mamba3_step.tensors.KernelArgs` (what the PTX execution tier
    packs into parameter structs)."""
    from . import kernel  # the one lazy import (see compile_kernel)

    return kernel.argument_masks(spec)


def default_builder() -> KernelBuilder:
    """The project's step kernel, with its computed sources."""
    return KernelBuilder(name=PACKAGE, compile=compile_kernel, sources=kernel_sources())
