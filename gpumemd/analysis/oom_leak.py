"""The leak at the OOM: which census groups an active leak finding points at, what they held when the
device ran out, the sentence that blames it, and the breakdown that keeps its bytes apart.

A leak finding says what grew while the job ran; the census taken at the OOM says what that holder
held when the device ran out. Both together let the verdict name the cause, and keep the leak's
autograd graphs out of the "activations" that the suggestions size their advice on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gpumemd.analysis.breakdown import CATEGORY_KEYS, breakdown_item, fmt
from gpumemd.analysis.census_culprits import describe_key
from gpumemd.analysis.leak_headline import projection_words, since_words
from gpumemd.records.census import Census, CensusGroup, category_bytes
from gpumemd.records.device import CPU, Device
from gpumemd.records.findings import Culprit, Finding
from gpumemd.records.oom import Breakdown, BreakdownItem, LeakCause

_ACTIVE_STATES = ("suspected", "confirmed")
_GRAPH_HOLDER = "autograd graph of "
_MODEL_STATE = ("parameter", "gradient", "optimizer_state")  # grows with the model, never leaks


def holder_root(holder: str | None) -> str | None:
    """What keeps a group alive, without the path to it: "`kept` in main() at train.py:12" for
    "`kept` in main() at train.py:12 → list of 770 items" and for "autograd graph of `kept` ... → ...".
    The same holder's line changes between censuses (the list grows); its root does not."""
    if not holder:
        return None
    return holder.split(" → ", 1)[0].removeprefix(_GRAPH_HOLDER).strip() or None


def holder_name(holder: str | None) -> str | None:
    """The name a person knows: "`kept`", "module global `job.CACHE`" -> "`job.CACHE`",
    "TrainerState.history" as it is."""
    root = holder_root(holder)
    if root is None:
        return None
    start = root.find("`")
    end = root.find("`", start + 1)
    return root[start:end + 1] if 0 <= start < end else root


def holder_variable(holder: str | None) -> str | None:
    """The variable's own name: "losses" for "`losses` in main() at train.py:7 → ..." and for "module
    global `__main__.losses` → ...". A frame that has unwound (an excepthook runs after it) leaves
    the module global: the same list under another path, which the census at the OOM sees."""
    name = holder_name(holder)
    if name is None:
        return None
    return name.strip("`").rsplit(".", 1)[-1] or None


def _matching_groups(census: Census, finding: Finding, device: Device) -> list[CensusGroup]:
    """The census groups on ``device`` the finding's culprits name: by holder (every group the same
    variable keeps, its graphs' saved tensors included), else by the culprit's group."""
    roots = {holder_root(c.holder) for c in finding.culprits} - {None}
    names = {holder_variable(c.holder) for c in finding.culprits} - {None}
    wanted = {c.description for c in finding.culprits}
    if finding.group is not None:
        wanted.add(finding.group)
    out = []
    for g in census.groups:
        if g.key.device != device:
            continue
        by_holder = holder_root(g.holder) in roots or holder_variable(g.holder) in names
        by_group = describe_key(g.key) in wanted
        if by_holder or (by_group and g.key.category not in _MODEL_STATE):
            out.append(g)
    return out


def _held_by(groups: list[CensusGroup], holder: str | None) -> LeakCause:
    """What the leaking groups held at the OOM: the fields the census decides (a finding's own
    replace the rest)."""
    largest = max(groups, key=lambda g: g.nbytes + g.graph_bytes)
    by_cat = tuple(sorted((category, n) for category, n in category_bytes(groups).items() if n))
    holder = holder or next((g.holder for g in sorted(groups, key=lambda g: -g.nbytes) if g.holder), None)
    description = describe_key(largest.key)
    return LeakCause(
        holder=holder_name(holder) or f"{description} tensors",
        held_bytes=sum(g.nbytes + g.graph_bytes for g in groups), graph_bytes=dict(by_cat).get("graph", 0),
        tensor_count=sum(g.count for g in groups), description=description, source="census", groups=len(groups),
        bytes_by_category=by_cat, holder_detail=holder,
        group_keys=tuple(g.key for g in sorted(groups, key=lambda g: g.nbytes + g.graph_bytes, reverse=True)),
    )


