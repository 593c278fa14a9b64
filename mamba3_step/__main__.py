"""``python -m mamba3_step {demo,precompile,inspect} ...``"""

from __future__ import annotations

import sys

COMMANDS = {
    "demo": ("mamba3_step.demo", "run a small pool-mode decode and check it against gather -> dense -> scatter"),
    "precompile": ("mamba3_step.compile_cache", "fill the ahead-of-time kernel cache"),
    "inspect": ("mamba3_step.inspect", "compile one specialisation and report what the compiler made of it"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m mamba3_step {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, helptext) in COMMANDS.items():
            print(f"  {name:<11} {helptext}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.cli_main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
