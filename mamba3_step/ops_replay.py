"""``replay_step_fn`` as a PyTorch custom op: ``torch.ops.mamba3_step.replay_step``.

Importing this module (the package does) registers the op with its schema, the tensors it
mutates and a fake implementation, so a model compiled with ``torch.compile(fullgraph=True)``
calls a replay step without a graph break, on CPU and CUDA. ``replay_step_fn`` itself calls the
op while it is being compiled (``api_replay.replay_through_op``), so compiled code calls it as
eager code does::

    out = replay_step_fn(tensors, ring, K, accepted=accepted)     # eager, or inside torch.compile

The op takes its arguments in :data:`mamba3_step.api_replay.REPLAY_OP_ORDER`: the step op's
tensors (``mamba3_step.ops``; ``out`` required and written, the op returns nothing), the
:class:`~mamba3_step.replay.Ring` fields as ``ring_B``, ``ring_x``, ``ring_coef``, ``ring_length``
and the optional ``ring_offset``, ``ring_drawn_for``, ``ring_angle``, each declared as mutated,
then ``K``, ``accepted`` and the options. The non-tensor arguments are ``Scalar`` so that the
validation sees them as given (a ``bool`` K is refused, not turned into 1).

Its real implementation is ``replay_step_fn`` (the kernel on CUDA, the CPU path on CPU); its fake
runs the same validation on the fake tensors: ``replay_kernel_spec`` for a CUDA call, the CPU
path's checks for a CPU one. So a traced call refuses what an eager call refuses, by name.
Letters (docs/contract.md): B P H D N R, K the flush length.
"""

from __future__ import annotations

from inspect import Parameter, Signature

import torch

from .api_replay import REPLAY_OP_ORDER, replay_kernel_spec, replay_step_fn
from .replay import Ring, check_replay_step
from .signature import OP_MUTATED, STEP_SIGNATURE, make_binder, op_schema_parts
from .tensors import StepTensors

__all__ = ["REPLAY_OP_MUTATED", "replay_op_schema", "replay_step"]

_RING_ARGS = tuple(f"ring_{f}" for f in Ring._fields)
#: the ring fields a Ring may leave out (stochastic rounding's, rotary's)
_OPTIONAL_RING = tuple(f"ring_{f}" for f in Ring._field_defaults)
_STEP_ARGS = tuple(n for n in REPLAY_OP_ORDER if n in StepTensors._fields)
#: replay's own arguments: schema type (Scalar: passed on as given) and default
_OWN = {"K": ("Scalar", Parameter.empty), "accepted": ("Tensor?", None), "rotate_pairwise": ("Scalar", False),
        "from_checkpoint": ("Scalar", False), "tile_D": ("Scalar?", None), "num_warps": ("Scalar?", None)}


def replay_op_schema() -> str:
    """``torch.library`` schema of ``mamba3_step::replay_step``, in :data:`REPLAY_OP_ORDER`: each
    mutated tensor (the step op's written ones, every ring tensor) with its own alias set."""
    step = dict(zip(_STEP_ARGS, op_schema_parts(_STEP_ARGS)))
    alias = sum("!)" in p for p in step.values())
    parts = []
    for name in REPLAY_OP_ORDER:
        if name in step:
            parts.append(step[name])
        elif name in _RING_ARGS:
            optional = name in _OPTIONAL_RING
            parts.append(f"Tensor(a{alias}!){'?' if optional else ''} {name}{'=None' if optional else ''}")
            alias += 1
        else:
            typ, default = _OWN[name]
            parts.append(f"{typ} {name}" + ("" if default is Parameter.empty else f"={default!r}"))
    return f"({', '.join(parts)}) -> ()"


def _parameter(name: str) -> Parameter:
    """The op's parameter ``name``: the step's declared one (``out`` required), else replay's own."""
    if name in STEP_SIGNATURE.parameters:
        p = STEP_SIGNATURE.parameters[name]
        return p.replace(kind=Parameter.POSITIONAL_OR_KEYWORD, default=Parameter.empty if name == "out" else p.default)
    default = _OWN[name][1] if name in _OWN else (None if name in _OPTIONAL_RING else Parameter.empty)
    return Parameter(name, Parameter.POSITIONAL_OR_KEYWORD, default=default)


_bind = make_binder("replay_step", Signature([_parameter(name) for name in REPLAY_OP_ORDER]))


def _split(args, kwargs) -> tuple:
    """The op's call -> ``(tensors, ring, K, options)``."""
    call = dict(zip(REPLAY_OP_ORDER, _bind(*args, **kwargs)))
    tensors = StepTensors(**{name: call[name] for name in StepTensors._fields})
    ring = Ring(*(call[name] for name in _RING_ARGS))
    options = {name: call[name] for name in ("accepted", "rotate_pairwise", "from_checkpoint", "tile_D", "num_warps")}
    return tensors, ring, call["K"], options


def _op_replay(*args, **kwargs) -> None:
    """The replay step, in place (see ``replay_step_fn``). ``out`` is required and written."""
    tensors, ring, K, options = _split(args, kwargs)
    replay_step_fn(tensors, ring, K, **options)


def _op_fake(*args, **kwargs) -> None:
    # Everything is written in place: no new outputs. The checks are the real ones (metadata only;
    # address comparisons are skipped for fake tensors and happen when the real implementation runs).
    tensors, ring, K, options = _split(args, kwargs)
    if tensors.x.device.type == "cuda":
        replay_kernel_spec(tensors, ring, K, **options)
        return None
    check_replay_step(tensors, ring, K, options["accepted"], options["rotate_pairwise"])
    return None


#: what the op declares as mutated: the step op's written tensors and every ring tensor
REPLAY_OP_MUTATED = tuple(n for n in _STEP_ARGS if n in OP_MUTATED) + _RING_ARGS
replay_step = torch.library.custom_op("mamba3_step::replay_step", _op_replay, mutates_args=REPLAY_OP_MUTATED,
                                      schema=replay_op_schema())
replay_step.register_fake(_op_fake)
