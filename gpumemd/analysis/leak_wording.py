"""The wording of leak findings: a track status and its culprits in, the record users read out.

Pure (no torch, no I/O). ``analysis.leak_detector`` decides; this module only says it: the
one-line summary, the culprit sentence ("+1 tensor/step: float32[4, 128], held by `kept` in main() at
train.py:12 → list of 1,204 items"), the kind refined by the evidence, and the severity from the
projected time to out-of-memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from gpumemd.analysis.holder_adds import added_at
from gpumemd.analysis.leak_detector import LeakState, TrackStatus
from gpumemd.analysis.leak_headline import (
    KIND_WORDS,
    Facts,
    duration_words,
    headline,
    holder_words,
    projection_words,
    since_words,
)
from gpumemd.analysis.units import format_bytes
from gpumemd.records.census import GroupDelta
from gpumemd.records.device import cuda_index
from gpumemd.records.findings import Culprit, Finding

CRITICAL_HOURS = 24.0
"""A finding projected to run out of memory sooner than this is critical; later ones are warnings."""

# --- findings: turning a track status and its culprits into the record users read --------------


def describe_group(delta: GroupDelta) -> str:
    """``float32[64, 256] with grad_fn`` / ``Adam[fc.weight].exp_avg float32[64, 256]``."""
    dtype = delta.dtype.removeprefix("torch.")
    shape = "[" + ", ".join(str(d) for d in delta.shape) + "]"
    text = f"{dtype}{shape}"
    if delta.category == "graph":
        text += " with grad_fn"
    elif delta.category not in ("other",):
        text += f" ({delta.category})"
    if delta.name:
        text = f"{delta.name} {text}"
    return text


def fold_graph_groups(deltas: Iterable[GroupDelta]) -> list[GroupDelta]:
    """Charge tensors that only an autograd graph keeps (category graph, no Python holder: saved
    activations whose wrapper torch preserved) to the held graph tensor that grew in count — the
    loss kept in a list — as its graph bytes: "+1 tensor/step: float32[] with grad_fn, held by list
    `losses`, keeping ~3 MiB/step of autograd graph alive"."""
    deltas = list(deltas)
    kept = [d for d in deltas if _graph_kept(d.category, d.holder) and d.bytes_delta > 0]
    roots = [d for d in deltas if d.category == "graph" and not _graph_kept(d.category, d.holder)
             and d.count_delta > 0]
    if not kept or not roots:
        return deltas
    root = max(roots, key=lambda d: (d.count_delta, d.bytes_delta))
    extra = sum(d.bytes_delta + d.graph_bytes_delta for d in kept)
    folded = dataclasses.replace(root, graph_bytes_delta=root.graph_bytes_delta + extra)
    return [folded, *(d for d in deltas if d is not root and d not in kept)]


def culprits_from_diff(deltas: Iterable[GroupDelta], *, limit: int = 3) -> tuple[Culprit, ...]:
    """The groups that grew most (own bytes plus graph bytes), as culprits."""
    ranked = sorted(
        (d for d in fold_graph_groups(deltas) if d.bytes_delta + d.graph_bytes_delta > 0),
        key=lambda d: (d.bytes_delta + d.graph_bytes_delta, d.count_delta), reverse=True,
    )
    return tuple(
        Culprit(description=describe_group(d), count_delta=d.count_delta, bytes_delta=d.bytes_delta,
                holder=d.holder, graph_bytes_delta=d.graph_bytes_delta, category=d.category)
        for d in ranked[:limit]
    )


_GRAPH_HOLDERS = ("autograd graph of ", "an autograd graph")  # how the census names graph-kept tensors


def _graph_kept(category: str | None, holder: str | None) -> bool:
    return category == "graph" and (holder is None or holder.startswith(_GRAPH_HOLDERS))


def kept_by_graph(c: Culprit) -> bool:
    """Tensors with a grad_fn that no Python object holds: autograd keeps them (saved activations
    whose Python wrapper torch preserved), so their bytes are graph bytes."""
    return _graph_kept(c.category, c.holder)


