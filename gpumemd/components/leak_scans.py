"""When the leak component scans for survivors: every ``SCAN_EVERY`` to ``SCAN_EVERY_MAX`` steps, spaced so
scans and evaluations together keep to their share of the overhead budget (``budget.Part.LEAK_CHECKS``),
and at every evaluation, so a culprit search samples the tensors and graph roots of that very step (an
EMA's root is new each step), except while scans find nothing (``IDLE_STRETCH``)."""

from __future__ import annotations

from gpumemd import budget

SCAN_EVERY = 10
"""Steps between survivor scans (and count-series observations) at least."""

SCAN_EVERY_MAX = 50
"""Steps between survivor scans at most, whatever the budget says: a 500-step window then still has
10 points of every count series, so the budget never starves detection."""

TRACKING_STRETCH = 16
"""While the only findings are confirmed ones and nothing else rises (``tracking``: the component
decides), scans and evaluations may be this many times further apart than ``SCAN_EVERY_MAX`` and
``check_every_steps`` when the budget asks: a leak that lasts for days is then tracked inside its share.
A 1-tensor/step leak on ~1.8 ms steps (``benchmarks/bench_leak_tracking.py --child on --mlp``, steps
3,000-8,000): the leak checks 7.0-7.2 µs a step at a stretch of 4, 5.0-5.1 at 8, 2.5-2.6 at 16, where
the budget spaced them 600-800 steps (a scan costs ~1 ms there, most of it per leaked tensor). What it
costs: a second leak that starts meanwhile is counted at the first scan its tensors outlive whole, one
to two intervals after its onset; its new series ends tracking, so it is judged at the usual interval
from there (confirmed 1,752 steps after its onset on a fast loop, against ~450 without tracking and 602
at a stretch of 4: tests/integration/test_leak_tracking.py). In time, an interval is a scan's cost over
the scans' share of the budget, whatever the step: ~1 ms over ~0.09% (at 1%), about a second here.
A confirmed track's re-tests keep their min_points floors (its window lengthens to cover them) and
come every ``CONFIRMED_EVERY`` checks, however far apart tracking spaces the checks."""


IDLE_STRETCH = 2
"""While scans find nothing (``idle``: the last scan counted no new long-lived tensor, no graph chain is
followed and no tensor family set a record, and the last evaluation found nothing rising and no active
finding: the component decides) and the budget asks for scans further apart than the longest interval,
scans and evaluations may be this many times further apart (``check_every``), at the same step ends.
That is a healthy fast loop's state nearly all of its life, and its leak checks were the largest part
of what the agent cost it: a scan ~200 µs after a step of compute at 0.45 ms steps, an evaluation ~100
µs, each with a full step end around it (``benchmarks/bench_step_overhead.py``: idle scans took ~4 of
~26 µs a step off; evaluations joining them, with a cheaper eve, +21.7-27.4 -> +18.3-23.7 µs in three
pairs on a loaded box). What it costs: a count, chain or family series that starts to grow is first
seen up to ``IDLE_STRETCH`` intervals after its onset rather than one, and a dense series (host RSS,
the allocator, the workers) first judged up to one check later; the evaluation that sees anything rise
ends the idle spacing, and onsets are dated from the points, not the checks (a chain's from its first
link: ``probes.survival.graph_chains``)."""

KEYED_WHILE_TRACKING = 32
"""While tracking (``TRACKING_STRETCH``), the candidates whose group keys a scan reads at most
(``SurvivorTracker.scan``): past that, a stratified random sample of those alive, each standing for its
stratum. A 1-tensor/step leak puts ~800 tensors through an 800-step scan, and reading each one's key
was most of the scan's cost (``benchmarks/bench_leak_tracking.py``'s "scans" column). The survival of
every candidate is still known, so a leak's own group is counted exactly; another group's new
members are estimated, right on average, until tracking ends (anything else that rises ends it) and
every candidate is keyed again."""


class ScanSchedule:
    """Counts in the agent's ``steps_total`` (every step, sampled or not). ``seconds`` is what the scans
    took so far (benchmarks read it)."""

    def __init__(self, *, window_steps: int, overhead_budget: float) -> None:
        self._longest = max(1, min(SCAN_EVERY_MAX, window_steps // 10))  # 10 points per window
        self.tracking = False  # the component says so at each evaluation (TRACKING_STRETCH)
        self.idle = False  # ... and this (IDLE_STRETCH)
        self._stretched = False  # the budget asked for scans further apart than the longest interval
        self._allowed = budget.share(overhead_budget, budget.Part.LEAK_CHECKS)
        self.interval = SCAN_EVERY  # steps between scans now
        self.next_total = SCAN_EVERY  # steps_total at which the next scan runs
        self._last_total = 0  # steps_total at the last scan
        self._cost: float | None = None  # moving average of a scan's seconds
        self.seconds = 0.0

    def due(self, total: int) -> bool:
        return total >= self.next_total

    def scanned(self, total: int, seconds: float, *, seconds_per_step: float | None,
                evaluations_share: float) -> None:
        """A scan at ``total`` took ``seconds``: space the next one. Evaluations run on their own cadence
        (``leak_check_every_steps``) and took ``evaluations_share`` of the job's time so far; the scans get
        the share less that, at least half of it."""
        self._last_total = total
        self.seconds += seconds
        cost = self._cost = seconds if self._cost is None else 0.8 * self._cost + 0.2 * seconds
        interval = SCAN_EVERY
        if seconds_per_step:  # the typical step: pauses between steps do not count
            allowed = max(self._allowed / 2, self._allowed - evaluations_share)
            interval = budget.steps_between(cost, allowed, seconds_per_step)
        longest = self._longest * (TRACKING_STRETCH if self.tracking else 1)
        self._stretched = interval > longest
        self.interval = max(min(SCAN_EVERY, self._longest), min(longest, interval))

    def check_every(self, every: int) -> int:
        """Steps between leak evaluations now, ``every`` (``leak_check_every_steps``) at the usual cadence:
        while tracking, at least a scan interval (``TRACKING_STRETCH``); while idle on a budget that asks,
        ``IDLE_STRETCH`` times ``every``, the evaluations riding with the idle scans."""
        if self.tracking:
            return max(every, self.interval)
        return every * IDLE_STRETCH if self.idle and self._stretched else every

    def plan(self, total: int, steps_to_evaluation: int | None) -> None:
        """After a step end at ``total``: the next scan ``interval`` steps after the last, or at the next
        evaluation (``steps_to_evaluation`` from now; None while one's searches go on) if sooner; while
        ``idle`` on a budget that asks for it, ``IDLE_STRETCH`` intervals after the last, where the
        evaluations are then too (``check_every``)."""
        if self.idle and self._stretched and steps_to_evaluation is not None:
            self.next_total = self._last_total + IDLE_STRETCH * self.interval
            return
        evaluation_at = total + (max(1, steps_to_evaluation) if steps_to_evaluation is not None else self.interval)
        self.next_total = min(self._last_total + self.interval, evaluation_at)
