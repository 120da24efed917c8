"""The cyclic collector held off while the agent walks the heap.

A census or a culprit search allocates thousands of short-lived tracked objects (lists, records,
sets of ids). Each allocation counts towards the collector's thresholds, so a walk can set off a
full collection of the job's heap in the middle of it: 0.4-0.5 s at a million objects, on top of the
walk (``benchmarks/bench_attribution.py --gc-objects 1000000`` measured a 597 ms census, 86 ms of it
the census). Those objects are freed by reference counting when the walk ends, so nothing is owed
to the collector afterwards: held off, the collection comes when the job's own allocations call for
it, as it would without the agent. A job that disabled the collector keeps it disabled.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass

_job_enabled: list[bool] = []  # the job's setting while a pause holds the collector off (nested: the outer)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection starts inside the block (the job's setting is restored after it)."""
    enabled = gc.isenabled()
    _job_enabled.append(_job_enabled[0] if _job_enabled else enabled)
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        _job_enabled.pop()
        if enabled:
            gc.enable()


def job_collector_enabled() -> bool:
    """Whether the job runs the cyclic collector (``gc.isenabled()``, as the job set it, in a pause too)."""
    return _job_enabled[0] if _job_enabled else gc.isenabled()


@dataclass(frozen=True)
class AutomaticHold:
    """Automatic collections held off (``hold_automatic``): the job's thresholds, and ours."""

    job: tuple[int, int, int]
    ours: tuple[int, int, int]


_holds: list[AutomaticHold] = []  # the one in force (at most one: a nested hold is a no-op)


def hold_automatic() -> AutomaticHold | None:
    """Hold off automatic collections until ``release_automatic``; None when they are off already."""
    job = gc.get_threshold()
    if job[0] == 0 or _holds:
        return None
    hold = AutomaticHold(job, (0, job[1], job[2]))
    gc.set_threshold(*hold.ours)
    _holds.append(hold)
    return hold


def release_automatic(hold: AutomaticHold | None) -> None:
    """Give the job its thresholds back, unless it set its own since (then it keeps them)."""
    if hold is None or hold not in _holds:
        return
    _holds.remove(hold)
    if gc.get_threshold() == hold.ours:
        gc.set_threshold(*hold.job)


def _restore_in_child() -> None:
    """A fork inside a pause or a hold: the child (a DataLoader worker) runs the job's settings."""
    if _job_enabled and _job_enabled[0]:
        gc.enable()
    _job_enabled.clear()
    for hold in _holds:
        if gc.get_threshold() == hold.ours:
            gc.set_threshold(*hold.job)
    _holds.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restore_in_child)
