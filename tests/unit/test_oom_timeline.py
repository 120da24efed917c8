"""The OOM report's timeline spans the run from attach to the OOM: a thinned long history beside the
ring of recent steps, so a leak's onset far back sits on the plotted line, and the failing step is
always its last row, read at the OOM, whatever steps the stride skipped before it."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from fakes import ManualClock

from gpumemd.api import build_agent
from gpumemd.components.census_component import CensusComponent, CensusOptions
from gpumemd.components.oom_component import OomComponent, OomOptions
from gpumemd.config import Config
from gpumemd.probes.census.census_steps import census_steps
from gpumemd.probes.snapshots.snapshot import SnapshotProbe
from gpumemd.records.oom import OomMessage
from gpumemd.records.samples import HostSample
from gpumemd.records.step import Identity, StepRecord
from gpumemd.report.build import TIMELINE_STEPS, ReportInputs, build_report
from gpumemd.report.markdown import render_markdown
from gpumemd.report.view import chart_markers
from gpumemd.step_history import LONG_HISTORY_POINTS, StepHistory

MiB = 2**20


def _record(step: int, steps: int = 1, rss: int = 300 * MiB) -> StepRecord:
    return StepRecord(step=step, wall_time=1000.0 + step, duration_s=0.001, host=HostSample(rss_bytes=rss), steps=steps)


def test_the_long_history_stays_bounded_and_spans_the_run_evenly() -> None:
    history = StepHistory()
    for step in range(0, 200_000, 10):  # a sampled record every 10 steps
        history.add(_record(step, 10))
    kept = [r.step for r in history.records()]
    assert len(kept) < LONG_HISTORY_POINTS and len(kept) > LONG_HISTORY_POINTS // 2
    assert kept[0] == 0 and kept[-1] >= 200_000 - 2 * history.spacing  # from attach to (nearly) now
    gaps = [b - a for a, b in itertools.pairwise(kept)]
    assert max(gaps) <= 2 * min(gaps)  # even: no stretch of the run thinner than another by more than 2x


def test_the_timeline_reaches_an_onset_older_than_the_recent_steps_and_ends_at_the_oom() -> None:
    onset, last = 1_000, 12_000  # the ring's last TIMELINE_STEPS records start at step 7,000
    rss = {s: 300 * MiB + max(0, s - onset) * 64 * 1024 for s in range(0, last + 2)}
    recent = [_record(s, 10, rss[s]) for s in range(0, last, 10)]
    history = StepHistory()
    for r in recent:
        history.add(r)
    report = build_report(ReportInputs(
        created_at=1.0, identity=Identity(), source="excepthook", exception_type="RuntimeError",
        exception_message="DefaultCPUAllocator: can't allocate memory", step=last + 1,
        message=OomMessage(kind="cpu", format="cpu", requested_bytes=MiB), steps=recent, history=history.records(),
        at_oom=_record(last + 1, 2, rss[last + 1]),
        host=HostSample(rss_bytes=rss[last + 1], available_bytes=MiB, total_bytes=2**34)))
    timeline = report["timeline"]
    steps = [row["step"] for row in timeline]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == last + 1
    assert len(timeline) <= TIMELINE_STEPS + LONG_HISTORY_POINTS + 1
    assert steps[-TIMELINE_STEPS - 1:-1] == [r.step for r in recent[-TIMELINE_STEPS:]]  # the recent part in full
    assert any(abs(s - onset) <= 2 * history.spacing for s in steps[:-TIMELINE_STEPS])  # the line passes the onset
    assert [row["at_oom"] for row in timeline[-2:]] == [False, True]
    assert timeline[-1]["steps"] == last + 1 - recent[-1].step and timeline[-1]["rss_bytes"] == rss[last + 1]
    markdown = render_markdown(report)
    assert (f"one every 10 steps (on fast steps the agent reads memory every few steps, to keep within its "
            f"overhead budget); the last row is the memory at the OOM, in step {last + 1}:") in markdown
    assert f"| {last + 1} (at the OOM) | train | " in markdown
    assert chart_markers(report)[-1] == (last + 1, f"OOM (step {last + 1})", "oom")


class _Costly:
    """Each sampled step end costs 60 µs of the manual clock: on 1 ms steps the agent samples every 10th."""

    name = "costly"

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock

    def start(self, agent: Any) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        self.clock.now += 60e-6

    def on_eve(self) -> None:
        pass

    def stop(self) -> None:
        pass


def test_a_fast_jobs_report_ends_in_the_failing_step_and_begins_at_attach(out_dir: str) -> None:
    clock = ManualClock(100.0)
    config = Config(output_dir=out_dir, sample_interval_s=0, nvml=False)
    census = CensusComponent(config.options(CensusOptions), census_fn=census_steps)
    oom = OomComponent(config.options(OomOptions), snapshot_probe=SnapshotProbe(), census=census)
    agent = build_agent(config, components=[_Costly(clock), oom], clock=clock, wall_clock=clock)
    agent.start()
    try:
        for _ in range(7_005):  # past TIMELINE_STEPS records at one every 10 steps, ending between two samples
            clock.now += 1e-3
            agent.mark_step()
        assert agent.stride == 10 and agent.steps()[-1].step < 7_004  # the last step ends went unsampled
        path = oom.handle(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 "
                                       "bytes. Error code 12 (Cannot allocate memory)"), source="oom_guard")
    finally:
        agent.stop()
    assert isinstance(path, str)
    with open(os.path.join(path, "report.json")) as f:
        report = json.load(f)
    timeline = report["timeline"]
    assert report["step"] == 7_005 and timeline[-1]["step"] == 7_005 and timeline[-1]["at_oom"] is True
    assert timeline[0]["step"] == 0 and isinstance(timeline[-1]["rss_bytes"], int)
