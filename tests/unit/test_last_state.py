"""The state file a SIGKILL leaves behind: when it is written, what it holds (bounded), and what
``gpumemd report`` says from it: how the process ended, or that it vanished and what it knew."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from fakes import ManualClock

from gpumemd import signal_locks
from gpumemd.cli import main
from gpumemd.components.state_writer import LastStateComponent
from gpumemd.records.census import Census, CensusGroup, GroupKey
from gpumemd.records.device import Device
from gpumemd.records.findings import Finding
from gpumemd.records.samples import AllocatorSample, HostSample, NvmlDeviceSample, WorkerSample, WorkersSample
from gpumemd.records.step import AgentState, Identity, StepRecord

GiB = 1024**3


def finding(n: int, state: str = "confirmed") -> Finding:
    return Finding(kind="tensor_leak", series=f"allocated_bytes{{device=0,n={n}}}", state=state,
                   slope_bytes_per_step=1e6 + n, slope_low=9e5, slope_high=1.1e6, onset_step=50,
                   growth_bytes=3 * GiB, steps_to_oom=1200.0, first_step=100, updated_step=900,
                   summary="tensor leak confirmed " + "x" * 5000, device=Device.cuda(0),
                   headline=f"tensor leak confirmed: +1 tensor/step held by `kept` ({n})")


class View:
    """The part of the agent the component reads, over a state the test sets."""

    def __init__(self, out: str) -> None:
        self.output_dir = out
        self.seconds_per_step = 0.25
        self.state_now = AgentState(identity=Identity(rank=3, pid=4242, hostname="node7"), attached_at=1e9,
                                    updated_at=1e9, step=10, steps_total=11)

    @property
    def published(self) -> AgentState:
        return self.state_now

    def state(self) -> AgentState:
        return self.state_now

    def run_in_background(self, errand: Any) -> bool:
        """The sampler's thread, as the agent hands it errands: a thread per errand here."""
        threading.Thread(target=errand).start()
        return True


def read(out: str) -> dict[str, Any]:
    return json.loads((Path(out) / "gpumemd-state-rank3.json").read_text())


def test_written_on_the_first_step_on_changes_and_otherwise_every_interval(tmp_path: Path) -> None:
    clock = ManualClock(100.0)
    out = str(tmp_path / "out")
    component, view = LastStateComponent(every_s=10.0, clock=clock), View(out)
    component.start(view)  # type: ignore[arg-type]
    record = StepRecord(step=10, wall_time=1e9, duration_s=0.25)
    component.on_step(record)
    component.drain()  # the step end hands the file to the component's writer thread
    assert component.writes == 1 and read(out)["step"] == 10 and read(out)["ended"] is None
    clock.now += 5
    view.state_now = dataclasses.replace(view.state_now, step=30)
    component.on_step(record)
    component.drain()
    assert component.writes == 1  # nothing new, and not yet due
    view.state_now = dataclasses.replace(view.state_now, findings=(finding(0, "suspected"),))
    component.on_step(record)
    component.drain()
    assert component.writes == 2 and read(out)["findings"][0]["state"] == "suspected"  # a change: at once
    clock.now += 10
    component.on_step(record)
    component.drain()
    assert component.writes == 3  # due
    view.state_now = dataclasses.replace(view.state_now, ended="SIGTERM", ended_at=1e9 + 60)
    component.stop()
    assert read(out)["ended"] == "SIGTERM" and component.writes == 4
    assert [p.name for p in Path(out).iterdir()] == ["gpumemd-state-rank3.json"]  # no temp file left


@pytest.mark.parametrize("how", ["flush", "stop"])
def test_a_signals_writer_writes_while_the_interrupted_thread_holds_the_writers_lock(tmp_path: Path, how: str) -> None:
    # A signal came while the training thread wrote the state file (news is written at the step end);
    # its handler waits for the flush (or, at a SIGTERM the job does not handle, the stop), which runs
    # on a thread of its own and waited for that lock until the signal's 25 s deadline: "writing what
    # the agent knows took over 25 s; the job ends without it" (tests/integration/test_job_endings.py).
    out = str(tmp_path / "out")
    component, view = LastStateComponent(), View(out)
    component.start(view)  # type: ignore[arg-type]
    view.state_now = dataclasses.replace(view.state_now, findings=(finding(0),), ended="SIGTERM")
    component._handled.acquire()  # the interrupted write on this (the "training") thread
    try:
        def as_the_signals_writer() -> None:
            with signal_locks.writing():
                getattr(component, how)()

        flush = threading.Thread(target=as_the_signals_writer)
        flush.start()
        flush.join(timeout=30)
        assert not flush.is_alive()
    finally:
        component._handled.release()
    assert read(out)["findings"][0]["state"] == "confirmed" and read(out)["ended"] == "SIGTERM"


def test_a_run_whose_findings_were_all_cleared_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # An epoch's list of outputs, emptied at its end: confirmed in epoch 1, then cleared. The exit line
    # says "1 growth cleared"; the report said only "no live leak finding".
    out = str(tmp_path / "out")
    component, view = LastStateComponent(), View(out)
    view.state_now = dataclasses.replace(view.state_now, findings=(finding(0, "cleared"), finding(1, "cleared")))
    component.start(view)  # type: ignore[arg-type]
    component.flush()
    assert read(out)["findings"] == [] and read(out)["findings_cleared"] == 2
    write_state(tmp_path / "vanished", findings=[], findings_cleared=2)
    assert main(["report", str(tmp_path / "vanished")]) == 0
    assert "no live leak finding (2 cleared: their lines are in leak-findings-rank0.jsonl)" in capsys.readouterr().out


