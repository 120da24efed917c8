"""The HTTP side: serve a registry on ``/metrics``, push it once, or write it as a textfile.

The server is prometheus_client's WSGI app (``make_wsgi_app``) in a server of our own, because the
one ``start_http_server`` gives runs one unbounded thread per connection with no socket timeout
(200 idle connections were 200 threads in the training process, alive after detach) and leaves its
listening socket to forked DataLoader workers. Here:

- the accept loop (one thread, a selector) reads each connection's request itself, without blocking,
  and only a request sent whole gets a thread; at most ``MAX_CONNECTIONS`` are answered at once (a
  scrape is answered in milliseconds; more wait their turn). A client that sends part of a request or
  nothing costs a socket and at most 16 KiB until its deadline, never a thread, so clients that
  reconnect the moment they are dropped cannot keep a scraper out (with one thread per connection
  and a backlog of 16, 64 such clients filled the backlog and scrapes timed out at connect). At most
  ``MAX_WAITING`` connections wait: a newer one closes the oldest, the slowest client;
- every connection has a whole-request deadline (``REQUEST_TIMEOUT_S``, from accept to its last
  byte, enforced by the accept loop) and the same socket timeout on each read and write once it is
  answered: a client that sends nothing, trickles a byte at a time, stalls a TLS handshake (run by
  the accept loop a step at a time, as bytes come) or reads the answer slowly is dropped;
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
import io
import ipaddress
import logging
import os
import selectors
import socket
import ssl
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from gpumemd.files import replace_file

log = logging.getLogger("gpumemd")

THREAD_NAME = "gpumemd-exporter"

MAX_CONNECTIONS = 16
"""Requests answered at once, one thread each (scrapers, a browser, curl); more wait their turn."""

MAX_WAITING = 128
"""Connections still sending their request, held by the accept loop without a thread; when more
come, the oldest is closed. Also the listen backlog."""

REQUEST_TIMEOUT_S = 10.0
"""The whole-request deadline of a connection (and the socket timeout of each read): a scrape is
answered in milliseconds; a connection open this long is closed, whatever its client does."""

_HEAD_MAX = 16 * 1024  # a request line and headers longer than this are no scrape's: closed

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


class _Replay(io.RawIOBase):
    """The bytes the accept loop read off a connection, then the socket: what the handler reads."""

    def __init__(self, head: bytes, sock: socket.socket) -> None:
        self._head = memoryview(head)
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._sock.recv_into(buffer)


class _QuietHandler(WSGIRequestHandler):
    timeout = None  # the server sets each connection's timeout before it is answered (_serve_one)
    server: _ContainedServer

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_Replay(self.server.head_of_current(), self.connection))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every 15 s must not write to the job's stderr


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    address: Any
    opened: float  # time.monotonic() at accept
    handshaken: bool  # False for a TLS connection until its handshake is done
    head: bytearray = field(default_factory=bytearray)  # what it sent so far (read by the accept loop)
    shed: bool = False  # closed by the server (deadline, stop, or shed for a newer client)

    def close(self) -> None:
        self.shed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, blocked reading or writing

    def request_complete(self, before: int) -> bool:
        """Its header block has ended (looked for only in what came after ``before`` bytes)."""
        tail = self.head[max(0, before - 3):]
        return b"\n\r\n" in tail or b"\n\n" in tail


class _ContainedServer(WSGIServer):
    """A WSGI server whose accept loop reads each request whole before a bounded set of threads
    answers it, with a deadline on each connection."""

    allow_reuse_address = True
    request_queue_size = MAX_WAITING

    def __init__(self, address: tuple[Any, ...], family: int, *, max_connections: int, max_waiting: int,
                 timeout: float, tls: ssl.SSLContext | None) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_waiting = max_waiting
        self._timeout = timeout
        self._tls = tls
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # notified when a connection comes or goes
        self._waiting: dict[int, _Connection] = {}  # by fd: still sending their request (the loop's own)
        self._ready: deque[_Connection] = deque()  # sent it whole, waiting for a free thread
        self._live: dict[threading.Thread, _Connection] = {}  # being answered, each by its thread
        self._stop = threading.Event()
        self.begun = 0  # metrics responses begun (each one's number is its ticket)
        self.begun_at: tuple[float, ...] = ()  # monotonic times the last two scrapes (a scraper's) began
        self.sent_ticket = 0  # the highest ticket of a metrics response sent whole
        self.stopped = False  # set by MetricsServer.stop: a wait for a response ends
        super().__init__(address, _QuietHandler)
        self.socket.setblocking(False)

    @property
    def open_connections(self) -> int:
        return len(self._waiting) + len(self._ready) + len(self._live)

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

    def serve(self) -> None:
        """The accept loop, until ``stop_serving``: accepts, reads requests, hands them to threads."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            next_expiry = 0.0
            while not self._stop.is_set():
                events = selector.select(_POLL_S)
                # what came on held connections before new ones: a request that came whole is read
                # before any newer connection can shed it (and no key outlives its socket)
                for key, _ in events:
                    if key.fileobj is not self.socket:
                        self._read(selector, self._waiting[key.fd])
                if any(key.fileobj is self.socket for key, _ in events):
                    self._accept(selector)
                self._dispatch()
                if time.monotonic() >= next_expiry:  # not at every event: a flood makes many
                    self._expire(selector)
                    next_expiry = time.monotonic() + _POLL_S
                with self.changed:
                    self.changed.notify_all()
            for conn in [*self._waiting.values(), *self._ready]:
                self._drop(None, conn)

    def stop_serving(self) -> None:
        self._stop.set()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        # a quarter of the room a turn, then the reads: a connection is read at least 4 times before
        # newer ones can shed it
        for _ in range(max(1, self._max_waiting // 4)):
            try:
                sock, address = self.socket.accept()
            except OSError:
                return  # none left (or out of descriptors: the deadlines free some)
            try:
                sock.setblocking(False)
                if self._tls is not None:  # its handshake runs here, a step at a time, as bytes come
                    sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except OSError:
                sock.close()  # gone already
                continue
            if len(self._waiting) >= self._max_waiting:  # the oldest still sending is the slowest client
                self._drop(selector, next(iter(self._waiting.values())))  # (the first in, as accepted)
            conn = _Connection(sock, address, time.monotonic(), handshaken=self._tls is None)
            self._waiting[sock.fileno()] = conn
            selector.register(sock, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
        """What the connection sent since; it moves to ``_ready`` once its request is whole."""
        sock = conn.sock
        try:
            if not conn.handshaken:
                assert isinstance(sock, ssl.SSLSocket)
                sock.do_handshake()
                conn.handshaken = True
            while True:  # until no more (a TLS socket may hold decrypted bytes the selector cannot see)
                chunk = sock.recv(_HEAD_MAX + 1 - len(conn.head))
                if not chunk or len(conn.head) + len(chunk) > _HEAD_MAX:
                    break  # it went away, or its headers are longer than any scrape's
                before = len(conn.head)
                conn.head += chunk
                if conn.request_complete(before):
                    del self._waiting[sock.fileno()]
                    selector.unregister(sock)
                    self._ready.append(conn)
                    return
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return  # more to come (a server's handshake writes fit in a fresh socket's buffer)
        except (OSError, ValueError):
            pass  # reset, or a failed handshake
        self._drop(selector, conn)

    def _drop(self, selector: selectors.BaseSelector | None, conn: _Connection) -> None:
        """Close a connection the accept loop holds (waiting or ready; never a thread's)."""
        if self._waiting.pop(conn.sock.fileno(), None) is not None and selector is not None:
            selector.unregister(conn.sock)
        conn.shed = True
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _dispatch(self) -> None:
        """A thread for each whole request, while fewer than ``max_connections`` are being answered."""
        while self._ready and self._slots.acquire(blocking=False):
            conn = self._ready.popleft()
            thread = threading.Thread(target=self._serve_one, args=(conn,), name=f"{THREAD_NAME}-connection",
                                      daemon=True)
            with self._lock:
                self._live[thread] = conn
            try:
                thread.start()
            except RuntimeError:  # no thread to be had (a process limit): this client loses its turn
                with self._lock:
                    self._live.pop(thread)
                self._slots.release()
                self._drop(None, conn)
                return

    def _expire(self, selector: selectors.BaseSelector) -> None:
        """Close every connection past its whole-request deadline, wherever it is."""
        expired = time.monotonic() - self._timeout
        for conn in [c for c in (*self._waiting.values(), *self._ready) if c.opened < expired]:
            with contextlib.suppress(ValueError):
                self._ready.remove(conn)
            self._drop(selector, conn)
        with self._lock:
            for conn in self._live.values():
                if conn.opened < expired and not conn.shed:
                    conn.close()

    def head_of_current(self) -> bytes:
        with self._lock:
            return bytes(self._live[threading.current_thread()].head)

    def _serve_one(self, conn: _Connection) -> None:
        try:
            conn.sock.settimeout(self._timeout)  # blocking again, each read and write bounded
            self.finish_request(conn.sock, conn.address)
        except (OSError, ValueError):
            pass  # a client that went away or timed out: nothing to report
        finally:
            self.shutdown_request(conn.sock)
            self._slots.release()
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
            conns = [*self._live.values(), *self._waiting.values(), *self._ready]
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
                 max_waiting: int = MAX_WAITING, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self._registry = registry
        self._options = options
        self._max_connections = max_connections
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
        httpd = _ContainedServer((opts.bind, opts.port), family, max_connections=self._max_connections,
                                 max_waiting=self._max_waiting, timeout=self._timeout, tls=tls)
        httpd.set_app(httpd.count(make_wsgi_app(self._registry)))
        _servers.add(httpd)
        thread = threading.Thread(target=httpd.serve, name=THREAD_NAME, daemon=True)
        thread.start()
        self._httpd, self._thread = httpd, thread
        port = int(httpd.server_address[1])
        scheme = "https" if opts.certfile else "http"
        self.url = f"{scheme}://{_url_host(opts.bind)}:{port}/metrics"
        return self.url

    @property
    def port(self) -> int | None:
        return int(self._httpd.server_address[1]) if self._httpd is not None else None

    def wait_for_connections(self, predicate: Callable[[int], bool], timeout: float) -> bool:
        """Block until ``predicate(connections open: waiting or answered)`` holds, or ``timeout``; its
        last value. (The accept loop changes the count and notifies at least every ``_POLL_S``.)"""
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
        httpd.stop_serving()  # the accept loop ends within _POLL_S, closing the connections it holds
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("gpumemd: the metrics server thread did not stop within %.0f s", timeout)
        httpd.server_close()
        httpd.close_connections(timeout=1.0)
        _servers.discard(httpd)


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
