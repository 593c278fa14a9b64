"""Pytest options, markers and fixtures for the mamba3_step test suite.

Shared helpers (input factory, pool indices, poisoning, the parity check) live in
``tests/helpers.py``: import them with ``from helpers import ...``.

Options and markers
-------------------
* ``--full-matrix``: opt in to the big matrices (the full compile cross product). Tests marked
  ``@pytest.mark.full_matrix`` are skipped without it; the ``full_matrix`` fixture returns the
  flag as a bool (skips nothing) for tests that only grow with it.
* ``--fuzz-long``: the public-surface fuzz harness runs 20,000 examples instead of its default
  budget (the ``fuzz_examples`` fixture).
* ``@pytest.mark.gpu``: skipped when ``torch.cuda.is_available()`` is False. GPU tests live in
  ``tests/gpu/``.
* Every test process uses its own kernel cache directory (``MAMBA3_STEP_CACHE_DIR``).

Parallel runs
-------------
``pyproject.toml`` runs the suite on ``pytest-xdist`` workers (``-n auto --dist loadgroup``; at
most :data:`MAX_WORKERS`, ``-n0`` for one process). Compiling a specialisation is the costly part
and each process compiles a specialisation once per architecture (``ptx_tier.ptx_kernel`` and
test_kernel_compile's facts), so the tests that take one specialisation as a parameter (its
compiler facts, its executed checks) share an ``xdist_group`` per architecture and run in one
process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from mamba3_step import compile_cache as cc
from mamba3_step.compile_cache import front

#: the suite's folders, by the layer they test: contract/ (the contract and the CPU path), kernel/
#: (compiles and their facts), ptx/ (the kernel's PTX executed), serving/, tools/, package/ (the
#: package's shape and docs), gpu/. The shared helpers (helpers.py, ptx_harness.py, the fuzz surfaces)
#: stay in tests/, and kernel/test_kernel_compile.py's specialisation tables are imported by the PTX
#: tier's tests: both folders are importable from every test.
TESTS = Path(__file__).resolve().parent
for _folder in (TESTS, TESTS / "kernel"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


# --------------------------------------------------------------------------- options, markers
def pytest_addoption(parser):
    parser.addoption(
        "--full-matrix",
        action="store_true",
        default=False,
        help="run the big matrices (full compile cross product); tests marked full_matrix",
    )
    parser.addoption(
        "--fuzz-long",
        action="store_true",
        default=False,
        help="run the public-surface fuzz harness (tests/contract/test_fuzz_surface.py) for 20,000 examples",
    )


#: at most this many xdist workers with ``-n auto`` (each imports torch and the DSL, and compiles)
MAX_WORKERS = 8

#: the tables of test_kernel_compile.py that name a specialisation by its ``name`` parameter (the
#: PTX execution tier's test modules import COVERING and MULTI_TOKEN from there)
_SPEC_TABLES = ("COVERING", "MULTI_TOKEN", "COVERING_TOKENS")


def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def _compile_group(item) -> str | None:
    """``key@arch`` of the specialisation a test compiles, when it takes one as a parameter (a
    ``name`` of one of :data:`_SPEC_TABLES`, or a ``spec``; ``arch`` defaults to sm_90a, the PTX
    execution tier's), else None."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    spec = params.get("spec")
    if spec is None and "name" in params:
        tables = [getattr(item.module, t, None) for t in _SPEC_TABLES]
        spec = next((t[params["name"]] for t in tables if isinstance(t, dict) and params["name"] in t), None)
    try:
        key = spec.with_default_tiling().key()
    except Exception:  # not a specialisation, or not a compilable one: no group
        return None
    return f"{key}@{params.get('arch', 'sm_90a')}"


def pytest_collection_modifyitems(config, items):
    full = config.getoption("--full-matrix")
    has_cuda = torch.cuda.is_available()
    skip_full = pytest.mark.skip(reason="big matrix: run with --full-matrix")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("full_matrix") is not None and not full:
            item.add_marker(skip_full)
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(skip_gpu)
        group = _compile_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def full_matrix(request) -> bool:
    """True when pytest was given ``--full-matrix``."""
    return bool(request.config.getoption("--full-matrix"))


@pytest.fixture
def fuzz_examples(request) -> int:
    """Examples of the public-surface fuzz harness: 20,000 with ``--fuzz-long``, else 400."""
    return 20_000 if request.config.getoption("--fuzz-long") else 400


@pytest.fixture(autouse=True, scope="session")
def _private_kernel_cache(tmp_path_factory):
    """Every test process uses its own kernel cache dir: no test writes to the user's cache."""
    old = os.environ.get("MAMBA3_STEP_CACHE_DIR")
    os.environ["MAMBA3_STEP_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernel-cache"))
    yield
    if old is None:
        os.environ.pop("MAMBA3_STEP_CACHE_DIR", None)
    else:
        os.environ["MAMBA3_STEP_CACHE_DIR"] = old


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """A fresh kernel cache dir (also as ``$XDG_CACHE_HOME``'s default), memory cache, counters and
    warn-once state for one test; the compile-cache test files use it for every test. Yields the
    (not yet created) cache dir."""
    root = tmp_path / "cache"
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(front, "_WARNED", set())
    cc.set_builder(None)
    cc.reset_memory_cache()
    cc.COUNTERS.reset()
    yield root
    cc.set_builder(None)
    cc.reset_memory_cache()

