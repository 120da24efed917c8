"""Real CUDA data, replayed on CPU: the recordings ``benchmarks/gpu_record.py`` saves from a device
(``bash benchmarks/gpu_check.sh --record DIR``), committed under ``tests/data/cuda/``.

Each recording is one JSON file; ``memory_stats`` holds ``torch.cuda.memory_stats()`` as torch
flattened it, one per allocator configuration. ``nested_from_flat`` rebuilds the nested dict torch's
C++ binding returned, so a test can patch ``torch.cuda.memory.memory_stats_as_nested_dict`` with it
and run torch's own flattening and gpumemd's reader on the same data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORDINGS = Path(__file__).parent / "data" / "cuda"


def recordings() -> list[Path]:
    return sorted(RECORDINGS.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def recorded_memory_stats() -> dict[str, dict[str, int]]:
    """``"<recording>:<configuration>"`` -> a flattened ``memory_stats()`` dict, from every recording."""
    out: dict[str, dict[str, int]] = {}
    for path in recordings():
        for config, flat in load(path).get("memory_stats", {}).items():
            out[f"{path.stem}:{config}"] = flat
    return out


def nested_from_flat(flat: dict[str, Any]) -> dict[Any, Any]:
    """The nested dict ``memory_stats()`` flattened: keys split on ".", and a private pool's ``"a_b"``
    back to torch's ``(a, b)`` pool id."""
    nested: dict[Any, Any] = {}
    for key, value in flat.items():
        parts: list[Any] = key.split(".")
        if parts[0] == "reserved_bytes_by_private_pools" and len(parts) > 1:
            parts[1] = tuple(int(p) for p in parts[1].split("_"))
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def recorded_ooms() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """``"<recording>:<configuration>"`` -> (device facts, that configuration's OOM facts), for every
    configuration of every recording that caught an OOM message."""
    out: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for path in recordings():
        data = load(path)
        for config, facts in data.get("configs", {}).items():
            if facts.get("oom_message"):
                out[f"{path.stem}:{config}"] = (data.get("device", {}), facts)
    return out


def recorded_snapshots() -> list[Path]:
    """The allocator snapshots with history (``torch.cuda.memory._snapshot()``) recorded beside them."""
    return sorted(RECORDINGS.glob("*-snapshot-*.pickle"))