def test_the_file_stays_small_whatever_the_job_knows(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    component, view = LastStateComponent(), View(out)
    view.state_now = dataclasses.replace(
        view.state_now, findings=tuple(finding(n) for n in range(100)),
        reports=tuple(f"/out/oom-{n}" for n in range(50)),
        nvml=(NvmlDeviceSample(Device.cuda(0), 80 * GiB, 79 * GiB, GiB),),
        host=HostSample(rss_bytes=GiB, available_bytes=10 * GiB, total_bytes=100 * GiB, limit="cgroup"),
        allocator=(AllocatorSample(Device.cuda(0), allocated_bytes=70 * GiB, allocated_peak_bytes=75 * GiB,
                                   reserved_bytes=78 * GiB, cap_bytes=79 * GiB),),
        workers=WorkersSample((WorkerSample(11, GiB), WorkerSample(12, GiB))),
        census=Census(step=9, taken_at=1e9, duration_s=0.1, groups=tuple(
            CensusGroup(GroupKey(Device.cuda(0), "float32", (n,), "other", None), 1, n, holder="x" * 5000)
            for n in range(1, 2001))))
    component.start(view)  # type: ignore[arg-type]
    component.flush()
    doc = read(out)
    assert len(doc["findings"]) == 8 and doc["findings_more"] == 92 and len(doc["reports"]) == 5
    assert os.path.getsize(Path(out) / "gpumemd-state-rank3.json") < 16 * 1024
    assert doc["headroom"][0] == {"where": "cuda:0", "free_bytes": GiB, "total_bytes": 80 * GiB}
    assert doc["headroom"][1]["limit"] == "the cgroup memory limit"
    assert doc["allocator"] == [{"device": 0, "allocated_bytes": 70 * GiB, "reserved_bytes": 78 * GiB,
                                 "peak_bytes": 75 * GiB, "cap_bytes": 79 * GiB}]
    assert doc["workers"] == {"count": 2, "rss_bytes": 2 * GiB}
    groups = doc["tensors"]["groups"]  # the census's three largest of 2,000, as report.json spells them
    assert [g["nbytes"] for g in groups] == [2000, 1999, 1998] and groups[0]["device"] == "cuda:0"
    assert doc["tensors"]["step"] == 9 and len(groups[0]["holder"]) == 600


def write_state(out: Path, **changes: Any) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    doc = {"schema": 1, "pid": int(gone.stdout), "rank": 0, "world_size": 1, "hostname": os.uname().nodename,
           "attached_at": 1e9, "written_at": 1e9 + 600, "step": 4100, "steps_total": 4101, "phase": "train",
           "seconds_per_step": 0.2,
           "headroom": [{"where": "host", "free_bytes": GiB // 2, "total_bytes": 64 * GiB, "rss_bytes": 60 * GiB}],
           "findings": [{"state": "confirmed", "kind": "tensor_leak", "series": "host_rss_bytes", "device": None,
                         "slope_bytes_per_step": 4e6, "growth_bytes": 16 * GiB, "steps_to_oom": 120.0,
                         "hours_to_oom": 0.01, "updated_step": 4000,
                         "headline": "tensor leak confirmed: held by `kept`",
                         "summary": "..."}],
           "findings_more": 0, "ooms_total": 0, "reports": [], "ended": None, "ended_at": None, **changes}
    out.mkdir(exist_ok=True)
    (out / "gpumemd-state-rank0.json").write_text(json.dumps(doc))


def test_report_on_an_output_dir_says_the_job_vanished_and_what_it_knew(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    write_state(tmp_path / "out")
    assert main(["report", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "VANISHED: no clean exit recorded" in text
    assert "at step 4100" in text and "out of memory in ~36 s (~120 steps)" in text and "held by `kept`" in text
    assert "at risk when last seen: confirmed tensor_leak" in text
    assert main(["report", "--json", str(tmp_path / "out")]) == 0
    [view] = json.loads(capsys.readouterr().out)["last_state"]
    assert view["vanished"] is True and view["at_risk"] == "confirmed tensor_leak"


def test_report_says_the_fix_the_exit_line_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The exit line ends "next: <fix>; then gpumemd report DIR", and the report did not say the fix: a
    # person who reads it after the job was killed (no exit line) never saw it.
    out = str(tmp_path / "out")
    component, view = LastStateComponent(), View(out)
    view.state_now = dataclasses.replace(view.state_now, findings=(finding(0),))
    component.start(view)  # type: ignore[arg-type]
    component.flush()
    fix = "keep .detach().cpu() copies, or bound what holds them (a deque(maxlen=N))"
    assert read(out)["findings"][0]["fix"] == fix
    assert main(["report", out]) == 0
    assert f"held by `kept` (0)\n    fix: {fix}\n" in capsys.readouterr().out


def test_report_says_how_a_job_ended_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_state(tmp_path / "out", ended="SIGTERM", ended_at=1e9 + 601)
    assert main(["report", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "ended by SIGTERM at 2001-09-09T01:56:41.000Z" in text and "VANISHED" not in text


def test_a_job_that_ended_before_its_first_step_says_so_not_step_none(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    write_state(tmp_path / "out", ended="exit", ended_at=1e9 + 601, step=None, steps_total=0)
    assert main(["report", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "before the first step ended (0 steps since attach" in text and "None" not in text, text


def test_a_foreign_state_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gpumemd-state-rank0.json").write_text("{not json")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "gpumemd-state-rank0.json: not a readable gpumemd state file" in err and "Traceback" not in err
