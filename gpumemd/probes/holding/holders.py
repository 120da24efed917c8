"""Who holds an object: the path from a name the user wrote down to it, in one line.

``who_holds(tensor)`` answers, for example::

    `losses` in main() at train.py:57 → list of 1,204 items
    `trainer.history` in main() at train.py:40 → list of 12 items
    module global `myjob.data.CACHE` → dict of 3 items
    `callbacks` in train() at train.py:57 → list of 700 items → partial.args[0]

The climb is breadth-first, one ``gc.get_referrers`` call (a heap scan) per level, so it is bounded
in depth and time and meant for a few sample tensors, never for every tensor; no scan starts that
the longest one so far says would overrun the time budget. It climbs through containers, objects,
closures, partials, bound methods, kept tracebacks and numpy arrays (which the gc does not track:
``_Climb._untracked``) until a root: a local variable of a running frame (read from the frames of
every thread: a running frame is not a gc referrer of its locals), a module global, or a class
attribute. Cut by the bounds before any root, the path starts at the nearest owner it reached and
says so. ``holder_tiers`` lists the roots, ``holder_paths`` writes the line; gpumemd's own frames and
the containers the caller passes in ``ignore`` are never reported.

Every heap scan for "who holds X" lives here: ``who_holds`` (and ``who_holds_stepwise``) for one
object, and ``cycle_holder`` for garbage that only a reference cycle keeps. Which census groups are
worth a look-up is ``probes.holding.holder_groups``.
"""

from __future__ import annotations

import gc
import sys
import time
import types
from collections import deque
from collections.abc import Iterable
from typing import Any

from gpumemd.probes.heap.stepwise import Stepwise, hold_weakly, run_to_end
from gpumemd.probes.holding.holder_paths import HolderPath, Root, local_name, render, top_name
from gpumemd.probes.holding.holder_reach import Reach, reach_down
from gpumemd.probes.holding.holder_roots import (
    drop_locals_snapshot,
    is_our_generator,
    is_ours,
    is_user_file,
    live_frames,
    module_dicts,
)
from gpumemd.probes.holding.holder_tiers import global_root, root_tiers, source_of

_FRONTIER_MAX = 32  # get_referrers compares each reference it visits with every frontier object
_UNTRACKED_CHUNK = 4096

PATH_CUT = " (path cut at depth "
"""How a path the bounds cut below any name reads, before its depth: not an answer, a lead."""

HOLDER_BUDGET_S = 0.25
"""A holder look-up's pause: past ``LEVELS_MIN`` levels no scan starts that would overrun it. At 1M
gc objects on a slow 2-core box those levels took up to 394 ms (``benchmarks/bench_holder_paths.py``);
``who_holds_stepwise`` pauses instead, each step end within this and one scan."""

LEVELS_MIN = 4
"""Levels a climb always goes up, whatever the clock says. Where one heap scan is slow (a loaded or
slow CPU: 120 ms for 170k objects on a shared 2-core box) the budget alone stopped at the first
level, and the finding said "holder not found"; the pause of a state change (a few in a run) then
grows to what four scans cost instead (``who_holds``; ``who_holds_stepwise`` goes on at the next step
end instead)."""

PAUSES_MAX = 4
"""Step ends a stepwise look-up may go on into after the first: at four levels a pause or more, a
path of twenty levels is found."""


def who_holds(
    obj: Any,
    *,
    max_depth: int = 12,
    time_budget_s: float = 1.0,
    ignore: Iterable[Any] = (),
) -> str | None:
    """One line naming what keeps ``obj`` alive, from a name the user wrote, or None when nothing
    recognisable was found in ``max_depth`` levels and ``time_budget_s`` seconds. A path that the
    bounds cut below any name starts at the nearest owner found and says "path cut at depth N".
    Never raises for an odd object."""
    path = run_to_end(who_holds_stepwise(obj, max_depth=max_depth, time_budget_s=time_budget_s, ignore=ignore,
                                         pauses=0))
    return path.text if path is not None else None


def who_holds_stepwise(
    obj: Any,
    *,
    max_depth: int = 12,
    time_budget_s: float = HOLDER_BUDGET_S,
    ignore: Iterable[Any] = (),
    pauses: int = PAUSES_MAX,
) -> Stepwise[HolderPath | None]:
    """``who_holds`` over up to ``pauses`` + 1 step ends, each within ``time_budget_s``: where the
    budget ends below any name, the climb yields and goes on at the next step end from the level it
    reached (on a slow CPU or a big heap one pause is a few levels). Across a yield the frames' locals
    are let go; the containers climbed through are kept (a leak's holders: the job keeps them too),
    and with them ``obj``, for ``pauses`` step ends at most."""
    climb = None
    try:
        climb = _Climb(obj, ignore, time_budget_s)
        del obj
        return (yield from climb.steps(max_depth, pauses))
    except Exception:  # noqa: BLE001 - a diagnostic must never fail the caller; None means "unknown"
        return None
    finally:
        if climb is not None:
            climb.release()


