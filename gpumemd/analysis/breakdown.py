"""Where the failing device's memory went at the OOM, and whether a leak, fragmentation or capacity is to blame.

Pure: every input is a record. Precedence for each number, most exact first: the allocator snapshot
taken inside the OOM observer, the observer's arguments, the OOM message, the last allocator sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gpumemd.analysis.headroom import cap_from_observer, reservable_bytes
from gpumemd.analysis.units import format_bytes
from gpumemd.records.census import Census, CensusGroup, GroupKey
from gpumemd.records.findings import Culprit, Finding
from gpumemd.records.oom import (
    Breakdown,
    BreakdownItem,
    LeakCause,
    ObserverCall,
    OomMessage,
    SnapshotSummary,
    breakdown_label,
)
from gpumemd.records.samples import AllocatorSample, HostSample

# Census category -> breakdown key.
CATEGORY_KEYS: dict[str, str] = {
    "parameter": "parameters",
    "gradient": "gradients",
    "optimizer_state": "optimizer_state",
    "buffer": "buffers",
    "graph": "graph_retained",
    "other": "other",
}


def _item(key: str, nbytes: int, device: str) -> BreakdownItem:
    return BreakdownItem(key, breakdown_label(key, device), nbytes)


def normalize_device(device: str) -> str:
    """``"cuda"`` -> ``"cuda:0"``; other strings unchanged."""
    return "cuda:0" if device == "cuda" else device


def census_bytes_on(census: Census | None, device: str) -> dict[str, int]:
    """Census bytes per category on one device; graph-retained bytes count towards ``graph``."""
    out = dict.fromkeys(CATEGORY_KEYS, 0)
    if census is None:
        return out
    device = normalize_device(device)
    for group in census.groups:
        if normalize_device(group.key.device) != device:
            continue
        out[group.key.category] = out.get(group.key.category, 0) + group.nbytes
        out["graph"] += group.graph_bytes
    return out


def fmt(n: int | None) -> str:
    """Bytes in verdicts and suggestions: ``8388608`` -> ``"8.00 MiB"``."""
    return format_bytes(n, digits=2, missing="unknown")


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


@dataclasses.dataclass(frozen=True)
class _Limits:
    """What bounded the failing device at the OOM: its total, the per-process cap and the room left."""

    device_total: int | None
    cap: int | None  # set_per_process_memory_fraction's cap; None: no cap known
    fraction: float | None
    device_free: int | None  # the driver's free memory, device-wide
    headroom: int | None  # what the allocator could still reserve: min(device_free, cap - reserved)

    @property
    def total(self) -> int | None:
        """What the breakdown is measured against: the cap when one is set (the job could use no more)."""
        return self.cap if self.cap is not None else self.device_total


def cap_words(cap: int, fraction: float | None) -> str:
    """"the process cap of 12.00 GiB (fraction 0.50)": a verdict's words for the cap."""
    return f"the process cap of {fmt(cap)}" + (f" (fraction {fraction:.2f})" if fraction is not None else "")


def _limits(msg: OomMessage, *, observer: ObserverCall | None, allocator: AllocatorSample | None,
            snapshot: SnapshotSummary | None, nvml_total_bytes: int | None, reserved: int | None) -> _Limits:
    """Tell the cap from the device total. The message says both ("total capacity", "X allowed;"); the
    observer's third argument is the cap when one is set and the total otherwise; the allocator sample
    carries the fraction gpumemd read from torch; NVML knows the total."""
    obs_total = observer.total_or_cap_bytes if observer else None
    known_total = _first(msg.total_bytes, nvml_total_bytes)
    sampled_cap = allocator.cap_bytes if allocator else None
    # A fraction read from torch says whether a cap is set; without one, the observer's figure may.
    read = allocator is not None and allocator.memory_fraction is not None
    cap = _first(msg.allowed_bytes, sampled_cap, None if read else cap_from_observer(obs_total, known_total))
    device_total = _first(msg.total_bytes, obs_total if cap is None else None, nvml_total_bytes)
    fraction = allocator.memory_fraction if allocator is not None and sampled_cap is not None else None
    if cap is not None and fraction is None and device_total:
        fraction = cap / device_total
    device_free = _first(observer.device_free_bytes if observer else None, msg.free_bytes,
                         snapshot.oom_device_free_bytes if snapshot else None)
    return _Limits(device_total=device_total, cap=cap, fraction=fraction, device_free=device_free,
                   headroom=reservable_bytes(device_free, reserved, cap))


