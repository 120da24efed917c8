"""The exporter inside a real agent: serving, ports, LOCAL_RANK, TLS, textfile, Pushgateway, teardown."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import logging
import os
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import gpumemd
from gpumemd.components.exporter import ExporterComponent


def train(steps: int) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def scrape(url: str, context: ssl.SSLContext | None = None) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def free_port_pair() -> int:
    """A port p with p and p + 1 free right now (for the LOCAL_RANK offset)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no pair of free ports")


def refused(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
    except urllib.error.URLError as exc:
        return isinstance(exc.reason, ConnectionRefusedError)
    return False


def test_serves_live_state_and_tears_down_completely(out_dir: str) -> None:
    agent = gpumemd.attach(port=0, output_dir=out_dir, sample_interval_s=0)
    url = agent.exporter_url
    assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")

    train(5)
    metrics = scrape(url)
    train(2)
    later = scrape(url)

    assert metrics["gpumemd_steps_total"] == 5 and later["gpumemd_steps_total"] == 7
    assert metrics["gpumemd_info"] == 1
    assert "gpumemd_host_rss_bytes" in metrics
    assert not any(name.startswith("gpumemd_allocator_") for name in metrics)  # CPU build: absent
    gpumemd.detach()
    assert agent.exporter_url is None
    assert refused(url)
    assert not [t for t in threading.enumerate() if t.name.startswith("gpumemd")]


def test_no_port_no_server(out_dir: str) -> None:
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0)
    assert agent.exporter_url is None
    assert agent.component(ExporterComponent) is None


def test_gpumemd_port_env_turns_it_on(out_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMEMD_PORT", "0")
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0)
    assert agent.exporter_url is not None
    assert scrape(agent.exporter_url)["gpumemd_steps_total"] == 0