class _Climb:
    """Breadth first up the referrers, one heap scan per level, until a root: a running frame's
    local (read before each scan), a module global or a class attribute (found by the scan)."""

    def __init__(self, target: Any, ignore: Iterable[Any], time_budget_s: float) -> None:
        self.budget_s = time_budget_s
        self.target_id = id(target)
        # Everything this search creates that references candidates must never be reported.
        self.nodes: dict[int, Any] = {id(target): target}  # id -> object, keeps ids unique while we run
        self.child_of: dict[int, int] = {}  # referrer id -> id of the object it holds on our path
        self.owner: int | None = None  # the nearest named owner (object, function, frame): where a cut path starts
        self.scan_s = 0.0  # the longest heap scan so far: no scan starts that would overrun the deadline
        self.ignored = {id(x) for x in ignore}
        self.frames: list[tuple[types.FrameType, dict[str, Any]]] = []
        self.reach = Reach()
        self._look()

    def _look(self) -> None:
        """Read the running frames' locals and what they reach down (within a fifth of the budget):
        a climb stops where it meets it. Every pause starts with a fresh look."""
        self.deadline = time.monotonic() + self.budget_s
        self.frames = live_frames()
        self.own: set[int] = set(self.ignored)
        self.own.update(id(x) for x in (self.nodes, self.child_of, self.frames))
        self.own.update(id(f_locals) for _, f_locals in self.frames)
        self.module_dicts = module_dicts()
        self.reach = reach_down(root_tiers(self.frames, self.module_dicts), self.own,
                                self.module_dicts, min(self.deadline, time.monotonic() + self.budget_s / 5))
        self.own.update(id(x) for x in (self.reach.objects, self.reach.parent, self.reach.roots, self.reach.depth))

    def _let_go(self) -> None:
        for frame, f_locals in self.frames:
            drop_locals_snapshot(frame, f_locals)
        self.frames.clear()
        self.reach.clear()

    def steps(self, max_depth: int, pauses: int) -> Stepwise[HolderPath | None]:
        frontier = [self.nodes[self.target_id]]
        depth = climbed = 0  # levels in all, and since the last look
        searched_untracked = False
        while True:
            frontier_ids = {id(o) for o in frontier}
            line = self._met(frontier_ids)
            if line is not None:
                return line
            if depth >= max_depth:
                break
            if climbed and time.monotonic() + self.scan_s > self.deadline:  # a level a look at least
                if pauses > 0:
                    pauses, climbed = pauses - 1, 0
                    if not (yield from self._pause()):
                        return None
                    continue  # the new look may meet the frontier as it is
                if depth >= LEVELS_MIN:
                    break
            self.own.add(id(frontier))
            roots, following = self._climb(frontier, frontier_ids)
            depth, climbed = depth + 1, climbed + 1
            if roots:
                _, root, start_id = min(roots, key=lambda r: r[0])
                return render(root, self._chain(start_id))
            if not following and not searched_untracked:
                # nothing tracked refers to what was reached: an untracked holder, perhaps
                following, searched_untracked = self._untracked(set(self.nodes)), True
            if not following:
                break
            frontier = following
        return self._cut(depth)

    def _pause(self) -> Stepwise[bool]:
        """Let the job run a step holding nothing of it but the containers climbed through; False when
        the target died meanwhile (it was the last of them the job let go)."""
        held = hold_weakly(self.nodes.pop(self.target_id))
        self._let_go()
        yield
        target = held()
        if target is None:
            return False
        self.nodes[self.target_id] = target
        del target
        self._look()
        return True

    def _climb(self, frontier: list[Any], frontier_ids: set[int]) -> tuple[list[tuple[int, Root, int]], list[Any]]:
        """One level up (one heap scan): the roots among the referrers of ``frontier`` as (rank, root,
        id of the object the root names), and the referrers to climb from next."""
        started = time.monotonic()
        referrers = gc.get_referrers(*frontier)
        self.scan_s = max(self.scan_s, time.monotonic() - started)
        self.own.add(id(referrers))
        roots: list[tuple[int, Root, int]] = []
        following: list[Any] = []
        for ref in referrers:
            rid = id(ref)
            if rid in self.own or rid in self.nodes:
                continue
            child = _held_child(ref, frontier_ids)
            if child is None or (isinstance(ref, types.FrameType) and is_ours(ref)) or is_our_generator(ref):
                continue
            if isinstance(ref, types.ModuleType):
                continue  # a module refers to its dict, which is a root already
            root = self._root(ref, child)
            if root is not None:
                roots.append(root)
                continue
            if isinstance(ref, type):
                continue  # mro tuples, bases: not how a class keeps an object alive
            self.nodes[rid] = ref
            self.child_of[rid] = id(child)
            if _named_owner(ref) and (self.owner is None or _user_frame_over(ref, self.nodes[self.owner])):
                self.owner = rid
            if len(following) < _FRONTIER_MAX:
                following.append(ref)
        del referrers
        return roots, following

    def _met(self, frontier_ids: set[int]) -> HolderPath | None:
        """The path, when the frontier meets what the locals reach (the nearest local first)."""
        reach = self.reach
        met = [i for i in frontier_ids if i in reach.objects]
        if not met:
            return None
        meet = min(met, key=lambda i: reach.depth[i])
        root, down = reach.chain_to(meet)
        return render(root, down + self._chain(meet)[1:])

    def _root(self, ref: Any, child: Any) -> tuple[int, Root, int] | None:
        """(rank, root, id of the object it names) when ``ref`` is a module namespace or a class."""
        if isinstance(ref, dict):
            module = self.module_dicts.get(id(ref))
            if module is not None:
                return 0, global_root(module, _key_text(ref, child), source_of(ref)), id(child)
            return None
        if isinstance(ref, type) and id(child) in self.child_of and child is _class_namespace(ref):
            held = self.child_of[id(child)]
            source = source_of(getattr(sys.modules.get(ref.__module__), "__dict__", None))
            return 1, Root(f"{ref.__qualname__}.{_key_text(child, self.nodes[held])}", source=source), held
        return None

    def _untracked(self, reached: set[int]) -> list[Any]:
        """Holders the gc does not track (a numpy array whose ``base`` is the object: ``t.numpy()``),
        found from the side of their tracked referrers: what those refer to, chunk by chunk."""
        numpy = sys.modules.get("numpy")
        if numpy is None:
            return []
        ndarray = numpy.ndarray
        found: list[Any] = []
        objects = gc.get_objects()
        self.own.add(id(objects))
        try:
            for start in range(0, len(objects), _UNTRACKED_CHUNK):
                if time.monotonic() > self.deadline:
                    break
                for ref in gc.get_referents(*objects[start:start + _UNTRACKED_CHUNK]):
                    if type(ref) is ndarray and id(ref.base) in reached and id(ref) not in self.nodes:
                        self.nodes[id(ref)] = ref
                        self.child_of[id(ref)] = id(ref.base)
                        found.append(ref)
                if found:
                    break
        finally:
            objects.clear()
        return found

    def _cut(self, depth: int) -> HolderPath | None:
        """The path from the nearest named owner, when the bounds stopped the climb below any root."""
        if self.owner is None:
            return None
        chain = self._chain(self.owner)
        top = chain[0]
        name = local_name(top, chain[1]) if isinstance(top, types.FrameType) and len(chain) > 1 else None
        if name is not None:  # a finished frame's local (at an OOM, a failing frame's): named as a running one's
            text = render(Root(name, local_of=(top.f_code, top.f_lineno)), chain[1:]).text + ", a finished frame"
        else:
            text = render(Root(top_name(top), "", ""), chain).text
        # No bound: the containers above the owner are not known.
        return HolderPath(f"{text}{PATH_CUT}{depth})")

    def _chain(self, start_id: int) -> list[Any]:
        chain = [self.nodes[start_id]]
        current = start_id
        while current != self.target_id and current in self.child_of:
            current = self.child_of[current]
            chain.append(self.nodes[current])
        return chain

    def release(self) -> None:
        self._let_go()
        self.nodes.clear()