def _room_items(limits: _Limits, reserved: int | None, name: str) -> tuple[list[BreakdownItem], int | None]:
    """The items after PyTorch's own, and the memory outside PyTorch. Without a cap: outside PyTorch
    (device total - reserved - free: the context, NCCL, other processes) and free, which with PyTorch's
    items make up the device. Under a cap: only the headroom left under it, so that the items partition
    the cap; memory outside PyTorch does not count against the cap and is reported beside it."""
    non_pytorch = None
    if limits.device_total is not None and reserved is not None and limits.device_free is not None:
        non_pytorch = max(0, limits.device_total - reserved - limits.device_free)
    items = []
    if limits.cap is not None:
        if limits.headroom is not None:
            items.append(_item("headroom", limits.headroom, name))
        return items, non_pytorch
    if non_pytorch is not None:
        items.append(_item("non_pytorch", non_pytorch, name))
    if limits.device_free is not None:
        items.append(_item("free", limits.device_free, name))
    return items, non_pytorch


def cuda_breakdown(
    *,
    device: int,
    message: OomMessage | None = None,
    observer: ObserverCall | None = None,
    snapshot: SnapshotSummary | None = None,
    allocator: AllocatorSample | None = None,
    census: Census | None = None,
    nvml_total_bytes: int | None = None,
) -> Breakdown:
    """The breakdown of ``cuda:<device>`` against its total (or its per-process cap)."""
    msg = message or OomMessage(kind="cuda", format="unparsed")
    requested = _first(observer.requested_bytes if observer else None, msg.requested_bytes,
                       snapshot.oom_requested_bytes if snapshot else None)
    allocated = _first(snapshot.allocated_bytes if snapshot else None, msg.allocated_bytes,
                       allocator.allocated_bytes if allocator else None)
    reserved = _first(snapshot.reserved_bytes if snapshot else None, msg.reserved_bytes,
                      allocator.reserved_bytes if allocator else None)
    limits = _limits(msg, observer=observer, allocator=allocator, snapshot=snapshot,
                     nvml_total_bytes=nvml_total_bytes, reserved=reserved)
    largest = snapshot.largest_free_block_bytes if snapshot else None
    name = f"cuda:{device}"
    by_cat = census_bytes_on(census, name)
    items = [_item(key, by_cat[cat], name) for cat, key in CATEGORY_KEYS.items()]
    seen = sum(by_cat.values())
    if allocated is not None and census is None:
        items.append(_item("unattributed", allocated, name))
    elif allocated is not None:
        # Saved activations live in C++ (autograd), not in gc-visible tensors: allocated minus what
        # the census saw is, mid-step, mostly activations.
        items.append(_item("invisible", max(0, allocated - seen), name))
    if reserved is not None and allocated is not None:
        items.append(_item("reserved_unallocated", max(0, reserved - allocated), name))
    room, non_pytorch = _room_items(limits, reserved, name)
    items += room
    verdict, why = _cuda_verdict(requested=requested, allocated=allocated, reserved=reserved, limits=limits,
                                 largest=largest)
    return Breakdown(
        device=f"cuda:{device}", total_bytes=limits.total, items=tuple(items), requested_bytes=requested,
        allocated_bytes=allocated, reserved_bytes=reserved, largest_free_block_bytes=largest,
        device_free_bytes=limits.device_free, verdict=verdict, verdict_why=why, cap_bytes=limits.cap,
        memory_fraction=limits.fraction, device_total_bytes=limits.device_total, headroom_bytes=limits.headroom,
        non_pytorch_bytes=non_pytorch,
    )


