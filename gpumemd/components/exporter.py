"""The Prometheus exporter as an agent component: serve ``/metrics``, push or write it at stop.

Started last (it never serves a half-started agent) and so stopped first. It does nothing on the
training thread: scrapes read ``agent.state()`` from the server's own threads.

A fatal OOM (uncaught in the main thread: the process exits right after) must still reach
Prometheus, which scrapes every 15 s while the process would be gone in a tenth of a second. The OOM
component calls ``fatal_oom`` from its excepthook: the textfile and the Pushgateway get the OOM at
once, then the server keeps answering until one scrape has fetched a response built after the OOM
was counted, for at most ``oom_linger_s``.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumemd.addresses import redacted
from gpumemd.components.base import ComponentBase
from gpumemd.exporter.server import MetricsServer, ServeOptions, push_once, write_textfile

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from gpumemd.components.base import AgentView

log = logging.getLogger("gpumemd")

ENDING_LINGER_MAX_S = 20.0
"""Longest wait at a job's end for the scrape that records it: below Slurm's KillWait and Kubernetes'
grace period (30 s by default), with the flush around it (``gpumemd.signal_endings.DEADLINE_S``)."""


@dataclass(frozen=True)
class ExporterOptions:
    """What the exporter reads of the configuration (``Config.options(ExporterOptions)``)."""

    port: int | None
    bind: str
    tls_certfile: str | None
    tls_keyfile: str | None
    textfile: str | None
    pushgateway: str | None
    oom_linger_s: float

    @property
    def enabled(self) -> bool:
        """The exporter runs when there is somewhere to export to."""
        return self.port is not None or bool(self.textfile) or bool(self.pushgateway)


class ExporterComponent(ComponentBase):
    """``url`` is the ``/metrics`` URL while serving (``Agent.exporter_url`` reads it), else None."""

    name = "exporter"

    def __init__(self, options: ExporterOptions) -> None:
        self.config = options
        self.url: str | None = None
        self.registry: CollectorRegistry | None = None
        self._agent: AgentView | None = None
        self._server: MetricsServer | None = None
        self._exported_at_oom = False  # the textfile/Pushgateway already has the fatal OOM: not again at exit

    def start(self, agent: AgentView) -> None:
        from prometheus_client import CollectorRegistry

        from gpumemd.exporter.collector import CounterBaseline, LiveFigures, StateCollector

        self._agent = agent
        config = self.config
        # Read the allocator once now, so torch's counters as they stand at attach become the baseline.
        agent.tick()
        state = agent.state()
        # A registry of our own: no process/platform/gc collectors of the default one, and we never
        # touch the user's global REGISTRY.
        self.registry = CollectorRegistry(auto_describe=False)

        def live() -> LiveFigures:  # read at scrape time, beside the state
            return LiveFigures(seconds_per_step=agent.seconds_per_step, phase=agent.current_phase)

        self.registry.register(StateCollector(agent.state, CounterBaseline(state.allocator), live=live))
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

    def fatal_oom(self) -> None:
        """An uncaught OOM is about to end the process (the OOM component's excepthook, after the report
        and the traceback): export it now, then wait for one scrape to fetch it, ``oom_linger_s`` at most.
        Never raises; Ctrl-C ends the wait."""
        agent = self._agent
        if agent is None or not agent.running or self.registry is None:  # stopped, or a forked worker
            return
        config = self.config
        # The process ends right after: its end is recorded now, so the scrape that fetches the OOM also
        # tells Prometheus this target did not vanish (GpumemdVanishedWhileAtRisk stays quiet).
        agent.publish(ended="oom", ended_at=time.time())
        if config.textfile or config.pushgateway:
            self._exported_at_oom = True
            self._export(agent)
        server = self._server
        if server is None or config.oom_linger_s <= 0:
            return
        mark = server.responses_begun  # the OOM is in the state already: responses after this carry it
        log.warning("gpumemd: keeping %s up until a scrape records the out-of-memory error (at most %.0f s; "
                    "GPUMEMD_OOM_LINGER_S=0 exits at once)", self.url, config.oom_linger_s)
        start = time.monotonic()
        try:
            seen = server.wait_for_response_after(mark, config.oom_linger_s)
        except KeyboardInterrupt:
            return
        log.debug("gpumemd: %s after %.1f s", "a scrape fetched the OOM" if seen else "no scrape came",
                  time.monotonic() - start)

    def flush(self) -> None:
        """Write the textfile and push now (a signal may end the process next); the server needs nothing."""
        agent = self._agent
        if agent is not None and self.registry is not None:
            self._export(agent)

    def stop(self) -> None:
        agent, self._agent = self._agent, None
        if self._server is not None:
            if agent is not None:
                self._linger_for_ending(agent, self._server)
            self._server.stop()
            self._server = None
        self.url = None
        if agent is not None and self.registry is not None and not self._exported_at_oom:
            self._export(agent)

    def _linger_for_ending(self, agent: AgentView, server: MetricsServer) -> None:
        """A job that ends (cleanly: detach, normal exit, a signal) keeps serving until one scrape has fetched
        its exit marker: without it Prometheus cannot tell this end from a SIGKILL, and ``GpumemdAgentDown``
        (a static target) or ``GpumemdVanishedWhileAtRisk`` (a job at risk) would page for a clean end.
        Only when a scraper (Prometheus, not curl or a browser) has come twice (its cadence is known), for
        1.5 of its intervals at most, and never longer than ``oom_linger_s`` (0: never) or
        ``ENDING_LINGER_MAX_S``."""
        interval = server.scrape_interval_s
        if interval is None or agent.state().ended in (None, "oom"):
            return
        limit = min(self.config.oom_linger_s, 1.5 * interval + 1.0, ENDING_LINGER_MAX_S)
        if limit <= 0:
            return
        mark = server.responses_begun
        log.info("gpumemd: keeping %s up until a scrape records how the job ended (at most %.0f s)", self.url, limit)
        try:
            server.wait_for_response_after(mark, limit)
        except KeyboardInterrupt:
            return

    def _export(self, agent: AgentView) -> None:
        """Write the textfile and push to the Pushgateway, where configured; failures are logged."""
        config = self.config
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
            except (OSError, ValueError) as exc:  # URLError: unreachable, refused, timeout; ValueError: a bad name
                log.warning("gpumemd: could not push metrics to the Pushgateway %s (%s)", redacted(config.pushgateway),
                            redacted(str(exc)))

