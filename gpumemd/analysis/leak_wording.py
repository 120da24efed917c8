"""The wording of leak findings: a track status and its culprits in, the record users read out.

Pure (no torch, no I/O). ``analysis.leak_detector`` decides; this module only says it: the
one-line summary, the culprit sentence ("+1 tensor/step: float32[4, 128], held by `kept` in main() at
train.py:12 → list of 1,204 items"; ``analysis.census_culprits`` writes it from a census diff,
``analysis.culprit_sentences`` from what the leak component measured itself), the kind refined by the
evidence, and the severity from the projected time to out-of-memory; and the one finding of a cause.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from gpumemd.analysis.census_culprits import culprit_sentence, refine_kind
from gpumemd.analysis.culprit_sentences import count_sentence, rows_rate, units_per_step
from gpumemd.analysis.holder_adds import added_at
from gpumemd.analysis.leak_detector import LeakState, TrackStatus
from gpumemd.analysis.leak_headline import KIND_WORDS, Facts, headline, holder_words, projection_words, since_words
from gpumemd.analysis.units import format_bytes
from gpumemd.records.device import Device, cuda_index
from gpumemd.records.findings import Culprit, Finding

CRITICAL_HOURS = 24.0
"""A finding projected to run out of memory sooner than this is critical; later ones are warnings."""

HOST_OVER_TENSORS = 4.0
"""Host growth per tensor byte at which a CPU tensor finding states it. Up to ~2x is what storing
the tensors costs the allocator (page rounding, fresh heap): a 64 KiB/step leak read "host RSS
+128.0 KiB/step", words that told nothing and pushed the line that adds to the holder out of the
200-character headline. The gaps that change the projection are two orders larger (256 B/step of
tensors, 30-75 KiB/step of RSS)."""

# --- findings: turning a track status and its culprits into the record users read --------------


_UNIT_NOUNS = {"tensors": "tensor", "nodes": "autograd node"}


def _severity(hours_to_oom: float | None, state: LeakState | None) -> str | None:
    if state is None or not state.active:
        return None
    return "critical" if hours_to_oom is not None and hours_to_oom < CRITICAL_HOURS else "warning"


def build_finding(
    status: TrackStatus, *, kind: str | None = None, culprits: Sequence[Culprit] = (),
    culprit_steps: float = 0.0, headroom_bytes: float | None = None, sites: Sequence[str] = (),
    bytes_per_unit: float = 1.0, seconds_per_step: float | None = None, holder_sentence: str | None = None,
    per_step: float | None = None, culprits_step: int | None = None, host_bytes_per_step: float | None = None,
) -> Finding:
    """The user-facing record for one track status; ``summary`` is the one-line sentence.

    For count series (``spec.unit == "tensors"``) the slope is tensors per step and
    ``bytes_per_unit`` converts it to bytes; ``holder_sentence`` is the culprit sentence when the
    component wrote it from the tensors themselves. ``per_step`` is the rate to state when the caller
    measured it better than the window's slope (a count series' slope since its onset).
    ``culprits_step`` is the step the culprits were looked up at: when it is earlier than this
    status, the sentence says so (container sizes and holders are from then, not from now).
    ``host_bytes_per_step``: host RSS's growth since a CPU tensor finding's onset (``_stated_host``)."""
    v = status.verdict
    kind = kind or refine_kind(status.spec.kind, culprits)
    counts = status.spec.unit != "bytes"
    scale = bytes_per_unit if counts else 1.0  # a count series' units to bytes
    per_step = v.slope.slope if per_step is None else per_step
    slope = per_step * scale
    active = status.state is not None and status.state.active
    host = _stated_host(host_bytes_per_step, slope) if counts else None
    # an inactive finding projects nothing: as if no headroom were known
    steps_to_oom, hours_to_oom = _time_to_oom(headroom_bytes if active else None, host or slope, seconds_per_step)
    projected, oom = projection_words(steps_to_oom, hours_to_oom)
    summary = _summary(status, kind, per_step, slope, bytes_per_unit=bytes_per_unit, projected=projected, host=host)
    rate = holder = None  # an inactive finding's headline says why it stopped instead
    if active:
        summary += _culprit_text(status, culprits, culprit_steps, holder_sentence=holder_sentence,
                                  culprits_step=culprits_step, sites=sites)
        rate, holder = _stated_rate(status, per_step, slope, culprits, host), holder_words(culprits, sites)
    return Finding(
        kind=kind,
        series=status.spec.name,
        state=status.state_name or "suspected",
        slope_bytes_per_step=slope,
        slope_low=v.slope.low * scale,
        slope_high=v.slope.high * scale,
        onset_step=status.onset_step,
        growth_bytes=int(status.growth_bytes * scale),
        steps_to_oom=steps_to_oom,
        first_step=status.first_step if status.first_step is not None else status.step,
        updated_step=status.step,
        summary=summary,
        headline=_headline(status, kind, rate, holder, oom),
        added_at=added_at(culprits[0].holder) if culprits else None,
        device=status.spec.device,
        culprits=tuple(culprits),
        phase=status.phase,
        p_value=v.p_increasing,
        sites=tuple(sites),
        tensors_per_step=per_step if status.spec.unit == "tensors" else None,
        hours_to_oom=hours_to_oom,
        severity=_severity(hours_to_oom, status.state),
        group=status.spec.group,
        host_bytes_per_step=host if active else None,
    )


def _headline(status: TrackStatus, kind: str, rate: str | None, holder: str | None, oom: str | None) -> str:
    """The state change's line: an active finding's rate, holder, onset and out-of-memory (``rate``
    given), or that its growth stopped, and why."""
    facts = Facts(kind=kind, state=status.state_name or "suspected", where=_where(status.spec.device, status.phase),
                  stopped=None if rate is not None else status.verdict.reason)
    if rate is not None:
        facts = dataclasses.replace(facts, rate=rate, holder=holder, onset_step=status.onset_step, out_of_memory=oom)
    return headline(facts)


def _stated_host(host_bytes_per_step: float | None, slope: float) -> float | None:
    """Host RSS's growth since a CPU tensor finding's onset, when it is ``HOST_OVER_TENSORS`` times the
    tensors' own bytes or more: then stated beside them, and the out-of-memory projection is made
    from it (the heap those tensors pin is what runs out)."""
    stated = host_bytes_per_step is not None and host_bytes_per_step >= HOST_OVER_TENSORS * slope
    return host_bytes_per_step if stated else None


def _time_to_oom(headroom_bytes: float | None, slope: float,
                 seconds_per_step: float | None) -> tuple[float | None, float | None]:
    """Steps (and hours, at the measured step time) until the growth fills the headroom."""
    if headroom_bytes is None or slope <= 0:
        return None, None
    steps_to_oom = max(0.0, headroom_bytes) / slope
    hours_to_oom = steps_to_oom * seconds_per_step / 3600 if seconds_per_step else None
    return steps_to_oom, hours_to_oom


def _where(device: Device | None, phase: str) -> str | None:
    """What a headline's kind leaves open: the CUDA device, and a phase other than training."""
    index = cuda_index(device)
    parts = [f"cuda:{index}"] if index is not None else []
    if phase != "train":
        parts.append(f"phase {phase}")
    return ", ".join(parts) or None


