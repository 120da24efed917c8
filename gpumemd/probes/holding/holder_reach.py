"""What the running frames' locals reach in a few hops, found downwards without any heap scan.

Climbing from an object to a name costs one heap scan per level (tens of milliseconds on a large
heap). The other half of the path is cheap: from each user local, ``gc.get_referents`` (what an
object refers to) a few levels down, bounded in objects and time. The climb stops at the first level
that meets an object reached from below: a forward hook's closure deep inside ``model`` is then a few
scans away, not ten. Large containers are only followed through their newest items (the end of their
referents): a leak appends, and the climb finds the container itself anyway.
"""

from __future__ import annotations

import collections
import gc
import itertools
import time
import types
from collections.abc import Sequence
from typing import Any

from gpumemd.probes.holding.holder_paths import Root
from gpumemd.probes.holding.holder_roots import is_our_generator

_OBJECTS_MAX = 20_000
_OBJECTS_MIN = 5_000  # visited whatever the clock says: a slow CPU still reaches a few levels down
_DEPTH_MAX = 10
_NEWEST_ITEMS = 64  # items followed in a container larger than this: the last ones
_NOT_FOLLOWED = (type, types.ModuleType, types.CodeType, str, bytes)


class Reach:
    """id -> (object, id of the object one level up or None at a root); roots name their object."""

    def __init__(self) -> None:
        self.objects: dict[int, Any] = {}
        self.parent: dict[int, int | None] = {}
        self.roots: dict[int, Root] = {}
        self.depth: dict[int, int] = {}

    def chain_to(self, obj_id: int) -> tuple[Root, list[Any]]:
        """The root and the objects from its object down to ``obj_id``."""
        chain: list[Any] = []
        current: int | None = obj_id
        while current is not None:
            chain.append(self.objects[current])
            root_id, current = current, self.parent[current]
        chain.reverse()
        return self.roots[root_id], chain

    def clear(self) -> None:
        self.objects.clear()
        self.parent.clear()
        self.roots.clear()
        self.depth.clear()


def reach_down(tiers: Sequence[list[tuple[Root, Any]]], own: set[int], module_dicts: dict[int, str],
               deadline: float) -> Reach:
    """Breadth first from the roots (a name and its object) of each tier in turn, at most
    ``_OBJECTS_MAX`` objects and ``_DEPTH_MAX`` levels in all, past ``deadline`` only for the first
    ``_OBJECTS_MIN``; ``own`` and module namespaces are not followed. The job's own frames come first,
    then its globals: a test runner's or a framework's frames reach thousands of objects that would
    spend the bounds first."""
    reach = Reach()
    for roots in tiers:
        if not _spread(reach, roots, own, module_dicts, deadline):
            break
    return reach


def _spread(reach: Reach, roots: list[tuple[Root, Any]], own: set[int], module_dicts: dict[int, str],
            deadline: float) -> bool:
    """One tier's breadth-first walk into ``reach``; False when the bounds stopped it."""
    level: list[Any] = []
    for root, obj in roots:
        if id(obj) not in reach.objects:
            reach.objects[id(obj)], reach.parent[id(obj)], reach.depth[id(obj)] = obj, None, 0
            reach.roots[id(obj)] = root
            level.append(obj)
    for depth in range(1, _DEPTH_MAX + 1):
        following: list[Any] = []
        for obj in level:
            seen = len(reach.objects)
            if seen >= _OBJECTS_MAX or (seen >= _OBJECTS_MIN and time.monotonic() > deadline):
                return False
            if isinstance(obj, type) and depth == 1:
                children: list[Any] = list(vars(obj).values())  # a class root: its attributes
            elif isinstance(obj, _NOT_FOLLOWED) or id(obj) in module_dicts or is_our_generator(obj):
                continue
            else:
                children = _referents(obj)
            for ref in children:
                rid = id(ref)
                if isinstance(ref, types.FrameType) and not isinstance(obj, types.TracebackType):
                    continue  # f_back and the like: only a frame a kept traceback holds is followed
                if rid in reach.objects or rid in own or (not gc.is_tracked(ref) and not _untracked_holder(ref)):
                    continue
                reach.objects[rid], reach.parent[rid], reach.depth[rid] = ref, id(obj), depth
                following.append(ref)
        level = following
    return True


def _referents(obj: Any) -> list[Any]:
    """What ``obj`` refers to; of a large container, only its newest items (never a copy of all)."""
    if type(obj).__name__ == "ndarray":
        return [obj.base]  # untracked, no referents for the gc: its base is what it keeps
    try:
        if isinstance(obj, (list, tuple, collections.deque)) and len(obj) > _NEWEST_ITEMS:
            return list(itertools.islice(reversed(obj), _NEWEST_ITEMS))
        if isinstance(obj, dict) and len(obj) > _NEWEST_ITEMS:
            return list(itertools.islice(reversed(obj.values()), _NEWEST_ITEMS))
        if isinstance(obj, (set, frozenset)) and len(obj) > _NEWEST_ITEMS:
            return []  # no order: no newest items
    except Exception:  # noqa: BLE001 - mutated while read, odd subclass: its referents, whole
        pass
    return gc.get_referents(obj)


def _untracked_holder(obj: Any) -> bool:
    """Untracked objects worth following all the same: tensors (the target may be one) and arrays."""
    return type(obj).__name__ in ("Tensor", "Parameter", "ndarray")
