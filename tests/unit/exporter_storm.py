"""Hostile clients and a Prometheus-style scraper, shared by the exporter tests and
``benchmarks/bench_exporter.py --storm``.

The storm runs in its own process (``start_storm``), as hostile clients would: N clients, each
connecting, sending part of a request (``partial``), nothing (``idle``) or one of the two (``mixed``),
and connecting again the moment the server drops it. One thread drives every client through a
selector, so the storm costs the exporter's process no GIL time and its own process little CPU.

    python tests/unit/exporter_storm.py PORT [--clients 64] [--mode partial|idle|mixed]

runs it until killed (SIGTERM); it then prints how many connections it made.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import http.client
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

PARTIAL = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: stuck/1.0\r\n"  # no blank line: unfinished
MODES = ("partial", "idle", "mixed")


def _storm(port: int, clients: int, mode: str) -> int:
    """Keep ``clients`` connections open against 127.0.0.1:``port`` until SIGTERM; connections made."""
    sel = selectors.DefaultSelector()
    made = [0]
    stopping = [False]

    def stop(signum: int, frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, stop)

    def connect(index: int) -> None:
        while not stopping[0]:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            if sock.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS):
                made[0] += 1
                sel.register(sock, selectors.EVENT_WRITE, index)
                return
            sock.close()
            time.sleep(0.01)  # refused (the server is gone): try again, without spinning

    def on_event(sock: socket.socket, index: int, events: int) -> None:
        sel.unregister(sock)
        if events & selectors.EVENT_WRITE and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            if mode == "partial" or (mode == "mixed" and index % 2 == 0):
                with contextlib.suppress(OSError):
                    sock.send(PARTIAL)
            sel.register(sock, selectors.EVENT_READ, index)  # connected: wait to be dropped
            return
        with contextlib.suppress(OSError):
            if events & selectors.EVENT_READ and sock.recv(4096):
                sel.register(sock, selectors.EVENT_READ, index)  # an answer (none comes to a part)
                return
        sock.close()  # dropped (closed or reset), or the connect failed
        connect(index)  # at once: the client that comes back the moment it is dropped

    for i in range(clients):
        connect(i)
    while not stopping[0]:
        for key, events in sel.select(timeout=0.1):
            assert isinstance(key.fileobj, socket.socket)
            on_event(key.fileobj, key.data, events)
    return made[0]


def start_storm(port: int, clients: int = 64, mode: str = "mixed") -> subprocess.Popen[str]:
    """The storm in its own process; stop it with ``stop_storm``."""
    return subprocess.Popen([sys.executable, __file__, str(port), "--clients", str(clients), "--mode", mode],
                            stdout=subprocess.PIPE, text=True)


def stop_storm(proc: subprocess.Popen[str]) -> int:
    """End the storm; the connections it made (0 if it could not say)."""
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return 0
    return int(out.strip() or 0)


@dataclass
class Scrapes:
    """What a Prometheus-style scraper saw: each scrape's outcome and its time."""

    timeout_s: float
    ok: list[float] = field(default_factory=list)  # seconds each successful scrape took
    failed: list[str] = field(default_factory=list)  # why each other one failed

    @property
    def total(self) -> int:
        return len(self.ok) + len(self.failed)


def scrape_once(port: int, timeout_s: float, expect: bytes) -> float:
    """One scrape as Prometheus makes it (its headers, one timeout for the whole scrape); its seconds.
    Raises OSError (or http.client's errors) on a failure, TimeoutError past the timeout."""
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics", headers={
            "Accept": "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
            "User-Agent": "Prometheus/2.53.0",
            "X-Prometheus-Scrape-Timeout-Seconds": f"{timeout_s:g}",
        })
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    took = time.monotonic() - start
    if response.status != 200 or expect not in body:
        raise OSError(f"status {response.status}, {len(body)} bytes")
    if took > timeout_s:
        raise TimeoutError(f"took {took:.2f} s")
    return took


def scrape_series(port: int, scrapes: int, *, interval_s: float, timeout_s: float, expect: bytes,
                  give_up_after: int | None = None) -> Scrapes:
    """``scrapes`` scrapes, one every ``interval_s`` (or at the end of the last, if it took longer),
    each within ``timeout_s``; stops early after ``give_up_after`` failures."""
    seen = Scrapes(timeout_s)
    next_at = time.monotonic()
    for _ in range(scrapes):
        time.sleep(max(0.0, next_at - time.monotonic()))
        next_at = time.monotonic() + interval_s
        try:
            seen.ok.append(scrape_once(port, timeout_s, expect))
        except (OSError, http.client.HTTPException) as exc:
            seen.failed.append(f"{type(exc).__name__}: {exc}")
            if give_up_after is not None and len(seen.failed) >= give_up_after:
                break
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--mode", choices=MODES, default="mixed")
    args = parser.parse_args()
    print(_storm(args.port, args.clients, args.mode), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
