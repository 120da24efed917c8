"""Append one whole JSON line to a file, or nothing: the findings file stays parseable on a full disk.

A plain ``f.write(line)`` that fails half-way (ENOSPC, EDQUOT) leaves a fragment, and the next record
is glued to it: a reader then loses both. Here the line goes out in one ``os.write`` on an
``O_APPEND`` descriptor; when that writes less than the whole line, or fails after writing part of it,
the file is cut back to its size before the write.

``replace_file`` writes a whole file the same way: all of it or none (temp file + ``os.replace``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def append_line(path: str, line: str) -> None:
    """Append ``line`` (a newline is added) whole, or raise ``OSError`` leaving the file as it was."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
        except OSError:
            _cut_back(fd, before)
            raise
        if written != len(data):
            _cut_back(fd, before)
            raise OSError(f"short write to {path} ({written} of {len(data)} bytes); the line was not added")
    finally:
        os.close(fd)


def _cut_back(fd: int, size: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(fd, size)


def replace_file(path: str, data: bytes, mode: int = 0o644, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` whole: a temp file in the same directory, then one ``os.replace``.

    A reader (or a crash, or a full disk) sees the previous file or the new one, never part of one.
    An existing ``path`` is replaced: callers that must not overwrite check first. ``fsync=False``: a
    file rewritten every second that only has to outlive the process (the page cache does), not the
    machine.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp makes it 0600
        os.replace(tmp, path)  # same directory: one filesystem, so atomic
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