def refine_kind(kind: str, culprits: Sequence[Culprit]) -> str:
    """A tensor leak whose growth is mostly autograd graph kept alive is a graph leak."""
    if kind != "tensor_leak" or not culprits:
        return kind
    graph = sum(max(0, c.graph_bytes_delta) + (max(0, c.bytes_delta) if kept_by_graph(c) else 0)
                for c in culprits)
    own = sum(max(0, c.bytes_delta) for c in culprits if not kept_by_graph(c))
    return "graph_leak" if graph > own else kind


def culprit_sentence(c: Culprit, steps: float) -> str:
    """'+1 tensor/step: float32[] with grad_fn, held by list `losses` (...), keeping ~3.1 MiB/step of
    autograd graph alive' — rates over the ``steps`` the census diff spans."""
    if steps < 1:
        # No interval to divide by (both censuses at one step): a count, never a made-up rate.
        text = f"+{c.count_delta:,} {c.noun}s: {c.description}, {format_bytes(c.bytes_delta + c.graph_bytes_delta)}"
        return text + (f", held by {c.holder}" if c.holder else ", holder not found")
    rate = c.count_delta / steps
    if c.count_delta <= 0:
        head = f"+0 {c.noun}s"
    elif rate >= 0.5:
        n = max(1, round(rate))
        head = f"+{n} {c.noun}{'s' if n != 1 else ''}/step"
    else:
        head = f"+1 {c.noun} every {steps / c.count_delta:.0f} steps"
    if kept_by_graph(c):
        # saved activations: what matters is the graph that keeps them and who holds its root
        holder = c.holder or "an autograd graph (its root's holder was not found)"
        return (f"{head.replace(c.noun, 'saved ' + c.noun, 1)}: {c.description} "
                f"(~{format_bytes(c.bytes_delta / steps)}/step), kept alive by {_the(holder)}")
    text = f"{head}: {c.description}"
    if c.bytes_delta < c.graph_bytes_delta:
        pass  # the graph is the story; the tensors' own bytes would only distract
    elif c.bytes_delta > 0 and c.count_delta > 0:
        text += f" (~{format_bytes(c.bytes_delta / steps)}/step)"
    elif c.bytes_delta > 0:
        text += f" growing ~{format_bytes(c.bytes_delta / steps)}/step"
    text += f", held by {c.holder}" if c.holder else ", holder not found"
    if c.graph_bytes_delta / steps >= 1:
        text += f", keeping ~{format_bytes(c.graph_bytes_delta / steps)}/step of autograd graph alive"
    return text


def _the(holder: str) -> str:
    return "the " + holder if holder.startswith("autograd graph") else holder


_UNIT_NOUNS = {"tensors": "tensor", "nodes": "autograd node"}


def severity(hours_to_oom: float | None, state: LeakState | None) -> str | None:
    if state is None or not state.active:
        return None
    return "critical" if hours_to_oom is not None and hours_to_oom < CRITICAL_HOURS else "warning"


