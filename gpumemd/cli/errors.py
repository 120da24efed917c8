"""The one error a subcommand raises to stop with a message: its own module, so that ``gpumemd.cli``
(which loads the subcommands) and the subcommands (which raise it) do not import each other."""

from __future__ import annotations


class CliError(Exception):
    """A user-facing error: printed as one line (no traceback) and turned into ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