def _cuda_verdict(
    *,
    requested: int | None,
    allocated: int | None,
    reserved: int | None,
    limits: _Limits,
    largest: int | None,
) -> tuple[str, str]:
    if requested is None:
        return "unknown", "the request size is unknown (no observer call, no parsable message)"
    cap, total = limits.cap, limits.device_total
    if cap is not None and requested > cap:
        return ("request_exceeds_device",
                f"one request of {fmt(requested)} is larger than {cap_words(cap, limits.fraction)} "
                "(set_per_process_memory_fraction): a size or shape bug, or a cap set too low")
    if total is not None and requested > total:
        return ("request_exceeds_device",
                f"one request of {fmt(requested)} is larger than the whole device ({fmt(total)}): "
                "a size or shape bug, not memory pressure")
    if allocated is None or reserved is None:
        return "unknown", "the allocator's state at the OOM is unknown"
    cached_free = max(0, reserved - allocated)
    room = limits.headroom or 0
    free_total = cached_free + room
    where = "on the device" if cap is None else f"left under {cap_words(cap, limits.fraction)}"
    if free_total >= requested and room < requested:
        biggest = fmt(largest)
        return ("fragmentation",
                f"{fmt(free_total)} was free ({fmt(cached_free)} cached by PyTorch + {fmt(room)} {where}), "
                f"more than the {fmt(requested)} requested, but the largest free block was {biggest}: "
                "the free memory was in pieces")
    bound = "" if cap is None else (f" under {cap_words(cap, limits.fraction)}, with "
                                    f"{fmt(limits.device_free)} free on the device")
    return ("capacity",
            f"the job needed {fmt(requested)} more with {fmt(allocated)} already allocated and only "
            f"{fmt(free_total)} free in all{bound}: the working set does not fit")


def cpu_breakdown(
    *,
    message: OomMessage | None = None,
    host: HostSample | None = None,
    census: Census | None = None,
) -> Breakdown:
    """The breakdown of host memory at a CPU allocation failure."""
    requested = message.requested_bytes if message else None
    total = host.total_bytes if host else None
    available = host.available_bytes if host else None
    rss = host.rss_bytes if host else None
    by_cat = census_bytes_on(census, "cpu")
    items = [_item(key, by_cat[cat], "cpu") for cat, key in CATEGORY_KEYS.items()]
    seen = sum(by_cat.values())
    if rss is not None:
        items.append(_item("process_other", max(0, rss - seen), "cpu"))
    if total is not None and available is not None and rss is not None:
        items.append(_item("non_pytorch", max(0, total - available - rss), "cpu"))
    if available is not None:
        items.append(_item("free", available, "cpu"))
    if requested is not None and total is not None and requested > total:
        verdict, why = ("request_exceeds_device",
                        f"one request of {fmt(requested)} is larger than the host's {fmt(total)} of RAM: "
                        "a size or shape bug, not memory pressure")
    elif requested is not None and available is not None and requested > available:
        verdict, why = ("capacity", f"the request of {fmt(requested)} exceeds the {fmt(available)} available")
    else:
        verdict, why = "unknown", "the host had room by its own account (overcommit limits or cgroup caps?)"
    return Breakdown(
        device="cpu", total_bytes=total, items=tuple(items), requested_bytes=requested,
        allocated_bytes=rss, reserved_bytes=None, largest_free_block_bytes=None,
        device_free_bytes=available, verdict=verdict, verdict_why=why,
    )


# --- the leak at the OOM -------------------------------------------------------------------------
# A leak finding says what grew while the job ran; the census taken at the OOM says what that
# holder held when the device ran out. Both together let the verdict name the cause, and keep the
# leak's autograd graphs out of the "activations" that the suggestions size their advice on.

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


def describe_key(dtype: str, shape: tuple[int, ...] | list[int], category: str, name: str | None) -> str:
    """``float32[512, 1024]``, ``float32[] with grad_fn``, ``fc.bias float32[8] (parameter)``: the
    words leak culprits use for a census group (``leak_wording.describe_group``), so they match."""
    text = f"{dtype.removeprefix('torch.')}[{', '.join(str(d) for d in shape)}]"
    if category == "graph":
        text += " with grad_fn"
    elif category != "other":
        text += f" ({category})"
    return f"{name} {text}" if name else text


def _series_device(series: str) -> str | None:
    """``tensors{device=cpu,group=...}`` -> "cpu"; ``allocated_bytes{device=0}`` -> "cuda:0"."""
    at = series.find("device=")
    if at < 0:
        return "cpu" if series.startswith("host") else None
    value = series[at + len("device="):].split(",", 1)[0].split("}", 1)[0]
    return f"cuda:{value}" if value.isdigit() else normalize_device(value)


def _series_group(series: str) -> str | None:
    """The group a per-group count series follows: ``tensors{device=cpu,group=float32[4, 8]}``."""
    at = series.find("group=")
    return series[at + len("group="):].removesuffix("}") if at >= 0 else None


def finding_device(finding: Finding) -> str | None:
    """The device whose memory a finding is about (None: not said)."""
    if finding.device is not None:
        return f"cuda:{finding.device}"
    if finding.kind == "host_leak":
        return "cpu"
    return _series_device(finding.series)


