"""The public lifecycle (one agent per process, started by ``attach()`` and removed by ``detach()``),
and the composition root: ``build_agent`` is the one place that builds the probes, the process's
allocation history and the components, and hands each its dependencies and its own options.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpumemd.config import Config
from gpumemd.config_renamed import current_name

if TYPE_CHECKING:
    from gpumemd.agent import Agent
    from gpumemd.components.base import Component
    from gpumemd.probes.device.allocation_history import AllocationHistory
    from gpumemd.probes.device.allocator import AllocatorProbe
    from gpumemd.probes.device.nvml import NvmlProbe
    from gpumemd.probes.process.host import HostProbe
    from gpumemd.probes.process.workers import WorkersProbe
    from gpumemd.records.step import Identity, StepRecord

log = logging.getLogger("gpumemd")

_lock = threading.Lock()
_agent: Agent | None = None


def attach(*, model: Any = None, optimizer: Any = None, **overrides: Any) -> Agent:
    """Start the agent (or return the running one) with ``GPUMEMD_*`` env vars and ``overrides``.

    Bad configuration raises ``ValueError`` here, naming the variable, the value and what is
    accepted. A second call returns the running agent; its ``model``/``optimizer`` are registered.
    """
    global _agent
    config = Config.from_sources(os.environ, **overrides)  # validate even when already attached
    if _reimporting_main():
        log.debug("gpumemd: not attaching in a process multiprocessing is starting (pid %d)", os.getpid())
        return build_agent(config, model=model, optimizer=optimizer, components=())  # never started: silent
    with _lock:
        agent = current()
        if agent is None:
            try:
                agent = build_agent(config, model=model, optimizer=optimizer)
                agent.start()
            except Exception as exc:  # noqa: BLE001 - the job comes first: no agent, never an error
                return _absent(config, agent, exc, model=model, optimizer=optimizer)
            _agent = agent
            return agent
    for obj in (model, optimizer):
        if obj is not None:
            agent.register(obj)
    _say_kept_settings(agent, config, overrides)
    return agent


def _reimporting_main() -> bool:
    """Is this a process that ``multiprocessing`` started with spawn or forkserver, re-importing the
    job's script (as ``__mp_main__``) before it runs its target? A DataLoader worker under the spawn
    start method does, so an ``attach()`` at the top of the script runs in every worker: those must
    stay silent, as forked workers are (they inherit a stopped agent). multiprocessing marks that
    import with ``_inheriting`` on the current process (its own checks read it). An ``attach()`` the
    worker's own code makes afterwards (``worker_init_fn``, a ``torch.multiprocessing.spawn`` target)
    is asked for there, and attaches."""
    mp = sys.modules.get("multiprocessing")  # a spawned child has imported it to start
    if mp is None:
        return False
    try:
        return bool(getattr(mp.current_process(), "_inheriting", False))
    except Exception:  # noqa: BLE001 - an odd multiprocessing: attach as usual
        return False


def _absent(config: Config, agent: Agent | None, exc: Exception, *, model: Any, optimizer: Any) -> Agent:
    """``attach()`` could not build or start the agent (a thread the process may not start, a probe's
    library failing in an unforeseen way): the job goes on unwatched, and one line says why."""
    log.warning("gpumemd: not attached (%s: %s); the job runs without gpumemd", type(exc).__name__, exc)
    if agent is not None:
        with contextlib.suppress(Exception):
            agent.stop()  # whatever start() installed before it failed (hooks, components)
    return build_agent(config, model=model, optimizer=optimizer, components=())  # never started


def _say_kept_settings(agent: Agent, asked: Config, overrides: dict[str, Any]) -> None:
    """A second attach() keeps the running agent as it is: say so when it asked for something else
    (``gpumemd run`` attached first and the script's own ``attach(port=9400)`` would be lost silently)."""
    names = {current_name(k) for k in overrides}  # attach(phases=...) asks for step_profile
    differ = sorted(k for k in names if getattr(asked, k, None) != getattr(agent.config, k, None))
    if not differ:
        return
    wanted = ", ".join(f"{k}={getattr(asked, k)!r}" for k in differ)
    running = ", ".join(f"{k}={getattr(agent.config, k)!r}" for k in differ)
    log.warning(
        "gpumemd: attach(%s) found an agent already attached (by `gpumemd run` or an earlier attach) and "
        "kept its settings (%s); give these options to `gpumemd run` or to the first attach()",
        wanted, running)


def detach() -> None:
    """Stop the agent and remove every hook, thread, server and handler it installed."""
    global _agent
    with _lock:
        agent, _agent = _agent, None
    if agent is not None:
        agent.stop()


def current() -> Agent | None:
    """The running agent of this process, or None (also None in a forked DataLoader worker)."""
    agent = _agent
    return agent if agent is not None and agent.running else None


@contextmanager
def attached(*, model: Any = None, optimizer: Any = None, **overrides: Any) -> Iterator[Agent]:
    """``with gpumemd.attached(...) as agent:`` attach for the block, detach after it."""
    agent = attach(model=model, optimizer=optimizer, **overrides)
    try:
        yield agent
    finally:
        detach()


def mark_step(step: int | None = None) -> StepRecord | None:
    """End a training step by hand (overrides the automatic optimizer hook). No-op when detached."""
    agent = current()
    return agent.mark_step(step) if agent is not None else None


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the steps inside the block (``with gpumemd.phase("eval"):``). No-op when detached."""
    agent = current()
    if agent is None:
        if not name or not isinstance(name, str):
            raise ValueError(f"gpumemd.phase(name) needs a non-empty string, got {name!r}")
        yield
        return
    with agent.phase(name):
        yield


# --- the composition root ----------------------------------------------------------------------


def build_agent(
    config: Config,
    *,
    model: Any = None,
    optimizer: Any = None,
    components: Sequence[Component] | None = None,
    allocator_probe: AllocatorProbe | None = None,
    host_probe: HostProbe | None = None,
    nvml_probe: NvmlProbe | None = None,
    identity: Identity | None = None,
    history: AllocationHistory | None = None,
    clock: Callable[[], float] = time.perf_counter,
    wall_clock: Callable[[], float] = time.time,
    max_stride: int | None = None,
    workers_probe: WorkersProbe | None = None,
) -> Agent:
    """An agent (not started) with the probes and components ``config`` asks for; any of them can be
    given instead (tests and benchmarks do). ``components=None`` means the default set."""
    from gpumemd.agent import Agent
    from gpumemd.probes.device.allocator import AllocatorProbe
    from gpumemd.probes.process.host import HostProbe
    from gpumemd.probes.process.workers import WorkersProbe

    if components is None:
        components = build_components(config, history=history)
    if nvml_probe is None and config.nvml:
        from gpumemd.probes.device.nvml import NvmlProbe

        nvml_probe = NvmlProbe(defer=True)  # started on the sampler's thread (Sampler.start)
    return Agent(config, allocator_probe=allocator_probe or AllocatorProbe(), host_probe=host_probe or HostProbe(),
                 nvml_probe=nvml_probe, components=components, model=model, optimizer=optimizer,
                 identity=identity, clock=clock, wall_clock=wall_clock, max_stride=max_stride,
                 workers_probe=workers_probe if workers_probe is not None else WorkersProbe())


def build_components(config: Config, *, history: AllocationHistory | None = None) -> list[Component]:
    """The capabilities a normal ``attach()`` turns on, each switched by its ``Config`` option, in
    start order: census first (the leak detector and the OOM report read its censuses), the leak
    detector next, then the step profile and OOM capture, the exporter last (it starts after everything
    it exports and so never serves a half-started agent; it stops first).

    ``history`` is the process's one allocation-history owner (torch's recording is process-wide),
    shared by the leak detector and the OOM capture. The census component is always built: it is the
    one census path (the job's ``Agent.census()``, the census at an OOM); ``census=False`` only turns
    off its censuses at step ends, and the leak detector, which reads those, then gets none."""
    from gpumemd.components.census_component import CensusComponent, CensusOptions
    from gpumemd.probes.census.census_steps import census_steps
    from gpumemd.probes.device.allocation_history import process_history

    history = history if history is not None else process_history()
    census = CensusComponent(config.options(CensusOptions), census_fn=census_steps)
    components: list[Component] = [census]
    if config.leak_detection:
        from gpumemd.components.leak import LeakComponent, LeakOptions
        from gpumemd.probes.survival.long_lived import long_lived_probes

        components.append(LeakComponent(config.options(LeakOptions), census=census if config.census else None,
                                        history=history, probes=long_lived_probes))
    if config.step_profile:
        from gpumemd.components.step_profiler import StepProfileComponent, StepProfileOptions

        components.append(StepProfileComponent(config.options(StepProfileOptions)))
    from gpumemd.components.exporter import ExporterComponent, ExporterOptions

    exporter_options = config.options(ExporterOptions)
    exporter = ExporterComponent(exporter_options) if exporter_options.enabled else None
    if config.oom_reports:
        from gpumemd.components.oom_component import OomComponent, OomOptions
        from gpumemd.probes.snapshots.snapshot import SnapshotProbe

        components.append(OomComponent(config.options(OomOptions), snapshot_probe=SnapshotProbe(history=history),
                                       census=census, on_fatal=exporter))
    from gpumemd.components.state_writer import LastStateComponent

    components.append(LastStateComponent())  # before the exporter: stopped after it, with the ending in
    if exporter is not None:
        components.append(exporter)
    return components
