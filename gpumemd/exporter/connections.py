"""The connections of the metrics server: a bounded accept loop and a bounded set of threads.

``prometheus_client.start_http_server`` runs one unbounded thread per connection with no socket
timeout. ``ContainedServer`` instead:

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
- ``MetricsServer.stop()`` closes the open connections and joins their threads; it wakes the accept loop,
  so a detach does not wait for its next poll;
- a forked child closes its copy of the listening socket and connections at once
  (``os.register_at_fork``), so the port is free as soon as the parent stops serving.
"""

from __future__ import annotations

import contextlib
import io
import os
import selectors
import socket
import ssl
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

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

_POLL_S = 0.5
"""How often the idle accept loop wakes to close connections past their deadline. A stop, and a thread
that frees a slot for a waiting request, wake it at once (``_wake``): an idle exporter takes the job's
GIL twice a second, not twenty times."""


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
    server: ContainedServer

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


class ContainedServer(WSGIServer):
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
        self.changed = threading.Condition(self._lock)  # notified when a connection comes or goes (or a response)
        self._waiting: dict[int, _Connection] = {}  # by fd: still sending their request (the loop's own)
        self._ready: deque[_Connection] = deque()  # sent it whole, waiting for a free thread
        self._live: dict[threading.Thread, _Connection] = {}  # being answered, each by its thread
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()  # a byte here wakes the accept loop
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        super().__init__(address, _QuietHandler)
        self.socket.setblocking(False)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed (stopped)
            self._wake_w.send(b"x")

    def watch_forks(self) -> None:
        """Close this server's sockets in a forked child (a DataLoader worker) at once."""
        _servers.add(self)

    def unwatch_forks(self) -> None:
        _servers.discard(self)

    @property
    def open_connections(self) -> int:
        return len(self._waiting) + len(self._ready) + len(self._live)

    def serve(self) -> None:
        """The accept loop, until ``stop_serving``: accepts, reads requests, hands them to threads."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            next_expiry = 0.0
            while not self._stop.is_set():
                events = selector.select(_POLL_S)
                # what came on held connections before new ones: a request that came whole is read
                # before any newer connection can shed it (and no key outlives its socket)
                for key, _ in events:
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    elif key.fileobj is not self.socket:
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
        self._wake()

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
                if not chunk:
                    break  # it went away
                before = len(conn.head)
                conn.head += chunk  # (with the start of a body, if one came along)
                if conn.request_complete(before):
                    del self._waiting[sock.fileno()]
                    selector.unregister(sock)
                    self._ready.append(conn)
                    return
                if len(conn.head) > _HEAD_MAX:
                    break  # headers longer than any scrape's
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
        _close(conn.sock)

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
            if self._ready:
                self._wake()  # a request waits for the slot just freed

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
        _close(*(conn.sock for conn in conns), self.socket, self._wake_r, self._wake_w)

    def server_close(self) -> None:
        super().server_close()
        _close(self._wake_r, self._wake_w)


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):  # closed already
            sock.close()


_servers: weakref.WeakSet[ContainedServer] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for server in list(_servers):
        server.close_in_forked_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
