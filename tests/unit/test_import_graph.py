"""The package's modules import one another without a circle, function-local imports included.

A circle that only closes through an import inside a function still works at run time (the import
runs after both modules have loaded), which is why nothing fails when one appears: it is found here,
from the source, before it makes the layering impossible to read top-down.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "gpumemd"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: Path) -> dict[str, Path]:
    return {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """``from ..x import y`` in ``module`` -> the absolute name of ``..x``."""
    base = module.split(".")
    if not is_package:
        base.pop()  # a plain module's level-1 anchor is its own package
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _owning_module(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in (``gpumemd.a.b.Thing`` -> ``gpumemd.a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _imports_of(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every package module ``module`` imports, wherever in the file the import statement stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module or ""
            # `from gpumemd.x import y` imports the submodule gpumemd.x.y when there is one, and
            # otherwise takes the name y from gpumemd.x itself
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                owner = _owning_module(target, known)
                if owner is not None and owner != module:
                    found.add(owner)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = _modules(root)
    return {module: _imports_of(module, path, known) for module, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as ``[a, b, ..., a]``, or None; depth-first with the path on a stack."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt in done:
                continue
            path.append(nxt)
            on_path.add(nxt)
            stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_sees_imports_inside_functions_relative_ones_and_submodules(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from gpumemd.a import thing\n",
        "a.py": "def f():\n    import gpumemd.b\n    from . import c\n    from .sub import d, name\n",
        "b.py": "import torch\nif True:\n    from gpumemd.sub.d import x\n",
        "c.py": "", "sub/__init__.py": "name = 1\n", "sub/d.py": "from .. import c\nfrom ..a import f\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    assert import_graph(package) == {
        "gpumemd": {"gpumemd.a"},
        "gpumemd.a": {"gpumemd.b", "gpumemd.c", "gpumemd.sub", "gpumemd.sub.d"},
        "gpumemd.b": {"gpumemd.sub.d"},
        "gpumemd.c": set(),
        "gpumemd.sub": set(),
        "gpumemd.sub.d": {"gpumemd.c", "gpumemd.a"},
    }
    assert find_cycle(import_graph(package)) == ["gpumemd.a", "gpumemd.b", "gpumemd.sub.d", "gpumemd.a"]


def test_find_cycle_reports_the_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
