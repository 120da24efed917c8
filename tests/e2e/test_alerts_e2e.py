"""End to end at the shipped scrape interval: alerts that fire when they should.

Five real CPU training processes (``gpumemd`` attached, metrics on a free port) and one real
Prometheus with the *shipped* global settings (``exporters/prometheus/prometheus.yml``: scrape and
evaluate every 15 s) and the shipped rules:

- three trials die of an uncaught CPU OOM (``torch.empty(2**50)``) at different moments of the
  scrape cycle: as soon as Prometheus is up (most likely before its first scrape of them), right
  after their first scrape (the worst case: the next scrape is a whole interval away) and half an
  interval after it. Each must fire ``GpumemdOutOfMemory``: the exporter keeps serving after the
  OOM until one scrape has fetched it (``oom_linger_s``), then the job exits with its own status;
- one blocks its training thread after 30 steps (a wait that never returns, like a hung collective)
  while its sampler thread goes on: Prometheus must see the last-step timestamp frozen while the
  agent's last-update timestamp advances, and the shipped stale expression must hold for it once
  its time has come;
- one blocks the same way inside ``gpumemd.phase("eval")`` (a long evaluation): the stale
  expression must leave it out.

The stale rule's time logic (10 minutes, 20 typical steps, ``for: 5m``) is promtool's unit test
(``gpumemd.rules.test.yml``); here the live data runs through the shipped expression with its
``time()`` moved an hour ahead.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
import yaml
from prometheus_server import Prometheus

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "exporters" / "prometheus"
RULES = PROM / "rules" / "gpumemd.rules.yml"
SHIPPED = yaml.safe_load((PROM / "prometheus.yml").read_text())["global"]
OOM_LINGER_S = 30.0  # the default of Config.oom_linger_s

JOB = textwrap.dedent("""
    import sys, threading, torch, gpumemd
    mode = sys.argv[1]
    agent = gpumemd.attach()  # GPUMEMD_PORT=0 and GPUMEMD_OUTPUT_DIR from the environment
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    if mode == "oom":
        print(agent.exporter_url, flush=True)
        go = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.readline(), go.set()), daemon=True).start()
        while not go.wait(0.02):  # training, a step every ~20 ms, until told
            step()
        torch.empty(2**50)  # a shape bug: uncaught, the job dies of it
    for _ in range(30):
        step()
    if mode == "stall":
        print(agent.exporter_url, flush=True)  # announced once blocked: every scrape sees the same last step
        sys.stdin.readline()  # the training thread blocks; the sampler thread goes on
    else:
        with gpumemd.phase("eval"):
            print(agent.exporter_url, flush=True)
            sys.stdin.readline()  # a long evaluation: no step, by design
