"""The in-memory front of the compile cache: one dict lookup per hit, then the disk, then a compile.

Letters (docs/contract.md): B lanes, P pool rows, H heads (none of them is part of a key).

:func:`obtain` answers from the in-process dict keyed by ``(StepSpec, arch)``; on a miss it
tries the disk entry (:mod:`.store`), and failing that compiles with the current
:class:`~mamba3_step.build.KernelBuilder`, exports and publishes the entry. When the disk cannot
be used (unwritable directory, no linker, an export error) it compiles in memory for this
process and says why once (:class:`CompileCacheWarning`); so it does when the directory cannot
be trusted (:func:`store.tree_problem`: another user could have written it) or inspected.
Compiles are serialised by one process-wide lock, so a kernel is never compiled twice in one
process.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Optional

from ..arch import check_arch, current_arch
from ..build import KernelBuilder, default_builder
from ..spec import StepSpec, complete_spec
from ..specsets import spec_label
from ..tensors import StepTensors
from ..validation import check_step_inputs
from . import key as _key
from . import store
from .counters import COUNTERS

__all__ = ["CompileCacheWarning", "compile_for", "entry_key", "entry_path", "get_builder", "get_compiled",
           "obtain", "precompile", "reset_memory_cache", "set_builder", "stats"]

_MEMORY: dict = {}
_LOCK = threading.RLock()
_BUILDER: Optional[KernelBuilder] = None
_WARNED: set = set()


class CompileCacheWarning(RuntimeWarning):
    """The disk cache cannot be used in this process (issued once per cause)."""


def _warn_once(cause: str, message: str) -> None:
    if cause in _WARNED:
        return
    _WARNED.add(cause)
    warnings.warn(message, CompileCacheWarning, stacklevel=5)


def stats() -> dict:
    """The counters as a dict, plus ``memory_entries`` (kernels held by this process)."""
    d = COUNTERS.as_dict()
    d["memory_entries"] = len(_MEMORY)
    return d


def get_builder() -> KernelBuilder:
    global _BUILDER
    if _BUILDER is None:
        _BUILDER = default_builder()
    return _BUILDER


def set_builder(builder: Optional[KernelBuilder]) -> None:
    """Compile with ``builder`` from now on (None: the real kernel); clears the memory cache."""
    global _BUILDER
    if builder is not None and not isinstance(builder, KernelBuilder):
        raise TypeError(f"builder: expected a KernelBuilder or None, got {type(builder).__name__}")
    with _LOCK:
        _BUILDER = builder
        _MEMORY.clear()


def reset_memory_cache() -> None:
    """Forget the kernels held in this process (the disk cache and counters are kept)."""
    with _LOCK:
        _MEMORY.clear()


def entry_key(spec: StepSpec, arch: str, builder: Optional[KernelBuilder] = None) -> dict:
    """The full disk-cache key of (spec, arch): everything that can change the compiled code."""
    return _key.entry_key(spec, arch, builder or get_builder())


def entry_path(spec: StepSpec, arch: Optional[str] = None, root: Optional[Path] = None) -> Path:
    """Directory of the disk entry for (spec, arch) under ``root`` (default: the cache dir)."""
    spec = complete_spec(spec)
    arch = check_arch(arch or current_arch())
    root = Path(root) if root is not None else _key.cache_dir()
    return _key.entry_dir(root, spec, arch, entry_key(spec, arch))


def obtain(spec: StepSpec, arch: Optional[str] = None) -> tuple:
    """Like :func:`get_compiled` but returns ``(fn, how, seconds, entry)``.

    ``how`` is ``"memory"``, ``"loaded"``, ``"compiled"`` (and stored), ``"rebuilt"`` (a bad
    entry was replaced) or ``"compiled-in-memory"`` (disk cache unusable: see the warning);
    ``entry`` is the entry directory or None.
    """
    if arch is not None and isinstance(spec, StepSpec):  # hot path: one dict lookup
        fn = _MEMORY.get((spec, arch))
        if fn is not None:
            COUNTERS.memory_hits += 1
            return fn, "memory", 0.0, None
    spec = complete_spec(spec)
    arch = check_arch(arch if arch is not None else current_arch())
    with _LOCK:
        fn = _MEMORY.get((spec, arch))
        if fn is not None:
            COUNTERS.memory_hits += 1
            return fn, "memory", 0.0, None
        t0 = time.perf_counter()
        fn, how, entry = _obtain_uncached(spec, arch)
        _MEMORY[(spec, arch)] = fn
        return fn, how, time.perf_counter() - t0, entry


def _obtain_uncached(spec: StepSpec, arch: str):
    """Disk, else compile and publish; in memory only when the disk cannot be used."""
    builder = get_builder()

    def compile_now():
        t = time.perf_counter()
        compiled = builder.compile(spec, arch)
        COUNTERS.compiles += 1
        return compiled, time.perf_counter() - t

    if not builder.exportable:
        return store.memory_callable(compile_now()[0]), "compiled-in-memory", None
    key = _key.entry_key(spec, arch, builder)
    root = _key.cache_dir()
    entry = _key.entry_dir(root, spec, arch, key)
    if not _tree_usable(root, entry.parent):
        return store.memory_callable(compile_now()[0]), "compiled-in-memory", None
    fn, problem = store.try_load(entry, key)
    if fn is not None:
        COUNTERS.disk_loads += 1
        return fn, "loaded", entry
    linker, why_not = _disk_usable(entry, problem)
    if why_not is not None:
        return store.memory_callable(compile_now()[0]), "compiled-in-memory", None

    with store.entry_lock(entry.parent / f".{entry.name}.lock"):
        fn, problem2 = store.try_load(entry, key)  # another process may have filled it meanwhile
        if fn is not None:
            COUNTERS.disk_loads += 1
            return fn, "loaded", entry
        if problem2 is not None:
            COUNTERS.rebuilds += 1
            store.discard(entry)
        compiled, compile_s = compile_now()
        try:
            fn = store.store(compiled, entry, key, linker, compile_s)
        except Exception as e:
            _warn_once("store", f"mamba3_step: could not write kernel cache entry {entry} "
                       f"({type(e).__name__}: {str(e)[:300]}); using the in-memory compile.")
            return store.memory_callable(compiled), "compiled-in-memory", None
        return fn, ("rebuilt" if (problem2 or problem) else "compiled"), entry


def _tree_usable(root: Path, arch_dir: Path) -> bool:
    """Create the cache's directories (0700) and check that the tree can be trusted; warn once if not.

    Nothing is read from the disk cache, and nothing written to it, unless this returns True.
    """
    try:
        store.make_private_dirs(arch_dir)
    except OSError as e:
        _warn_unwritable(arch_dir, f"{type(e).__name__}: {e}")
        return False
    try:
        problem = store.tree_problem(root, arch_dir)
    except OSError as e:
        _warn_once("unreadable", f"mamba3_step: kernel cache directory {root} cannot be inspected "
                   f"({type(e).__name__}: {e}); compiling kernels in memory for this process only. Set "
                   f"{_key.ENV_CACHE_DIR} to a directory of your own.")
        return False
    if problem is not None:
        _warn_once("untrusted", f"mamba3_step: kernel cache directory {root} is not safe to load code from: "
                   f"{problem}. Compiling kernels in memory for this process only. The cache and every "
                   f"directory in it must be owned by you and not writable by group or others (chmod 700); "
                   f"each directory above it must be owned by you or root and not writable by group or "
                   f"others unless sticky (like /tmp). Set {_key.ENV_CACHE_DIR} to a private directory.")
        return False
    return True


def _warn_unwritable(directory: Path, why: str) -> None:
    _warn_once("unwritable", f"mamba3_step: kernel cache directory {directory} is not writable "
               f"({why}); compiling kernels in memory for this process only. Set "
               f"{_key.ENV_CACHE_DIR} to a writable directory to keep compiled kernels.")


def _disk_usable(entry: Path, problem: Optional[str]) -> tuple:
    """``(linker, None)`` when an entry can be written, else ``(None, why)`` (warned once)."""
    why_not = store.writable_dir(entry.parent)
    if why_not is not None:
        if problem is not None:
            COUNTERS.rebuilds += 1
        _warn_unwritable(entry.parent, why_not)
        return None, why_not
    linker = store.find_linker()
    if linker is None:
        _warn_once("linker", "mamba3_step: no C/C++ linker found ($CXX, c++, g++, clang++, $CC, cc, "
                   "gcc, clang) to turn exported kernels into shared libraries; compiling kernels in "
                   "memory for this process only. Install g++ (or set CXX) to enable the disk cache.")
        return None, "no linker"
    return linker, None


def get_compiled(spec: StepSpec, arch: Optional[str] = None):
    """The compiled step kernel for ``spec`` on ``arch``, without launching it.

    Args:
        spec: the static specialisation. ``tile_D``/``num_warps`` left at 0 are filled with the
            per-configuration default. ``B``, ``P``, ``H`` and strides are runtime values and
            not part of it: calls that differ only in those share one kernel.
        arch: target, e.g. ``"sm_90a"``; default ``current_arch()`` (``sm_90a`` without a GPU).

    Returns:
        A positional-only ``tvm_ffi.Function`` taking :func:`mamba3_step.tensors.kernel_arguments`
        (launches on the current CUDA stream). In order: the in-process dict, the disk cache
        (no compile, no cutlass import), else a compile that is exported to the disk cache.

    Raises:
        TypeError: ``spec`` is not a StepSpec or ``arch`` not a string.
        ValueError: unsupported N/D/R, dtype or tiling in ``spec``; a malformed ``arch``.
    """
    return obtain(spec, arch)[0]


_STEP_OPTIONS = ("update_kv_state", "tile_D", "num_warps")


def compile_for(*args, arch: Optional[str] = None, **kwargs):
    """The compiled kernel a ``mamba3_step_fn(*args, **kwargs)`` call would launch, not launched.

    Takes ``mamba3_step_fn``'s arguments (``validate_indices`` is accepted and ignored; ``out``
    may be omitted). Only metadata is read, so CPU or meta tensors work and nothing
    synchronises. ``arch`` defaults to the device of ``x`` when it is a CUDA tensor, else
    ``current_arch()``. Shapes: see ``mamba3_step_fn`` (state (P or B, H, D, N), x (B, H, D) ...).

    Raises:
        TypeError / ValueError: as :func:`mamba3_step.validation.check_step_inputs` for bad inputs.
    """
    kwargs.pop("validate_indices", None)
    options = {k: kwargs.pop(k) for k in _STEP_OPTIONS if k in kwargs}
    tensors = StepTensors(*args, **kwargs)
    spec = check_step_inputs(tensors, **options)
    if arch is None:
        device = getattr(tensors.x, "device", None)
        arch = current_arch(device) if device is not None and device.type == "cuda" else current_arch()
    return get_compiled(spec, arch)


def precompile(specs, arch: Optional[str] = None) -> list:
    """Fill the cache for ``specs``; one result dict per spec (``how``, ``seconds``, ``error``...)."""
    arch = check_arch(arch if arch is not None else current_arch())
    results = []
    for spec in specs:
        row = {"spec": spec.key(), "label": spec_label(spec), "arch": arch}
        try:
            _, how, seconds, entry = obtain(spec, arch)
            row.update(how=how, seconds=round(seconds, 4), entry=str(entry) if entry else None,
                       error=None)
        except Exception as e:  # report and go on with the other specs
            row.update(how="failed", seconds=None, entry=None, error=f"{type(e).__name__}: {e}")
        results.append(row)
    return results
