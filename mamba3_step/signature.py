"""The step's arguments, declared once, and every entry point's signature derived from them.

Letters (docs/contract.md): B lanes, T tokens, P pool rows, H heads, D head dim, N state size,
R MIMO rank.

The declaration is two bundles:

* :class:`~mamba3_step.tensors.StepTensors`: every tensor argument and ``null_slot_id``, in the
  public order, with their defaults (a field without a default is required);
* :class:`StepOptions`: the options, with their defaults.

The public signature (:data:`STEP_SIGNATURE`) is those fields in that order: the fields up to
:data:`LAST_POSITIONAL` may be passed by position, the rest of the tensors and every option only
by keyword. ``mamba3_step_fn`` is written out flat (it is the documented function; a test holds
it equal to :data:`STEP_SIGNATURE`). Every other entry point takes ``*args, **kwargs``, carries
its signature as ``__signature__`` (so ``inspect.signature`` and ``help`` show the real
parameters) and binds a call with :func:`make_binder`, which follows Python's own rules for a
function of that signature, so a wrong call gets Python's TypeError naming the entry point. An entry point that supplies some
arguments itself (``decode_step`` takes the rows and ``null_slot_id`` from a pool) or names them
differently declares a :class:`View` of the signature instead of a list of parameters.

The custom op's schema (:func:`op_schema`) comes from the same declaration; see its docstring
for its order. The one field that is a bundle, ``replay_ring`` (a
:class:`~mamba3_step.tensors.Ring`), is one parameter of the public signature and one op argument
per ring field (:data:`OP_RING_ARGS`; :func:`op_values` and :func:`from_op_values` convert).

A new argument is one field of ``StepTensors`` (a tensor) or of :class:`StepOptions` (an
option); every entry point here follows (docs/design/architecture.md, "Where a change goes").
"""

from __future__ import annotations

from inspect import Parameter, Signature
from typing import Callable, NamedTuple, Optional

import torch

from .tensors import Ring, StepTensors

__all__ = ["LAST_POSITIONAL", "OP_ORDER", "OP_RING_ARGS", "STEP_SIGNATURE", "StepOptions", "TENSOR_SIGNATURE", "View",
           "declared_signature", "make_binder", "op_schema", "op_schema_parts", "split_call", "view_signature"]


class StepOptions(NamedTuple):
    """The step's options (docs/contract.md; ``mamba3_step_fn``'s docstring)."""

    update_kv_state: bool = False
    tile_D: Optional[int] = None
    num_warps: Optional[int] = None
    validate_indices: bool = False
    rotate_pairwise: bool = False
    stochastic_rounding: bool = False
    replay_flush_length: Optional[int] = None
    replay_from_checkpoint: bool = False


#: the options validation reads (``check_step_inputs``'s keywords); the rest act after it
VALIDATED_OPTIONS = ("update_kv_state", "tile_D", "num_warps", "rotate_pairwise", "stochastic_rounding")


def validated_options(options) -> dict:
    """The :data:`VALIDATED_OPTIONS` of a :class:`StepOptions` (or a dict of its fields), as keywords."""
    if isinstance(options, dict):
        return {name: options.get(name, StepOptions._field_defaults[name]) for name in VALIDATED_OPTIONS}
    return {name: getattr(options, name) for name in VALIDATED_OPTIONS}


#: the last field of StepTensors a caller may pass by position
LAST_POSITIONAL = "zproj"
_NUM_TENSORS = len(StepTensors._fields)
_POSITIONAL = StepTensors._fields.index(LAST_POSITIONAL) + 1

#: how each declared annotation is shown (``inspect.signature``) and typed in the op's schema
_ANNOTATIONS = {
    "Tensor": ("torch.Tensor", "Tensor"),
    "Optional[Tensor]": ("torch.Tensor | None", "Tensor?"),
    "Optional[int]": ("int | None", "Scalar?"),
    "bool": ("bool", "Scalar"),
    "Optional[Ring]": ("Ring | None", None),  # the op takes the ring's tensors (OP_RING_ARGS)
}


