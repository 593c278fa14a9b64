"""Target architectures: naming, checking, and the one rule from a GPU to its ``sm_`` name.

The launcher (the device a tensor is on) and the compile cache (this machine's GPU, or
:data:`DEFAULT_ARCH` without one) both use :func:`arch_from_capability`, so a precompiled entry
is the one a launch asks for.
"""

from __future__ import annotations

import re

import torch

__all__ = ["DEFAULT_ARCH", "SUPPORTED_ARCHS", "arch_from_capability", "check_arch", "current_arch", "device_arch",
           "sm_number"]

#: the architecture used when no GPU is visible (the flagship serving target, H100/H200)
DEFAULT_ARCH = "sm_90a"

#: every target the CuteDSL compiler knows (the names of ``cutlass.base_dsl.enums.Arch``; kept here
#: by hand so that checking a name needs no cutlass import, and compared with the DSL's list by a
#: test). Whether the kernel compiles for one is the compiler's answer.
SUPPORTED_ARCHS = (
    "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a",
    "sm_100", "sm_100a", "sm_100f", "sm_101", "sm_101a", "sm_101f", "sm_103", "sm_103a", "sm_103f",
    "sm_107", "sm_107a", "sm_107f", "sm_110", "sm_110a", "sm_110f",
    "sm_120", "sm_120a", "sm_120f", "sm_121", "sm_121a", "sm_121f",
)

_ARCH_RE = re.compile(r"^sm_([0-9]{2,3})[af]?$")


def _check_format(arch) -> str:
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected a string such as 'sm_90a', got {type(arch).__name__}")
    if not _ARCH_RE.match(arch):
        raise ValueError(f"arch: expected 'sm_' + compute capability digits (+ optional a/f), e.g. "
                         f"'sm_90a' or 'sm_100a', got {arch!r}")
    return arch


def check_arch(arch) -> str:
    """``arch`` if it names a target the compiler knows (:data:`SUPPORTED_ARCHS`), such as
    ``"sm_90a"``; TypeError/ValueError naming it otherwise (the list is in the message)."""
    _check_format(arch)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: expected one of {', '.join(SUPPORTED_ARCHS)} (the targets the CuteDSL "
                         f"compiler knows), got {arch!r}")
    return arch


def sm_number(arch: str) -> int:
    """``"sm_90a"`` -> 90 for any well-formed name, known or not (TypeError/ValueError otherwise)."""
    return int(_ARCH_RE.match(_check_format(arch)).group(1))


def arch_from_capability(major: int, minor: int) -> str:
    """``sm_XY`` for a CUDA compute capability, ``a``-suffixed for sm_90 / sm_100 / sm_103."""
    arch = f"sm_{int(major)}{int(minor)}"
    return arch + "a" if int(major) in (9, 10) else arch


def device_arch(device) -> str:
    """The target of a CUDA device (what a launch on it needs)."""
    return arch_from_capability(*torch.cuda.get_device_capability(device))


def current_arch(device=None) -> str:
    """The architecture to compile for on this machine: the CUDA device's (``device``, default
    the current one) when a GPU is visible, else :data:`DEFAULT_ARCH` (``sm_90a``)."""
    try:
        if not torch.cuda.is_available():
            return DEFAULT_ARCH
        major, minor = torch.cuda.get_device_capability(device)
    except Exception:  # no CUDA runtime at all
        return DEFAULT_ARCH
    return arch_from_capability(major, minor)
