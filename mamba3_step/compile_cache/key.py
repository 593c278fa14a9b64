"""The disk cache's key: everything that can change the compiled code, and where an entry lives.

Letters (docs/contract.md): N state size, D head dim, R MIMO rank.

The key of (spec, arch, builder) holds the cache format, the builder's name, ``StepSpec.key()``,
the architecture, a sha256 of the builder's source files (for the real kernel: the kernel module
and every package module it imports, computed by :func:`mamba3_step.build.kernel_sources`), the
installed versions of nvidia-cutlass-dsl and apache-tvm-ffi, the ``CUTE_DSL_*`` environment
variables that can change code, and the platform. An entry's directory name carries a digest of
the full key; its manifest carries the key itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

from ..build import KernelBuilder
from ..spec import StepSpec

__all__ = ["CACHE_FORMAT", "ENV_CACHE_DIR", "cache_dir", "entry_dir", "entry_key", "key_digest",
           "package_versions", "source_fingerprint"]

#: environment variable naming the cache directory (overrides the per-user default)
ENV_CACHE_DIR = "MAMBA3_STEP_CACHE_DIR"
#: bump when the entry layout or export procedure changes: old entries are then ignored
CACHE_FORMAT = 1
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
_FINGERPRINTS: dict = {}  # builder -> sha256 of its sources (read once per process)
_VERSIONS: Optional[dict] = None


def cache_dir() -> Path:
    """The disk cache root: ``$MAMBA3_STEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/mamba3_step``,
    else ``~/.cache/mamba3_step``. Not created here.

    Resolved as the operating system resolves it (symbolic links, then ``..``): the directory whose
    owner and modes the cache checks is the directory it reads. A lexical normalisation would
    check ``a/link/../x`` as ``a/x`` while opening ``x`` beside the link's target."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(os.path.realpath(Path(env).expanduser()))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return Path(os.path.realpath(base / "mamba3_step"))


def source_fingerprint(builder: KernelBuilder) -> str:
    """sha256 over the builder's source files (a missing file hashes as such).

    Each file enters with its path relative to the sources' common folder (so two checkouts of
    the same code share entries) and its bytes.
    """
    fp = _FINGERPRINTS.get(builder)
    if fp is None:
        h = hashlib.sha256(builder.name.encode())
        paths = [os.path.abspath(src) for src in builder.sources]
        top = os.path.commonpath([os.path.dirname(p) for p in paths]) if paths else ""
        for path in paths:
            h.update(b"\0" + os.path.relpath(path, top).encode() + b"\0")
            try:
                h.update(Path(path).read_bytes())
            except OSError:
                h.update(b"<missing>")
        fp = _FINGERPRINTS[builder] = h.hexdigest()
    return fp


def package_versions() -> dict:
    """Installed versions of the compiler and the FFI (read once per process)."""
    global _VERSIONS
    if _VERSIONS is None:
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


def entry_key(spec: StepSpec, arch: str, builder: KernelBuilder) -> dict:
    """The full disk-cache key of (spec, arch, builder)."""
    return {
        "format": CACHE_FORMAT,
        "builder": builder.name,
        "spec": spec.key(),
        "arch": arch,
        "sources_sha256": source_fingerprint(builder),
        "versions": package_versions(),
        "env": _codegen_env(),
        "platform": f"{sys.platform}-{platform.machine()}",
    }


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def entry_dir(root: Path, spec: StepSpec, arch: str, key: dict) -> Path:
    """``<root>/v<format>/<arch>/n<N>d<D>r<R>-<digest>``: the directory of one entry."""
    label = f"n{spec.dstate}d{spec.headdim}r{spec.mimo}"
    return Path(root) / f"v{CACHE_FORMAT}" / arch / f"{label}-{key_digest(key)}"
