"""Input validation for the step: every bad input gets a ValueError/TypeError that names the
argument and says what was expected and what was got (docs/contract.md, "Errors").

* :func:`check_step_inputs` (``validation.step``) reads only metadata (shapes, dtypes, devices,
  strides, pointers): it never synchronises, so it is safe under CUDA-graph capture. It walks
  the table of ``validation.table`` (one row per tensor argument) and returns the complete
  :class:`~mamba3_step.spec.StepSpec` the call compiles to, tiling included.
* :func:`check_options` (``validation.step``) type-checks the non-tensor options (ints, bools).
* :func:`check_indices` (``validation.indices``) is the opt-in debug check of the index
  *values* (range, duplicate destinations, destination/source overlap). It synchronises.

The single checks (``validation.checks``) each raise one message; dtype problems raise
TypeError, everything else ValueError.
"""

from .indices import check_indices
from .step import check_options, check_step_inputs

__all__ = ["check_indices", "check_options", "check_step_inputs"]
