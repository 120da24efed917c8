"""A holder path, written as the user would write it: from a name in their code down to the object.

``render(root, chain)`` turns the objects of a path (``chain[0]`` the object the root name refers
to, ``chain[-1]`` the object looked up) into one line such as::

    `callbacks` in train() at train.py:57 → list of 700 items → partial.args[0]
    `trainer.stats.window` in main() at train.py:12 → deque of 512 items
    `errors` in train() at train.py:40 → list of 40 items → [i].__traceback__ → frame train_step() → local `act`

Attributes join into one dotted name; a container is said by its type and size, read now (so a
sentence written later reads the size then), never by one key: ``[i]`` and ``[k]`` stand for "an
element". Closure cells, defaults, ``functools.partial`` arguments, bound methods, exceptions and
their tracebacks, ndarray bases and ``nn.Module`` children are each read the way one would write
them. The hop from one object to the next is found again here, from the objects themselves: the
climb that found the path only knows who refers to whom. A path whose only container that can grow
is a ``deque`` with a ``maxlen`` says so apart (``HolderPath.bound``): what it holds stops growing at
that bound.
"""

from __future__ import annotations

import collections
import functools
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from gpumemd.analysis.holder_adds import UNTIL_RESET
from gpumemd.probes.holding.holder_roots import drop_locals_snapshot, is_user_file, where_added, where_assigned

_CONTAINERS = (list, tuple, set, frozenset, collections.deque, dict)
_GROWABLE = (list, set, collections.deque, dict)
_MODULE_DICTS = frozenset({"_modules", "_parameters", "_buffers"})  # nn.Module children: `model.fc`, `model[1]`


class HolderPath(NamedTuple):
    """A holder path's line, and ``bound``: (maxlen, length now) of the bounded deque that is the only
    container on the path that can grow, else None (no container, or one without a bound)."""

    text: str
    bound: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Root:
    """How a path's first object is named: ``before + name + after``, e.g. `` `losses` in main() at
    train.py:7``; attributes read below it extend ``name`` inside the backticks."""

    name: str
    before: str = "`"
    after: str = "`"
    local_of: tuple[types.CodeType, int | None] | None = None
    """A frame's local: its code and running line, read into `` in f() at file:line`` only when
    this root names a path (finding the line disassembles the code)."""
    source: str | None = None
    """A global's or a class attribute's source file, where the line that adds to it is looked for."""
    prefix: int = 0
    """Characters of ``name`` the source does not write: a global's module and its dot."""

    def suffix(self) -> str:
        if self.local_of is None:
            return self.after
        code, running_line = self.local_of
        return f"` in {code.co_name}() {where_assigned(code, self.name, running_line)}"

    def added(self, expr: str) -> str:
        """``, appended at train.py:57`` for the root's expression (``name`` and the attributes read
        below it), when the source says where it grows; else "". Read only for the root that names
        a path, as its line is."""
        if self.local_of is not None:
            code = self.local_of[0]
            first = None if code.co_name == "<module>" else code.co_firstlineno
            return where_added(code.co_filename, expr, first)
        if self.source is None:
            return ""
        return where_added(self.source, expr[self.prefix:], None)


