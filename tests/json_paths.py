"""Every path into a JSON document, for tests that mutate a report field by field."""

from __future__ import annotations

from typing import Any


def json_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The document's own path (``()``) and its keys' and first three items' paths, depth first."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(json_paths(v, (*prefix, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            out.extend(json_paths(v, (*prefix, i)))
    return out
