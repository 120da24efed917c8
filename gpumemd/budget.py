"""One overhead budget, split between the parts of the agent that cost the job time.

``overhead_budget`` (1% by default) is one promise: what the job pays per step, wall-clock. Several
parts of the agent spend it, each spacing its own work by the job's typical step time: sampled step
ends (the stride), survivor scans and leak evaluations (the scan interval), heap looks for a host
leak's culprit and the retries of a culprit search that found nothing (the time between them) and
tensor censuses (the census interval). When each part
kept its own share and nothing added them up, the shares and the census's minimum came to more than
the budget: at 10-15 ms steps the agent clocked 0.94-1.24% of the step before the cost it cannot clock.
This table is the one place the budget is divided, and its shares add up to the whole:

- ``UNCLOCKED_SHARE`` of the budget is left for what the agent costs the job but cannot clock: the
  optimizer hook's call on every step and the cache misses its work leaves to the job's next steps.
  ``benchmarks/bench_step_overhead.py`` measures it ("not clocked", wall-clock minus the agent's own
  figure): 6-9 µs of 21-28 µs per step at 0.26-1.06 ms steps on a quiet box, a quarter to a third
  (8-17 µs of 28-40 µs with busy neighbours), and 0 within the error at 12 ms;
- the rest, the *clocked plan*, is split by ``SHARES``. Every part but the census keeps inside its
  share by spacing its work; the census takes what the others left (the plan less their measured
  cost), never less than its own share. So the clocked total stays inside the plan.

Where a part cannot keep inside its share it goes over, and the census's part shrinks towards its own
share to make room: detection needs its points (sampled step ends are at most ``agent.MAX_STRIDE``
steps apart, scans at most ``leak.SCAN_EVERY_MAX``), and a state change of a leak finding looks for
its culprit at once. On very short steps (under ~1 ms here) that is what sets the cost, which
``bench_step_overhead.py`` reports per step in microseconds.

Pure arithmetic: the parts measure their own costs and ask here what they may spend.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from types import MappingProxyType

UNCLOCKED_SHARE = 0.25
"""Part of ``overhead_budget`` left for what the agent costs the job but cannot clock."""

STEP_END_PAUSE_S = 0.2
"""The longest pause the agent's heavy work aims to put on one step end, however large the heap.

A heap pass (a census, a holder search, a heap look) costs ~0.1 s per million gc-tracked objects on a
quiet core. The average is the overhead budget's business; this bounds the single pause a job (and
its collectives, its data pipeline, its watchdog) feels: a census stops naming holders when it has
run this long, and a leak finding's culprit search runs one heap pass per step end once a step end
has paid this much (``components.leak_pending``)."""

HEAP_PASS_START_S = STEP_END_PAUSE_S / 4
"""A heap pass (~0.1-0.2 s at a million objects, and a holder search's first one cannot be cut short)
starts only while the step end has paid less than this, so that it ends within ``STEP_END_PAUSE_S``
or about; later, it waits for the next step end."""


class Part(enum.Enum):
    """A part of the agent that spends the overhead budget."""

    STEP_ENDS = "step_ends"  # sampled step ends: probes, the record, the components' per-step work
    LEAK_CHECKS = "leak_checks"  # survivor scans (count series) and leak detector evaluations
    HOST_LOOKS = "host_looks"  # heap scans for a culprit: host looks while host RSS rises, fruitless searches' retries
    CENSUS = "census"  # tensor censuses: what the other parts leave, at least its own share


SHARES: Mapping[Part, float] = MappingProxyType({
    Part.STEP_ENDS: 0.25,
    Part.LEAK_CHECKS: 0.25,
    Part.HOST_LOOKS: 0.15,
    Part.CENSUS: 0.35,
})
"""Each part's share of the clocked plan. Step ends and leak checks feed detection every step or
every few; host looks are occasional (a 0.1-0.3 s heap scan); the census is the costliest single
action and the one that names culprits, so it also gets whatever the others do not use."""

if not math.isclose(sum(SHARES.values()), 1.0):  # pragma: no cover - a table edit that breaks the promise
    raise AssertionError(f"budget.SHARES must add up to 1, not {sum(SHARES.values())}")


def clocked_plan(overhead_budget: float) -> float:
    """The share of the job's step time the agent's clocked work may take, all parts together."""
    return overhead_budget * (1.0 - UNCLOCKED_SHARE)


def share(overhead_budget: float, part: Part) -> float:
    """The share of the job's step time that ``part`` may take (for the census, its least)."""
    return clocked_plan(overhead_budget) * SHARES[part]


def census_share(overhead_budget: float, others: float) -> float:
    """The share of the job's step time the census may take, given what the other parts took
    (``others``, measured, as a share of the step time): the plan less that, at least its own share."""
    return max(share(overhead_budget, Part.CENSUS), clocked_plan(overhead_budget) - max(0.0, others))


def steps_between(cost_seconds: float, allowed_share: float, seconds_per_step: float) -> int:
    """Steps to wait between two runs of work costing ``cost_seconds`` so that it takes
    ``allowed_share`` of a job whose steps take ``seconds_per_step`` (at least 1)."""
    if allowed_share <= 0 or seconds_per_step <= 0:
        raise ValueError(f"budget.steps_between: allowed_share={allowed_share!r} and "
                         f"seconds_per_step={seconds_per_step!r} must be positive")
    return max(1, math.ceil(cost_seconds / (allowed_share * seconds_per_step)))