def _held_per_finding(finding: Finding, culprit: Culprit | None) -> LeakCause:
    """No census at the OOM, or it did not see the leak (host objects): the finding's own growth."""
    grown = max(0, finding.growth_bytes)
    category = "graph" if finding.kind == "graph_leak" else (culprit.category if culprit else None) or "other"
    description = culprit.description if culprit else (finding.group or finding.series)
    holder = culprit.holder if culprit else None
    return LeakCause(
        holder=holder_name(holder) or f"{description} tensors", held_bytes=grown,
        graph_bytes=grown if category == "graph" else 0,
        tensor_count=sum(max(0, c.count_delta) for c in finding.culprits), description=description,
        source="finding", groups=0, bytes_by_category=((category, grown),), holder_detail=holder,
    )


def leak_from_finding(finding: Finding, census: Census | None, device: Device, step: int | None = None,
                      ) -> LeakCause | None:
    """What an active leak finding about ``device`` held at the OOM (in ``step``), or None (cleared,
    other device)."""
    if finding.state not in _ACTIVE_STATES:
        return None
    where = finding.device  # the device whose memory the finding is about (None: not said)
    if where is not None and where != device:
        return None  # a host leak does not fill a GPU, nor one GPU's leak another
    culprit = next((c for c in finding.culprits if c.holder), finding.culprits[0] if finding.culprits else None)
    groups = _matching_groups(census, finding, device) if census is not None else []
    held = _held_by(groups, culprit.holder if culprit else None) if groups else _held_per_finding(finding, culprit)
    held = dataclasses.replace(held, source="finding", kind=finding.kind, state=finding.state,
                               slope_bytes_per_step=finding.slope_bytes_per_step, onset_step=finding.onset_step,
                               series=finding.series, estimated=not groups)
    if groups and census is not None and census.step is not None and step is not None and step - census.step > 1:
        return _projected(held, census.step, step)
    return held


def _projected(leak: LeakCause, census_step: int, step: int) -> LeakCause:
    """What an earlier census's groups of ``leak`` held, grown by the finding's slope to the OOM in
    ``step``: the census at the OOM failed (a CPU OOM under RLIMIT_AS leaves no room for one), and the
    last one, 1,200 steps before, put 1.2 of the 3.6 GiB a list held at the OOM on it."""
    grown = round((leak.slope_bytes_per_step or 0.0) * (step - 1 - census_step))
    if grown <= 0:
        return leak
    return dataclasses.replace(leak, held_bytes=leak.held_bytes + grown, census_step=census_step,
                               bytes_by_category=(*leak.bytes_by_category, (PROJECTED, grown)))


PROJECTED = "projected"
"""The ``bytes_by_category`` entry of a leak's growth since an earlier census (``_projected``): bytes no
census saw, so not in any census category of the breakdown."""


def leak_from_census(census: Census | None, before: Census | None, device: Device) -> LeakCause | None:
    """A group a named holder kept growing between the last census and the one at the OOM, for when
    the detector had not spoken yet. Conservative: the group must already have held two tensors at
    the earlier census (the failing step's activations are new groups, not grown ones)."""
    if census is None or before is None or census.step is None or before.step is None:
        return None
    old = {g.key: g for g in before.groups}

    def growth(g: CensusGroup) -> int:
        prev = old.get(g.key)
        return 0 if prev is None else g.nbytes + g.graph_bytes - prev.nbytes - prev.graph_bytes

    grown = [g for g in census.groups
             if g.holder and g.key.device == device and g.key.category not in _MODEL_STATE
             and g.key in old and old[g.key].count >= 2 and g.count > old[g.key].count and growth(g) > 0]
    if not grown:
        return None
    top = max(grown, key=growth)
    kind = "graph_leak" if top.key.category == "graph" else "tensor_leak"
    return dataclasses.replace(_held_by([top], top.holder), kind=kind, state="grew",
                               slope_bytes_per_step=growth(top) / max(1, census.step - before.step),
                               onset_step=before.step)


def leak_at_oom(
    *, findings: Sequence[Finding], census: Census | None, census_before: Census | None, device: Device,
    step: int | None = None,
) -> LeakCause | None:
    """The active leak that held the most on ``device`` at the OOM (in ``step``): from the findings, else
    from the growth between the last census and the OOM's."""
    leaks = [leak for f in findings if (leak := leak_from_finding(f, census, device, step)) is not None]
    if leaks:
        return max(leaks, key=lambda leak: (leak.held_bytes, leak.state == "confirmed"))
    return leak_from_census(census, census_before, device)


def _kind_words(leak: LeakCause) -> str:
    kind = {"tensor_leak": "tensor leak", "graph_leak": "leak of autograd graphs",
            "host_leak": "host memory leak"}.get(leak.kind, leak.kind.replace("_", " "))
    return f"{kind} seen between censuses" if leak.source == "census" else f"{leak.state} {kind}"


