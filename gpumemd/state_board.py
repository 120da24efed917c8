"""The agent's published state: one immutable ``AgentState``, swapped whole, and the newest step.

Writers (components, the sampler thread) take a lock and swap in a new state (``publish``); readers
never lock. A sampled step end only records its record (``pending``, one reference assignment); the
state that includes it is built by the first reader (``state``) and cached until the next step or
publish, so a step costs no state construction and a reader never waits on the training thread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from gpumemd.probes.process.identity import refreshed_identity
from gpumemd.signal_locks import YieldingLock

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.probes.health import ProbeHealth
    from gpumemd.records.step import AgentState, StepRecord


log = logging.getLogger("gpumemd")


class Probe(Protocol):
    """A probe as the state sees it: its health (errors, availability, why it is absent)."""

    @property
    def health(self) -> ProbeHealth: ...


class StateBoard:
    """``base`` is the last published state (None before the agent starts); ``pending`` the newest
    step record with the step count when it was made, not yet in a built state."""

    def __init__(self, counts: AgentView, probes: Mapping[str, Probe], wall_clock: Callable[[], float]) -> None:
        self._counts = counts  # the agent: its step counts, phase and overhead go into each state
        self._probes = probes
        self._wall = wall_clock
        self._lock = YieldingLock()  # writers only (training + sampler thread); readers never lock
        self.base: AgentState | None = None
        self.pending: tuple[StepRecord, int] | None = None
        self._view: tuple[AgentState, tuple[StepRecord, int] | None, int, AgentState] | None = None
        self._health_key: tuple[tuple[str, int, bool | None], ...] = ()
        self._health: tuple[dict[str, int], dict[str, bool]] = ({}, {})
        # When the probes' figures (allocator, host) were last published: a component's publish (a
        # finding, a census) makes the state newer than the newest step without making its readings so.
        self._sampled_at = float("-inf")

    def publish(self, changes: Mapping[str, object]) -> None:
        """Swap in a new state with ``changes`` applied (plus fresh overhead, probe health and phase)."""
        with self._lock:
            current = self.base
            assert current is not None, "agent not started"
            errors, available = self._probe_health()
            now = self._wall()
            if "host" in changes or "allocator" in changes:
                self._sampled_at = now
            self.base = dataclasses.replace(  # one reference assignment: readers see old or new
                current,
                updated_at=now,
                overhead=self._counts.overhead(),
                probe_errors=errors,
                probes_available=available,
                phase=self._counts.current_phase,
                **changes,  # type: ignore[arg-type]
            )

    def refresh_identity(self) -> bool:
        """Publish the rank torch.distributed gives now, if it differs from the one published (jobs
        often call ``init_process_group`` after attach); True once it was found."""
        base = self.base
        assert base is not None
        identity = refreshed_identity(base.identity)
        if identity is None:
            return False
        self.publish({"identity": identity})
        log.debug("gpumemd: rank %d of %d from torch.distributed", identity.rank, identity.world_size)
        return True

    def _probe_health(self) -> tuple[dict[str, int], dict[str, bool]]:
        """Errors and availability per probe; the same dicts are reused while nothing changes, so
        the per-step publish allocates nothing for them."""
        probes = [(name, p.health) for name, p in self._probes.items()]
        key = tuple((name, h.errors, h.available) for name, h in probes)
        if key != self._health_key:
            self._health_key = key
            self._health = ({n: h.errors for n, h in probes}, {n: bool(h.available) for n, h in probes})
        return self._health

    def state(self) -> AgentState:
        """The latest immutable state, the newest step included (built on first read, then cached)."""
        base, pending, total = self.base, self.pending, self._counts.steps_total
        if base is None:
            raise RuntimeError("gpumemd: the agent has not been started; use gpumemd.attach()")
        view = self._view
        if view is not None and view[0] is base and view[1] is pending and view[2] == total:
            return view[3]
        state = base if pending is None else self._with_step(base, pending[0])
        self._view = (base, pending, total, state)
        return state

    def _with_step(self, base: AgentState, record: StepRecord) -> AgentState:
        """The published state with the newest record, and the step count of the steps since it."""
        counts = self._counts
        sampler_newer = self._sampled_at > record.wall_time  # the sampler read after this step ended
        allocator = base.allocator if sampler_newer and base.allocator else (record.allocator or base.allocator)
        host = base.host if sampler_newer and base.host else (record.host or base.host)
        # The sampler's reading of the workers has their USS and PSS: the record's (RSS only) stands in
        # until it has read them once.
        workers = base.workers if base.workers is not None else record.workers
        return dataclasses.replace(
            base,
            updated_at=max(base.updated_at, record.wall_time),
            step=counts.current_step,
            steps_total=counts.steps_total,
            last_step=record,
            allocator=allocator,
            host=host,
            workers=workers,
            overhead=counts.overhead(),
            phase=counts.current_phase,
        )
