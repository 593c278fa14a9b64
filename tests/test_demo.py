"""`python -m mamba3_step demo`: exit code and parity report, in-process and as a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from mamba3_step import cli, demo

REPO = Path(__file__).resolve().parents[1]


def _max_err(text: str) -> float:
    m = re.search(r"max \|out - float64 reference\| = ([0-9.e+-]+)", text)
    assert m, text
    return float(m.group(1))


def test_demo_in_process_reports_parity(capsys):
    rc = cli.main(["demo", "--steps", "5", "--layers", "2", "--seed", "1", "--device", "cpu"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "device=cpu" in text and "PyTorch CPU path" in text
    assert "PARITY HELD" in text and "byte-identical" in text
    # one table row per step, every one ok
    rows = [l for l in text.splitlines() if re.match(r"^\s+\d+\s+\d+\s+", l)]
    assert len(rows) == 5 and all(r.split()[7] == "ok" for r in rows), text
    assert 0 < _max_err(text) < 0.05  # bf16 outputs: a few bf16 ulps of O(1) values
    assert re.search(r"\d+ live lanes, [1-9]\d* padded lanes", text), text  # padding really happened


def test_demo_null_slot_and_more_layers(capsys):
    rc = cli.main(["demo", "--steps", "4", "--layers", "3", "--null-slot", "--quiet", "--seed", "2"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "pad id 0 (row 0 reserved as null slot)" in text and "PARITY HELD" in text


def test_demo_fails_loudly_when_parity_breaks(capsys, monkeypatch):
    real = demo.gather_dense_scatter

    def off_by_one_ulp(*args, **kwargs):
        out = real(*args, **kwargs)
        flat = out.view(-1).view(torch.int16)
        flat[0] += 1  # one bit of one lane: still a parity failure
        return out

    monkeypatch.setattr(demo, "gather_dense_scatter", off_by_one_ulp)
    rc = cli.main(["demo", "--steps", "2", "--quiet"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "PARITY FAILED" in text and "out differs from the baseline" in text


def test_demo_bad_arguments(capsys):
    assert cli.main(["demo", "--buckets", "1,x"]) == 2
    assert cli.main(["demo", "--max-batch", "99"]) == 2
    assert cli.main(["demo", "--config", "48,32,2"]) == 2
    assert "N (dstate) must be one of" in capsys.readouterr().err
    assert cli.main(["demo", "--layers", "0"]) == 2
    if not torch.cuda.is_available():
        assert cli.main(["demo", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err or torch.cuda.is_available()


def test_demo_as_module_subprocess():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "mamba3_step", "demo", "--steps", "3", "--device", "cpu"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARITY HELD" in proc.stdout and "device=cpu" in proc.stdout
