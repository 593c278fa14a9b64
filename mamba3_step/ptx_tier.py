"""The step kernel's PTX, executed on CPU tensors: ``ptx_step_fn`` and its pieces.

This is how the project runs its CuteDSL kernel without a GPU. For a :class:`StepSpec`
it compiles the kernel exactly as the launcher does (same ``cute.compile`` call, plus
``--keep-ptx``), takes the PTX the DSL handed to ``ptxas``, and executes it with
:mod:`mamba3_step.ptx` on the caller's CPU tensors:

* parameters: one struct per tensor argument, laid out from the compiled host launcher's
  signature (``ir_module``), filled with each tensor's pointer and the dynamic extents
  and strides the DSL marked dynamic (``fake_arguments``); every struct's size is checked
  against the PTX ``.param`` declaration;
* launch: the kernel's own grid rule (:meth:`Mamba3StepKernel.grid`), its block size and
  dynamic shared-memory size read from the compiled launch configuration;
* memory: every tensor argument is a region; only the tensors the step may write
  (``state`` or ``state_out``, ``out``, and ``Bstate``/``Xstate`` with
  ``update_kv_state``) are writable, so a stray store into an input is a fault.

:func:`ptx_step_fn` has ``mamba3_step_fn``'s signature and contract (validation included)
and returns ``out``; :func:`run_step_ptx` returns the executor's
:class:`~mamba3_step.ptx.RunResult` (issue counts and the access log) for analyses.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from dataclasses import dataclass

import torch

from . import ptx
from .api import prepare_step
from .inspect import _launch_config
from .kernel import Mamba3StepKernel, compile_step_kernel, fake_arguments, kernel_arguments
from .spec import StepSpec

#: kernel_arguments' tensor order (the 19th argument is null_slot)
ARGUMENT_NAMES = ("state", "Bstate", "Xstate", "A", "B", "C", "D", "x", "dt", "trap", "xproj", "zproj",
                  "outproj", "z", "out", "state_out", "state_batch_indices", "dst_state_batch_indices")


@dataclass(frozen=True)
class PTXKernel:
    """One specialisation's PTX and what a launch of it needs."""
    spec: StepSpec
    arch: str
    ptx_text: str
    module: ptx.Module
    param_types: tuple  # LType per kernel parameter (tensor structs, then null_slot)
    fakes: tuple  # the compile-time argument of each kernel parameter (FakeTensor or scalar)
    names: tuple  # argument name of each kernel parameter
    block: tuple
    dynamic_smem: int


_KERNELS: dict = {}
_LOCK = threading.Lock()


def ptx_kernel(spec: StepSpec, arch: str = "sm_90a") -> PTXKernel:
    """Compile ``spec`` for ``arch`` and keep its PTX (once per process per (spec, arch))."""
    key = (spec, arch)
    with _LOCK:
        if key in _KERNELS:
            return _KERNELS[key]
    dump = tempfile.mkdtemp(prefix="mamba3-ptx-")
    try:
        compiled = compile_step_kernel(spec, arch, extra_options=f"--keep-ptx --dump-dir {dump}")
        text = compiled.__ptx__
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    if not text:
        raise RuntimeError(f"the DSL returned no PTX for {spec.key()} @ {arch}")
    module = ptx.parse_module(text)
    entry = module.entry()
    host = ptx.host_signature(str(compiled.ir_module), compiled.function_name)
    fakes_all = fake_arguments(spec)[:-1]  # the stream is not a kernel parameter
    kept = [(n, f) for n, f in zip(ARGUMENT_NAMES + ("null_slot",), fakes_all) if f is not None]
    types = tuple(host[: len(kept)])
    if len(host) != len(kept) + 1 or len(entry.params) != len(kept):
        raise RuntimeError(f"{spec.key()}: {len(kept)} kernel arguments, host signature has {len(host)} "
                           f"(with the stream), the PTX entry {len(entry.params)} parameters")
    for (name, _), t, p in zip(kept, types, entry.params):
        if t.size_align()[0] != p.size:
            raise RuntimeError(f"{name}: struct {t} is {t.size_align()[0]} bytes, the PTX .param {p.size}")
    launch = _launch_config(compiled)
    smem = max(launch["smem"]) if launch["smem"] else 0
    block = launch["block"][0] if launch["block"] else (Mamba3StepKernel(spec).num_threads, 1, 1)
    k = PTXKernel(spec, arch, text, module, types, tuple(f for _, f in kept), tuple(n for n, _ in kept),
                  tuple(block), smem)
    with _LOCK:
        _KERNELS[key] = k
    return k


