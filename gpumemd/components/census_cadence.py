"""When the census component's next census is due.

A census holds the GIL for tens to hundreds of milliseconds, so it cannot run every step. The next
census is due ``N = ceil(cost / (share x seconds per step))`` steps after the last one, where ``cost``
is what the last census took, ``share`` is ``gpumemd.budget.census_share``: the budget's clocked plan
less the rest of the agent's clocked cost per step (as a share of the step), at least the census's own
share of the plan, and the seconds per step are the agent's typical step time (the median of recent
sampled steps: a pause between steps, such as an evaluation loop or a checkpoint, is not step time). So
N adapts as the heap (cost) or the step time changes, and the census costs ``share`` of the *step time*,
which is what the job notices. ``census_every_steps > 0`` forces N instead. The first census runs at the
first step end (it measures the cost). A failing census is retried after 2, 4, 8... steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd.budget import steps_between

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView

MAX_INTERVAL = 100_000
"""Never go longer than this many steps without a census."""


class CensusCadence:
    """The steps since the last census began (``steps_since``, which the component counts) and when the
    next is due; ``share(seconds per step)`` is the share of the step time a census may take."""

    def __init__(self, every: int, share: Callable[[float], float]) -> None:
        self.every = every  # > 0 forces the cadence
        self._share = share
        self.steps_since = 0
        self.next_look = 0  # steps since the last census at which due() looks again
        self.retry_after = 0  # steps to wait after a failed census (doubles each failure)
        self._last_cost: float | None = None

    @property
    def last_cost(self) -> float | None:
        """What the last census took, in seconds (None before one)."""
        return self._last_cost

    def interval(self, agent: AgentView | None) -> int:
        """Steps between censuses: forced, or what the budget allows at the current step time."""
        if self.every > 0:
            return self.every
        seconds_per_step = agent.seconds_per_step if agent is not None else None
        if self._last_cost is None or not seconds_per_step:
            return 1 if self._last_cost is None else MAX_INTERVAL
        return min(MAX_INTERVAL, steps_between(self._last_cost, self._share(seconds_per_step), seconds_per_step))

    def due(self, agent: AgentView | None) -> bool:
        if self.steps_since < self.retry_after:
            return False
        if self.every > 0:
            return self.steps_since >= self.every
        if self._last_cost is None or self.steps_since >= MAX_INTERVAL:
            return True  # the first census measures the cost
        if not (agent is not None and agent.seconds_per_step):
            self.next_look = self.steps_since + 1  # the step time is not known yet: look again next time
            return False
        interval = self.interval(agent)
        # Not due: look again halfway to the interval computed now (on the samples between, one
        # comparison); step time and cost change slowly, so a few looks per census are enough.
        self.next_look = self.steps_since + max(1, (interval - self.steps_since) // 2)
        return self.steps_since >= interval

    def began(self) -> None:
        """A census began: the next is due an interval from here."""
        self.steps_since = 0
        self.next_look = 0

    def back_off(self) -> int:
        """A census failed: the steps to wait before the next try (2, 4, 8...)."""
        self.retry_after = min(MAX_INTERVAL, max(2, self.retry_after * 2))
        return self.retry_after

    def finished(self, cost: float, *, failed: bool = False) -> None:
        """A census ended: its cost sets the interval (a failed one retries sooner)."""
        self._last_cost = cost
        self.next_look = 0
        if not failed:
            self.retry_after = 0


def other_share(agent: AgentView | None, seconds_per_step: float) -> float:
    """The rest of the agent's cost (training thread and sampler, censuses left out) per step, as a
    share of the job's step time."""
    if agent is None or seconds_per_step <= 0:
        return 0.0
    overhead = agent.overhead()
    if not overhead.steps:
        return 0.0
    other = overhead.seconds_total - overhead.census_seconds_total
    return max(0.0, other / overhead.steps / seconds_per_step)
