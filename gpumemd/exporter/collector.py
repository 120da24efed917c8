"""Metric families built from the agent's latest immutable state at scrape time.

No global Gauges: each scrape reads one ``AgentState`` (a single reference read, no lock the
training thread waits on) and builds fresh families from it. What a probe cannot measure is left
out (no series), never reported as 0. Counters start at 0 at attach: torch's allocator counters
(``num_alloc_retries``, ``num_ooms``...) count since CUDA initialised, so the values seen at attach
are subtracted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumemd._version import __version__
from gpumemd.exporter.metrics import BASE_LABELS, BY_NAME, HOST_DEVICE_LABEL, LEAK_STATE_VALUES
from gpumemd.records.device import Device, cuda_index
from gpumemd.records.samples import AllocatorSample
from gpumemd.records.step import AgentState

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from gpumemd.records.findings import Finding

log = logging.getLogger("gpumemd")

# AllocatorSample counter field -> counter metric name (reported as counted since attach: ``since_attach``).
_ALLOCATOR_COUNTERS: dict[str, str] = {
    "num_alloc_retries": "gpumemd_allocator_alloc_retries_total",
    "num_ooms": "gpumemd_allocator_ooms_total",
    "num_oom_rejections": "gpumemd_allocator_oom_rejections_total",
    "num_device_alloc": "gpumemd_allocator_device_allocs_total",
    "num_device_free": "gpumemd_allocator_device_frees_total",
}
_ALLOCATOR_GAUGES: dict[str, str] = {
    "allocated_bytes": "gpumemd_allocator_allocated_bytes",
    "reserved_bytes": "gpumemd_allocator_reserved_bytes",
    "active_bytes": "gpumemd_allocator_active_bytes",
    "inactive_split_bytes": "gpumemd_allocator_inactive_split_bytes",
    "requested_bytes": "gpumemd_allocator_requested_bytes",
    "allocated_peak_bytes": "gpumemd_allocator_peak_allocated_bytes",
    "reserved_peak_bytes": "gpumemd_allocator_peak_reserved_bytes",
    "segment_count": "gpumemd_allocator_segments",
    "cap_bytes": "gpumemd_allocator_cap_bytes",  # None (no series) without a per-process cap
}


class CounterBaseline:
    """torch's allocator counters at attach, per device; subtracted so counters start at 0.

    A device first touched after attach has a baseline of 0 (its counters start with CUDA). If the
    job calls ``torch.cuda.reset_accumulated_memory_stats`` the raw counter drops below the
    baseline: from then on the raw value is exported (Prometheus reads the drop as a reset).
    """

    def __init__(self, samples: Iterable[AllocatorSample] = ()) -> None:
        self._base: dict[tuple[Device, str], int] = {}
        for sample in samples:
            for field_name in _ALLOCATOR_COUNTERS:
                value = getattr(sample, field_name)
                if value:
                    self._base[(sample.device, field_name)] = value
        self._lock = threading.Lock()  # scrape threads only; the training thread never takes it

    def since_attach(self, device: Device, field_name: str, value: int) -> int:
        key = (device, field_name)
        with self._lock:
            base = self._base.get(key, 0)
            if value < base:
                self._base.pop(key, None)
                base = 0
        return value - base


class StepClock:
    """When the last training step ended, for ``gpumemd_last_step_timestamp_seconds``.

    The step path takes no clock on an unsampled step (a counter decrement, see ``gpumemd.agent``),
    so the state knows the wall time of the last *sampled* step and how many steps were counted
    since. That wall time is a lower bound on the last step's end, exact to within the steps since the
    last full sampled step end (the stride, at most ``MAX_STRIDE`` = 10 steps, 40 while a leak is only
    tracked, and above 1 only on fast steps; on loops fast enough for quick step ends, up to
    ``(QUICK_MAX + 1)`` strides: a second or two there). A scrape
    that sees the step count differ from the previous scrape's knows a step ended after that
    previous scrape, and moves the bound up to it: when steps turn slow under a wide stride, the
    figure still lags by at most one step and one scrape interval, never by ten slow steps.
    Scrape threads only: nothing here runs on the training thread.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: tuple[int, float] | None = None  # (steps_total, a time at or before the state was read)
        self._after: float | None = None  # a step ended after this time

    def now(self) -> float:
        """Read before the state: the observation is then "at this time, the count was at most N"."""
        return self._clock()

    def last_step_at(self, state: AgentState, read_at: float) -> float | None:
        """The bound for ``state``, read at or after ``read_at`` (from ``now()``)."""
        record = state.last_step
        with self._lock:
            seen = self._seen
            if seen is None or read_at >= seen[1]:  # a scrape that overtook a newer one says nothing new
                if seen is not None and seen[0] != state.steps_total:
                    self._after = seen[1]
                self._seen = (state.steps_total, read_at)
            after = self._after
        if record is None:
            return None
        return record.wall_time if after is None else max(record.wall_time, after)


