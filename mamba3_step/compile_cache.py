"""Compile-once kernel cache: an in-process dict in front of a persistent, ahead-of-time disk cache.

Letters (SPEC.md): B batch lanes, P pool rows, H heads, D head dim, N state size (dstate),
R MIMO rank.

``cute.compile`` keeps no disk cache, so without this module every process would pay every
compile again (about 1.2 s per specialisation). Here a kernel is compiled once per
:class:`~mamba3_step.spec.StepSpec` and target architecture, exported with the DSL's
``export_to_c``, linked into a shared library and stored in a cache directory; a later
process loads it with ``tvm_ffi.load_module`` in milliseconds, without importing cutlass.

Public API
----------
* :func:`get_compiled` ``(spec, arch=None) -> callable``: in-memory hit, else disk load, else
  compile + export + store. ``B``, ``P``, ``H`` and strides are not part of the spec, so they
  never cause a compile.
* :func:`compile_for` ``(*mamba3_step_fn args, arch=None, **kwargs)``: derive the spec from a
  call's tensors (CPU, CUDA or meta tensors: only metadata is read) and return the kernel
  without launching it.
* :data:`COUNTERS` / :func:`stats`: process-wide counts of ``compiles``, ``disk_loads``,
  ``memory_hits``, ``disk_writes`` and ``rebuilds`` (corrupt, truncated or stale entries).
* :func:`reset_memory_cache`, :func:`current_arch`, :func:`cache_dir`, :func:`entry_path`.
* ``python -m mamba3_step precompile``: :func:`cli_main`.

The returned callable
---------------------
Always a positional-only ``tvm_ffi.Function`` (the same type whether it was just compiled or
loaded from disk): it takes the 19 runtime arguments of
:func:`mamba3_step.kernel.kernel_arguments` (18 tensors or ``None`` where the spec has none,
then ``null_slot``) and launches on the caller's current CUDA stream. Called with CPU tensors it
raises ``ValueError`` without launching.

Disk cache
----------
Directory: ``$MAMBA3_STEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/mamba3_step``, else
``~/.cache/mamba3_step``. One entry per (spec, arch) is a directory
``v<CACHE_FORMAT>/<arch>/<label>-<digest>/`` holding ``kernel.so`` and ``manifest.json``.
The digest hashes the full key: cache format, ``StepSpec.key()``, the architecture, a sha256
of the kernel's source files (:data:`KERNEL_SOURCES`), the installed versions of
nvidia-cutlass-dsl and apache-tvm-ffi, the codegen-relevant ``CUTE_DSL_*`` environment
variables and the platform. The manifest stores that key in full plus the sha256 and size of
``kernel.so`` and the kernel's calling signature; all are checked before a library is loaded,
so a hash collision, a stale, truncated or tampered entry is detected, discarded and rebuilt,
never loaded.

Entries are built in a private temporary directory inside the cache and published with one
atomic ``rename``; an advisory ``fcntl`` lock per entry makes a second process wait for the
first one's compile and then load its result. Two processes filling one cache never corrupt
it. If the cache directory cannot be written, or no C/C++ linker is found (``$CXX``, ``c++``,
``g++``, ``clang++``, ``$CC``, ``cc``, ``gcc``, ``clang``), kernels are compiled in memory for
this process and one :class:`CompileCacheWarning` says why. A read-only directory that already
holds valid entries (e.g. filled at image-build time) is still loaded from.

The cache directory holds shared libraries that are loaded into the process: it must be as
trusted as the Python environment itself (it is created with mode 0700).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from .spec import (
    KV_DTYPES,
    PROJ_DTYPES,
    STATE_DTYPES,
    SUPPORTED_D,
    SUPPORTED_N,
    SUPPORTED_R,
    X_DTYPES,
    StepSpec,
    flagship_spec,
)
from .tiling import shape_problem, tiling_problem

__all__ = [
    "CACHE_FORMAT",
    "COUNTERS",
    "CompileCacheWarning",
    "CompileCounters",
    "DEFAULT_ARCH",
    "ENV_CACHE_DIR",
    "KERNEL_SOURCES",
    "KernelBuilder",
    "arch_from_capability",
    "cache_dir",
    "cli_main",
    "compile_for",
    "current_arch",
    "entry_key",
    "entry_path",
    "get_compiled",
    "obtain",
    "precompile",
    "reset_memory_cache",
    "set_builder",
    "specs_for_config",
    "stats",
]

#: environment variable naming the cache directory (overrides the per-user default)
ENV_CACHE_DIR = "MAMBA3_STEP_CACHE_DIR"
#: bump when the entry layout or export procedure changes: old entries are then ignored
CACHE_FORMAT = 1
#: files (relative to the package) whose text defines the compiled code; must equal
#: ``mamba3_step.kernel.KERNEL_SOURCES`` (a test checks it, without this module importing cutlass)
KERNEL_SOURCES = ("kernel.py", "contract.py", "spec.py", "tensors.py", "tiling.py")
#: the architecture used when no GPU is visible (the flagship serving target, H100/H200)
DEFAULT_ARCH = "sm_90a"
#: seconds a process waits for another process's lock on one entry before compiling anyway
LOCK_TIMEOUT_S = 600.0

_ARCH_RE = re.compile(r"^sm_[0-9]{2,3}[af]?$")
_ARTIFACT = "kernel.so"
_MANIFEST = "manifest.json"
#: CUTE_DSL_* variables known not to change generated code (everything else enters the key)
_ENV_IGNORED = frozenset(
    "CUTE_DSL_" + s
    for s in (
        "ARCH",  # the target is passed explicitly with --gpu-arch
        "JIT_TIME_PROFILING", "LOG_TO_CONSOLE", "LOG_TO_FILE", "LOG_LEVEL",
        "PRINT_AFTER_PREPROCESSOR", "PRINT_IR", "SHOW_STACKTRACE", "FILTER_STACKTRACE",
        "NO_CACHE", "JIT_CACHE_MAX_ELEMS", "DUMP_DIR", "CACHE_DIR", "WARNINGS_IGNORE",
        "DISABLE_FILE_CACHING", "KEEP", "LIBS",
    )
)


class CompileCacheWarning(RuntimeWarning):
    """The disk cache cannot be used in this process (issued once per cause)."""


# ------------------------------------------------------------------------------ counters
@dataclass
class CompileCounters:
    """Process-wide event counts (read them through :data:`COUNTERS` or :func:`stats`).

    Attributes:
        compiles: kernel compilations (``cute.compile`` calls) in this process.
        disk_loads: kernels loaded from the disk cache instead of compiled.
        memory_hits: :func:`get_compiled` calls answered by the in-process dict.
        disk_writes: entries this process published to the disk cache.
        rebuilds: corrupt, truncated, stale or unloadable entries detected (never loaded;
            discarded and rebuilt when the directory is writable).
    """

    compiles: int = 0
    disk_loads: int = 0
    memory_hits: int = 0
    disk_writes: int = 0
    rebuilds: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


COUNTERS = CompileCounters()


def stats() -> dict:
    """The counters as a dict, plus ``memory_entries`` (kernels held by this process)."""
    d = COUNTERS.as_dict()
    d["memory_entries"] = len(_MEMORY)
    return d


# ------------------------------------------------------------------------------- builder
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


def _compile_real_kernel(spec: StepSpec, arch: str):
    from .kernel import compile_step_kernel  # imports cutlass: only on a real miss

    return compile_step_kernel(spec, arch)


def default_builder() -> KernelBuilder:
    """The project's step kernel (:func:`mamba3_step.kernel.compile_step_kernel`)."""
    pkg = Path(__file__).resolve().parent
    return KernelBuilder(
        name="mamba3_step",
        compile=_compile_real_kernel,
        sources=tuple(str(pkg / s) for s in KERNEL_SOURCES),
    )


