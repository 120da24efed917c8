"""Tensors that grow by being replaced: the largest new tensor of each family at every survivor scan.

Why: ``all_logits = torch.cat([all_logits, out.detach()])`` keeps one tensor alive at any time,
but a new one each step, one batch larger. The survivor tracker never counts it (each dies within
a step: the count of long-lived tensors stays flat) and each step's tensor has a new shape (a new
group). What stays the same is its *family*: device, dtype, the dimensions after the first, and
whether it has a ``grad_fn``. At each survivor scan the tracker has already listed the young
tensors (made since the last scan and alive now); this probe takes the largest of each family
among them, by its leading dimension, so one series per family says how large the newest member
is. A family is worth a series once its largest member has set a new record at ``RECORDS_TO_WATCH``
scans and at least doubled: a batch of variable size sets a few records, then stops; an
accumulation sets one at every scan.

Cost: none per tensor beyond the survivor tracker's (the group key it reads of each new tensor, for
its count at the next scan, is the family's too), on scan steps only. Memory: ``MAX_FAMILIES``
families, ``PAST`` points each, one weak reference each.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import weakref
from collections.abc import Iterable
from typing import Any

from gpumemd.probes.survival.survivor_counts import GroupKey
from gpumemd.records.device import Device

MAX_FAMILIES = 128
"""Families remembered at most; the one seen least recently goes first."""

PAST = 48
"""Scans whose largest member is kept per family (to start its series with its past)."""

RECORDS_TO_WATCH = 8
"""New records of a family's largest member before it is worth a series."""

GROWTH_TO_WATCH = 2.0
"""... and by how much its largest member must have grown since first seen."""

# device name, dtype, dimensions after the first, has grad_fn
FamilyKey = tuple[str, str, tuple[int, ...], bool]


@dataclasses.dataclass(slots=True)
class Family:
    """One family's state: its largest member at the last scans, its records, a weak sample."""

    key: FamilyKey
    row_bytes: int  # bytes per unit of the leading dimension
    first_rows: int
    best_rows: int = 0  # the all-time record
    records: int = 0
    rows: int = 0  # the largest member at the newest scan it was seen in
    step: int = 0
    past: collections.deque[tuple[int, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=PAST))
    sample: weakref.ref[Any] | None = None

    @property
    def device(self) -> Device:
        return Device.parse(self.key[0])

    @property
    def watched(self) -> bool:
        return self.records >= RECORDS_TO_WATCH and self.best_rows >= GROWTH_TO_WATCH * max(1, self.first_rows)

    def describe(self) -> str:
        """``float32[N, 10]``: the family, its leading dimension named."""
        _, dtype, trailing, graph = self.key
        text = f"{dtype}[{', '.join(['N', *(str(d) for d in trailing)])}]"
        return text + " with grad_fn" if graph else text


class TensorFamilies:
    """The largest new member of each family, per scan; see the module docstring."""

    def __init__(self, *, max_families: int = MAX_FAMILIES) -> None:
        self._max = max_families
        self._families: collections.OrderedDict[FamilyKey, Family] = collections.OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes per element, per dtype
        self.records = 0  # records set by any family (a member larger than every one before), in all

    def get(self, key: FamilyKey) -> Family | None:
        return self._families.get(key)

    def sample(self, key: FamilyKey) -> Any:
        """The newest largest member of a family, if alive (a strong reference: drop it soon)."""
        family = self._families.get(key)
        return family.sample() if family is not None and family.sample is not None else None

    def observe(self, tensors: Iterable[tuple[Any, GroupKey]], step: int) -> list[Family]:
        """Take the largest member of each family among ``tensors`` (the scan's new, live tensors, each
        with its survivor group key, read once for both: ``SurvivorTracker.new_tensors``) at ``step``;
        returns the families seen at this scan."""
        largest: dict[tuple[str, str, Any, bool], tuple[int, Any]] = {}
        for t, (device, dtype, shape, graph) in tensors:
            if not shape:
                continue
            key = (device, dtype, shape[1:], graph)
            rows = shape[0]
            seen = largest.get(key)
            if seen is None or rows > seen[0]:
                largest[key] = (rows, t)
        seen_now = []
        for (device, dtype, trailing, graph), (rows, t) in largest.items():
            try:
                size = self._sizes.get(dtype)
                if size is None:
                    size = self._sizes[dtype] = t.element_size()
            except Exception:  # noqa: BLE001
                continue
            dims = tuple(trailing)
            seen_now.append(self._update((device, dtype, dims, graph), rows, size * math.prod(dims), t, step))
        largest.clear()
        return seen_now

    def _update(self, key: FamilyKey, rows: int, row_bytes: int, t: Any, step: int) -> Family:
        family = self._families.get(key)
        if family is None:
            family = Family(key, row_bytes, first_rows=rows, best_rows=rows)
            self._families[key] = family
            if len(self._families) > self._max:
                self._families.popitem(last=False)
        else:
            self._families.move_to_end(key)
            if rows > family.best_rows:
                family.best_rows = rows
                family.records += 1
                self.records += 1
        family.rows, family.step = rows, step
        family.past.append((step, rows))
        try:
            family.sample = weakref.ref(t)
        except TypeError:
            family.sample = None
        return family

    def clear(self) -> None:
        self._families.clear()
