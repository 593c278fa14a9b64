"""Input validation for the step: every bad input gets a ValueError/TypeError that names the
argument and says what was expected and what was got (docs/contract.md, "Errors").

* :func:`check_step_inputs` (``validation.step``) reads only metadata (shapes, dtypes, devices,
  strides, pointers): it never synchronises, so it is safe under CUDA-graph capture. It walks
  the table of ``validation.table`` (one row per tensor argument) and returns the complete
  :class:`~mamba3_step.spec.StepSpec` the call compiles to, tiling included.
* :func:`check_options` (``validation.step``) type-checks the non-tensor options (ints, bools).
* :func:`check_step_inputs_cached` (``validation.cache``) gives the same result or raises the same
  error as :func:`check_step_inputs`, validating each call signature (everything it reads but
  the data pointers) once: a repeated signature costs only guard and address checks. The
  :class:`CheckedSignature` it keeps is also what a ``StepPlan`` checks every call against.
* :func:`check_indices` (``validation.indices``) is the opt-in debug check of the index
  *values* (range, duplicate destinations, destination/source overlap). It synchronises.

The single checks (``validation.checks``) each raise one message; dtype problems raise
TypeError, everything else ValueError.
"""

from .cache import NATIVE, VALIDATION_CACHE, CheckedSignature, ValidationCache, check_step_inputs_cached
from .indices import check_indices
from .step import check_options, check_step_inputs

__all__ = ["NATIVE", "VALIDATION_CACHE", "CheckedSignature", "ValidationCache", "check_indices", "check_options",
           "check_step_inputs", "check_step_inputs_cached"]
