"""End to end: a job that vanishes while leaking is told from one that ended cleanly.

Two real CPU training processes at default settings leak a tensor a step (``gpumemd`` attached,
metrics on a free port) and one real Prometheus scrapes them every second with the shipped rules:

- ``killed`` is scraped twice: as a static target (job ``gpumemd``) and as a file_sd target written by
  the shipped Slurm helper (job ``gpumemd-file-sd``). Once Prometheus has its leak finding, the target
  file is removed with the documented ``--remove`` trap, while the process still runs, so that it is
  the removal (not a failed scrape) that makes the file_sd series stale: the alert must fire for that
  target within two intervals. Then the process is SIGKILLed (the OOM killer's way): the alert must
  fire for the static target within two scrape intervals;
- ``terminated`` gets SIGTERM (scancel): it dies of it (-15, as without gpumemd), but first writes
  its exit summary, textfile, findings and state file, records its end and keeps serving until a
  scrape has fetched the exit marker: the alert stays quiet for it.

A second test stalls a leaking job (SIGSTOP, 3 missed scrapes), SIGKILLs it, and starts a healthy job on
its port: the page survives the stall and the port's reuse, and the new job's clean end pages nothing.

This Prometheus scrapes every second, the shipped one every 15 s: the rules' waits are scaled by the
same factor (``scaled_rules``), so that they span as many scrapes as shipped: the vanished alert's
``for: 1m`` (4 scrapes) is 4 s here, ``keep_firing_for: 2m`` (8 scrapes) 8 s. Their exact timing
is promtool's unit test (``gpumemd.rules.runs.test.yml``).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_server import Prometheus, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "exporters" / "prometheus" / "rules" / "gpumemd.rules.yml"
FILE_SD = ROOT / "exporters" / "slurm" / "gpumemd_file_sd.py"
INTERVAL_S = 1.0  # scrape and evaluation interval of this test's Prometheus
SCALE = INTERVAL_S / 15.0  # the shipped interval is 15 s
VANISHED_FOR_S = 60 * SCALE


def scaled_rules(tmp_path: Path) -> str:
    """The shipped rules with their waits (``for:``, ``keep_firing_for:`` in minutes) scaled to this interval."""
    def scaled(match: re.Match[str]) -> str:
        return f"{match.group(1)}: {float(match.group(2)) * 60 * SCALE:g}s"

    text = re.sub(r"\b(for|keep_firing_for): (\d+)m\b", scaled, RULES.read_text())
    assert "for: 4s" in text and "keep_firing_for: 8s" in text, "the shipped waits changed: rescale this test"
    path = tmp_path / "gpumemd.rules.yml"
    path.write_text(text)
    return str(path)

JOB = textwrap.dedent("""
    import torch, gpumemd
    agent = gpumemd.attach()  # GPUMEMD_PORT=0 and GPUMEMD_OUTPUT_DIR from the environment
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept, said = [], False
    while True:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        kept.append(torch.zeros(16 * 1024))  # the leak: 64 KiB a step
        if not said and agent.findings():
            print(agent.exporter_url, flush=True)
            said = True
