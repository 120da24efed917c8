"""Append one whole JSON line to a file, or nothing: the findings file stays parseable on a full disk.

A plain ``f.write(line)`` that fails half-way (ENOSPC, EDQUOT) leaves a fragment, and the next record
is glued to it: a reader then loses both. Here the line goes out in one ``os.write`` on an
``O_APPEND`` descriptor; when that writes less than the whole line, or fails after writing part of it,
the file is cut back to its size before the write.
"""

from __future__ import annotations

import contextlib
import os


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