def _tensor_leaves(fake, t: torch.Tensor) -> list:
    """Pointer, then the dynamic extents, then the dynamic strides (the DSL's struct order)."""
    shapes = [int(s) for s, dyn in zip(t.shape, fake.dynamic_shapes_mask) if dyn]
    strides = [int(s) for s, dyn in zip(t.stride(), fake.dynamic_strides_mask) if dyn]
    return [t.data_ptr()] + shapes + strides


def writable_arguments(spec: StepSpec) -> frozenset:
    """The tensors a step may write (everything else is registered read-only)."""
    names = {"out", "state_out" if spec.has_state_out else "state"}
    if spec.update_kv_state:
        names |= {"Bstate", "Xstate"}
    return frozenset(names)


def run_step_ptx(spec: StepSpec, *, arch: str = "sm_90a", record: bool = True, record_shared: bool = False,
                 extra_regions: dict | None = None, **tensors) -> ptx.RunResult:
    """Execute one step's kernel on CPU tensors (already validated; ``out`` given).

    ``tensors`` are ``mamba3_step_fn``'s tensors by name plus ``null_slot_id``.
    ``extra_regions`` (name -> tensor) registers more readable memory, e.g. a whole
    allocation around a pool view, to *observe* rather than forbid accesses to it.
    """
    k = ptx_kernel(spec, arch)
    args = kernel_arguments(spec, **tensors)
    by_name = dict(zip(ARGUMENT_NAMES + ("null_slot",), args))
    memory = ptx.GlobalMemory()
    writable = writable_arguments(spec)
    params = []
    for name, fake, ltype in zip(k.names, k.fakes, k.param_types):
        value = by_name[name]
        if isinstance(value, torch.Tensor):
            memory.add(name, value, writable=name in writable)
            params.append(ptx.pack(ltype, _tensor_leaves(fake, value)))
        else:
            params.append(ptx.pack(ltype, [int(value)]))
    for name, t in (extra_regions or {}).items():
        memory.add(name, t, writable=False)
    x = tensors["x"]
    grid = Mamba3StepKernel.grid(spec, x.shape[0], x.shape[1])
    result = ptx.run(k.module, grid=grid, block=k.block, params=params, memory=memory,
                     dynamic_smem=k.dynamic_smem, record=record, record_shared=record_shared)
    result.extra["memory"] = memory
    return result


def ptx_step_fn(state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj=None, state_out=None, out=None,
                z=None, zproj=None, *, state_batch_indices=None, dst_state_batch_indices=None, null_slot_id=None,
                update_kv_state=False, tile_D=None, num_warps=None, validate_indices=False,
                arch: str = "sm_90a") -> torch.Tensor:
    """``mamba3_step_fn`` on CPU tensors, computed by executing the kernel's PTX.

    Same arguments, validation and in-place effects as :func:`mamba3_step.mamba3_step_fn`
    (plus ``arch``, the target whose PTX runs). A verification instrument: it runs the
    compiled kernel instruction by instruction, so keep shapes small.
    """
    spec, tensors = prepare_step(
        state, Bstate, Xstate, A, B, C, D, x, dt, trap, xproj, outproj, state_out, out, z, zproj,
        state_batch_indices=state_batch_indices, dst_state_batch_indices=dst_state_batch_indices,
        null_slot_id=null_slot_id, update_kv_state=update_kv_state, tile_D=tile_D, num_warps=num_warps,
        validate_indices=validate_indices,
    )
    if x.shape[0] > 0:
        run_step_ptx(spec, arch=arch, **tensors)
    return tensors["out"]