_BUILDER: Optional[KernelBuilder] = None


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


# ---------------------------------------------------------------------------- arch / dirs
def arch_from_capability(major: int, minor: int) -> str:
    """``sm_XY`` for a CUDA compute capability, ``a``-suffixed for sm_90 / sm_100 / sm_103.

    Matches :func:`mamba3_step.launch.device_arch` (the launcher's choice), so a precompiled
    entry is the one the launcher asks for.
    """
    arch = f"sm_{int(major)}{int(minor)}"
    return arch + "a" if int(major) in (9, 10) else arch


def current_arch(device=None) -> str:
    """The architecture to compile for on this machine: the CUDA device's (``device``, default
    the current one) when a GPU is visible, else :data:`DEFAULT_ARCH` (``sm_90a``)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return DEFAULT_ARCH
        major, minor = torch.cuda.get_device_capability(device)
    except Exception:  # no CUDA runtime at all
        return DEFAULT_ARCH
    return arch_from_capability(major, minor)


def _check_arch(arch) -> str:
    if not isinstance(arch, str):
        raise TypeError(f"arch: expected a string such as 'sm_90a', got {type(arch).__name__}")
    if not _ARCH_RE.match(arch):
        raise ValueError(f"arch: expected 'sm_' + compute capability digits (+ optional a/f), e.g. "
                         f"'sm_90a' or 'sm_100a', got {arch!r}")
    return arch


def cache_dir() -> Path:
    """The disk cache root: ``$MAMBA3_STEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/mamba3_step``,
    else ``~/.cache/mamba3_step``. Not created here."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mamba3_step"


