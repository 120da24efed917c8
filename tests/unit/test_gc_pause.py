"""The agent's heap walks never set off a collection of the job's heap, and leave the job's collector
setting as they found it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from gpumemd.probes.census import take_census
from gpumemd.probes.gc_pause import collector_paused, job_collector_enabled


@pytest.fixture
def eager_collector() -> Iterator[list[int]]:
    """Thresholds at which any walk's allocations set off collections (the older generations' too,
    as far as the interpreter's own rules let them); the generations of the collections that start."""
    started: list[int] = []
    here = threading.get_ident()

    def note(phase: str, info: dict[str, int]) -> None:
        # this thread's only: another thread's explicit gc.collect() (a test runner's) is not the walk's
        if phase == "start" and threading.get_ident() == here:
            started.append(info["generation"])

    thresholds = gc.get_threshold()
    gc.set_threshold(10, 1, 1)
    gc.callbacks.append(note)
    try:
        yield started
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*thresholds)


def test_a_census_sets_off_no_collection(eager_collector: list[int]) -> None:
    kept = [[] for _ in range(5000)]  # noqa: F841 - a heap for the census to walk
    take_census(holders=0)
    assert eager_collector  # the walk without the pause: it set off collections
    eager_collector.clear()
    with collector_paused():
        assert not gc.isenabled() and job_collector_enabled()
        take_census(holders=0)
    assert eager_collector == [] and gc.isenabled()


def test_a_job_that_disabled_the_collector_keeps_it_disabled() -> None:
    gc.disable()
    try:
        with collector_paused(), collector_paused():
            assert not job_collector_enabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with collector_paused(), collector_paused():
        assert job_collector_enabled()  # nested pauses tell the job's own setting
    assert gc.isenabled()