@dataclass(frozen=True, slots=True)
class LiveFigures:
    """What a scrape reads from the running agent besides its published state: the typical step
    time (``Agent.seconds_per_step``) and the phase the job is in now (``Agent.current_phase``, which
    the state carries only as of its last publish)."""

    seconds_per_step: float | None = None
    phase: str | None = None


PHASE_LABEL_MAX = 64  # a phase name is the user's string: bounded in the label


class StateCollector:
    """A prometheus_client collector over ``state()``; register it in its own CollectorRegistry."""

    def __init__(self, state: Callable[[], AgentState], baseline: CounterBaseline | None = None, *,
                 live: Callable[[], LiveFigures] | None = None, step_clock: StepClock | None = None) -> None:
        self._state = state
        self._baseline = baseline or CounterBaseline()
        self._live = live
        self._step_clock = step_clock or StepClock()
        self._failed_logged = False

    def describe(self) -> list[Metric]:
        # An empty describe() stops the registry from calling collect() at registration time.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            read_at = self._step_clock.now()
            state = self._state()
            live = self._live() if self._live is not None else None
            families = build_families(state, self._baseline, live=live,
                                      last_step_at=self._step_clock.last_step_at(state, read_at))
        except Exception as exc:  # noqa: BLE001 - a bad scrape must not take the server (or job) down
            if not self._failed_logged:
                self._failed_logged = True
                log.warning("gpumemd: building metrics failed (%s: %s); this scrape is empty",
                            type(exc).__name__, exc)
            return iter(())
        return iter(families)


class _Families:
    """Families keyed by metric name, created on first sample so absent data gives no family."""

    def __init__(self, base: Mapping[str, str]) -> None:
        self._base = dict(base)
        self._families: dict[str, Any] = {}

    def add(self, name: str, value: float | None, **labels: str) -> None:
        if value is None:
            return
        family = self._families.get(name)
        spec = BY_NAME[name]
        if family is None:
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

            names = [*BASE_LABELS, *spec.labels]
            # created=None (the default) on a custom family means no _created series.
            family = (
                CounterMetricFamily(name, spec.help, labels=names)
                if spec.type == "counter"
                else GaugeMetricFamily(name, spec.help, labels=names)
            )
            self._families[name] = family
        values = [self._base[label] for label in BASE_LABELS] + [labels.get(label, "") for label in spec.labels]
        family.add_metric(values, float(value))

    def result(self) -> list[Metric]:
        return list(self._families.values())


def build_families(state: AgentState, baseline: CounterBaseline | None = None, *,
                   live: LiveFigures | None = None, last_step_at: float | None = None) -> list[Metric]:
    """Every family for one state. Pure apart from the baseline's reset bookkeeping.

    ``live`` adds what the agent knows beyond its state (typical step time, current phase);
    ``last_step_at`` is the ``StepClock``'s figure (default: the last sampled step's wall time)."""
    baseline = baseline or CounterBaseline()
    ident = state.identity
    out = _Families({"rank": str(ident.rank), "local_rank": str(ident.local_rank)})
    out.add(
        "gpumemd_info", 1, version=__version__, world_size=str(ident.world_size),
        hostname=ident.hostname, launcher=ident.source, run_id=state.run,
    )
    _allocator(out, state, baseline)
    _nvml(out, state)
    _host(out, state)
    _steps(out, state, live or LiveFigures(), last_step_at)
    _census(out, state)
    _step_profile(out, state)
    _findings(out, state.findings, live.seconds_per_step if live else None)
    _agent(out, state)
    return out.result()