def build_finding(
    status: TrackStatus, *, kind: str | None = None, culprits: Sequence[Culprit] = (),
    culprit_steps: float = 0.0, headroom_bytes: float | None = None, sites: Sequence[str] = (),
    bytes_per_unit: float = 1.0, seconds_per_step: float | None = None, holder_sentence: str | None = None,
    per_step: float | None = None, culprits_step: int | None = None,
) -> Finding:
    """The user-facing record for one track status; ``summary`` is the one-line sentence.

    For count series (``spec.unit == "tensors"``) the slope is tensors per step and
    ``bytes_per_unit`` converts it to bytes; ``holder_sentence`` is the culprit sentence when the
    component wrote it from the tensors themselves. ``per_step`` is the rate to state when the caller
    measured it better than the window's slope (a count series' slope since its onset).
    ``culprits_step`` is the step the culprits were looked up at: when it is earlier than this
    status, the sentence says so (container sizes and holders are from then, not from now)."""
    v = status.verdict
    kind = kind or refine_kind(status.spec.kind, culprits)
    counts = status.spec.unit != "bytes"
    per_step = v.slope.slope if per_step is None else per_step
    slope = per_step * bytes_per_unit if counts else per_step
    active = status.state is not None and status.state.active
    steps_to_oom, hours_to_oom = _time_to_oom(headroom_bytes, slope, seconds_per_step) if active else (None, None)
    projected, oom = projection_words(steps_to_oom, hours_to_oom)
    name = status.spec.name
    summary = _summary(status, kind, per_step, slope, bytes_per_unit=bytes_per_unit, projected=projected)
    facts = Facts(kind=kind, state=status.state_name or "suspected", where=_where(status),
                  stopped=None if active else v.reason)
    if active:
        summary += _culprit_text(status, culprits, culprit_steps, holder_sentence=holder_sentence,
                                  culprits_step=culprits_step, sites=sites)
        facts = dataclasses.replace(facts, rate=_stated_rate(status, per_step, slope, culprits),
                                    holder=holder_words(culprits, sites), onset_step=status.onset_step,
                                    out_of_memory=oom)
    low, high = (v.slope.low, v.slope.high)
    if counts:
        low, high = low * bytes_per_unit, high * bytes_per_unit
    return Finding(
        kind=kind,
        series=name,
        state=status.state_name or "suspected",
        slope_bytes_per_step=slope,
        slope_low=low,
        slope_high=high,
        onset_step=status.onset_step,
        growth_bytes=int(status.growth_bytes * (bytes_per_unit if counts else 1)),
        steps_to_oom=steps_to_oom,
        first_step=status.first_step if status.first_step is not None else status.step,
        updated_step=status.step,
        summary=summary,
        headline=headline(facts),
        added_at=added_at(culprits[0].holder) if culprits else None,
        device=status.spec.device,
        culprits=tuple(culprits),
        phase=status.phase,
        p_value=v.p_increasing,
        sites=tuple(sites),
        tensors_per_step=per_step if status.spec.unit == "tensors" else None,
        hours_to_oom=hours_to_oom,
        severity=severity(hours_to_oom, status.state),
        group=status.spec.group,
    )


def _time_to_oom(headroom_bytes: float | None, slope: float,
                 seconds_per_step: float | None) -> tuple[float | None, float | None]:
    """Steps (and hours, at the measured step time) until the growth fills the headroom."""
    if headroom_bytes is None or slope <= 0:
        return None, None
    steps_to_oom = max(0.0, headroom_bytes) / slope
    hours_to_oom = steps_to_oom * seconds_per_step / 3600 if seconds_per_step else None
    return steps_to_oom, hours_to_oom


def _where(status: TrackStatus) -> str | None:
    """What a headline's kind leaves open: the CUDA device, and a phase other than training."""
    index = cuda_index(status.spec.device)
    parts = [f"cuda:{index}"] if index is not None else []
    if status.phase != "train":
        parts.append(f"phase {status.phase}")
    return ", ".join(parts) or None


def _rate(status: TrackStatus, per_step: float, slope: float) -> str:
    """"+1 tensor/step (~2.0 KiB/step)", "+128.2 KiB/step": the growth per step a headline states."""
    if status.spec.row_bytes:
        return rows_rate(slope / status.spec.row_bytes, status.spec.row_bytes)
    if status.spec.unit == "bytes":
        return f"+{format_bytes(slope)}/step"
    noun = _UNIT_NOUNS.get(status.spec.unit, status.spec.unit)
    n = _count(per_step)
    rate = f"+{n} {noun}{'' if n == '1' else 's'}/step"
    return f"{rate} (~{format_bytes(slope)}/step)" if slope >= 1 else rate


