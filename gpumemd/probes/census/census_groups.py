"""The storages one census counted, and what it reports of them: groups, the largest, the invisible.

The census pass makes one ``StorageRecord`` per storage (classified and named, with the graph
bytes charged to it); everything here reads those records and knows nothing of how they were found.
A record describes its storage when it is made (device, dtype, shape of the tensor that represents
it) and holds that tensor only weakly: a census spread over several step ends (``probes.census.census_steps``)
must not keep a step's tensors alive into the next one. Grouping is incremental for the same reason:
``Grouping.add`` takes the records a slice at a time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from gpumemd.records.census import CensusGroup, GroupKey, TensorEntry
from gpumemd.records.device import Device
from gpumemd.records.samples import AllocatorSample

if TYPE_CHECKING:
    import torch

    from gpumemd.probes.heap.storages import Storages

# (device name, dtype, shape, category, name) while aggregating: plain tuples of strings hash and
# compare in C, the GroupKey and Device dataclasses' __hash__/__eq__ run in Python. Records get the
# Device once per group.
_Key: TypeAlias = "tuple[str, str, tuple[int, ...], str, str | None]"
TensorRef: TypeAlias = "Callable[[], torch.Tensor | None]"
"""How a record holds its tensor: a weak reference (``probes.heap.stepwise.hold_weakly``)."""


class StorageRecord:
    """One storage (or the component storages of one sparse/wrapper tensor) during a census."""

    __slots__ = ("category", "device", "dtype", "graph_bytes", "kept_by", "name", "nbytes", "ref", "shape")

    def __init__(self, nbytes: int, category: str, name: str | None, ref: TensorRef,  # noqa: PLR0917 - one per storage, in the hot loop
                 device: Any, dtype: Any, shape: Any) -> None:
        self.nbytes = nbytes
        self.category = category
        self.name = name
        self.ref = ref  # the representative, held weakly: its shape/dtype/device describe the storage
        self.device = device  # a torch.device, or None when the representative could not be read
        self.dtype = dtype  # a torch.dtype, or None
        self.shape = shape  # a torch.Size (hashes like the tuple it is), or ()
        self.graph_bytes = 0
        self.kept_by: StorageRecord | None = None  # the graph-keeping tensor whose autograd graph saves this

    def represent(self, t: torch.Tensor, ref: TensorRef) -> None:
        """Make ``t`` (held by ``ref``) the representative: a better name or a base for a view."""
        self.ref = ref
        self.device, self.dtype, self.shape = describe(t)


def describe(t: torch.Tensor) -> tuple[Any, Any, Any]:
    """(device, dtype, shape) of ``t``, None/() for what cannot be read (nested tensors have no sizes())."""
    device = dtype = None
    shape: Any = ()
    try:
        device = t.device
        dtype = t.dtype
        shape = t.shape
    except Exception:  # noqa: BLE001 - keep what was read
        pass
    return device, dtype, shape


class Grouping:
    """Groups, the largest storages and the invisible bytes of one census's records, folded in a
    slice at a time (``add``) and read at the end (``finish``)."""

    def __init__(self, storages: Storages, largest: int) -> None:
        self.storages = storages
        self.dtypes: dict[torch.dtype, str] = {}
        self.acc: dict[_Key, _Group] = {}
        self.visible: dict[str, int] = {}  # device name -> the bytes of its counted storages
        self.top: list[StorageRecord] = []
        self.n_largest = largest

    def add(self, records: Sequence[StorageRecord]) -> None:
        acc, visible = self.acc, self.visible
        devices, dtypes = self.storages.devices, self.dtypes
        device_name, dtype_name = self._device_name, self._dtype_name
        for record in records:  # the hot loop: the names come from the caches, inline
            info = devices.get(record.device)
            dev = info[0] if info is not None else device_name(record.device)
            key: _Key = (dev, dtypes.get(record.dtype) or dtype_name(record.dtype), record.shape,
                         record.category, record.name)
            visible[dev] = visible.get(dev, 0) + record.nbytes
            size = record.nbytes + record.graph_bytes
            group = acc.get(key)
            if group is None:
                acc[key] = _Group(record, size)
            else:
                group.count += 1
                group.nbytes += record.nbytes
                group.graph_bytes += record.graph_bytes
                if size > group.size:
                    group.largest, group.size = record, size
        if self.n_largest > 0:
            self.top = heapq.nlargest(self.n_largest, [*self.top, *records], key=_size)

    def finish(self, allocator: Sequence[AllocatorSample]) -> tuple[
        list[CensusGroup], dict[GroupKey, torch.Tensor], dict[GroupKey, torch.Tensor], list[TensorEntry],
        dict[Device, int],
    ]:
        """(groups largest first, a sample tensor per group and, when an autograd graph saves that
        sample, the tensor keeping the graph alive (both for holder lookups; groups whose tensors died
        have none), the largest storages, the invisible bytes per device)."""
        groups, samples, owners = _finish(self.acc)
        entries = [self._entry(record) for record in self.top]
        self.top = []
        return groups, samples, owners, entries, self._invisible(allocator)

    def _invisible(self, allocator: Sequence[AllocatorSample]) -> dict[Device, int]:
        """CUDA allocated bytes minus the gc-visible storages on that device (graph estimates excluded:
        what autograd saved is part of what the census cannot see)."""
        return {s.device: max(0, s.allocated_bytes - self.visible.get(s.device.name, 0))
                for s in allocator if s.allocated_bytes is not None}

    def _entry(self, record: StorageRecord) -> TensorEntry:
        return TensorEntry(
            nbytes=record.nbytes,
            shape=tuple(record.shape),
            dtype=self._dtype_name(record.dtype),
            device=Device.parse(self._device_name(record.device)),
            category=record.category,
            name=record.name,
            graph_bytes=record.graph_bytes,
        )

    def _device_name(self, dev: torch.device | None) -> str:
        if dev is None:
            return "?"
        info = self.storages.devices.get(dev)
        return (info or self.storages.device(dev))[0]

    def _dtype_name(self, dt: torch.dtype | None) -> str:
        if dt is None:
            return "?"
        name = self.dtypes.get(dt)
        if name is None:
            name = self.dtypes[dt] = str(dt).removeprefix("torch.")
        return name


def _size(record: StorageRecord) -> int:
    return record.nbytes + record.graph_bytes


class _Group:
    """A group while the records are folded in: the largest record describes it."""

    __slots__ = ("count", "graph_bytes", "largest", "nbytes", "size")

    def __init__(self, record: StorageRecord, size: int) -> None:
        self.count = 1
        self.nbytes = record.nbytes
        self.graph_bytes = record.graph_bytes
        self.largest = record
        self.size = size


def _finish(
    acc: dict[_Key, _Group],
) -> tuple[list[CensusGroup], dict[GroupKey, torch.Tensor], dict[GroupKey, torch.Tensor]]:
    groups = []
    samples: dict[GroupKey, torch.Tensor] = {}
    owners: dict[GroupKey, torch.Tensor] = {}
    for key, g in acc.items():
        group_key = GroupKey(Device.parse(key[0]), key[1], tuple(key[2]), key[3], key[4])
        groups.append(CensusGroup(group_key, g.count, g.nbytes, g.graph_bytes))
        sample = g.largest.ref()
        if sample is not None:
            samples[group_key] = sample
        owner = g.largest.kept_by.ref() if g.largest.kept_by is not None else None
        if owner is not None:
            owners[group_key] = owner
    acc.clear()
    groups.sort(key=lambda g: g.nbytes + g.graph_bytes, reverse=True)
    return groups, samples, owners