def _allocator(out: _Families, state: AgentState, baseline: CounterBaseline) -> None:
    for sample in state.allocator:
        device = sample.device.label
        for field_name, name in _ALLOCATOR_GAUGES.items():
            out.add(name, getattr(sample, field_name), device=device)
        for field_name, name in _ALLOCATOR_COUNTERS.items():
            value = getattr(sample, field_name)
            if value is not None:
                out.add(name, baseline.since_attach(sample.device, field_name, value), device=device)
    if state.last_step is not None:
        for sample in state.last_step.allocator:
            out.add("gpumemd_step_end_allocated_bytes", sample.allocated_bytes, device=sample.device.label)


def _nvml(out: _Families, state: AgentState) -> None:
    for nv in state.nvml:
        device = nv.device.label
        out.add("gpumemd_device_total_bytes", nv.total_bytes, device=device)
        out.add("gpumemd_device_used_bytes", nv.used_bytes, device=device)
        out.add("gpumemd_device_free_bytes", nv.free_bytes, device=device)
        out.add("gpumemd_device_process_used_bytes", nv.process_used_bytes, device=device)


def _host(out: _Families, state: AgentState) -> None:
    host = state.host
    if host is None:
        return
    out.add("gpumemd_host_rss_bytes", host.rss_bytes)
    out.add("gpumemd_host_available_bytes", host.available_bytes)
    out.add("gpumemd_host_total_bytes", host.total_bytes)
    out.add("gpumemd_host_pinned_bytes", host.pinned_bytes)
    out.add("gpumemd_host_file_bytes", host.file_bytes)
    for limit in host.limits:
        out.add("gpumemd_host_limit_bytes", limit.limit_bytes, limit=limit.kind)
        out.add("gpumemd_host_limit_headroom_bytes", limit.headroom_bytes, limit=limit.kind)
    workers = state.workers
    if workers is not None:
        out.add("gpumemd_workers", len(workers.workers))
        out.add("gpumemd_workers_rss_bytes", workers.rss_bytes)
        out.add("gpumemd_workers_pss_bytes", workers.pss_bytes)
        out.add("gpumemd_workers_uss_bytes", workers.uss_bytes)


def _steps(out: _Families, state: AgentState, live: LiveFigures, last_step_at: float | None) -> None:
    out.add("gpumemd_step", state.step)
    out.add("gpumemd_steps_total", state.steps_total)
    record = state.last_step
    if record is not None:
        out.add("gpumemd_step_duration_seconds", record.duration_s)
        out.add("gpumemd_last_step_timestamp_seconds", record.wall_time if last_step_at is None else last_step_at)
    out.add("gpumemd_step_typical_duration_seconds", live.seconds_per_step)
    phase = (live.phase or state.phase)[:PHASE_LABEL_MAX]
    # A step has ended in this phase when the last record is of it: the first step of a phase is
    # always sampled (Agent.phase). An evaluation or checkpoint phase ends no steps.
    stepping = record is not None and record.phase[:PHASE_LABEL_MAX] == phase
    out.add("gpumemd_job_phase_info", 1, job_phase=phase, stepping="true" if stepping else "false")


def _census(out: _Families, state: AgentState) -> None:
    out.add("gpumemd_censuses_total", state.censuses_total)
    census = state.census
    if census is None:
        return
    for category, nbytes in census.bytes_by_category().items():
        out.add("gpumemd_census_bytes", nbytes, category=category)
    for category, count in census.count_by_category().items():
        out.add("gpumemd_census_tensors", count, category=category)
    out.add("gpumemd_census_duration_seconds", census.duration_s)
    out.add("gpumemd_census_step", census.step)  # the census series are as of this step and time
    out.add("gpumemd_census_timestamp_seconds", census.taken_at)
    # The label is N, as on every allocator series; in the order of torch's names, as always.
    for device, nbytes in sorted(census.invisible_bytes_by_device.items(), key=lambda dn: dn[0].name):
        out.add("gpumemd_census_invisible_bytes", nbytes, device=device.label)