def _growth_parts(status: TrackStatus, per_step: float, slope: float, bytes_per_unit: float) -> list[str]:
    """The rate, the onset and the growth so far of an active finding."""
    v = status.verdict
    counts = status.spec.unit != "bytes"
    noun = _UNIT_NOUNS.get(status.spec.unit, status.spec.unit)
    parts: list[str] = []
    if counts:
        n = _count(per_step)
        rate = f"+{n} {noun}{'' if n == '1' else 's'}/step"
        parts.append(f"{rate} (~{format_bytes(slope)}/step)" if slope >= 1 else rate)
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
             projected: str | None) -> str:
    """The summary up to its culprit: what, in what state, how fast and how soon out of memory."""
    parts = [f"{KIND_WORDS.get(kind, kind)} {status.state_name} on {status.spec.name}"]
    if status.phase != "train":
        parts[0] += f" (phase {status.phase})"
    if status.state is None or not status.state.active:
        parts.append(f"growth stopped ({status.verdict.reason})")
    else:
        parts.extend(_growth_parts(status, per_step, slope, bytes_per_unit))
        if status.held:  # its counter stopped: the rate and growth are as last measured, a lower bound
            parts.append(status.held)
        if projected is not None:
            parts.append(f"out of memory in {projected}")
    return ", ".join(parts)


def _stated_rate(status: TrackStatus, per_step: float, slope: float, culprits: Sequence[Culprit]) -> str:
    """The rate the headline states: per worker process for the DataLoader workers."""
    if culprits and culprits[0].category == "workers" and culprits[0].count_delta > 0:
        return f"+{format_bytes(slope / culprits[0].count_delta)}/step each"
    return _rate(status, per_step, slope)


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


def count_sentence(per_step: float, description: str, own_bytes: float, graph_bytes: float,
                   holder: str | None, *, graph_nodes: int = 0) -> str:
    """The culprit sentence of a count series, written from the tensors themselves: '+1 tensor/step:
    float32[4, 128] (~2.0 KiB/step), held by `kept` in main() at train.py:12 → list of 1,204 items'.
    ``graph_nodes``: the autograd nodes one of them keeps alive when backward() freed what they saved
    (the nodes still hold host memory, which this process's RSS shows rather than any tensor)."""
    n = _count(per_step)
    text = f"+{n} tensor{'' if n == '1' else 's'}/step: {description} (~{format_bytes(per_step * own_bytes)}/step"
    if graph_bytes:
        text += f", keeping ~{format_bytes(per_step * graph_bytes)}/step of autograd graph alive"
    elif graph_nodes > 1:
        text += (f", each keeping its autograd graph of {graph_nodes:,} nodes alive: backward() freed its "
                 "saved tensors, the nodes stay in host memory")
    return text + ")" + (f", held by {holder}" if holder else ", holder not found")


def growth_sentence(holder: str | None, description: str, rows_per_step: float, row_bytes: int,
                    rows_now: int) -> str:
    """The culprit sentence of a tensor replaced each step by a larger one: '`all_logits` in
    evaluate() at eval.py:30 grows +64 rows/step (~2.5 KiB/step): float32[N, 10], 19,200 rows
    (750.0 KiB) now, a larger copy every step (torch.cat onto the kept tensor): ...'."""
    who = holder if holder else f"a {description} tensor (holder not found)"
    return (f"{who} grows {rows_rate(rows_per_step, row_bytes)}: {description}, {rows_now:,} rows "
            f"({format_bytes(rows_now * row_bytes)}) now, replaced by a larger copy every step "
            "(torch.cat onto the kept tensor): append the parts to a list and cat once, "
            "move them to the CPU or reset it each epoch, or keep a running metric instead")


def workers_noun(pids: Sequence[int], dataloader: bool) -> str:
    """'DataLoader workers (2, pids 4120, 4121)', 'child processes (1, pid 4120)'."""
    shown = ", ".join(str(p) for p in pids[:6]) + (", …" if len(pids) > 6 else "")
    noun = "DataLoader workers" if dataloader else "child processes"
    return f"{noun} ({len(pids)}, pid{'s' if len(pids) != 1 else ''} {shown})"


def workers_holder(pids: Sequence[int], datasets: Sequence[str]) -> str:
    """What a workers finding names where others name a holder: 'DataLoader workers (2, pids 41, 42)
    running CachingDataset'."""
    text = workers_noun(pids, bool(datasets))
    return text + f" running {', '.join(datasets)}" if datasets else text


