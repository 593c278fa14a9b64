"""``python -m mamba3_step verify``: the kernel's PTX executed on the CPU and checked against float64.

:mod:`.step` checks a specialisation's step (values, bits, padding traffic, bytes); :mod:`.flush`
checks the flush forms of ``materialize_fn`` on rings the executed stepwise kernel built.
"""

from .flush import flush_check
from .step import (HELP, add_arguments, append_reference, executed_facts, replay_instructions, run, tolerance,
                   verify_instructions, verify_spec)

__all__ = ["HELP", "add_arguments", "append_reference", "executed_facts", "flush_check", "replay_instructions", "run",
           "tolerance", "verify_instructions", "verify_spec"]
