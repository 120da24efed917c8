"""The Prometheus exporter as an agent component: serve ``/metrics``, push or write it at stop.

Started last (it never serves a half-started agent) and so stopped first. It does nothing on the
training thread: scrapes read ``agent.state()`` from the server's own threads.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import TYPE_CHECKING, Any

from gpumemd.exporter.server import MetricsServer, ServeOptions, push_once, write_textfile

if TYPE_CHECKING:
    from gpumemd.agent import Agent
    from gpumemd.records.step import StepRecord

log = logging.getLogger("gpumemd")


class ExporterComponent:
    """``url`` is the ``/metrics`` URL while serving (``Agent.exporter_url`` reads it), else None."""

    name = "exporter"

    def __init__(self) -> None:
        self.url: str | None = None
        self.registry: Any = None
        self._agent: Agent | None = None
        self._server: MetricsServer | None = None

    def start(self, agent: Agent) -> None:
        from prometheus_client import CollectorRegistry

        from gpumemd.exporter.collector import CounterBaseline, StateCollector

        self._agent = agent
        config = agent.config
        # Read the allocator once now, so torch's counters as they stand at attach become the baseline.
        agent.tick()
        state = agent.state()
        # A registry of our own: no process/platform/gc collectors of the default one, and we never
        # touch the user's global REGISTRY.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StateCollector(agent.state, CounterBaseline(state.allocator)))
        if config.port is None:
            return  # textfile / pushgateway alone need no server
        port = config.port + state.identity.local_rank if config.port else 0
        if port > 65535:
            log.warning("gpumemd: metrics port %d + LOCAL_RANK %d is above 65535; the job goes on without "
                        "an exporter (choose a lower GPUMEMD_PORT)", config.port, state.identity.local_rank)
            return
        server = MetricsServer(
            self.registry,
            ServeOptions(port=port, bind=config.bind, certfile=config.tls_certfile, keyfile=config.tls_keyfile),
        )
        try:
            self.url = server.start()
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"could not be bound ({exc})"
            log.warning("gpumemd: metrics port %s:%d %s; the job goes on without an exporter "
                        "(set GPUMEMD_PORT / attach(port=...) to a free port, or 0 for any)", config.bind, port, why)
            return
        self._server = server
        log.info("gpumemd: serving metrics at %s", self.url)

    def on_step(self, record: StepRecord) -> None:
        return None  # scrapes read the published state; nothing to do on the training thread

    def stop(self) -> None:
        agent, self._agent = self._agent, None
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.url = None
        if agent is None or self.registry is None:
            return
        config = agent.config
        if config.textfile:
            try:
                write_textfile(config.textfile, self.registry)
            except OSError as exc:
                log.warning("gpumemd: could not write the metrics textfile %s (%s)", config.textfile, exc)
        if config.pushgateway:
            ident = agent.state().identity
            key = {"instance": ident.hostname or socket.gethostname(), "rank": str(ident.rank)}
            try:
                push_once(config.pushgateway, self.registry, key)
            except OSError as exc:  # URLError is an OSError: unreachable gateway, refused, timeout
                log.warning("gpumemd: could not push metrics to the Pushgateway %s (%s)", config.pushgateway, exc)


def enabled(config: Any) -> bool:
    """The exporter runs when there is somewhere to export to."""
    return config.port is not None or bool(config.textfile) or bool(config.pushgateway)
