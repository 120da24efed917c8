"""What the leak component and its parts read of the configuration."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LeakOptions:
    """What the leak component reads of the configuration (``Config.options(LeakOptions)``; the
    fields are ``Config``'s, documented there)."""

    leak_min_bytes_per_step: int | None
    leak_host_min_bytes_per_step: int | None
    leak_warmup_steps: int
    leak_window_steps: int
    leak_check_every_steps: int
    leak_horizon_hours: float
    leak_history_on_suspect: bool
    overhead_budget: float
    keep_steps: int
    record_history: bool
    history_max_entries: int
