"""Build of the one optional C module, ``mamba3_step.validation._admit`` (issue 11).

Everything else is in pyproject.toml. The module makes the per-call admission check of a
validated call signature (``CheckedSignature.admits``, behind ``StepPlan.run`` and the eager
validation cache) a single C call; it needs a C compiler and Python's headers, not torch's.
``optional=True``: where it cannot be built (no compiler, no headers) the install goes on and the
library uses the pure-Python check, which gives the same verdicts (``mamba3_step.validation.NATIVE``
says which one is in use).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("mamba3_step.validation._admit", ["mamba3_step/validation/_admit.c"],
                             extra_compile_args=["-O2"], optional=True)])
