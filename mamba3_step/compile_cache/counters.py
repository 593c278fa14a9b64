"""Process-wide event counts of the compile cache (read them through ``stats()``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["COUNTERS", "CompileCounters"]


@dataclass
class CompileCounters:
    """Process-wide event counts.

    Attributes:
        compiles: kernel compilations (``cute.compile`` calls) in this process.
        disk_loads: kernels loaded from the disk cache instead of compiled.
        memory_hits: ``get_compiled`` calls answered by the in-process dict.
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