# ------------------------------------------------------------------------------- the key
_FINGERPRINTS: dict = {}
_VERSIONS: Optional[dict] = None


def _source_fingerprint(builder: KernelBuilder) -> str:
    """sha256 over the builder's source files (name and bytes; a missing file hashes as such)."""
    fp = _FINGERPRINTS.get(builder)
    if fp is None:
        h = hashlib.sha256(builder.name.encode())
        for src in builder.sources:
            p = Path(src)
            h.update(b"\0" + p.name.encode() + b"\0")
            try:
                h.update(p.read_bytes())
            except OSError:
                h.update(b"<missing>")
        fp = _FINGERPRINTS[builder] = h.hexdigest()
    return fp


def _package_versions() -> dict:
    global _VERSIONS
    if _VERSIONS is None:
        from importlib import metadata

        vs = {}
        for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
            try:
                vs[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                vs[dist] = "not-installed"
        _VERSIONS = vs
    return dict(_VERSIONS)


def _codegen_env() -> dict:
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("CUTE_DSL_") and k not in _ENV_IGNORED}


def entry_key(spec: StepSpec, arch: str, builder: Optional[KernelBuilder] = None) -> dict:
    """The full disk-cache key of (spec, arch): everything that can change the compiled code."""
    builder = builder or get_builder()
    return {
        "format": CACHE_FORMAT,
        "builder": builder.name,
        "spec": spec.key(),
        "arch": arch,
        "sources_sha256": _source_fingerprint(builder),
        "versions": _package_versions(),
        "env": _codegen_env(),
        "platform": f"{sys.platform}-{platform.machine()}",
    }


def _key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _label(spec: StepSpec) -> str:
    return f"n{spec.dstate}d{spec.headdim}r{spec.mimo}"


def entry_path(spec: StepSpec, arch: Optional[str] = None, root: Optional[Path] = None) -> Path:
    """Directory of the disk entry for (spec, arch) under ``root`` (default :func:`cache_dir`)."""
    spec = _complete_spec(spec)
    arch = _check_arch(arch or current_arch())
    key = entry_key(spec, arch)
    root = Path(root) if root is not None else cache_dir()
    return root / f"v{CACHE_FORMAT}" / arch / f"{_label(spec)}-{_key_digest(key)}"


