"""How much the job's child processes grew since each was first seen (pure: no torch, no I/O).

Why growth since first seen rather than their total: DataLoader workers come and go. Without
``persistent_workers`` a new set starts every epoch (and an eval loader's for every eval), each from
the job's own pages; their total RSS jumps with every new set and falls with every exit, which is
no leak. A worker's growth since it started is: a new worker adds nothing until it grows, a gone
one takes its growth with it (so a restart brings the series back down, as a reset), and a worker
that keeps growing for as long as it lives (a cache in a persistent worker) is a ramp.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_PIDS = 256
"""Children remembered at most (a job that forks more is followed for the first ones)."""


class WorkerGrowth:
    """Feed each reading's (pid, RSS) pairs; ``update`` returns their growth since first seen."""

    def __init__(self) -> None:
        self._first: dict[int, int] = {}  # pid -> RSS when first seen
        self.pids: tuple[int, ...] = ()  # the children of the newest reading

    @property
    def seen(self) -> bool:
        return bool(self._first)

    def update(self, readings: Iterable[tuple[int, int]]) -> float:
        pairs = list(readings)
        pids = tuple(sorted(pid for pid, _ in pairs))
        if pids != self.pids:
            for gone in set(self._first) - set(pids):
                del self._first[gone]
            self.pids = pids
        total = 0
        for pid, rss in pairs:
            first = self._first.get(pid)
            if first is None:
                if len(self._first) >= MAX_PIDS:
                    continue
                first = self._first[pid] = rss
            total += rss - first
        return float(total)
