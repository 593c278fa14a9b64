"""The on-disk store of the compile cache: trust checks, verified loads, atomic writes, locks.

One entry per (spec, arch) is a directory holding ``kernel.so`` (the exported kernel, linked
into a shared library) and ``manifest.json`` (the full key, the library's sha256 and size, its
calling signature). :func:`try_load` checks all of it before the library is loaded, so a hash
collision, a stale, truncated or tampered entry is reported and never loaded. :func:`store`
builds an entry in a private temporary directory inside the cache and publishes it with one
atomic ``rename``; :func:`entry_lock` (advisory ``fcntl``) lets a second process wait for the
first one's compile instead of repeating it.

Trust (docs/compile-cache.md, "Trust model"): the directory holds shared libraries that get
loaded into the process, so nothing is read from it unless this user could have been the only
writer. :func:`tree_problem` checks the directories (the cache root and those below it: owned
by this user, not writable by group or others; those above it: owned by this user or root, not
writable by group or others unless sticky); :func:`try_load` checks the entry directory and opens
each file with ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``s the open file (a regular file, owned
by this user, not writable by group or others) before reading it. Directories are created 0700
and files 0600/0700 whatever the umask. ``_current_uid`` is the one place the user is named
(tests monkeypatch it to play another user).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
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

__all__ = ["LOCK_TIMEOUT_S", "MANIFEST_MAX_BYTES", "MANIFEST_MAX_DEPTH", "discard", "entry_lock", "ffi_signature",
           "find_linker", "make_private_dirs", "memory_callable", "parse_manifest", "store", "tree_problem", "try_load",
           "writable_dir"]

#: seconds a process waits for another process's lock on one entry before compiling anyway
LOCK_TIMEOUT_S = 600.0
_ARTIFACT = "kernel.so"
_MANIFEST = "manifest.json"
_MODULES: list = []  # keeps loaded tvm-ffi modules (and their shared libraries) alive
_GO_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: a manifest is parsed only within these bounds (a few hundred bytes and 3 levels in practice): a larger
#: or deeper one is corrupt, so that parsing any entry takes bounded time and stack
MANIFEST_MAX_BYTES = 1 << 16
MANIFEST_MAX_DEPTH = 16
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class UntrustedError(OSError):
    """A path in the cache that this user cannot be sure only it (or root, above the cache) wrote."""


def _current_uid() -> int:
    """The user whose files the cache trusts: the effective uid (monkeypatched by tests)."""
    return os.geteuid()


def _owner_and_mode_problem(path, st: os.stat_result, *, root_ok: bool, sticky_ok: bool) -> Optional[str]:
    uid = _current_uid()
    if st.st_uid != uid and not (root_ok and st.st_uid == 0):
        who = "this user or root" if root_ok else "this user"
        return f"{path} is owned by uid {st.st_uid}, not by {who} (uid {uid})"
    if stat.S_ISLNK(st.st_mode):
        return None  # a link's own mode means nothing; only its owner can change it
    if st.st_mode & _GO_WRITE and not (sticky_ok and st.st_mode & stat.S_ISVTX and stat.S_ISDIR(st.st_mode)):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _private_problem(path, st: os.stat_result) -> Optional[str]:
    """Cache contents: owned by this user exactly, not writable by group or others."""
    return _owner_and_mode_problem(path, st, root_ok=False, sticky_ok=False)


def tree_problem(root: Path, arch_dir: Path) -> Optional[str]:
    """Why the cache tree cannot be trusted, or None. Raises OSError when it cannot be inspected.

    Every directory above ``root`` (as written and after resolving links) must be owned by this
    user or root and not writable by group or others unless sticky (like /tmp): otherwise
    another user could rename the cache away and put their own in its place. ``root`` itself (it
    may be a link this user owns), and the existing directories from it down to ``arch_dir``,
    must be real directories owned by this user and not writable by group or others.
    """
    root = Path(os.path.abspath(root))
    above = list(reversed(root.parents)) + list(reversed(Path(os.path.realpath(root)).parents))
    for p in above:
        problem = _owner_and_mode_problem(p, os.lstat(p), root_ok=True, sticky_ok=True)
        if problem:
            return problem
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        problem = _private_problem(root, st)
        if problem:
            return problem
        st = os.stat(root)
    chain = [root] + [root / part for part in _parts_below(root, Path(os.path.abspath(arch_dir)))]
    for i, p in enumerate(chain):
        if i:
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                break
        if not stat.S_ISDIR(st.st_mode):
            return f"{p} is not a directory"
        problem = _private_problem(p, st)
        if problem:
            return problem
    return None


def _parts_below(top: Path, path: Path) -> list:
    """``top/a/b`` for ``path = top/a/b/...``: the cumulative relative paths from ``top`` to ``path``."""
    rel = path.relative_to(top).parts
    return [Path(*rel[: i + 1]) for i in range(len(rel))]


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each with mode 0700 (whatever the umask)."""
    missing = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # another process made it: the trust check looks at it like any other
        os.chmod(d, 0o700)  # mkdir's mode is masked by the umask


