"""``gpumemd top`` as a person at a terminal uses it: real CPU jobs at default settings, the live view in
tmux (``send-keys``, ``capture-pane``).

- one job leaking 64 KiB a step from step 300: the frame shows the step moving, the leak finding once
  it is confirmed, follows the window's size, and ``q`` exits cleanly; then the job stops stepping and
  writes its state file (``flush``, as a signal's handler does) and ``gpumemd top --once --json`` gives
  the step, memory figures and findings ``agent.state()`` holds;
- two ranks of one job in one directory, one SIGKILLed: the frame shows it as vanished, first.

Without tmux these skip with the install command, except where ``GPUMEMD_REQUIRE_TMUX=1`` (CI sets it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

JOB = textwrap.dedent("""
    import json, os, signal, sys, time, torch, gpumemd
    from gpumemd.components.state_writer import LastStateComponent
    agent = gpumemd.attach()  # GPUMEMD_OUTPUT_DIR (and RANK for the two-rank test) from the environment
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept, pause, n = [], sys.argv[1], 0
    def step():
        global n
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        if n >= 300:
            kept.append(torch.zeros(16 * 1024))  # the leak: 64 KiB a step from step 300
        n += 1
        time.sleep(0.001)  # leave the other core to top and tmux
    while not os.path.exists(pause):
        step()
    agent.component(LastStateComponent).flush()  # the state file is what the agent holds now, steps stopped
    state = agent.state()
    host = state.host
    with open(pause + ".json", "w") as f:
        json.dump({"step": state.step, "rss_bytes": host.rss_bytes, "free_bytes": host.available_bytes,
                   "findings": [[x.series, x.state, x.slope_bytes_per_step, x.steps_to_oom]
                                for x in state.findings if x.state != "cleared"]}, f)
    print("paused", flush=True)
    signal.pause()  # until the test kills it
