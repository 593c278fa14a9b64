"""Launching the compiled step on a CUDA device: the layer above the compile cache.

:func:`launch_step` looks the kernel up through the compile cache (in-process dict, then disk,
then a compile) and calls it with :func:`~mamba3_step.tensors.kernel_arguments`: on the caller's
current CUDA stream, no allocation, no synchronisation, so the step can be captured in a CUDA
graph. This module does not import cutlass: a cache hit never loads the DSL.
"""

from __future__ import annotations

from . import compile_cache
from .arch import device_arch
from .spec import StepSpec
from .tensors import StepTensors, kernel_arguments

__all__ = ["device_arch", "get_step_kernel", "launch_step"]


def get_step_kernel(spec: StepSpec, arch: str):
    """The compiled kernel for (spec, arch): :func:`mamba3_step.compile_cache.get_compiled`."""
    return compile_cache.get_compiled(spec, arch)


def launch_step(spec: StepSpec, tensors: StepTensors) -> None:
    """Launch the step on the current CUDA stream: no allocation, no synchronisation.

    ``tensors`` are validated by :func:`mamba3_step.validation.check_step_inputs` (whose result
    is ``spec``) with ``out`` allocated; ``B == 0`` must not reach here.
    """
    fn = get_step_kernel(spec, device_arch(tensors.x.device))
    fn(*kernel_arguments(spec, tensors))
