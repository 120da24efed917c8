"""How a job's exception reads: in a report, and what python prints when an excepthook fails, for the job's
hook that gpumemd's excepthooks wrap.

Re-raising from the wrapper would put its own frame in the hook's traceback; these print what python
(``sys.excepthook``) or ``threading`` (``threading.excepthook``) would print without gpumemd.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from types import FrameType, TracebackType
from typing import Any

_TRACEBACK_CHARS = 20_000  # of an OOM report's traceback: the last ones, where it failed


def print_hook_failure(error: BaseException, exc_type: type[BaseException], exc: BaseException,
                        tb: TracebackType | None, *, called_handling: bool) -> None:
    """What python prints when ``sys.excepthook`` raises (``_PyErr_PrintEx``), for the job's hook that
    ours wraps: re-raising would add our wrapper's frame to the hook's traceback. Each exception is
    shown by ``sys.__excepthook__``, which is python's own display (``PyErr_Display``)."""
    try:
        hook_tb = error.__traceback__
        hook_tb = hook_tb.tb_next if hook_tb is not None else None  # from the job's hook on: not sys_hook
        if called_handling and error.__context__ is exc:
            error.__context__ = None  # python calls the hook outside any except block
        _write_stderr("Error in sys.excepthook:\n")
        sys.__excepthook__(type(error), error.with_traceback(hook_tb), hook_tb)
        _write_stderr("\nOriginal exception was:\n")
        sys.__excepthook__(exc_type, exc, tb)
    except Exception:  # noqa: BLE001 - python ignores a failure to print here too
        pass


def print_thread_hook_failure(error: Exception, caller: FrameType, args: Any) -> None:
    """What ``threading`` prints when ``threading.excepthook`` raises (``_make_invoke_excepthook``), for
    the job's hook that ours wraps: "Exception in threading.excepthook:", then ``sys.excepthook`` with
    the hook's exception, its traceback starting in the caller's frame as it would without gpumemd
    (re-raising would put this wrapper's frame in it)."""
    try:
        error.__suppress_context__ = True
        tb = error.__traceback__
        hook_tb = tb.tb_next if tb is not None else None  # from the job's hook on: not thread_hook
        shown = TracebackType(hook_tb, caller, caller.f_lasti, caller.f_lineno)
        stderr = sys.stderr if sys.stderr is not None else getattr(args.thread, "_stderr", None)
        print("Exception in threading.excepthook:", file=stderr, flush=True)
        hook = sys.excepthook if sys.excepthook is not None else sys.__excepthook__  # None at shutdown
        hook(type(error), error.with_traceback(shown), shown)
    except Exception:  # noqa: BLE001 - threading ignores a failure to print here too
        pass


def _write_stderr(text: str) -> None:
    """``PySys_WriteStderr``: to ``sys.stderr``, else to the process's stderr."""
    try:
        sys.stderr.write(text)
    except Exception:  # noqa: BLE001 - no sys.stderr (None) or a broken one
        with contextlib.suppress(OSError):
            os.write(2, text.encode("utf-8", "backslashreplace"))


def format_traceback(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= _TRACEBACK_CHARS else "...\n" + text[-_TRACEBACK_CHARS:]


def safe_str(exc: BaseException) -> str:
    """The exception's message as Python's traceback shows it: an exception whose ``__str__`` raises
    still gets its report (the message reads as the traceback's placeholder)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - the job's own exception class, whatever it does
        return "<exception str() failed>"