def _annotation(bundle, name: str) -> str:
    """A field's annotation as written (a NamedTuple keeps postponed annotations as ForwardRefs)."""
    ann = bundle.__annotations__[name]
    return getattr(ann, "__forward_arg__", ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann)))


def _declared():
    """(name, default or Parameter.empty, annotation text, kind) of every declared argument."""
    rows = []
    for i, name in enumerate(StepTensors._fields):
        kind = Parameter.POSITIONAL_OR_KEYWORD if i < _POSITIONAL else Parameter.KEYWORD_ONLY
        default = StepTensors._field_defaults.get(name, Parameter.empty)
        rows.append((name, default, _annotation(StepTensors, name), kind))
    for name in StepOptions._fields:
        rows.append((name, StepOptions._field_defaults[name], _annotation(StepOptions, name), Parameter.KEYWORD_ONLY))
    return rows


def declared_signature(*, options: bool = True) -> Signature:
    """The public signature: the StepTensors fields, then (``options``) the StepOptions fields."""
    rows = _declared() if options else _declared()[:_NUM_TENSORS]
    return Signature([Parameter(name, kind, default=default, annotation=_ANNOTATIONS[ann][0])
                      for name, default, ann, kind in rows])


#: ``mamba3_step_fn``'s signature, and every entry point's that takes the whole call
STEP_SIGNATURE = declared_signature()
#: the tensor arguments alone (a plan's per-step call: the options are the plan's)
TENSOR_SIGNATURE = declared_signature(options=False)


def split_call(values: tuple) -> tuple[StepTensors, StepOptions]:
    """A bound call in :data:`STEP_SIGNATURE` order -> ``(StepTensors, StepOptions)``."""
    end = _NUM_TENSORS + len(StepOptions._fields)
    if torch.compiler.is_compiling():  # the constructors: older dynamo cannot trace tuple.__new__
        return StepTensors(*values[:_NUM_TENSORS]), StepOptions(*values[_NUM_TENSORS:end])
    return tuple.__new__(StepTensors, values[:_NUM_TENSORS]), tuple.__new__(StepOptions, values[_NUM_TENSORS:end])


