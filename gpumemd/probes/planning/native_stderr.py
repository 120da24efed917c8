"""Keep a native library's log lines out of the job's stderr for the span of one call.

Kineto (torch's profiler backend) writes ``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start``
straight to file descriptor 2 at every profiler start and stop, whatever ``KINETO_LOG_LEVEL`` says;
``find_batch_size`` on CPU starts the profiler once per try, which printed a dozen such lines. Python's
``sys.stderr`` cannot catch a C++ ``fprintf``, so the descriptor itself is pointed at a temporary
file for the span of the profiler's start (or stop) alone, and every line that is not Kineto's is
written back: another thread's output in that span is delayed by microseconds, never lost.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Kineto's log prefix: LEVEL:YYYY-MM-DD HH:MM:SS PID:TID File.cpp:LINE]
KINETO_LINE = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")


def is_kineto_line(line: bytes) -> bool:
    return KINETO_LINE.match(line) is not None


@contextmanager
def native_stderr_filtered(drop: Callable[[bytes], bool] = is_kineto_line) -> Iterator[None]:
    """Inside the block, lines written to fd 2 for which ``drop`` is true vanish; the rest are
    written back when it ends. Where fd 2 cannot be redirected (closed, not a descriptor), the
    block runs with stderr as it is."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as spool:
        try:
            os.dup2(spool.fileno(), 2)
        except OSError:
            os.close(saved)
            yield
            return
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()  # Python-level writes in the block belong to the spool as well
            os.dup2(saved, 2)
            os.close(saved)
            spool.seek(0)
            kept = b"".join(line for line in spool if not drop(line))
            if kept:
                os.write(2, kept)
