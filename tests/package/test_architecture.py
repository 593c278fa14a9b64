"""The package's shape: an import graph that only points down, and modules and functions small
enough to read (docs/design/architecture.md).

The graph is read from the source with ``ast`` (``mamba3_step.sources``: module-level and
function-level imports alike), so nothing here depends on what happens to be imported.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ptx_executor
from mamba3_step import sources

#: function-local imports the package is allowed: (module, imported module) -> why it is lazy
ALLOWED_LOCAL_IMPORTS = {
    ("mamba3_step.build", "mamba3_step.kernel"):
        "the kernel module imports cutlass (~0.6 s): only a compile loads it, never a cache hit, "
        "the CPU path or `import mamba3_step`",
    ("mamba3_step.compile_cache.store", "cutlass.runtime"):
        "the DSL's runtime libraries are looked up only to link a kernel that was just compiled",
}

#: the layers, bottom to top (docs/design/architecture.md); a module may import only from its own layer or below
LAYERS = [
    ["contract"],
    # rounding: the state's random bits and low-precision stores
    ["tiling", "slab_pipeline", "tensors", "signature", "arch", "sources", "testing", "rotary", "rounding"],
    ["spec"],
    # ring: replay's ring (allocation, argument checks); replay: its CPU path; replay_validation: what a step
    # with a ring checks on every device; ring_guard: a replay plan's per-run check of its ring
    ["reference", "validation", "specsets", "ring", "replay", "replay_validation", "ring_guard"],
    ["kernel"],
    ["build"],  # the kernel's cutlass-free face: imports it lazily, on the first compile
    ["compile_cache"],
    ["launch"],
    # plan: plan once, run many (StepPlan); materialize: a replay row's current state on any device (the
    # kernel's flush form on CUDA)
    ["api", "plan", "materialize"],
    ["ops", "serving"],
    ["layer"],  # a Mamba-3 decode layer
    # the tools (cli, demo, verify, inspection, precompile, the PTX tier, the models): above the whole runtime,
    # and never loaded by `import mamba3_step`
    ["tools"],
    ["__main__"],
]
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
#: modules allowed past MAX_MODULE_LINES, and why
LONG_MODULES = {}
#: functions allowed past MAX_FUNCTION_LINES (docstring not counted), and why
LONG_FUNCTIONS = {}


def _graph() -> dict[str, list[sources.Import]]:
    return {m: sources.imports_of(m) for m in sources.modules()}


def _internal(target: str) -> bool:
    return target == sources.PACKAGE or target.startswith(sources.PACKAGE + ".")


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add it (and to docs/design/architecture.md)")


def test_every_module_has_a_layer():
    for module in sources.modules():
        if module != sources.PACKAGE:
            _layer(module)


def test_import_graph_has_no_cycle():
    edges = {m: sorted({i.target for i in imps if _internal(i.target) and i.target != m})
             for m, imps in _graph().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in edges.get(node, []):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [node])


def test_imports_only_point_down_the_layers():
    wrong = []
    for module, imps in _graph().items():
        if module == sources.PACKAGE:
            continue  # the package's __init__ re-exports the public API from every layer
        for imp in imps:
            if _internal(imp.target) and imp.target != sources.PACKAGE and _layer(imp.target) > _layer(module):
                wrong.append(f"{module}:{imp.line} imports {imp.target} (a higher layer)")
            if imp.target == sources.PACKAGE:
                wrong.append(f"{module}:{imp.line} imports the package itself (import the module instead)")
    assert not wrong, "\n".join(wrong)


def test_no_function_local_imports_but_the_documented_ones():
    found = {}
    for module, imps in _graph().items():
        for imp in imps:
            if imp.function is not None:
                found[(module, imp.target)] = f"{module}:{imp.line} in {imp.function}()"
    unexpected = sorted(where for key, where in found.items() if key not in ALLOWED_LOCAL_IMPORTS)
    assert not unexpected, "function-local imports (import at module level, or document it in " \
                           "ALLOWED_LOCAL_IMPORTS with the reason):\n" + "\n".join(unexpected)
    assert set(ALLOWED_LOCAL_IMPORTS) <= set(found), "ALLOWED_LOCAL_IMPORTS lists imports that are gone"


def test_no_dynamic_imports():
    for module in sources.modules():
        tree = ast.parse(sources.module_file(module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                assert name not in ("importlib.import_module", "__import__", "import_module"), \
                    f"{module}:{node.lineno} imports dynamically ({name}); the graph test cannot see it"


def _function_lines(node: ast.AST) -> int:
    """Lines of a function, its docstring not counted."""
    lines = node.end_lineno - node.lineno + 1
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        lines -= body[0].end_lineno - body[0].lineno + 1
    return lines


@pytest.mark.parametrize("module", sources.modules())
def test_modules_and_functions_are_small(module):
    path = sources.module_file(module)
    text = path.read_text()
    n = len(text.splitlines())
    if module not in LONG_MODULES:
        assert n <= MAX_MODULE_LINES, f"{module}: {n} lines (at most {MAX_MODULE_LINES}; split it by layer)"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = _function_lines(node)
            if size > MAX_FUNCTION_LINES:
                assert f"{module}.{node.name}" in LONG_FUNCTIONS, (
                    f"{module}.{node.name}: {size} lines without its docstring (at most {MAX_FUNCTION_LINES}, "
                    f"or a reason in LONG_FUNCTIONS)")


def test_long_modules_are_still_long():
    """An exception that is no longer needed goes."""
    for module in LONG_MODULES:
        assert len(sources.module_file(module).read_text().splitlines()) > MAX_MODULE_LINES, module


def _loaded_by(modules: str, packages: tuple) -> list:
    """The modules of ``packages`` (each a package or a module, with its submodules) that importing
    ``modules`` (comma-separated) loads, in a fresh interpreter."""
    code = (f"import json, sys, {modules}; print(json.dumps(sorted(m for m in sys.modules "
            f"if any(m == p or m.startswith(p + '.') for p in {list(packages)!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_and_its_commands_loads_no_cutlass():
    """Only a compile imports the DSL: the API, the launcher, the cache and the CLI do not."""
    assert _loaded_by("mamba3_step, mamba3_step.launch, mamba3_step.tools.cli, mamba3_step.serving",
                      ("cutlass",)) == []


def test_importing_the_package_loads_no_tool_and_no_ptx_executor():
    """The runtime stands without its tools: ``import mamba3_step`` (and the serving layer, the layer and
    the launcher) loads no module of ``mamba3_step.tools`` and none of the PTX executor."""
    assert _loaded_by("mamba3_step, mamba3_step.serving, mamba3_step.layer, mamba3_step.launch",
                      ("mamba3_step.tools", "ptx_executor")) == []


def test_the_ptx_executor_imports_nothing_of_the_runtime():
    """The PTX executor is its own package: it reads PTX and runs it, knowing nothing of the step."""
    root = Path(ptx_executor.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 5, files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] != sources.PACKAGE, f"{path.name}:{node.lineno} imports {name}"
