"""``python -m mamba3_step``: one table of subcommands, one way to name a specialisation, one default."""

from __future__ import annotations

import argparse
import types

import pytest

from mamba3_step.tools import cli
from mamba3_step.spec import flagship_spec
from mamba3_step.slab_pipeline import PIPELINE_DEFAULT_CTAS
from mamba3_step.specsets import add_spec_arguments, specs_from_args


def _args(*argv):
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", [c.name for c in cli.COMMANDS])
def test_every_subcommand_defaults_to_the_flagship_as_servers_run_it(command):
    args = _args(command)
    assert specs_from_args(args) == [flagship_spec()]
    assert flagship_spec().pool and flagship_spec().update_kv_state  # as a server runs it


@pytest.mark.parametrize("command", ["precompile", "inspect"])
def test_spec_flags_mean_the_same_in_every_subcommand(command):
    args = _args(command, "--config", "64,32,2", "--config", "flagship", "--state-dtype", "bfloat16",
                 "--mode", "dense", "--no-z", "--no-update-kv-state")
    changes = dict(state_dtype="bfloat16", pool=False, has_z=False, update_kv_state=False)
    assert specs_from_args(args) == [flagship_spec(dstate=64, headdim=32, mimo=2, **changes),
                                     flagship_spec(**changes)]


UNPINNED, LATE, COPY = dict(unpinned_loads=True), dict(unpinned_loads=True, late_epilogue=True), dict(async_state_copy=True)
PIPE = dict(pipeline_ctas=PIPELINE_DEFAULT_CTAS)


@pytest.mark.parametrize("kernel, fields", [("registers", [{}]), ("async-copy", [COPY]), ("both", [{}, COPY]),
                                            ("unpinned", [UNPINNED]), ("late-epilogue", [LATE]),
                                            ("layouts", [{}, UNPINNED, LATE]), ("pipeline", [PIPE]),
                                            ("pipelined", [{}, PIPE])])
def test_the_kernel_flag_names_the_register_kernel_its_load_layouts_or_the_asynchronous_copy(kernel, fields):
    args = _args("inspect", "--kernel", kernel, "--config", "flagship", "--config", "64,32,2")
    want = [s.replace(**f) for s in (flagship_spec(), flagship_spec(dstate=64, headdim=32, mimo=2)) for f in fields]
    assert specs_from_args(args) == want
    with pytest.raises(SystemExit):
        _args("inspect", "--kernel", "warp-specialised")


def test_demo_takes_the_config_and_dtype_flags():
    args = _args("demo", "--config", "32,32,2", "--kv-dtype", "float16", "--x-dtype", "float16")
    (spec,) = specs_from_args(args)
    assert (spec.dstate, spec.headdim, spec.mimo, spec.kv_dtype, spec.x_dtype) == (32, 32, 2, "float16", "float16")


def test_a_config_that_names_a_dtype_the_flags_contradict_is_refused():
    with pytest.raises(ValueError, match="names state_dtype=bfloat16, but the flags ask for float16"):
        specs_from_args(_args("precompile", "--config", "128,64,4,bfloat16", "--state-dtype", "float16"))
    # the same dtype twice is fine
    assert specs_from_args(_args("precompile", "--config", "128,64,4,bfloat16", "--state-dtype", "bfloat16")) \
        == [flagship_spec(state_dtype="bfloat16")]


def test_adding_a_subcommand_is_one_table_entry(monkeypatch, capsys):
    """A new subcommand (like ``verify``) is a module with HELP, add_arguments and run; it reuses
    the shared specialisation flags."""
    seen = {}

    def add_arguments(p: argparse.ArgumentParser) -> None:
        add_spec_arguments(p)
        p.add_argument("--rounds", type=int, default=1)

    def run(args, parser) -> int:
        seen["specs"], seen["rounds"] = specs_from_args(args), args.rounds
        return 3

    probe = types.SimpleNamespace(HELP="check something", add_arguments=add_arguments, run=run)
    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + (cli.Command("probe", probe),))
    assert cli.main(["probe", "--config", "32,32,1", "--rounds", "2"]) == 3
    assert seen == {"specs": [flagship_spec(dstate=32, headdim=32, mimo=1)], "rounds": 2}
    assert cli.main(["--help"]) == 0
    assert "probe" in capsys.readouterr().out


