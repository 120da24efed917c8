"""The excepthooks the OOM component chains in front of the job's (``sys.excepthook`` and
``threading.excepthook``): an uncaught OOM is reported, then the job's own hook (or python's) runs and
sees the exception unchanged; a failing job hook prints as python prints it (``hook_printing``)."""

from __future__ import annotations

import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

from gpumemd.components.hook_printing import print_hook_failure, print_thread_hook_failure

Report = Callable[[BaseException | None, str], bool]
"""Report an exception from an excepthook (its source: "excepthook", "thread_excepthook"); True when
it was an OOM and reported."""


class ExceptHooks:
    """``report`` is asked first; ``fatal`` is called after the job's ``sys.excepthook`` for an OOM
    that was reported (or marked ``handled_mark`` by ``oom_guard``): the process exits next. Both are
    held weakly (python's hooks must not keep a detached component alive)."""

    def __init__(self, report: Report, fatal: Callable[[], None], *, handled_mark: str) -> None:
        self._report = weakref.WeakMethod(report)  # a bound method
        self._fatal_ref = weakref.WeakMethod(fatal)
        self._mark = handled_mark
        self._prev_sys: Callable[..., Any] | None = None
        self._prev_thread: Callable[..., Any] | None = None
        self._sys_hook: Callable[..., Any] | None = None
        self._thread_hook: Callable[..., Any] | None = None

    def install(self) -> None:
        prev_sys, prev_thread = sys.excepthook, threading.excepthook
        report, fatal, mark = self._safe_report, self._call_fatal, self._mark

        def sys_hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            handled = report(exc, "excepthook")
            called_handling = sys.exc_info()[1] is exc  # a caller in an except block (gpumemd run), not python
            try:
                prev_sys(exc_type, exc, tb)  # the user's traceback printer (or debugger) sees it unchanged
            except SystemExit:
                raise  # python exits with the hook's code, as it would without gpumemd
            except BaseException as hook_error:  # noqa: BLE001 - shown as python shows it, not from here
                print_hook_failure(hook_error, exc_type, exc, tb, called_handling=called_handling)
            finally:
                if handled:
                    traceback.clear_frames(tb)
                if handled or getattr(exc, mark, False):  # oom_guard may have reported it
                    fatal()

        def thread_hook(args: Any) -> None:
            handled = report(args.exc_value, "thread_excepthook")
            try:
                prev_thread(args)
            except Exception as hook_error:  # noqa: BLE001 - shown as threading shows it, not from here
                print_thread_hook_failure(hook_error, sys._getframe(1), args)
            finally:
                if handled:
                    traceback.clear_frames(args.exc_traceback)  # the process lives on: give the memory back

        self._prev_sys, self._prev_thread = prev_sys, prev_thread
        self._sys_hook, self._thread_hook = sys_hook, thread_hook
        sys.excepthook = sys_hook
        threading.excepthook = thread_hook

    def _safe_report(self, exc: BaseException | None, source: str) -> bool:
        report = self._report()
        try:
            return bool(report is not None and report(exc, source))
        except Exception:  # noqa: BLE001 - the previous hook must run whatever happens here
            return False

    def _call_fatal(self) -> None:
        fatal = self._fatal_ref()
        if fatal is not None:
            fatal()

    def remove(self) -> None:
        """Restore the job's hooks, unless someone wrapped ours since: then ours stays in their chain as
        a pass-through (``report`` checks whether the component still runs)."""
        if self._sys_hook is not None and sys.excepthook is self._sys_hook and self._prev_sys:
            sys.excepthook = self._prev_sys
        if self._thread_hook is not None and threading.excepthook is self._thread_hook and self._prev_thread:
            threading.excepthook = self._prev_thread
        self._sys_hook = self._thread_hook = None
