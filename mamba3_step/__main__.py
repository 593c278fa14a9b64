"""``python -m mamba3_step {demo,precompile,inspect} ...`` (see :mod:`mamba3_step.tools.cli`)."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
