"""``python -m mamba3_step verify`` and ``inspect --executed``: the PTX tier for people changing the
kernel without a GPU. The rows must pass on the real kernel and fail when the kernel is wrong."""

from __future__ import annotations

import json

import pytest

from mamba3_step.tools import cli
from mamba3_step.tools.verify import step as verify
from mamba3_step.spec import StepSpec, flagship_spec


def test_verify_row_of_the_flagship_passes_with_every_check():
    row = verify.verify_spec(flagship_spec(), "sm_90a", batch=6, heads=2)
    assert row["ok"] and row["fault"] is None and row["parity"] and row["accurate"]
    assert row["padding_bytes"] == 0 and row["races"] == 0
    assert 0 < row["err_out"] <= verify.tolerance(row["budget_out"], 1.0)
    assert row["budget_out"] > 0 and row["budget_state"] > 0


def test_verify_reports_a_wrong_kernel(monkeypatch):
    """A kernel that writes garbage into out (here: the executed run, corrupted afterwards) fails
    the row and the command exits 1."""
    real = verify.run_step_ptx

    def corrupted(spec, tensors, **kw):
        result = real(spec, tensors, **kw)
        tensors.out.add_(1.0)
        return result

    monkeypatch.setattr(verify, "run_step_ptx", corrupted)
    row = verify.verify_spec(StepSpec(32, 32, 1, pool=True).with_default_tiling(), "sm_90a", batch=4, heads=1)
    assert not row["accurate"] and not row["ok"]


