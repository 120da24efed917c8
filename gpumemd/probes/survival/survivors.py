"""Long-lived tensors, counted per group between censuses, from the garbage collector's young generations.

Why this design: a census scans the whole heap (tens of ms), so
under a 1% budget it runs every few thousand steps on a fast job, and a list gaining one 2 KiB tensor
per step is invisible in host RSS (freed heap chunks absorb it). What is cheap is where new objects
live: CPython keeps every gc-tracked object allocated since the last collection in generation 0, and
in a training loop, whose allocations and frees balance, it stays small (a collection runs once it
exceeds ``threshold0``, 700 by default). Every ``scan_every`` steps the tracker lists the tensors
there and takes *weak* references to them; a tensor still alive at the next
scan has outlived a step boundary by ``scan_every`` steps: it is counted in its group (device, dtype,
shape, has grad_fn) and a weakref callback uncounts it when it dies. A tensor that a collection moves
to an older generation between two scans is caught by a ``gc.callbacks`` hook that lists the young
tensors of generation 0 when any collection starts. So ``groups()`` gives the number of long-lived
tensors per group, exact to ``scan_every`` steps, with no heap scan and no strong reference: object
lifetimes never change. benchmarks/bench_leak.py measures the cost per step.

What it cannot see: tensors only C++ holds (saved activations without a Python wrapper: the census's
graph walk covers those) and tensors that were already old at attach (the baseline). Under
``gc.disable()`` the young generation holds everything allocated since; the scan spaces itself out
when it gets slow.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from gpumemd.probes.heap.gc_pause import collector_paused
from gpumemd.records.device import Device

log = logging.getLogger("gpumemd")

MAX_TRACKED = 200_000
"""Long-lived tensors tracked at most; beyond it new ones are not counted (``capped``). Each costs ~200
bytes here (a 112-byte weakref with four slots, its dict entry and its id: group keys are shared), and
torch keeps the 64-byte Python object of its storage, made when it is sized, while the tensor lives:
~52 MB at the cap (measured: benchmarks/bench_survivor_memory.py)."""

MAX_GROUPS = 256
"""Distinct (device, dtype, shape, graph) groups at most; further shapes share one overflow group."""

OVERFLOW = ("*", "*", (), False)
_MAX_PENDING = 100_000  # candidates between two scans (a job that makes tensors faster is sampled)
_SAMPLES = 4  # newest members kept (weakly) per group, for holder look-ups

YOUNG_COLLECT_AT = 256
"""Objects in generation 0 beyond which a scan runs the young collection itself (``threshold0`` when
that is lower). CPython collects generation 0 when allocations minus deallocations of tracked objects
pass ``threshold0``; a job in steady state (and the agent's own ring of step records, once full) frees
an old object for each new one, so that count stays low while generation 0's list grows by the
survivors of every step: 20,000 objects after 10,000 steps, a 300 µs scan (measured). Most of that
growth is the agent's own (two objects per step record, one floor tuple per 10 steps: ~25 objects
between two scans of a 1 ms job), and listing generation 0 is the largest part of a scan and grows with
it: collecting at 256 objects (listing ~130 on average) instead of 2,000 costs a 1 ms job ~2.5 µs a step
less, and the collection (of ~256 objects, every ~10 scans) is the one CPython would have run a little
later: it only moves survivors on (and frees young cyclic garbage a little sooner). Never under
``gc.disable()`` or a zero threshold."""

# device name, dtype, shape, has grad_fn: strings while scanning (they hash in C); a group's
# ``device`` is the Device.
GroupKey = tuple[str, str, tuple[int, ...], bool]


class _Ref(weakref.ref[Any]):
    __slots__ = ("base", "key", "nbytes", "tid")
    key: GroupKey
    nbytes: int
    tid: int
    base: int  # id of the base tensor when this one is a view, else 0


@dataclass(frozen=True, slots=True)
class SurvivorGroup:
    key: GroupKey
    count: int
    nbytes: int

    @property
    def device(self) -> Device:
        return Device.parse(self.key[0])

    @property
    def graph(self) -> bool:
        return self.key[3]

    def describe(self) -> str:
        _, dtype, shape, graph = self.key
        if self.key == OVERFLOW:
            return "tensors of other shapes"
        text = f"{dtype}[{', '.join(str(d) for d in shape)}]"
        return text + " with grad_fn" if graph else text


class SurvivorTracker:
    """Counts tensors promoted to the oldest gc generation, per group; see the module docstring."""

    def __init__(self, *, max_tracked: int = MAX_TRACKED) -> None:
        import torch

        self._tensor_types = frozenset({torch.Tensor})  # exact type: parameters are not the leak
        self.max_tracked = max_tracked
        self._refs: dict[int, _Ref] = {}
        self._counts: dict[GroupKey, int] = {}
        self._bytes: dict[GroupKey, int] = {}
        self._samples: dict[GroupKey, deque[_Ref]] = {}
        self._view_bases: dict[int, int] = {}  # id of a counted view's base -> views counted on it
        # Candidates listed at the last scan (counted at the next one if alive) and those the gc
        # callback listed since (they become candidates at the next scan, so that a tensor is
        # counted only once it has outlived at least one whole scan interval).
        self._pending: list[weakref.ref[Any]] = []
        self._listed: list[weakref.ref[Any]] = []
        self._installed = False
        self._collecting = False  # our own young collection: its callback has nothing new to list
        self.collections = 0  # collections seen
        self.callback_seconds = 0.0  # time in the gc callback not yet taken by take_callback_seconds()
        self.young_objects = 0  # objects in the young generations at the last look
        # The tracker reached its cap at least once: tensors made while it was there were never counted,
        # so from then on every count is a lower bound, and one that stays flat says nothing.
        self.capped = False
        self.errors = 0
        self._dtypes: dict[Any, str] = {}
        self._devices: dict[Any, str] = {}
        # One key object per group, shared by its tensors' refs (a fresh key tuple and shape tuple
        # per tensor were ~120 bytes each). Bounded: keys beyond ``max_groups`` become OVERFLOW.
        self._keys: dict[GroupKey, GroupKey] = {OVERFLOW: OVERFLOW}

    # --- lifecycle ---------------------------------------------------------------------------

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._on_gc)
            self._installed = False
        self._pending.clear()
        self._listed.clear()
        self._refs.clear()  # the weakrefs die with the dict: their callbacks never run
        self._view_bases.clear()
        self._counts.clear()
        self._bytes.clear()
        self._samples.clear()
        self._keys = {OVERFLOW: OVERFLOW}

    # --- reading (training thread, every few steps) ------------------------------------------

    def groups(self) -> list[SurvivorGroup]:
        return [SurvivorGroup(k, c, self._bytes.get(k, 0)) for k, c in list(self._counts.items())]

    def total(self) -> tuple[int, dict[Device, int]]:
        """(tensors, bytes per device) of everything tracked."""
        by_name: dict[str, int] = {}
        for key, nbytes in list(self._bytes.items()):
            by_name[key[0]] = by_name.get(key[0], 0) + nbytes
        return len(self._refs), {Device.parse(name): nbytes for name, nbytes in by_name.items()}

    def sample(self, key: GroupKey) -> Any:
        """The newest live member of a group (a strong reference: the caller drops it soon)."""
        for ref in reversed(self._samples.get(key, ())):
            obj = ref()
            if obj is not None:
                return obj
        return None

    def new_graph_roots(self, limit: int) -> list[Any]:
        """Up to ``limit`` tensors with a ``grad_fn`` made since the last scan and still alive, newest
        first (strong references: the caller drops them soon). Read right after ``scan()``."""
        out: list[Any] = []
        for ref in reversed(self._pending):
            t = ref()
            if t is not None and t.grad_fn is not None:
                out.append(t)
                if len(out) >= limit:
                    break
        return out

    def new_tensors(self) -> list[Any]:
        """The tensors made since the last scan and still alive, as listed by it (strong references:
        the caller drops the list soon). Read right after ``scan()``: what grows by being replaced
        each step (``torch.cat`` onto a kept tensor) is only ever here, never counted."""
        return [t for ref in self._pending if (t := ref()) is not None]

    def long_lived_graph_samples(self, limit: int) -> list[Any]:
        """The newest live members of the groups that have a ``grad_fn`` (strong references: drop
        them soon). An accumulator updated in place (``total += loss``) stays one long-lived tensor
        whose ``grad_fn`` changes every step: it is never a new tensor, so look at these too."""
        out: list[Any] = []
        for key, samples in list(self._samples.items()):
            if not key[3]:
                continue
            for ref in reversed(samples):
                t = ref()
                if t is not None:
                    out.append(t)
                    if len(out) >= limit:
                        return out
        return out

    # --- scanning (training thread) and the gc callback (any thread) ---------------------------

    def scan(self) -> None:
        """Count the candidates of the last scan that are still alive, then list the young tensors
        as the next candidates. Called at step ends, every ``scan_every`` steps."""
        try:
            # Each counted tensor gets a tracked weakref that outlives the scan: 2,000 of them (a
            # 10-tensor/step leak between two scans) set off several collections inside the loop, a
            # full one among them now and then, which cost the job 4x the counting (78 against 19
            # µs/step at ~2 ms steps). Held off, the one collection they call for comes at the job's
            # next allocation.
            with collector_paused():
                self._count_survivors()
            listed, self._listed = self._listed, []
            self._pending = listed + self._young(collect=True)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not disturb the job
            self.errors += 1
            self._pending.clear()
            if self.errors == 1:
                log.info("gpumemd: survivor scan failed (%s: %s)", type(exc).__name__, exc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # A collection moves generation 0's survivors to an older generation, where no scan looks:
        # list them as candidates first (weakly: holding them would keep cyclic garbage
        # alive through the very collection that is about to free it).
        if phase != "start" or self._collecting:
            return
        start = time.perf_counter()
        try:
            self.collections += 1
            if len(self._listed) < _MAX_PENDING:
                self._listed.extend(self._young())
        except Exception:  # noqa: BLE001 - never disturb the collector
            self.errors += 1
        self.callback_seconds += time.perf_counter() - start

    def take_callback_seconds(self) -> float:
        """Seconds spent in the gc callback since the last call (the agent counts them as its own)."""
        seconds, self.callback_seconds = self.callback_seconds, 0.0
        return seconds

    def _young(self, *, collect: bool = False) -> list[weakref.ref[Any]]:
        if len(self._refs) >= self.max_tracked:
            self.capped = True
            return []
        types = self._tensor_types
        # Generation 0 only: every collection (the callback above) lists it before moving its
        # survivors on, so a tensor is seen in generation 0 at least once whatever happens to it.
        young = gc.get_objects(generation=0)
        self.young_objects = len(young)
        found = list(itertools.compress(young, map(types.__contains__, map(type, young))))
        young.clear()
        # Only from a scan: inside the gc callback a collection is already starting.
        threshold0 = gc.get_threshold()[0] if collect else 0
        if threshold0 > 0 and self.young_objects > min(YOUNG_COLLECT_AT, threshold0) and gc.isenabled():
            self._collecting = True
            try:
                gc.collect(0)
            finally:
                self._collecting = False
        refs = self._refs
        out = [weakref.ref(t) for t in found if id(t) not in refs]
        found.clear()
        return out

    def _count_survivors(self) -> None:
        """Count the candidates still alive. A leak of one tensor a step puts every one of its tensors
        through here once, so this is the cost of tracking it, per leaked tensor: each torch attribute
        read costs ~0.1-0.5 µs, so each is read once, and a group's counts, bytes and samples are
        updated once per scan, not once per tensor."""
        pending, self._pending = self._pending, []
        refs, bases, died = self._refs, self._view_bases, self._died
        alive = [t for ref in pending if (t := ref()) is not None and id(t) not in refs]
        pending.clear()
        # Each storage once: a view keeps its base tensor alive (``kept.append(out.detach()[:4])``
        # keeps the whole ``out.detach()``), so the base of a counted view is not counted itself:
        # the view is, and its holder is the container, not "no Python holder".
        with_base = [(t, t._base) for t in alive]
        alive.clear()
        batch = {id(b) for _, b in with_base if b is not None}
        added: dict[GroupKey, list[_Ref]] = {}
        t = base = None
        for t, base in with_base:
            tid = id(t)
            if tid in bases or tid in batch:
                continue
            if len(refs) >= self.max_tracked:
                self.capped = True
                break
            try:
                key, nbytes = self._describe(t)
            except Exception:  # noqa: BLE001 - an exotic tensor: not counted
                self.errors += 1
                continue
            r = _Ref(t, died)
            r.key, r.nbytes, r.tid, r.base = key, nbytes, tid, id(base) if base is not None else 0
            if r.base:
                bases[r.base] = bases.get(r.base, 0) + 1
                counted_base = refs.get(r.base)
                if counted_base is not None:  # counted at an earlier scan, before its view was seen
                    self._uncount(counted_base)
            refs[tid] = r
            group = added.get(key)
            if group is None:
                added[key] = [r]
            else:
                group.append(r)
        del t, base
        with_base.clear()
        for key, group in added.items():
            self._add(key, group)

    def _add(self, key: GroupKey, group: list[_Ref]) -> None:
        """Count a scan's new members of one group (their refs already carry the described key)."""
        if key not in self._counts and len(self._counts) >= MAX_GROUPS:
            key = OVERFLOW
        key = self._keys.get(key) or self._intern(key)
        for r in group:
            r.key = key  # the interned key, shared (and OVERFLOW past the cap)
        self._counts[key] = self._counts.get(key, 0) + len(group)
        self._bytes[key] = self._bytes.get(key, 0) + sum(r.nbytes for r in group)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=_SAMPLES)
        samples.extend(group[-_SAMPLES:])

    def _intern(self, key: GroupKey) -> GroupKey:
        if len(self._keys) > 2 * MAX_GROUPS:  # groups that died and left their keys behind
            self._keys = {k: k for k in self._counts}
            self._keys[OVERFLOW] = OVERFLOW
        key = (key[0], key[1], tuple(key[2]), key[3])  # a plain tuple, not the torch.Size it was read as
        self._keys[key] = key
        return key

    def _describe(self, t: Any) -> tuple[GroupKey, int]:
        """Its group key (the shape as torch gives it: a ``torch.Size`` hashes and compares as the
        tuple, and ``_intern`` keeps a plain tuple) and its storage's bytes."""
        dev, dt = t.device, t.dtype
        device = self._devices.get(dev)
        if device is None:
            device = self._devices[dev] = str(dev)
        dtype = self._dtypes.get(dt)
        if dtype is None:
            dtype = self._dtypes[dt] = str(dt).removeprefix("torch.")
        return (device, dtype, t.shape, t.grad_fn is not None), t.untyped_storage().nbytes()

    def _died(self, ref: _Ref) -> None:
        if self._refs.get(ref.tid) is not ref:
            return  # uninstalled, uncounted as a view's base, or an id reused after a reset
        self._uncount(ref)

    def _uncount(self, ref: _Ref) -> None:
        del self._refs[ref.tid]
        if ref.base:
            n = self._view_bases.get(ref.base, 0) - 1
            if n > 0:
                self._view_bases[ref.base] = n
            else:
                self._view_bases.pop(ref.base, None)
        key = ref.key
        n = self._counts.get(key, 0) - 1
        if n > 0:
            self._counts[key] = n
            self._bytes[key] = self._bytes.get(key, 0) - ref.nbytes
        else:
            self._counts.pop(key, None)
            self._bytes.pop(key, None)
            self._samples.pop(key, None)
