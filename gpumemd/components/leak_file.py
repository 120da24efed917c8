"""The findings file: ``leak-findings-rank<N>.jsonl`` in the output directory, one JSON line per state
change of a finding, each carrying the run it belongs to (a directory may hold several runs', and
``gpumemd report`` reads only the latest's). Appended, never rewritten: a line written is never lost."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd.files import append_line
from gpumemd.records.plain import jsonable, plain

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.records.findings import Finding

log = logging.getLogger("gpumemd")


class FindingsFile:
    def __init__(self, agent: AgentView, wall_clock: Callable[[], float]) -> None:
        self._agent = agent
        self._wall = wall_clock
        self._failed = False  # the last append failed (said once until one succeeds again)

    @property
    def path(self) -> str:
        """Named from the rank known when it is written: jobs often call ``init_process_group`` after attach."""
        rank = self._agent.state().identity.rank
        return os.path.join(self._agent.output_dir, f"leak-findings-rank{rank}.jsonl")

    def append(self, finding: Finding) -> None:
        path = self.path
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            line = {"time": self._wall(), "run": self._agent.state().run, **jsonable(plain(finding))}
            append_line(path, json.dumps(line, sort_keys=True))
            self._failed = False
        except OSError as exc:
            if not self._failed:
                log.warning("gpumemd: could not append to %s (%s); findings stay in the agent state", path, exc)
            self._failed = True