def leak_sentence(leak: LeakCause, total: int | None, device: Device) -> str:
    """"`kept` grew ~2.00 MiB/step since step 60 and held 1.50 GiB of the host's 23.54 GiB at the OOM
    (770 × float32[512, 1024]; confirmed tensor leak)"."""
    text = leak.holder
    if leak.slope_bytes_per_step and leak.slope_bytes_per_step > 0:
        text += f" grew ~{fmt(round(leak.slope_bytes_per_step))}/step"
    else:
        text += " grew"
    if leak.onset_step is not None:
        text += f" {since_words(leak.onset_step)}"
    whose = "the host's" if device == CPU else f"{device.name}'s"
    of_total = f" of {whose} {fmt(total)}" if total else ""
    held = f"by then at least {fmt(leak.held_bytes)}" if leak.estimated else f"{fmt(leak.held_bytes)}"
    if leak.census_step is not None:
        held = f"~{held}"
    text += f" and held {held}{of_total} at the OOM"
    if leak.groups > 1:
        what = f"{leak.tensor_count:,} tensors in {leak.groups} groups, the largest {leak.description}"
    else:
        what = f"{leak.tensor_count:,} × {leak.description}" if leak.tensor_count else leak.description
    if leak.census_step is not None:  # an earlier census's count, and what the slope added since
        seen = fmt(leak.held_bytes - dict(leak.bytes_by_category).get(PROJECTED, 0))
        what += f" at the last census (after step {leak.census_step:,}: {seen}) and its slope since"
    return f"{text} ({what}; {_kind_words(leak)})"


def is_leak_the_cause(breakdown: Breakdown, leak: LeakCause) -> bool:
    """The device was full (capacity) or hit a limit it did not report (unknown), and the leak held
    more than the request that failed: without it, that request would have had room. A request larger
    than the device, or free memory in pieces, is a cause of its own, whatever leaks."""
    if breakdown.verdict not in ("capacity", "unknown"):
        return False
    floor = max(2**20, int(0.01 * (breakdown.total_bytes or 0)))
    return leak.held_bytes >= max(breakdown.requested_bytes or 0, floor)


def _move_to_leaked(items: tuple[BreakdownItem, ...], leak: LeakCause, device: Device) -> tuple[BreakdownItem, ...]:
    """The leak's bytes out of the items the census put them in, into one ``leaked`` item first.
    Bytes the census did not see (an estimated leak) come out of ``invisible`` when it has them."""
    take: dict[str, int] = {}
    unseen = "process_other" if device == CPU else "invisible"  # where what no census saw is
    for category, n in leak.bytes_by_category:
        key = unseen if category == PROJECTED else CATEGORY_KEYS.get(category, "other")
        take[key] = take.get(key, 0) + n
    if leak.estimated:  # the census did not see it: it is in what the census cannot see
        take = {unseen: leak.held_bytes}
    taken = [min(item.nbytes, take.get(item.key, 0)) for item in items]
    out = [BreakdownItem(item.key, item.label, item.nbytes - n) for item, n in zip(items, taken, strict=True)]
    moved = sum(taken)
    return (breakdown_item("leaked", moved, device), *out) if moved else items


def with_leak(breakdown: Breakdown, leak: LeakCause | None) -> Breakdown:
    """The breakdown with the leak attached, its bytes in a ``leaked`` item (so no suggestion counts
    them as activations), and the verdict "leak" when it is the cause."""
    if leak is None:
        return breakdown
    sentence = leak_sentence(leak, breakdown.total_bytes, breakdown.device)
    leak = dataclasses.replace(leak, summary=sentence)
    items = _move_to_leaked(breakdown.items, leak, breakdown.device)
    if not is_leak_the_cause(breakdown, leak):
        return dataclasses.replace(breakdown, items=items, leak=leak)
    why = sentence
    if breakdown.requested_bytes is not None:
        why += f", more than the {fmt(breakdown.requested_bytes)} request that failed"
    why += f". Memory at the OOM: {breakdown.verdict_why}"
    return dataclasses.replace(breakdown, items=items, leak=leak, verdict="leak", verdict_why=why)


def without_projection(finding: Finding) -> Finding:
    """The finding as a report of the OOM it foresaw shows it: that OOM has happened, so neither its
    summary nor its headline says when the memory would run out (the figures stay in its fields)."""
    summary_words, headline_words = projection_words(finding.steps_to_oom, finding.hours_to_oom)
    if summary_words is None:
        return finding
    return dataclasses.replace(
        finding, summary=finding.summary.replace(f", out of memory in {summary_words}", "", 1),
        headline=finding.headline.replace(f", out of memory in {headline_words}", "", 1))
