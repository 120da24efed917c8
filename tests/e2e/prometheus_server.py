"""A real Prometheus process for the end-to-end tests, on loopback with a temporary data directory.

Without the ``prometheus`` binary the e2e tests skip, except where ``GPUMEMD_REQUIRE_PROMETHEUS=1``
(CI installs Debian's package and sets it), where a missing binary fails them.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """One Prometheus process on 127.0.0.1 with a temporary data directory."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.log_path = workdir / "prometheus.log"

    def start(self, targets: list[str], rule_files: list[str], timeout: float = 30.0,
              global_config: dict[str, Any] | None = None,
              scrape_configs: list[dict[str, Any]] | None = None) -> None:
        """``global_config``: the ``global`` section (default: scrape and evaluate every second);
        ``scrape_configs``: more scrape jobs beside the static ``gpumemd`` one (e.g. a file_sd one)."""
        config = {
            "global": global_config or {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": rule_files,
            "scrape_configs": [{"job_name": "gpumemd", "static_configs": [{"targets": targets}]},
                               *(scrape_configs or [])],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        for _attempt in range(3):  # the free port can be taken between our probe and Prometheus's bind
            try:
                self._launch(config_path, free_port(), timeout)
                return
            except RuntimeError:
                if "address already in use" not in self.logs():
                    raise
        raise RuntimeError(f"prometheus found no free port:\n{self.logs()}")

    def _launch(self, config_path: Path, port: int, timeout: float) -> None:
        self.url = f"http://127.0.0.1:{port}"
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=0.1)  # a short wait on the process, not a sleep
        self.stop()
        raise RuntimeError(f"prometheus not ready within {timeout:.0f} s:\n{self.logs()}")

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
