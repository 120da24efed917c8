"""CUDA allocation sites behind a leak: the lines whose live blocks grew since it was suspected.

With allocation history on, each live block carries the stack that allocated it. When a device's
leak is first suspected the sites' live bytes are noted (switching history on then when
``leak_history_on_suspect`` allows it); at later evaluations the sites that grew since are named.
History switched on for a suspicion goes off again (if it was ours) once every suspicion that
asked for it is decided: confirmed (the names stay), cleared, or withdrawn as explained elsewhere.
Recording costs ~2 µs per allocation for the rest of a job that may run for weeks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpumemd.analysis.alloc_sites import SiteBytes, diff_sites, live_by_site, site_sentence
from gpumemd.analysis.leak_detector import LeakState, TrackStatus
from gpumemd.probes.holding.package_dirs import internal_dirs, library_dirs
from gpumemd.records.device import cuda_index

if TYPE_CHECKING:
    from gpumemd.components.leak_options import LeakOptions
    from gpumemd.probes.device.allocation_history import AllocationHistory

log = logging.getLogger("gpumemd")
_HISTORY_USER = "leak"  # this component's name among the users of the allocation history

Snapshot = Mapping[str, Any] | Sequence[Any]  # torch's snapshot: a dict, or memory_snapshot()'s segment list


class AllocationSites:
    """Names the allocation sites that grew behind a device's leak; see the module docstring.

    ``history`` is the process's allocation history (shared with the OOM capture); ``snapshot_fn``
    replaces torch's snapshot (tests feed snapshots in torch's shape)."""

    def __init__(self, options: LeakOptions, history: AllocationHistory, *,
                 snapshot_fn: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self._options = options
        self._history = history
        self._snapshot_fn = snapshot_fn
        self._before: dict[int, tuple[int, dict[str, SiteBytes]]] = {}  # per CUDA ordinal: step, live bytes by site
        self._named: dict[int, tuple[str, ...]] = {}  # per CUDA ordinal, once a finding is confirmed
        self._open: dict[int, set[tuple[str, str]]] = {}  # per CUDA ordinal: the (series, phase) suspicions noted
        self.enabled_by_us = False  # allocation history is on because this component asked

    def sites(self, status: TrackStatus) -> tuple[str, ...]:
        """CUDA allocation sites that grew since the leak was suspected (with allocation history)."""
        d = cuda_index(status.spec.device)
        if d is None:
            return ()
        named = self._named.get(d)
        if named is not None and status.state is LeakState.CONFIRMED:
            return named  # named at confirmation, when recording went off
        if status.state is LeakState.SUSPECTED and status.changed:
            self._note(d, status.step)
            self._open.setdefault(d, set()).add((status.spec.name, status.phase))
            return ()
        before = self._before.get(d)
        snap = self._snapshot() if before is not None else None
        if before is None or snap is None:
            return ()
        grown = diff_sites(before[1], live_by_site(snap, d, internal=internal_dirs(), library=library_dirs()), limit=3)
        sites = tuple(site_sentence(g, status.step - before[0]) for g in grown)
        if status.state is LeakState.CONFIRMED:
            self._named[d] = sites
            self._decided(d, (status.spec.name, status.phase), force=True)  # the sites are named
        return sites

    def settle(self, status: TrackStatus) -> None:
        """``status`` is no longer a suspicion (cleared, or withdrawn as explained by another series):
        its noted sites are forgotten, and history goes off when no suspicion needs it any more."""
        d = cuda_index(status.spec.device)
        if d is not None and (status.state is None or not status.state.active):
            self._decided(d, (status.spec.name, status.phase), force=False)

    def _decided(self, device: int, key: tuple[str, str], *, force: bool) -> None:
        waiting = self._open.get(device)
        if waiting is not None:
            waiting.discard(key)
        elif not force:
            return  # never noted here: nothing of ours to undo
        if not waiting:
            self._open.pop(device, None)
            self._before.pop(device, None)
        if not self._open:
            self.release()  # only if it was ours: a job's own recording stays on

    def _note(self, device: int, step: int) -> None:
        """A new suspicion: note the live bytes by site now (history on, or switched on if allowed)."""
        config = self._options
        self._named.pop(device, None)
        history_on = config.record_history or self.enabled_by_us or (
            self._history.enabled_by_the_job()) or (
            config.leak_history_on_suspect and self._enable_history(config.history_max_entries))
        if not history_on:
            return
        snap = self._snapshot()
        if snap is not None:
            self._before[device] = (step, live_by_site(snap, device, internal=internal_dirs(),
                                                           library=library_dirs()))

    def clear(self) -> None:
        """Forget the sites and switch our allocation history off (at stop)."""
        self.release()
        self._before.clear()
        self._named.clear()
        self._open.clear()

    def _enable_history(self, max_entries: int) -> bool:
        self.enabled_by_us = self._history.acquire(_HISTORY_USER, max_entries)  # asked only while it is False
        return self.enabled_by_us

    def release(self) -> None:
        if self.enabled_by_us:
            self.enabled_by_us = False
            self._history.release(_HISTORY_USER)

    def _snapshot(self) -> Snapshot | None:
        """The allocator's segments with their blocks' stacks, without the trace ring buffer: the
        full ``_snapshot()`` would build every trace entry (up to ``history_max_entries``) as Python
        objects on the training thread, and allocation sites need only the live blocks."""
        try:
            if self._snapshot_fn is not None:
                return self._snapshot_fn()
            import torch

            memory_snapshot = torch.cuda.memory.memory_snapshot
            if "include_traces" in inspect.signature(memory_snapshot).parameters:
                return memory_snapshot(include_traces=False)
            return torch.cuda.memory._snapshot()
        except (RuntimeError, AttributeError) as exc:
            log.info("gpumemd: no CUDA snapshot for allocation sites (%s)", exc)
            return None