""")


def seconds(duration: str) -> float:
    """A Prometheus duration as the shipped config writes them (``15s``, ``1m``)."""
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match, duration
    return float(match.group(1)) * (60 if match.group(2) == "m" else 1)


def rule_expr(alert: str) -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    [expr] = [r["expr"] for g in groups for r in g["rules"] if r.get("alert") == alert]
    return str(expr)


@dataclass
class Job:
    name: str
    mode: str
    proc: subprocess.Popen[str]
    stderr_path: Path
    target: str = ""
    signalled_at: float | None = None
    exited_at: float | None = None
    fired_at: float | None = None
    notes: list[str] = field(default_factory=list)

    def read_target(self, deadline: float) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = stdout.readline().strip() if ready else ""
        assert line.startswith("http://"), f"{self.name}: no metrics URL ({line!r})\n{self.stderr()}"
        self.target = line.split("//")[1].split("/")[0]

    def send(self, line: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()
        self.signalled_at = time.monotonic()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:] if self.stderr_path.exists() else ""


def start_job(name: str, mode: str, tmp_path: Path) -> Job:
    script = tmp_path / "job.py"
    if not script.exists():
        script.write_text(JOB)
    # No census component: the alerts do not read it, and five jobs share the machine's cores.
    env = {**os.environ, "GPUMEMD_PORT": "0", "GPUMEMD_OUTPUT_DIR": str(tmp_path / name), "GPUMEMD_NVML": "0",
           "GPUMEMD_CENSUS": "0"}
    stderr_path = tmp_path / f"{name}.stderr"
    with stderr_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(script), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env, cwd=tmp_path)
    return Job(name, mode, proc, stderr_path)


def firing(prom: Prometheus, name: str) -> set[str]:
    return {a["labels"].get("instance", "") for a in prom.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == "firing"}


def by_instance(prom: Prometheus, expr: str) -> dict[str, dict[str, Any]]:
    return {r["metric"].get("instance", ""): r for r in prom.query(expr)}


def diagnose(jobs: dict[str, Job], prometheus: Prometheus) -> str:
    lines = [f"{j.name}: target {j.target} signalled {j.signalled_at} exited {j.exited_at} "
             f"rc {j.proc.poll()} fired {j.fired_at}\n{j.stderr()}" for j in jobs.values()]
    return "\n".join(lines) + "\nprometheus:\n" + prometheus.logs()


def watch(prometheus: Prometheus, jobs: dict[str, Job], interval: float, deadline: float) -> None:
    """Until ``deadline``: send the timed OOMs, and note when each OOM job exits and its alert fires,
    until both have happened for every OOM job and the blocked jobs have been scraped 3 times."""
    instance = {job.target: job for job in jobs.values()}
    ooms = [job for job in jobs.values() if job.mode == "oom"]
    first_scrape: dict[str, float] = {}
    while time.monotonic() < deadline:
        now = time.monotonic()
        for result in prometheus.query("up"):
            first_scrape.setdefault(instance[result["metric"]["instance"]].name, now)
        after, mid = jobs["oom_after_first_scrape"], jobs["oom_mid_interval"]
        if after.signalled_at is None and after.name in first_scrape:
            after.send("oom")  # right after a scrape: the next one is a whole interval away
        if mid.signalled_at is None and mid.name in first_scrape and now >= first_scrape[mid.name] + interval / 2:
            mid.send("oom")
        for job in ooms:
            if job.exited_at is None and job.proc.poll() is not None:
                job.exited_at = now
        for target in firing(prometheus, "GpumemdOutOfMemory"):
            if target in instance and instance[target].fired_at is None:
                instance[target].fired_at = now
        stalled_samples = by_instance(prometheus, "count_over_time(gpumemd_last_step_timestamp_seconds[5m])")
        enough = all(float(stalled_samples.get(jobs[n].target, {"value": (0, "0")})["value"][1]) >= 3
                     for n in ("stall", "eval"))
        if all(job.fired_at is not None and job.exited_at is not None for job in ooms) and enough:
            break
        time.sleep(0.25)  # polling Prometheus's API until the conditions hold (deadline above)


def assert_fatal_ooms_fired(prometheus: Prometheus, jobs: dict[str, Job], started: float,
                            prom_started: float) -> None:
    """Every fatal OOM fired the alert, and the jobs ended as they would without gpumemd."""
    ooms = [job for job in jobs.values() if job.mode == "oom"]
    for job in ooms:
        assert job.fired_at is not None, f"GpumemdOutOfMemory did not fire for {job.name}\n{diagnose(jobs, prometheus)}"
        assert job.proc.wait(timeout=OOM_LINGER_S + 30) == 1, diagnose(jobs, prometheus)
        stderr = job.stderr()
        assert "Traceback (most recent call last)" in stderr and "DefaultCPUAllocator" in stderr, stderr
        assert job.signalled_at is not None and job.exited_at is not None
        # the wait ended on the scrape, not on the oom_linger_s bound
        assert job.exited_at - job.signalled_at < OOM_LINGER_S - 2, diagnose(jobs, prometheus)
    for job in ooms:  # the trials' timings, for `pytest -s`
        assert job.fired_at is not None
        print(f"{job.name}: jobs up {prom_started - started:.1f} s after start; OOM "
              f"{job.signalled_at - prom_started:.1f} s after Prometheus started; exit "
              f"{job.exited_at - job.signalled_at:.1f} s and alert firing {job.fired_at - job.signalled_at:.1f} s "
              "after the OOM")
    oom_targets = {job.target for job in ooms}
    expression = by_instance(prometheus, rule_expr("GpumemdOutOfMemory"))
    assert oom_targets <= set(expression), (expression, diagnose(jobs, prometheus))
    for target in oom_targets:  # the scrape that saw the OOM also carried its report
        [reports] = prometheus.query(f'max_over_time(gpumemd_oom_reports_total{{instance="{target}"}}[5m])')
        assert float(reports["value"][1]) == 1
        [count] = prometheus.query(f'max_over_time(gpumemd_ooms_total{{instance="{target}"}}[5m])')
        assert float(count["value"][1]) == 1


def assert_blocked_training_goes_stale(prometheus: Prometheus, jobs: dict[str, Job]) -> None:
    """A blocked training thread: the step timestamp froze while the agent kept publishing."""
    stall, evaluation = jobs["stall"], jobs["eval"]
    for job in (stall, evaluation):
        selector = f'{{instance="{job.target}"}}'
        [samples] = prometheus.query(f"count_over_time(gpumemd_last_step_timestamp_seconds{selector}[5m])")
        assert float(samples["value"][1]) >= 3, diagnose(jobs, prometheus)
        [frozen] = prometheus.query(f"changes(gpumemd_last_step_timestamp_seconds{selector}[5m])")
        assert float(frozen["value"][1]) == 0, diagnose(jobs, prometheus)
        [alive] = prometheus.query(f"changes(gpumemd_agent_last_update_timestamp_seconds{selector}[5m])")
        assert float(alive["value"][1]) >= 2, diagnose(jobs, prometheus)
        [typical] = prometheus.query(f"gpumemd_step_typical_duration_seconds{selector}")
        assert 0 < float(typical["value"][1]) < 1
    [phase] = prometheus.query(f'gpumemd_job_phase_info{{instance="{evaluation.target}"}}')
    assert (phase["metric"]["job_phase"], phase["metric"]["stepping"]) == ("eval", "false")
    [phase] = prometheus.query(f'gpumemd_job_phase_info{{instance="{stall.target}"}}')
    assert (phase["metric"]["job_phase"], phase["metric"]["stepping"]) == ("train", "true")

    stale = rule_expr("GpumemdAgentStale")
    assert stale.count("time()") == 1
    assert not ({stall.target, evaluation.target} & set(by_instance(prometheus, stale)))  # not yet
    an_hour_later = by_instance(prometheus, stale.replace("time()", "(time() + 3600)"))
    assert stall.target in an_hour_later, (an_hour_later, diagnose(jobs, prometheus))
    assert evaluation.target not in an_hour_later  # a labelled evaluation stays quiet


def stop_jobs(jobs: dict[str, Job]) -> None:
    for job in jobs.values():
        if job.proc.poll() is None and job.proc.stdin is not None:
            job.proc.stdin.close()  # the blocked jobs read EOF and end
    for job in jobs.values():
        try:
            job.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            job.proc.wait()


def test_fatal_ooms_fire_at_the_shipped_interval_and_blocked_training_goes_stale(
        prometheus: Prometheus, tmp_path: Path) -> None:
    interval = seconds(SHIPPED["scrape_interval"])
    assert interval == 15 and seconds(SHIPPED["evaluation_interval"]) == 15, SHIPPED
    plan = {"oom_at_start": "oom", "oom_after_first_scrape": "oom", "oom_mid_interval": "oom",
            "stall": "stall", "eval": "eval"}
    started = time.monotonic()
    jobs = {name: start_job(name, mode, tmp_path) for name, mode in plan.items()}
    try:
        deadline = time.monotonic() + 90
        for job in jobs.values():
            job.read_target(deadline)
        prometheus.start([job.target for job in jobs.values()], [str(RULES)], global_config=SHIPPED)
        prom_started = time.monotonic()
        jobs["oom_at_start"].send("oom")
        # worst case: a scrape, an interval, an evaluation
        watch(prometheus, jobs, interval, prom_started + 4 * interval + 20)
        assert_fatal_ooms_fired(prometheus, jobs, started, prom_started)
        assert_blocked_training_goes_stale(prometheus, jobs)
    finally:
        stop_jobs(jobs)
