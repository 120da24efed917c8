"""One heavy piece of work per step end: a leak evaluation never lands on the step end where the
census component scanned the heap, and a census at every step never starves the detector."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch

from gpumemd.api import build_agent
from gpumemd.components.census_component import CensusComponent
from gpumemd.components.leak import LeakComponent
from gpumemd.components.leak_scans import IDLE_STRETCH
from gpumemd.config import Config
from gpumemd.probes.heap.stepwise import Stepwise
from gpumemd.records.census import Census


def _run(out_dir: str, census_every_steps: int, steps: int) -> tuple[list[tuple[int, int]], list[int]]:
    # The detector at its defaults (50 warm-up steps, an evaluation every 50); only the census cadence is
    # forced, so that periodic censuses fall on evaluation steps.
    config = Config(output_dir=out_dir, sample_interval_s=0, nvml=False, quiet=True,
                    census_every_steps=census_every_steps)
    agent = build_agent(config)
    leak = agent.component(LeakComponent)
    census = agent.component(CensusComponent)
    assert leak is not None and census is not None
    evaluated: list[tuple[int, int]] = []  # (step, the detector's cadence set there)
    censused: list[int] = []
    evaluate, begin = leak._evaluate, census._begin

    def counting_evaluate(parts: Any, step: int) -> None:
        evaluate(parts, step)
        evaluated.append((step, parts.series.detector.check_every))

    def counting_begin(step: int | None, *args: Any, **kwargs: Any) -> Any:
        censused.append(-1 if step is None else step)
        return begin(step, *args, **kwargs)

    def empty_census(request: Any, **kwargs: Any) -> Stepwise[Census]:
        # What is under test is when the census runs, not what it finds: a heap scan at every step
        # would cost the suite a minute.
        return Census(step=request.step, taken_at=time.time(), duration_s=0.0, groups=())
        yield  # a stepwise census of one slice

    leak._evaluate = counting_evaluate  # type: ignore[method-assign]
    census._begin = counting_begin  # type: ignore[method-assign]
    census._census_fn = empty_census
    model = torch.nn.Linear(8, 8)
    agent.register(model)
    agent.start()
    try:
        for step in range(steps):
            model(torch.randn(4, 8)).sum().backward()
            agent.mark_step(step)
    finally:
        agent.stop()
    return evaluated, censused


def _assert_on_cadence(evaluated: list[tuple[int, int]], steps: int) -> None:
    """On the detector's cadence from the first evaluation, a step or a sampling stride late: every
    leak_check_every_steps (50), or twice that while the evaluations find nothing on a loop this fast
    (``leak_scans.IDLE_STRETCH``)."""
    assert evaluated and evaluated[0][0] <= 60, evaluated
    assert all(every in (50, 50 * IDLE_STRETCH) for _, every in evaluated), evaluated
    assert all(every <= b - a <= every + 10 for (a, every), (b, _) in itertools.pairwise(evaluated)), evaluated
    assert steps - evaluated[-1][0] <= evaluated[-1][1] + 10, evaluated


@pytest.mark.parametrize("census_every_steps", [2, 3])
def test_an_evaluation_waits_for_the_step_after_a_census(out_dir: str, census_every_steps: int) -> None:
    evaluated, censused = _run(out_dir, census_every_steps, 400)
    assert not {step for step, _ in evaluated} & set(censused), (evaluated, censused)
    _assert_on_cadence(evaluated, 400)


def test_a_census_at_every_step_cannot_starve_the_detector(out_dir: str) -> None:
    evaluated, censused = _run(out_dir, 1, 300)
    assert len(censused) >= 290
    _assert_on_cadence(evaluated, 300)  # deferred once, then evaluated on the next step end anyway