def _step_profile(out: _Families, state: AgentState) -> None:
    profile = state.step_profile
    if profile is None:
        return
    out.add("gpumemd_step_profile_step", profile.step)
    # figures() leaves out what was not measured (the allocator's points on CPU): absent, never 0.
    for point, nbytes in profile.figures().items():
        out.add("gpumemd_step_profile_bytes", nbytes, point=point)


def _findings(out: _Families, findings: tuple[Finding, ...], seconds_per_step: float | None) -> None:
    # Several findings can share a kind and device (e.g. two series of one device): export the
    # most severe one, so each label set appears once and stays bounded.
    worst: dict[tuple[str, str], Finding] = {}
    for finding in findings:
        # The CUDA ordinal; findings off CUDA (the host's RSS, cpu tensors) share device="host": a real
        # value, which a dashboard's device variable and an alert's text can show.
        ordinal = cuda_index(finding.device)
        key = (finding.kind, HOST_DEVICE_LABEL if ordinal is None else str(ordinal))
        current = worst.get(key)
        if current is None or _rank(finding) > _rank(current):
            worst[key] = finding
    for (kind, device), finding in sorted(worst.items()):
        out.add("gpumemd_leak_state", LEAK_STATE_VALUES.get(finding.state, 0), kind=kind, device=device)
        out.add("gpumemd_leak_slope_bytes_per_step", finding.slope_bytes_per_step, kind=kind, device=device)
        out.add("gpumemd_leak_growth_bytes", finding.growth_bytes, kind=kind, device=device)
        out.add("gpumemd_leak_steps_to_oom", finding.steps_to_oom, kind=kind, device=device)
        # the finding's own figure (one time to OOM, as its line and the report say it), else its steps
        # at the typical step time
        seconds = finding.hours_to_oom * 3600 if finding.hours_to_oom is not None else (
            finding.steps_to_oom * seconds_per_step if finding.steps_to_oom is not None and seconds_per_step else None)
        if seconds is not None:
            out.add("gpumemd_leak_seconds_to_oom", seconds, kind=kind, device=device)
    _growth_slopes(out, findings)


def _growth_slopes(out: _Families, findings: tuple[Finding, ...]) -> None:
    """The two growths that have a figure of their own, with the leak series' labels (the fastest of each)."""
    for name, prefix in (("gpumemd_leak_workers_slope_bytes_per_step", "workers_rss_bytes"),
                         ("gpumemd_leak_growing_tensor_slope_bytes_per_step", "growing_tensor_bytes")):
        fastest: dict[tuple[str, str], float] = {}
        for finding in findings:
            if finding.state != "cleared" and finding.series.startswith(prefix):
                ordinal = cuda_index(finding.device)
                key = (finding.kind, HOST_DEVICE_LABEL if ordinal is None else str(ordinal))
                fastest[key] = max(fastest.get(key, 0.0), finding.slope_bytes_per_step)
        for (kind, device), slope in sorted(fastest.items()):
            out.add(name, slope, kind=kind, device=device)


def _rank(finding: Finding) -> tuple[int, float]:
    return (LEAK_STATE_VALUES.get(finding.state, 0), finding.slope_bytes_per_step)


def _agent(out: _Families, state: AgentState) -> None:
    out.add("gpumemd_ooms_total", state.ooms_total)
    out.add("gpumemd_oom_reports_total", len(state.reports))
    overhead = state.overhead
    out.add("gpumemd_agent_training_thread_seconds_total", overhead.training_thread_seconds_total)
    out.add("gpumemd_agent_census_seconds_total", overhead.census_seconds_total)
    out.add("gpumemd_agent_sampler_seconds_total", overhead.sampler_seconds_total)
    out.add("gpumemd_agent_overhead_ratio", overhead.ratio)
    out.add("gpumemd_agent_last_update_timestamp_seconds", state.updated_at)
    out.add("gpumemd_agent_start_timestamp_seconds", state.attached_at)
    if state.ended is not None:
        out.add("gpumemd_agent_exit_timestamp_seconds", state.ended_at, reason=state.ended, run_id=state.run)
    for probe, errors in sorted(state.probe_errors.items()):
        out.add("gpumemd_probe_errors_total", errors, probe=probe)
    for probe, available in sorted(state.probes_available.items()):
        out.add("gpumemd_probe_available", 1 if available else 0, probe=probe)
