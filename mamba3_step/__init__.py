"""mamba3_step: the Mamba-3 MIMO decode step over paged state pools.

``mamba3_step_fn`` runs the CuteDSL kernel on CUDA tensors and a PyTorch implementation
of the same contract on CPU tensors. See README.md and SPEC (docs/design.md).
"""

from .spec import StepSpec, flagship_spec

PAD_SLOT_ID = -1

from .api import mamba3_step_fn  # noqa: E402
from . import ops  # noqa: E402,F401  registers torch.ops.mamba3_step.step (torch.compile-friendly)
from .ops import mamba3_step_op  # noqa: E402

__all__ = ["PAD_SLOT_ID", "StepSpec", "flagship_spec", "mamba3_step_fn", "mamba3_step_op"]
__version__ = "0.1.0"
