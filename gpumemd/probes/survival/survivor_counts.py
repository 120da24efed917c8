"""Long-lived tensors counted per group, exact by weak references: ``survivors.SurvivorTracker`` finds
the candidates at each scan, ``SurvivorCounts.count`` counts them, and a counted tensor's weakref
callback uncounts it when it dies. What a counted tensor costs (a weakref with five slots and a dict
entry; its group's key is shared) is paid for each one, so past ``PER_GROUP_PER_SCAN`` new members of
one group at a scan, a sample of them stands for the rest.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from gpumemd.records.device import Device

MAX_GROUPS = 256
"""Distinct (device, dtype, shape, graph) groups at most; further shapes share one overflow group."""

PER_GROUP_PER_SCAN = 16
"""New members of one group counted one by one at a scan at most; beyond that, evenly spaced ones (the
newest always among them) each stand for the unsampled members before it, so the group's count and
bytes are exact when counted. Why: a counted tensor costs a weakref with a callback, a dict entry and
the callback when it dies, and a healthy job that keeps its last 2,000 steps' 10 tensors in a
``deque(maxlen=2000)`` puts 500 through that at every 50-step scan, for ever: scans cost it 31.7 µs a
step of ~2.2 ms, 24.8 sampled (``benchmarks/bench_leak_tracking.py --leak-rate 10 --keep 2000``).
What it gives up: as sampled members die, the count falls by their weight (a churned group's count is
exact to within a few members' weight), and a view sampled out does not mark its base as counted."""

OVERFLOW = ("*", "*", (), False)
_SAMPLES = 4  # newest members kept (weakly) per group, for holder look-ups

# device name, dtype, shape, has grad_fn: strings while scanning (they hash in C); a group's
# ``device`` is the Device.
GroupKey = tuple[str, str, tuple[int, ...], bool]


class _Ref(weakref.ref[Any]):
    __slots__ = ("base", "key", "nbytes", "tid", "weight")
    key: GroupKey
    nbytes: int  # the bytes it stands for: its storage's, times ``weight``
    tid: int
    base: int  # id of the base tensor when this one is a view, else 0
    weight: int  # the tensors it stands for (``PER_GROUP_PER_SCAN``): itself and unsampled neighbours


@dataclass(frozen=True, slots=True)
class SurvivorGroup:
    key: GroupKey
    count: int
    nbytes: int

    @property
    def device(self) -> Device:
        return Device.parse(self.key[0])

    @property
    def graph(self) -> bool:
        return self.key[3]

    def describe(self) -> str:
        _, dtype, shape, graph = self.key
        if self.key == OVERFLOW:
            return "tensors of other shapes"
        text = f"{dtype}[{', '.join(str(d) for d in shape)}]"
        return text + " with grad_fn" if graph else text


class SurvivorCounts:
    """Counted tensors, per group; ``tracked`` (their number, the cap's measure) and ``capped`` (the cap
    was reached at least once: from then on every count is a lower bound, and one that stays flat
    says nothing)."""

    def __init__(self, max_tracked: int) -> None:
        self.max_tracked = max_tracked
        self.tracked = 0
        self.capped = False
        self.refs: dict[int, _Ref] = {}  # id of a counted tensor -> its ref (``id(t) in refs``: counted)
        self._counts: dict[GroupKey, int] = {}
        self._bytes: dict[GroupKey, int] = {}
        self._samples: dict[GroupKey, deque[_Ref]] = {}
        self._view_bases: dict[int, int] = {}  # id of a counted view's base -> views counted on it
        self._dtypes: dict[Any, str] = {}
        self._devices: dict[Any, str] = {}
        # One key object per group, shared by its tensors' refs (a fresh key tuple and shape tuple
        # per tensor were ~120 bytes each). Bounded: keys beyond ``max_groups`` become OVERFLOW.
        self._keys: dict[GroupKey, GroupKey] = {OVERFLOW: OVERFLOW}
        self.represented: set[int] = set()  # ids of members a sample stood for at the last ``count``
        # Keys and view bases read at the last ``describe`` (id -> (key, id of the base or 0)): a scan's
        # new tensors are described once, for the families and for their count at the next scan.
        self._described: dict[int, tuple[GroupKey, int]] = {}

    def clear(self) -> None:
        self.refs.clear()  # the weakrefs die with the dict: their callbacks never run
        self.tracked = 0
        self._described = {}
        self._view_bases.clear()
        self._counts.clear()
        self._bytes.clear()
        self._samples.clear()
        self._keys = {OVERFLOW: OVERFLOW}

    def groups(self) -> list[SurvivorGroup]:
        return [SurvivorGroup(k, c, self._bytes.get(k, 0)) for k, c in list(self._counts.items())]

    def total(self) -> tuple[int, dict[Device, int]]:
        """(tensors, bytes per device) of everything tracked."""
        by_name: dict[str, int] = {}
        for key, nbytes in list(self._bytes.items()):
            by_name[key[0]] = by_name.get(key[0], 0) + nbytes
        return self.tracked, {Device.parse(name): nbytes for name, nbytes in by_name.items()}

    def sample(self, key: GroupKey, *, oldest: bool = False) -> Any:
        """The newest live member of a group, or with ``oldest`` the first counted one still alive (one
        walk over every counted tensor: for a rare look past what a bounded container holds). A strong
        reference: the caller drops it soon."""
        refs = (r for r in self.refs.values() if r.key == key) if oldest else reversed(self._samples.get(key, ()))
        for ref in refs:
            obj = ref()
            if obj is not None:
                return obj
        return None

    def long_lived_graph_samples(self, limit: int) -> list[Any]:
        """The newest live members of the groups that have a ``grad_fn`` (strong references: drop
        them soon). An accumulator updated in place (``total += loss``) stays one long-lived tensor
        whose ``grad_fn`` changes every step: it is never a new tensor, so look at these too."""
        out: list[Any] = []
        for key, samples in list(self._samples.items()):
            if not key[3]:
                continue
            for ref in reversed(samples):
                t = ref()
                if t is not None:
                    out.append(t)
                    if len(out) >= limit:
                        return out
        return out

    def describe(self, tensors: list[Any]) -> list[tuple[Any, GroupKey]]:
        """Each new tensor with its group key (an exotic one left out), read now and kept for its count
        at the next scan: reading a tensor's attributes is most of what tracking a leak costs per
        tensor (~0.2 µs each warm, several times that once the job's steps have taken the cache), so
        each is read once. Only the last call's are kept."""
        described: dict[int, tuple[GroupKey, int]] = {}
        out = []
        for t in tensors:
            read = self._read(t)
            if read is not None:
                described[id(t)] = read
                out.append((t, read[0]))
        self._described = described
        return out

    def count(self, alive: list[Any], most: int | None, weights: list[int] | None = None) -> None:
        """Count the candidates still alive. A leak of one tensor a step puts every one of its tensors
        through here once, so this is the cost of tracking it, per leaked tensor: each torch attribute
        read costs ~0.1-0.5 µs, so a tensor ``describe`` read at the last scan is not read again, and a
        group's counts, bytes and samples are updated once per scan, not once per tensor. ``alive``: the
        candidates, not counted yet (the list is emptied). Past ``most`` new members of a group, a
        sample of them stands for the rest (``represented`` lists those; None: every one counted).
        ``weights``: the tensors each candidate stands for (``survivors._stratified``; None: 1 each)."""
        bases = self._view_bases
        described, self._described = self._described, {}
        # Each storage once: a view keeps its base tensor alive (``kept.append(out.detach()[:4])``
        # keeps the whole ``out.detach()``), so the base of a counted view is not counted itself:
        # the view is, and its holder is the container, not "no Python holder".
        keyed: list[tuple[Any, GroupKey, int, int]] = []
        for t, weight in zip(alive, weights or itertools.repeat(1), strict=False):  # weights: one per tensor
            known = described.get(id(t)) or self._read(t)
            if known is not None:
                keyed.append((t, *known, weight))
        alive.clear()
        described.clear()
        batch = {base for _, _, base, _ in keyed if base}
        members: dict[GroupKey, list[tuple[Any, int, int]]] = {}
        t = None
        for t, key, base, weight in keyed:
            if id(t) in bases or id(t) in batch:
                continue
            group = members.get(key)
            if group is None:
                members[key] = [(t, base, weight)]
            else:
                group.append((t, base, weight))
        del t
        keyed.clear()
        for key, group in members.items():
            counted = self._counted(group, most)
            if counted:
                self._add(key, counted)  # keyed before the group lets go of them: one may die now
            group.clear()
            if self.capped:
                break

    def _counted(self, group: list[tuple[Any, int, int]], most: int | None) -> list[_Ref]:
        """Refs for a scan's new members of one group (oldest first): all of them, or evenly spaced
        ones ending at the newest, each standing for the members since the one before it (and for
        what each of those stands for: its weight)."""
        refs, bases, died = self.refs, self._view_bases, self._died
        n = len(group)
        m = n if most is None else min(n, most)
        picks = [n - 1 - (i * n) // m for i in range(m - 1, -1, -1)]  # ascending, the newest last
        if m < n:
            chosen = set(picks)
            self.represented.update(id(group[i][0]) for i in range(n) if i not in chosen)
        stood_for = list(itertools.accumulate(w for _, _, w in group))
        out: list[_Ref] = []
        previous = -1
        for i in picks:
            if self.tracked >= self.max_tracked:
                self.capped = True
                break
            t, base, _ = group[i]
            try:
                nbytes = t.untyped_storage().nbytes()
            except Exception:  # noqa: BLE001 - an exotic tensor: not counted
                continue
            r = _Ref(t, died)
            r.weight = stood_for[i] - (stood_for[previous] if previous >= 0 else 0)
            previous = i
            r.nbytes, r.tid, r.base = nbytes * r.weight, id(t), base
            if r.base:
                bases[r.base] = bases.get(r.base, 0) + 1
                counted_base = refs.get(r.base)
                if counted_base is not None:  # counted at an earlier scan, before its view was seen
                    self._uncount(counted_base)
            refs[r.tid] = r
            self.tracked += r.weight
            out.append(r)
        return out

    def _add(self, key: GroupKey, group: list[_Ref]) -> None:
        """Count a scan's new members of one group (their refs already carry the described key)."""
        if key not in self._counts and len(self._counts) >= MAX_GROUPS:
            key = OVERFLOW
        key = self._keys.get(key) or self._intern(key)
        for r in group:
            r.key = key  # the interned key, shared (and OVERFLOW past the cap)
        self._counts[key] = self._counts.get(key, 0) + sum(r.weight for r in group)
        self._bytes[key] = self._bytes.get(key, 0) + sum(r.nbytes for r in group)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=_SAMPLES)
        samples.extend(group[-_SAMPLES:])

    def _intern(self, key: GroupKey) -> GroupKey:
        if len(self._keys) > 2 * MAX_GROUPS:  # groups that died and left their keys behind
            self._keys = {k: k for k in self._counts}
            self._keys[OVERFLOW] = OVERFLOW
        key = (key[0], key[1], tuple(key[2]), key[3])  # a plain tuple, not the torch.Size it was read as
        self._keys[key] = key
        return key

    def _read(self, t: Any) -> tuple[GroupKey, int] | None:
        """Its group key and the id of its base tensor (0 when it is no view); None for an exotic
        tensor, which is not counted."""
        try:
            base = t._base
            return self._key(t), id(base) if base is not None else 0
        except Exception:  # noqa: BLE001 - an exotic tensor: not counted
            return None

    def _key(self, t: Any) -> GroupKey:
        """Its group key, with the shape as torch gives it: a ``torch.Size`` hashes and compares as the
        tuple, and ``_intern`` keeps a plain tuple."""
        dev, dt = t.device, t.dtype
        device = self._devices.get(dev)
        if device is None:
            device = self._devices[dev] = str(dev)
        dtype = self._dtypes.get(dt)
        if dtype is None:
            dtype = self._dtypes[dt] = str(dt).removeprefix("torch.")
        return device, dtype, t.shape, t.grad_fn is not None

    def _died(self, ref: _Ref) -> None:
        if self.refs.get(ref.tid) is not ref:
            return  # uninstalled, uncounted as a view's base, or an id reused after a reset
        self._uncount(ref)

    def _uncount(self, ref: _Ref) -> None:
        del self.refs[ref.tid]
        self.tracked -= ref.weight
        if ref.base:
            n = self._view_bases.get(ref.base, 0) - 1
            if n > 0:
                self._view_bases[ref.base] = n
            else:
                self._view_bases.pop(ref.base, None)
        key = ref.key
        n = self._counts.get(key, 0) - ref.weight
        if n > 0:
            self._counts[key] = n
            self._bytes[key] = self._bytes.get(key, 0) - ref.nbytes
        else:
            self._counts.pop(key, None)
            self._bytes.pop(key, None)
            self._samples.pop(key, None)
