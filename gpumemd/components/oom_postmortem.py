"""An OOM's post-mortem directory: what it is made of (the observer's capture or a snapshot taken now,
the census at the OOM and the one before it, the recent step records, the memory in the failing step,
the published state, the environment) and its writing (``report.build``, ``report.writer``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from gpumemd.analysis.snapshot_summary import expandable_segments_enabled, summarize_snapshot
from gpumemd.components.hook_printing import format_traceback, safe_str
from gpumemd.probes.holding.package_dirs import internal_dirs, library_dirs
from gpumemd.probes.process.environment import collect_environment
from gpumemd.records.device import cuda_index
from gpumemd.report.build import ReportInputs, build_report, oom_device
from gpumemd.report.writer import render_files, report_dir_name, write_report_dir

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.components.census_component import CensusComponent
    from gpumemd.components.oom_capture import Capture
    from gpumemd.probes.snapshots.snapshot import SnapshotProbe
    from gpumemd.records.census import Census
    from gpumemd.records.oom import OomMessage
    from gpumemd.records.step import StepRecord


class PostMortem:
    """Writes the OOM component's post-mortem directories: ``probe`` takes the allocator's snapshot and
    summary, ``census`` (the census component) the census at the OOM; ``wall_clock`` dates the report."""

    def __init__(self, probe: SnapshotProbe, census: CensusComponent, wall_clock: Callable[[], float]) -> None:
        self._probe = probe
        self._census = census
        self._wall = wall_clock

    def write(self, agent: AgentView, exc: BaseException | None, message: OomMessage | None, source: str,
              capture: Capture | None, *, taken: tuple[Census | None, str | None] | None = None) -> str:
        """Write the post-mortem directory of one OOM and return its path. ``capture`` is the observer's (None
        without one: on CUDA the snapshot is then taken now); ``taken`` is the census to show and its note
        (by default one taken now)."""
        state = agent.state()
        snapshot = capture.snapshot if capture else None
        snapshot_source = "oom_observer" if snapshot is not None else None
        on_cuda = message is not None and message.kind != "cpu"
        if snapshot is None and on_cuda:
            snapshot = self._probe.capture()  # no observer yet (OOM in the first step): the state now
            snapshot_source = "report_time" if snapshot is not None else None
        census_before = state.census  # the last census before the OOM's: what grew since
        census, note = taken if taken is not None else self._census_at_oom(agent)
        step = capture.step if source == "caught" and capture else 0 if state.step is None else state.step + 1
        inputs = ReportInputs(
            created_at=self._wall(),
            identity=state.identity,
            source=source,
            exception_type=type(exc).__name__ if exc is not None else "none",
            exception_message=safe_str(exc) if exc is not None else "report requested without an exception",
            traceback_text=format_traceback(exc),
            message=message,
            step=step,
            phase=agent.current_phase,
            observer=capture.call if capture else None,
            snapshot_summaries=summarize_snapshot(
                snapshot, internal=internal_dirs(), library=library_dirs()) if snapshot is not None else {},
            snapshot_source=snapshot_source,
            snapshot_file="snapshot.pickle" if snapshot is not None else None,
            expandable_segments=expandable_segments_enabled(snapshot) if snapshot is not None else None,
            census=census,
            census_note=note,
            census_before=census_before if census_before is not census else None,
            steps=agent.steps(),
            history=agent.history(),
            at_oom=_read_now(agent),
            findings=state.findings,
            host=state.host,
            workers=state.workers,
            allocator=state.allocator,
            nvml=state.nvml,
            step_profile=state.step_profile,
        )
        ordinal = cuda_index(oom_device(inputs))
        summary = capture.memory_summary if capture and capture.memory_summary else (
            self._probe.memory_summary(ordinal) if ordinal is not None else None)
        env = collect_environment(state.identity, device=ordinal)
        inputs = replace(inputs, environment=env, memory_summary=summary)
        report = build_report(inputs)
        files = render_files(report, snapshot)
        name = report_dir_name(state.identity.rank, step, inputs.created_at)
        return write_report_dir(agent.output_dir, name, files)

    def _census_at_oom(self, agent: AgentView) -> tuple[Census | None, str | None]:
        try:
            return self._census.take_outside_step(), None  # now, while the failing frames still hold their tensors
        except ImportError:
            return agent.state().census, "the census module is not available; showing the last census"
        except Exception as err:  # noqa: BLE001 - a census failure must not cost the report
            why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__  # MemoryError() says nothing
            return agent.state().census, f"census at the OOM failed ({why})"


def _read_now(agent: AgentView) -> StepRecord | None:
    """The memory at the OOM, in the failing step (the timeline's last row); None when unreadable."""
    try:
        return agent.read_now()
    except Exception:  # noqa: BLE001 - a probe failing at the OOM must not cost the report
        return None