# ------------------------------------------------------------------------- warnings/locks
_WARNED: set = set()


def _warn_once(cause: str, message: str) -> None:
    if cause in _WARNED:
        return
    _WARNED.add(cause)
    warnings.warn(message, CompileCacheWarning, stacklevel=4)


@contextlib.contextmanager
def _entry_lock(lock_path: Path) -> Iterator[None]:
    """Advisory exclusive lock on ``lock_path`` (no-op where fcntl or the file is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # a stuck holder: go on without the lock (the rename stays atomic)
                time.sleep(0.05)
            except OSError:
                break
        yield
    finally:
        os.close(fd)  # releases the lock


def _writable_dir(path: Path) -> Optional[str]:
    """Create ``path`` (mode 0700) and check it can take a new file; the reason if not."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


# ----------------------------------------------------------------------- loading entries
_MEMORY: dict = {}
_MODULES: list = []  # keeps loaded tvm-ffi modules (and their shared libraries) alive
_LOCK = threading.RLock()


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _embedded_signature(data: bytes) -> Optional[str]:
    """The calling signature text the tvm-ffi wrapper embeds in an exported library."""
    m = re.search(rb"when calling: `([^`]*)`", data)
    return m.group(1).decode("utf-8", "replace") if m else None


def _ffi_signature(fn) -> Optional[str]:
    """The calling signature a tvm-ffi function reports (probe call with no arguments).

    Not used on the load path: the first tvm-ffi error in a process costs about 1.5 s
    (backtrace set-up). Tests use it to compare a loaded kernel with the JIT one.
    """
    try:
        fn()
    except TypeError as e:
        m = re.search(r"`([^`]*)`", str(e))
        return m.group(1) if m else None
    except Exception:
        return None
    return None  # pragma: no cover - every kernel takes arguments


def _load_library(path: Path, function_name: str):
    import tvm_ffi

    module = tvm_ffi.load_module(str(path))
    fn = module[function_name]
    _MODULES.append(module)
    return fn


def _try_load(entry: Path, key: dict):
    """``(fn, None)`` for a valid entry, ``(None, None)`` when absent, ``(None, why)`` when bad."""
    manifest_path = entry / _MANIFEST
    if not entry.exists():
        return None, None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable manifest ({type(e).__name__})"
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return None, "stale entry: its key differs from this process's key"
    artifact = manifest.get("artifact")
    fname = manifest.get("function_name")
    if artifact != _ARTIFACT or not isinstance(fname, str) or not fname.isidentifier():
        return None, "malformed manifest"
    so = entry / artifact
    try:
        data = so.read_bytes()
    except OSError as e:
        return None, f"missing artifact ({type(e).__name__})"
    if len(data) != manifest.get("size") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        return None, "artifact does not match its recorded size/sha256 (truncated or tampered)"
    try:
        fn = _load_library(so, fname)
    except Exception as e:
        return None, f"library does not load ({type(e).__name__}: {str(e)[:200]})"
    return fn, None


def _discard(entry: Path) -> None:
    """Remove a bad entry: rename it aside first (atomic), then delete."""
    trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(entry, trash)
    except OSError:
        return  # already gone (another process discarded it) or not ours to remove
    shutil.rmtree(trash, ignore_errors=True)


# ------------------------------------------------------------------------ writing entries
def _find_linker() -> Optional[str]:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++", os.environ.get("CC"), "cc", "gcc",
                 "clang"):
        if cand:
            path = shutil.which(cand)
            if path:
                return path
    return None


def _runtime_libraries() -> list:
    from cutlass.runtime import find_runtime_libraries  # cutlass is imported: we just compiled

    return [p for p in find_runtime_libraries(enable_tvm_ffi=True) if p]


def _link_shared(linker: str, obj: Path, out: Path) -> None:
    cmd = [linker, "-shared", "-o", str(out), str(obj)]
    for lib in _runtime_libraries():
        d, name = os.path.split(lib)
        stem = name[3:] if name.startswith("lib") else name
        stem = stem.split(".so")[0]
        cmd += [f"-L{d}", f"-l{stem}", f"-Wl,-rpath,{d}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")


