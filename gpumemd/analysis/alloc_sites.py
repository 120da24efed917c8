"""Allocation sites from CUDA memory snapshots: live bytes grouped by first user frame, diffed (pure).

Input is ``torch.cuda.memory._snapshot()`` exactly (TORCH_MEMORY_API.md §2.2): ``segments`` with
``blocks``, each block with ``state`` and ``frames`` (innermost first). With allocation history on,
each live block carries the stack that allocated it; the first frame outside torch and the
standard library is the line a human wrote ("train.py:57 in main"). Diffing two snapshots taken
a window apart names the lines whose live bytes grew: the allocation sites of a leak.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NO_STACK = "<no stack recorded>"

# Frames that are never "the user's line": C++ frames (stacks="all"), the interpreter's frozen
# modules, and files under the directories the caller names (torch's and gpumemd's packages, the
# standard library: ``gpumemd.probes.package_dirs``). Real directories, not substrings: a user's
# own folder named "torch" or "gpumemd" (this repository's checkout on a CI runner) is user code.
_NATIVE_SUFFIXES = (".cpp", ".cc", ".cu", ".cuh", ".h", ".hpp", ".c")


@dataclass(frozen=True, slots=True)
class SiteBytes:
    site: str
    bytes: int
    count: int


@dataclass(frozen=True, slots=True)
class SiteDelta:
    """Live bytes and blocks at one allocation site that appeared between two snapshots."""

    site: str
    bytes_delta: int
    count_delta: int


def is_user_frame(filename: str, internal: Sequence[str]) -> bool:
    """Is a frame in ``filename`` the user's code (not C++, not a pseudo-file, not under ``internal``)?"""
    if not filename or filename == "??" or filename.startswith("<"):
        return False
    if filename.endswith(_NATIVE_SUFFIXES):
        return False
    return not filename.replace("\\", "/").startswith(tuple(internal))


def first_user_frame(frames: Sequence[Mapping[str, Any]] | None, internal: Sequence[str] = ()) -> str | None:
    """``train.py:57 in main`` for the innermost frame that is the user's code, else None.
    ``internal``: directory prefixes (``/``-separated, ending in ``/``) that are never the user's."""
    for frame in frames or ():
        if not isinstance(frame, Mapping):
            continue
        filename = str(frame.get("filename", ""))
        if is_user_frame(filename, internal):
            short = filename.replace("\\", "/").rsplit("/", 1)[-1]
            return f"{short}:{frame.get('line', '?')} in {frame.get('name', '?')}"
    return None


def live_by_site(snapshot: Mapping[str, Any] | Sequence[Any], device: int | None = None, *,
                 internal: Sequence[str] = ()) -> dict[str, SiteBytes]:
    """Live (``active_allocated``) block bytes grouped by first user frame, for one device or all.

    A bare list is read as ``torch.cuda.memory_snapshot()``'s list of segments.
    """
    segments: Iterable[Any] = (
        snapshot if isinstance(snapshot, Sequence) else (snapshot.get("segments") or ())
    )
    acc: dict[str, list[int]] = {}
    for seg in segments:
        if not isinstance(seg, Mapping):
            continue
        if device is not None and int(seg.get("device", 0)) != device:
            continue
        for block in seg.get("blocks") or ():
            if not isinstance(block, Mapping) or block.get("state") != "active_allocated":
                continue
            site = first_user_frame(block.get("frames"), internal) or NO_STACK
            slot = acc.setdefault(site, [0, 0])
            slot[0] += int(block.get("size", 0))
            slot[1] += 1
    return {site: SiteBytes(site, b, c) for site, (b, c) in acc.items()}


def site_growth(
    before: Mapping[str, Any] | Sequence[Any], after: Mapping[str, Any] | Sequence[Any], *,
    device: int | None = None, limit: int = 5, internal: Sequence[str] = (),
) -> list[SiteDelta]:
    """Sites whose live bytes grew from ``before`` to ``after``, largest growth first."""
    return diff_sites(live_by_site(before, device, internal=internal), live_by_site(after, device, internal=internal),
                      limit=limit)


def diff_sites(old: Mapping[str, SiteBytes], new: Mapping[str, SiteBytes], *, limit: int = 5) -> list[SiteDelta]:
    """``site_growth`` over two ``live_by_site`` results (keep those, not whole snapshots)."""
    deltas = []
    for site, now in new.items():
        was = old.get(site)
        db = now.bytes - (was.bytes if was else 0)
        dc = now.count - (was.count if was else 0)
        if db > 0:
            deltas.append(SiteDelta(site, db, dc))
    deltas.sort(key=lambda d: (d.bytes_delta, d.count_delta), reverse=True)
    return deltas[:limit]


def site_sentence(delta: SiteDelta, steps: float) -> str:
    """``train.py:57 in main (+2 blocks, +64.0 KiB/step)``."""
    from gpumemd.analysis.units import format_bytes  # same units everywhere

    steps = max(steps, 1.0)
    return f"{delta.site} (+{delta.count_delta} blocks, +{format_bytes(delta.bytes_delta / steps)}/step)"
