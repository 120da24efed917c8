"""What a component is, and the narrow view of the agent it gets.

The agent drives components (``start``, ``on_eve`` and ``on_step`` around sampled step ends, ``stop``),
each hook named in ``Component``; ``ComponentBase`` gives the ones a component does not need. A component
sees the agent only through ``AgentView``: the step counters and timings it reads, the published
state, and the few calls it makes back (publish a result, ask for a sample, account for its time).
It never reaches the agent's hooks, probes, configuration or sibling components: those are given
to it by the composition root (``gpumemd.api.build_agent``) as typed constructor arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import weakref
    from collections.abc import Callable

    from gpumemd.records.census import Census
    from gpumemd.records.step import AgentState, Overhead, StepRecord


class AgentView(Protocol):
    """The part of ``gpumemd.agent.Agent`` a component may use."""

    @property
    def output_dir(self) -> str: ...

    @property
    def running(self) -> bool: ...

    @property
    def steps_total(self) -> int: ...

    @property
    def samples_total(self) -> int: ...

    @property
    def current_step(self) -> int | None: ...

    @property
    def seconds_per_step(self) -> float | None: ...

    @property
    def current_phase(self) -> str: ...

    @property
    def published(self) -> AgentState: ...

    # The job's own models and optimizers (duck-typed, as the job made them: hence Any).
    @property
    def models(self) -> weakref.WeakSet[Any]: ...

    @property
    def optimizers(self) -> weakref.WeakSet[Any]: ...

    def state(self) -> AgentState: ...

    def publish(self, **changes: object) -> AgentState: ...

    def overhead(self) -> Overhead: ...

    def steps(self) -> list[StepRecord]: ...

    def history(self) -> list[StepRecord]: ...

    def read_now(self) -> StepRecord | None: ...

    def tick(self) -> None: ...

    def sample_within(self, steps: int = 1) -> None: ...

    def sample_sparsely(self, on: bool) -> None:
        """While ``on``, sampled step ends may be further apart (``stride.SPARSE_STRETCH``): a leak
        finding is only being tracked."""

    def add_census_seconds(self, seconds: float) -> None: ...

    def add_thread_seconds(self, seconds: float) -> None: ...

    def run_in_background(self, errand: Callable[[], None]) -> bool: ...


class Component(Protocol):
    """A capability plugged into the agent (census, leak detection, OOM capture, exporter, ...).

    ``on_step`` runs on the training thread at every *sampled* step end (``record.steps`` says how
    many steps the record stands for) and must be cheap or self-spacing. ``on_eve`` runs at the end of
    the step before each sampled one (O(1) work only: most step ends are eves of none, and this one is
    a job's step). Components publish results with ``agent.publish(field=value)``; they never mutate
    state.

    On fast steps some sampled step ends are *quick* (``StepEnds.end``): the probes are read, and
    the record is made at the next full step end, in order, where a component that defines
    ``on_quick(record, samples_total)`` gets it (the leak component: every point counts; the census:
    its step count). ``on_step`` sees full step ends only, so work done "now" happens at one.
    """

    name: str

    def start(self, agent: AgentView) -> None: ...

    def on_eve(self) -> None: ...

    def on_step(self, record: StepRecord) -> None: ...

    def stop(self) -> None: ...


class ComponentBase:
    """The step hooks as no-ops, for components that need only some of them (``start`` and ``stop``
    each component writes: they are where it takes and gives back what it uses)."""

    def on_eve(self) -> None:
        return None

    def on_step(self, record: StepRecord) -> None:
        return None


@runtime_checkable
class Serving(Protocol):
    """A component that serves something at a URL while it runs (the exporter's ``/metrics``)."""

    @property
    def url(self) -> str | None: ...


@runtime_checkable
class TakesCensus(Protocol):
    """A component that takes a census on request (the census component): ``Agent.census()`` asks it,
    so the job's censuses join the ones the leak detector and the OOM report compare."""

    def take_outside_step(self) -> Census: ...


@runtime_checkable
class Flushes(Protocol):
    """A component that writes what it knows on request (the exporter's textfile and push, the state
    file): a signal may end the process next (``gpumemd.signal_endings``)."""

    def flush(self) -> None: ...
