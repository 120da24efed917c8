"""The metrics server's pure parts and its lifecycle on its own (no agent)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from exporter_storm import scrape_series, start_storm, stop_storm
from prometheus_client import CollectorRegistry, Gauge

from gpumemd.exporter.connections import MAX_WAITING, THREAD_NAME
from gpumemd.exporter.server import MetricsServer, ServeOptions, _url_host, write_textfile


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


# --- containment: bounded threads, timeouts, nothing left after stop or in a fork --


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    Gauge("gpumemd_test_value", "A test gauge.", registry=registry).set(3)
    return registry


def _exporter_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def test_idle_connections_are_capped_and_closed_on_stop() -> None:
    server = MetricsServer(_registry(), ServeOptions(port=0), max_waiting=4)
    server.start()
    assert server.port is not None
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(40)]
    try:
        # 40 silent clients: 4 are held (the newest), the other 36 shed as newer ones came
        closed: set[socket.socket] = set()
        deadline = time.monotonic() + 10
        while len(closed) < 36 and time.monotonic() < deadline:
            readable, _, _ = select.select([s for s in idle if s not in closed], [], [], 0.1)
            closed.update(s for s in readable if s.recv(1) == b"")
        assert len(closed) == 36 and server.wait_for_connections(lambda n: n == 4, timeout=10)
        assert idle[-4:] == [s for s in idle if s not in closed]
        # a client that has not sent its request costs no thread: only the accept loop runs
        assert _exporter_threads() == [THREAD_NAME]
        for s in idle[-4:]:
            s.close()
        # the accept loop sees the end of each stream and lets it go
        assert server.wait_for_connections(lambda n: n == 0, timeout=10)
        with urllib.request.urlopen(server.url, timeout=10) as response:
            assert b"gpumemd_test_value 3.0" in response.read()
        # the scrape's connection ends on its own
        assert server.wait_for_connections(lambda n: n == 0, timeout=10)
        # stop() closes the connections still open
        held = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        idle.append(held)
        assert server.wait_for_connections(lambda n: n == 1, timeout=10)
        server.stop()
        assert _exporter_threads() == []
        assert held.recv(1) == b""
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_a_silent_client_is_dropped_after_the_timeout() -> None:
    server = MetricsServer(_registry(), ServeOptions(port=0), timeout=0.2)
    server.start()
    assert server.port is not None
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as silent:
            assert silent.recv(1) == b""  # the server closed it (a timeout here would raise instead)
    finally:
        server.stop()


def test_a_forked_child_does_not_keep_the_port() -> None:
    server = MetricsServer(_registry(), ServeOptions(port=0))
    server.start()
    port = server.port
    assert port is not None
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker that outlives the parent's detach
        os.close(ready_r)
        os.close(done_w)
        os.write(ready_w, b"x")
        os.read(done_r, 1)  # alive until the parent has checked (its end closed: b"")
        os._exit(0)
    try:
        os.close(ready_w)
        os.close(done_r)
        assert os.read(ready_r, 1) == b"x"
        server.stop()
        # the child is alive and still would hold a copy of the listening socket, had it not closed it
        with socket.socket() as again:
            again.bind(("127.0.0.1", port))
            again.listen()
    finally:
        os.close(ready_r)
        os.close(done_w)  # lets the child end
        os.waitpid(pid, 0)


# --- response accounting: "has a scrape fetched the state as of now?" (the fatal-OOM linger) ---------


def test_a_response_begun_after_the_mark_and_sent_whole_is_seen() -> None:
    server = MetricsServer(_registry(), ServeOptions(port=0))
    url = server.start()
    try:
        mark = server.responses_begun
        assert not server.wait_for_response_after(mark, timeout=0.05)  # nobody scraped
        with urllib.request.urlopen(url, timeout=10) as response:
            assert b"gpumemd_test_value 3.0" in response.read()
        assert server.wait_for_response_after(mark, timeout=10)
        assert server.responses_begun == mark + 1
        # the content length is still set (a one-chunk body), as before the accounting
        with urllib.request.urlopen(url, timeout=10) as response:
            assert int(response.headers["Content-Length"]) == len(response.read())
    finally:
        server.stop()
    assert not server.wait_for_response_after(0, timeout=0.05)  # stopped: nothing to wait for


def test_favicon_and_filtered_requests_do_not_count() -> None:
    server = MetricsServer(_registry(), ServeOptions(port=0))
    url = server.start()
    try:
        mark = server.responses_begun
        for path in ("/favicon.ico", "/metrics?name[]=gpumemd_other"):
            with urllib.request.urlopen(url.replace("/metrics", path), timeout=10) as response:
                response.read()
        assert server.responses_begun == mark
        assert not server.wait_for_response_after(mark, timeout=0.05)
    finally:
        server.stop()


class _Gate:
    """A collector that blocks inside collect() until released: a response begun, not yet sent."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def describe(self) -> list:
        return []

    def collect(self):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.release.wait(10)
        return iter(())


