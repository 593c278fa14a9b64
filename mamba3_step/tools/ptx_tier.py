"""The step kernel's PTX, executed on CPU tensors: ``ptx_step_fn`` and its pieces.

This is how the project runs its CuteDSL kernel without a GPU (docs/ptx-tier.md). For a
:class:`StepSpec` it compiles the kernel exactly as the launcher does (the same
``cute.compile`` call through :mod:`mamba3_step.build`, plus ``--keep-ptx``), takes the PTX
the DSL handed to ``ptxas``, and executes it with :mod:`ptx_executor` on the caller's CPU
tensors:

* parameters: one struct per tensor argument, laid out from the compiled host launcher's
  signature (``ir_module``), filled with each tensor's pointer and the extents and strides
  the compile-time signature marked dynamic (:func:`mamba3_step.build.argument_masks`);
  every struct's size is checked against the PTX ``.param`` declaration;
* launch: the kernel's grid rule (:func:`mamba3_step.tiling.launch_grid`, the slab pipeline's
  :func:`~mamba3_step.slab_pipeline.pipeline_grid`), its block size and
  dynamic shared memory read from the compiled launch configuration;
* memory: every tensor argument is a region; only the tensors the step may write
  (``state`` or ``state_out``, ``out``, and ``Bstate``/``Xstate`` with ``update_kv_state``)
  are writable, so a stray store into an input is a fault.

:func:`ptx_step_fn` has ``mamba3_step_fn``'s signature and contract (validation included) and
returns ``out``; :func:`run_step_ptx` returns the executor's :class:`~ptx_executor.RunResult`
(issue counts, the access log, and ``extra["memory"]``) for analyses. Importing this module
does not import cutlass; the first compile does.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from dataclasses import dataclass
from inspect import Parameter

import torch

import ptx_executor as ptx
from ..api import prepare_step
from ..build import argument_masks, compile_kernel
from ..signature import STEP_SIGNATURE, make_binder, split_call
from ..spec import StepSpec
from ..tensors import RING_FIELDS, StepTensors, kernel_arguments
from ..slab_pipeline import pipeline_grid
from ..tiling import launch_cluster, launch_grid, thread_layout
from ..validation.table import RULES, is_written

__all__ = ["PTXKernel", "ptx_kernel", "ptx_step_fn", "run_step_ptx", "writable_arguments"]


@dataclass(frozen=True)
class PTXKernel:
    """One specialisation's PTX and what a launch of it needs."""
    spec: StepSpec
    arch: str
    ptx_text: str
    module: ptx.Module
    names: tuple  # argument name of each kernel parameter, in order
    masks: tuple  # (dynamic shape modes, dynamic stride modes) per parameter, or "scalar"
    param_types: tuple  # ptx.LType per kernel parameter
    block: tuple
    dynamic_smem: int
    compiled: object  # the compile result (its cubin is the same as a plain compile's: compiler facts read it)


_KERNELS: dict = {}
_LOCK = threading.Lock()


def ptx_kernel(spec: StepSpec, arch: str = "sm_90a") -> PTXKernel:
    """Compile ``spec`` for ``arch`` and keep its PTX (once per process per (spec, arch))."""
    with _LOCK:
        if (spec, arch) in _KERNELS:
            return _KERNELS[(spec, arch)]
    dump = tempfile.mkdtemp(prefix="mamba3-ptx-")
    try:
        compiled = compile_kernel(spec, arch, extra_options=f"--keep-ptx --dump-dir {dump}")
        text = compiled.__ptx__
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    if not text:
        raise RuntimeError(f"the DSL returned no PTX for {spec.key()} @ {arch}")
    module = ptx.parse_module(text)
    params = module.entry().params
    kept = [(n, m) for n, m in argument_masks(spec)._asdict().items() if m is not None]  # absent tensors: no parameter
    ir_text = str(compiled.ir_module)
    host = ptx.host_signature(ir_text, compiled.function_name)
    if len(host) != len(kept) + 1 or len(params) != len(kept):  # the host also takes the stream
        raise RuntimeError(f"{spec.key()}: {len(kept)} kernel arguments, host signature {len(host)} "
                           f"(with the stream), PTX entry {len(params)} parameters")
    types = tuple(host[: len(kept)])
    for (name, _), t, p in zip(kept, types, params):
        if t.size_align()[0] != p.size:
            raise RuntimeError(f"{name}: struct {t} is {t.size_align()[0]} bytes, the PTX .param {p.size}")
    launch = ptx.launch_config(ir_text)
    block = launch["block"][0] if launch["block"] else (thread_layout(
        spec.dstate, spec.tile_D, spec.num_warps, spec.state_dtype, spec.mimo, spec.carried_tokens).num_threads, 1, 1)
    kernel = PTXKernel(spec, arch, text, module, tuple(n for n, _ in kept), tuple(m for _, m in kept), types,
                       tuple(block), max(launch["smem"], default=0), compiled)
    with _LOCK:
        _KERNELS[(spec, arch)] = kernel
    return kernel


