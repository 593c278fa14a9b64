"""The on-disk store of the compile cache: verified loads, atomic writes, per-entry locks.

One entry per (spec, arch) is a directory holding ``kernel.so`` (the exported kernel, linked
into a shared library) and ``manifest.json`` (the full key, the library's sha256 and size, its
calling signature). :func:`try_load` checks all of it before the library is loaded, so a hash
collision, a stale, truncated or tampered entry is reported and never loaded. :func:`store`
builds an entry in a private temporary directory inside the cache and publishes it with one
atomic ``rename``; :func:`entry_lock` (advisory ``fcntl``) lets a second process wait for the
first one's compile instead of repeating it.

The directory holds shared libraries that get loaded into the process: it must be as trusted as
the Python environment itself (the front creates it with mode 0700).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import tvm_ffi

from .counters import COUNTERS
from .key import key_digest

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no advisory locks
    fcntl = None

__all__ = ["LOCK_TIMEOUT_S", "discard", "entry_lock", "ffi_signature", "find_linker", "memory_callable",
           "store", "try_load", "writable_dir"]

#: seconds a process waits for another process's lock on one entry before compiling anyway
LOCK_TIMEOUT_S = 600.0
_ARTIFACT = "kernel.so"
_MANIFEST = "manifest.json"
_MODULES: list = []  # keeps loaded tvm-ffi modules (and their shared libraries) alive


def writable_dir(path: Path) -> Optional[str]:
    """Create ``path`` (mode 0700) and check it can take a new file; the reason if not."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


@contextlib.contextmanager
def entry_lock(lock_path: Path) -> Iterator[None]:
    """Advisory exclusive lock on ``lock_path`` (no-op where fcntl or the file is unavailable)."""
    if fcntl is None:  # pragma: no cover - not POSIX
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


def embedded_signature(data: bytes) -> Optional[str]:
    """The calling signature text the tvm-ffi wrapper embeds in an exported library."""
    m = re.search(rb"when calling: `([^`]*)`", data)
    return m.group(1).decode("utf-8", "replace") if m else None


def ffi_signature(fn) -> Optional[str]:
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


def load_library(path: Path, function_name: str):
    module = tvm_ffi.load_module(str(path))
    fn = module[function_name]
    _MODULES.append(module)
    return fn


def try_load(entry: Path, key: dict):
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
        fn = load_library(so, fname)
    except Exception as e:
        return None, f"library does not load ({type(e).__name__}: {str(e)[:200]})"
    return fn, None


def discard(entry: Path) -> None:
    """Remove a bad entry: rename it aside first (atomic), then delete."""
    trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(entry, trash)
    except OSError:
        return  # already gone (another process discarded it) or not ours to remove
    shutil.rmtree(trash, ignore_errors=True)


def find_linker() -> Optional[str]:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++", os.environ.get("CC"), "cc", "gcc",
                 "clang"):
        if cand:
            path = shutil.which(cand)
            if path:
                return path
    return None


def _runtime_libraries() -> list:
    from cutlass.runtime import find_runtime_libraries  # lazy: cutlass is loaded only after a compile

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


def store(compiled, entry: Path, key: dict, linker: str, compile_s: float):
    """Export ``compiled`` into ``entry`` atomically and return the loaded function.

    Builds in a private temp dir in the same parent, then renames it into place. If another
    process published the entry first, its entry is kept and ours is dropped.
    """
    fname = "mamba3_step_" + key_digest(key)  # unique: several entries live in one process
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        obj, so = tmp / "kernel.o", tmp / _ARTIFACT
        compiled.export_to_c(str(obj), function_name=fname, export_only_tvm_ffi_symbols=True)
        _link_shared(linker, obj, so)
        obj.unlink()
        fn = load_library(so, fname)  # dlopen keeps the mapping valid across the rename
        data = so.read_bytes()
        manifest = {
            "key": key,
            "artifact": _ARTIFACT,
            "function_name": fname,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "signature": embedded_signature(data),
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


def memory_callable(compiled):
    """The positional tvm-ffi function of a freshly compiled kernel (no disk involved)."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    if get is not None:
        fn = get()
        if fn is not None:
            return fn
    return compiled  # e.g. cross-compiled (no JIT engine): calling it raises the DSL's error
