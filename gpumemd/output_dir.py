"""Where the agent writes, settled when it starts: the configured directory when files can be written
there, else a temporary directory, and the start line says which and why.

An unwritable output directory (a typo, a read-only mount, ``/proc/...``) used to be learnt at the
worst moment: when the OOM report could not be written. ``gpumemd doctor`` reads the same check.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from dataclasses import dataclass

log = logging.getLogger("gpumemd")

FALLBACK_PREFIX = "gpumemd-out-"


def nearest_existing(path: str) -> str:
    """``path`` if it exists, else its nearest existing parent: where the directory would be created."""
    base = path
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    return base


def output_dir_problem(path: str) -> str | None:
    """Why files cannot be written in the directory ``path`` (a sentence naming it), or None.

    One temp file is created and removed in ``path`` or, when it does not exist yet, in its nearest
    existing parent, where it would be created; the directory itself is never created here."""
    target = os.path.abspath(path)
    base = nearest_existing(target)
    created = "" if base == target else f" cannot be created, {base}"
    if not os.path.isdir(base):
        return f"{target}{created} is not a directory"
    try:
        fd, tmp = tempfile.mkstemp(prefix=".gpumemd-check-", dir=base)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if created and exc.errno == errno.ENOENT:  # it exists, yet refuses an entry: /proc, /sys and their kind
            return f"{target}{created} takes no new files: {reason}"
        return f"{target}{created} is not writable: {reason}"
    os.close(fd)
    os.unlink(tmp)
    return None


@dataclass(frozen=True)
class SettledOutput:
    """The directory the agent writes to, and the configured one when it could not be used."""

    path: str
    wanted: str
    problem: str | None = None  # why ``wanted`` cannot be written (None: path == wanted, writable)

    def words(self) -> str:
        """The start line's "output ..." part: the path, and when it is not the configured one, why."""
        if self.problem is None:
            return self.path
        if self.path == self.wanted:
            return f"{self.path} (NOT WRITABLE: {self.problem}; no temporary directory could be made either)"
        return f"{self.path} (a temporary directory: {self.problem})"


def settle_output_dir(path: str) -> SettledOutput:
    """The configured directory when writable; else a new temporary one (``tempfile.mkdtemp``), whose
    name the start line gives. Never raises: a check that fails keeps the configured directory."""
    wanted = os.path.abspath(path)
    try:
        problem = output_dir_problem(wanted)
        if problem is None:
            return SettledOutput(wanted, wanted)
        try:
            fallback = tempfile.mkdtemp(prefix=FALLBACK_PREFIX)
        except OSError:
            return SettledOutput(wanted, wanted, problem)
        return SettledOutput(fallback, wanted, problem)
    except Exception as exc:  # noqa: BLE001 - attaching must not fail on a check
        log.debug("gpumemd: output directory check failed (%s: %s)", type(exc).__name__, exc)
        return SettledOutput(wanted, wanted)
