"""The HTTP side: serve a registry on ``/metrics``, push it once, or write it as a textfile.

The server is prometheus_client's WSGI app (``make_wsgi_app``) in a server of our own, because the
one ``start_http_server`` gives runs one unbounded thread per connection with no socket timeout
(200 idle connections were 200 threads in the training process, alive after detach) and leaves its
listening socket to forked DataLoader workers. ``connections.ContainedServer`` contains its
connections (bounded threads, a deadline each, nothing left after ``stop()`` or in a forked child).

It also counts the metrics responses it begins and sends whole, so that after a fatal OOM the
exporter can wait until one scrape has carried the OOM away (``wait_for_response_after``), and learns
a scraper's cadence from the scrapes that say they are one (``scrape_interval_s``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from gpumemd.exporter.connections import (
    MAX_CONNECTIONS,
    MAX_WAITING,
    REQUEST_TIMEOUT_S,
    THREAD_NAME,
    ContainedServer,
)
from gpumemd.files import replace_file

log = logging.getLogger("gpumemd")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    port: int  # the final port (LOCAL_RANK already added); 0 picks a free one
    bind: str = "127.0.0.1"
    certfile: str | None = None
    keyfile: str | None = None


def _from_a_scraper(environ: dict[str, Any]) -> bool:
    """Prometheus (and the agents built on its scrape code) send their scrape timeout with every scrape;
    curl, a browser or a test's urlopen do not."""
    return "HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS" in environ


def _full_exposition(environ: dict[str, Any]) -> bool:
    """A GET that prometheus_client answers with every metric (not the favicon, not ``name[]=`` filtered)."""
    return (environ.get("REQUEST_METHOD") == "GET" and environ.get("PATH_INFO") != "/favicon.ico"
            and "name[]" not in parse_qs(environ.get("QUERY_STRING", "")))


class _Sent:
    """A WSGI body that calls ``done`` once its last chunk was written to the socket.

    wsgiref writes each chunk before asking for the next, so the code after the last ``yield`` runs
    only when every byte went out; a failed write ends the iteration first. ``len`` keeps the
    Content-Length wsgiref sets for a one-chunk body."""

    def __init__(self, body: Iterable[bytes], done: Callable[[], None]) -> None:
        self._body = list(body)
        self._done = done

    def __len__(self) -> int:
        return len(self._body)

    def __iter__(self) -> Iterator[bytes]:
        yield from self._body
        self._done()


