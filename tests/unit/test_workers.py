"""The job's child processes: the probe, their growth since first seen, and what a finding says."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gpumemd.analysis.culprit_sentences import workers_holder, workers_noun, workers_sentence
from gpumemd.analysis.leak_headline import holder_words
from gpumemd.analysis.worker_growth import WorkerGrowth
from gpumemd.probes.process.workers import WorkersProbe
from gpumemd.records.findings import Culprit

PAGE = os.sysconf("SC_PAGE_SIZE")


def _fake_proc(root: Path, pid: int, tid: int, children: dict[int, int], *, rollup: bool = True) -> Path:
    """A /proc tree: ``pid``'s thread ``tid`` has ``children`` (pid -> resident pages)."""
    task = root / str(pid) / "task" / str(tid)
    task.mkdir(parents=True)
    (task / "children").write_text(" ".join(str(c) for c in children) + " ")
    for child, pages in children.items():
        (root / str(child)).mkdir()
        (root / str(child) / "statm").write_text(f"9999 {pages} 10 1 0 50 0\n")
        if rollup:
            (root / str(child) / "smaps_rollup").write_text(
                f"00400000-ffffffffff600000 ---p 00000000 00:00 0   [rollup]\nRss: {pages * 4} kB\n"
                "Pss: 300 kB\nPrivate_Clean: 8 kB\nPrivate_Dirty: 92 kB\n")
    return root


def test_the_sampler_reading_lists_every_threads_children_with_uss_and_pss(tmp_path: Path) -> None:
    probe = WorkersProbe(proc=str(_fake_proc(tmp_path, 100, 100, {201: 50, 202: 70})), pid=100)
    sample = probe.read()
    assert sample is not None
    assert sample.pids == (201, 202)
    assert sample.rss_bytes == 120 * PAGE
    assert sample.pss_bytes == 600 * 1024 and sample.uss_bytes == 200 * 1024
    probe.close()


def test_the_per_step_reading_is_rss_only_and_drops_a_child_that_exited(tmp_path: Path) -> None:
    probe = WorkersProbe(proc=str(_fake_proc(tmp_path, 100, 100, {201: 50}, rollup=False)), pid=100)
    probe.read()  # the sampler listed 201
    first = probe.rss()
    assert first is not None and [(w.pid, w.rss_bytes, w.uss_bytes) for w in first.workers] == [(201, 50 * PAGE, None)]
    (tmp_path / "201" / "statm").write_text("")  # an exited child's file reads nothing
    gone = probe.rss()
    assert gone is not None and gone.workers == ()
    probe.close()


def test_a_real_child_is_seen_by_the_training_thread_without_the_sampler() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    probe = WorkersProbe()
    try:
        deadline = time.monotonic() + 10
        sample = probe.rss()
        while (sample is None or child.pid not in sample.pids) and time.monotonic() < deadline:
            sample = probe.rss()
        assert sample is not None and child.pid in sample.pids
        assert next(w for w in sample.workers if w.pid == child.pid).rss_bytes > 0  # (seen from its fork on)
    finally:
        child.kill()
        child.wait()
        probe.close()


def test_growth_since_first_seen_ramps_for_a_growing_worker_and_a_restart_starts_again() -> None:
    growth = WorkerGrowth()
    assert growth.update([(1, 1000), (2, 1000)]) == 0
    assert growth.update([(1, 1500), (2, 1200)]) == 700
    # a new epoch's workers: their growth starts from nothing, the old ones' went with them
    assert growth.update([(3, 5000), (4, 5000)]) == 0
    # an eval loader's short-lived worker beside them adds nothing until it grows
    assert growth.update([(3, 5100), (4, 5000), (9, 9000)]) == 100


def test_a_workers_finding_names_them_their_dataset_and_what_to_try() -> None:
    text = workers_sentence((41, 42), 300 * 1024, 120, [("CachingDataset (train.data)", True)])
    assert text.startswith("DataLoader workers (2, pids 41, 42) +300.0 KiB/step each since step 120")
    assert "running CachingDataset (train.data), persistent_workers=True" in text
    assert "copy-on-read" in text and "bound it" in text
    assert workers_noun((7,), False) == "child processes (1, pid 7)"
    culprit = Culprit("DataLoader workers", 2, 0, holder=workers_holder((41, 42), ["CachingDataset"]),
                      category="workers")
    assert holder_words([culprit], ()) == "in DataLoader workers (2, pids 41, 42) running CachingDataset"


def test_the_workers_are_an_item_of_their_own_in_a_host_oom_breakdown() -> None:
    from gpumemd.analysis.breakdown import cpu_breakdown
    from gpumemd.records.samples import HostSample, WorkerSample, WorkersSample

    gib = 1 << 30
    host = HostSample(rss_bytes=4 * gib, available_bytes=gib, total_bytes=16 * gib)
    workers = WorkersSample(tuple(WorkerSample(p, 5 * gib, pss_bytes=int(2.275 * gib)) for p in (1, 2, 3, 4)))
    items = {i.key: i for i in cpu_breakdown(host=host, workers=workers).items}
    assert items["workers"].nbytes == int(2.275 * gib) * 4  # their PSS: ~9.1 GiB
    assert items["workers"].label.startswith("the job's worker processes")
    assert items["non_pytorch"].nbytes == 16 * gib - gib - 4 * gib - items["workers"].nbytes
    assert "workers" not in {i.key for i in cpu_breakdown(host=host).items}
