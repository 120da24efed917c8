"""The HTTP side: serve a registry on ``/metrics``, push it once, or write it as a textfile.

prometheus_client's ``start_http_server`` returns ``(httpd, thread)``; we keep both so ``stop()``
shuts the server down, closes its socket and joins its thread (nothing survives a detach).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gpumemd")

THREAD_NAME = "gpumemd-exporter"


@dataclass(frozen=True, slots=True)
class ServeOptions:
    port: int  # the final port (LOCAL_RANK already added); 0 picks a free one
    bind: str = "127.0.0.1"
    certfile: str | None = None
    keyfile: str | None = None


class MetricsServer:
    """One running ``/metrics`` endpoint. ``start`` raises OSError when the port is taken."""

    def __init__(self, registry: Any, options: ServeOptions) -> None:
        self._registry = registry
        self._options = options
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def start(self) -> str:
        from prometheus_client import start_http_server

        opts = self._options
        httpd, thread = start_http_server(
            opts.port, addr=opts.bind, registry=self._registry, certfile=opts.certfile, keyfile=opts.keyfile
        )
        thread.name = THREAD_NAME  # so the test suite's thread check sees it if it ever outlives stop()
        self._httpd, self._thread = httpd, thread
        port = int(httpd.server_address[1])
        scheme = "https" if opts.certfile else "http"
        self.url = f"{scheme}://{_url_host(opts.bind)}:{port}/metrics"
        return self.url

    @property
    def port(self) -> int | None:
        return int(self._httpd.server_address[1]) if self._httpd is not None else None

    def stop(self, timeout: float = 10.0) -> None:
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        self.url = None
        if httpd is None:
            return
        httpd.shutdown()  # returns once serve_forever has left its loop
        httpd.server_close()
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
    """node_exporter textfile-collector output, written atomically (temp file + os.replace)."""
    from prometheus_client import generate_latest

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # same directory: os.replace stays atomic (one filesystem)
    try:
        with open(tmp, "wb") as f:
            f.write(generate_latest(registry))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def push_once(gateway: str, registry: Any, grouping_key: dict[str, str], timeout: float = 5.0) -> None:
    """One PUT of the registry to a Pushgateway (job ``gpumemd``), replacing this rank's group."""
    from prometheus_client import push_to_gateway

    push_to_gateway(gateway, job="gpumemd", registry=registry, grouping_key=grouping_key, timeout=timeout)