def _store(compiled, entry: Path, key: dict, linker: str, compile_s: float):
    """Export ``compiled`` into ``entry`` atomically and return the loaded function.

    Builds in a private temp dir in the same parent, then renames it into place. If another
    process published the entry first, its entry is kept and ours is dropped.
    """
    fname = "mamba3_step_" + _key_digest(key)  # unique: several entries live in one process
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        obj, so = tmp / "kernel.o", tmp / _ARTIFACT
        compiled.export_to_c(str(obj), function_name=fname, export_only_tvm_ffi_symbols=True)
        _link_shared(linker, obj, so)
        obj.unlink()
        fn = _load_library(so, fname)  # dlopen keeps the mapping valid across the rename
        data = so.read_bytes()
        manifest = {
            "key": key,
            "artifact": _ARTIFACT,
            "function_name": fname,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "signature": _embedded_signature(data),
            "compile_seconds": round(compile_s, 4),
            "created_unix": time.time(),
            "created_by_pid": os.getpid(),
        }
        with open(tmp / _MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        with open(so, "rb") as f:
            os.fsync(f.fileno())
        try:
            os.rename(tmp, entry)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # another process published a (valid, by the lock protocol) entry first: keep it
        else:
            COUNTERS.disk_writes += 1
        return fn
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _memory_callable(compiled):
    """The positional tvm-ffi function of a freshly compiled kernel (no disk involved)."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    if get is not None:
        fn = get()
        if fn is not None:
            return fn
    return compiled  # e.g. cross-compiled (no JIT engine): calling it raises the DSL's error


# ------------------------------------------------------------------------------ the cache
def _complete_spec(spec) -> StepSpec:
    if not isinstance(spec, StepSpec):
        raise TypeError(f"spec: expected a mamba3_step.StepSpec, got {type(spec).__name__}")
    for field, allowed in (("state_dtype", STATE_DTYPES), ("kv_dtype", KV_DTYPES),
                           ("x_dtype", X_DTYPES), ("proj_dtype", PROJ_DTYPES)):
        if getattr(spec, field) not in allowed:
            raise ValueError(f"spec.{field}: expected one of {allowed}, got {getattr(spec, field)!r}")
    problem = shape_problem(spec.dstate, spec.headdim, spec.mimo)
    if problem is not None:
        raise ValueError(f"spec: {problem}")
    if spec.tile_D == 0 or spec.num_warps == 0:
        spec = spec.with_default_tiling()
    problem = tiling_problem(spec)
    if problem is not None:
        raise ValueError(f"spec: {problem}")
    return spec


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
    spec = _complete_spec(spec)
    arch = _check_arch(arch if arch is not None else current_arch())
    mkey = (spec, arch)
    fn = _MEMORY.get(mkey)
    if fn is not None:
        COUNTERS.memory_hits += 1
        return fn, "memory", 0.0, None
    with _LOCK:
        fn = _MEMORY.get(mkey)
        if fn is not None:
            COUNTERS.memory_hits += 1
            return fn, "memory", 0.0, None
        t0 = time.perf_counter()
        fn, how, entry = _obtain_uncached(spec, arch)
        _MEMORY[mkey] = fn
        return fn, how, time.perf_counter() - t0, entry


def _obtain_uncached(spec: StepSpec, arch: str):
    builder = get_builder()

    def compile_now():
        t = time.perf_counter()
        compiled = builder.compile(spec, arch)
        COUNTERS.compiles += 1
        return compiled, time.perf_counter() - t

    if not builder.exportable:
        return _memory_callable(compile_now()[0]), "compiled-in-memory", None

    key = entry_key(spec, arch, builder)
    entry = cache_dir() / f"v{CACHE_FORMAT}" / arch / f"{_label(spec)}-{_key_digest(key)}"
    fn, problem = _try_load(entry, key)
    if fn is not None:
        COUNTERS.disk_loads += 1
        return fn, "loaded", entry

    why_not = _writable_dir(entry.parent)
    if why_not is not None:
        if problem is not None:
            COUNTERS.rebuilds += 1
        _warn_once("unwritable", f"mamba3_step: kernel cache directory {entry.parent} is not writable "
                   f"({why_not}); compiling kernels in memory for this process only. Set "
                   f"{ENV_CACHE_DIR} to a writable directory to keep compiled kernels.")
        return _memory_callable(compile_now()[0]), "compiled-in-memory", None
    linker = _find_linker()
    if linker is None:
        _warn_once("linker", "mamba3_step: no C/C++ linker found ($CXX, c++, g++, clang++, $CC, cc, "
                   "gcc, clang) to turn exported kernels into shared libraries; compiling kernels in "
                   "memory for this process only. Install g++ (or set CXX) to enable the disk cache.")
        return _memory_callable(compile_now()[0]), "compiled-in-memory", None

    with _entry_lock(entry.parent / f".{entry.name}.lock"):
        fn, problem2 = _try_load(entry, key)  # another process may have filled it meanwhile
        if fn is not None:
            COUNTERS.disk_loads += 1
            return fn, "loaded", entry
        bad = problem2 or problem
        if problem2 is not None:
            COUNTERS.rebuilds += 1
            _discard(entry)
        compiled, compile_s = compile_now()
        try:
            fn = _store(compiled, entry, key, linker, compile_s)
        except Exception as e:
            _warn_once("store", f"mamba3_step: could not write kernel cache entry {entry} "
                       f"({type(e).__name__}: {str(e)[:300]}); using the in-memory compile.")
            return _memory_callable(compiled), "compiled-in-memory", None
        return fn, ("rebuilt" if bad else "compiled"), entry


def get_compiled(spec: StepSpec, arch: Optional[str] = None):
    """The compiled step kernel for ``spec`` on ``arch``, without launching it.

    Args:
        spec: the static specialisation. ``tile_D``/``num_warps`` left at 0 are filled with the
            per-configuration default. ``B``, ``P``, ``H`` and strides are runtime values and
            not part of it: calls that differ only in those share one kernel.
        arch: target, e.g. ``"sm_90a"``; default :func:`current_arch` (``sm_90a`` without a GPU).

    Returns:
        A positional-only ``tvm_ffi.Function`` taking :func:`mamba3_step.kernel.kernel_arguments`
        (launches on the current CUDA stream). In order: the in-process dict, the disk cache
        (no compile, no cutlass import), else a compile that is exported to the disk cache.

    Raises:
        TypeError: ``spec`` is not a StepSpec or ``arch`` not a string.
        ValueError: unsupported N/D/R, dtype or tiling in ``spec``; a malformed ``arch``.
    """
    return obtain(spec, arch)[0]


def reset_memory_cache() -> None:
    """Forget the kernels held in this process (the disk cache and counters are kept)."""
    with _LOCK:
        _MEMORY.clear()


def compile_for(*args, arch: Optional[str] = None, **kwargs):
    """The compiled kernel a ``mamba3_step_fn(*args, **kwargs)`` call would launch, not launched.

    Takes ``mamba3_step_fn``'s arguments (``validate_indices`` is accepted and ignored; ``out``
    may be omitted). Only metadata is read, so CPU or meta tensors work and nothing
    synchronises. ``arch`` defaults to the device of ``x`` when it is a CUDA tensor, else
    :func:`current_arch`. Shapes: see ``mamba3_step_fn`` (state (P or B, H, D, N), x (B, H, D) ...).

    Raises:
        TypeError / ValueError: as :func:`mamba3_step.validation.check_step_inputs` for bad inputs.
    """
    from .tensors import StepTensors
    from .validation import check_step_inputs

    kwargs.pop("validate_indices", None)
    options = {k: kwargs.pop(k) for k in ("update_kv_state", "tile_D", "num_warps") if k in kwargs}
    tensors = StepTensors(*args, **kwargs)
    spec = check_step_inputs(tensors, **options)
    if arch is None:
        device = getattr(tensors.x, "device", None)
        arch = current_arch(device) if device is not None and device.type == "cuda" else current_arch()
    return get_compiled(spec, arch)


# ---------------------------------------------------------------------------- precompile
_CONFIG_HELP = ("flagship | all | N,D,R[,state_dtype[,kv_dtype[,x_dtype[,proj_dtype]]]] "
                "(repeatable)")


def specs_for_config(config: str, **flags) -> list:
    """Specs named by one ``--config`` value; ``flags`` are StepSpec mode fields (pool, has_dst,
    update_kv_state, has_z, has_outproj, has_state_out) applied over the flagship's.

    ``all`` is the supported cross product N x D x R (4 x 3 x 4 = 48) with the flagship dtypes
    and the given flags, minus combinations whose default tiling is impossible.
    """
    if not isinstance(config, str):
        raise TypeError(f"config: expected a string ({_CONFIG_HELP}), got {type(config).__name__}")
    text = config.strip()
    if text == "flagship":
        return [flagship_spec(**flags)]
    if text == "all":
        out = []
        for n, d, r in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R):
            s = flagship_spec(dstate=n, headdim=d, mimo=r, **flags)
            if tiling_problem(s) is None:
                out.append(s)
        return out
    parts = [p.strip() for p in text.split(",")]
    if not 3 <= len(parts) <= 7:
        raise ValueError(f"config: expected {_CONFIG_HELP}, got {config!r}")
    try:
        n, d, r = (int(p) for p in parts[:3])
    except ValueError:
        raise ValueError(f"config: N,D,R must be integers ({_CONFIG_HELP}), got {config!r}") from None
    problem = shape_problem(n, d, r)
    if problem:
        raise ValueError(f"config {config!r}: {problem}")
    changes = dict(dstate=n, headdim=d, mimo=r)
    for field, allowed, value in zip(("state_dtype", "kv_dtype", "x_dtype", "proj_dtype"),
                                     (STATE_DTYPES, KV_DTYPES, X_DTYPES, PROJ_DTYPES), parts[3:]):
        if value not in allowed:
            raise ValueError(f"config {config!r}: {field} must be one of {allowed}, got {value!r}")
        changes[field] = value
    spec = flagship_spec(**changes, **flags)
    problem = tiling_problem(spec)
    if problem:
        raise ValueError(f"config {config!r}: {problem}")
    return [spec]


def spec_label(spec: StepSpec) -> str:
    """A short human-readable name: ``N128 D64 R4 float32/bfloat16/bfloat16/bfloat16 tD64 w8 pool+kv+z+outproj``."""
    flags = [n for n, on in (("pool", spec.pool), ("dst", spec.has_dst), ("kv", spec.update_kv_state),
                             ("z", spec.has_z), ("outproj", spec.has_outproj),
                             ("state_out", spec.has_state_out)) if on]
    return (f"N{spec.dstate} D{spec.headdim} R{spec.mimo} {spec.state_dtype}/{spec.kv_dtype}/"
            f"{spec.x_dtype}/{spec.proj_dtype} tD{spec.tile_D} w{spec.num_warps} "
            f"{'+'.join(flags) or 'dense'}")


def precompile(specs, arch: Optional[str] = None) -> list:
    """Fill the cache for ``specs``; one result dict per spec (``how``, ``seconds``, ``error``...)."""
    arch = _check_arch(arch if arch is not None else current_arch())
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


def cli_main(argv: Optional[list] = None) -> int:
    """``python -m mamba3_step precompile [--arch sm_90a] [--config ...] [--json] ...``"""
    p = argparse.ArgumentParser(
        prog="python -m mamba3_step precompile",
        description="Compile step-kernel specialisations into the disk cache ahead of time (server "
                    "start-up, image build) and report, per specialisation, whether it was compiled "
                    "or loaded and how long it took.")
    p.add_argument("--arch", default=None,
                   help=f"target architecture, e.g. sm_90a, sm_100a (default: this machine's GPU, "
                        f"else {DEFAULT_ARCH})")
    p.add_argument("--config", action="append", default=None, metavar="CONFIG",
                   help=f"{_CONFIG_HELP}; default flagship. 'all' = the 48 supported N x D x R "
                        "combinations with the flagship dtypes and the given mode flags")
    p.add_argument("--mode", choices=("pool", "dense"), default="pool",
                   help="pool mode (state_batch_indices given; default) or dense mode")
    p.add_argument("--dst", action="store_true", help="pool mode with dst_state_batch_indices")
    p.add_argument("--no-update-kv-state", action="store_true", help="without update_kv_state")
    p.add_argument("--no-z", action="store_true", help="without the z gate")
    p.add_argument("--no-outproj", action="store_true", help="without outproj (out is (B, R, H, D))")
    p.add_argument("--state-out", action="store_true", help="dense mode with state_out")
    p.add_argument("--cache-dir", default=None, help=f"cache directory (default: ${ENV_CACHE_DIR}, "
                   "else $XDG_CACHE_HOME/mamba3_step, else ~/.cache/mamba3_step)")
    p.add_argument("--list", action="store_true", help="print the specialisations, compile nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = p.parse_args(argv)

    if a.dst and a.mode != "pool":
        p.error("--dst needs --mode pool")
    if a.state_out and a.mode != "dense":
        p.error("--state-out needs --mode dense")
    flags = dict(pool=a.mode == "pool", has_dst=a.dst, update_kv_state=not a.no_update_kv_state,
                 has_z=not a.no_z, has_outproj=not a.no_outproj, has_state_out=a.state_out)
    try:
        arch = _check_arch(a.arch) if a.arch is not None else current_arch()
        specs = []
        for c in a.config or ["flagship"]:
            for s in specs_for_config(c, **flags):
                if s not in specs:
                    specs.append(s)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    if a.cache_dir is not None:
        os.environ[ENV_CACHE_DIR] = a.cache_dir

    if a.list:
        if a.json:
            print(json.dumps({"arch": arch, "count": len(specs),
                              "specs": [{"spec": s.key(), "label": spec_label(s)} for s in specs]}))
        else:
            for s in specs:
                print(spec_label(s))
            print(f"{len(specs)} specialisation(s) for {arch}")
        return 0

    t0 = time.perf_counter()
    results = precompile(specs, arch)
    total = time.perf_counter() - t0
    summary = {how: sum(r["how"] == how for r in results)
               for how in ("compiled", "rebuilt", "compiled-in-memory", "loaded", "memory", "failed")}
    failed = summary["failed"]
    if a.json:
        print(json.dumps({"arch": arch, "cache_dir": str(cache_dir()), "total_seconds": round(total, 4),
                          "results": results, "summary": summary, "counters": stats(),
                          "failed": failed}))
    else:
        width = max(len(r["label"]) for r in results)
        print(f"{'specialisation':<{width}}  {'result':<18} {'seconds':>8}")
        for r in results:
            secs = f"{r['seconds']:8.3f}" if r["seconds"] is not None else f"{'-':>8}"
            print(f"{r['label']:<{width}}  {r['how']:<18} {secs}")
            if r["error"]:
                print(f"    error: {r['error']}")
        n = summary
        print(f"{len(results)} specialisation(s) for {arch} in {total:.2f} s: "
              f"{n['compiled'] + n['compiled-in-memory']} compiled, {n['loaded']} loaded, "
              f"{n['rebuilt']} rebuilt, {n['memory']} already in memory, {failed} failed; "
              f"cache {cache_dir()}")
    return 1 if failed else 0
