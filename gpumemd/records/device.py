"""How gpumemd names a device: one ``Device`` value, and the spellings each output needs.

Records carry a ``Device``; only the outputs spell it, each its own way, and every spelling is here:

- ``name``: torch's device string, ``"cpu"`` or ``"cuda:N"`` (never a bare ``"cuda"``: ``parse``
  makes it ``cuda:0``), as census groups, breakdowns and findings' text show it;
- ``label``: the metric label, the CUDA ordinal ``"N"`` for CUDA (as on every allocator series),
  else the name;
- ``cuda_index``: the CUDA ordinal as torch numbers it in this process (after
  ``CUDA_VISIBLE_DEVICES``), or None off CUDA: what torch's and NVML's calls take, and what the JSON
  of samples, findings and OOM records holds.

Devices are interned: ``Device.cuda(n)`` and ``Device.parse(name)`` return the same object for the
same device, so the per-step path looks them up and never builds one. Two devices compare by value,
so a device named one way here and another way there is still the same device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

_CUDA = "cuda"
_PARSED_MAX = 256
"""Names ``parse`` remembers at most: a process has a handful of devices, but report files read
back may name anything."""


@dataclass(frozen=True, slots=True)
class Device:
    """A device: its type (``"cpu"``, ``"cuda"``, or another of torch's device types) and its index
    (None where torch gives none, as for ``"cpu"``). Build one with ``Device.cuda`` or
    ``Device.parse`` (interned), or use ``CPU``."""

    kind: str
    index: int | None = None
    # Spellings computed once (devices are interned): outputs read them on every scrape and step.
    name: str = field(init=False, repr=False, compare=False)
    label: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind == _CUDA and self.index is None:
            raise ValueError('Device("cuda") needs an index: Device.parse("cuda") is cuda:0')
        name = self.kind if self.index is None else f"{self.kind}:{self.index}"
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "label", str(self.index) if self.kind == _CUDA else name)

    def __str__(self) -> str:
        return self.name

    @property
    def cuda_index(self) -> int | None:
        """The CUDA ordinal; None for any other device."""
        return self.index if self.kind == _CUDA else None

    @property
    def order(self) -> tuple[str, int]:
        """A sort key: by type, then by index (``cuda:2`` before ``cuda:10``; no index first)."""
        return self.kind, -1 if self.index is None else self.index

    @staticmethod
    def cuda(index: int) -> Device:
        """CUDA device ``index`` (``3`` -> ``cuda:3``), interned."""
        device = _CUDA_DEVICES.get(index)
        if device is None:
            device = _CUDA_DEVICES[index] = Device(_CUDA, index)
        return device

    @staticmethod
    def of(value: DeviceLike) -> Device:
        """The device a user names, as torch's own calls take it: a ``Device``, a CUDA ordinal (``0``),
        torch's string (``"cuda:0"``, ``"cpu"``) or a ``torch.device`` (read by its string, so this
        layer needs no torch). A bool or a negative ordinal is refused: neither names a device."""
        if isinstance(value, Device):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ValueError(f"device {value}: a CUDA ordinal is 0 or more (torch.cuda.device_count() - 1 at most)")
            return Device.cuda(value)
        if isinstance(value, str) or type(value).__name__ == "device":
            return Device.parse(str(value))
        raise TypeError(f"device {value!r}: expected a CUDA ordinal, a name such as 'cuda:0', or a torch.device")

    @staticmethod
    def parse(name: str) -> Device:
        """torch's device string: ``"cuda:3"``, ``"cpu"``, ``"mps:0"``; ``"cuda"`` is ``cuda:0`` (torch's
        current device at the time is device 0 for gpumemd's purposes: a census sees the tensor's own
        device, which always carries an index). A name that is not ``type`` or ``type:N`` is kept whole
        as the type, so that ``str(Device.parse(name)) == name`` for every name but ``"cuda"``."""
        device = _PARSED.get(name)
        if device is None:
            device = _parse(name)
            if len(_PARSED) < _PARSED_MAX:
                _PARSED[name] = device
        return device


def _parse(name: str) -> Device:
    if name == _CUDA:
        return Device.cuda(0)
    kind, sep, index = name.rpartition(":")
    # Only a canonical number is an index ("cuda:01" would not spell back the same).
    if not sep or not kind or not index.isdecimal() or str(int(index)) != index:
        return Device(name)
    return Device.cuda(int(index)) if kind == _CUDA else Device(kind, int(index))


DeviceLike = Union["Device", int, str, Any]
"""What a lookup by device takes: see ``Device.of`` (``Any``: a ``torch.device``, typed without torch)."""

_CUDA_DEVICES: dict[int, Device] = {}
CPU = Device("cpu")
_PARSED: dict[str, Device] = {CPU.name: CPU}


def cuda_index(device: Device | None) -> int | None:
    """The CUDA ordinal of ``device``; None off CUDA and for no device."""
    return device.cuda_index if device is not None else None
