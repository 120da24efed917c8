"""The start line and the exit summary: wording on data, then said by a real agent."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import gpumemd
from gpumemd.announce import StartFacts, exit_summary, fix_words, start_line
from gpumemd.api import build_agent
from gpumemd.config import Config
from gpumemd.records.findings import Culprit, Finding
from gpumemd.records.step import AgentState, Identity, Overhead


def _facts(**changes: object) -> StartFacts:
    base: dict[str, object] = dict(pid=4242, rank=0, world_size=1, output_dir="/job/gpumemd-out", metrics_url=None,
                                   devices=(), absent={"allocator": "this torch is a CPU build"})
    base.update(changes)
    return StartFacts(**base)  # type: ignore[arg-type]


def test_start_line_says_output_metrics_devices_and_absent_probes() -> None:
    line = start_line(_facts())
    assert line == ("gpumemd: watching pid 4242 · output /job/gpumemd-out · metrics off (set --port or GPUMEMD_PORT "
                    "to serve Prometheus metrics) · devices: host memory only (no CUDA device in use) · "
                    "absent: allocator: this torch is a CPU build")
    served = start_line(_facts(metrics_url="http://127.0.0.1:9401/metrics", devices=("cuda:1",), absent={},
                               rank=1, world_size=8))
    assert served == ("gpumemd: watching pid 4242, rank 1/8 · output /job/gpumemd-out · "
                      "metrics http://127.0.0.1:9401/metrics · devices: cuda:1")


def _finding(state: str, summary: str, slope: float = 1e6, holder: str | None = None) -> Finding:
    culprits = (Culprit(description="float32[]", count_delta=1, bytes_delta=4, holder=holder),) if holder else ()
    return Finding(kind="tensor_leak", series="tensors{group=x}", state=state, slope_bytes_per_step=slope,
                   slope_low=slope, slope_high=slope, onset_step=10, growth_bytes=0, steps_to_oom=None,
                   first_step=100, updated_step=200, summary=summary, culprits=culprits,
                   headline=f"tensor leak {state}: +1 tensor/step held by {holder}, since step 10")


def _state(**changes: object) -> AgentState:
    overhead = Overhead(training_thread_seconds_total=0.3, census_seconds_total=0.2, wall_seconds=30.0, steps=1000)
    base: dict[str, object] = dict(identity=Identity(), attached_at=0.0, updated_at=30.0, steps_total=1000,
                                   overhead=overhead)
    base.update(changes)
    return AgentState(**base)  # type: ignore[arg-type]


def test_exit_summary_of_a_healthy_run() -> None:
    assert exit_summary(_state(), "/out") == ("gpumemd: 1,000 steps watched in 30.0 s · no leak found · no OOM · "
                                              "agent took 300 ms (1.0% of the run; tensor censuses 200 ms of it)")


def test_exit_summary_of_a_run_of_no_step_says_no_share() -> None:
    # the job failed at its imports: its attach against a few ms of wall time is no share of a run
    overhead = Overhead(training_thread_seconds_total=0.002, wall_seconds=0.004, steps=0)
    assert exit_summary(_state(overhead=overhead, steps_total=0), "/out").endswith(" · agent took 2 ms")


def test_exit_summary_says_the_recent_share_when_one_off_costs_dominate_the_run() -> None:
    # a short run: the whole run's 1.0% is mostly its first census; its last 1,500 steps took 0.4%
    assert exit_summary(_state(), "/out", recent=(1500, 0.004)).endswith(
        "agent took 300 ms (1.0% of the run; tensor censuses 200 ms of it; 0.4% over the last 1,500 steps)")
    # the whole run's share is the steady one: nothing more to say
    assert exit_summary(_state(), "/out", recent=(1500, 0.008)).endswith("tensor censuses 200 ms of it)")


def test_the_recent_share_covers_the_last_thousand_to_two_thousand_steps(out_dir: str) -> None:
    with gpumemd.attached(output_dir=out_dir, quiet=True) as agent:
        _train(900)
        assert agent._step_ends.recent(agent._clock()) is None  # fewer than 1,000 steps
        _train(1700)
        recent = agent._step_ends.recent(agent._clock())
        assert recent is not None
        steps, share = recent
        assert 1000 <= steps < 2000 + 50  # marks are taken at full step ends, at most 50 steps apart
        assert 0 < share < 1


def test_exit_summary_names_each_live_finding_once_worst_first_and_the_reports() -> None:
    findings = (_finding("cleared", "host growth cleared."), _finding("suspected", "small suspected.", 10.0),
                _finding("confirmed", "tensor leak confirmed, ...; held by `losses` → list of 12 items.",
                         holder="`losses` in main() at train.py:7 → list of 12 items"))
    line = exit_summary(_state(findings=findings, reports=("/out/oom-1",), ooms_total=1), "/out")
    assert (" · 2 leak findings: tensor leak held by `losses` in main() at train.py:7 (confirmed, since step 10); "
            "tensor leak (suspected, since step 10) · 1 OOM report: /out/oom-1 · " in line)
    # the exit summary names them; it does not say their state-change lines again, nor stale sizes
    assert all(f.headline not in line and f.summary not in line for f in findings)
    assert "12 items" not in line
    # what to do next comes last: the worst live finding's fix in a few words, and where to read it all
    assert line.endswith(" · output /out · next: keep .detach().cpu() copies, or bound what holds them "
                         "(a deque(maxlen=N)); then gpumemd report /out")
    assert "2 OOMs, no report written" in exit_summary(_state(ooms_total=2), "/out")
    assert exit_summary(_state(ooms_total=2), "/out").endswith(" · next: gpumemd report /out")
    assert "1 growth cleared" in exit_summary(_state(findings=findings[:1]), "/out")


def test_the_fix_of_a_retained_graph_depends_on_what_keeps_it() -> None:
    loss = dataclasses.replace(_finding("confirmed", "s."), kind="graph_leak",
                               series="tensors{device=cpu,group=float32[] with grad_fn}")
    logits = dataclasses.replace(loss, series="tensors{device=cpu,group=float32[64, 10] with grad_fn}")
    assert fix_words(loss) == "keep loss.item() or .detach(), not the tensor with its graph"
    assert fix_words(logits) == "compute what you keep under torch.no_grad(), or keep its .detach()"
    assert fix_words(dataclasses.replace(logits, kind="tensor_leak")).startswith("keep .detach().cpu() copies")
    scalars = dataclasses.replace(loss, kind="tensor_leak", series="tensors{device=cpu,group=float32[]}")
    assert fix_words(scalars).startswith("keep .item() of each, not the tensor")
    # A torchmetrics metric's state keeps every update() until reset(): neither .item() nor a deque is the fix.
    metric = dataclasses.replace(scalars, culprits=(Culprit(
        description="float32[]", count_delta=1, bytes_delta=4,
        holder="`auroc.preds` in <module>() at job.py:8 (a BinaryAUROC's state, kept until reset()) → list"),))
    assert fix_words(metric) == ("call the metric's reset() after compute(), each epoch: it keeps every update() "
                                 "until then")
    # A queue whose consumer thread falls behind (an uploader): bound the queue, or send numbers.
    queued = dataclasses.replace(logits, kind="tensor_leak", culprits=(Culprit(
        description="float32[32, 10]", count_delta=1, bytes_delta=1280,
        holder="`outbox.queue` in <module>() at job.py:7, queued at job.py:22 → deque of 408 items"),))
    assert fix_words(queued).startswith("the queue's consumer falls behind: bound it (Queue(maxsize=N))")


def test_the_fix_of_a_host_leak_depends_on_where_it_grows() -> None:
    host = dataclasses.replace(_finding("confirmed", "s."), kind="host_leak", series="host_rss_bytes")
    held = dataclasses.replace(host, culprits=(Culprit(
        description="list", count_delta=100, bytes_delta=2**20,
        holder="`raw_samples` in <module>() at job.py:9 → list"),))
    assert fix_words(held) == "bound or clear the container that grows every step"
    # No Python container grew with it (malloc's bytes in use rose with RSS): bounding one is not the fix.
    assert fix_words(host) == "look outside Python objects: a C extension's or a native library's allocations grow"
    workers = dataclasses.replace(host, culprits=(Culprit(
        description="DataLoader workers (2, pids 7, 8)", count_delta=2, bytes_delta=2**20, holder="DecodedSampleCache",
        category="workers"),))
    assert fix_words(workers).startswith("bound what the Dataset caches in each worker")


def _train(steps: int) -> None:
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpumemd.status"]


def test_attach_says_what_it_watches_and_detach_what_it_saw(out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpumemd.status")
    with gpumemd.attached(output_dir=out_dir):
        _train(3)
        assert len(_said(caplog)) == 1
    start, summary = _said(caplog)
    assert start.startswith(f"gpumemd: watching pid {os.getpid()} · output {out_dir} · metrics off")
    if not torch.cuda.is_available():
        assert "devices: host memory only" in start and "absent: allocator: this torch is a CPU build" in start
    assert summary.startswith("gpumemd: 3 steps watched in ")
    assert " · no leak found · no OOM · agent took " in summary


def test_quiet_and_other_ranks_say_nothing(out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpumemd.status")
    with gpumemd.attached(output_dir=out_dir, quiet=True):
        _train(2)
    agent = build_agent(Config(output_dir=out_dir), identity=Identity(rank=3, world_size=4)).start()
    _train(2)
    agent.stop()
    assert _said(caplog) == []


def test_without_logging_the_lines_go_to_stderr_around_the_job(tmp_path: Path) -> None:
    """No logging configured (a plain script under ``gpumemd run``): stderr starts with the start line and
    ends with the summary; the job's own output is untouched."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(
        """
        import torch
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
        print("trained")
        """
    ))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "gpumemd", "run", "--output-dir", str(out), str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "trained\n"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("gpumemd: watching pid ")
    assert f"output {out}" in lines[0]
    assert lines[-1].startswith("gpumemd: 5 steps watched in ") and "no leak found" in lines[-1]
    quiet = subprocess.run([sys.executable, "-m", "gpumemd", "run", "--quiet", "--output-dir", str(out), str(script)],
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and quiet.stdout == "trained\n"
    assert "gpumemd:" not in quiet.stderr


def test_each_rank_says_its_own_exit_line_when_it_has_news(caplog: pytest.LogCaptureFixture) -> None:
    """torchrun, rank 1 leaking: rank 0's "no leak found" was the last word on the job, and rank 1 said
    nothing at exit. Each line now says its rank; a healthy rank other than 0 stays silent."""
    from gpumemd.agent_announce import say_exit

    leaking = [_finding("confirmed", "s", holder="`stash` in main() at ddp.py:10")]
    said = []
    for rank, findings in ((0, []), (1, leaking), (2, [])):
        state = _state(identity=Identity(rank=rank, world_size=3), findings=findings)
        with caplog.at_level(logging.INFO, logger="gpumemd.status"):
            caplog.clear()
            say_exit(exit_summary(state, "/out"), state, quiet=False)
        said += [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert [line.split(": ", 1)[0] for line in said] == ["gpumemd[rank 0/3]", "gpumemd[rank 1/3]"], said
    assert "no leak found" in said[0] and "1 leak finding: tensor leak held by `stash`" in said[1]
    alone = _state()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpumemd.status"):
        say_exit(exit_summary(alone, "/out"), alone, quiet=False)
    assert [r.getMessage() for r in caplog.records] == [exit_summary(alone, "/out")]  # one process: as it was
