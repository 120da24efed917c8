"""Build the report: records in, one JSON-ready dict out (no I/O, no torch).

``report.json`` is this dict; ``report.md`` and ``report.html`` render it; ``gpumemd report`` reads
it back. ``SCHEMA_VERSION`` changes when a key changes meaning or disappears (adding keys does not).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumemd.analysis.breakdown import cpu_breakdown, cuda_breakdown, leak_at_oom, with_leak
from gpumemd.analysis.suggestions import suggest
from gpumemd.records.census import Census
from gpumemd.records.findings import Finding
from gpumemd.records.oom import Breakdown, ObserverCall, OomMessage, SnapshotSummary
from gpumemd.records.phases import PhaseBreakdown
from gpumemd.records.samples import AllocatorSample, HostSample, NvmlDeviceSample
from gpumemd.records.step import Identity, StepRecord

SCHEMA_VERSION = 1
REPORT_KIND = "gpumemd.oom_report"
TOP_TENSORS = 500  # largest storages, in report.json only: the people's reports show groups
TOP_GROUPS = 100  # in report.json; report.md/html and `gpumemd report` show the first view.GROUPS_SHOWN
TIMELINE_STEPS = 500
# PhaseBreakdown.figures() names -> what the report calls them (in figures() order).
PHASE_LABELS: dict[str, str] = {
    "forward_start": "forward start",
    "forward_peak": "forward peak",
    "after_backward": "after backward",
    "after_step": "after optimizer step",
    "optimizer_step_peak": "optimizer step peak",
    "saved_for_backward": "saved for backward (activations)",
    "parameters": "parameters + buffers",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "forward_transient": "forward rise above its start",
    "optimizer_step_transient": "optimizer step temporaries",
}


@dataclass(frozen=True)
class ReportInputs:
    """Everything known at the OOM, gathered by the OOM component."""

    created_at: float
    identity: Identity
    source: str  # "excepthook", "thread_excepthook", "oom_guard" or "request"
    exception_type: str
    exception_message: str
    traceback_text: str = ""
    message: OomMessage | None = None
    step: int | None = None
    phase: str = "train"
    observer: ObserverCall | None = None
    snapshot_summaries: Mapping[int, SnapshotSummary] = field(default_factory=dict)
    snapshot_source: str | None = None  # "oom_observer" or "report_time"
    snapshot_file: str | None = None  # "snapshot.pickle" when one is written
    expandable_segments: bool | None = None
    census: Census | None = None  # taken at the OOM
    census_note: str | None = None
    census_before: Census | None = None  # the last census before the OOM's (what grew since)
    steps: Sequence[StepRecord] = ()
    findings: Sequence[Finding] = ()
    host: HostSample | None = None
    allocator: Sequence[AllocatorSample] = ()
    nvml: Sequence[NvmlDeviceSample] = ()
    environment: Mapping[str, Any] = field(default_factory=dict)
    memory_summary: str | None = None
    phases: PhaseBreakdown | None = None  # the last sampled step's phases (attach(phases=True))


def oom_device(inputs: ReportInputs) -> int | None:
    """The failing CUDA device ordinal, or None for a host (CPU) failure."""
    msg = inputs.message
    if msg is not None and msg.kind == "cpu":
        return None
    if msg is not None and msg.device is not None:
        return msg.device
    if inputs.observer is not None:
        return inputs.observer.device
    if msg is not None and msg.kind in ("cuda", "device"):
        # The message did not say (a runtime or library allocation failure, an unknown wording): the
        # device is the one this process uses when it uses exactly one; otherwise it stays unknown,
        # never "GPU 0" by default.
        used = {a.device for a in inputs.allocator}
        return used.pop() if len(used) == 1 else None
    return None


def _device_breakdown(inputs: ReportInputs) -> Breakdown:
    device = oom_device(inputs)
    if device is None:
        return cpu_breakdown(message=inputs.message, host=inputs.host, census=inputs.census)
    allocator = next((a for a in inputs.allocator if a.device == device), None)
    nvml = next((n for n in inputs.nvml if n.device == device), None)
    return cuda_breakdown(
        device=device, message=inputs.message, observer=inputs.observer,
        snapshot=inputs.snapshot_summaries.get(device), allocator=allocator, census=inputs.census,
        nvml_total_bytes=nvml.total_bytes if nvml else None,
    )


def compute_breakdown(inputs: ReportInputs) -> Breakdown:
    """The failing device's breakdown, with the leak active at the OOM (if any) in it and, when the
    leak held more than the failing request, in its verdict."""
    breakdown = _device_breakdown(inputs)
    leak = leak_at_oom(findings=inputs.findings, census=inputs.census, census_before=inputs.census_before,
                       device=breakdown.device)
    return with_leak(breakdown, leak)


def _timeline_row(record: StepRecord, device: int | None) -> dict[str, Any]:
    sample = record.allocator_for(device) if device is not None else None
    return {
        "step": record.step,
        "steps": record.steps,  # steps this row stands for (the agent samples every Nth on fast steps)
        "wall_time": record.wall_time,
        "duration_s": record.duration_s,
        "phase": record.phase,
        "allocated_bytes": sample.allocated_bytes if sample else None,
        "allocated_peak_bytes": sample.allocated_peak_bytes if sample else None,
        "reserved_bytes": sample.reserved_bytes if sample else None,
        "rss_bytes": record.host.rss_bytes if record.host else None,
        "census_total_bytes": record.census_total_bytes,
    }


def _peak(timeline: list[dict[str, Any]], breakdown: Breakdown, on_cpu: bool) -> int | None:
    keys = ("rss_bytes",) if on_cpu else ("allocated_peak_bytes", "allocated_bytes")
    values = [row[k] for row in timeline for k in keys if isinstance(row.get(k), int)]
    if breakdown.allocated_bytes is not None:
        values.append(breakdown.allocated_bytes)
    return max(values) if values else None


def _tensors(census: Census | None, note: str | None) -> dict[str, Any] | None:
    if census is None:
        return {"available": False, "note": note or "no census was available"}
    groups = sorted(census.groups, key=lambda g: g.nbytes + g.graph_bytes, reverse=True)[:TOP_GROUPS]
    return {
        "available": True,
        "note": note,
        "step": census.step,
        "taken_at": census.taken_at,
        "duration_s": census.duration_s,
        "total_bytes": census.total_bytes,
        "tensor_count": census.tensor_count,
        "bytes_by_category": census.bytes_by_category(),
        "top": [dataclasses.asdict(e) for e in census.top(TOP_TENSORS)],
        "groups": [
            {**dataclasses.asdict(g.key), "count": g.count, "nbytes": g.nbytes,
             "graph_bytes": g.graph_bytes, "holder": g.holder}
            for g in groups
        ],
    }


def _phases(phases: PhaseBreakdown | None) -> dict[str, Any] | None:
    """The last phase breakdown; figures it could not measure (allocator phases on CPU) are left out."""
    if phases is None:
        return None
    return {
        "step": phases.step,
        "device": phases.device,
        "saved_tensors": phases.saved_tensors,
        "overhead_s": phases.overhead_s,
        "figures": [{"name": name, "label": PHASE_LABELS.get(name, name), "nbytes": nbytes}
                    for name, nbytes in phases.figures().items()],
    }


def build_report(inputs: ReportInputs) -> dict[str, Any]:
    """The report as a JSON-ready dict (finite floats, lists, str keys)."""
    breakdown = compute_breakdown(inputs)
    device = oom_device(inputs)
    suggestions = suggest(breakdown, findings=inputs.findings, phase=inputs.phase,
                          expandable_segments=inputs.expandable_segments)
    timeline = [_timeline_row(r, device) for r in list(inputs.steps)[-TIMELINE_STEPS:]]
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": REPORT_KIND,
        "created_at": inputs.created_at,
        "rank": inputs.identity.rank,
        "world_size": inputs.identity.world_size,
        "step": inputs.step,
        "phase": inputs.phase,
        "source": inputs.source,
        "exception": {"type": inputs.exception_type, "message": inputs.exception_message,
                      "traceback": inputs.traceback_text},
        "oom": dataclasses.asdict(inputs.message) if inputs.message else None,
        "observer": dataclasses.asdict(inputs.observer) if inputs.observer else None,
        "breakdown": dataclasses.asdict(breakdown),
        "peak_bytes": _peak(timeline, breakdown, device is None),
        "suggestions": [dataclasses.asdict(s) for s in suggestions],
        "tensors": _tensors(inputs.census, inputs.census_note),
        "phases": _phases(inputs.phases),  # optional (None without attach(phases=True)); added in schema 1
        "timeline": timeline,
        "findings": [dataclasses.asdict(f) for f in inputs.findings],
        "snapshot": {
            "file": inputs.snapshot_file,
            "source": inputs.snapshot_source,
            "devices": [dataclasses.asdict(s) for _, s in sorted(inputs.snapshot_summaries.items())],
        },
        "environment": dict(inputs.environment),
        "memory_summary": inputs.memory_summary,
    }
    return jsonable(report)


def jsonable(value: Any) -> Any:
    """Tuples -> lists, non-finite floats -> None, keys -> str: what strict JSON can hold."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