""")


def require_tmux() -> str:
    path = shutil.which("tmux")
    if path is None:
        if os.environ.get("GPUMEMD_REQUIRE_TMUX"):
            pytest.fail("GPUMEMD_REQUIRE_TMUX is set but `tmux` is not on PATH (apt-get install tmux)")
        pytest.skip("`tmux` not installed (apt-get install -y tmux); CI sets GPUMEMD_REQUIRE_TMUX=1")
    return path


class Tmux:
    """A private tmux server (its own socket) running one command in a 160x50 window."""

    def __init__(self, binary: str, name: str) -> None:
        self.cmd = [binary, "-L", name]

    def start(self, command: str) -> None:
        subprocess.run([*self.cmd, "new-session", "-d", "-x", "160", "-y", "50", command], check=True)

    def screen(self) -> str:
        return subprocess.run([*self.cmd, "capture-pane", "-p"], capture_output=True, text=True).stdout

    def resize(self, columns: int) -> None:
        subprocess.run([*self.cmd, "resize-window", "-x", str(columns), "-y", "50"], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.cmd, "send-keys", *keys], check=True)

    def wait(self, what: str, ok: Callable[[str], bool], timeout: float = 45) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if ok(text):
                return text
            time.sleep(0.3)
        raise AssertionError(f"the pane never showed {what}; it shows:\n{self.screen()}")

    def kill(self) -> None:
        subprocess.run([*self.cmd, "kill-server"], capture_output=True)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Tmux]:
    t = Tmux(require_tmux(), f"gpumemd-test-{os.getpid()}-{tmp_path.name}")
    yield t
    t.kill()


def start_job(tmp_path: Path, out: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", JOB, str(tmp_path / f"pause-{env.get('RANK', 0)}")],
                            env={**os.environ, "GPUMEMD_OUTPUT_DIR": str(out), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def wait_for_state_files(out: Path, jobs: list[subprocess.Popen[str]], timeout: float = 40) -> None:
    """Poll, with a deadline, until rank r of ``jobs[r]`` has written its state file (its first step ended)."""
    deadline = time.monotonic() + timeout
    while not all((out / f"gpumemd-state-rank{r}.json").exists() for r in range(len(jobs))):
        assert time.monotonic() < deadline and all(j.poll() is None for j in jobs), "no state file written"
        time.sleep(0.2)


def top_command(out: Path) -> str:
    return f"{sys.executable} -m gpumemd top {out}; echo TOP-EXIT=$?; sleep 60"


def steps_shown(screen: str) -> list[int]:
    return [int(w.replace(",", "")) for line in screen.splitlines() if line.startswith("rank ")
            for w in [line.split(" step ")[1].split()[0]] if " step " in line]


def test_top_follows_a_leaking_job_and_its_json_is_the_agents_state(tmp_path: Path, tmux: Tmux) -> None:
    out = tmp_path / "out"
    job = start_job(tmp_path, out)
    try:
        wait_for_state_files(out, [job])  # the job's first step has ended
        tmux.start(top_command(out))
        first = tmux.wait("a rank with its step", lambda s: bool(steps_shown(s)))
        assert "RUNNING" in first and "host    RSS" in first, first
        tmux.wait("the step moving", lambda s: bool(steps_shown(s)) and steps_shown(s)[0] > steps_shown(first)[0])
        frame = tmux.wait("the confirmed finding", lambda s: "finding confirmed tensor_leak" in s)
        assert "+64.0 KiB/step" in frame and "out of memory in ~" in frame, frame
        tmux.resize(60)  # the frame follows: lines cut at the new width, none wrapped onto the next
        # a frame drawn at 60 columns (between clearing the pane and drawing, tmux showed it blank)
        narrow = tmux.wait("the frame at 60 columns", lambda s: "(q quits)" not in s and "rank 0  RUNNING" in s)
        assert narrow.splitlines()[1] == "" and narrow.splitlines()[2].startswith("rank 0  RUNNING"), narrow
        tmux.resize(160)
        tmux.wait("the frame at 160 columns again", lambda s: "(q quits)" in s)
        tmux.keys("q")
        tmux.wait("top's clean exit", lambda s: "TOP-EXIT=0" in s, timeout=10)

        (tmp_path / "pause-0").touch()  # the job stops right after a state file write
        assert job.stdout is not None and job.stdout.readline().strip() == "paused"
        shown = subprocess.run([sys.executable, "-m", "gpumemd", "top", "--once", "--json", str(out)],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        [rank] = json.loads(shown.stdout)["ranks"]
        held = json.loads((tmp_path / "pause-0.json").read_text())
        assert rank["status"] == "running" and rank["step"] == held["step"]
        [host] = [m for m in rank["memory"] if m["where"] == "host"]
        assert (host["rss_bytes"], host["free_bytes"]) == (held["rss_bytes"], held["free_bytes"])
        assert held["findings"] and [[f["series"], f["state"]] for f in rank["findings"]] == \
            [f[:2] for f in held["findings"]]
        assert [f["steps_to_oom"] for f in rank["findings"]] == [f[3] for f in held["findings"]]
    finally:
        job.kill()
        job.wait()


def test_a_killed_rank_shows_as_vanished_first(tmp_path: Path, tmux: Tmux) -> None:
    out = tmp_path / "out"
    jobs = [start_job(tmp_path, out, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2") for r in (0, 1)]
    try:
        wait_for_state_files(out, jobs)
        tmux.start(top_command(out))
        tmux.wait("both ranks running", lambda s: s.count("RUNNING") == 2)
        jobs[1].send_signal(signal.SIGKILL)  # the OOM killer's way: nothing runs in the job
        jobs[1].wait()
        frame = tmux.wait("rank 1 vanished", lambda s: "rank 1  VANISHED" in s)
        assert "1 running, 1 vanished, 0 ended" in frame
        ranks = [line.split()[1] for line in frame.splitlines() if line.startswith("rank ")]
        assert ranks == ["1", "0"], frame  # the vanished rank first
        assert "VANISHED: no clean exit recorded" in frame
        tmux.keys("q")
        tmux.wait("top's clean exit", lambda s: "TOP-EXIT=0" in s, timeout=10)
    finally:
        for job in jobs:
            job.kill()
            job.wait()
