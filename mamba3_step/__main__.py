"""``python -m mamba3_step {demo,precompile,inspect} ...`` (see :mod:`mamba3_step.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
