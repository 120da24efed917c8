"""The memory limits this process really runs under, beside the host's RAM: its cgroup's and its rlimits.

In a Kubernetes pod or a Slurm job with a memory limit, the host's RAM is the node's, not the job's:
the kernel kills the job when its cgroup reaches ``memory.max`` (v2) or ``memory.limit_in_bytes``
(v1), however much the node has free. Under ``ulimit -v`` (``RLIMIT_AS``) or ``RLIMIT_DATA`` an
allocation fails when the process's virtual (data) size would pass the soft limit.

The cgroup is found once (``/proc/self/cgroup`` and the mount table), with the limit files of the
process's cgroup and of each ancestor up to the mount's root (a pod's or a Slurm job's limit is often
set on a parent); each sample then opens each file at most once. Every path is under ``root`` so that
tests point the probe at a fake tree laid out as the kernel writes it.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from gpumemd.records.samples import HostLimit

UNLIMITED = 1 << 60
"""At or above this a limit is none: cgroup v1 writes ``PAGE_COUNTER_MAX`` pages for "no limit"
(9223372036854771712 with 4 KiB pages), v2 writes ``max``, an rlimit ``RLIM_INFINITY``."""


@dataclass(frozen=True, slots=True)
class _Level:
    """One cgroup's memory files: its limit, its usage and the stat file with its inactive page cache."""

    limit: str
    usage: str
    stat: str


@dataclass(frozen=True, slots=True)
class _Flavour:
    version: int
    fstype: str
    limit: str
    usage: str
    inactive_key: str  # memory.stat's reclaimable page cache (the kubelet's working set leaves it out)


_V2 = _Flavour(2, "cgroup2", "memory.max", "memory.current", "inactive_file")
_V1 = _Flavour(1, "cgroup", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


class CgroupMemory:
    """The cgroup memory limit of this process: the least ``limit − working set`` over its cgroup and
    the ancestors inside the mount. ``path`` is the process's own cgroup directory (None: none found)."""

    def __init__(self, root: str = "/") -> None:
        self.version: int | None = None
        self.path: str | None = None
        self._levels: tuple[_Level, ...] = ()
        self._inactive_key = ""
        self.binding_file: str | None = None  # the limit file of the level that bound at the last read
        try:
            self._find(root)
        except (OSError, ValueError, IndexError):
            self._levels = ()  # no readable cgroup: the limit is absent, never an error

    def _find(self, root: str) -> None:
        memberships = _read(_under(root, "/proc/self/cgroup")).splitlines()
        mounts = _read(_under(root, "/proc/self/mountinfo")).splitlines()
        for flavour in (_V2, _V1):  # a hybrid host has both: the one with memory files is the one in use
            found = _cgroup_dir(root, flavour, memberships, mounts)
            if found is None:
                continue
            leaf, top = found
            levels = _levels(leaf, top, flavour)
            if levels or os.path.exists(os.path.join(leaf, flavour.usage)):
                self.version, self.path, self._levels = flavour.version, leaf, levels
                self._inactive_key = flavour.inactive_key
                return

    @property
    def files(self) -> tuple[str, ...]:
        """The limit files read at each sample (the process's cgroup first)."""
        return tuple(level.limit for level in self._levels)

    def read(self) -> HostLimit | None:
        """The binding cgroup limit now, or None when no level has one (or none can be read)."""
        best: HostLimit | None = None
        self.binding_file = None
        for level in self._levels:
            try:
                limit = _limit_value(_read(level.limit))
                if limit is None:
                    continue
                used = max(0, int(_read(level.usage)) - _stat_value(level.stat, self._inactive_key))
            except (OSError, ValueError):
                continue  # a level removed or unreadable now: the others still bound the job
            found = HostLimit("cgroup", limit, used)
            if best is None or found.headroom_bytes < best.headroom_bytes:
                best, self.binding_file = found, level.limit
        return best


def rlimits(vm_bytes: int | None, data_bytes: int | None) -> list[HostLimit]:
    """The soft ``RLIMIT_AS`` and ``RLIMIT_DATA`` that are set, against the process's virtual size and
    data size (statm's ``size`` and ``data``: what the kernel checks each against)."""
    out = []
    for kind, resource_id, used in (("rlimit_as", resource.RLIMIT_AS, vm_bytes),
                                    ("rlimit_data", resource.RLIMIT_DATA, data_bytes)):
        soft = resource.getrlimit(resource_id)[0]
        if soft == resource.RLIM_INFINITY or soft >= UNLIMITED or used is None:
            continue
        out.append(HostLimit(kind, int(soft), used))
    return out


def binding(limits: list[HostLimit]) -> HostLimit | None:
    """The limit with the least headroom (the first of equals: host RAM is listed first)."""
    return min(limits, key=lambda limit: limit.headroom_bytes) if limits else None


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as f:
        return f.read()


def _limit_value(text: str) -> int | None:
    text = text.strip()
    if text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def _stat_value(path: str, key: str) -> int:
    """One counter of a ``memory.stat`` file (0 when absent: the usage then counts the cache too)."""
    try:
        text = _read(path)
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _cgroup_dir(root: str, flavour: _Flavour, memberships: list[str],
                mounts: list[str]) -> tuple[str, str] | None:
    """(the process's cgroup directory, its mount's directory) for ``flavour``, or None."""
    member = _membership(flavour, memberships)
    mount = _mount(flavour, mounts)
    if member is None or mount is None:
        return None
    mount_root, mount_point = mount
    top = _under(root, mount_point)
    # Inside a cgroup namespace (a container) the mount's root is the container's own cgroup, and the
    # path /proc/self/cgroup gives is relative to it or "/"; outside, it is the full path from the top.
    relative = member
    if mount_root != "/" and (member == mount_root or member.startswith(mount_root + "/")):
        relative = member[len(mount_root):]
    leaf = os.path.normpath(os.path.join(top, relative.lstrip("/")))
    if not os.path.isdir(leaf) or not (leaf == top or leaf.startswith(top + os.sep)):
        leaf = top  # a path the mount does not show: the mount's root is the nearest we can read
    return leaf, top


def _membership(flavour: _Flavour, lines: list[str]) -> str | None:
    """The cgroup path of this process in ``flavour``'s hierarchy (``/proc/self/cgroup``: id:controllers:path)."""
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if flavour.version == 2 and hierarchy == "0" and controllers == "":
            return path
        if flavour.version == 1 and "memory" in controllers.split(","):
            return path
    return None


def _mount(flavour: _Flavour, lines: list[str]) -> tuple[str, str] | None:
    """(root within the hierarchy, mount point) of ``flavour``'s mount, from ``/proc/self/mountinfo``:
    ``id parent major:minor root mount-point options [optional...] - fstype source super-options``."""
    for line in lines:
        before, sep, after = line.partition(" - ")
        if not sep:
            continue
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != flavour.fstype:
            continue
        if flavour.version == 1 and "memory" not in tail[2].split(","):
            continue
        return _unescape(fields[3]), _unescape(fields[4])
    return None


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def _levels(leaf: str, top: str, flavour: _Flavour) -> tuple[_Level, ...]:
    """The limit files of ``leaf`` and each ancestor up to ``top`` that has them (v2's root has none)."""
    out = []
    here = leaf
    while True:
        limit = os.path.join(here, flavour.limit)
        if os.path.exists(limit):
            out.append(_Level(limit, os.path.join(here, flavour.usage), os.path.join(here, "memory.stat")))
        if here == top or os.path.dirname(here) == here:
            break
        here = os.path.dirname(here)
    return tuple(out)
