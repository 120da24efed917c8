"""A finding whose culprit search found nothing is looked at again, each time twice as far on and once the job
has paid for the last search within its share of the budget: a look is a census and heap scans, and one every
half window cost a fast loop with a C extension's leak half its time."""

from __future__ import annotations

import math
import time

from gpumemd import budget
from gpumemd.components.leak_findings import RETRY_DOUBLINGS, LeakFindings
from gpumemd.components.leak_options import LeakOptions
from gpumemd.config import Config


def _looks(findings: LeakFindings, steps: int, every: int = 50, seconds_per_step: float | None = None) -> list[int]:
    """The steps a culprit search runs at, from a state change's at step 0, checked every ``every`` steps
    as the leak component's evaluations do."""
    key = ("host_rss_bytes", "train")
    findings.attempts[key] = 0
    looked = []
    for step in range(every, steps, every):
        if findings.retry_culprits(key, step, seconds_per_step):
            findings.attempts[key] = step
            looked.append(step)
    return looked


def test_each_fruitless_look_doubles_the_wait_for_the_next() -> None:
    options = Config(output_dir="unused").options(LeakOptions)
    half = options.leak_window_steps // 2
    looked = _looks(LeakFindings(options, census=None, wall_clock=time.time), 2_000_000)
    gaps = [b - a for a, b in zip([0, *looked], looked, strict=False)]
    assert gaps[:4] == [half, 2 * half, 4 * half, 8 * half]
    assert max(gaps) == half << RETRY_DOUBLINGS and gaps[-1] == half << RETRY_DOUBLINGS  # the cap
    assert len(looked) < 40  # over two million steps (half a window each: 8,000)


def test_a_costly_search_is_looked_at_again_once_the_job_has_paid_for_it() -> None:
    # A C extension's leak on a 2.6 ms/step job: its search (a census, four heap passes) took 0.2-0.4 s,
    # and the doubling schedule looked again 250, 500, 1,000 and 2,000 steps on (~10% of the job's time).
    options = Config(output_dir="unused").options(LeakOptions)
    findings = LeakFindings(options, census=None, wall_clock=time.time)
    findings._search_seconds[("host_rss_bytes", "train")] = 0.35
    paid = math.ceil(0.35 / (0.0026 * budget.share(options.overhead_budget, budget.Part.HOST_LOOKS)))
    looked = _looks(findings, 1_000_000, seconds_per_step=0.0026)
    gaps = [b - a for a, b in zip([0, *looked], looked, strict=False)]
    assert gaps and all(paid <= gap < paid + 50 for gap in gaps), (paid, gaps)
    # A cheap search on the same job keeps the doubling schedule.
    cheap = LeakFindings(options, census=None, wall_clock=time.time)
    cheap._search_seconds[("host_rss_bytes", "train")] = 1e-4
    assert _looks(cheap, 2_000, seconds_per_step=0.0026) == [250, 750, 1_750]
