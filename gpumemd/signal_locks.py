"""Locks that a signal's writer waits for a bounded time, then goes on without.

At a signal, the agent writes what it knows (and, when the signal ends the job, stops) on a thread of
its own while the handler waits for it on the training thread (``signal_endings``). The training
thread is then stopped at whatever bytecode the signal came: inside a census slice, a publish, a state
file write, each under its lock. The writer would wait for that lock until the signal's deadline (25
s) and the job would end late and without its files ("writing what the agent knows took over 25 s":
CI, ``test_a_job_killed_while_leaking_fires_and_a_terminated_one_does_not`` and ``test_job_endings``).
Those locks are ``YieldingLock``s: the writer thread (``writing``) waits ``SIGNAL_WAIT_S`` at most,
then goes on without the lock. The thread that holds it is the one waiting for the writer, so nothing
changes the guarded state meanwhile; what it left half done (a census slice, a write to a temp file)
is dropped or replaced whole, and a sampler or scrape thread holding it lets go well within the wait.
Every other thread takes the lock as a plain one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

SIGNAL_WAIT_S = 2.0
"""How long a signal's writer waits for a lock before it goes on without it."""

_writer: int | None = None  # the ident of the thread writing at a signal, while it runs


@contextmanager
def writing() -> Iterator[None]:
    """The current thread is a signal's writer for the ``with`` block (``SignalEndings._bounded``)."""
    global _writer
    _writer = threading.get_ident()
    try:
        yield
    finally:
        _writer = None


def is_writer() -> bool:
    """Whether the current thread is a signal's writer."""
    return _writer is not None and threading.get_ident() == _writer


class YieldingLock:
    """A non-reentrant lock (``with`` only) that a signal's writer holds if it can get it within
    ``SIGNAL_WAIT_S``, and otherwise goes on without (see the module docstring)."""

    __slots__ = ("_lock", "_writer_without")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writer_without = False  # the writer went on without the lock (so must not release it)

    def __enter__(self) -> bool:
        if is_writer():
            held = self._lock.acquire(timeout=SIGNAL_WAIT_S)
            self._writer_without = not held
            return held
        return self._lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._writer_without and is_writer():
            self._writer_without = False
            return
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()
