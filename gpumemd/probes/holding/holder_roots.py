"""Where a holder path starts: the names a user wrote, read without a heap scan.

The running frames of every thread with their locals (a running frame is no gc referrer of its
locals, so they are read directly), the namespaces of loaded modules, the line that assigns a
variable, and the line that adds to it (its source read once, ``analysis.holder_adds``). gpumemd's
own frames are never roots: the agent's locals are no user's names.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tokenize
import types
from typing import Any

from gpumemd.analysis.holder_adds import NOTHING, SourceAdds, adding_line, adding_words, scan
from gpumemd.probes.holding.package_dirs import not_user_dirs

_CO_OPTIMIZED = 0x0001  # inspect.CO_OPTIMIZED: a function frame, whose f_locals is a snapshot dict


def live_frames() -> list[tuple[types.FrameType, dict[str, Any]]]:
    """Every running frame of every thread with its locals, gpumemd's own frames left out."""
    out: list[tuple[types.FrameType, dict[str, Any]]] = []
    # This frame is among the tops: a local still referring to it when it returns would make a
    # cycle that keeps the caller frames (and their locals, the target included) alive until the
    # next gc. Both locals are empty at the end.
    tops: list[types.FrameType] = list(sys._current_frames().values())
    frame: types.FrameType | None = None
    while tops:
        frame = tops.pop()
        while frame is not None:
            if not is_ours(frame):
                with contextlib.suppress(Exception):  # a frame torn down under us
                    out.append((frame, frame.f_locals))
            frame = frame.f_back
    return out


# The demo's training loop is user code that happens to ship with gpumemd: its locals are holders.
_USER_MODULES = frozenset({"gpumemd.cli.demo"})


def is_ours(frame: types.FrameType) -> bool:
    name = frame.f_globals.get("__name__", "")
    return isinstance(name, str) and name.startswith("gpumemd") and name not in _USER_MODULES


def is_our_generator(obj: object) -> bool:
    """A generator of gpumemd's own (a culprit search that runs one heap pass per step end holds the
    tensor it looks up in a local between its passes): never a holder, as gpumemd's frames are not."""
    if not isinstance(obj, types.GeneratorType):
        return False
    frame = obj.gi_frame
    return frame is not None and is_ours(frame)


def drop_locals_snapshot(frame: types.FrameType, f_locals: dict[str, Any]) -> None:
    """Before 3.13 reading ``f_locals`` of a function frame leaves a snapshot dict on the frame
    that keeps every local alive until the frame ends: clear it, unless a tracer could write it
    back into the frame (a Python tracer sets ``f_trace``), or it is a module/class namespace."""
    if sys.version_info >= (3, 13):
        return
    if not frame.f_code.co_flags & _CO_OPTIMIZED or frame.f_trace is not None:
        return
    if f_locals is frame.f_globals:
        return
    f_locals.clear()


def module_dicts() -> dict[int, str]:
    """Module namespace id -> the module's name. One namespace can have several names: multiprocessing
    aliases the main script as ``__mp_main__`` (spawn and forkserver workers, and a parent preparing
    them); it is named ``__main__``, as the job knows it."""
    out: dict[int, str] = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and (name == "__main__" or id(namespace) not in out):
            out[id(namespace)] = name
    return out


RUNNING_LINE = " (the line running when it was looked up)"
"""How ``where_assigned`` ends when no store names the variable: a parameter, most often."""

_STORED_AT: dict[types.CodeType, dict[str, int]] = {}  # code -> name -> the line of its first store
_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF"})