def _matching_groups(census: Census, finding: Finding, device: str) -> list[CensusGroup]:
    """The census groups on ``device`` the finding's culprits name: by holder (every group the same
    variable keeps, its graphs' saved tensors included), else by the culprit's group."""
    roots = {holder_root(c.holder) for c in finding.culprits} - {None}
    names = {holder_variable(c.holder) for c in finding.culprits} - {None}
    wanted = {c.description for c in finding.culprits}
    group = _series_group(finding.series)
    if group is not None:
        wanted.add(group)
    out = []
    for g in census.groups:
        if normalize_device(g.key.device) != device:
            continue
        by_holder = holder_root(g.holder) in roots or holder_variable(g.holder) in names
        by_group = describe_key(g.key.dtype, g.key.shape, g.key.category, g.key.name) in wanted
        if by_holder or (by_group and g.key.category not in _MODEL_STATE):
            out.append(g)
    return out


def _by_category(groups: list[CensusGroup]) -> tuple[tuple[str, int], ...]:
    out: dict[str, int] = {}
    for g in groups:
        out[g.key.category] = out.get(g.key.category, 0) + g.nbytes
        if g.graph_bytes:
            out["graph"] = out.get("graph", 0) + g.graph_bytes
    return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class _Held:
    """What the leaking groups held at the OOM (the LeakCause fields the census decides)."""

    held_bytes: int
    graph_bytes: int
    tensor_count: int
    description: str
    groups: int
    bytes_by_category: tuple[tuple[str, int], ...]
    holder_detail: str | None
    group_keys: tuple[GroupKey, ...] = ()


def _held_by(groups: list[CensusGroup], holder: str | None) -> _Held:
    largest = max(groups, key=lambda g: g.nbytes + g.graph_bytes)
    by_cat = _by_category(groups)
    holder = holder or next((g.holder for g in sorted(groups, key=lambda g: -g.nbytes) if g.holder), None)
    return _Held(
        held_bytes=sum(g.nbytes + g.graph_bytes for g in groups), graph_bytes=dict(by_cat).get("graph", 0),
        tensor_count=sum(g.count for g in groups),
        description=describe_key(largest.key.dtype, largest.key.shape, largest.key.category, largest.key.name),
        groups=len(groups), bytes_by_category=by_cat, holder_detail=holder,
        group_keys=tuple(g.key for g in sorted(groups, key=lambda g: g.nbytes + g.graph_bytes, reverse=True)),
    )


def _held_per_finding(finding: Finding, culprit: Culprit | None) -> _Held:
    """No census at the OOM, or it did not see the leak (host objects): the finding's own growth."""
    grown = max(0, finding.growth_bytes)
    category = "graph" if finding.kind == "graph_leak" else (culprit.category if culprit else None) or "other"
    return _Held(
        held_bytes=grown, graph_bytes=grown if category == "graph" else 0,
        tensor_count=sum(max(0, c.count_delta) for c in finding.culprits),
        description=culprit.description if culprit else (_series_group(finding.series) or finding.series),
        groups=0, bytes_by_category=((category, grown),), holder_detail=culprit.holder if culprit else None,
    )


def _cause(held: _Held, **fields: Any) -> LeakCause:
    return LeakCause(
        holder=holder_name(held.holder_detail) or f"{held.description} tensors", held_bytes=held.held_bytes,
        graph_bytes=held.graph_bytes, tensor_count=held.tensor_count, description=held.description,
        groups=held.groups, bytes_by_category=held.bytes_by_category, holder_detail=held.holder_detail,
        group_keys=held.group_keys, **fields,
    )


def leak_from_finding(finding: Finding, census: Census | None, device: str) -> LeakCause | None:
    """What an active leak finding about ``device`` held at the OOM, or None (cleared, other device)."""
    if finding.state not in _ACTIVE_STATES:
        return None
    where = finding_device(finding)
    if where is not None and where != device:
        return None  # a host leak does not fill a GPU, nor one GPU's leak another
    culprit = next((c for c in finding.culprits if c.holder), finding.culprits[0] if finding.culprits else None)
    groups = _matching_groups(census, finding, device) if census is not None else []
    held = _held_by(groups, culprit.holder if culprit else None) if groups else _held_per_finding(finding, culprit)
    return _cause(held, source="finding", kind=finding.kind, state=finding.state,
                  slope_bytes_per_step=finding.slope_bytes_per_step, onset_step=finding.onset_step,
                  series=finding.series, estimated=not groups)


def leak_from_census(census: Census | None, before: Census | None, device: str) -> LeakCause | None:
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
             if g.holder and normalize_device(g.key.device) == device and g.key.category not in _MODEL_STATE
             and g.key in old and old[g.key].count >= 2 and g.count > old[g.key].count and growth(g) > 0]
    if not grown:
        return None
    top = max(grown, key=growth)
    kind = "graph_leak" if top.key.category == "graph" else "tensor_leak"
    return _cause(_held_by([top], top.holder), source="census", kind=kind, state="grew",
                  slope_bytes_per_step=growth(top) / max(1, census.step - before.step), onset_step=before.step)


def leak_at_oom(
    *, findings: Sequence[Finding], census: Census | None, census_before: Census | None, device: str,
) -> LeakCause | None:
    """The active leak that held the most on ``device`` at the OOM: from the findings, else from the
    growth between the last census and the OOM's."""
    device = normalize_device(device)
    leaks = [leak for f in findings if (leak := leak_from_finding(f, census, device)) is not None]
    if leaks:
        return max(leaks, key=lambda leak: (leak.held_bytes, leak.state == "confirmed"))
    return leak_from_census(census, census_before, device)


def _kind_words(leak: LeakCause) -> str:
    kind = {"tensor_leak": "tensor leak", "graph_leak": "leak of autograd graphs",
            "host_leak": "host memory leak"}.get(leak.kind, leak.kind.replace("_", " "))
    if leak.source == "census":
        return f"{kind} seen between censuses"
    return f"{leak.state} {kind}"


def leak_sentence(leak: LeakCause, total: int | None, device: str) -> str:
    """"`kept` grew ~2.00 MiB/step since step 60 and held 1.50 GiB of the host's 23.54 GiB at the OOM
    (770 × float32[512, 1024]; confirmed tensor leak)"."""
    text = leak.holder
    if leak.slope_bytes_per_step and leak.slope_bytes_per_step > 0:
        text += f" grew ~{fmt(round(leak.slope_bytes_per_step))}/step"
    else:
        text += " grew"
    if leak.onset_step is not None:
        text += f" since step {leak.onset_step}"
    whose = "the host's" if device == "cpu" else f"{device}'s"
    of_total = f" of {whose} {fmt(total)}" if total else ""
    held = f"by then at least {fmt(leak.held_bytes)}" if leak.estimated else f"{fmt(leak.held_bytes)}"
    text += f" and held {held}{of_total} at the OOM"
    if leak.groups > 1:
        what = f"{leak.tensor_count:,} tensors in {leak.groups} groups, the largest {leak.description}"
    else:
        what = f"{leak.tensor_count:,} × {leak.description}" if leak.tensor_count else leak.description
    return f"{text} ({what}; {_kind_words(leak)})"


def is_leak_the_cause(breakdown: Breakdown, leak: LeakCause) -> bool:
    """The device was full (capacity) or hit a limit it did not report (unknown), and the leak held
    more than the request that failed: without it, that request would have had room. A request larger
    than the device, or free memory in pieces, is a cause of its own, whatever leaks."""
    if breakdown.verdict not in ("capacity", "unknown"):
        return False
    floor = max(2**20, int(0.01 * (breakdown.total_bytes or 0)))
    return leak.held_bytes >= max(breakdown.requested_bytes or 0, floor)


def _move_to_leaked(items: tuple[BreakdownItem, ...], leak: LeakCause, device: str) -> tuple[BreakdownItem, ...]:
    """The leak's bytes out of the items the census put them in, into one ``leaked`` item first.
    Bytes the census did not see (an estimated leak) come out of ``invisible`` when it has them."""
    take: dict[str, int] = {}
    for category, n in leak.bytes_by_category:
        key = CATEGORY_KEYS.get(category, "other")
        take[key] = take.get(key, 0) + n
    if leak.estimated:  # the census did not see it: it is in what the census cannot see
        take = {"process_other" if device == "cpu" else "invisible": leak.held_bytes}
    out = []
    moved = 0
    for item in items:
        n = min(item.nbytes, take.get(item.key, 0))
        moved += n
        out.append(BreakdownItem(item.key, item.label, item.nbytes - n))
    return (_item("leaked", moved, device), *out) if moved else items


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
