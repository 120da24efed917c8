"""Finding and running a headless Chromium for the tests that render report.html as a person would.

Without the binary those tests skip with the install command, except where
``GPUMEMD_REQUIRE_CHROMIUM=1`` (CI installs the package and sets it): there a missing binary fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser")


def require_chromium() -> str:
    path = next((p for p in map(shutil.which, NAMES) if p), None)
    if path is None:
        if os.environ.get("GPUMEMD_REQUIRE_CHROMIUM"):
            pytest.fail("GPUMEMD_REQUIRE_CHROMIUM is set but `chromium` is not on PATH (apt-get install chromium)")
        pytest.skip("`chromium` not installed (apt-get install -y chromium); CI sets GPUMEMD_REQUIRE_CHROMIUM=1")
    return path


def run_chromium(binary: str, url: str, work: Path, *args: str, timeout: float = 120) -> str:
    """Run headless Chromium on ``url`` with its own throwaway profile under ``work``; its stdout."""
    profile = work / "profile"
    profile.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", f"--user-data-dir={profile}", *args, url],
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def page_requests(net_log: Path) -> list[str]:
    """URLs the page itself asked the network for, read from Chromium's net log (``--log-net-log``).
    Chromium's own background traffic (updates, accounts) carries no initiator origin; a file://
    page's requests carry its opaque origin."""
    data = json.loads(net_log.read_text(encoding="utf-8"))
    start = data["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [
        e["params"]["url"] for e in data["events"]
        if e.get("type") == start and e.get("params", {}).get("initiator") != "not an origin"
        and str(e["params"].get("url", "")).startswith(("http://", "https://"))
    ]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
