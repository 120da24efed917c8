"""The one error a subcommand raises to stop with a message: its own module, so that ``gpumemd.cli``
(which loads the subcommands) and the subcommands (which raise it) do not import each other."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing error: printed as one line (no traceback), exit code 2."""
