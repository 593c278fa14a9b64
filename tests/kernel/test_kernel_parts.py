"""The kernel package's shape: the launcher's hand-written parameters are the declared bundle, no
code is generated at import, every part is fingerprinted, and each specialisation gets the state
format its dtype and rounding call for.

Nothing here compiles: the kernel class is built (no trace) and its source read.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from mamba3_step import build, sources
from mamba3_step.spec import flagship_spec
from mamba3_step.tensors import KERNEL_ARGUMENT_NAMES

kernel = pytest.importorskip("mamba3_step.kernel")

PACKAGE_DIR = Path(kernel.__file__).parent


def test_the_launcher_takes_every_kernel_argument_in_order_then_the_stream():
    params = tuple(inspect.signature(kernel.Mamba3StepKernel.__call__).parameters)
    assert params == ("self",) + KERNEL_ARGUMENT_NAMES + ("stream",)


def test_the_launcher_packs_each_parameter_into_its_own_field():
    """``KernelArgs(name=name, ...)``: every field named once, from the parameter of that name."""
    src = PACKAGE_DIR.joinpath("step.py").read_text()
    call = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "__call__")
    packs = [n for n in ast.walk(call) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "KernelArgs"]
    assert len(packs) == 1 and not packs[0].args
    pairs = [(k.arg, k.value.id) for k in packs[0].keywords]
    assert pairs == [(name, name) for name in KERNEL_ARGUMENT_NAMES]


def test_no_code_is_generated_with_exec_or_eval():
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("exec", "eval", "compile"):
                pytest.fail(f"{path.name}:{node.lineno} calls {node.func.id}")


def test_every_part_of_the_kernel_package_is_fingerprinted():
    parts = {str(p) for p in PACKAGE_DIR.glob("*.py")}
    assert len(parts) > 10
    assert parts <= set(build.kernel_sources())
    assert {m for m in sources.modules() if m.startswith("mamba3_step.kernel.")} == \
        {f"mamba3_step.kernel.{Path(p).stem}" for p in parts if not p.endswith("__init__.py")}


@pytest.mark.parametrize("state_dtype, stochastic, fmt", [
    ("float32", False, "StateFormat"),
    ("bfloat16", False, "StateFormat"),
    ("bfloat16", True, "RoundedState"),
    ("float16", True, "RoundedState"),
    ("int8", True, "ScaledState"),
    ("float8_e4m3fn", True, "ScaledState"),
])
def test_the_state_format_is_chosen_once_from_the_spec(state_dtype, stochastic, fmt):
    spec = flagship_spec(state_dtype=state_dtype, stochastic_rounding=stochastic).with_default_tiling()
    k = kernel.Mamba3StepKernel(spec)
    assert type(k.storage).__name__ == fmt
    assert k.storage.kernel is k and k.storage.state_dtype is k.state_dtype
