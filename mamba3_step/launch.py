"""Launching the compiled step on a CUDA device: the layer above the compile cache.

:func:`launch_step` looks the kernel up through the compile cache (in-process dict, then disk,
then a compile) and calls it with :func:`~mamba3_step.tensors.kernel_arguments`: on the caller's
current CUDA stream, no allocation, no synchronisation, so the step can be captured in a CUDA
graph. This module does not import cutlass: a cache hit never loads the DSL.

A device's target architecture is asked of the CUDA runtime once per device index
(:func:`arch_of`) and remembered: a device's compute capability does not change while a
process runs, and asking costs microseconds per call.
"""

from __future__ import annotations

import torch

from . import compile_cache
from .arch import device_arch
from .spec import StepSpec
from .tensors import StepTensors, kernel_arguments

__all__ = ["arch_of", "device_arch", "get_step_kernel", "kernel_for", "launch_step"]

#: device index (``Tensor.get_device()``) -> target architecture, filled by :func:`arch_of`
_ARCH_BY_INDEX: dict = {}


def get_step_kernel(spec: StepSpec, arch: str):
    """The compiled kernel for (spec, arch): :func:`mamba3_step.compile_cache.get_compiled`."""
    return compile_cache.get_compiled(spec, arch)


def arch_of(x: torch.Tensor) -> str:
    """The target architecture of the device ``x`` is on (:func:`mamba3_step.arch.device_arch`),
    asked once per device index and remembered."""
    index = x.get_device()
    arch = _ARCH_BY_INDEX.get(index)
    if arch is None:
        arch = _ARCH_BY_INDEX.setdefault(index, device_arch(x.device))
    return arch


def kernel_for(spec: StepSpec, x: torch.Tensor):
    """The compiled kernel of ``spec`` for the device ``x`` is on: a callable taking
    :func:`~mamba3_step.tensors.kernel_arguments`, launching on the current CUDA stream."""
    return get_step_kernel(spec, arch_of(x))


def launch_step(spec: StepSpec, tensors: StepTensors) -> None:
    """Launch the step on the current CUDA stream: no allocation, no synchronisation.

    ``tensors`` are validated by :func:`mamba3_step.validation.check_step_inputs` (whose result
    is ``spec``) with ``out`` allocated; ``B == 0`` must not reach here.
    """
    x = tensors.x
    arch = _ARCH_BY_INDEX.get(x.get_device()) or arch_of(x)  # arch_of, without a call on the hot path
    compile_cache.get_compiled(spec, arch)(*kernel_arguments(tensors))
