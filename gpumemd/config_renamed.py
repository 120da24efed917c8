"""Options renamed so that one word means one thing: "phase" is the job's label (``gpumemd.phase``),
"history" is torch's CUDA allocation recording.

The old names still work (``attach()`` keyword, ``GPUMEMD_*`` variable, ``gpumemd run`` option), each
with one deprecation line naming the new one: job scripts and launch files outlive a release.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumemd.log_once import log_once

# old name -> name now
RENAMED: dict[str, str] = {
    "history_steps": "keep_steps",
    "phases": "step_profile",
    "phase_every_steps": "step_profile_every_steps",
}
_OLD = {new: old for old, new in RENAMED.items()}


def current_name(name: str) -> str:
    """An option's name now (``history_steps`` -> ``keep_steps``); other names unchanged."""
    return RENAMED.get(name, name)


def old_name(name: str) -> str:
    """The name option ``name`` had before it was renamed; ``name`` itself if it never was."""
    return _OLD.get(name, name)


def current_names(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``attach()`` keywords under the options' names now, and for each the name the caller used (errors
    name that one). One deprecation line per old name used; given both names, the name now wins."""
    values = {name: value for name, value in overrides.items() if name not in RENAMED}
    given = {name: name for name in values}
    for old, new in RENAMED.items():
        if old not in overrides:
            continue
        # once per process: `gpumemd run` and the framework callbacks validate before they attach
        log_once(f"attach({old})", "gpumemd: attach(%s=...) is deprecated; use attach(%s=...) (same meaning)",
                 old, new)
        if new not in values:
            values[new] = overrides[old]
            given[new] = old
    return values, given
