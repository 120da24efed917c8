"""Who holds an object: climb ``gc.get_referrers`` to something a human knows, in one line.

``who_holds(tensor)`` answers, for example::

    `losses` in main() at train.py:57 → list of 1,204 items
    TrainerState.history → list of 12 items
    module global `myjob.data.CACHE` → dict key 'preds'

The climb is breadth-first, one ``gc.get_referrers`` call (a heap scan) per level, so it is bounded
in depth and time and meant for a few sample tensors, never for every tensor. Terminals, best first:
a local variable of a running frame (found by reading the frames of every thread: a running frame
is not a gc referrer of its locals), a module global, an attribute of an object or class. Lists,
tuples, sets and dicts on the way are described by their size or key. gpumemd's own frames and the
containers the caller passes in ``ignore`` are never reported.

Every heap scan for "who holds X" lives here: ``who_holds`` for one object, ``fill_holders`` for the
few census groups worth naming, ``holder_of_group`` for a census group found again by its key, and
``cycle_holder`` for garbage that only a reference cycle keeps.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import types
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gpumemd.records.census import Census, CensusGroup, GroupKey

if TYPE_CHECKING:
    import torch

_CO_OPTIMIZED = 0x0001  # inspect.CO_OPTIMIZED: a function frame, whose f_locals is a snapshot dict
_FRONTIER_MAX = 256
_KEY_TEXT_MAX = 40
_RANK = {"local": 0, "global": 1, "attribute": 2, "other": 3}
_SEQUENCES = (list, tuple, set, frozenset, deque)

HOLDER_BUDGET_S = 0.5
"""One holder look-up (heap scans) per state change takes at most this long."""


def who_holds(
    obj: Any,
    *,
    max_depth: int = 8,
    time_budget_s: float = 1.0,
    ignore: Iterable[Any] = (),
) -> str | None:
    """One line naming what keeps ``obj`` alive, or None when nothing recognisable was found in
    ``max_depth`` levels and ``time_budget_s`` seconds. Never raises for an odd object."""
    try:
        return _Climb(obj, ignore, time_budget_s).run(max_depth)
    except Exception:  # noqa: BLE001 - a diagnostic must never fail the caller; None means "unknown"
        return None


class _Climb:
    def __init__(self, target: Any, ignore: Iterable[Any], time_budget_s: float) -> None:
        self.deadline = time.monotonic() + time_budget_s
        self.target_id = id(target)
        # Everything this search creates that references candidates must never be reported.
        self.nodes: dict[int, Any] = {id(target): target}  # id -> object, keeps ids unique while we run
        self.child_of: dict[int, int] = {}  # referrer id -> id of the object it holds on our path
        self.step_text: dict[int, str] = {}  # referrer id -> how it holds that object
        self.dict_key: dict[int, str] = {}  # dict id -> the key under which it holds the object
        self.frames = _live_frames()
        self.own: set[int] = {id(x) for x in ignore}
        self.own.update(id(x) for x in (self.nodes, self.child_of, self.step_text, self.dict_key, self.frames))
        self.own.update(id(f_locals) for _, f_locals in self.frames)
        self.module_dicts = _module_dicts()

    def run(self, max_depth: int) -> str | None:
        frontier = [self.nodes[self.target_id]]
        try:
            for _ in range(max_depth):
                frontier_ids = {id(o) for o in frontier}
                best = self._frame_terminal(frontier_ids)
                if best is not None:
                    return self._render(*best)
                if time.monotonic() > self.deadline:
                    return None
                terminals, following = self._climb(frontier, frontier_ids)
                if terminals:
                    terminals.sort(key=lambda t: t[0])
                    _, text, child_id = terminals[0]
                    return self._render(text, child_id)
                if not following:
                    return None
                frontier = following
            return None
        finally:
            self._release()

    def _climb(self, frontier: list[Any], frontier_ids: set[int]) -> tuple[list[tuple[int, str, int]], list[Any]]:
        """One level up (one heap scan): the terminals among the referrers of ``frontier`` as (rank,
        text, id of the object they hold), and the containers to climb from next."""
        referrers = gc.get_referrers(*frontier)
        self.own.add(id(referrers))
        self.own.add(id(frontier))
        terminals: list[tuple[int, str, int]] = []
        following: list[Any] = []
        for ref in referrers:
            rid = id(ref)
            if rid in self.own or rid in self.nodes:
                continue
            child = _held_child(ref, frontier_ids)
            if child is None:
                continue
            found = self._classify(ref, child)
            if found is None:
                continue
            kind, text, skip_child = found
            if skip_child:  # the child is the holder's own __dict__: its key is in the name
                child = self.nodes[self.child_of[id(child)]]
            self.nodes[rid] = ref
            self.child_of[rid] = id(child)
            if kind == "step":
                self.step_text[rid] = text
                if len(following) < _FRONTIER_MAX:
                    following.append(ref)
            else:
                terminals.append((_RANK[kind], text, id(child)))
        del referrers
        return terminals, following

    # --- terminals and steps --------------------------------------------------------------------

    def _frame_terminal(self, frontier_ids: set[int]) -> tuple[str, int] | None:
        for frame, f_locals in self.frames:
            for name, value in f_locals.items():
                if id(value) in frontier_ids:
                    code = frame.f_code
                    if name in code.co_freevars or not name.isidentifier():
                        # a closure's view of an outer frame's variable (the outer frame is named
                        # instead), or a compiler-made slot such as pytest's `@py_assert1`
                        continue
                    return f"`{name}` in {code.co_name}() {_where_assigned(code, name, frame.f_lineno)}", id(value)
        return None

    def _classify(self, ref: Any, child: Any) -> tuple[str, str, bool] | None:
        """("local"|"global"|"attribute"|"other", terminal text) or ("step", container text)."""
        if isinstance(ref, types.FrameType):
            return _finished_frame(ref, child)
        if isinstance(ref, dict):
            key = _key_for(ref, child)
            module = self.module_dicts.get(id(ref))
            if module is not None:
                return "global", f"module global `{module}.{_bare(key)}`", False
            self.dict_key[id(ref)] = key
            return "step", f"dict key {key}", False
        if isinstance(ref, _SEQUENCES):
            size = len(ref)
            return "step", f"{type(ref).__name__} of {size:,} item{'' if size == 1 else 's'}", False
        if isinstance(ref, type):
            class_key = self.dict_key.get(id(child))
            if class_key is not None:
                return "attribute", f"{ref.__qualname__}.{_bare(class_key)}", True
            return None  # mro tuples, bases: not how a class keeps an object alive
        if isinstance(ref, types.ModuleType):
            return None  # a module refers to its dict, which was reported as a global already
        if isinstance(ref, (types.FunctionType, types.MethodType)):
            return "other", f"function `{getattr(ref, '__qualname__', '?')}`", False
        if isinstance(ref, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
            return "local", f"a local of generator `{getattr(ref, '__qualname__', '?')}`", False
        if isinstance(ref, types.CellType):
            return "step", "closure cell", False
        found = _attribute_of(ref, child, self.dict_key.get(id(child)))
        if found is not None:
            return "attribute", f"{type(ref).__qualname__}.{found[0]}", found[1]
        return "step", type(ref).__qualname__, False

    def _render(self, terminal: str, child_id: int) -> str:
        parts = [terminal]
        current = child_id
        while current != self.target_id:
            text = self.step_text.get(current)
            nxt = self.child_of.get(current)
            if nxt is None:
                break
            if text:
                parts.append(text)
            current = nxt
        return " → ".join(parts)

    def _release(self) -> None:
        for frame, f_locals in self.frames:
            _drop_locals_snapshot(frame, f_locals)
        self.frames.clear()
        self.nodes.clear()


# --- helpers ---------------------------------------------------------------------------------------


def _live_frames() -> list[tuple[types.FrameType, dict[str, Any]]]:
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
            if not _is_ours(frame):
                with contextlib.suppress(Exception):  # a frame torn down under us
                    out.append((frame, frame.f_locals))
            frame = frame.f_back
    return out


def _finished_frame(frame: types.FrameType, child: Any) -> tuple[str, str, bool] | None:
    """Running frames are no gc referrers of their locals (they are read directly): this is a
    finished frame that a traceback (a stored exception) still keeps, with all its locals."""
    if _is_ours(frame):
        return None
    f_locals = frame.f_locals
    name = next((k for k, v in list(f_locals.items()) if v is child), None)
    # frame.clear() (traceback.clear_frames) does not clear that snapshot: drop it now
    _drop_locals_snapshot(frame, f_locals)
    del f_locals
    if name is None:
        return None
    where = f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
    return "local", f"`{name}` in {frame.f_code.co_name}() at {where} (a finished frame a traceback keeps)", False


# The demo's training loop is user code that happens to ship with gpumemd: its locals are holders.
_USER_MODULES = frozenset({"gpumemd.cli.demo"})


def _is_ours(frame: types.FrameType) -> bool:
    name = frame.f_globals.get("__name__", "")
    return isinstance(name, str) and name.startswith("gpumemd") and name not in _USER_MODULES


def _drop_locals_snapshot(frame: types.FrameType, f_locals: dict[str, Any]) -> None:
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


def _module_dicts() -> dict[int, str]:
    """Module namespace id -> the module's name. One namespace can have several names: multiprocessing
    aliases the main script as ``__mp_main__`` (spawn and forkserver workers, and a parent preparing
    them); it is named ``__main__``, as the job knows it."""
    out: dict[int, str] = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and (name == "__main__" or id(namespace) not in out):
            out[id(namespace)] = name
    return out


def _held_child(ref: Any, frontier_ids: set[int]) -> Any:
    for referent in gc.get_referents(ref):
        if id(referent) in frontier_ids:
            return referent
    return None


def _key_for(mapping: dict[Any, Any], child: Any) -> str:
    for key, value in list(mapping.items()):
        if value is child:
            return _key_text(key)
        if key is child:
            return f"(a key; {len(mapping):,} items)"
    return "?"


def _key_text(key: Any) -> str:
    # repr() only of plain scalars: repr() of a tensor would synchronise the device.
    if isinstance(key, (str, int, float, bool)) or key is None:
        text = repr(key)
        return text if len(text) <= _KEY_TEXT_MAX else text[: _KEY_TEXT_MAX - 1] + "…"
    return f"<{type(key).__qualname__}>"


def _bare(key_text: str) -> str:
    return key_text[1:-1] if len(key_text) >= 2 and key_text[0] == key_text[-1] == "'" else key_text


def _attribute_of(obj: Any, child: Any, child_dict_key: str | None) -> tuple[str, bool] | None:
    """(attribute name, whether ``child`` is ``obj.__dict__``) for how ``obj`` holds ``child``."""
    try:
        namespace = object.__getattribute__(obj, "__dict__")
    except Exception:  # noqa: BLE001 - no __dict__, or a __getattribute__ that objects
        namespace = None
    if namespace is child and child_dict_key is not None:
        return _bare(child_dict_key), True
    if isinstance(namespace, dict):
        for key, value in list(namespace.items()):
            if value is child and isinstance(key, str):
                return key, False
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            try:
                if object.__getattribute__(obj, slot) is child:
                    return str(slot), False
            except Exception:  # noqa: BLE001 - an unset slot
                continue
    return None


_ASSIGNED: dict[tuple[Any, str], int | None] = {}
_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF"})


def _where_assigned(code: types.CodeType, name: str, running_line: int | None) -> str:
    """``at train.py:12`` (the line that first assigns the variable in that function), or, when the
    bytecode does not say, the line running when it was looked up, labelled as such."""
    key = (code, name)
    if key not in _ASSIGNED:
        import dis

        line = current = None
        try:
            for ins in dis.get_instructions(code):
                current = ins.starts_line or current  # set on the first instruction of each line
                if ins.opname in _STORES and ins.argval == name:
                    line = current
                    break
        except Exception:  # noqa: BLE001 - odd code objects: fall back to the running line
            line = None
        if len(_ASSIGNED) < 4096:
            _ASSIGNED[key] = line
    else:
        line = _ASSIGNED[key]
    path = _short_path(code.co_filename)
    if line is not None:
        return f"at {path}:{line}"
    return f"at {path}:{running_line} (the line running when it was looked up)"


def _short_path(path: str) -> str:
    """The file name with its parent directory: enough to find it, short enough for one line."""
    parts = path.replace("\\", "/").rsplit("/", 2)
    return "/".join(parts[-2:]) if len(parts) > 2 else path


def holder_of_group(key: GroupKey) -> str | None:
    """Who holds a live tensor of this census group (the census looks holders up only for groups
    whose count grew; a retained graph grows behind one tensor)."""
    import torch  # lazily: `import gpumemd` stays light

    deadline = time.monotonic() + HOLDER_BUDGET_S
    sample = None
    for i, obj in enumerate(gc.get_objects()):
        if i % 4096 == 0 and time.monotonic() > deadline:
            return None
        if type(obj) is not torch.Tensor:  # exact type: cheap, and parameters are never culprits here
            continue
        try:
            if (tuple(obj.shape) == key.shape and str(obj.dtype).removeprefix("torch.") ==
                    key.dtype.removeprefix("torch.") and str(obj.device) == key.device.name
                    and (key.category != "graph" or obj.grad_fn is not None)):
                sample = obj
                break
        except Exception:  # noqa: BLE001 - an odd tensor subclass must not stop the search
            continue
    if sample is None:
        return None
    try:
        return who_holds(sample, time_budget_s=max(0.05, deadline - time.monotonic())) or cycle_holder(sample)
    finally:
        del sample


def cycle_holder(obj: Any, max_objects: int = 32) -> str | None:
    """``Node.payload, in a reference cycle nothing else refers to`` when ``obj`` is an attribute of
    an object whose referrers close into a small cycle: garbage the collector has not freed (gc
    disabled, frozen, or not run yet). ``who_holds`` finds no name for it: there is none."""
    refs = gc.get_referrers(obj)
    owner, attr = None, None
    for ref in refs:
        attrs = getattr(ref, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(ref, type):
            attr = next((k for k, v in attrs.items() if v is obj), None)
            if attr is not None:
                owner = ref
                break
    refs.clear()
    if owner is None:
        return None
    closure: dict[int, Any] = {id(owner): owner}
    frontier = [owner]
    while frontier:
        current = frontier.pop()
        found = gc.get_referrers(current)
        for ref in found:
            if ref is frontier or ref is closure or ref is found or id(ref) in closure:
                continue
            if isinstance(ref, (types.FrameType, types.ModuleType)):
                return None  # a running frame or a module holds it: not garbage
            closure[id(ref)] = ref
            if len(closure) > max_objects:
                return None  # reachable from something larger: not an isolated cycle
            frontier.append(ref)
        found.clear()
    return f"{type(owner).__name__}.{attr}, in a reference cycle nothing else refers to (garbage gc has not freed)"


def fill_holders(
    groups: list[CensusGroup],
    samples: dict[GroupKey, torch.Tensor],
    owners: dict[GroupKey, torch.Tensor],
    *,
    holders: int,
    previous: Census | None,
    budget_s: float,
) -> list[CensusGroup]:
    """A census's groups with ``holder`` set for the few that need it: the ``holders`` anonymous
    groups that grew most since ``previous`` (or the largest ones, without it), looked up through
    a sample tensor of each (``samples``), all lookups together within ``budget_s``.

    A tensor that only an autograd graph keeps (a saved activation) has no gc referrer: it is
    described as ``autograd graph of <who holds the tensor that keeps the graph>`` (``owners``)."""
    chosen = _groups_to_look_up(groups, holders, previous)
    if not chosen:
        return groups
    deadline = time.monotonic() + budget_s
    found: dict[GroupKey, str] = {}
    owner_lines: dict[int, str | None] = {}
    for group in chosen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sample = samples.get(group.key)
        if sample is None:
            continue
        holder = who_holds(sample, time_budget_s=remaining, ignore=(samples, owners))
        del sample
        owner = owners.get(group.key)
        if holder is None and owner is not None:
            if id(owner) not in owner_lines:
                remaining = max(0.0, deadline - time.monotonic())
                owner_lines[id(owner)] = who_holds(owner, time_budget_s=remaining, ignore=(samples, owners))
            line = owner_lines[id(owner)]
            holder = f"autograd graph of {line}" if line else "an autograd graph"
        del owner
        if holder is not None:
            found[group.key] = holder
    if not found:
        return groups
    return [
        CensusGroup(g.key, g.count, g.nbytes, g.graph_bytes, found[g.key]) if g.key in found else g
        for g in groups
    ]


def _groups_to_look_up(groups: list[CensusGroup], holders: int, previous: Census | None) -> list[CensusGroup]:
    """The anonymous groups that grew most since ``previous`` (in count or bytes), or the largest."""
    anonymous = [g for g in groups if g.key.name is None]
    if previous is None:
        return anonymous[:holders]
    before = {g.key: g for g in previous.groups}

    def growth(g: CensusGroup) -> int:
        old = before.get(g.key)
        return g.nbytes + g.graph_bytes - (old.nbytes + old.graph_bytes if old else 0)

    grown = [(growth(g), g) for g in anonymous if g.count > getattr(before.get(g.key), "count", 0)
             or growth(g) > 0]
    grown.sort(key=lambda pair: pair[0], reverse=True)
    return [g for _, g in grown[:holders]]
