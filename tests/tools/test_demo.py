"""`python -m mamba3_step demo`: exit code and parity report, in-process and as a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mamba3_step.tools import cli
from mamba3_step.tools.demo import decode as demo, speculative as demo_speculative
from mamba3_step.layer import Mamba3DecodeLayer
from mamba3_step.serving import StatePool
from mamba3_step.testing import LayerShape

SMALL = LayerShape(H=2, D=32, N=32, R=2)  # a small layer, quick on the CPU path

REPO = Path(__file__).resolve().parents[2]


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
    assert "REPLAY CHECK PASSED" in text and re.search(r"[1-9]\d* lane-steps wrote the state, [1-9]\d* only appended",
                                                        text), text
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


def test_demo_decodes_through_the_layer_and_checks_the_angle_rows(monkeypatch):
    """Each layer of each step is one Mamba3DecodeLayer decode (one step call); a wrong angle row fails."""
    calls = []
    real_decode, real_baseline = Mamba3DecodeLayer.decode_traced, demo._baseline

    def counted(self, *args, **kwargs):
        calls.append(self)
        return real_decode(self, *args, **kwargs)

    monkeypatch.setattr(Mamba3DecodeLayer, "decode_traced", counted)
    res = demo.run_toy_decode(steps=3, layers=2, shape=SMALL, seed=3)
    assert res.parity and len(calls) == 3 * 2 and len(set(map(id, calls))) == 2
    assert 0 < res.max_err <= 2 * res.max_err_fp32 + torch.finfo(torch.bfloat16).eps

    def off_angle(layer, base, d, null_slot_id):
        out = real_baseline(layer, base, d, null_slot_id)
        base.angle_state[int(d.dst[0])] += 1  # one unit (2**-64 turn) of one angle
        return out

    monkeypatch.setattr(demo, "_baseline", off_angle)
    res = demo.run_toy_decode(steps=1, layers=1, shape=SMALL, seed=3)
    assert res.failures == ["step 0 layer 0: angle_state pool differs from the baseline"]


def test_demo_bad_arguments(capsys):
    assert cli.main(["demo", "--buckets", "1,x"]) == 2
    assert cli.main(["demo", "--max-batch", "99"]) == 2
    assert cli.main(["demo", "--config", "48,32,2"]) == 2
    assert "N (dstate) must be one of" in capsys.readouterr().err
    assert cli.main(["demo", "--layers", "0"]) == 2
    if not torch.cuda.is_available():
        assert cli.main(["demo", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err or torch.cuda.is_available()


@pytest.mark.parametrize("argv,named", [(["--buckets", "0,1"], "--buckets"), (["--buckets", "2,2"], "--buckets"),
                                        (["--device", "xyz"], "--device"), (["--device", "meta"], "--device")])
def test_demo_bad_option_values_are_usage_errors(argv, named, capsys):
    """Each used to end in a traceback and exit 1."""
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err.splitlines()[-1] and "Traceback" not in err


def test_demo_as_module_subprocess():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "mamba3_step", "demo", "--steps", "3", "--device", "cpu"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARITY HELD" in proc.stdout and "device=cpu" in proc.stdout


# ---- the speculative-decoding round ----------------------------------------------------
_SPEC_SUMMARY = (r"speculative decoding: (\d+) verify steps x (\d+) layers, T=(\d+) tokens each \((\d+) random "
                 r"drafts\), (\d+) of (\d+) tokens accepted")


def test_demo_speculative_round_ran_and_matched_one_token_decoding(capsys):
    rc = cli.main(["demo", "--steps", "2", "--spec-rounds", "5", "--spec-tokens", "3", "--seed", "4"])
    text = capsys.readouterr().out
    assert rc == 0, text
    rows = [line for line in text.splitlines() if line.startswith("spec round ")]
    assert len(rows) == 5 and all(r.endswith(": ok") for r in rows), text
    m = re.search(_SPEC_SUMMARY, text)
    assert m, text
    steps, layers, T, drafts, accepted, verified = map(int, m.groups())
    assert (steps, layers, T, drafts) == (5, 2, 3, 2)
    assert 5 <= accepted < verified  # at least one token per request and round stands; some drafts were rejected
    assert "byte-identical to one-token-at-a-time decoding" in text and "SPECULATIVE CHECK PASSED" in text
    assert re.search(r"spec round \d: \d requests \(bucket \d, [1-9]\d* padded\)", text), text  # padded lanes


def test_speculative_round_records_and_skipping_it(capsys):
    res = demo.run_speculative_decode(rounds=6, tokens=4, requests=3, layers=2, shape=SMALL, seed=5)
    assert res.parity and not res.failures and len(res.records) == 6
    assert all(1 <= a <= 4 for r in res.records for a in r.accepted) and res.verified == 4 * sum(
        r.live for r in res.records)
    assert sum(r.left for r in res.records) > 0 and sum(r.joined for r in res.records) > 3  # requests came and went
    assert len({a for r in res.records for a in r.accepted}) > 1  # different numbers of tokens accepted
    assert cli.main(["demo", "--steps", "1", "--quiet", "--spec-tokens", "0"]) == 0
    assert "speculative decoding" not in capsys.readouterr().out
    assert cli.main(["demo", "--spec-tokens", "17"]) == 2
    assert cli.main(["demo", "--spec-rounds", "0"]) == 2


def test_demo_speculative_round_catches_a_wrong_rollback(capsys, monkeypatch):
    """A server that continues from the row before the accepted one (an off-by-one commit)."""
    real = StatePool.commit_accepted

    def off_by_one(self, groups, num_accepted_tokens):
        real(self, groups, [max(1, int(n) - 1) for n in num_accepted_tokens])

    monkeypatch.setattr(StatePool, "commit_accepted", off_by_one)
    rc = cli.main(["demo", "--steps", "1", "--spec-rounds", "3", "--quiet", "--seed", "1"])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "SPECULATIVE CHECK FAILED" in text and "NOT byte-identical" in text
    assert "differs from one-token decoding" in text and "current_rows is not the accepted row" in text
    assert "PARITY HELD" in text  # the toy decode before it was fine


def test_demo_speculative_round_compares_every_accepted_token(monkeypatch):
    """One bit of one accepted token's out in the one-token twin is enough to fail the round."""
    real = demo_speculative.decode_step
    calls = []

    def flipped(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 7:  # some token of some layer of some round
            out.view(-1).view(torch.int16)[0] ^= 1
        return out

    monkeypatch.setattr(demo_speculative, "decode_step", flipped)
    res = demo.run_speculative_decode(rounds=3, tokens=3, layers=2, shape=SMALL, seed=2)
    assert not res.parity
    assert [f for f in res.failures if "out differs from one-token decoding" in f], res.failures


def test_demo_speculative_round_catches_a_stray_write(monkeypatch):
    """A verify step that also wrote a row no request owns (the pool's last row is never allocated)."""
    real = demo_speculative._verify

    def stray(runners, idx, inputs):
        outs = real(runners, idx, inputs)
        runners[-1].pool.Xstate(1)[-1] += 1.0
        return outs

    monkeypatch.setattr(demo_speculative, "_verify", stray)
    res = demo.run_speculative_decode(rounds=2, tokens=2, layers=2, shape=SMALL, seed=6)
    assert not res.parity
    assert "round 0: layer 1: Xstate rows outside the groups changed" in res.failures, res.failures


def test_demo_replay_round_catches_a_wrong_commit(capsys, monkeypatch):
    """A replay that commits one draft too many: the materialised state leaves stepwise decoding."""
    from mamba3_step.tools.demo import replay as demo_replay
    real = demo_replay.replay_step

    def over_commit(t, ring, flush_length, num_accepted_tokens=None, **kw):
        accepted = num_accepted_tokens
        return real(t, ring, flush_length, num_accepted_tokens=None if accepted is None else (accepted + 1).clamp(max=3),
                    **kw)

    monkeypatch.setattr(demo_replay, "replay_step", over_commit)
    rc = cli.main(["demo", "--steps", "1", "--quiet", "--seed", "1"])
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "REPLAY CHECK FAILED" in text and "differs from stepwise decoding" in text
