"""mamba3_step: the Mamba-3 MIMO decode step over paged state pools.

``mamba3_step_fn`` runs the CuteDSL kernel on CUDA tensors and a PyTorch implementation
of the same contract on CPU tensors; ``plan_step`` validates a call signature once for servers
(``StepPlan.run`` per step); both take the replay mode (``replay_ring``: pools kept as checkpoints and
rings). The contract: docs/contract.md; the layers of the
package: docs/design/architecture.md.
"""

from . import ops  # noqa: F401  registers torch.ops.mamba3_step.step (torch.compile-friendly)
from .api import mamba3_step_fn
from .materialize import materialize_fn
from .contract import PAD_SLOT_ID
from .ops import mamba3_step_op
from .plan import StepPlan, StepPlanMismatch, plan_step
from .replay import Ring, materialize, new_ring
from .rotary import angle_from_radians, angle_to_radians
from .spec import StepSpec, flagship_rotary_spec, flagship_spec

__all__ = ["PAD_SLOT_ID", "Ring", "StepPlan", "StepPlanMismatch", "StepSpec", "angle_from_radians", "angle_to_radians",
           "flagship_rotary_spec", "flagship_spec", "mamba3_step_fn", "mamba3_step_op", "materialize", "materialize_fn",
           "new_ring", "plan_step"]
__version__ = "0.1.0"