def writable_arguments(spec: StepSpec) -> frozenset:
    """The tensors a step may write (everything else is registered read-only); a replay step writes
    its ring's entries and lengths too."""
    written = {rule.name for rule in RULES if is_written(rule, spec.has_state_out, spec.update_kv_state)}
    return frozenset(written | (set(RING_FIELDS) if spec.replay_ring else set()))


def _leaves(mask, value) -> list:
    """The values of one parameter struct: pointer, dynamic extents, dynamic strides."""
    if mask == "scalar":
        return [int(value)]
    shapes, strides = mask
    return ([value.data_ptr()] + [int(s) for s, dyn in zip(value.shape, shapes) if dyn]
            + [int(s) for s, dyn in zip(value.stride(), strides) if dyn])


#: run_step_ptx's default cluster: the one the kernel's launch asks for (tiling.launch_cluster)
LAUNCH_CLUSTER = "launch"


def run_step_ptx(spec: StepSpec, tensors: StepTensors, *, arch: str = "sm_90a", record: bool = True,
                 record_shared: bool = False, extra_regions: dict | None = None, ring=None,
                 cluster=LAUNCH_CLUSTER) -> ptx.RunResult:
    """Execute one step's kernel on CPU tensors (validated, ``out`` allocated, ``B > 0``).

    ``extra_regions`` (name -> tensor) registers more readable memory, e.g. a whole allocation
    around a pool view, to *observe* accesses to it rather than forbid them. ``ring``: a replay
    step's :class:`~mamba3_step.replay.Ring` (``spec.replay_ring``). ``cluster``: the launch's
    (default), or another (None: none) to see what a launch without it would do.
    """
    k = ptx_kernel(spec, arch)
    values = kernel_arguments(tensors, ring)._asdict()
    memory = ptx.GlobalMemory()
    writable = writable_arguments(spec)
    params = []
    for name, mask, ltype in zip(k.names, k.masks, k.param_types):
        if mask != "scalar":
            memory.add(name, values[name], writable=name in writable)
        params.append(ptx.pack(ltype, _leaves(mask, values[name])))
    for name, t in (extra_regions or {}).items():
        memory.add(name, t, writable=False)
    grid = (pipeline_grid(tensors.batch, tensors.xproj.shape[1], spec.headdim, spec.tile_D, spec.pipeline_ctas)
            if spec.pipeline_ctas else launch_grid(tensors.batch, tensors.xproj.shape[1], spec.headdim, spec.tile_D))
    result = ptx.run(k.module, grid=grid, block=k.block, params=params, memory=memory,
                     dynamic_smem=k.dynamic_smem, record=record, record_shared=record_shared,
                     cluster=launch_cluster(spec) if cluster == LAUNCH_CLUSTER else cluster)
    result.extra["memory"] = memory
    return result


_PTX_SIGNATURE = STEP_SIGNATURE.replace(
    parameters=[*STEP_SIGNATURE.parameters.values(), Parameter("arch", Parameter.KEYWORD_ONLY, default="sm_90a",
                                                                annotation="str")],
    return_annotation="torch.Tensor")
_bind_ptx = make_binder("ptx_step_fn", _PTX_SIGNATURE)


def ptx_step_fn(*args, **kwargs) -> torch.Tensor:
    """``mamba3_step_fn`` on CPU tensors, computed by executing the kernel's PTX.

    Same arguments, validation and in-place effects as :func:`mamba3_step.mamba3_step_fn`
    (plus ``arch``, the target whose PTX runs). A verification instrument: it runs the compiled
    kernel instruction by instruction, so keep shapes small.
    """
    values = _bind_ptx(*args, **kwargs)
    tensors, options = split_call(values)
    spec, tensors, out = prepare_step(tensors, **options._asdict())
    if tensors.batch > 0:
        run_step_ptx(spec, tensors, arch=values[-1])
    return out


ptx_step_fn.__signature__ = _PTX_SIGNATURE
