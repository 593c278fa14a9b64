"""One declaration per argument (docs/design/architecture.md, "Where a change goes"): every list of the step's
arguments in the package agrees with ``StepTensors`` + ``StepOptions``, so a place a new argument
forgot fails here, not on a GPU.

Letters (docs/contract.md): B lanes, P pool rows, H heads, D head dim, N state size, R MIMO rank.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

import mamba3_step.ops  # noqa: F401  (registers the op)
from mamba3_step import StepPlan, mamba3_step_fn, mamba3_step_op, plan_step
from mamba3_step.api import prepare_step
from mamba3_step.tools.ptx_tier import ptx_step_fn
from mamba3_step.serving import CudaGraphStepRunner, decode_step
from mamba3_step.serving.hook import POOL_SUPPLIED
from mamba3_step.signature import OP_MUTATED, OP_ORDER, OP_RING_ARGS, STEP_SIGNATURE, TENSOR_SIGNATURE, StepOptions
from mamba3_step.tensors import KERNEL_ARGUMENT_NAMES, LANE_FIELDS, RING_FIELDS, Ring, StepTensors, kernel_arguments
from mamba3_step.validation.table import RULE_BY_NAME, RULES
from mamba3_step.testing import make_inputs

REPO = Path(__file__).resolve().parents[2]
DECLARED = StepTensors._fields + StepOptions._fields
#: the functions allowed more than 12 parameters (self/cls not counted; *args and **kwargs one each)
MAX_PARAMETERS = 12
#: the one flat public signature, and the kernel's launcher: tvm-ffi passes a bundle as an ffi Array (about
#: twice the host cost of flat arguments), so it takes one parameter per KernelArgs field
#: (tests/kernel/test_kernel_parts.py checks the list)
LONG_SIGNATURES = {("api.py", "mamba3_step_fn"), ("step.py", "__call__"), ("plan.py", "run")}


def _names(fn) -> tuple:
    return tuple(inspect.signature(fn).parameters)


def test_mamba3_step_fn_is_the_declared_signature():
    assert inspect.signature(mamba3_step_fn).replace(return_annotation=inspect.Signature.empty) == STEP_SIGNATURE
    assert _names(mamba3_step_fn) == DECLARED


def test_a_plans_run_is_the_declared_tensor_signature():
    """``StepPlan.run`` is written out flat (the per-step path binds no call): its parameters are the
    declared tensors', in order, with their kinds, defaults and annotations."""
    got = inspect.signature(StepPlan.run)
    assert list(got.parameters)[0] == "self"
    assert got.replace(parameters=list(got.parameters.values())[1:],
                       return_annotation=inspect.Signature.empty) == TENSOR_SIGNATURE


@pytest.mark.parametrize("entry", [mamba3_step_op, plan_step, ptx_step_fn])
def test_whole_call_entry_points_show_the_declared_signature(entry):
    params = inspect.signature(entry).parameters
    assert tuple(params)[: len(DECLARED)] == DECLARED
    for name in DECLARED:
        assert params[name] == STEP_SIGNATURE.parameters[name], name


def test_plan_run_shows_the_tensor_arguments():
    assert _names(StepPlan.run)[1:] == StepTensors._fields
    assert tuple(TENSOR_SIGNATURE.parameters) == StepTensors._fields


def test_views_cover_every_declared_argument():
    """decode_step takes every argument the pool does not supply; the runner every per-lane one."""
    names = set(_names(decode_step))
    renamed = {"state_batch_indices": "slots", "dst_state_batch_indices": "dst_slots"}
    for name in DECLARED:
        if name not in POOL_SUPPLIED:
            assert renamed.get(name, name) in names, name
    runner = set(_names(CudaGraphStepRunner.step))
    assert set(LANE_FIELDS) | {"slots", "dst_slots", "num_accepted_tokens", "clone"} <= runner


@pytest.mark.parametrize("entry,name", [(mamba3_step_op, "mamba3_step_op"), (plan_step, "plan_step"),
                                        (ptx_step_fn, "ptx_step_fn"), (decode_step, "decode_step")])
def test_a_wrong_call_is_refused_by_python_naming_the_entry_point(entry, name):
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'stat'"):
        entry(stat=None)
    with pytest.raises(TypeError, match=rf"^{name}\(\) missing"):
        entry()


def test_every_tensor_field_has_a_validation_row():
    # replay_ring: a bundle of tensors, checked against the step by mamba3_step.ring.check_ring
    tensors = [f for f in StepTensors._fields if f not in ("null_slot_id", "replay_ring")]
    assert sorted(RULE_BY_NAME) == sorted(tensors)
    assert len(RULES) == len(tensors)


def test_the_op_schema_is_the_declaration():
    schema = torch.ops.mamba3_step.step.default._schema
    assert tuple(a.name for a in schema.arguments) == OP_ORDER
    # replay_ring is its tensors, one op argument per Ring field
    assert OP_RING_ARGS == tuple(f"replay_ring_{f}" for f in Ring._fields)
    assert sorted(OP_ORDER) == sorted([n for n in DECLARED if n != "replay_ring"] + list(OP_RING_ARGS))
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == set(OP_MUTATED) == {r.name for r in RULES if r.written} | set(OP_RING_ARGS)
    for a in schema.arguments:
        optional = a.name in OP_RING_ARGS or (
            a.name != "out" and STEP_SIGNATURE.parameters[a.name].default is not inspect.Parameter.empty)
        assert a.has_default_value() == optional, a.name