def workers_sentence(pids: Sequence[int], per_worker: float, onset_step: int | None,
                     loaders: Sequence[tuple[str, bool | None]]) -> str:
    """'DataLoader workers (2, pids 4120, 4121) +300.0 KiB/step each since step 120, running
    CachingDataset (train.data) with persistent_workers=True: ...' and what to try."""
    text = f"{workers_noun(pids, bool(loaders))} +{format_bytes(per_worker)}/step each"
    if onset_step is not None:
        text += f" {since_words(onset_step)}"
    text += " while the training process stays flat"
    if loaders:
        runs = "; ".join(f"{name}{'' if persistent is None else f', persistent_workers={persistent}'}"
                         for name, persistent in loaders)
        text += f", running {runs}"
    return (text + ": a cache in the Dataset fills in every worker: bound it (an LRU of fixed size) or "
            "fill it before the workers start; Python lists and dicts the Dataset holds are copied into "
            "each worker as it reads them (copy-on-read): hold numpy arrays or tensors instead")


def rows_rate(rows_per_step: float, row_bytes: int) -> str:
    """'+64 rows/step (~2.5 KiB/step)'."""
    n = _count(rows_per_step)
    return f"+{n} row{'' if n == '1' else 's'}/step (~{format_bytes(rows_per_step * row_bytes)}/step)"


def chain_sentence(description: str, graph_nodes: int, saved_per_step: float, holder: str | None, *,
                   at_least: bool = False) -> str:
    """The culprit sentence of a graph chain: 'every step's graph stays chained to float32[] held by
    `epoch_loss` in train() at train.py:57 (graph of 3,001 nodes now; backward() freed their saved
    tensors, the nodes stay): accumulate `.item()` or `.detach()`, not the tensor with its graph'.
    ``at_least``: the count stopped at ``graph_nodes`` ("20,000+ nodes")."""
    nodes = f"{graph_nodes:,}{'+' if at_least else ''}"
    text = (f"every step's graph stays chained to {description}"
            f"{f' held by {holder}' if holder else ' (holder not found)'} (graph of {nodes} nodes now; ")
    if saved_per_step >= 1:
        text += f"its saved tensors grow ~{format_bytes(saved_per_step)}/step)"
    else:
        text += "backward() freed their saved tensors, the nodes stay)"
    return text + ": accumulate `.item()` or `.detach()`, not the tensor with its graph"


def _count(per_step: float) -> str:
    """1 for 0.98 tensors/step (a count series is exact up to its sampling), 0.5 for 0.5."""
    if per_step >= 0.95:
        return f"{round(per_step):,}"
    return f"{per_step:.2g}"


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
    where = _finding_where(lead)
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
    n = _count(per_step)
    rate = f"+{n} tensor{'' if n == '1' else 's'}/step"
    parts = [head, f"{rate} (~{format_bytes(slope)}/step)"]
    if onset is not None:
        parts.append(since_words(onset))
    parts.append(f"+{format_bytes(sum(m.growth_bytes for m in active))} so far")
    oom = (f"~{duration_words(hours_to_oom)}" if hours_to_oom is not None
           else f"~{steps_to_oom:,.0f} steps" if steps_to_oom is not None else None)
    if hours_to_oom is not None and steps_to_oom is not None:
        parts.append(f"out of memory in {oom} (~{steps_to_oom:,.0f} steps)")
    elif oom is not None:
        parts.append(f"out of memory in {oom}")
    summary = ", ".join(parts) + "".join("; " + _group_sentence(m) for m in ranked if m.culprits)
    shared = (dataclasses.replace(culprits[0], holder=holder),) if culprits and holder else culprits
    facts = Facts(kind=lead.kind, state=state, rate=f"{rate} (~{format_bytes(slope)}/step, {len(active)} groups)",
                  where=where, holder=holder_words(shared, ()), onset_step=onset, out_of_memory=oom)
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
        severity="critical" if hours_to_oom is not None and hours_to_oom < CRITICAL_HOURS else "warning",
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


def _finding_where(finding: Finding) -> str | None:
    """What a headline's kind leaves open, from a finding (``_where`` reads a status)."""
    index = cuda_index(finding.device)
    parts = [f"cuda:{index}"] if index is not None else []
    if finding.phase != "train":
        parts.append(f"phase {finding.phase}")
    return ", ".join(parts) or None
