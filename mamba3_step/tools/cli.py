"""``python -m mamba3_step <command> [options]``: one entry point, one table of subcommands.

A subcommand is one row of :data:`COMMANDS`: its name, a one-line help, and a module with
``add_arguments(parser)`` (its flags) and ``run(args, parser) -> int`` (its exit status; bad
flags go to ``parser.error``, exit status 2). Subcommands that work on specialisations name
them with the shared flags of :mod:`mamba3_step.specsets` (re-exported here:
:func:`add_spec_arguments` in ``add_arguments``; :func:`specs_from_args` / :func:`arch_from_args`,
or both through :func:`parse_spec_args`, in ``run``), so every subcommand takes
``--config flagship|all|N,D,R`` and the same dtype and mode flags, with the same default:
the flagship as servers run it.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import NamedTuple

from .demo import decode as demo
from .verify import step as verify
from . import precompile as precompile_cli
from .inspection import report
from ..specsets import add_spec_arguments, arch_from_args, parse_spec_args, specs_from_args

__all__ = ["COMMANDS", "Command", "add_spec_arguments", "arch_from_args", "build_parser", "main", "parse_spec_args",
           "specs_from_args"]


class Command(NamedTuple):
    name: str
    module: ModuleType  # has HELP, add_arguments(parser) and run(args, parser) -> int


COMMANDS = (
    Command("demo", demo),
    Command("precompile", precompile_cli),
    Command("inspect", report),
    Command("verify", verify),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mamba3_step",
                                     description="mamba3_step: the Mamba-3 MIMO decode step over paged state pools")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(c.name for c in COMMANDS) + "}")
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.module.HELP, prog=f"python -m mamba3_step {command.name}")
        command.module.add_arguments(p)
        p.set_defaults(_command=command, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit status (2 for bad flags, 0 for ``--help``)."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        if getattr(args, "_command", None) is None:
            parser.print_help()
            return 2
        return int(args._command.module.run(args, args._parser) or 0)
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2, message already printed)
        return e.code if isinstance(e.code, int) else 2
