"""The PTX hash list of every specialisation the test suite compiles: the check of a pure refactor.

    python tests/ptx_hashes.py --out hashes.txt [--full-matrix] [--jobs 2]
    python tests/ptx_hashes.py --compare before.txt after.txt

The first form collects the suite (``pytest --collect-only``; the default run's tests, with
``--full-matrix`` the big matrices' after them, in an order that spreads every prefix over the code
paths, so a partial list already covers them; ``--resume`` appends to a partial list), takes every (specialisation, architecture) a test names (its ``spec`` parameter, or
a ``name`` of the tables ``tests/conftest.py`` resolves; ``arch`` defaults to sm_90a), compiles
each once with the PTX kept, and writes one line per specialisation: ``sha256 key@arch``. The
kernel's entry name is replaced by ``ENTRY`` before hashing: the DSL spells the kernel's module
path and class into it. The second form prints the differences and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(")


def normalised_ptx(text: str) -> str:
    """``text`` with every kernel entry name replaced by ``ENTRY``."""
    for name in set(_ENTRY.findall(text)):
        text = text.replace(name, "ENTRY")
    return text


class _Collector:
    """A pytest plugin that records the specialisation of every collected test, those of the default
    run first (the tests without the ``full_matrix`` mark), then the others."""

    def __init__(self, full_matrix: bool):
        self.full_matrix = full_matrix
        self.specs: dict[str, tuple] = {}

    def pytest_collection_modifyitems(self, session, config, items):
        import conftest  # tests/conftest.py: the suite's own map from a test to its specialisation

        default = [i for i in items if not i.get_closest_marker("full_matrix")]
        full = [i for i in items if i.get_closest_marker("full_matrix")] if self.full_matrix else []
        for item in default + full:
            params = getattr(getattr(item, "callspec", None), "params", {})
            spec = params.get("spec")
            if spec is None and "name" in params:
                for table in (*conftest._SPEC_TABLES, "LAUNCH_BOUND"):
                    t = getattr(item.module, table, None)
                    if isinstance(t, dict) and params["name"] in t:
                        spec = t[params["name"]]
                        break
            try:
                spec = spec.with_default_tiling()
                key = spec.key()
            except Exception:  # not a specialisation, or not a compilable one
                continue
            arch = params.get("arch", "sm_90a")
            if isinstance(arch, str):
                self.specs[f"{key}@{arch}"] = (spec, arch)


#: the key fields that size a specialisation rather than choose its code paths
_SIZE_FIELDS = ("dstate", "headdim", "mimo", "state_dtype", "kv_dtype", "x_dtype", "proj_dtype", "tile_D", "num_warps")


def _paths_of(label: str) -> str:
    """``label`` without its size fields: the code paths the specialisation takes, and its arch."""
    key, arch = label.rsplit("@", 1)
    kept = [f for f in key.split("-") if f.split("=")[0] not in _SIZE_FIELDS]
    return "-".join(kept) + "@" + arch


def stratified(labels: list[str]) -> list[str]:
    """``labels`` reordered so that any prefix spreads over the code paths: round robin over the
    groups of :func:`_paths_of`, each group in a fixed pseudo-random order."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        groups.setdefault(_paths_of(label), []).append(label)
    rounds = []
    for g in sorted(groups):
        members = sorted(groups[g], key=lambda s: hashlib.sha256(s.encode()).hexdigest())
        rounds.append(members)
    out = []
    while any(rounds):
        for members in rounds:
            if members:
                out.append(members.pop(0))
    return out


def collect(full_matrix: bool) -> dict[str, tuple]:
    import pytest

    collector = _Collector(full_matrix)
    args = ["--collect-only", "-q", "-n0", "-p", "no:cacheprovider", str(HERE)]
    sys.path.insert(0, str(HERE))
    with open(os.devnull, "w") as devnull:
        saved, sys.stdout = sys.stdout, devnull
        try:
            code = pytest.main(args, plugins=[collector])
        finally:
            sys.stdout = saved
    if code not in (0, 5):
        raise SystemExit(f"collection failed (pytest exit {code})")
    return collector.specs


def _hash_one(item: tuple) -> tuple[str, str]:
    label, (spec, arch) = item
    from mamba3_step.build import compile_kernel

    dump = tempfile.mkdtemp(prefix="mamba3-ptxhash-")
    try:
        text = compile_kernel(spec, arch, extra_options=f"--keep-ptx --dump-dir {dump}").__ptx__
    except Exception as e:  # a specialisation that does not compile is listed as such
        return label, f"error:{type(e).__name__}"
    finally:
        for p in Path(dump).glob("*"):
            p.unlink()
        os.rmdir(dump)
    return label, hashlib.sha256(normalised_ptx(text).encode()).hexdigest()


def compare(before: Path, after: Path) -> int:
    def read(p):
        return dict(reversed(line.split(maxsplit=1)) for line in p.read_text().splitlines() if line.strip())

    a, b = read(before), read(after)
    diffs = [f"only before: {k}" for k in sorted(a.keys() - b.keys())]
    diffs += [f"only after: {k}" for k in sorted(b.keys() - a.keys())]
    diffs += [f"differs: {k}" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    print("\n".join(diffs))
    print(f"{len(a)} before, {len(b)} after, {len(diffs)} differences")
    return 1 if diffs else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--full-matrix", action="store_true")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--resume", action="store_true", help="keep --out's lines and hash only the others")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if a.out is None:
        ap.error("--out is required (or --compare)")
    found = collect(a.full_matrix)
    default = collect(False)
    order = list(default) + stratified([k for k in found if k not in default])  # the default run's first
    done = set()
    if a.resume and a.out.exists():
        done = {line.split()[1] for line in a.out.read_text().splitlines() if line.strip()}
    specs = [(k, found[k]) for k in order if k not in done]
    print(f"{len(found)} specialisations, {len(done)} already listed", flush=True)
    with ProcessPoolExecutor(max_workers=a.jobs) as pool, open(a.out, "a" if a.resume else "w") as out:
        for i, (label, digest) in enumerate(pool.map(_hash_one, specs, chunksize=1)):
            out.write(f"{digest} {label}\n")
            out.flush()
            if i % 50 == 0:
                print(f"{i}/{len(specs)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