def _count_rate(unit: str, per_step: float, slope: float, host: float | None = None, more: str = "") -> str:
    """"+1 tensor/step (~2.0 KiB/step)": a count series' rate, with its bytes when they are one or more,
    and host RSS's growth with it ("~256 B/step, host RSS +30.1 KiB/step") when that is stated; ``more``
    ("2 groups") last in the same parentheses."""
    rate = units_per_step(per_step, _UNIT_NOUNS.get(unit, unit))
    inside = [f"~{format_bytes(slope)}/step" + (f", host RSS +{format_bytes(host)}/step" if host else "")] \
        if slope >= 1 else []
    inside += [more] if more else []
    return f"{rate} ({', '.join(inside)})" if inside else rate


def _growth_parts(status: TrackStatus, per_step: float, slope: float, bytes_per_unit: float,
                  host: float | None) -> list[str]:
    """The rate, the onset and the growth so far of an active finding."""
    v = status.verdict
    counts = status.spec.unit != "bytes"
    noun = _UNIT_NOUNS.get(status.spec.unit, status.spec.unit)
    parts: list[str] = []
    if counts:
        parts.append(_count_rate(status.spec.unit, per_step, slope, host))
    else:
        low = v.slope.low if math.isfinite(v.slope.low) else 0.0
        bounds = f">= {format_bytes(low)}/step at 95%"
        if status.spec.row_bytes:  # "+64 rows/step (~2.5 KiB/step, >= ...)"
            parts.append(rows_rate(slope / status.spec.row_bytes, status.spec.row_bytes)[:-1] + f", {bounds})")
        else:
            parts.append(f"+{format_bytes(slope)}/step ({bounds})")
    if status.onset_step is not None:
        parts.append(since_words(status.onset_step))
    grown = status.growth_bytes * bytes_per_unit if counts else status.growth_bytes
    if counts and grown < 1:
        parts.append(f"+{status.growth_bytes:,.0f} {noun}s so far")
    else:
        parts.append(f"+{format_bytes(grown)} so far")
    return parts


