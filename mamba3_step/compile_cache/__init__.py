"""Compile-once kernel cache: an in-process dict in front of a persistent, ahead-of-time disk cache.

Letters (docs/contract.md): B batch lanes, P pool rows, H heads, D head dim, N state size
(dstate), R MIMO rank.

``cute.compile`` keeps no disk cache, so without this package every process would pay every
compile again (seconds per specialisation: docs/compile-cache.md). Here a kernel is compiled once per
:class:`~mamba3_step.spec.StepSpec` and target architecture, exported with the DSL's
``export_to_c``, linked into a shared library and stored in a cache directory; a later process
loads it with ``tvm_ffi.load_module`` in milliseconds, without importing cutlass.
docs/compile-cache.md has the whole story.

Public API
----------
* :func:`get_compiled` ``(spec, arch=None) -> callable``: in-memory hit, else disk load, else
  compile + export + store. ``B``, ``P``, ``H`` and strides are not part of the spec, so they
  never cause a compile. :func:`obtain` also says how and how long.
* :func:`compile_for` ``(*mamba3_step_fn args, arch=None, **kwargs)``: derive the spec from a
  call's tensors (CPU, CUDA or meta tensors: only metadata is read) and return the kernel
  without launching it.
* :data:`COUNTERS` / :func:`stats`: process-wide counts of ``compiles``, ``disk_loads``,
  ``memory_hits``, ``disk_writes`` and ``rebuilds`` (corrupt, truncated or stale entries).
* :func:`precompile`, :func:`reset_memory_cache`, :func:`set_builder`, :func:`current_arch`,
  :func:`cache_dir`, :func:`entry_path`, :func:`entry_key`.

The returned callable is always a positional-only ``tvm_ffi.Function``: it takes the 19
runtime arguments of :func:`mamba3_step.tensors.kernel_arguments` and launches on the caller's
current CUDA stream.

The one ordering hazard: the source fingerprint and the package versions in the disk key are
read once per process (per builder). Editing the kernel's sources in a running process does
not change its keys: restart (or ``set_builder`` a new builder) to see the edit.

Layers (each a module; none imports a layer above it):

=================  ===============================================================
``key``            the disk key (fingerprint, versions, env) and an entry's path
``counters``       the process-wide counts
``store``          the on-disk entries: trust checks, verified load, atomic publish, locks
``front``          the in-memory dict, the builder, fallbacks; ``obtain``, ``precompile``
``cli``            the ``precompile`` subcommand
=================  ===============================================================
"""

from ..arch import DEFAULT_ARCH, arch_from_capability, current_arch
from ..build import KernelBuilder
from ..specsets import spec_label, specs_for_config
from .counters import COUNTERS, CompileCounters
from .front import (CompileCacheWarning, compile_for, entry_key, entry_path, get_builder, get_compiled, obtain,
                    precompile, reset_memory_cache, set_builder, stats)
from .key import CACHE_FORMAT, ENV_CACHE_DIR, cache_dir

__all__ = [
    "CACHE_FORMAT", "COUNTERS", "CompileCacheWarning", "CompileCounters", "DEFAULT_ARCH", "ENV_CACHE_DIR",
    "KernelBuilder", "arch_from_capability", "cache_dir", "compile_for", "current_arch", "entry_key",
    "entry_path", "get_builder", "get_compiled", "obtain", "precompile", "reset_memory_cache", "set_builder",
    "spec_label", "specs_for_config", "stats",
]