class _Writer:
    """Pieces joined by " → "; ``expr`` is the expression being extended (``state.history``)."""

    def __init__(self, root: Root) -> None:
        self.pieces: list[str] = []
        self.root: Root | None = root  # until its piece is written: then the line that adds to it
        self.before, self.after = root.before, root.suffix()
        self.expr: str | None = root.name or None
        self.placeholder = False  # expr is only "[i]": an element nobody named yet
        self.growable: list[object] = []  # the containers written that can grow (``HolderPath.bound``)

    def start(self, before: str, expr: str, after: str = "") -> None:
        self.flush()
        self.before, self.expr, self.after, self.placeholder = before, expr, after, False

    def access(self, text: str, owner: str | None = None) -> None:
        """``.attr`` / ``.args[0]`` on the current expression; ``owner`` names a callable element
        (``partial``) instead of ``[i]``."""
        if self.expr is None:
            self.start("", (owner or "") + text)
        elif self.placeholder and owner:
            self.expr = owner + text
        else:
            self.expr += text
        self.placeholder = False

    def container(self, obj: object, element: str) -> None:
        if isinstance(obj, _GROWABLE):
            self.growable.append(obj)
        self.piece(_size_text(obj))
        self.before, self.expr, self.after, self.placeholder = "", element, "", True

    def piece(self, text: str) -> None:
        self.flush()
        self.pieces.append(text)

    def flush(self) -> None:
        if self.expr and not self.placeholder:
            added = self.root.added(self.expr) if self.root is not None else ""
            self.pieces.append(f"{self.before}{self.expr}{self.after}{added}")
        self.root, self.expr, self.placeholder = None, None, False

    def finish(self) -> HolderPath:
        self.flush()
        bound = None
        if len(self.growable) == 1 and isinstance(self.growable[0], collections.deque):
            deque = self.growable[0]
            bound = (deque.maxlen, len(deque)) if deque.maxlen is not None else None
        return HolderPath(" → ".join(self.pieces), bound)


def render(root: Root, chain: Sequence[object]) -> HolderPath:
    """The path ``chain`` (root object first, the object looked up last) in one line, and its bound."""
    start = _past_library_internals(chain)
    if start:
        cls = type(chain[start])
        root, chain = Root(cls.__qualname__, "", "", source=_source_file(cls)), chain[start:]
    writer = _Writer(root)
    i = 0
    while i < len(chain) - 1:
        i += max(1, _hop(writer, chain, i))
    return writer.finish()


def _past_library_internals(chain: Sequence[object]) -> int:
    """Where a path that reaches the job's own object through a library's private attributes starts
    instead: at that object, named by its class (0: where it starts). A Lightning module's list was
    "`t._data_connector._datahook_selector.model.training_step_outputs`", through the Trainer's
    internals, the next time "`t._accelerator_connector._strategy_flag._lightning_module...`"; it
    is "M.training_step_outputs", the attribute the job's class M appends to."""
    private = False
    for i in range(len(chain) - 1):
        parent = chain[i]
        if _is_the_jobs(parent):
            if private:
                return i
            continue
        if not isinstance(parent, (*_SELF_DESCRIBED, type, types.TracebackType)):
            name, _ = _attribute(parent, chain[i + 1], chain[i + 2] if i + 2 < len(chain) else None)
            private = private or (name is not None and name.startswith("_") and not name.startswith("__")
                                  and name not in _MODULE_DICTS)
    return 0


def _is_the_jobs(obj: object) -> bool:
    """An instance of a class the job's own code defines."""
    if isinstance(obj, (*_SELF_DESCRIBED, type)):
        return False
    path = _source_file(type(obj))
    return path is not None and is_user_file(path)


def _source_file(cls: type) -> str | None:
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return path if isinstance(path, str) else None


_SELF_DESCRIBED = (types.FrameType, types.FunctionType, types.MethodType, types.CellType, functools.partial,
                   types.GeneratorType, *_CONTAINERS)


def top_name(obj: object) -> str:
    """The first name of a path cut before any root: the top object's type (``Queue`` in ``Queue.queue``),
    or nothing for what its own hop describes (a function's closure, a frame, a container)."""
    if isinstance(obj, _SELF_DESCRIBED):
        return ""
    return obj.__qualname__ if isinstance(obj, type) else type(obj).__qualname__


def _short_qualname(fn: object) -> str:
    """``make.<lambda>`` for ``main.<locals>.make.<locals>.<lambda>``: the function and what encloses it."""
    parts = [p for p in str(getattr(fn, "__qualname__", "?")).split(".") if p != "<locals>"]
    return ".".join(parts[-2:])