class _Required:
    """The marker of a parameter without a default, in a binder's template."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<required>"


_REQUIRED = _Required()


def _positional_range(low: int, high: int) -> str:
    return str(high) if low == high else f"from {low} to {high}"


def make_binder(name: str, signature: Signature) -> Callable[..., tuple]:
    """A function named ``name`` binding a call to exactly ``signature``: it returns the arguments as a
    tuple, in the signature's order, defaults filled in, and refuses a call Python would refuse for a
    function of that signature with Python's ``TypeError`` (naming ``name``): too many positional
    arguments, an unknown keyword, a value given twice, a required argument missing."""
    params = list(signature.parameters.values())
    names = tuple(p.name for p in params)
    known = frozenset(names)
    positional = sum(p.kind in (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD) for p in params)
    template = tuple(_REQUIRED if p.default is Parameter.empty else p.default for p in params)
    required = [i for i, p in enumerate(params) if p.default is Parameter.empty]
    least = sum(1 for i in required if i < positional)
    # per count of positional arguments given: the names they took, and the required names still to come
    taken = [frozenset(names[:n]) for n in range(positional + 1)]
    still_required = [frozenset(names[i] for i in required if i >= n) for n in range(positional + 1)]

    def refuse(given: int, kwargs: dict) -> TypeError:
        """Python's TypeError for a call this signature does not take (the call is known to be wrong)."""
        if given > positional:
            return TypeError(f"{name}() takes {_positional_range(least, positional)} positional arguments but "
                             f"{given} were given")
        for key in kwargs:
            if key not in known:
                return TypeError(f"{name}() got an unexpected keyword argument '{key}'")
            if key in taken[given]:
                return TypeError(f"{name}() got multiple values for argument '{key}'")
        missing = [n for n in names if n in still_required[given] and n not in kwargs]
        kind = "positional" if names.index(missing[0]) < positional else "keyword-only"
        listed = " and ".join(f"'{m}'" for m in missing) if len(missing) < 3 else \
            ", ".join(f"'{m}'" for m in missing[:-1]) + f", and '{missing[-1]}'"
        return TypeError(f"{name}() missing {len(missing)} required {kind} argument{'s' if len(missing) > 1 else ''}: "
                         f"{listed}")

    required_by_keyword = still_required[0]

    index = {n: i for i, n in enumerate(names)}

    def traced(args: tuple, kwargs: dict) -> tuple:
        """The same binding in plain loops, which torch.compile traces (set operations on a dict's
        keys it does not)."""
        given = len(args)
        if given > positional or any(key not in index or index[key] < given for key in kwargs):
            raise refuse(given, kwargs)
        values = list(args) + [kwargs[n] if n in kwargs else template[i] for i, n in enumerate(names) if i >= given]
        if any(values[i] is _REQUIRED for i in required):
            raise refuse(given, kwargs)
        return tuple(values)

    def bind(*args, **kwargs) -> tuple:
        if torch.compiler.is_compiling():
            return traced(args, kwargs)
        keys = kwargs.keys()
        if not args:  # every argument by keyword: a server's usual call
            if keys <= known and required_by_keyword <= keys:
                return tuple(map(kwargs.get, names, template))
            raise refuse(0, kwargs)
        given = len(args)
        if given > positional or not keys <= known or not still_required[given] <= keys or \
                not keys.isdisjoint(taken[given]):
            raise refuse(given, kwargs)
        return args + tuple(map(kwargs.get, names[given:], template[given:]))

    bind.__name__ = bind.__qualname__ = name
    bind.__signature__ = signature
    return bind


# ---------------------------------------------------------------------- views
class View(NamedTuple):
    """How an entry point presents the declared arguments.

    ``leading``: its own parameters, first; ``promoted``: declared names that become positional
    parameters right after them (required); ``supplied``: declared names the entry point fills
    itself (not parameters); ``renamed``: declared name -> the entry point's name;
    ``keyword_only``: every declared parameter keyword-only; ``trailing``: its own keyword-only
    parameters, last.
    """

    leading: tuple = ()
    promoted: tuple = ()
    supplied: frozenset = frozenset()
    renamed: dict = {}
    keyword_only: bool = False
    trailing: tuple = ()


def view_signature(view: View) -> Signature:
    """The signature an entry point with ``view`` shows (and binds with :func:`make_binder`)."""
    rows = _declared()
    by_name = {r[0]: r for r in rows}
    params = list(view.leading)
    for name in view.promoted:
        _, _, ann, _ = by_name[name]
        params.append(Parameter(view.renamed.get(name, name), Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=_ANNOTATIONS[ann][0].removesuffix(" | None")))
    for name, default, ann, kind in rows:
        if name in view.supplied or name in view.promoted:
            continue
        if view.keyword_only:
            kind = Parameter.KEYWORD_ONLY
        params.append(Parameter(view.renamed.get(name, name), kind, default=default, annotation=_ANNOTATIONS[ann][0]))
    params.extend(view.trailing)
    return Signature(params)


def view_fields(view: View) -> tuple[str, ...]:
    """The declared name of each parameter of :func:`view_signature` (``None`` for the view's own)."""
    sig = view_signature(view)
    declared = {view.renamed.get(r[0], r[0]): r[0] for r in _declared()}
    own = {p.name for p in (*view.leading, *view.trailing)}
    return tuple(None if name in own else declared[name] for name in sig.parameters)


