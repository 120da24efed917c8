"""The storages one census counted, and what it reports of them: groups, the largest, the invisible.

The census pass makes one ``StorageRecord`` per storage (classified and named, with the graph
bytes charged to it); everything here reads those records and knows nothing of how they were found.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

from gpumemd.records.census import CensusGroup, GroupKey, TensorEntry
from gpumemd.records.device import Device
from gpumemd.records.samples import AllocatorSample

if TYPE_CHECKING:
    import torch

    from gpumemd.probes.storages import Storages

# (device name, dtype, shape, category, name) while aggregating: plain tuples of strings hash and
# compare in C, the GroupKey and Device dataclasses' __hash__/__eq__ run in Python. Records get the
# Device once per group.
_Key: TypeAlias = "tuple[str, str, tuple[int, ...], str, str | None]"


class StorageRecord:
    """One storage (or the component storages of one sparse/wrapper tensor) during a census."""

    __slots__ = ("category", "gkey", "graph_bytes", "kept_by", "name", "nbytes", "tensor")

    def __init__(self, nbytes: int, category: str, name: str | None, tensor: torch.Tensor) -> None:
        self.nbytes = nbytes
        self.category = category
        self.name = name
        self.tensor = tensor  # the representative: its shape/dtype/device describe the storage
        self.graph_bytes = 0
        self.gkey: _Key | None = None  # set while grouping
        self.kept_by: StorageRecord | None = None  # the graph-keeping tensor whose autograd graph saves this


class Grouping:
    """Groups, the largest storages and the invisible bytes of one census's records."""

    def __init__(self, records: list[StorageRecord], storages: Storages) -> None:
        self.records = records
        self.storages = storages
        self.dtypes: dict[torch.dtype, str] = {}

    def groups(self) -> tuple[list[CensusGroup], dict[GroupKey, torch.Tensor], dict[GroupKey, torch.Tensor]]:
        """Groups, largest first; per group a sample tensor and, when an autograd graph saves
        that sample, the tensor keeping the graph alive (both for holder lookups)."""
        acc: dict[_Key, _Group] = {}
        devices, dtypes = self.storages.devices, self.dtypes
        for record in self.records:
            t = record.tensor
            try:  # _group_key inlined: this runs once per storage
                dev, dt = t.device, t.dtype
                key: _Key = (
                    (devices.get(dev) or self.storages.device(dev))[0],
                    dtypes.get(dt) or self._dtype(dt),
                    t.shape,  # a torch.Size hashes and compares like the tuple it becomes below
                    record.category,
                    record.name,
                )
            except Exception:  # noqa: BLE001 - nested tensors have no sizes()
                key = self._group_key(record)
            record.gkey = key
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
        return _finish(acc)

    def largest(self, n: int) -> list[TensorEntry]:
        top = heapq.nlargest(n, self.records, key=lambda r: r.nbytes + r.graph_bytes)
        out = []
        for record in top:
            device, dtype, shape, category, name = self._group_key(record)
            out.append(
                TensorEntry(
                    nbytes=record.nbytes,
                    shape=tuple(shape),
                    dtype=dtype,
                    device=Device.parse(device),
                    category=category,
                    name=name,
                    graph_bytes=record.graph_bytes,
                )
            )
        return out

    def invisible(self, allocator: Sequence[AllocatorSample]) -> dict[Device, int]:
        """CUDA allocated bytes minus the gc-visible storages on that device (graph estimates excluded:
        what autograd saved is part of what the census cannot see)."""
        if not allocator:
            return {}
        visible: dict[str, int] = {}
        devices = self.storages.devices
        for record in self.records:
            try:
                dev = record.tensor.device
            except Exception:  # noqa: BLE001
                continue
            name = (devices.get(dev) or self.storages.device(dev))[0]
            visible[name] = visible.get(name, 0) + record.nbytes
        out = {}
        for sample in allocator:
            if sample.allocated_bytes is None:
                continue
            out[sample.device] = max(0, sample.allocated_bytes - visible.get(sample.device.name, 0))
        return out

    def _group_key(self, record: StorageRecord) -> _Key:
        if record.gkey is not None:
            return record.gkey
        t = record.tensor
        device, dtype = "?", "?"
        shape: tuple[int, ...] = ()
        try:
            dev = t.device
            device = (self.storages.devices.get(dev) or self.storages.device(dev))[0]
            dt = t.dtype
            dtype = self.dtypes.get(dt) or self._dtype(dt)
            shape = tuple(t.shape)
        except Exception:  # noqa: BLE001 - nested tensors have no sizes(); keep what was read
            pass
        return (device, dtype, shape, record.category, record.name)

    def _dtype(self, dt: torch.dtype) -> str:
        name = self.dtypes[dt] = str(dt).removeprefix("torch.")
        return name


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
        samples[group_key] = g.largest.tensor
        if g.largest.kept_by is not None:
            owners[group_key] = g.largest.kept_by.tensor
    acc.clear()
    groups.sort(key=lambda g: g.nbytes + g.graph_bytes, reverse=True)
    return groups, samples, owners