def _summary(status: TrackStatus, kind: str, per_step: float, slope: float, *, bytes_per_unit: float,
             projected: str | None, host: float | None) -> str:
    """The summary up to its culprit: what, in what state, how fast and how soon out of memory."""
    parts = [f"{KIND_WORDS.get(kind, kind)} {status.state_name} on {status.spec.name}"]
    if status.phase != "train":
        parts[0] += f" (phase {status.phase})"
    if status.state is None or not status.state.active:
        parts.append(f"growth stopped ({status.verdict.reason})")
    else:
        parts.extend(_growth_parts(status, per_step, slope, bytes_per_unit, host))
        if status.held:  # its counter stopped: the rate and growth are as last measured, a lower bound
            parts.append(status.held)
        if projected is not None:
            parts.append(f"out of memory in {projected}")
    return ", ".join(parts)


def _stated_rate(status: TrackStatus, per_step: float, slope: float, culprits: Sequence[Culprit],
                 host: float | None) -> str:
    """The growth per step a headline states: "+1 tensor/step (~2.0 KiB/step)", "+128.2 KiB/step"; per
    worker process for the DataLoader workers."""
    if culprits and culprits[0].category == "workers" and culprits[0].count_delta > 0:
        return f"+{format_bytes(slope / culprits[0].count_delta)}/step each"
    if status.spec.row_bytes:
        return rows_rate(slope / status.spec.row_bytes, status.spec.row_bytes)
    if status.spec.unit == "bytes":
        return f"+{format_bytes(slope)}/step"
    return _count_rate(status.spec.unit, per_step, slope, host)


def _culprit_text(status: TrackStatus, culprits: Sequence[Culprit], culprit_steps: float, *,
                  holder_sentence: str | None, culprits_step: int | None, sites: Sequence[str]) -> str:
    """What an active finding's summary says after its rate: the culprit, and where it was allocated."""
    text = ""
    if holder_sentence:
        text += "; " + holder_sentence
    elif culprits:
        text += "; " + culprit_sentence(culprits[0], culprit_steps)
        if len(culprits) > 1:
            text += f" (+{len(culprits) - 1} more group{'s' if len(culprits) > 2 else ''})"
    if (holder_sentence or culprits) and culprits_step is not None and culprits_step < status.step:
        text += f" (culprit looked up at step {culprits_step:,})"
    if sites:
        text += "; allocated at " + sites[0]
    return text