class _ContainedServer(ContainedServer):
    """The contained server, counting the metrics responses it begins and sends whole."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.begun = 0  # metrics responses begun (each one's number is its ticket)
        self.begun_at: tuple[float, ...] = ()  # monotonic times the last two scrapes (a scraper's) began
        self.sent_ticket = 0  # the highest ticket of a metrics response sent whole
        self.stopped = False  # set by MetricsServer.stop: a wait for a response ends
        super().__init__(*args, **kwargs)

    def count(self, app: Callable[..., Any]) -> Callable[..., Any]:
        """``app`` with its metrics responses numbered when begun and recorded once sent whole."""

        def counted(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            if not _full_exposition(environ):
                return app(environ, start_response)
            with self.changed:
                self.begun += 1
                ticket = self.begun
                if _from_a_scraper(environ):
                    self.begun_at = (*self.begun_at[-1:], time.monotonic())
            return _Sent(app(environ, start_response), lambda: self._sent(ticket))

        return counted

    def _sent(self, ticket: int) -> None:
        with self.changed:
            self.sent_ticket = max(self.sent_ticket, ticket)
            self.changed.notify_all()


class MetricsServer:
    """One running ``/metrics`` endpoint. ``start`` raises OSError when the port is taken."""

    def __init__(self, registry: Any, options: ServeOptions, *, max_waiting: int = MAX_WAITING,
                 timeout: float = REQUEST_TIMEOUT_S) -> None:
        self._registry = registry
        self._options = options
        self._max_waiting = max_waiting
        self._timeout = timeout
        self._httpd: _ContainedServer | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def start(self) -> str:
        from prometheus_client import make_wsgi_app

        opts = self._options
        tls = None
        if opts.certfile:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.load_cert_chain(certfile=opts.certfile, keyfile=opts.keyfile)
        family = socket.AF_INET6 if ipaddress.ip_address(opts.bind).version == 6 else socket.AF_INET
        httpd = _ContainedServer((opts.bind, opts.port), family, max_connections=MAX_CONNECTIONS,
                                 max_waiting=self._max_waiting, timeout=self._timeout, tls=tls)
        httpd.set_app(httpd.count(make_wsgi_app(self._registry)))
        httpd.watch_forks()
        thread = threading.Thread(target=httpd.serve, name=THREAD_NAME, daemon=True)
        thread.start()
        self._httpd, self._thread = httpd, thread
        scheme = "https" if opts.certfile else "http"
        self.url = f"{scheme}://{_url_host(opts.bind)}:{self.port}/metrics"
        return self.url

    @property
    def port(self) -> int | None:
        return int(self._httpd.server_address[1]) if self._httpd is not None else None

    def wait_for_connections(self, predicate: Callable[[int], bool], timeout: float) -> bool:
        """Block until ``predicate(connections open: waiting or answered)`` holds, or ``timeout``; its
        last value. (The accept loop notifies after each round of events, and at least every ``_POLL_S``.)"""
        httpd = self._httpd
        if httpd is None:
            return predicate(0)
        with httpd.changed:
            return httpd.changed.wait_for(lambda: predicate(httpd.open_connections), timeout)

    @property
    def responses_begun(self) -> int:
        """Metrics responses begun so far: a mark for ``wait_for_response_after``."""
        httpd = self._httpd
        if httpd is None:
            return 0
        with httpd._lock:
            return httpd.begun

    @property
    def scrape_interval_s(self) -> float | None:
        """Seconds between the last two scrapes by a scraper (a request with Prometheus's
        ``X-Prometheus-Scrape-Timeout-Seconds`` header): its cadence (None before two; curl and browsers
        do not count)."""
        httpd = self._httpd
        if httpd is None:
            return None
        with httpd._lock:
            times = httpd.begun_at
        return times[1] - times[0] if len(times) == 2 else None

    def wait_for_response_after(self, mark: int, timeout: float) -> bool:
        """Block until a metrics response begun after ``mark`` (from ``responses_begun``) has been sent
        whole, or ``timeout``; whether one was. Such a response was built from the state as it stood
        when the mark was taken, or later."""
        httpd = self._httpd
        if httpd is None:
            return False
        with httpd.changed:
            httpd.changed.wait_for(lambda: httpd.sent_ticket > mark or httpd.stopped, timeout)
            return httpd.sent_ticket > mark

    def stop(self, timeout: float = 10.0) -> None:
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        self.url = None
        if httpd is None:
            return
        with httpd.changed:
            httpd.stopped = True
            httpd.changed.notify_all()
        httpd.stop_serving()  # wakes the accept loop, which ends, closing the connections it holds
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("gpumemd: the metrics server thread did not stop within %.0f s", timeout)
        httpd.server_close()
        httpd.close_connections(timeout=1.0)
        httpd.unwatch_forks()


def _url_host(bind: str) -> str:
    """An address a client can use: a wildcard bind is reachable on loopback."""
    addr = ipaddress.ip_address(bind)
    if addr.is_unspecified:
        return "127.0.0.1" if addr.version == 4 else "[::1]"
    return f"[{bind}]" if addr.version == 6 else bind


def write_textfile(path: str, registry: Any) -> None:
    """Node_exporter textfile-collector output, written whole (``gpumemd.files.replace_file``)."""
    from prometheus_client import generate_latest

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    replace_file(path, generate_latest(registry))


def push_once(gateway: str, registry: Any, grouping_key: dict[str, str], timeout: float = 5.0) -> None:
    """One PUT of the registry to a Pushgateway (job ``gpumemd``), replacing this rank's group."""
    from prometheus_client import push_to_gateway

    push_to_gateway(gateway, job="gpumemd", registry=registry, grouping_key=grouping_key, timeout=timeout)