def test_kernel_arguments_are_declared_fields_in_one_order():
    assert KERNEL_ARGUMENT_NAMES[-1] == "null_slot"
    # every kernel argument is a public one, but the ring's (a replay step: mamba3_step.replay.Ring)
    assert set(KERNEL_ARGUMENT_NAMES[:-1]) - set(RING_FIELDS) <= set(StepTensors._fields)
    inputs = make_inputs(3, 5, seed=1)
    call = StepTensors(**inputs, out=inputs["x"].clone(),
                       state_batch_indices=torch.tensor([0, 4, -1], dtype=torch.int32), null_slot_id=2)
    args = kernel_arguments(call)
    assert args._fields == KERNEL_ARGUMENT_NAMES
    for name in KERNEL_ARGUMENT_NAMES[:-1]:
        assert getattr(args, name) is (None if name in RING_FIELDS else getattr(call, name))
    assert args.null_slot == 2 and kernel_arguments(call._replace(null_slot_id=None)).null_slot == -1


def _long_signatures() -> list[str]:
    found = []
    for path in sorted((REPO / "mamba3_step").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                if count > MAX_PARAMETERS and (path.name, node.name) not in LONG_SIGNATURES:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {count} parameters")
    return found


def test_no_function_but_the_public_one_takes_more_than_12_parameters():
    """Everything below the flat public signature takes bundles (StepTensors, StepOptions, KernelArgs,
    the kernel's per-CTA context); the entry points bind the declared signature."""
    assert not _long_signatures(), "\n".join(_long_signatures())


def test_the_change_guide_names_files_that_exist():
    text = (REPO / "docs" / "design" / "architecture.md").read_text()
    guide = text[text.index("## Where a change goes"):]
    guide = guide[: guide.index("\n## ", 1) if "\n## " in guide[1:] else len(guide)]
    paths = set(re.findall(r"`((?:mamba3_step/|tests/|docs/|bench/)[\w/.-]+\.(?:py|md|c))`", guide))
    assert paths, "the guide names no file"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, missing


def test_mamba3_step_fn_documents_every_argument():
    doc = mamba3_step_fn.__doc__
    for name in DECLARED:
        assert re.search(rf"\b{name}\b", doc), name


@pytest.mark.parametrize("mode", ["dense", "dense-state_out", "pool", "pool-dst-accepted-T3", "pool-noz-noout"])
def test_fake_arguments_launcher_and_host_packing_agree(mode):
    """The kernel's bundle three ways: the compiled launcher's parameters, the fake arguments it is
    compiled with, and what the host passes for a call of that specialisation (None exactly where
    the specialisation has no tensor)."""
    kernel = pytest.importorskip("mamba3_step.kernel")


    assert _names(kernel.Mamba3StepKernel.__call__) == ("self",) + KERNEL_ARGUMENT_NAMES + ("stream",)
    T = 3 if "T3" in mode else None
    pool = mode.startswith("pool")
    inputs = make_inputs(4, 9 if pool else None, tokens=T, has_z="noz" not in mode,
                         has_outproj="noout" not in mode, seed=3)
    extra = {}
    if "state_out" in mode:
        extra["state_out"] = torch.empty_like(inputs["state"])
    if pool:
        extra["state_batch_indices"] = torch.tensor([0, 5, -1, 8], dtype=torch.int32)
    if "dst" in mode:
        extra["state_batch_indices"] = torch.tensor([[0, 1, 2], [3, 4, 5], [-1, -1, -1], [6, 7, 8]],
                                                    dtype=torch.int32)
        extra["num_accepted_tokens"] = torch.tensor([1, 3, 1, 2], dtype=torch.int32)
        extra["dst_state_batch_indices"] = extra["state_batch_indices"].clone()
    spec, tensors, _ = prepare_step(StepTensors(**inputs, **extra))
    fakes = kernel.fake_arguments(spec)
    packed = kernel_arguments(tensors)
    assert type(fakes) is type(packed) and fakes._fields == KERNEL_ARGUMENT_NAMES
    assert [f is None for f in fakes] == [p is None for p in packed]
    masks = kernel.argument_masks(spec)
    assert [m is None for m in masks] == [p is None for p in packed]


def test_the_validation_cache_keys_on_every_validated_option():
    """``ValidationCache.check`` and ``call_key`` are written out for speed: their options must be
    :data:`VALIDATED_OPTIONS`, in order, with StepOptions' defaults."""
    from mamba3_step.signature import VALIDATED_OPTIONS, StepOptions
    from mamba3_step.validation.cache import ValidationCache, call_key
    for fn, skip in ((ValidationCache.check, 2), (call_key, 1)):
        params = list(inspect.signature(fn).parameters.values())[skip:]
        assert tuple(p.name for p in params) == VALIDATED_OPTIONS, fn
    for p in list(inspect.signature(ValidationCache.check).parameters.values())[2:]:
        assert p.default == StepOptions._field_defaults[p.name], p.name
