"""The package's own import graph, read from its source with ``ast`` (nothing is imported).

Two users: the disk cache's key hashes every module the compiled kernel depends on
(:func:`closure` of ``mamba3_step.kernel``), and the layering test checks that the graph has no
cycle and no function-local import beyond the documented ones. Both see the same edges.

An edge ``a -> b`` means module ``a`` has an ``import`` statement (at module level or inside a
function) that loads package module ``b``: ``from .b import x``, ``from . import b``,
``import mamba3_step.b``, ``from mamba3_step.b import x``. ``from .pkg import name`` where
``name`` is a submodule of ``pkg`` points at the submodule; otherwise at ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

__all__ = ["Import", "PACKAGE", "PACKAGE_ROOT", "closure", "imports_of", "module_file", "modules"]

PACKAGE = "mamba3_step"
PACKAGE_ROOT = Path(__file__).resolve().parent


class Import(NamedTuple):
    target: str  # dotted module name, inside or outside the package
    line: int
    function: str | None  # the enclosing function's name for a function-local import, else None


def module_file(name: str, root: Path = PACKAGE_ROOT) -> Path | None:
    """The source file of package module ``name`` (``"mamba3_step.x.y"``) under ``root``, or None."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = root.joinpath(*parts[1:])
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def modules(root: Path = PACKAGE_ROOT) -> list[str]:
    """Every module of the package under ``root``, dotted (``__init__`` files name their package)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("").parts
        if "__pycache__" in rel:
            continue
        out.append(".".join((PACKAGE,) + (rel[:-1] if rel[-1] == "__init__" else rel)))
    return out


def _visit(tree: ast.AST, function: str | None = None):
    """(node, enclosing function) for every import node, functions included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, function
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        yield from _visit(node, inner)


def imports_of(name: str, root: Path = PACKAGE_ROOT) -> list[Import]:
    """Every import statement of package module ``name``, resolved to dotted module names."""
    path = module_file(name, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node, function in _visit(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(a.name, node.lineno, function) for a in node.names]
            continue
        if node.level:
            base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.append(Import(sub if module_file(sub, root) else base, node.lineno, function))
    return found


def closure(name: str, root: Path = PACKAGE_ROOT) -> list[Path]:
    """Source files of ``name`` and of every package module it imports, transitively.

    Subpackages' ``__init__`` files on the way are included (importing a submodule runs them);
    the top package's ``__init__`` is not (it only re-exports the public API).
    """
    seen, todo = set(), [name]
    while todo:
        mod = todo.pop()
        if mod in seen or module_file(mod, root) is None:
            continue
        seen.add(mod)
        todo += [imp.target for imp in imports_of(mod, root)]
        parent = mod.rpartition(".")[0]
        if parent != PACKAGE:
            todo.append(parent)
    seen.discard(PACKAGE)
    return sorted(module_file(m, root) for m in seen)
