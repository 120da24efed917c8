"""The exporter inside a real agent: serving, ports, LOCAL_RANK, TLS, textfile, Pushgateway, teardown."""

from __future__ import annotations

import http.client
import http.server
import logging
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import gpumemd


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
    assert agent.component("exporter") is None


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
    gpumemd.attach(pushgateway=f"127.0.0.1:{port}", output_dir=out_dir, sample_interval_s=0)
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        gpumemd.detach()
    assert any("could not push metrics" in r.getMessage() for r in caplog.records)


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