def writable_dir(path: Path) -> Optional[str]:
    """Create ``path`` (mode 0700) and check it can take a new file; the reason if not."""
    try:
        make_private_dirs(path)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def read_private_file(path: Path, max_bytes: Optional[int] = None) -> bytes:
    """The bytes of ``path`` if it is a regular file this user owns and only it can write.

    Opened with ``O_NOFOLLOW`` (a symbolic link is refused) and ``O_NONBLOCK`` (a FIFO cannot
    block the open), then checked on the open descriptor, so what is checked is what is read.
    Raises OSError (UntrustedError for a file of the wrong kind, owner or mode), and ValueError
    for a file longer than ``max_bytes`` (None: any length), read no further.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedError(f"{path} is not a regular file")
        problem = _private_problem(path, st)
        if problem:
            raise UntrustedError(problem)
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise ValueError(f"{path} is longer than {max_bytes} bytes")
    finally:
        os.close(fd)


@contextlib.contextmanager
def entry_lock(lock_path: Path) -> Iterator[None]:
    """Advisory exclusive lock on ``lock_path`` (no-op where fcntl or the file is unavailable)."""
    if fcntl is None:  # pragma: no cover - not POSIX
        yield
        return
    try:  # never through a link, never blocking on a FIFO; only a regular file of ours is locked
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        yield
        return
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode) or _private_problem(lock_path, st):
        os.close(fd)
        yield  # not a lock file of ours: go on without the lock (the rename stays atomic)
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


def parse_manifest(data: bytes):
    """The JSON value of a manifest's bytes, parsed only if it nests at most ``MANIFEST_MAX_DEPTH`` arrays
    and objects deep (counted in one pass over the bytes, strings skipped): ValueError otherwise, or for
    text that is not JSON. With ``MANIFEST_MAX_BYTES`` this bounds the time and stack of any parse."""
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > MANIFEST_MAX_DEPTH:
                raise ValueError(f"the manifest nests deeper than {MANIFEST_MAX_DEPTH} levels")
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return json.loads(data)


def try_load(entry: Path, key: dict):
    """``(fn, None)`` for a valid entry, ``(None, None)`` when absent, ``(None, why)`` when bad.

    Bad includes untrusted: an entry that is a link or not a directory, or an entry or file not
    owned by this user or writable by others. Nothing of such an entry is read or loaded.
    """
    try:
        st = os.lstat(entry)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"unreadable entry ({type(e).__name__}: {e})"
    if stat.S_ISLNK(st.st_mode):
        return None, "the entry is a symbolic link (never followed)"
    if not stat.S_ISDIR(st.st_mode):
        return None, "the entry is not a directory"
    problem = _private_problem(entry, st)
    if problem:
        return None, f"untrusted entry: {problem}"
    try:
        manifest = parse_manifest(read_private_file(entry / _MANIFEST, MANIFEST_MAX_BYTES))
    except (OSError, ValueError, RecursionError) as e:
        return None, f"unreadable manifest ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return None, "stale entry: its key differs from this process's key"
    artifact = manifest.get("artifact")
    fname = manifest.get("function_name")
    if artifact != _ARTIFACT or not isinstance(fname, str) or not fname.isidentifier():
        return None, "malformed manifest"
    so = entry / artifact
    try:
        data = read_private_file(so)
    except OSError as e:
        return None, f"missing or unreadable artifact ({type(e).__name__}: {e})"
    if len(data) != manifest.get("size") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        return None, "artifact does not match its recorded size/sha256 (truncated or tampered)"
    try:  # by path: only this user can change the file between the check above and the load
        fn = load_library(so, fname)
    except Exception as e:
        return None, f"library does not load ({type(e).__name__}: {str(e)[:200]})"
    return fn, None


def discard(entry: Path) -> None:
    """Remove a bad entry (a directory, a file or a link): rename it aside first (atomic), then delete."""
    trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(entry, trash)
    except OSError:
        return  # already gone (another process discarded it) or not ours to remove
    if os.path.isdir(trash) and not os.path.islink(trash):
        shutil.rmtree(trash, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(trash)


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
        os.chmod(so, 0o700)  # the linker's mode follows the umask (0777 under umask 000)
        fn = load_library(so, fname)  # dlopen keeps the mapping valid across the rename
        data = read_private_file(so)
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
        fd = os.open(tmp / _MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # the mode of os.open is masked by the umask too
        with open(fd, "w") as f:
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