""")


def firing(prometheus: Prometheus) -> set[tuple[str, str]]:
    return {(a["labels"]["job"], a["labels"]["instance"]) for a in alerts(prometheus, "GpumemdVanishedWhileAtRisk")}


def alerts(prometheus: Prometheus, name: str) -> list[dict[str, Any]]:
    return [a for a in prometheus.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == "firing"]


def leak_seen(prometheus: Prometheus) -> set[tuple[str, str]]:
    return {(r["metric"]["job"], r["metric"]["instance"]) for r in prometheus.query("gpumemd_leak_state > 0")}


def wait_until_fired(prometheus: Prometheus, alert: tuple[str, str], since: float) -> float:
    """Seconds from ``since`` until ``alert`` (job, instance) fires; polled every 0.1 s, 30 s at most."""
    while time.monotonic() < since + 30:
        if alert in firing(prometheus):
            return time.monotonic() - since
        time.sleep(0.1)  # polling Prometheus's API until the alert fires (deadline above)
    raise AssertionError(f"{alert} did not fire within 30 s: {firing(prometheus)}\n{prometheus.logs()}")


def test_a_job_killed_while_leaking_fires_and_a_terminated_one_does_not(prometheus: Prometheus,
                                                                         tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}
    # Ports chosen here, so Prometheus starts beside the jobs: file_sd's first discovery (Prometheus
    # sends target updates every 5 s) overlaps their start-up.
    targets = {name: f"127.0.0.1:{free_port()}" for name in ("killed", "terminated")}
    procs = {}
    for name, target in targets.items():
        with (tmp_path / f"{name}.stderr").open("w") as stderr:
            procs[name] = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                                           stderr=stderr, text=True,
                                           env={**env, "GPUMEMD_PORT": target.rsplit(":", 1)[1],
                                                "GPUMEMD_OUTPUT_DIR": str(tmp_path / name),
                                                "GPUMEMD_TEXTFILE": str(tmp_path / name / "metrics.prom")})
    try:
        sd_dir = tmp_path / "file_sd"
        sd_dir.mkdir()
        sd_file = sd_dir / "gpumemd-job.json"
        host, port = targets["killed"].rsplit(":", 1)
        subprocess.run([sys.executable, str(FILE_SD), "--nodelist", host, "--tasks-per-node", "1", "--port", port,
                        "--job-name", "train", "--output", str(sd_file)], check=True, timeout=30)
        interval = f"{INTERVAL_S:.0f}s"
        prometheus.start([targets["killed"], targets["terminated"]], [scaled_rules(tmp_path)],
                         global_config={"scrape_interval": interval, "evaluation_interval": interval,
                                        "scrape_timeout": interval},
                         scrape_configs=[{"job_name": "gpumemd-file-sd",
                                          "file_sd_configs": [{"files": [str(sd_dir / "*.json")]}]}])
        deadline = time.monotonic() + 120
        for name, proc in procs.items():
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline().strip() if ready else ""
            assert line == f"http://{targets[name]}/metrics", f"{name}: not serving ({line!r}, rc {proc.poll()})"
        static, from_file_sd = ("gpumemd", targets["killed"]), ("gpumemd-file-sd", targets["killed"])
        terminated = ("gpumemd", targets["terminated"])
        expected = {static, from_file_sd, terminated}
        while expected - leak_seen(prometheus):  # every job's finding is in Prometheus
            assert time.monotonic() < deadline, f"findings not scraped: {leak_seen(prometheus)}"
            time.sleep(0.1)  # polling Prometheus's API until the condition holds (deadline above)
        while prometheus.query(f'count_over_time(up{{instance="{targets["terminated"]}"}}[1m]) >= 2') == []:
            assert time.monotonic() < deadline, "the terminated job was not scraped twice"
            time.sleep(0.1)  # the agent learns the scrape cadence from two scrapes
        assert not firing(prometheus)

        # The Slurm trap removes the target file: Prometheus drops the target and marks its series stale.
        # Meanwhile the other job gets SIGTERM, and must stay quiet for 3 evaluations after its end.
        subprocess.run([sys.executable, str(FILE_SD), "--output", str(sd_file), "--remove"], check=True, timeout=30)
        removed_at = time.monotonic()
        procs["terminated"].send_signal(signal.SIGTERM)
        removal = ended_at = None
        while removal is None or ended_at is None or time.monotonic() < ended_at + 3 * INTERVAL_S:
            assert time.monotonic() < removed_at + 30, (firing(prometheus), prometheus.logs())
            alerts = firing(prometheus)
            assert terminated not in alerts
            if removal is None and from_file_sd in alerts:
                removal = time.monotonic() - removed_at
            if ended_at is None and procs["terminated"].poll() is not None:
                ended_at = time.monotonic()
            time.sleep(0.1)  # polling Prometheus's API and the job until all three hold (deadline above)
        assert procs["terminated"].returncode == -signal.SIGTERM  # it still died of SIGTERM
        killed_at = time.monotonic()
        procs["killed"].kill()
        kill = wait_until_fired(prometheus, static, killed_at)
        # ... having written what it knew: exit summary, textfile with the marker, findings, state file
        out = tmp_path / "terminated"
        assert "gpumemd: ended by SIGTERM · " in (tmp_path / "terminated.stderr").read_text()
        assert 'reason="SIGTERM"' in (out / "metrics.prom").read_text()
        assert (out / "leak-findings-rank0.jsonl").read_text().strip()
        assert json.loads((out / "gpumemd-state-rank0.json").read_text())["ended"] == "SIGTERM"
        [marker] = prometheus.query(f'last_over_time(gpumemd_agent_exit_timestamp_seconds'
                                    f'{{instance="{targets["terminated"]}"}}[1m])')
        assert marker["metric"]["reason"] == "SIGTERM"

        # the wait, then within two scrape intervals: the stale series, then the evaluation (0.5 s for our
        # polling)
        assert kill <= VANISHED_FOR_S + 2 * INTERVAL_S + 0.5, kill
        # a file_sd change reaches the scrape manager within its 5 s update throttle, then as above
        assert removal <= 5 + VANISHED_FOR_S + 2 * INTERVAL_S + 0.5, removal
        print(f"fired {kill:.1f} s after SIGKILL, {removal:.1f} s after the file_sd removal; SIGTERM to exit "
              f"{ended_at - removed_at:.1f} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


RUNS_JOB = textwrap.dedent("""
    import sys, time, torch
    leak = sys.argv[1] == "leak"
    if not leak:
        sys.stdin.readline()  # started ahead (torch imported): attaches when told, on the port just freed
    import gpumemd
    agent = gpumemd.attach()  # GPUMEMD_PORT and GPUMEMD_OUTPUT_DIR from the environment
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept, said = [], False
    while True:
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        if leak:
            kept.append(torch.zeros(16 * 1024))  # the leak: 64 KiB a step
        else:
            time.sleep(0.005)  # a healthy job that leaves the machine's cores to the others
        if not said and (not leak or any(f.state == "confirmed" for f in agent.findings())):
            print(agent.exporter_url, flush=True)
            said = True
