"""Build the report: records in, one JSON-ready dict out (no I/O, no torch).

``report.json`` is this dict; ``report.md`` and ``report.html`` render it; ``gpumemd report`` reads
it back. ``SCHEMA_VERSION`` changes when a key changes meaning or disappears (adding keys does not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumemd.analysis.breakdown import cpu_breakdown, cuda_breakdown, fmt
from gpumemd.analysis.headroom import reservable_bytes
from gpumemd.analysis.oom_leak import leak_at_oom, with_leak, without_projection
from gpumemd.analysis.suggestions import suggest, why_none
from gpumemd.records.census import Census, GroupKey, TensorEntry
from gpumemd.records.device import Device
from gpumemd.records.findings import Finding
from gpumemd.records.oom import Breakdown, ObserverCall, OomMessage, SnapshotSummary
from gpumemd.records.plain import jsonable, plain
from gpumemd.records.samples import AllocatorSample, HostSample, NvmlDeviceSample, WorkersSample
from gpumemd.records.step import Identity, StepRecord
from gpumemd.records.step_profile import StepProfile

SCHEMA_VERSION = 1
REPORT_KIND = "gpumemd.oom_report"
TOP_TENSORS = 500  # largest storages, in report.json only: the people's reports show groups
TOP_GROUPS = 100  # in report.json; report.md/html and `gpumemd report` show the first view.GROUPS_SHOWN
TIMELINE_STEPS = 500
# StepProfile.figures() names -> what the report calls them (in figures() order).
STEP_PROFILE_LABELS: dict[str, str] = {
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
    source: str  # "excepthook", "thread_excepthook", "oom_guard", "caught" or "request"
    exception_type: str
    exception_message: str
    traceback_text: str = ""
    message: OomMessage | None = None
    step: int | None = None
    phase: str = "train"
    observer: ObserverCall | None = None
    snapshot_summaries: Mapping[Device, SnapshotSummary] = field(default_factory=dict)
    snapshot_source: str | None = None  # "oom_observer" or "report_time"
    snapshot_file: str | None = None  # "snapshot.pickle" when one is written
    expandable_segments: bool | None = None
    census: Census | None = None  # taken at the OOM, unless ``census_note`` says why not
    census_note: str | None = None  # why ``census`` is an earlier one (the census at the OOM failed)
    census_before: Census | None = None  # the last census before the OOM's (what grew since)
    steps: Sequence[StepRecord] = ()  # the recent ring, in full
    history: Sequence[StepRecord] = ()  # since attach, thinned evenly (``gpumemd.step_history``)
    at_oom: StepRecord | None = None  # the probes read at the OOM, in the failing step
    findings: Sequence[Finding] = ()
    host: HostSample | None = None
    workers: WorkersSample | None = None  # the job's child processes at the OOM (the last reading)
    allocator: Sequence[AllocatorSample] = ()
    nvml: Sequence[NvmlDeviceSample] = ()
    environment: Mapping[str, Any] = field(default_factory=dict)
    memory_summary: str | None = None
    step_profile: StepProfile | None = None  # the last sampled step's profile (attach(step_profile=True))


# Whether the job caught the OOM or died of it, by where the report came from.
OUTCOMES = {
    "caught": "caught: the job caught this OOM and went on (an OOM it caught recurs: fix it or bound it)",
    "excepthook": "fatal: nothing caught this OOM and it ended the job",
    "thread_excepthook": "fatal to its thread: nothing caught this OOM and it ended the thread",
    "oom_guard": "raised to the job through gpumemd.oom_guard",
    "request": "report requested by the job (gpumemd.oom_report)",
}
OUTCOME_WORDS = {"caught": "caught", "excepthook": "fatal", "thread_excepthook": "fatal (thread)",
                 "oom_guard": "oom_guard", "request": "requested"}
"""The outcome in a word, for a table of reports (``gpumemd report`` over several)."""


def oom_device(inputs: ReportInputs) -> Device | None:
    """The failing CUDA device; None for a host (CPU) failure and for a device the error does
    not name in a process that uses several (``breakdown_device`` says which one the report shows)."""
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


@dataclass(frozen=True)
class ShownDevice:
    """The device a report's breakdown shows (None: the host) and, when the error did not name it, why
    this one (``Breakdown.device_note``)."""

    device: Device | None
    note: str | None = None


def breakdown_device(inputs: ReportInputs) -> ShownDevice:
    """The device the breakdown shows: ``oom_device`` where that is known. A CUDA (or other device) OOM
    whose device is unknown, in a process whose allocator was sampled on several devices, shows the
    fullest of them with a note saying so, never the host's memory as if the host had run out. A host
    failure, and a device OOM with no allocator sample, show the host."""
    device = oom_device(inputs)
    msg = inputs.message
    if device is not None or msg is None or msg.kind not in ("cuda", "device"):
        return ShownDevice(device)
    used = sorted({a.device for a in inputs.allocator}, key=lambda d: d.order)
    if not used:
        return ShownDevice(None)  # no allocator sampled: nothing on a device to show
    return _fullest(inputs, used)


def _sample_of(inputs: ReportInputs, device: Device) -> tuple[AllocatorSample | None, NvmlDeviceSample | None]:
    """The allocator and NVML samples of ``device`` (the first of each, as the breakdown reads them)."""
    return (next((a for a in inputs.allocator if a.device == device), None),
            next((n for n in inputs.nvml if n.device == device), None))


def _room_left(inputs: ReportInputs, device: Device) -> int | None:
    """What the allocator on ``device`` could still reserve: min(NVML free, cap − reserved)."""
    allocator, nvml = _sample_of(inputs, device)
    if allocator is None:
        return None
    return reservable_bytes(nvml.free_bytes if nvml else None, allocator.reserved_bytes, allocator.cap_bytes)


def _share_allocated(inputs: ReportInputs, device: Device) -> float | None:
    """Allocated over what the job could use on ``device``: its cap when one is set, else its total."""
    allocator, nvml = _sample_of(inputs, device)
    total = (allocator.cap_bytes if allocator else None) or (nvml.total_bytes if nvml else None)
    if allocator is None or allocator.allocated_bytes is None or not total:
        return None
    return allocator.allocated_bytes / total


def _reserved(inputs: ReportInputs, device: Device) -> float | None:
    """What PyTorch reserved on ``device`` (every allocator backend reports it)."""
    allocator, _ = _sample_of(inputs, device)
    return allocator.reserved_bytes if allocator else None


# How to tell the fullest device, best first; the first measure known for every device decides:
# (words, reader, higher is fuller, how a value reads).
_FULLNESS: tuple[tuple[str, Callable[[ReportInputs, Device], float | None], bool, Callable[[float], str]], ...] = (
    ("the least room left to reserve", _room_left, False, lambda v: fmt(int(v))),
    ("the highest share allocated", _share_allocated, True, lambda v: f"{v:.1%}"),
    ("the most reserved by PyTorch", _reserved, True, lambda v: fmt(int(v))),  # no NVML, no cap
)


def _fullest(inputs: ReportInputs, used: list[Device]) -> ShownDevice:
    """The fullest of the devices in ``used`` (two or more) by the first measure in ``_FULLNESS`` known
    for all of them; the note names the device, the measure and the runner-up."""
    for words, read, higher, show in _FULLNESS:
        values = {d: read(inputs, d) for d in used}
        known = {d: v for d, v in values.items() if v is not None}
        if len(known) < len(used):
            continue
        order = sorted(used, key=lambda d: (-known[d] if higher else known[d], d.order))
        first, second = order[0], order[1]
        also = (f"; tied with {second}, the lower number is shown" if known[first] == known[second]
                else f", against {show(known[second])} on {second}"
                + ("" if len(used) == 2 else ", the next fullest"))
        return ShownDevice(first, f"The error does not name its device; showing {first}, the fullest of "
                                  f"the {len(used)} devices this process uses ({words}, {show(known[first])}{also})")
    return ShownDevice(used[0], f"The error does not name its device, and the samples of the {len(used)} devices "
                                f"this process uses do not say which was fullest; showing {used[0]}, the first")


def _device_breakdown(inputs: ReportInputs) -> Breakdown:
    shown = breakdown_device(inputs)
    device = shown.device
    if device is None:
        # the host read at the OOM, when it could be: a limit the job set since the last sample binds now
        host = inputs.at_oom.host if inputs.at_oom is not None and inputs.at_oom.host is not None else inputs.host
        return cpu_breakdown(message=inputs.message, host=host, census=inputs.census, workers=inputs.workers)
    allocator, nvml = _sample_of(inputs, device)
    breakdown = cuda_breakdown(
        device=device, message=inputs.message, observer=inputs.observer,
        snapshot=inputs.snapshot_summaries.get(device), allocator=allocator, census=inputs.census,
        nvml_total_bytes=nvml.total_bytes if nvml else None,
    )
    return dataclasses.replace(breakdown, device_note=shown.note) if shown.note else breakdown


def compute_breakdown(inputs: ReportInputs) -> Breakdown:
    """The failing device's breakdown, with the leak active at the OOM (if any) in it and, when the
    leak held more than the failing request, in its verdict."""
    breakdown = _device_breakdown(inputs)
    leak = leak_at_oom(findings=inputs.findings, census=inputs.census, census_before=inputs.census_before,
                       device=breakdown.device, step=inputs.step)
    return with_leak(breakdown, leak)


def timeline_records(inputs: ReportInputs) -> list[tuple[StepRecord, int]]:
    """(record, steps it stands for), oldest first: the long history's records older than the recent
    ones shown, then the last ``TIMELINE_STEPS`` recent records, then the reading at the OOM. The
    chart so spans the run from attach to the OOM (a leak's onset far back included), the table's
    last rows are the recent steps in full, and the failing step is always the last row."""
    recent = list(inputs.steps)[-TIMELINE_STEPS:]
    first = recent[0].step if recent else None
    out: list[tuple[StepRecord, int]] = []
    for record in inputs.history:
        if first is not None and record.step >= first:
            break
        # a thinned record stands for the steps since the previous one kept
        out.append((record, record.step - out[-1][0].step if out else record.steps))
    out += [(r, r.steps) for r in recent]
    at_oom = inputs.at_oom
    if at_oom is not None and (not out or at_oom.step >= out[-1][0].step):
        out.append((at_oom, at_oom.step - out[-1][0].step if out else at_oom.steps))
    return out


def _timeline_row(record: StepRecord, steps: int, device: Device | None, *, at_oom: bool) -> dict[str, Any]:
    sample = record.allocator_for(device) if device is not None else None
    return {
        "step": record.step,
        "steps": steps,  # steps this row stands for (sampled every Nth on fast steps; thinned far back)
        "at_oom": at_oom,  # read at the OOM, in the failing step (the last row)
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
        "top": [plain(e) for e in top_entries(census, TOP_TENSORS)],
        "groups": [
            {**plain(g.key), "count": g.count, "nbytes": g.nbytes,
             "graph_bytes": g.graph_bytes, "holder": g.holder}
            for g in groups
        ],
    }


def top_entries(census: Census, n: int) -> list[TensorEntry]:
    """The ``n`` largest storages, each with its group's holder when it has none of its own: a tensor
    carries the name the user wrote (``module global `__main__.x```) as its group does."""
    holders = {g.key: g.holder for g in census.groups if g.holder}
    return [e if e.holder is not None else dataclasses.replace(
        e, holder=holders.get(GroupKey(e.device, e.dtype, e.shape, e.category, e.name))) for e in census.top(n)]


def _step_profile(profile: StepProfile | None) -> dict[str, Any] | None:
    """The last step profile; figures it could not measure (the allocator's on CPU) are left out."""
    if profile is None:
        return None
    return {
        "step": profile.step,
        "device": profile.device.name,
        "saved_tensors": profile.saved_tensors,
        "overhead_s": profile.overhead_s,
        "figures": [{"name": name, "label": STEP_PROFILE_LABELS.get(name, name), "nbytes": nbytes}
                    for name, nbytes in profile.figures().items()],
    }


def build_report(inputs: ReportInputs) -> dict[str, Any]:
    """The report as a JSON-ready dict (finite floats, lists, str keys)."""
    breakdown = compute_breakdown(inputs)
    device = breakdown_device(inputs).device  # the timeline and the peak follow the device shown
    suggestions = suggest(breakdown, findings=inputs.findings, phase=inputs.phase,
                          expandable_segments=inputs.expandable_segments,
                          largest=top_entries(inputs.census, 20) if inputs.census is not None else ())
    timeline = [_timeline_row(r, n, device, at_oom=r is inputs.at_oom) for r, n in timeline_records(inputs)]
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": REPORT_KIND,
        "created_at": inputs.created_at,
        "rank": inputs.identity.rank,
        "world_size": inputs.identity.world_size,
        "step": inputs.step,
        "phase": inputs.phase,
        "source": inputs.source,
        "outcome": OUTCOMES.get(inputs.source, inputs.source),
        "exception": {"type": inputs.exception_type, "message": inputs.exception_message,
                      "traceback": inputs.traceback_text},
        "oom": plain(inputs.message) if inputs.message else None,
        "observer": plain(inputs.observer) if inputs.observer else None,
        "breakdown": plain(breakdown),
        "peak_bytes": _peak(timeline, breakdown, device is None),
        "suggestions": [plain(s) for s in suggestions],
        "suggestions_none": None if suggestions else why_none(breakdown),
        "tensors": _tensors(inputs.census, inputs.census_note),
        # optional (None without attach(step_profile=True)). Named "phases" until the key was renamed: an
        # older reader sees no step profile, as when none was measured, and load.py reads old files.
        "step_profile": _step_profile(inputs.step_profile),
        "timeline": timeline,
        # the OOM these findings foresaw has happened: no "out of memory in ~12 min" beside it
        "findings": [plain(without_projection(f)) for f in inputs.findings],
        "snapshot": {
            "file": inputs.snapshot_file,
            "source": inputs.snapshot_source,
            "devices": [plain(s) for _, s in sorted(inputs.snapshot_summaries.items(), key=lambda ds: ds[0].order)],
        },
        "environment": dict(inputs.environment),
        "memory_summary": inputs.memory_summary,
    }
    return jsonable(report)
