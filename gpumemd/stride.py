"""How many steps apart the agent samples: every step while a sampled step end fits its share of
``overhead_budget`` (``gpumemd.budget``, ``Part.STEP_ENDS``) at the job's measured step time, on
faster steps every Nth (N <= ``MAX_STRIDE``); where even every ``MAX_STRIDE``th is over the share,
sampled step ends may be quick (``quick``: the reads now, the rest at the next full one).

Both figures are medians of the last few samples: a census or a scan (budgeted on their own) does not
count as the cost of a step end, and a pause between steps (an evaluation, a checkpoint) not as the
step time.
"""

from __future__ import annotations

import collections

from gpumemd import budget

MAX_STRIDE = 10
"""Steps per sample at most. The leak detector's dense series work on floors of 10-step blocks, so a
sample every 10 steps still gives every block a point. (At 20 the scenario suite still passed, but
the host-buffer leak at 128 KiB/step was suspected 600 steps after onset instead of 450, past the
500 the leak detector is held to: half the floors make the rank test slower to convince.)"""

SPARSE_STRETCH = 4
"""While a leak finding is only being tracked (``StridePlanner.sparse``, set by the leak component when
its scans stretch: ``components.leak_scans.TRACKING_STRETCH``), sampled step ends may be this many
times further apart than ``MAX_STRIDE`` when the budget asks. Tracking a leak can last for days, and
its step ends were most of what the agent cost then: a 1-tensor/step leak tracked on ~1.5 ms CPU steps
took 9.9-11.1 µs a step of the agent's own time at a stride of 10 and 5.5-5.8 µs at 40, and on ~0.44 ms
steps 8.4-8.6 against 4.9-5.1 (``benchmarks/bench_leak_tracking.py``, steps 3,000-6,000). What it costs:
a dense series (host RSS, the allocator) that starts to rise meanwhile has one floor per 40 steps until
an evaluation sees it rise, which ends tracking and brings the stride back; count series come from the
scans, which take full step ends of their own (``on_eve``) and are unaffected."""

_COST_WINDOW = 9  # sampled step ends whose median cost sets the stride
_REPLAN_EVERY = 4
"""Sampled step ends between two looks at the medians: a look is two sorts, ~10 µs after a step of
compute has taken the cache, and the medians of 9 move little from one sample to the next."""


class StridePlanner:
    """Keeps the recent costs of sampled step ends and the job's step times, and says the stride."""

    def __init__(self, overhead_budget: float, max_stride: int = MAX_STRIDE) -> None:
        self._allowed = budget.share(overhead_budget, budget.Part.STEP_ENDS)
        self._max_stride = max(1, max_stride)
        self._costs: collections.deque[float] = collections.deque(maxlen=_COST_WINDOW)
        self._durations: collections.deque[float] = collections.deque(maxlen=_COST_WINDOW)
        self.seconds_per_step: float | None = None
        """The job's typical step time: the median over recent sampled steps (None before two)."""
        self.stride = 1
        """Steps per sample now: 1 when every step is sampled."""
        self.quick = False
        """Sampled step ends may be quick (``StepEnds.end``): the budget would space full ones
        further than the longest stride, and the stride is the agent's own (no ``max_stride`` was set)."""
        self._own_stride = self._max_stride == MAX_STRIDE
        self._unplanned = 0  # samples taken in since the medians were last looked at
        self._sparse = False

    @property
    def sparse(self) -> bool:
        """Sampled step ends may be up to ``SPARSE_STRETCH`` x ``MAX_STRIDE`` steps apart (``SPARSE_STRETCH``)."""
        return self._sparse

    @sparse.setter
    def sparse(self, on: bool) -> None:
        if on != self._sparse:
            self._sparse = on
            self._unplanned = _REPLAN_EVERY  # the next sampled step end plans afresh

    def plan(self, cost: float, seconds_per_step: float | None) -> int:
        """Take in one sampled step end (what it cost, and the mean time of the steps it stands for)
        and return the stride from here on."""
        costs, durations = self._costs, self._durations
        costs.append(cost)
        if seconds_per_step:
            durations.append(seconds_per_step)
        self._unplanned += 1
        if self._unplanned < _REPLAN_EVERY and self.seconds_per_step is not None and len(costs) >= _COST_WINDOW:
            return self.stride
        self._unplanned = 0
        if durations:
            self.seconds_per_step = sorted(durations)[len(durations) // 2]
        stride = 1
        typical_step = self.seconds_per_step
        if typical_step and len(costs) >= 3:
            typical = sorted(costs)[len(costs) // 2]
            wanted = budget.steps_between(typical, self._allowed, typical_step)
            longest = MAX_STRIDE * SPARSE_STRETCH if self._sparse and self._own_stride else self._max_stride
            stride = min(longest, wanted)
            self.quick = self._own_stride and wanted > longest
        self.stride = stride
        return stride