def test_a_response_begun_before_the_mark_does_not_count() -> None:
    # It may have been built from the state before the OOM was counted.
    registry = _registry()
    gate = _Gate()
    registry.register(gate)
    server = MetricsServer(registry, ServeOptions(port=0))
    url = server.start()
    early: list[bytes] = []
    fetch = threading.Thread(target=lambda: early.append(urllib.request.urlopen(url, timeout=10).read()))
    try:
        fetch.start()
        assert gate.entered.wait(10)
        mark = server.responses_begun  # the early response is under way: its ticket is the mark
        gate.release.set()
        fetch.join(10)
        assert early and b"gpumemd_test_value" in early[0]
        assert not server.wait_for_response_after(mark, timeout=0.05)
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()
        assert server.wait_for_response_after(mark, timeout=10)
    finally:
        gate.release.set()
        server.stop()


def test_stop_ends_a_wait_for_a_response() -> None:
    server = MetricsServer(_registry(), ServeOptions(port=0))
    server.start()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(server.wait_for_response_after(0, timeout=60)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting: nobody scrapes
    start = time.monotonic()
    server.stop()
    waiter.join(10)
    assert result == [False] and time.monotonic() - start < 10  # not the 60 s bound


def test_a_scrape_gets_through_sixteen_clients_trickling_their_requests() -> None:
    # At the defaults (16 connections, 10 s): each slow client sends a byte every 50 ms, so no single
    # read ever times out; before the server shed the slowest, none of 30 scrapes got through.
    server = MetricsServer(_registry(), ServeOptions(port=0))
    server.start()
    assert server.port is not None
    slow = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(16)]
    stop = threading.Event()

    def trickle() -> None:
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 10_000
        for i in range(len(request)):
            for s in slow:
                with contextlib.suppress(OSError):  # shed by the server: this client lost its place
                    s.send(request[i:i + 1])
            if stop.wait(0.05):
                return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        assert server.wait_for_connections(lambda n: n == 16, timeout=10)
        for _ in range(3):  # and again: the slow clients keep every other slot
            with urllib.request.urlopen(server.url, timeout=3) as response:
                assert b"gpumemd_test_value 3.0" in response.read()
    finally:
        stop.set()
        thread.join(5)
        for s in slow:
            s.close()
        server.stop()


@pytest.mark.parametrize("clients", [64, 2 * MAX_WAITING])
def test_scrapes_get_through_clients_that_reconnect_the_moment_they_are_dropped(clients: int) -> None:
    # At the defaults: clients in another process send part of a request or nothing, and connect again
    # at once when dropped. With a thread per connection and a backlog of 16, 9-14 of 30 scrapes got
    # through 64 of them (their connects timed out). Now 64 are held, threadless, till their deadline;
    # past MAX_WAITING the oldest is dropped for each newcomer, and they come back as fast as it goes.
    server = MetricsServer(_registry(), ServeOptions(port=0))
    server.start()
    assert server.port is not None
    storm = start_storm(server.port, clients=clients, mode="mixed")
    made = 0
    try:
        assert server.wait_for_connections(lambda n: n >= min(clients, MAX_WAITING), timeout=10)  # all in
        assert _exporter_threads() == [THREAD_NAME]
        # as Prometheus scrapes (its headers, its default 10 s timeout for the whole scrape), faster
        seen = scrape_series(server.port, 30, interval_s=0.2, timeout_s=10.0, expect=b"gpumemd_test_value 3.0",
                             give_up_after=2)
        assert len(seen.ok) >= 29, seen.failed
    finally:
        made = stop_storm(storm)
        server.stop()
    if clients > MAX_WAITING:
        assert made > 2 * clients  # they were dropped and came back, again and again


def test_a_client_trickling_bytes_is_dropped_at_the_whole_request_deadline() -> None:
    server = MetricsServer(_registry(), ServeOptions(port=0), timeout=0.5)
    server.start()
    assert server.port is not None
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as client:
            start = time.monotonic()
            closed = False
            while not closed and time.monotonic() - start < 5:
                try:
                    client.send(b"G")  # well within the per-read timeout each time
                except OSError:
                    closed = True
                    break
                readable, _, _ = select.select([client], [], [], 0.1)
                closed = bool(readable) and client.recv(1) == b""
            assert closed  # within 5 s, at a deadline of 0.5 s, though every read came in time
    finally:
        server.stop()
