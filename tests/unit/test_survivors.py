"""SurvivorTracker: long-lived tensors counted per group from the young gc generation."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from gpumemd.probes.survival.survivor_counts import GroupKey
from gpumemd.probes.survival.survivors import SurvivorTracker


def _count(tracker: SurvivorTracker, key: GroupKey) -> int:
    return next((g.count for g in tracker.counts.groups() if g.key == key), 0)


def _tracker() -> SurvivorTracker:
    t = SurvivorTracker()
    t.install()
    return t


def test_kept_tensors_are_counted_once_per_group_and_temporaries_never() -> None:
    tracker = _tracker()
    try:
        kept = []
        for step in range(50):
            torch.randn(64) * 2  # a temporary: dies within the step
            kept.append(torch.zeros(4, 8))
            if step % 10 == 0:
                tracker.scan()
        tracker.scan()
        key = ("cpu", "float32", (4, 8), False)
        # Counted once it outlived a whole scan interval: those made up to the scan at step 40.
        assert _count(tracker, key) == 41
        tracker.scan()
        assert _count(tracker, key) == 50
        groups = {g.key: g for g in tracker.counts.groups()}
        assert groups[key].nbytes == 50 * 4 * 8 * 4
        assert ("cpu", "float32", (64,), False) not in groups
        assert tracker.counts.sample(key) is kept[-1]
    finally:
        tracker.uninstall()


def test_a_kept_view_counts_its_storage_once_not_its_base_too() -> None:
    # ``kept.append(out.detach()[:4])``: the view keeps its base (the whole detached output) alive
    tracker = _tracker()
    try:
        kept = []
        for step in range(30):
            out = torch.randn(32, 10)
            kept.append(out.detach()[:4])
            del out
            if step % 10 == 0:
                tracker.scan()
        tracker.scan()
        tracker.scan()
        groups = {g.key: g for g in tracker.counts.groups()}
        view = ("cpu", "float32", (4, 10), False)
        assert groups[view].count == 30 and groups[view].nbytes == 30 * 32 * 10 * 4  # the whole storage
        assert ("cpu", "float32", (32, 10), False) not in groups  # the base: not a second leak
    finally:
        tracker.uninstall()


def test_dead_tensors_are_uncounted_by_their_weakref() -> None:
    tracker = _tracker()
    try:
        kept = [torch.zeros(3) for _ in range(10)]
        tracker.scan()
        tracker.scan()
        key = ("cpu", "float32", (3,), False)
        assert _count(tracker, key) == 10
        del kept[:6]
        assert _count(tracker, key) == 4
        kept.clear()
        assert _count(tracker, key) == 0 and tracker.counts.groups() == []
    finally:
        tracker.uninstall()


def test_tensors_moved_to_an_older_generation_between_scans_are_still_counted() -> None:
    tracker = _tracker()
    try:
        tracker.scan()
        kept = [torch.zeros(5) for _ in range(10)]
        gc.collect(0)  # moves them out of generation 0 before the next scan looks
        tracker.scan()
        tracker.scan()
        assert _count(tracker, ("cpu", "float32", (5,), False)) == 10
        assert tracker.collections >= 1
        del kept
    finally:
        tracker.uninstall()


def test_holds_no_strong_reference() -> None:
    tracker = _tracker()
    try:
        kept = [torch.zeros(7)]
        ref = weakref.ref(kept[0])
        tracker.scan()
        tracker.scan()
        assert _count(tracker, ("cpu", "float32", (7,), False)) == 1
        kept.clear()
        assert ref() is None
    finally:
        tracker.uninstall()


def test_graph_roots_are_the_newest_tensors_with_a_grad_fn() -> None:
    tracker = _tracker()
    try:
        w = torch.ones(3, requires_grad=True)
        tracker.scan()
        a = w * 2
        b = a + 1
        plain = torch.zeros(2)
        tracker.scan()
        roots = tracker.new_graph_roots(8)
        assert roots[:2] == [b, a] or [id(r) for r in roots[:2]] == [id(b), id(a)]
        assert all(r.grad_fn is not None for r in roots) and not any(r is plain for r in roots)
        assert len(tracker.new_graph_roots(1)) == 1
    finally:
        tracker.uninstall()


def test_uninstall_removes_the_gc_callback() -> None:
    tracker = _tracker()
    assert tracker._on_gc in gc.callbacks
    tracker.uninstall()
    assert tracker._on_gc not in gc.callbacks


def test_counting_sets_off_no_collection_and_leaves_the_job_setting() -> None:
    # Each counted tensor gets a tracked weakref: counting thousands would otherwise start
    # collections (a full one now and then) in the middle of the loop.
    tracker = _tracker()
    counted_at_collections: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            counted_at_collections.append(len(tracker.counts.refs))

    threshold = gc.get_threshold()
    gc.set_threshold(50, threshold[1], threshold[2])  # a collection every 50 new tracked objects
    gc.callbacks.append(seen)
    try:
        kept = [torch.zeros(2) for _ in range(1000)]
        tracker.scan()
        counted_at_collections.clear()
        tracker.scan()  # counts the 1,000 (the loop makes a weakref for each sampled one)
        assert _count(tracker, ("cpu", "float32", (2,), False)) == 1000
        assert all(n in (0, len(tracker.counts.refs)) for n in counted_at_collections), counted_at_collections
        assert gc.isenabled()
        gc.disable()  # a job that runs without the collector keeps it so
        kept += [torch.zeros(2) for _ in range(10)]
        tracker.scan()
        tracker.scan()
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
        tracker.uninstall()


def test_a_sampled_groups_other_members_are_counted_once_even_if_a_collection_lists_them() -> None:
    tracker = _tracker()
    young = tracker._young

    def after_a_collection(*, collect: bool = False, skip: set[int] | frozenset[int] = frozenset(),
                           collect_over: int | None = None) -> list[Any]:
        if collect:  # the collection the counting held off starts just before the scan's own one
            gc.collect(0)
        return young(collect=collect, skip=skip, collect_over=collect_over)

    try:
        kept = [torch.zeros(5) for _ in range(100)]
        tracker.scan()  # listed as candidates
        tracker._young = after_a_collection  # type: ignore[method-assign]
        tracker.scan()  # counted: 16 samples stand for the 100
        tracker._young = young  # type: ignore[method-assign]
        tracker.scan()
        tracker.scan()
        assert _count(tracker, ("cpu", "float32", (5,), False)) == 100
        assert len(tracker.counts.refs) == 16
        del kept
    finally:
        tracker.uninstall()



def test_a_scan_that_keys_a_sample_still_counts_a_leak_exactly() -> None:
    tracker = _tracker()
    try:
        kept: list[torch.Tensor] = []
        read = []
        describe = tracker.counts.describe
        tracker.counts.describe = lambda tensors: read.append(len(tensors)) or describe(tensors)  # type: ignore[method-assign]
        for _ in range(6):
            kept.extend(torch.zeros(16) for _ in range(300))
            tracker.scan(keyed_at_most=32)
            tracker.new_tensors()
        tracker.scan(keyed_at_most=32)
        key = ("cpu", "float32", (16,), False)
        assert _count(tracker, key) == 1800  # each of the 300 a scan counted once
        assert read == [16] * 6  # the families' keys: the newest 16 of the 300 only
        assert len(tracker.counts.refs) <= 6 * 16  # a few refs a scan, each standing for its stratum
        del kept[:900]
        assert 700 <= _count(tracker, key) <= 1100  # the strata die with their members, about
    finally:
        tracker.uninstall()


def test_a_sample_of_a_patterned_loop_counts_each_group_about_right() -> None:
    """Random picks: a loop whose survivors alternate two shapes is not read as one of them."""
    tracker = _tracker()
    try:
        tracker.scan(keyed_at_most=32)
        # 2,048 in 32 strata of 64: picks spaced evenly would all fall on one shape
        kept = [torch.zeros(8) if i % 2 else torch.zeros(2, 2) for i in range(2048)]
        tracker.scan(keyed_at_most=32)
        tracker.scan(keyed_at_most=32)
        counts = {g.key[2]: g.count for g in tracker.counts.groups()}
        assert sum(counts.values()) == 2048  # every survivor stood for once
        assert 512 <= counts.get((8,), 0) <= 1536 and 512 <= counts.get((2, 2), 0) <= 1536, counts
        more = [torch.zeros(2, 2) for _ in range(20)]
        tracker.scan()  # tracking ended: each candidate keyed again
        tracker.scan()
        assert {g.key[2]: g.count for g in tracker.counts.groups()}[(2, 2)] == counts[(2, 2)] + 20
        del kept, more
    finally:
        tracker.uninstall()
