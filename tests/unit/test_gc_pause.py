"""The agent's heap walks never set off a collection of the job's heap, and leave the job's collector
setting as they found it."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from gpumemd.probes.heap.gc_pause import collector_paused, hold_automatic, job_collector_enabled, release_automatic

_WALKS = """
import gc, json
from gpumemd.probes.census.census_steps import take_census
from gpumemd.probes.heap.gc_pause import collector_paused
started = []
gc.callbacks.append(lambda phase, info: phase == "start" and started.append(info["generation"]))
kept = [[] for _ in range(5000)]  # a heap for the census to walk
gc.set_threshold(10, 1, 1)  # any walk's allocations now set off collections
take_census(holders=0)
unpaused, started[:] = list(started), []
with collector_paused():
    take_census(holders=0)
print(json.dumps([unpaused, started, gc.isenabled()]))
"""


def test_a_census_sets_off_no_collection() -> None:
    # A fresh interpreter: in a test session, other tests' leftovers (finalizers, threads) may collect
    # explicitly while the census runs, which no pause can or should prevent.
    out = subprocess.run([sys.executable, "-c", _WALKS], capture_output=True, text=True, timeout=120, check=True)
    unpaused, paused, enabled_after = json.loads(out.stdout.strip().splitlines()[-1])
    assert unpaused  # the walk without the pause: it set off collections
    assert paused == [] and enabled_after


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


def test_a_hold_stops_automatic_collections_and_gives_the_jobs_thresholds_back() -> None:
    job = gc.get_threshold()
    hold = hold_automatic()
    try:
        assert hold is not None and gc.get_threshold() == (0, job[1], job[2]) and gc.isenabled()
        assert hold_automatic() is None  # one hold at a time: a nested one changes nothing
    finally:
        release_automatic(hold)
    assert gc.get_threshold() == job


def test_thresholds_the_job_sets_during_a_hold_are_kept() -> None:
    job = gc.get_threshold()
    hold = hold_automatic()
    try:
        gc.set_threshold(5000, 20, 20)  # the job's own tuning, while a census is under way
        release_automatic(hold)
        assert gc.get_threshold() == (5000, 20, 20)
    finally:
        gc.set_threshold(*job)


def test_a_process_forked_during_a_hold_runs_the_jobs_thresholds() -> None:
    job = gc.get_threshold()
    hold = hold_automatic()
    try:
        pid = os.fork()  # as a DataLoader forks its workers
        if pid == 0:
            os._exit(0 if gc.get_threshold() == job else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release_automatic(hold)
    assert os.waitstatus_to_exitcode(status) == 0
