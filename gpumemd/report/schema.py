"""The shape of report.json that ``gpumemd report`` reads, checked before anything renders it.

A report someone hands you is outside input: a field of the wrong type must be a one-line refusal
that names the field, not a traceback from deep inside a renderer. The schema lists only what the
readers use, each with the JSON types it may have; everything else in the file is carried along.
"""

from __future__ import annotations

import math
from typing import Any

# JSON types by name: "int" excludes bools (JSON true is not a byte count), "num" is int or float.
_Spec = dict[str, Any]

_FINDING: _Spec = {"state": "str", "kind": "str", "series": "str", "summary": "str"}
_SUGGESTION: _Spec = {"title": "str", "saving_bytes": "num?", "why": "str"}
_TENSOR: _Spec = {"nbytes": "int", "dtype": "str", "device": "str", "category": "str", "shape": ["int"],
                  "name": "str?", "holder": "str?", "graph_bytes": "int?"}
_GROUP: _Spec = {**_TENSOR, "count": "int"}
_ITEM: _Spec = {"key": "str", "nbytes": "int", "label": "str?"}
_GROUP_KEY: _Spec = {"device": "str", "dtype": "str", "shape": ["int"], "category": "str", "name": "str?"}
_LEAK: _Spec = {"holder": "str?", "held_bytes": "int?", "summary": "str?", "holder_detail": "str?",
                "onset_step": "int?", "group_keys": [_GROUP_KEY]}
REPORT_SCHEMA: _Spec = {
    "created_at": "time?",
    "source": "str?",
    "outcome": "str?",
    "suggestions_none": "str?",
    "peak_bytes": "int?",
    "rank": "int?",
    "step": "int?",
    "phase": "str?",
    "exception": {"type": "str?"},
    "breakdown": {"total_bytes": "int?", "verdict": "str?", "verdict_why": "str?", "device": "str?",
                  "requested_bytes": "int?", "items": [_ITEM], "leak": _LEAK, "cap_bytes": "int?",
                  "memory_fraction": "num?", "device_total_bytes": "int?", "headroom_bytes": "int?",
                  "device_free_bytes": "int?", "non_pytorch_bytes": "int?",
                  "device_note": "str?", "host_limit": "str?"},
    "suggestions": [_SUGGESTION],
    "tensors": {"available": "bool?", "tensor_count": "int?", "total_bytes": "int?", "note": "str?",
                "top": [_TENSOR], "groups": [_GROUP]},
    "findings": [_FINDING],
}

_ROOM: _Spec = {"where": "str", "free_bytes": "int?", "total_bytes": "int?", "rss_bytes": "int?", "limit": "str?"}
_ALLOCATOR: _Spec = {"device": "int?", "allocated_bytes": "int?", "reserved_bytes": "int?", "peak_bytes": "int?",
                     "cap_bytes": "int?"}
_STATE_FINDING: _Spec = {**_FINDING, "headline": "str?", "device": "int?", "slope_bytes_per_step": "num?",
                         "growth_bytes": "num?", "steps_to_oom": "num?", "hours_to_oom": "num?", "updated_step": "int?",
                         "added_at": "str?", "fix": "str?"}
STATE_SCHEMA: _Spec = {
    "pid": "int?", "rank": "int?", "world_size": "int?", "hostname": "str?", "attached_at": "time?",
    "written_at": "time?", "step": "int?", "steps_total": "int?", "phase": "str?", "seconds_per_step": "num?",
    "headroom": [_ROOM], "findings": [_STATE_FINDING], "findings_more": "int?", "findings_cleared": "int?",
    "ooms_total": "int?",
    "reports": ["str"], "ended": "str?", "ended_at": "time?", "allocator": [_ALLOCATOR],
    "workers": {"count": "int?", "rss_bytes": "int?"},
    "tensors": {"step": "int?", "tensor_count": "int?", "total_bytes": "int?", "groups": [_GROUP]},
}
"""``gpumemd-state-rank<R>.json`` (``report.last_state``): what ``gpumemd report`` and ``gpumemd top`` print."""

_MAX_INT = 2**64  # byte counts and steps beyond this are not from a real job
_MAX_TIME = 253402300800  # epoch seconds of 10000-01-01: later stamps cannot be printed as dates


def schema_errors(report: dict[str, Any], schema: _Spec = REPORT_SCHEMA, where: str = "", *,
                  strict: bool = False) -> str | None:
    """The first field that does not match ``schema`` ("breakdown.items[3].nbytes: expected an integer,
    got 'x'"), or None. Absent sections and fields are allowed (older writers, sections not measured),
    except in list entries (``strict``), whose non-optional fields the readers index directly."""
    for key, spec in schema.items():
        if key not in report:
            if strict and isinstance(spec, str) and not spec.endswith("?"):
                return f"{where}{key}: missing"
            continue
        error = _check(report[key], spec, f"{where}{key}")
        if error is not None:
            return error
    return None


def _check(value: Any, spec: Any, path: str, *, entry: bool = False) -> str | None:
    if isinstance(spec, dict):
        if value is None and not entry:
            return None
        if not isinstance(value, dict):
            return f"{path}: expected an object, got {_show(value)}"
        return schema_errors(value, spec, path + ".", strict=entry)
    if isinstance(spec, list):
        if value is None:
            return None
        if not isinstance(value, list):
            return f"{path}: expected a list, got {_show(value)}"
        for i, item in enumerate(value):
            error = _check(item, spec[0], f"{path}[{i}]", entry=True)
            if error is not None:
                return error
        return None
    optional = spec.endswith("?")
    kind = spec.rstrip("?")
    if value is None:
        return None if optional else f"{path}: expected {_WORDS[kind]}, got null"
    if not _is(value, kind):
        return f"{path}: expected {_WORDS[kind]}, got {_show(value)}"
    return None


def _is(value: Any, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) < _MAX_INT
    if kind == "num":
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and abs(value) < _MAX_INT)
    if kind == "time":
        return _is(value, "num") and 0 <= value < _MAX_TIME
    raise AssertionError(kind)


_WORDS = {"str": "a string", "bool": "true or false", "int": "an integer", "num": "a number",
          "time": "seconds since 1970 before the year 10000"}


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
