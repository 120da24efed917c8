"""End to end: a job that vanishes while leaking is told from one that ended cleanly.

Three real CPU training processes at default settings leak a tensor a step (``gpumemd`` attached,
metrics on a free port) and one real Prometheus scrapes them every second with the shipped rules:

- ``killed``, a static target, is SIGKILLed once Prometheus has scraped its leak finding (the OOM
  killer's way): ``GpumemdVanishedWhileAtRisk`` must fire within two scrape intervals;
- ``removed``, a file_sd target written by the shipped Slurm helper, is SIGKILLed and its target
  file removed with the documented ``--remove`` trap: the alert fires for it too;
- ``terminated`` gets SIGTERM (scancel): it dies of it, but first records its end and keeps serving
  until a scrape has fetched the exit marker: the alert stays quiet for it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_server import Prometheus

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "exporters" / "prometheus" / "rules" / "gpumemd.rules.yml"
FILE_SD = ROOT / "exporters" / "slurm" / "gpumemd_file_sd.py"
INTERVAL_S = 1.0  # scrape and evaluation interval of this test's Prometheus

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


def firing(prometheus: Prometheus) -> set[str]:
    return {a["labels"]["instance"] for a in prometheus.api("alerts")["alerts"]
            if a["labels"]["alertname"] == "GpumemdVanishedWhileAtRisk" and a["state"] == "firing"}


def leak_seen(prometheus: Prometheus) -> set[str]:
    return {r["metric"]["instance"] for r in prometheus.query("gpumemd_leak_state > 0")}


def test_a_job_killed_while_leaking_fires_and_a_terminated_one_does_not(prometheus: Prometheus,
                                                                         tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEMD_")}
    procs = {name: subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True,
                                    env={**env, "GPUMEMD_PORT": "0", "GPUMEMD_OUTPUT_DIR": str(tmp_path / name)})
             for name in ("killed", "removed", "terminated")}
    try:
        targets = {}
        deadline = time.monotonic() + 120
        for name, proc in procs.items():
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline().strip() if ready else ""
            assert line.startswith("http://"), f"{name}: no metrics URL ({line!r}, rc {proc.poll()})"
            targets[name] = line.split("//")[1].split("/")[0]
        sd_dir = tmp_path / "file_sd"
        sd_dir.mkdir()
        sd_file = sd_dir / "gpumemd-job.json"
        host, port = targets["removed"].rsplit(":", 1)
        subprocess.run([sys.executable, str(FILE_SD), "--nodelist", host, "--tasks-per-node", "1", "--port", port,
                        "--job-name", "train", "--output", str(sd_file)], check=True, timeout=30)
        interval = f"{INTERVAL_S:.0f}s"
        prometheus.start([targets["killed"], targets["terminated"]], [str(RULES)],
                         global_config={"scrape_interval": interval, "evaluation_interval": interval,
                                        "scrape_timeout": interval},
                         scrape_configs=[{"job_name": "gpumemd-file-sd",
                                          "file_sd_configs": [{"files": [str(sd_dir / "*.json")]}]}])
        while set(targets.values()) - leak_seen(prometheus):  # every job's finding is in Prometheus
            assert time.monotonic() < deadline, f"findings not scraped: {leak_seen(prometheus)}"
            time.sleep(0.1)  # polling Prometheus's API until the condition holds (deadline above)
        while prometheus.query(f'count_over_time(up{{instance="{targets["terminated"]}"}}[1m]) >= 2') == []:
            assert time.monotonic() < deadline, "the terminated job was not scraped twice"
            time.sleep(0.1)  # the agent learns the scrape cadence from two scrapes

        procs["terminated"].send_signal(signal.SIGTERM)
        killed_at = time.monotonic()
        procs["killed"].kill()
        procs["removed"].kill()
        procs["removed"].wait(timeout=30)
        subprocess.run([sys.executable, str(FILE_SD), "--output", str(sd_file), "--remove"], check=True, timeout=30)
        removed_at = time.monotonic()
        fired: dict[str, float] = {}
        while len(fired) < 2 and time.monotonic() < killed_at + 30:
            now = time.monotonic()
            for name in ("killed", "removed"):
                if targets[name] in firing(prometheus):
                    fired.setdefault(name, now)
            time.sleep(0.1)  # polling Prometheus's API until both fired (deadline above)
        assert procs["terminated"].wait(timeout=30) == -signal.SIGTERM  # it still died of SIGTERM
        ended_at = time.monotonic()
        # Quiet for the job that ended cleanly: watched for three more evaluations after its end.
        while time.monotonic() < ended_at + 3 * INTERVAL_S:
            assert targets["terminated"] not in firing(prometheus)
            time.sleep(0.1)  # polling Prometheus's API over the watch window
        assert targets["terminated"] not in firing(prometheus)
        [marker] = prometheus.query(f'last_over_time(gpumemd_agent_exit_timestamp_seconds'
                                    f'{{instance="{targets["terminated"]}"}}[1m])')
        assert marker["metric"]["reason"] == "SIGTERM"

        assert set(fired) == {"killed", "removed"}, (fired, prometheus.logs())
        # within two scrape intervals: the failed scrape, then the evaluation (0.5 s for our polling)
        assert fired["killed"] - killed_at <= 2 * INTERVAL_S + 0.5, fired["killed"] - killed_at
        assert fired["removed"] - removed_at <= 2 * INTERVAL_S + 0.5, fired["removed"] - removed_at
        print(f"fired {fired['killed'] - killed_at:.1f} s after SIGKILL, {fired['removed'] - removed_at:.1f} s after "
              f"the file_sd removal; SIGTERM to exit {ended_at - killed_at:.1f} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
