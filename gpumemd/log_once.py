"""Warnings said once per kind: a failure that repeats every step must not flood a week-long job's log."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("gpumemd")

_logged: set[str] = set()
_LOGGED_MAX = 1024


def log_once(key: str, message: str, *args: Any) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen."""
    if key in _logged:
        return
    if len(_logged) < _LOGGED_MAX:  # bounded: a week-long job must not grow this set forever
        _logged.add(key)
    log.warning(message, *args)
