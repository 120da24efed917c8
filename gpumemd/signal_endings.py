"""Signals that end a job: write what the agent knows, then end exactly as the job would have.

Slurm (``scancel``, the time limit, ``--signal=USR1@60``), Kubernetes (pod deletion, preemption) and
most schedulers end a job with SIGTERM (or the signal ``--signal`` names); without a handler Python
dies of it at once, and the agent's exit summary, textfile, push and last state went with it.

What is installed, at ``Agent.start`` and from the main thread only (``signal.signal`` elsewhere
raises; a job that attaches from another thread keeps its signals as they are): for SIGTERM, SIGINT,
SIGUSR1 and SIGUSR2, a wrapper around the disposition in place, when that is

- the default action (``SIG_DFL``): on the signal, the agent stops as at a normal exit (exit summary,
  textfile, push, final state file, the exit marker a scrape or push carries), then the default is
  put back and the signal raised again: the process dies of the same signal, with the same status
  (-15, or 143 in a shell), as without gpumemd;
- a Python handler of the job's: the agent writes what it knows (textfile, push, state file; no exit
  summary, since the job may go on), then calls the job's handler, whose ending is the job's.

Left alone: ``SIG_IGN`` (the job ignores the signal: so do we), a handler not installed from Python
(``getsignal`` gives None: faulthandler, a C library), and SIGINT's ``default_int_handler``, which
raises KeyboardInterrupt: the job's own ``try/except KeyboardInterrupt`` must keep working and its
traceback must not grow a frame of ours; an uncaught one ends the process through ``atexit`` (or
``gpumemd run``'s detach), which already stops the agent.

Handlers installed after attach: the job (or Lightning, or torchelastic) may replace ours later.
Two cases, both handled at signal time or lazily:

- the newcomer chains to what it replaced (Lightning calls the previous handler): our wrapper is then
  called *not* as the installed handler (``getsignal`` is not it). Wrapping ``SIG_DFL`` it must not
  kill: the newcomer would not have called a default action; it flushes and returns;
- the newcomer does not chain: ``recheck``, called from sampled step ends on the main thread (every
  few seconds at most; one ``getsignal`` per signal), wraps it in turn, so its signal still flushes.

The flush runs on a short-lived thread the handler waits for, at most ``DEADLINE_S``: the handler
runs between two bytecodes of the main thread, which may hold a lock the flush needs (the state
board's writer lock, the OOM observer's); inline, that would hang the job forever instead of ending
it. Slurm's KillWait and Kubernetes' grace period are 30 s by default, above the deadline.

A DataLoader worker forked after attach inherits the wrappers; there the agent is not running, and
the wrapper behaves as the disposition it wraps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from gpumemd import signal_locks
from gpumemd.analysis.oom_message import classify_exception
from gpumemd.records.step import exit_ending

log = logging.getLogger("gpumemd")

SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
DEADLINE_S = 25.0
"""Longest a signal waits for the agent to write what it knows (a scrape included, see the exporter)."""

_AGAIN_S = 1.0  # one signal's flushes, however many of our wrappers it passes through

Handler = Callable[[int, FrameType | None], Any] | int | None


class _Wrapper:
    """The handler installed in place of ``inner`` (``SIG_DFL`` or the job's Python handler)."""

    def __init__(self, owner: SignalEndings, inner: Handler) -> None:
        self.owner = owner
        self.inner = inner

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        installed = signal.getsignal(signum) is self  # False: a later handler is chaining to us
        return self.owner.on_signal(signum, frame, self.inner, installed=installed)


class SignalEndings:
    """Installs and removes the wrappers; ``flush`` writes what the agent knows, ``finish(name)``
    stops the agent as ended by the signal ``name``; ``active()`` says whether the agent runs here."""

    def __init__(self, *, flush: Callable[[], None], finish: Callable[[str], None], active: Callable[[], bool],
                 deadline_s: float = DEADLINE_S) -> None:
        self._flush = flush
        self._finish = finish
        self._active = active
        self._deadline_s = deadline_s
        self._signums = [int(getattr(signal, name)) for name in SIGNALS if hasattr(signal, name)]
        self._wrappers: dict[int, _Wrapper] = {}
        self._busy = False
        self._flushed_at = -_AGAIN_S

    def install(self) -> None:
        """Wrap each signal's disposition (main thread only; elsewhere nothing is installed)."""
        if threading.current_thread() is not threading.main_thread():
            log.debug("gpumemd: attached outside the main thread; signals are left as they are")
            return
        for signum in self._signums:
            self._wrap(signum)

    def recheck(self) -> None:
        """Wrap a handler the job installed since (main thread only; cheap: one ``getsignal`` each)."""
        if not self._wrappers or threading.current_thread() is not threading.main_thread():
            return
        for signum, wrapper in list(self._wrappers.items()):
            if signal.getsignal(signum) is not wrapper:
                self._wrap(signum)

    def uninstall(self) -> None:
        """Put back what each wrapper wraps, where ours is still the installed handler."""
        wrappers, self._wrappers = self._wrappers, {}
        if threading.current_thread() is not threading.main_thread():
            return  # stopping from the flush thread: the process is about to end
        for signum, wrapper in wrappers.items():
            if signal.getsignal(signum) is wrapper:
                _set(signum, wrapper.inner)

    def _wrap(self, signum: int) -> None:
        current = signal.getsignal(signum)
        if isinstance(current, _Wrapper):
            if current.owner is self:
                self._wrappers[signum] = current
                return
            current = current.inner  # an earlier agent's, left behind: wrap what it wrapped
        if (current is None or current == signal.SIG_IGN
                or (signum == signal.SIGINT and current is signal.default_int_handler)):
            self._wrappers.pop(signum, None)
            return
        wrapper = _Wrapper(self, current)
        if _set(signum, wrapper):
            self._wrappers[signum] = wrapper

    def on_signal(self, signum: int, frame: FrameType | None, inner: Handler, *, installed: bool) -> Any:
        """One signal: write what the agent knows, then do what ``inner`` would have done."""
        name = signal.Signals(signum).name
        active = self._active() and not self._busy
        if inner == signal.SIG_DFL:
            if not installed:
                if active:  # a later handler chains to its predecessor: that was no action
                    _raise_if_any(self._bounded(self._flush_once))
                return None
            if active:
                # What another handler raised meanwhile is dropped: without us the process would have
                # died before that signal came (a DataLoader's SIGCHLD handler, when the same SIGTERM
                # reached its workers, raises "worker killed by signal" into the main thread).
                self._bounded(lambda: self._finish(name))
            die_by(signum)
            return None
        raised = self._bounded(self._flush_once) if active else None
        result = inner(signum, frame) if callable(inner) else None
        _raise_if_any(raised)  # after the job's handler, as it would have come without us
        return result

    def _flush_once(self) -> None:
        """The flush, unless one ran within ``_AGAIN_S``: a re-wrapped handler that chains to our first
        wrapper would otherwise write everything twice for one signal."""
        now = time.monotonic()
        if now - self._flushed_at < _AGAIN_S:
            return
        self._flushed_at = now
        self._flush()

    def _bounded(self, work: Callable[[], None]) -> BaseException | None:
        """Run ``work`` on its own thread and wait for it, ``deadline_s`` at most (see the docstring).
        What another signal's handler raises into the wait (KeyboardInterrupt, a DataLoader's worker
        error) does not cut it short: the first such exception is returned for the caller to raise
        where the job would have met it."""
        self._busy = True  # a second signal while we write goes straight to the job's ending

        # Waited for on events, not Thread.join: a join that an exception interrupts marks the thread
        # stopped while it still runs (CPython 3.11's _wait_for_tstate_lock), and is never waited for again.
        began, done = threading.Event(), threading.Event()

        def run() -> None:
            began.set()
            try:
                with signal_locks.writing():  # the locks the training thread may hold wait for it 2 s at most
                    work()
            except Exception:
                log.debug("gpumemd: writing at a signal failed", exc_info=True)
            finally:
                done.set()

        thread = threading.Thread(target=run, name="gpumemd-signal-flush", daemon=True)
        raised: BaseException | None = None
        deadline = time.monotonic() + self._deadline_s
        starting = True
        try:
            while True:
                try:
                    if starting:
                        starting = False
                        thread.start()
                    done.wait(max(0.0, deadline - time.monotonic()))
                    break
                except BaseException as exc:  # noqa: BLE001 - another handler's, raised between our bytecodes
                    raised = raised or exc
                    if time.monotonic() >= deadline or not began.wait(1.0):
                        break  # out of time, or cut off before the thread could start: nothing to wait for
            if not done.is_set():
                log.warning("gpumemd: writing what the agent knows took over %.0f s; the job ends without it",
                            self._deadline_s)
        finally:
            self._busy = False
        return raised


def ending_at_exit() -> str:
    """How the process is ending, asked from ``atexit``: python keeps the uncaught exception it has just
    printed (``sys.last_exc``; ``sys.last_value`` before 3.12). None kept is an exit whose status python
    does not tell an ``atexit`` handler ("exit"; ``gpumemd run`` knows it and records "exit:N"). An
    interactive session keeps its earlier errors there too: it ends as "exit"."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return "exit"
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return uncaught_ending(exc) if isinstance(exc, BaseException) else "exit"


def uncaught_ending(exc: BaseException) -> str:
    """``AgentState.ended`` for an exception the job did not catch (``records.step.ending_words``)."""
    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT"
    if isinstance(exc, SystemExit):
        return exit_ending(exc.code if isinstance(exc.code, int) else int(exc.code is not None))
    if classify_exception(exc) is not None:
        return "oom"
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"exception:{name[:120]}"


def _raise_if_any(exc: BaseException | None) -> None:
    if exc is not None:
        raise exc


def _set(signum: int, handler: Handler) -> bool:
    try:
        signal.signal(signum, handler)
    except (ValueError, OSError, TypeError) as exc:  # not the main thread, or an uncatchable signal
        log.debug("gpumemd: could not install a handler for signal %d (%s)", signum, exc)
        return False
    return True


def die_by(signum: int) -> None:
    """End the process of ``signum`` under its default action, as it would have without a handler."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
