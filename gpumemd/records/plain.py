"""Records as plain values for JSON: ``dataclasses.asdict``, with each ``Device`` spelt as its field says.

Records carry ``Device`` values; the files keep the spellings they always had. A ``Device`` field is
written as torch's name (``"cuda:0"``, ``"cpu"``) unless its metadata is ``AS_ORDINAL``: then as the
CUDA ordinal (null off CUDA), as allocator samples, findings and OOM records always were. A field
marked ``IN_MEMORY_ONLY`` is left out of the files (what a record carries for other layers to read
instead of parsing names, and that the file formats never had).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gpumemd.records.device import Device

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_JSON = "json"
_ORDINAL = "ordinal"
_OMIT = "omit"

AS_ORDINAL: Mapping[str, str] = MappingProxyType({_JSON: _ORDINAL})
"""Field metadata: this ``Device`` field is written as its CUDA ordinal (null off CUDA)."""

IN_MEMORY_ONLY: Mapping[str, str] = MappingProxyType({_JSON: _OMIT})
"""Field metadata: this field is not written."""


def plain(record: DataclassInstance) -> dict[str, object]:
    """``dataclasses.asdict(record)`` (same keys in the same order, tuples kept as tuples), with every
    ``Device`` spelt as its field says and ``IN_MEMORY_ONLY`` fields left out."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(record):
        spelling = f.metadata.get(_JSON)
        if spelling == _OMIT:
            continue
        out[f.name] = _value(getattr(record, f.name), spelling == _ORDINAL)
    return out


def _value(value: object, ordinal: bool = False) -> object:
    if isinstance(value, Device):
        return value.cuda_index if ordinal else value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_value(v) for v in value)
    if isinstance(value, dict):
        return type(value)((_value(k), _value(v)) for k, v in value.items())
    return value


def jsonable(value: Any) -> Any:
    """Tuples -> lists, non-finite floats -> None, keys -> str: what strict JSON can hold."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)