# --- helpers ---------------------------------------------------------------------------------------


def _named_owner(ref: Any) -> bool:
    """An object a cut path can start at: anything but an anonymous container or a closure cell."""
    return not isinstance(ref, (list, tuple, set, frozenset, deque, dict, types.CellType, types.TracebackType))


def _user_frame_over(ref: Any, owner: Any) -> bool:
    """Does a cut path start better at ``ref`` than at ``owner``: a frame of the job's code over a
    library's (the failing frames at an OOM hold the same tensor as the job's `x` and torch's `input`,
    in whichever order the heap lists them)?"""
    return (isinstance(ref, types.FrameType) and isinstance(owner, types.FrameType)
            and is_user_file(ref.f_code.co_filename) and not is_user_file(owner.f_code.co_filename))


def _class_namespace(cls: type) -> Any:
    """The dict behind ``cls.__dict__`` (a read-only proxy): the gc referrer of class attributes."""
    return next((r for r in gc.get_referents(cls) if isinstance(r, dict) and "__module__" in r), None)


def _held_child(ref: Any, frontier_ids: set[int]) -> Any:
    return next((r for r in gc.get_referents(ref) if id(r) in frontier_ids), None)


def _key_text(mapping: Any, child: Any) -> str:
    """The name under which a namespace holds ``child`` (variable names are short and plain)."""
    for key, value in list(mapping.items()):
        if value is child:
            return key if isinstance(key, str) else f"<{type(key).__qualname__}>"
    return "?"


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
