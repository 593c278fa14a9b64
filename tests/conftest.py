"""Pytest options, markers and fixtures for the mamba3_step test suite.

Shared helpers (input factory, pool indices, poisoning, the parity check) live in
``tests/helpers.py``: import them with ``from helpers import ...``.

Options and markers
-------------------
* ``--full-matrix``: opt in to the big matrices (the full compile cross product). Tests marked
  ``@pytest.mark.full_matrix`` are skipped without it; the ``full_matrix`` fixture returns the
  flag as a bool (skips nothing) for tests that only grow with it.
* ``@pytest.mark.gpu``: skipped when ``torch.cuda.is_available()`` is False. GPU tests live in
  ``tests/gpu/``.
* Every test process uses its own kernel cache directory (``MAMBA3_STEP_CACHE_DIR``).
"""

from __future__ import annotations

import os

import pytest
import torch


# --------------------------------------------------------------------------- options, markers
def pytest_addoption(parser):
    parser.addoption(
        "--full-matrix",
        action="store_true",
        default=False,
        help="run the big matrices (full compile cross product); tests marked full_matrix",
    )


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


@pytest.fixture
def full_matrix(request) -> bool:
    """True when pytest was given ``--full-matrix``."""
    return bool(request.config.getoption("--full-matrix"))


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
