"""Loading a snapshot someone sent: ``load_snapshot(path)`` and ``loads_snapshot(data)``.

A restricted unpickler admits builtin containers and scalars only, so a crafted ``snapshot.pickle``
cannot run code, and the loader bounds what it may build (file size, memo indexes, copies, hashing,
nesting, shared references), so a crafted one cannot exhaust memory or time either: the rules are in
``snapshot_rules``, the opcode pass in ``snapshot_prescan``, the building pass in ``snapshot_unpickle``.
"""

from __future__ import annotations

import os
import pickle
import stat
from typing import Any

from gpumemd.probes.snapshots.snapshot_prescan import prescan
from gpumemd.probes.snapshots.snapshot_rules import DEFAULT_LIMITS, Limits, SnapshotLoadError
from gpumemd.probes.snapshots.snapshot_unpickle import unpickle


def loads_snapshot(data: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any] | list[Any]:
    """Unpickle a snapshot without running code, in memory and time bounded by the file's size (see
    Limits; tests pass small ones); the result is a dict (``_snapshot``) or a list. Anything else
    raises SnapshotLoadError."""
    data = bytes(data)
    if len(data) > limits.max_bytes:
        raise SnapshotLoadError(f"refused a {len(data)}-byte snapshot: over the {limits.max_bytes}-byte limit")
    try:
        prescan(data, limits)
        obj = unpickle(data, limits)
    except SnapshotLoadError:
        raise
    except RecursionError:
        raise SnapshotLoadError("refused: nested too deeply to load") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, UnicodeDecodeError, OverflowError) as exc:
        raise SnapshotLoadError(f"not a readable pickle ({type(exc).__name__}: {exc}); truncated?") from None
    if isinstance(obj, dict) and isinstance(obj.get("segments"), list):
        return obj
    if isinstance(obj, list):
        return obj
    raise SnapshotLoadError(
        f"not a PyTorch memory snapshot: expected a dict with a 'segments' list, got {type(obj).__name__}"
    )


def load_snapshot(path: str, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any] | list[Any]:
    """Read and safely unpickle ``path`` (see ``loads_snapshot``); a file over 2 GiB is refused unread."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # a FIFO blocks, /dev/zero never ends
            raise SnapshotLoadError(f"{path} is not a regular file")
        if info.st_size > limits.max_bytes:
            raise SnapshotLoadError(f"refused {path}: {info.st_size} bytes, over the {limits.max_bytes}-byte limit "
                                    "for a snapshot")
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)  # a file that grew since stat is caught below
    except OSError as exc:
        raise SnapshotLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    return loads_snapshot(data, limits)
