"""Work that runs one heap pass at a time: a generator that yields between its passes.

A culprit search on a big heap is several passes (a census, a holder search, a look for the autograd
graph that keeps a tensor), each ~0.1 s per million gc-tracked objects. Written as a generator that
``yield``s after each pass, the same search runs whole where a pause does not matter (an OOM, a test:
``run_to_end``) or one pass per step end in a training loop (``components.leak_pending``), so no single
step end pays for all of them.

Across a ``yield`` the job runs a step: a tensor kept across it is held only weakly
(``hold_weakly``), so the search never keeps a step's activations alive into the next step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Generator
from typing import Any, TypeVar

T = TypeVar("T")

Stepwise = Generator[None, None, T]
"""A piece of work that yields between heap passes and returns its result."""

Hinted = Generator["str | None", None, T]
"""Stepwise work that says what comes next: it yields ``HEAP_PASS`` before a pass that scans the heap
(whoever runs it starts that early in a step end), None before a short one."""

HEAP_PASS = "heap pass"
"""Yielded before a pass that scans the whole heap and cannot be cut short once begun."""


def run_to_end(work: Generator[Any, None, T]) -> T:
    """Run ``work`` through all its passes now and return what it returns."""
    while True:
        try:
            next(work)
        except StopIteration as done:
            return done.value


def hold_weakly(obj: Any) -> Callable[[], Any]:
    """A call that gives ``obj`` back while something else keeps it alive, else None. An object that
    takes no weak references is held (for the one step the work waits)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj
