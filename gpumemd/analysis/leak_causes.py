"""One finding per cause: count series that grow together under one holder are one finding.

Pure (no torch, no I/O). The leak component builds one finding per (series, phase) as the detector
decides; several of them can be one cause in the user's code: a tensor and its labels appended
together (``history.append((logits, y))``: two groups of tensors, one list), or a kept exception's
frame (one group per local of the frame). Such groups are one finding when

- both are count series (``tensors{...}``: each tensor is in exactly one group, so their rates add
  up; bytes series of one device measure the same tensors twice and are never summed),
- on the same device and phase,
- under the same root: the holder path up to and including its first growing container, sizes left
  out ("`errors` in train() at train.py:40 → list" for "... → list of 40 items → [i].__traceback__ →
  frame step() → local `act`"), and
- at about the same rate (tensors/step within ``RATE_TOLERANCE`` of each other).

The merge is sticky, so a cause never flips between one finding and two from one evaluation to the
next: a finding joins a cause when it first appears and stays in it while it is a finding (cleared
included; a withdrawn finding leaves). A cause's key is the (series, phase) of the finding that
started it, so the same cause keeps its key. Its state: cleared once every member is cleared (said
once), confirmed once any member was confirmed (it never falls back to suspected while active),
else suspected. A cause of one finding is that finding, unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from gpumemd.analysis.holder_adds import common_metric, metric_owner
from gpumemd.analysis.leak_headline import shared_hops, short_path
from gpumemd.analysis.leak_wording import cause_finding
from gpumemd.records.findings import Finding

Key = tuple[str, str]
"""A finding's (series, phase); a cause is keyed by its first finding's."""

RATE_TOLERANCE = 0.25
"""Rates (tensors/step) within this share of the larger one are "about the same". Count series are
exact up to their sampling (a group appended once per step reads 1.0); one cause's groups differ
by what an append adds, not by how often."""

_SIZED = re.compile(r"^[\w.]+ of ([\d,]+) items?$")  # a container hop: "list of 1,204 items"
_ROOT_SHARE = 0.5  # a container at least this share of the path's largest one is the growing one


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """A finding in a cause: the cause's key, the root it was joined under, its rate then."""

    cause: Key
    root: str | None
    rate: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class Causes:
    """Which finding is in which cause (``members``) and the finding each cause publishes."""

    members: Mapping[Key, Member] = dataclasses.field(default_factory=dict)
    findings: Mapping[Key, Finding] = dataclasses.field(default_factory=dict)


NO_CAUSES = Causes()


def cause_root(holder: str | None) -> str | None:
    """The holder path up to and including its first growing container, without sizes, counts or
    a bare container at its end: "`history` in main() at train.py:5" for "`history` in main() at
    train.py:5 → list of 501 items → tuple of 2 items". The growing container is the first one at
    least half as large as the path's largest (a dict of 3 keys holding lists of 500 grows in its
    lists); a path without sized containers is its own root."""
    if not holder:
        return None
    hops = holder.split(" → ")
    owner = metric_owner(short_path(hops[0]))
    if owner is not None:  # a torchmetrics metric's states grow together: the metric is the root
        return owner
    sizes = [_size(hop) for hop in hops]
    largest = max((s for s in sizes if s is not None), default=None)
    end = len(hops)
    if largest is not None:
        end = next(i + 1 for i, s in enumerate(sizes) if s is not None and s >= _ROOT_SHARE * largest)
    return short_path(" → ".join(hops[:end])) or None


def merge_causes(findings: Mapping[Key, Finding], previous: Causes) -> Causes:
    """The causes of ``findings`` (per (series, phase), in the order they were first raised), given
    the causes of the previous evaluation; see the module docstring."""
    # the findings already in a cause stay there; new ones join one of them, or start their own
    members = {key: previous.members[key] for key in findings if key in previous.members}
    for key, finding in findings.items():
        if key not in members:
            members[key] = _join(key, finding, findings, members)
    grouped: dict[Key, list[Finding]] = {}
    for key, finding in findings.items():
        grouped.setdefault(members[key].cause, []).append(finding)
    out: dict[Key, Finding] = {}
    for cause, group in grouped.items():
        before = previous.findings.get(cause)
        out[cause] = group[0] if len(group) == 1 else cause_finding(
            group, state=_state(group, before), holder=_common_path(f.culprits[0].holder for f in group
                                                                   if f.culprits and f.culprits[0].holder))
    return Causes(members, out)


def state_changes(previous: Causes, now: Causes, changed: Sequence[Key]) -> list[Finding]:
    """The causes to report, in the order of ``changed`` (the findings whose state changed at this
    evaluation): those whose state is not the one they had (a second group joining a suspected
    cause, or one of two groups clearing, says nothing)."""
    out: dict[Key, Finding] = {}
    for key in changed:
        member = now.members.get(key)
        finding = now.findings.get(member.cause) if member is not None else None
        if member is None or finding is None or member.cause in out:
            continue
        before = previous.findings.get(member.cause)
        if before is None or before.state != finding.state:
            out[member.cause] = finding
    return list(out.values())


def newly_critical(now: Causes, said: AbstractSet[Key]) -> list[tuple[Key, Finding]]:
    """The active causes projected to run out of memory within a day (``severity`` "critical") of which
    no line has said so yet (``said``: the caller's, per episode). A CPU leak's projection can fall from
    days to minutes after its state change was said: host RSS grows with the tensors it keeps (far more
    than their own bytes, as the heap fragments), and that growth is stated once it is material. Only
    the state file and the exit line would tell the person who read "out of memory in ~75 days"."""
    return [(key, f) for key, f in now.findings.items()
            if f.state != "cleared" and f.severity == "critical" and key not in said]


def withdrawn(previous: Causes, now: Causes) -> list[Finding]:
    """The causes a person was told of (suspected or confirmed) that are gone now: a finding leaves only
    when withdrawn (another series accounts for its growth), and a cause goes with its last finding."""
    return [f for key, f in previous.findings.items() if key not in now.findings and f.state != "cleared"]


def accounting_for(finding: Finding, causes: Causes) -> Finding | None:
    """The active cause on the same device that most likely accounts for a withdrawn ``finding``'s
    growth: a confirmed one first, then the fastest."""
    live = [f for f in causes.findings.values() if f.state != "cleared" and f.device == finding.device]
    return max(live, key=lambda f: (f.state == "confirmed", f.slope_bytes_per_step), default=None)


def _join(key: Key, finding: Finding, findings: Mapping[Key, Finding], members: Mapping[Key, Member]) -> Member:
    """A new finding's membership: a cause with the same root at about the same rate, or its own."""
    rate = finding.tensors_per_step
    root = cause_root(finding.culprits[0].holder) if finding.culprits and rate is not None else None
    if root is not None and rate is not None and finding.state != "cleared":
        for other_key, other in members.items():
            mate = findings[other_key]
            if (other.root == root and other_key[1] == key[1] and mate.device == finding.device
                    and _close(rate, mate.tensors_per_step if mate.state != "cleared" else other.rate)):
                return Member(other.cause, root, rate)
    return Member(key, root, rate)


def _close(rate: float, other: float | None) -> bool:
    if other is None or rate <= 0 or other <= 0:
        return False
    return abs(rate - other) <= RATE_TOLERANCE * max(rate, other)


def _state(group: list[Finding], before: Finding | None) -> str:
    active = [f for f in group if f.state != "cleared"]
    if not active:
        return "cleared"
    was_confirmed = before is not None and before.state == "confirmed"
    return "confirmed" if was_confirmed or any(f.state == "confirmed" for f in active) else "suspected"


def _common_path(holders: Iterable[str]) -> str | None:
    """The hops the holders share from their start, sizes left out: "`errors` in f() at x.py:3 →
    list → [i].__traceback__ → frame g()" for two locals of one kept frame; or the metric whose states
    they are."""
    paths = [[short_path(hop) or hop for hop in h.split(" → ")] for h in holders]
    return " → ".join(shared_hops(paths)) or common_metric(path[0] for path in paths)


def _size(hop: str) -> int | None:
    match = _SIZED.match(hop)
    return int(match.group(1).replace(",", "")) if match else None
