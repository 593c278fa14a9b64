"""The CuteDSL Mamba-3 MIMO decode-step kernel, as a package of parts.

:class:`Mamba3StepKernel` (:mod:`.step`) is one specialisation: it composes the device-side parts,
one mixin per module (the token loop, replay, outputs from the checkpoint, staging, the rotary angle,
the slab, the update, the epilogue, the random bits), and holds the state's storage format
(:mod:`.state_formats`). :mod:`.bundles` declares the values the parts pass each other,
:mod:`.ptx_ops` the single PTX instructions, :mod:`.compile` the compile function.

Without a GPU the compiled kernel is verified by executing its PTX on the CPU
(:mod:`mamba3_step.tools.ptx_tier`, docs/ptx-tier.md).

Where this package sits (docs/design/architecture.md): it imports cutlass, so only the build
layer (:mod:`mamba3_step.build`) imports it, on the first compile. Launching goes through
:mod:`mamba3_step.launch` and the compile cache, which never import it; the runtime arguments
(:class:`~mamba3_step.tensors.KernelArgs`) are declared, free of cutlass, in
:mod:`mamba3_step.tensors`. Every module of this package, and whatever they import from the
package, is part of the disk cache's key (:func:`mamba3_step.build.kernel_sources`).
"""

from .bundles import CUTLASS_DTYPES, Cta, Drafts, Operands, RowGroup, Shared, Token
from .compile import argument_masks, compile_step_kernel, fake_arguments
from .epilogue import reduction_plan
from .ptx_ops import inline_ptx
from .state_formats import RoundedState, ScaledState, StateFormat, state_format
from .step import Mamba3StepKernel

__all__ = ["CUTLASS_DTYPES", "Cta", "Drafts", "Mamba3StepKernel", "Operands", "RowGroup", "Shared", "Token",
           "argument_masks", "compile_step_kernel", "fake_arguments", "inline_ptx", "reduction_plan", "RoundedState",
           "ScaledState", "StateFormat", "state_format"]
