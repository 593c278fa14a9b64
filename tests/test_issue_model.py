"""The static issue model's arithmetic (mamba3_step.issue_model), on figures checked by hand."""

from __future__ import annotations

import pytest

from mamba3_step.bytes_model import bytes_per_step
from mamba3_step.issue_model import GPUS, UPSTREAM, issue_model, slab_bytes
from mamba3_step.spec import flagship_spec


def test_clock_is_derived_from_the_fp32_peak():
    assert GPUS["H100"].clock_hz == pytest.approx(67e12 / (132 * 256))  # ~1.98 GHz
    assert 1.9e9 < GPUS["H100"].clock_hz < 2.0e9 and 2.0e9 < GPUS["B200"].clock_hz < 2.2e9


def test_issue_and_memory_times_per_slab():
    gpu = GPUS["H100"]
    m = issue_model(7788, 70_000, gpu)
    assert m["issue_us"] == pytest.approx(7788 / 4 / gpu.clock_hz * 1e6)
    assert m["memory_us"] == pytest.approx(70_000 / (3.35e12 / 132) * 1e6)
    assert m["ratio"] == pytest.approx(m["issue_us"] / m["memory_us"])


def test_slab_bytes_is_the_step_per_lane_and_head():
    spec = flagship_spec()
    assert slab_bytes(spec, 8, 2) == bytes_per_step(spec, 8, 2)["total"] / 16
    # the fp32 (64 x 128) state, read and written, is most of it
    assert 65536 < slab_bytes(spec) < 1.1 * 65536


def test_upstream_constants_are_the_issue_figures():
    assert UPSTREAM["sm_90a"]["warp_instructions_per_slab"] == 1947 * 128 // 32 == 7788
    assert UPSTREAM["sm_100a"]["warp_instructions_per_slab"] == 7268