# ---------------------------------------------------------------------- the custom op
#: the op's arguments that carry ``replay_ring``: one optional tensor per :class:`~mamba3_step.tensors.Ring`
#: field, ``replay_ring_<field>`` (all None: a stepwise step)
OP_RING_ARGS = tuple(f"replay_ring_{field}" for field in Ring._fields)


def _op_order() -> tuple[str, ...]:
    required = [n for n in StepTensors._fields if n not in StepTensors._field_defaults]
    rest = []
    for name in StepTensors._fields:
        if name in StepTensors._field_defaults and name != "out":
            rest.extend(OP_RING_ARGS if name == "replay_ring" else (name,))
    return tuple(required) + ("out",) + tuple(rest) + StepOptions._fields


#: the op's argument order: the required tensors and ``out`` (required there: the op returns
#: nothing), then the optional fields in declared order (``replay_ring`` as :data:`OP_RING_ARGS`),
#: then the options. A new field lands before the options, which callers pass by keyword.
OP_ORDER = _op_order()
#: the tensors the op declares as mutated: every tensor the step may write (the ring's included)
OP_MUTATED = ("state", "Bstate", "Xstate", "state_out", "out", "angle_state", "state_scale") + OP_RING_ARGS


def op_values(tensors: StepTensors, options) -> dict:
    """A call's op arguments by name (:data:`OP_ORDER`): the tensors with ``replay_ring`` as its
    tensors (:data:`OP_RING_ARGS`), then ``options`` (a :class:`StepOptions`, or a dict of its fields)."""
    values = dict(zip(StepTensors._fields, tensors))
    ring = values.pop("replay_ring")
    values.update(zip(OP_RING_ARGS, (None,) * len(OP_RING_ARGS) if ring is None else ring))
    values.update(options if isinstance(options, dict) else zip(StepOptions._fields, options))
    return values


def from_op_values(values: dict) -> tuple[StepTensors, StepOptions]:
    """:func:`op_values`' inverse: ``(StepTensors, StepOptions)`` of the op's arguments by name; the
    ring's tensors become a :class:`~mamba3_step.tensors.Ring` unless they are all None."""
    ring = tuple(values[name] for name in OP_RING_ARGS)
    tensors = {name: values[name] for name in StepTensors._fields if name != "replay_ring"}
    replay_ring = None if all(v is None for v in ring) else Ring(*ring)
    return (StepTensors(**tensors, replay_ring=replay_ring),
            StepOptions(**{name: values[name] for name in StepOptions._fields}))


def op_schema() -> str:
    """``torch.library`` schema of ``mamba3_step::step``, in :data:`OP_ORDER`.

    Tensors are ``Tensor`` (``Tensor?`` when optional; ``out`` required), each mutated one with
    its own alias set ``(aN!)``; ``null_slot_id`` and the options are ``Scalar`` so that the
    dispatcher passes them on as given (it would turn ``update_kv_state=1`` into True before the
    validation could refuse it). Every argument after ``out`` has its declared default.
    """
    return f"({', '.join(op_schema_parts(OP_ORDER))}) -> ()"


def op_schema_parts(names) -> list[str]:
    """The schema's argument texts of the declared ``names`` (in their order), each mutated tensor
    with its own alias set ``(a0!)``, ``(a1!)``, ... in that order (see :func:`op_schema`)."""
    rows = {r[0]: r for r in _declared()}
    rows.update({name: (name, None, "Optional[Tensor]", None) for name in OP_RING_ARGS})
    parts, alias = [], 0
    for name in names:
        _, default, ann, _ = rows[name]
        typ = "Tensor" if name == "out" else _ANNOTATIONS[ann][1]
        if name in OP_MUTATED:
            typ = typ.replace("Tensor", f"Tensor(a{alias}!)")
            alias += 1
        text = f"{typ} {name}"
        if name != "out" and default is not Parameter.empty:
            text += f"={default!r}"  # None, False, True: the schema's own spelling
        parts.append(text)
    return parts

