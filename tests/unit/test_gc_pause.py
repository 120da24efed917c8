"""The agent's heap walks never set off a collection of the job's heap, and leave the job's collector
setting as they found it."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

from gpumemd.probes.gc_pause import collector_paused, job_collector_enabled

_WALKS = """
import gc, json
from gpumemd.probes.census import take_census
from gpumemd.probes.gc_pause import collector_paused
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
