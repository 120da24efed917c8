"""Which DataLoader runs in which worker processes: the Dataset class, worker count and persistence.

Read at a finding only (one pass over the gc-tracked objects: milliseconds on a large heap), never
per step. Relies on the multiprocessing iterator's private attributes (``_workers``, ``_dataset``,
``_persistent_workers``), read with ``getattr`` defaults: a torch that renames them gives "unknown".
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True, slots=True)
class LoaderWorkers:
    """One live multi-process DataLoader iterator and the pids of its workers."""

    pids: tuple[int, ...]
    dataset: str  # "CachingDataset (train.data)"
    persistent: bool | None


def loaders_of(pids: Iterable[int]) -> list[LoaderWorkers]:
    """The live multi-process DataLoader iterators whose workers include any of ``pids``."""
    module = sys.modules.get("torch.utils.data.dataloader")
    cls = getattr(module, "_MultiProcessingDataLoaderIter", None)
    if cls is None:
        return []
    wanted = set(pids)
    out: list[LoaderWorkers] = []
    with contextlib.suppress(Exception):  # a diagnostic: unknown, never an error
        objects = gc.get_objects()
        iterators = [o for o in objects if issubclass(type(o), cls)]  # type(): no __class__ lookups
        objects.clear()
        for it in iterators:
            workers = tuple(p for w in getattr(it, "_workers", ()) if (p := getattr(w, "pid", None)) is not None)
            if not wanted & set(workers):
                continue
            dataset = type(getattr(it, "_dataset", None))
            name = f"{dataset.__qualname__} ({dataset.__module__})"
            out.append(LoaderWorkers(workers, name, getattr(it, "_persistent_workers", None)))
    return out