def cause_finding(members: Sequence[Finding], *, state: str, holder: str | None) -> Finding:
    """One finding for the count findings of one cause (``analysis.leak_causes`` groups them): the
    groups it lists, their total rate, the earliest onset, and ``holder``, the path they share, in
    its headline. Rates, growth and time to out-of-memory are the active members' sums (a cleared
    cause only says that its growth stopped). The rest (kind, series, device, phase) is the largest
    member's."""
    active = [m for m in members if m.state != "cleared"]
    lead = max(active or members, key=lambda m: m.slope_bytes_per_step)
    head = f"{KIND_WORDS.get(lead.kind, lead.kind)} {state} on {_groups_text(active or members)}"
    if lead.phase != "train":
        head += f" (phase {lead.phase})"
    where = _where(lead.device, lead.phase)
    if not active:
        return dataclasses.replace(
            lead, state=state, summary=f"{head}, growth stopped", culprits=(), severity=None, added_at=None,
            headline=headline(Facts(kind=lead.kind, state=state, where=where)),
            first_step=min(m.first_step for m in members), updated_step=max(m.updated_step for m in members))
    per_step = sum(m.tensors_per_step or 0.0 for m in active)
    slope = sum(m.slope_bytes_per_step for m in active)
    steps_to_oom, hours_to_oom = _sooner(m.steps_to_oom for m in active), _sooner(m.hours_to_oom for m in active)
    onset = min((m.onset_step for m in active if m.onset_step is not None), default=None)
    ranked = sorted(active, key=lambda m: m.slope_bytes_per_step, reverse=True)
    culprits = tuple(m.culprits[0] for m in ranked if m.culprits)
    # host RSS's growth, as the member that states it said it (``_stated_host``): the projection is its
    host = sum(m.host_bytes_per_step for m in active if m.host_bytes_per_step is not None) or None
    rate = _count_rate("tensors", per_step, slope, host)
    parts = [head, rate]
    if onset is not None:
        parts.append(since_words(onset))
    parts.append(f"+{format_bytes(sum(m.growth_bytes for m in active))} so far")
    projected, oom = projection_words(steps_to_oom, hours_to_oom)  # a member's hours come with its steps
    if projected is not None:
        parts.append(f"out of memory in {projected}")
    summary = ", ".join(parts) + "".join("; " + _group_sentence(m) for m in ranked if m.culprits)
    shared = (dataclasses.replace(culprits[0], holder=holder),) if culprits and holder else culprits
    facts = Facts(kind=lead.kind, state=state, where=where, holder=holder_words(shared, ()), onset_step=onset,
                  rate=_count_rate("tensors", per_step, slope, host, f"{len(active)} groups"), out_of_memory=oom)
    return dataclasses.replace(
        lead, state=state, slope_bytes_per_step=slope, slope_low=sum(m.slope_low for m in active),
        slope_high=sum(m.slope_high for m in active), onset_step=onset,
        growth_bytes=sum(m.growth_bytes for m in active), steps_to_oom=steps_to_oom,
        first_step=min(m.first_step for m in members), updated_step=max(m.updated_step for m in members),
        summary=summary, headline=headline(facts), culprits=culprits,
        added_at=added_at(holder) or (added_at(culprits[0].holder) if culprits else None),
        p_value=max((m.p_value for m in active if m.p_value is not None), default=None),
        sites=tuple(dict.fromkeys(s for m in active for s in m.sites)), tensors_per_step=per_step,
        hours_to_oom=hours_to_oom,
        severity=_severity(hours_to_oom, LeakState(state)), host_bytes_per_step=host,
    )


def _groups_text(members: Sequence[Finding]) -> str:
    """"2 groups (float32[32, 10], int64[32])": what a cause's finding is on."""
    ranked = sorted(members, key=lambda m: m.slope_bytes_per_step, reverse=True)
    names = [m.culprits[0].description if m.culprits else (m.group or m.series) for m in ranked]
    return f"{len(members)} groups ({', '.join(names)})"


def _group_sentence(member: Finding) -> str:
    """One group of a cause, as its own finding said it: rate, bytes per step, who holds it."""
    c = member.culprits[0]
    count = max(1, c.count_delta)
    return count_sentence(member.tensors_per_step or 0.0, c.description, c.bytes_delta / count,
                          c.graph_bytes_delta / count, c.holder)


def _sooner(values: Iterable[float | None]) -> float | None:
    """Time to out-of-memory of growths that add up on one headroom: 1 / sum(1 / t)."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    if any(v <= 0 for v in known):
        return 0.0
    return 1.0 / sum(1.0 / v for v in known)