""")


def rule_expr(alert: str) -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    [expr] = [r["expr"] for g in groups for r in g["rules"] if r.get("alert") == alert]
    return str(expr)


def read_url(proc: subprocess.Popen[str], deadline: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    return proc.stdout.readline().strip() if ready else ""


def poll_until(condition: Any, deadline: float, what: str, prometheus: Prometheus) -> None:
    while not condition():
        assert time.monotonic() < deadline, f"{what}\n{prometheus.logs()}"
        time.sleep(0.1)  # polling Prometheus's API until the condition holds (deadline above)


def test_a_stall_keeps_the_page_and_a_new_job_on_the_port_neither_clears_nor_takes_it(
        prometheus: Prometheus, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(RUNS_JOB)
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}, "GPUMEMD_PORT": str(port)}
    procs = {name: subprocess.Popen([sys.executable, str(script), name], cwd=tmp_path, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                    env={**env, "GPUMEMD_OUTPUT_DIR": str(tmp_path / name)})
             for name in ("leak", "healthy")}
    leaking, healthy = procs["leak"], procs["healthy"]
    vanished = "GpumemdVanishedWhileAtRisk"
    try:
        prometheus.start([target], [scaled_rules(tmp_path)])
        deadline = time.monotonic() + 90
        assert read_url(leaking, deadline) == f"http://{target}/metrics", leaking.poll()
        poll_until(lambda: alerts(prometheus, "GpumemdLeakConfirmed"), deadline, "no LeakConfirmed", prometheus)
        [confirmed] = alerts(prometheus, "GpumemdLeakConfirmed")
        [info] = prometheus.query(f'gpumemd_info{{instance="{target}"}}')
        old_run = info["metric"]["run_id"]

        # A stall of 3 scrapes (the platform check's 6 s at 2 s): the page goes on, nothing vanished.
        leaking.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        while time.monotonic() < stopped_at + 3 * INTERVAL_S:
            assert not firing(prometheus)
            assert [a["activeAt"] for a in alerts(prometheus, "GpumemdLeakConfirmed")] == [confirmed["activeAt"]]
            time.sleep(0.1)  # polling Prometheus's API through the stall (3 intervals)
        leaking.send_signal(signal.SIGCONT)
        poll_until(lambda: prometheus.query(f'up{{instance="{target}"}} == 1'), deadline, "not back", prometheus)
        [missed] = prometheus.query(f'count_over_time((up{{instance="{target}"}} == 0)[30s:1s])')
        assert float(missed["value"][1]) >= 2, "the stall missed no scrape"
        assert not firing(prometheus)
        assert [a["activeAt"] for a in alerts(prometheus, "GpumemdLeakConfirmed")] == [confirmed["activeAt"]]

        # SIGKILL: the run's page fires, and the down expression holds it (no goodbye).
        leaking.kill()
        leaking.wait()
        wait_until_fired(prometheus, ("gpumemd", target), time.monotonic())
        assert prometheus.query(rule_expr("GpumemdAgentDown"))

        # A healthy job on the same port: another run, which neither clears the page...
        assert healthy.stdin is not None
        healthy.stdin.write("go\n")
        healthy.stdin.flush()
        assert read_url(healthy, deadline) == f"http://{target}/metrics", healthy.poll()
        new_info = f'gpumemd_info{{instance="{target}",run_id!="{old_run}"}}'
        poll_until(lambda: prometheus.query(f"count_over_time({new_info}[1m]) >= 2"), deadline,
                   "the new run was not scraped twice", prometheus)
        assert [a["labels"]["run_id"] for a in alerts(prometheus, vanished)] == [old_run]
        [new] = prometheus.query(new_info)
        new_run = new["metric"]["run_id"]

        # ... nor takes it when it ends cleanly (SIGTERM): its goodbye is scraped, no page names it.
        healthy.send_signal(signal.SIGTERM)
        assert healthy.wait(timeout=30) == -signal.SIGTERM
        ended_at = time.monotonic()
        [marker] = prometheus.query(f'last_over_time(gpumemd_agent_exit_timestamp_seconds{{instance="{target}"}}[1m])')
        assert marker["metric"]["run_id"] == new_run and marker["metric"]["reason"] == "SIGTERM"
        while time.monotonic() < ended_at + VANISHED_FOR_S + 3 * INTERVAL_S:
            assert [a["labels"]["run_id"] for a in alerts(prometheus, vanished)] == [old_run]
            time.sleep(0.1)  # polling Prometheus's API for the vanished alert's wait and 3 intervals
        assert not prometheus.query(rule_expr("GpumemdAgentDown"))  # a clean end: no down target
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()
