"""The metrics server's pure parts and its lifecycle on its own (no agent)."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from gpumemd.exporter.server import THREAD_NAME, MetricsServer, ServeOptions, _url_host, write_textfile


def test_url_host_is_reachable_for_wildcard_and_ipv6_binds() -> None:
    assert _url_host("127.0.0.1") == "127.0.0.1"
    assert _url_host("0.0.0.0") == "127.0.0.1"
    assert _url_host("::") == "[::1]"
    assert _url_host("::1") == "[::1]"
    assert _url_host("10.1.2.3") == "10.1.2.3"


def test_server_serves_then_stops_its_thread_and_socket() -> None:
    registry = CollectorRegistry(auto_describe=False)
    Gauge("gpumemd_test_value", "A test gauge.", registry=registry).set(3)
    server = MetricsServer(registry, ServeOptions(port=0))
    url = server.start()
    assert server.port is not None and url == f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert b"gpumemd_test_value 3.0" in response.read()
    assert THREAD_NAME in [t.name for t in threading.enumerate()]

    server.stop()
    server.stop()  # idempotent

    assert server.url is None and server.port is None
    assert THREAD_NAME not in [t.name for t in threading.enumerate()]


def test_textfile_replaces_the_old_file_whole(tmp_path: Path) -> None:
    registry = CollectorRegistry(auto_describe=False)
    gauge = Gauge("gpumemd_test_value", "A test gauge.", registry=registry)
    path = tmp_path / "out.prom"
    gauge.set(1)
    write_textfile(str(path), registry)
    gauge.set(2)
    write_textfile(str(path), registry)
    assert "gpumemd_test_value 2.0" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.prom"]
