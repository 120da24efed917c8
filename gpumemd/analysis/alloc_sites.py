"""Allocation sites from CUDA memory snapshots: live bytes grouped by first user frame, diffed (pure).

Input is ``torch.cuda.memory._snapshot()`` exactly (TORCH_MEMORY_API.md §2.2): ``segments`` with
``blocks``, each block with ``state`` and ``frames`` (innermost first). With allocation history on,
each live block carries the stack that allocated it. A site is the first frame outside torch and
gpumemd ("modeling_llama.py:321 in forward"), and, when that is a library's, the first frame in the
user's own files too ("..., called from train.py:57 in main"). Diffing two snapshots taken a window
apart names the lines whose live bytes grew: the allocation sites of a leak.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NO_STACK = "<no stack recorded>"

# Frames that are never "the user's line": C++ frames (stacks="all"), the interpreter's frozen
# modules, torch.compile's generated code (Inductor's ``call`` in its cache directory, whichever
# user's), and files under the directories the caller names (torch's and gpumemd's packages:
# ``gpumemd.probes.holding.package_dirs``). Real directories, not substrings: a user's own folder named
# "torch" or "gpumemd" (this repository's checkout on a CI runner) is user code.
_NATIVE_SUFFIXES = (".cpp", ".cc", ".cu", ".cuh", ".h", ".hpp", ".c")
_GENERATED_DIR = "/torchinductor_"
# ``_snapshot(augment_with_fx_traces=True)`` puts the model's own stack on frames of FX-generated code
_FX_TRACE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


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
    """Is a frame in ``filename`` the user's code (not C++, not a pseudo-file, not generated, not
    under ``internal``)?"""
    if not filename or filename == "??" or filename.startswith("<"):
        return False
    if filename.endswith(_NATIVE_SUFFIXES):
        return False
    path = filename.replace("\\", "/")
    return _GENERATED_DIR not in path and not path.startswith(tuple(internal))


def _fx_frames(frame: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The model's own frames behind a frame of FX-generated code, innermost first (from torch's
    ``fx_original_trace``, a traceback text, outermost first)."""
    trace = frame.get("fx_original_trace")
    if not isinstance(trace, str):
        return []
    found = [{"filename": f, "line": int(n), "name": name} for f, n, name in _FX_TRACE.findall(trace)]
    return found[::-1]


def _expanded(frames: Sequence[Any] | None) -> Iterable[Mapping[str, Any]]:
    for frame in frames or ():
        if isinstance(frame, Mapping):
            yield from _fx_frames(frame)
            yield frame


def site_frames(frames: Sequence[Any] | None, internal: Sequence[str] = (),
                library: Sequence[str] = ()) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """The innermost frame outside ``internal`` and the innermost frame outside ``internal`` and
    ``library`` (the user's own file); either None when there is none. Directory prefixes are
    ``/``-separated and end in ``/``."""
    outside = own = None
    for frame in _expanded(frames):
        filename = str(frame.get("filename", ""))
        if not is_user_frame(filename, internal):
            continue
        if outside is None:
            outside = frame
        if not filename.replace("\\", "/").startswith(tuple(library)):
            own = frame
            break
    return outside, own


def _short(frame: Mapping[str, Any]) -> str:
    short = str(frame.get("filename", "")).replace("\\", "/").rsplit("/", 1)[-1]
    return f"{short}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def first_user_frame(frames: Sequence[Mapping[str, Any]] | None, internal: Sequence[str] = (),
                     library: Sequence[str] = ()) -> str | None:
    """``train.py:57 in main`` for the innermost frame outside ``internal`` (torch, gpumemd), and
    ``modeling_llama.py:321 in forward, called from train.py:57 in main`` when that frame is under
    ``library`` and a frame of the user's own files is further out; None when no frame is outside."""
    outside, own = site_frames(frames, internal, library)
    if outside is None:
        return None
    return _short(outside) if own is None or own is outside else f"{_short(outside)}, called from {_short(own)}"


def live_by_site(snapshot: Mapping[str, Any] | Sequence[Any], device: int | None = None, *,
                 internal: Sequence[str] = (), library: Sequence[str] = ()) -> dict[str, SiteBytes]:
    """Live (``active_allocated``) block bytes grouped by first user frame, for one device or all.

    A bare list is read as ``torch.cuda.memory_snapshot()``'s list of segments.
    """
    segments: Iterable[Any] = snapshot if isinstance(snapshot, Sequence) else (snapshot.get("segments") or ())
    acc: dict[str, list[int]] = {}
    for seg in segments:
        if not isinstance(seg, Mapping) or (device is not None and int(seg.get("device", 0)) != device):
            continue
        for block in seg.get("blocks") or ():
            if not isinstance(block, Mapping) or block.get("state") != "active_allocated":
                continue
            site = first_user_frame(block.get("frames"), internal, library) or NO_STACK
            slot = acc.setdefault(site, [0, 0])
            slot[0] += int(block.get("size", 0))
            slot[1] += 1
    return {site: SiteBytes(site, b, c) for site, (b, c) in acc.items()}


def diff_sites(old: Mapping[str, SiteBytes], new: Mapping[str, SiteBytes], *, limit: int = 5) -> list[SiteDelta]:
    """Sites whose live bytes grew from ``old`` to ``new``, largest growth first: two ``live_by_site``
    results (keep those, not whole snapshots)."""
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
