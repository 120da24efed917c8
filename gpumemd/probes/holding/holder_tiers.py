"""The roots a holder climb reaches down from (``holder_reach``), in tiers, each with the name a user
reads: the locals of the job's own running frames, its modules' globals (a class among them followed
into its attributes), then the locals of library frames. Read from what ``holder_roots`` found, without
a heap scan.
"""

from __future__ import annotations

import types
from typing import Any

from gpumemd.probes.holding.holder_paths import Root
from gpumemd.probes.holding.holder_roots import first_stores, is_user_file, user_modules


def root_tiers(
    frames: list[tuple[types.FrameType, dict[str, Any]]], module_dicts: dict[int, str]
) -> list[list[tuple[Root, Any]]]:
    """The roots to reach down from, in three tiers: the locals of the job's own running frames, its
    modules' globals, then the locals of library frames (a framework's loop, a test runner),
    each with the name a user reads."""
    own_code: list[tuple[Root, Any]] = []
    own_parameters: list[tuple[Root, Any]] = []  # after: the caller's own variable says more than `self`
    library: list[tuple[Root, Any]] = []
    for frame, f_locals in frames:
        code = frame.f_code
        users = is_user_file(code.co_filename)
        for name, value in f_locals.items():
            if name in code.co_freevars or not name.isidentifier():
                # a closure's view of an outer frame's variable (the outer frame is named
                # instead), or a compiler-made slot such as pytest's `@py_assert1`
                continue
            found = (Root(name, "`", local_of=(code, frame.f_lineno)), value)
            if not users:
                library.append(found)
            else:  # a variable no line of the function stores is a parameter, most often
                (own_code if name in first_stores(code) else own_parameters).append(found)
    # the locals a tier before the globals: a job of many modules (a test suite's, a framework
    # plugin's) has thousands of globals whose first levels spent the bounds of one tier
    return [own_code + own_parameters, _global_roots(module_dicts), library]


def _global_roots(module_dicts: dict[int, str]) -> list[tuple[Root, Any]]:
    """The globals of the job's own modules (after the locals: a local is the nearer name); a
    class among them is followed into its attributes, named ``Class.attr`` as the climb names them."""
    roots: list[tuple[Root, Any]] = []
    for module, namespace in user_modules(module_dicts):
        source = source_of(namespace)
        for name, value in list(namespace.items()):
            if isinstance(value, (types.ModuleType, types.FunctionType)) or name.startswith("__"):
                continue
            if isinstance(value, type):
                roots.append((Root(value.__qualname__, source=source), value))
            else:
                roots.append((global_root(module, name, source), value))
    return roots


def global_root(module: str, name: str, source: str | None) -> Root:
    """The root of module global ``module.name``, as the climb and the tiers both name it."""
    return Root(f"{module}.{name}", "module global `", source=source, prefix=len(module) + 1)


def source_of(namespace: Any) -> str | None:
    """A module namespace's source file, where the line that adds to one of its names is looked for."""
    path = namespace.get("__file__") if isinstance(namespace, dict) else None
    return path if isinstance(path, str) and path.endswith(".py") else None