def _size_text(obj: object) -> str:
    try:
        size = len(obj)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - mutated or odd: the type alone
        return type(obj).__name__
    text = f"{type(obj).__name__} of {size:,} item{'' if size == 1 else 's'}"
    # A bound the user set stops the growth there: a reader weighing a leak finding must see it.
    maxlen = obj.maxlen if isinstance(obj, collections.deque) else None
    return f"{text} (maxlen {maxlen:,})" if maxlen is not None else text


def _hop(w: _Writer, chain: Sequence[object], i: int) -> int:
    """Write how ``chain[i]`` holds ``chain[i + 1]``; returns how many hops that took."""
    parent, child = chain[i], chain[i + 1]
    after = chain[i + 2] if i + 2 < len(chain) else None
    if isinstance(parent, types.FrameType):
        _frame_hop(w, parent, child)
        return 1
    if isinstance(parent, types.TracebackType):
        return 1  # tb_next / tb_frame: the frame that follows says where
    if isinstance(parent, functools.partial):
        return _partial_hop(w, parent, child, after)
    if isinstance(parent, types.FunctionType):
        return _function_hop(w, parent, child, chain, i)
    if isinstance(parent, types.MethodType):
        w.access(".__self__" if child is parent.__self__ else ".__func__",
                 f"`{_short_qualname(parent.__func__)}`")
        return 1
    if isinstance(parent, types.CellType):
        w.piece("closure cell")
        return 1
    if isinstance(parent, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
        _suspended_hop(w, parent, child)
        return 1
    if isinstance(parent, type):
        return _class_hop(w, parent, child, after)
    if isinstance(parent, _CONTAINERS):
        w.container(parent, "[k]" if isinstance(parent, dict) else "[i]")
        return 1
    if type(parent).__name__ == "ndarray" and getattr(parent, "base", None) is child:
        w.access(".base")
        return 1
    return _object_hop(w, parent, child, chain, i)


def local_name(frame: types.FrameType, child: object) -> str | None:
    """The name of the local of ``frame`` that is ``child``, if one is."""
    f_locals = frame.f_locals
    name = next((k for k, v in list(f_locals.items()) if v is child), None)
    # frame.clear() (traceback.clear_frames) does not clear that snapshot: drop it now
    drop_locals_snapshot(frame, f_locals)
    return name


def _frame_hop(w: _Writer, frame: types.FrameType, child: object) -> None:
    """A finished frame that a traceback keeps, holding ``child`` as a local."""
    name = local_name(frame, child)
    w.piece(f"frame {frame.f_code.co_name}()")
    if name is not None:
        w.start("local `", name, "`")


_SUSPENDED = ((types.GeneratorType, "generator", "gi_frame"), (types.CoroutineType, "coroutine", "cr_frame"),
              (types.AsyncGeneratorType, "async generator", "ag_frame"))


def _suspended_hop(w: _Writer, parent: object, child: object) -> None:
    """A suspended generator (or coroutine) holding ``child``: by the local's name when it is one
    ("local `produced` of generator `batches`"), else as its frame's."""
    what, frame = next(((word, getattr(parent, attr, None)) for kind, word, attr in _SUSPENDED
                        if isinstance(parent, kind)), ("generator", None))
    name = local_name(frame, child) if isinstance(frame, types.FrameType) else None
    where = f"{what} `{_short_qualname(parent)}`"
    w.piece(f"local `{name}` of {where}" if name is not None else f"a local of {where}")


def _partial_hop(w: _Writer, parent: functools.partial[object], child: object, after: object) -> int:
    if child is parent.args and after is not None:
        index = next((j for j, v in enumerate(parent.args) if v is after), None)
        w.access(f".args[{index if index is not None else '?'}]", "partial")
        return 2
    if child is parent.keywords and after is not None:
        key = next((k for k, v in parent.keywords.items() if v is after), "?")
        w.access(f".keywords[{key!r}]", "partial")
        return 2
    w.access(".func", "partial")
    return 1


def _function_hop(w: _Writer, fn: types.FunctionType, child: object, chain: Sequence[object], i: int) -> int:
    qualname = _short_qualname(fn)
    after = chain[i + 2] if i + 2 < len(chain) else None
    closure, defaults = fn.__closure__ or (), fn.__defaults__ or ()
    if child is fn.__closure__ and isinstance(after, types.CellType):
        index = next((j for j, c in enumerate(closure) if c is after), None)
        names = fn.__code__.co_freevars
        var = names[index] if index is not None and index < len(names) else "?"
        w.start(f"`{qualname}` closure `", var, "`")
        return 3 if i + 3 < len(chain) else 2  # function -> tuple -> cell -> the cell's contents
    if child is fn.__defaults__ and after is not None:
        index = next((j for j, v in enumerate(defaults) if v is after), 0)
        params = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        param = params[len(params) - len(defaults) + index] if len(params) >= len(defaults) else "?"
        w.start(f"`{qualname}` default `", param, "`")
        return 2
    if child is fn.__kwdefaults__ and after is not None:
        key = next((k for k, v in (fn.__kwdefaults__ or {}).items() if v is after), "?")
        w.start(f"`{qualname}` default `", str(key), "`")
        return 2
    w.piece(f"function `{qualname}`")
    return 1


def _class_hop(w: _Writer, cls: type, child: object, after: object) -> int:
    """A class holds its attributes in its namespace dict: ``Class.attr``."""
    for key, value in list(vars(cls).items()):
        if value is child and isinstance(key, str):  # reached from the class itself
            w.access(f".{key}")
            return 1
        if value is after and isinstance(key, str):  # through its namespace dict
            w.access(f".{key}")
            return 2
    w.piece(cls.__qualname__)
    return 1


def _object_hop(w: _Writer, parent: object, child: object, chain: Sequence[object], i: int) -> int:
    """An attribute (``__dict__`` or ``__slots__``) of a plain object; ``nn.Module`` children read
    as ``model.fc`` / ``model[1]``."""
    after = chain[i + 2] if i + 2 < len(chain) else None
    name, taken = _attribute(parent, child, after)
    if name is None:
        w.piece(type(parent).__qualname__)
        return 1
    w.access(f".{name}")
    if _metric_state(parent, name):
        w.after += f" (a {type(parent).__name__}'s state, {UNTIL_RESET})"
    if name in _MODULE_DICTS and isinstance(chain[i + taken], dict) and i + taken + 1 < len(chain):
        mapping = chain[i + taken]
        key = next((k for k, v in list(mapping.items()) if v is chain[i + taken + 1]), None)  # type: ignore[attr-defined]
        if isinstance(key, str):
            w.expr = (w.expr or "").removesuffix(f".{name}") + (f"[{key}]" if key.isdigit() else f".{key}")
            return taken + 1
    return taken


def _metric_state(obj: object, name: str) -> bool:
    """Is ``obj.name`` a state of a torchmetrics metric (its ``_defaults``), which grows by ``update()``?"""
    try:
        return (any(c.__name__ == "Metric" and c.__module__.startswith("torchmetrics") for c in type(obj).__mro__)
                and name in object.__getattribute__(obj, "_defaults"))
    except Exception:  # noqa: BLE001 - an odd object: no metric
        return False


def _attribute(obj: object, child: object, after: object) -> tuple[str | None, int]:
    """(attribute name, hops it takes: 2 through ``obj.__dict__``, else 1) for how ``obj`` holds ``child``."""
    try:
        namespace = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - no __dict__, or a __getattribute__ that objects
        namespace = None
    if isinstance(namespace, dict):
        target, hops = (after, 2) if namespace is child else (child, 1)
        for key, value in list(namespace.items()):
            if value is target and isinstance(key, str):
                return key, hops
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            try:
                if object.__getattribute__(obj, slot) is child:
                    return str(slot), 1
            except Exception:  # noqa: BLE001 - an unset slot
                continue
    if isinstance(obj, BaseException):
        for attr in ("__traceback__", "__context__", "__cause__", "args"):
            if getattr(obj, attr, None) is child:
                return attr, 1
    return None, 1