def test_verify_cli_table_json_and_exit_status(capsys):
    assert cli.main(["verify", "--config", "32,32,1", "--batch", "4", "--heads", "1", "--dst"]) == 0
    out = capsys.readouterr().out
    assert "N32 D32 R1" in out and "1 specialisation(s): 1 passed, 0 failed" in out
    assert cli.main(["verify", "--config", "32,32,1", "--batch", "4", "--heads", "1", "--json",
                     "--mode", "dense", "--no-update-kv-state"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["ok"] and row["spec"]["pool"] is False and row["parity"]  # dense: its pool twin's parity
    assert cli.main(["verify", "--batch", "1"]) == 2


def test_executed_facts_agree_with_the_bytes_model_and_count_instructions():
    facts = verify.executed_facts(flagship_spec(), "sm_90a", batch=2, heads=1)
    assert facts["bytes_agree"], facts["bytes"]
    mix = facts["warp_instructions_per_cta"]
    assert mix["FFMA"] > 0.4 * mix["total"]  # the state update is most of what a CTA issues
    g = facts["global"]
    assert g["sectors"] >= g["ideal_sectors"] > 0
    assert facts["shared"]["wavefronts"] >= facts["shared"]["ideal_wavefronts"] > 0


@pytest.mark.parametrize("argv", [["inspect", "--executed", "--json", "--config", "32,32,1"]])
def test_inspect_executed_json(argv, capsys):
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["executed"]["bytes_agree"] and report["executed"]["ctas"] == 4 * 2


@pytest.mark.parametrize("changes", [dict(tokens=3, has_dst=True, dst_per_token=True, num_accepted=True),
                                     dict(tokens=2, pool=False, update_kv_state=False)],
                         ids=["speculative", "dense"])
def test_verify_rows_of_multi_token_specialisations_pass(changes):
    row = verify.verify_spec(flagship_spec(dstate=32, headdim=32, mimo=2, **changes), "sm_90a", batch=7, heads=1)
    assert row["ok"] and row["parity"] and row["padding_bytes"] == 0 and row["races"] == 0, row
    assert "T" + str(changes["tokens"]) in row["label"]


def test_executed_facts_of_a_speculative_step_agree_with_the_bytes_model():
    spec = flagship_spec(dstate=32, headdim=32, mimo=2, tokens=3, has_dst=True, dst_per_token=True,
                         num_accepted=True)
    facts = verify.executed_facts(spec, "sm_90a", batch=2, heads=1)
    assert facts["bytes_agree"], facts["bytes"]
    assert facts["bytes"]["state"]["executed"] == 2 * 32 * 32 * 4 * (1 + 3)  # read once, written per token


@pytest.mark.parametrize("from_checkpoint", [False, True])
def test_verify_rows_of_replay_specialisations_pass(from_checkpoint):
    spec = flagship_spec(dstate=32, headdim=32, mimo=2, replay_ring=3, replay_from_checkpoint=from_checkpoint)
    row = verify.verify_spec(spec, "sm_90a", batch=6, heads=1)
    assert row["ok"] and row["parity"] and row["accurate"] and row["padding_bytes"] == 0 and row["races"] == 0, row
    assert "replay3" in row["label"] and (row["err_out"] > 0) == from_checkpoint


def test_verify_row_of_a_replay_verify_specialisation_passes():
    """Verify steps (T = 2 drafts, each accepted by the row's next step) against the stepwise T-token kernel."""
    spec = flagship_spec(dstate=32, headdim=32, mimo=2, replay_ring=2, tokens=2, num_accepted=True)
    row = verify.verify_spec(spec, "sm_90a", batch=6, heads=1)
    assert row["ok"] and row["parity"] and row["padding_bytes"] == 0 and row["races"] == 0, row
    assert "T2" in row["label"] and "accepted" in row["label"] and "replay2" in row["label"]


def test_verify_reports_a_wrong_replay_kernel(monkeypatch):
    """A replay kernel whose out is off by one unit fails parity (its outs are the stepwise kernel's)."""
    real = verify.run_step_ptx

    def corrupted(spec, tensors, ring=None, **kw):
        result = real(spec, tensors, ring=ring, **kw)
        if ring is not None:
            tensors.out.add_(1.0)
        return result

    monkeypatch.setattr(verify, "run_step_ptx", corrupted)
    row = verify.verify_spec(flagship_spec(dstate=32, headdim=32, mimo=1, replay_ring=2), "sm_90a", batch=4, heads=1)
    assert not row["parity"] and not row["ok"]
    spec = flagship_spec(dstate=32, headdim=32, mimo=1, replay_ring=2, tokens=2, num_accepted=True)
    row = verify.verify_spec(spec, "sm_90a", batch=4, heads=1)
    assert not row["parity"] and not row["ok"]


def test_verify_checks_materialize_flush_forms(capsys, monkeypatch):
    """--materialize-ring L: rings built by the executed stepwise kernel (rotary angles and stochastic
    draws recorded as a replay step records them), the flush form's rows equal to its rows bit for bit;
    a flush form that loses one entry fails; --facts is refused."""
    argv = ["verify", "--config", "32,32,1", "--batch", "4", "--heads", "1", "--materialize-ring", "3"]
    assert cli.main([*argv, "--rope-angles", "4", "--bc-bias", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["ok"] and row["parity"] and row["padding_bytes"] == 0 and row["spec"]["replay_ring"] == 1
    assert cli.main([*argv, "--state-dtype", "int8", "--stochastic-rounding"]) == 0
    assert "replay1+draft3" in capsys.readouterr().out
    assert cli.main([*argv, "--facts"]) == 2
    from mamba3_step.tools.verify import flush as verify_flush

    real = verify_flush.flush_form

    def short(t, ring, rows, **kw):  # the copies see one committed entry fewer
        return real(t, ring._replace(length=(ring.length - 1).clamp(min=0)), rows, **kw)

    monkeypatch.setattr(verify_flush, "flush_form", short)
    assert cli.main([*argv, "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["parity"]


def test_verify_cli_replay_flags(capsys):
    assert cli.main(["verify", "--config", "32,32,1", "--batch", "4", "--heads", "1", "--replay-ring", "2"]) == 0
    assert "replay2" in capsys.readouterr().out
    assert cli.main(["verify", "--config", "32,32,1", "--replay-from-checkpoint"]) == 2
    assert "--replay-from-checkpoint needs --replay-ring" in capsys.readouterr().err
    assert cli.main(["verify", "--config", "32,32,1", "--batch", "4", "--heads", "1", "--replay-ring", "2", "--dst"]) == 0
    assert "pool+dst+kv+z+outproj+replay2" in capsys.readouterr().out  # destinations: moves flush into them
    assert cli.main(["verify", "--config", "32,32,1", "--replay-ring", "2", "--dst", "--tokens", "2"]) == 2
    assert "replay_ring with has_dst takes one-token steps" in capsys.readouterr().err
    # rotary: the angle rows are the pools' too (until 2026-11-27 the check built a ring without angles and crashed)
    assert cli.main(["verify", "--config", "32,32,1", "--batch", "4", "--heads", "1", "--replay-ring", "2",
                     "--rope-angles", "4", "--bc-bias"]) == 0
    assert "rope4+bcbias+replay2" in capsys.readouterr().out
    # and stochastic rounding: the ring keeps its draws (the same crash, found reading the change again)
    assert cli.main(["verify", "--config", "32,32,1", "--batch", "4", "--heads", "1", "--replay-ring", "2",
                     "--state-dtype", "bfloat16", "--stochastic-rounding"]) == 0
