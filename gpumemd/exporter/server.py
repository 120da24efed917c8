"""The HTTP side: serve a registry on ``/metrics``, push it once, or write it as a textfile.

The server is prometheus_client's WSGI app (``make_wsgi_app``) in a server of our own, because the
one ``start_http_server`` gives runs one unbounded thread per connection with no socket timeout
(200 idle connections were 200 threads in the training process, alive after detach) and leaves its
listening socket to forked DataLoader workers. Here:

- at most ``MAX_CONNECTIONS`` connections are served at once. When all are taken, a new one sheds the
  oldest connection still sending its request (a scrape sends its request in microseconds: the oldest
  such is the slowest client), so 16 clients trickling bytes cannot lock a scraper out; when every
  connection is already being answered, the new one is closed at accept;
- every connection has a whole-request deadline (``REQUEST_TIMEOUT_S``, from accept to its last byte,
  enforced by the accept loop) and the same socket timeout on each read: a client that sends nothing,
  trickles a byte at a time, stalls a TLS handshake or reads the answer slowly is dropped; the
  handshake runs in the connection's thread, never the accept loop;
- ``stop()`` closes the open connections and joins their threads; the accept loop polls every 50 ms,
  so a detach does not wait half a second;
- a forked child closes its copy of the listening socket and connections at once
  (``os.register_at_fork``), so the port is free as soon as the parent stops serving.

It also counts the metrics responses it begins and sends whole, so that after a fatal OOM the
exporter can wait until one scrape has carried the OOM away (``wait_for_response_after``), and learns
a scraper's cadence from the scrapes that say they are one (``scrape_interval_s``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from gpumemd.files import replace_file

log = logging.getLogger("gpumemd")

THREAD_NAME = "gpumemd-exporter"

MAX_CONNECTIONS = 16
"""Connections served at once (scrapers, a browser, curl); more are closed when accepted."""

REQUEST_TIMEOUT_S = 10.0
"""The whole-request deadline of a connection (and the socket timeout of each read): a scrape is
answered in milliseconds; a connection open this long is closed, whatever its client does."""

_SHED_WAIT_S = 1.0  # how long the accept loop waits for a shed connection's thread to free its slot

_POLL_S = 0.05  # how often the accept loop looks for stop(): the bound on a detach's wait


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


class _QuietHandler(WSGIRequestHandler):
    timeout = None  # the server sets each connection's timeout before the handshake (_serve_one)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every 15 s must not write to the job's stderr


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    opened: float  # time.monotonic() at accept
    answering: bool = False  # its request was read whole and the app is answering it
    shed: bool = False  # closed by the server (deadline, or shed for a newer client)

    def close(self) -> None:
        self.shed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, blocked reading or writing


class _ContainedServer(WSGIServer):
    """A WSGI server with a bounded set of connection threads, each with a timeout."""

    allow_reuse_address = True
    request_queue_size = MAX_CONNECTIONS

    def __init__(self, address: tuple[Any, ...], family: int, *, max_connections: int, timeout: float,
                 tls: ssl.SSLContext | None) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(max_connections)
        self._timeout = timeout
        self._tls = tls
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # notified when a connection starts or ends
        self._live: dict[threading.Thread, _Connection] = {}  # each connection's thread, socket and age
        self.begun = 0  # metrics responses begun (each one's number is its ticket)
        self.begun_at: tuple[float, ...] = ()  # monotonic times the last two scrapes (a scraper's) began
        self.sent_ticket = 0  # the highest ticket of a metrics response sent whole
        self.stopped = False  # set by MetricsServer.stop: a wait for a response ends
        super().__init__(address, _QuietHandler)

    def count(self, app: Callable[..., Any]) -> Callable[..., Any]:
        """``app`` with its metrics responses numbered when begun and recorded once sent whole."""

        def counted(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            self._answering()
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

    def _answering(self) -> None:
        with self._lock:
            conn = self._live.get(threading.current_thread())
            if conn is not None:
                conn.answering = True

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not self._shed_for_new():
            self.shutdown_request(request)  # every slot is answering a request: closed at once, no thread
            return
        thread = threading.Thread(target=self._serve_one, args=(request, client_address),
                                  name=f"{THREAD_NAME}-connection", daemon=True)
        with self.changed:
            self._live[thread] = _Connection(request, time.monotonic())
            self.changed.notify_all()
        thread.start()

    def _shed_for_new(self) -> bool:
        """Every slot is taken: close the oldest connection still sending its request and take its
        slot once its thread has let it go. False when none is (every one is being answered)."""
        with self._lock:
            reading = [c for c in self._live.values() if not c.answering and not c.shed]
            oldest = min(reading, key=lambda c: c.opened, default=None)
            if oldest is not None:
                oldest.close()
        if oldest is None:
            return self._slots.acquire(blocking=False)
        return self._slots.acquire(timeout=_SHED_WAIT_S)

    def service_actions(self) -> None:
        """Run by the accept loop at least every ``_POLL_S``: close connections past their deadline."""
        expired = time.monotonic() - self._timeout
        with self._lock:
            for conn in self._live.values():
                if conn.opened < expired and not conn.shed:
                    conn.close()

    def _serve_one(self, request: socket.socket, client_address: Any) -> None:
        try:
            request.settimeout(self._timeout)
            if self._tls is not None:
                request = self._tls.wrap_socket(request, server_side=True)  # the handshake, here
                with self._lock:
                    conn = self._live.get(threading.current_thread())
                    if conn is not None:
                        conn.sock = request
            self.finish_request(request, client_address)
        except (OSError, ValueError):
            pass  # a client that went away, timed out or failed its handshake: nothing to report
        finally:
            self.shutdown_request(request)
            self._slots.release()  # before leaving _live: a count below the cap means a free slot
            with self.changed:
                self._live.pop(threading.current_thread(), None)
                self.changed.notify_all()

    def close_connections(self, timeout: float) -> None:
        with self._lock:
            live = list(self._live.items())
        for _, conn in live:
            conn.close()
        for thread, _ in live:
            thread.join(timeout)

    def close_in_forked_child(self) -> None:
        """This process is a fork: its copies of the sockets must not keep the port or clients."""
        with self._lock:
            conns = list(self._live.values())
            self._live.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.close()
        with contextlib.suppress(OSError):
            self.socket.close()


_servers: weakref.WeakSet[_ContainedServer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for server in list(_servers):
        server.close_in_forked_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class MetricsServer:
    """One running ``/metrics`` endpoint. ``start`` raises OSError when the port is taken."""

    def __init__(self, registry: Any, options: ServeOptions, *, max_connections: int = MAX_CONNECTIONS,
                 timeout: float = REQUEST_TIMEOUT_S) -> None:
        self._registry = registry
        self._options = options
        self._max_connections = max_connections
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
        httpd = _ContainedServer((opts.bind, opts.port), family, max_connections=self._max_connections,
                                 timeout=self._timeout, tls=tls)
        httpd.set_app(httpd.count(make_wsgi_app(self._registry)))
        _servers.add(httpd)
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": _POLL_S},
                                  name=THREAD_NAME, daemon=True)
        thread.start()
        self._httpd, self._thread = httpd, thread
        port = int(httpd.server_address[1])
        scheme = "https" if opts.certfile else "http"
        self.url = f"{scheme}://{_url_host(opts.bind)}:{port}/metrics"
        return self.url

    @property
    def port(self) -> int | None:
        return int(self._httpd.server_address[1]) if self._httpd is not None else None

    @property
    def connections(self) -> int:
        """Connections being served now (at most ``max_connections``)."""
        httpd = self._httpd
        if httpd is None:
            return 0
        with httpd._lock:
            return len(httpd._live)

    def wait_for_connections(self, predicate: Callable[[int], bool], timeout: float) -> bool:
        """Block until ``predicate(connections being served)`` holds, or ``timeout``; its last value."""
        httpd = self._httpd
        if httpd is None:
            return predicate(0)
        with httpd.changed:
            return httpd.changed.wait_for(lambda: predicate(len(httpd._live)), timeout)

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
        httpd.shutdown()  # returns once serve_forever has left its loop (within _POLL_S)
        httpd.server_close()
        httpd.close_connections(timeout=1.0)
        _servers.discard(httpd)
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("gpumemd: the metrics server thread did not stop within %.0f s", timeout)


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
