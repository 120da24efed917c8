"""A tensor census: every live storage counted once, grouped, classified and named.

Pure data and arithmetic (no torch): the census probe builds these, the leak detector and the OOM
report read them, and ``Census.diff`` is what names the culprits of a leak.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpumemd.records.device import Device

CATEGORIES: tuple[str, ...] = ("parameter", "gradient", "optimizer_state", "buffer", "graph", "other")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One storage (views of it are folded in), as it appears in the ranked tensor list."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    device: Device
    category: str
    name: str | None = None
    holder: str | None = None
    graph_bytes: int = 0  # bytes of autograd graph this tensor keeps alive (category "graph")


@dataclass(frozen=True, slots=True)
class GroupKey:
    device: Device
    dtype: str
    shape: tuple[int, ...]
    category: str
    name: str | None  # a parameter/buffer/optimizer-state name, or None for anonymous tensors


@dataclass(frozen=True, slots=True)
class CensusGroup:
    key: GroupKey
    count: int
    nbytes: int
    graph_bytes: int = 0
    holder: str | None = None  # who holds a sample of the group, when it was looked up


@dataclass(frozen=True, slots=True)
class GroupDelta:
    """How one group changed between two censuses (``Census.diff``)."""

    key: GroupKey
    count_delta: int
    bytes_delta: int
    graph_bytes_delta: int = 0
    holder: str | None = None

    @property
    def device(self) -> Device:
        return self.key.device


@dataclass(frozen=True, slots=True)
class Census:
    """The result of one census pass."""

    step: int | None
    taken_at: float
    duration_s: float
    groups: tuple[CensusGroup, ...]
    largest: tuple[TensorEntry, ...] = ()
    objects_scanned: int = 0
    invisible_bytes_by_device: Mapping[Device, int] = field(default_factory=dict)
    graph_truncated: bool = False  # the graph walk hit its node bound: graph bytes are a lower bound
    errors: int = 0  # tensors the census could not read (skipped, never raised)

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups) + self.graph_retained_bytes

    @property
    def graph_retained_bytes(self) -> int:
        """Bytes kept alive by live autograd graphs, beyond the gc-visible tensors themselves."""
        return sum(g.graph_bytes for g in self.groups)

    @property
    def tensor_count(self) -> int:
        return sum(g.count for g in self.groups)

    def bytes_by_category(self) -> dict[str, int]:
        """All six categories, always; graph-retained bytes count towards ``graph``."""
        return category_bytes(self.groups)

    def count_by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for g in self.groups:
            out[g.key.category] = out.get(g.key.category, 0) + g.count
        return out

    def bytes_by_device(self) -> dict[Device, int]:
        out: dict[Device, int] = {}
        for g in self.groups:
            out[g.key.device] = out.get(g.key.device, 0) + g.nbytes + g.graph_bytes
        return out

    def groups_named(self, name: str) -> list[CensusGroup]:
        """The groups whose name is ``name`` (one per device/dtype/shape it appears with)."""
        return [g for g in self.groups if g.key.name == name]

    def top(self, n: int = 20) -> list[TensorEntry]:
        """The ``n`` largest storages, largest first."""
        return sorted(self.largest, key=lambda e: e.nbytes + e.graph_bytes, reverse=True)[:n]

    def diff(self, earlier: Census) -> list[GroupDelta]:
        """Groups that grew or appeared since ``earlier``, largest byte growth first."""
        before = {g.key: g for g in earlier.groups}
        deltas: list[GroupDelta] = []
        for g in self.groups:
            old = before.get(g.key)
            count_delta = g.count - (old.count if old else 0)
            bytes_delta = g.nbytes - (old.nbytes if old else 0)
            graph_delta = g.graph_bytes - (old.graph_bytes if old else 0)
            if count_delta > 0 or bytes_delta + graph_delta > 0:
                deltas.append(GroupDelta(g.key, count_delta, bytes_delta, graph_delta, g.holder))
        deltas.sort(key=lambda d: (d.bytes_delta + d.graph_bytes_delta, d.count_delta), reverse=True)
        return deltas


def category_bytes(groups: Iterable[CensusGroup]) -> dict[str, int]:
    """Storage bytes of ``groups`` per category, all six always; graph-retained bytes count towards ``graph``."""
    out = dict.fromkeys(CATEGORIES, 0)
    for g in groups:
        out[g.key.category] = out.get(g.key.category, 0) + g.nbytes
        out["graph"] += g.graph_bytes
    return out
