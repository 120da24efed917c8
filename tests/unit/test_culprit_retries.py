"""A finding whose culprit search found nothing is looked at again, each time twice as far on: a look is a
census and a heap scan, and one every half window cost a fast loop with a C extension's leak half its time."""

from __future__ import annotations

import time

from gpumemd.components.leak_findings import RETRY_DOUBLINGS, LeakFindings
from gpumemd.components.leak_options import LeakOptions
from gpumemd.config import Config


def _looks(findings: LeakFindings, steps: int, every: int = 50) -> list[int]:
    """The steps a culprit search runs at, from a state change's at step 0, checked every ``every`` steps
    as the leak component's evaluations do."""
    key = ("host_rss_bytes", "train")
    findings.attempts[key] = 0
    looked = []
    for step in range(every, steps, every):
        if findings.retry_culprits(key, step):
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