def test_port_is_offset_by_local_rank(out_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = free_port_pair()
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    agent = gpumemd.attach(port=base, output_dir=out_dir, sample_interval_s=0)
    assert agent.exporter_url == f"http://127.0.0.1:{base + 1}/metrics"
    with urllib.request.urlopen(agent.exporter_url, timeout=10) as response:
        text = response.read().decode()
    assert 'rank="5"' in text and 'local_rank="1"' in text


def test_a_port_in_use_is_logged_and_the_job_goes_on(out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="gpumemd"):
            agent = gpumemd.attach(port=port, output_dir=out_dir, sample_interval_s=0)
        train(3)
    assert agent.exporter_url is None
    assert agent.state().steps_total == 3
    assert any(f"127.0.0.1:{port} is already in use" in r.getMessage() for r in caplog.records)


def test_textfile_written_atomically_at_detach(out_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "collector" / "gpumemd.prom"
    agent = gpumemd.attach(textfile=str(path), output_dir=out_dir, sample_interval_s=0)
    assert agent.exporter_url is None  # no port: nothing served, only the file at exit
    train(4)
    assert not path.exists()
    gpumemd.detach()
    text = path.read_text()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["gpumemd_steps_total"] == 4
    assert [p.name for p in path.parent.iterdir()] == ["gpumemd.prom"]  # no temp file left


def test_textfile_must_end_in_prom(out_dir: str) -> None:
    with pytest.raises(ValueError, match=r"textfile.*\.prom"):
        gpumemd.attach(textfile="/tmp/metrics.txt", output_dir=out_dir)


class _Gateway(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, str, bytes]]] = []

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append(("PUT", self.path, body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def gateway() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    received: ClassVar[list[tuple[str, str, bytes]]] = []
    handler = type("Handler", (_Gateway,), {"received": received})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="test-pushgateway", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_pushes_once_to_a_pushgateway_at_detach(out_dir: str, gateway: tuple[str, list]) -> None:
    address, received = gateway
    gpumemd.attach(pushgateway=address, output_dir=out_dir, sample_interval_s=0)
    train(2)
    assert received == []
    gpumemd.detach()
    [(method, path, body)] = received
    assert method == "PUT"
    assert path.startswith("/metrics/job/gpumemd/instance/") and path.endswith("/rank/0")
    assert b"gpumemd_steps_total" in body


def test_an_unreachable_pushgateway_is_logged(out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    gpumemd.attach(pushgateway=f"http://user:s3cret@127.0.0.1:{port}", output_dir=out_dir, sample_interval_s=0)
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        gpumemd.detach()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"could not push metrics to the Pushgateway http://***@127.0.0.1:{port}" in m for m in said), said
    assert not any("s3cret" in m for m in said)  # the credentials are never printed


# A self-signed test-only pair for 127.0.0.1, valid for 100 years (made once with
# `openssl req -x509 -newkey rsa:2048 -nodes -days 36500 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1`),
# so the test needs no openssl binary.
TLS_DIR = Path(__file__).resolve().parents[1] / "data" / "tls"


def test_serves_https_with_a_certificate(out_dir: str) -> None:
    cert, key = TLS_DIR / "cert.pem", TLS_DIR / "key.pem"
    agent = gpumemd.attach(port=0, tls_certfile=str(cert), tls_keyfile=str(key), output_dir=out_dir,
                           sample_interval_s=0)
    url = agent.exporter_url
    assert url is not None and url.startswith("https://")
    context = ssl.create_default_context(cafile=str(cert))
    assert scrape(url, context)["gpumemd_info"] == 1
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP is not served
        urllib.request.urlopen(url.replace("https://", "http://"), timeout=5)


# --- a fatal OOM reaches Prometheus: linger until one scrape, push/write at once ------
# The excepthook runs in a thread here, as the process would at exit; the real exit is the subprocess
# test at the end. (An uncaught exception's hook is the last thing the process runs before atexit.)


def _oom() -> RuntimeError:
    try:
        torch.empty(2**50)  # a real CPU allocation failure (malloc fails at once, no RAM is used)
    except RuntimeError as exc:
        return exc
    raise AssertionError("the allocation did not fail")


def _excepthook_in_thread(exc: BaseException) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        done.set()

    thread = threading.Thread(target=run, name="test-excepthook", daemon=True)
    thread.start()
    return thread, done


def _lingering(caplog: pytest.LogCaptureFixture, done: threading.Event, timeout: float = 30.0) -> bool:
    """Wait for the hook's "keeping ... up" line (or for the hook to return): whether it lingers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("until a scrape records the out-of-memory error" in r.getMessage() for r in caplog.records):
            return True
        if done.wait(0.02):
            return False
    raise AssertionError("the excepthook neither lingered nor returned")


def test_a_fatal_oom_keeps_serving_until_one_scrape_has_fetched_it(out_dir: str, caplog: pytest.LogCaptureFixture,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    agent = gpumemd.attach(port=0, output_dir=out_dir, sample_interval_s=0, oom_linger_s=60)
    url = agent.exporter_url
    assert url is not None
    train(3)
    before = scrape(url)  # a scrape before the OOM does not end the wait
    assert before["gpumemd_ooms_total"] == 0
    thread, done = _excepthook_in_thread(_oom())
    assert _lingering(caplog, done)
    assert not done.is_set()
    metrics = scrape(url)
    assert metrics["gpumemd_ooms_total"] == 1 and metrics["gpumemd_oom_reports_total"] == 1
    assert done.wait(10), "the hook went on waiting after a scrape fetched the OOM"
    thread.join(10)
    assert "DefaultCPUAllocator: can't allocate memory" in capsys.readouterr().err  # the traceback, as ever


def test_the_wait_is_bounded_by_oom_linger_s(out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    gpumemd.attach(port=0, output_dir=out_dir, sample_interval_s=0, oom_linger_s=0.3)
    train(2)
    start = time.monotonic()
    thread, done = _excepthook_in_thread(_oom())
    assert _lingering(caplog, done)
    assert done.wait(10)  # nobody scrapes: it gives up after 0.3 s
    assert 0.25 <= time.monotonic() - start < 10
    thread.join(10)


@pytest.mark.parametrize("case", ["linger_0", "no_port", "interactive", "not_an_oom"])
def test_no_wait_where_there_is_nothing_to_wait_for(case: str, out_dir: str, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    options: dict = {"port": 0, "oom_linger_s": 60}
    if case == "linger_0":
        options["oom_linger_s"] = 0
    if case == "no_port":
        options = {"textfile": str(tmp_path / "m.prom"), "oom_linger_s": 60}
    if case == "interactive":
        monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # a REPL goes on after the traceback
    gpumemd.attach(output_dir=out_dir, sample_interval_s=0, **options)
    train(2)
    exc = ValueError("not memory") if case == "not_an_oom" else _oom()
    thread, done = _excepthook_in_thread(exc)
    assert not _lingering(caplog, done)
    thread.join(10)


def test_an_oom_that_oom_guard_reported_and_reraised_still_lingers(out_dir: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    agent = gpumemd.attach(port=0, output_dir=out_dir, sample_interval_s=0, oom_linger_s=60)
    train(2)
    try:
        with gpumemd.oom_guard():
            torch.empty(2**50)
    except RuntimeError as exc:
        caught = exc
    assert agent.state().ooms_total == 1  # the guard counted and reported it
    thread, done = _excepthook_in_thread(caught)
    assert _lingering(caplog, done)
    assert agent.exporter_url is not None
    assert scrape(agent.exporter_url)["gpumemd_ooms_total"] == 1
    assert done.wait(10)
    thread.join(10)


def test_textfile_and_pushgateway_get_the_fatal_oom_at_once(out_dir: str, tmp_path: Path,
                                                            gateway: tuple[str, list],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpumemd")
    address, received = gateway
    path = tmp_path / "gpumemd.prom"
    agent = gpumemd.attach(port=0, textfile=str(path), pushgateway=address, output_dir=out_dir,
                           sample_interval_s=0, oom_linger_s=60)
    train(2)
    thread, done = _excepthook_in_thread(_oom())
    assert _lingering(caplog, done)
    # before any scrape, while the process would still be waiting: both already have the OOM
    text = path.read_text()
    assert "gpumemd_ooms_total 1.0" in text.replace('{local_rank="0",rank="0"}', "")
    [(method, _, body)] = received
    assert method == "PUT" and b"gpumemd_oom_reports_total" in body
    assert agent.exporter_url is not None
    scrape(agent.exporter_url)
    assert done.wait(10)
    thread.join(10)
    path.write_text("# the textfile collector's copy\n")
    gpumemd.detach()  # the exit: no second push (an unreachable gateway would cost its timeout again)
    assert len(received) == 1 and path.read_text() == "# the textfile collector's copy\n"


def test_a_forked_worker_does_not_linger(out_dir: str) -> None:
    gpumemd.attach(port=0, output_dir=out_dir, sample_interval_s=0, oom_linger_s=60)
    train(2)
    exc = _oom()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker dying of an OOM: its exit is not the job's
        code = 3
        try:
            start = time.monotonic()
            with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
                sys.excepthook(type(exc), exc, exc.__traceback__)
            code = 0 if time.monotonic() - start < 5 else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


CRASH = textwrap.dedent("""
    import torch, gpumemd
    agent = gpumemd.attach(port=0, sample_interval_s=0)
    print(agent.exporter_url, flush=True)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.empty(2**50)
""")


def test_the_job_exits_with_its_own_traceback_and_status_once_scraped(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    env = {**os.environ, "GPUMEMD_OUTPUT_DIR": str(tmp_path / "out")}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().strip()
        lines: list[str] = []
        for line in proc.stderr:  # up to the linger line: the traceback is printed before it
            lines.append(line)
            if "until a scrape records the out-of-memory error" in line:
                break
        assert proc.poll() is None, "the job exited before a scrape fetched its OOM"
        metrics = scrape(url)
        assert metrics["gpumemd_ooms_total"] == 1 and metrics["gpumemd_oom_reports_total"] == 1
        assert proc.wait(timeout=60) == 1  # python's status for an uncaught exception
        stderr = "".join(lines) + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    traceback_lines = [line for line in stderr.splitlines() if not line.startswith("gpumemd")]
    assert traceback_lines[0] == "Traceback (most recent call last):"
    assert traceback_lines[-1].startswith("RuntimeError: [enforce fail at alloc_cpu.cpp")
    assert "line 11, in <module>" in stderr