def test_no_or_unknown_subcommand_exits_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_multi_token_flags_name_the_speculative_specialisation():
    args = _args("precompile", "--tokens", "4", "--dst-per-token", "--num-accepted")
    assert specs_from_args(args) == [flagship_spec(tokens=4, has_dst=True, dst_per_token=True, num_accepted=True)]
    assert specs_from_args(_args("inspect", "--tokens", "3")) == [flagship_spec(tokens=3)]


@pytest.mark.parametrize("argv,message", [
    (["--tokens", "0"], "tokens must be an int in"),
    (["--tokens", "17"], "tokens must be an int in"),
    (["--dst-per-token"], "--dst-per-token needs --tokens of at least 2"),
    (["--tokens", "2", "--num-accepted", "--mode", "dense", "--no-update-kv-state"], "need --mode pool"),
])
def test_bad_multi_token_flags_are_refused_with_the_flag_named(argv, message):
    with pytest.raises(ValueError, match=message):
        specs_from_args(_args("precompile", *argv))


@pytest.mark.parametrize("argv, named", [
    (["demo", "--layers", "99999999999999999999"], "--layers"),
    (["demo", "--slots", "99999999999999999999"], "--slots"),
    (["demo", "--heads", "99999999999999999999"], "--heads"),
    (["demo", "--seed", "99999999999999999999"], "--seed"),
    (["demo", "--steps", "99999999999999999999"], "--steps"),
    (["demo", "--spec-rounds", "99999999999999999999"], "--spec-rounds"),
    (["demo", "--buckets", "99999999999999999999"], "--buckets"),
    (["verify", "--batch", "99999999999999999999"], "--batch"),
    (["verify", "--heads", "99999999999999999999"], "--heads"),
    (["verify", "--seed", "-99999999999999999999"], "--seed"),
    (["inspect", "--heads", "99999999"], "--heads"),
])
def test_out_of_range_option_values_are_usage_errors(argv, named, capsys):
    """Each used to end in a traceback (an allocation, or an int beyond 64 bits) or run forever."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert named in err.splitlines()[-1] and "Traceback" not in err


def test_rotary_flags_name_the_rotary_specialisation():
    args = _args("precompile", "--rope-angles", "32", "--bc-bias", "--shared-bc")
    assert specs_from_args(args) == [flagship_spec(rope_angles=32, has_bc_bias=True, shared_bc=True)]
    args = _args("inspect", "--config", "64,32,1", "--rope-angles", "32", "--rotate-pairwise")
    assert specs_from_args(args) == [flagship_spec(dstate=64, headdim=32, mimo=1, rope_angles=32,
                                                   rotate_pairwise=True)]


@pytest.mark.parametrize("argv, message", [
    (["--rotate-pairwise"], "--rotate-pairwise and --bc-bias need --rope-angles S > 0"),
    (["--bc-bias"], "--rotate-pairwise and --bc-bias need --rope-angles S > 0"),
    (["--rope-angles", "-1"], "--rope-angles: expected S >= 0"),
    (["--rope-angles", "65"], r"rope_angles \(S\) must be an int in \[0, N/2 = 64\]"),
    (["--rope-angles", "8", "--tile-d", "32"], "rope_angles > 0 needs tile_D >= headdim"),
])
def test_bad_rotary_flags_are_refused_with_the_flag_named(argv, message):
    with pytest.raises(ValueError, match=message):
        specs_from_args(_args("precompile", *argv))


def test_verify_runs_a_rotary_specialisation(capsys):
    argv = ["verify", "--config", "32,32,1", "--rope-angles", "8", "--rotate-pairwise", "--shared-bc", "--batch", "3",
            "--heads", "2"]
    assert cli.main(argv) == 0
    assert "rope8+pairwise+sharedBC" in capsys.readouterr().out


def test_stochastic_rounding_flag_names_the_specialisation():
    args = _args("precompile", "--state-dtype", "bfloat16", "--stochastic-rounding")
    assert specs_from_args(args) == [flagship_spec(state_dtype="bfloat16", stochastic_rounding=True)]
    with pytest.raises(ValueError, match="stochastic_rounding needs a 16- or 8-bit state"):
        specs_from_args(_args("inspect", "--stochastic-rounding"))