def first_stores(code: types.CodeType) -> dict[str, int]:
    """Each variable ``code`` stores, with the line of its first store: one disassembly per code
    object (a look-up names every local of every running frame; one pass each was 0.1 s)."""
    stored = _STORED_AT.get(code)
    if stored is None:
        import dis

        stored = {}
        current = None
        try:
            for ins in dis.get_instructions(code):
                current = ins.starts_line or current  # set on the first instruction of each line
                if ins.opname in _STORES and isinstance(ins.argval, str) and current is not None:
                    stored.setdefault(ins.argval, current)
        except Exception:  # noqa: BLE001 - odd code objects: every name falls back to the running line
            stored = {}
        if len(_STORED_AT) < 4096:
            _STORED_AT[code] = stored
    return stored


def where_assigned(code: types.CodeType, name: str, running_line: int | None) -> str:
    """``at train.py:12`` (the line that first assigns the variable in that function), or, when the
    bytecode does not say, the line running when it was looked up, labelled as such."""
    line = first_stores(code).get(name)
    path = short_path(code.co_filename)
    if line is not None:
        return f"at {path}:{line}"
    return f"at {path}:{running_line}{RUNNING_LINE}"


def _user_module_files() -> set[str]:
    """The files of gpumemd's modules that are user code (the demo's training loop)."""
    return {str(getattr(sys.modules.get(name), "__file__", None)) for name in _USER_MODULES}


_ADDS: dict[str, SourceAdds] = {}  # source file -> what adds to what in it, read once
_ADDS_FILES_MAX = 64
_SOURCE_MAX = 256 << 10
"""Bytes: a larger file is not read (a generated one, most likely). Parsing is a pause of the step end
it happens in, once per file: 120 ms for torch's 128 KB ``nn/modules/module.py`` on a loaded 2-core box."""


def where_added(path: str, expr: str, first_line: int | None) -> str:
    """``, appended at train.py:57``: the first line of the job's file ``path`` that adds to ``expr``
    (within the function that starts at ``first_line``, or the whole file for None), or "" when
    none does or the file cannot be read. The file is parsed, never run, once per process."""
    try:
        adds = _ADDS.get(path)
        if adds is None:
            adds = NOTHING
            if (is_user_file(path) or path in _user_module_files()) and os.path.getsize(path) <= _SOURCE_MAX:
                with tokenize.open(path) as f:  # the encoding the file declares
                    adds = scan(f.read())
            if len(_ADDS) < _ADDS_FILES_MAX:
                _ADDS[path] = adds
        found = adding_line(adds, expr, first_line)
    except Exception:  # noqa: BLE001 - gone, unreadable, odd encoding: the path is said without it
        return ""
    return f", {adding_words(found, short_path(path))}" if found is not None else ""


def short_path(path: str) -> str:
    """The file name with its parent directory: enough to find it, short enough for one line."""
    parts = path.replace("\\", "/").rsplit("/", 2)
    return "/".join(parts[-2:]) if len(parts) > 2 else path


def is_user_file(path: str) -> bool:
    """Is this source file the job's own code: neither the standard library, torch, gpumemd, nor an
    installed package (True when that cannot be told: no file is then put after another)."""
    try:
        internal = not_user_dirs()
    except Exception:  # noqa: BLE001 - no torch (it names torch's directory)
        return True
    path = path.replace("\\", "/")
    return "-packages/" not in path and not path.startswith(internal) and not path.startswith("<frozen")


def user_modules(namespaces: dict[int, str]) -> list[tuple[str, dict[str, Any]]]:
    """(name, namespace) of the loaded modules that are the job's own code: neither the standard
    library, torch, gpumemd, nor an installed package. ``namespaces``: ``module_dicts()``."""
    try:
        internal = not_user_dirs()
    except Exception:  # noqa: BLE001 - no torch (it names torch's directory): no module is told apart
        return []
    out: list[tuple[str, dict[str, Any]]] = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        path = getattr(module, "__file__", None)
        if not isinstance(namespace, dict) or not isinstance(path, str) or id(namespace) not in namespaces:
            continue
        path = path.replace("\\", "/")
        if "-packages/" in path or path.startswith(internal):
            continue
        out.append((namespaces[id(namespace)], namespace))
    return out

