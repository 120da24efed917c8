"""The agent: the only place with hooks, threads and global state.

One training step, as the agent sees it: ``optimizer.step()`` returns -> the global optimizer
post-step hook -> the step is counted. On a *sampled* step the agent then reads allocator stats and
host RSS, appends a ``StepRecord`` to a bounded ring buffer and calls each component's ``on_step``
(census, leak detector, ...). Outputs (exporter, reports) only ever read the published state.

Which steps are sampled, and what a sampled step end does: ``gpumemd.step_end``. What one "step" is,
and how steps are counted: ``gpumemd.step_clock``. What a sampled step end reads: ``gpumemd.step_reading``.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from gpumemd.agent_announce import exit_line, say, say_exit, start_facts, warn_output
from gpumemd.announce import start_line
from gpumemd.component_set import ComponentSet
from gpumemd.components.base import Serving, TakesCensus
from gpumemd.config import Config
from gpumemd.output_dir import settle_output_dir
from gpumemd.probes.process.identity import RankLogFilter, current_identity
from gpumemd.records.step import AgentState, Identity, Overhead, StepRecord
from gpumemd.sampler import Sampler
from gpumemd.signal_endings import SignalEndings, ending_at_exit
from gpumemd.state_board import StateBoard
from gpumemd.step_end import StepEnds
from gpumemd.step_log import StepLog
from gpumemd.step_reading import StepReader
from gpumemd.stride import MAX_STRIDE, StridePlanner

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpumemd.components.base import Component
    from gpumemd.probes.device.allocator import AllocatorProbe
    from gpumemd.probes.device.nvml import NvmlProbe
    from gpumemd.probes.process.host import HostProbe
    from gpumemd.probes.process.workers import WorkersProbe
    from gpumemd.records.census import Census
    from gpumemd.records.findings import Finding
    from gpumemd.state_board import Probe

__all__ = ["MAX_STRIDE", "Agent"]

log = logging.getLogger("gpumemd")

ComponentT = TypeVar("ComponentT")


class Agent:
    """Samples memory every step into a bounded ring of step records and publishes an immutable state.

    The agent owns the hooks; what it samples with (probes) and what it drives (components) are given
    to it: ``gpumemd.api.build_agent`` builds both from the configuration. Its parts: the step clock
    (``gpumemd.step_clock``), the sampled step end (``gpumemd.step_end``), its reads
    (``gpumemd.step_reading``), the stride (``gpumemd.stride``), the sampler thread (``gpumemd.sampler``),
    the published state (``gpumemd.state_board``) and what it says at start and exit (``gpumemd.agent_announce``).
    The agent imports no component and looks components up by type (``component``).
    """

    def __init__(
        self,
        config: Config,
        *,
        allocator_probe: AllocatorProbe,
        host_probe: HostProbe,
        nvml_probe: NvmlProbe | None = None,
        components: Sequence[Component] = (),
        model: Any = None,
        optimizer: Any = None,
        identity: Identity | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        max_stride: int | None = None,
        workers_probe: WorkersProbe | None = None,
    ) -> None:
        self.config = config
        self.output_dir = os.path.abspath(config.output_dir)
        self._clock = clock
        self._wall = wall_clock
        self._closed_at_stop = (nvml_probe, host_probe, workers_probe)  # what holds files or a library open
        self._identity = identity
        self._components = ComponentSet(components)
        named: dict[str, Probe | None] = {"allocator": allocator_probe, "host": host_probe, "nvml": nvml_probe,
                                          "workers": workers_probe}
        self._probes: dict[str, Probe] = {name: probe for name, probe in named.items() if probe is not None}
        self._board = StateBoard(self, self._probes, wall_clock)
        self._reader = StepReader(allocator=allocator_probe, host=host_probe, workers=workers_probe,
                                  published=lambda: self._board.base, wall_clock=wall_clock,
                                  reset_peaks=config.reset_peak_each_step)
        self._log = StepLog(self._reader, config.keep_steps)
        self._sampler = Sampler(allocator=allocator_probe, host=host_probe, nvml=nvml_probe, clock=clock,
                                workers=workers_probe)
        self.run_in_background = self._sampler.run_soon  # off the training thread (False: run it yourself)
        # tests: max_stride=1 samples every step
        self._planner = StridePlanner(config.overhead_budget, MAX_STRIDE if max_stride is None else max_stride)
        self._signals = SignalEndings(flush=self.flush, finish=lambda name: self.stop(ending=name),
                                      active=lambda: self.running)
        self._step_ends = StepEnds(clock=clock, planner=self._planner, reader=self._reader, log=self._log,
                                   board=self._board, components=self._components, signals=self._signals,
                                   identity_known=identity is not None)
        self.step_clock = self._step_ends.step_clock  # it calls the step ends back on the sampled steps
        self.optimizers = self.step_clock.optimizers  # the job's, weakly: for naming
        self._attached_clock = clock()
        self._log_filter = RankLogFilter(lambda: self._board.base.identity if self._board.base is not None else None)
        self._attached = False  # start ran to its end (its start line said so)
        # Objects the user told us about (for naming); weak so we never keep a model alive.
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()
        for obj in (model, optimizer):
            if obj is not None:
                self.register(obj)

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> Agent:
        """Install hooks, start the sampler and the components; in that order (stop reverses it)."""
        if self._step_ends.running:
            return self
        identity = self._identity or current_identity()
        settled = settle_output_dir(self.output_dir)  # said in the start line, not learnt at the OOM
        self.output_dir = settled.path
        self._sampler.attached()
        now = self._wall()
        self._board.base = AgentState(identity=identity, attached_at=now, updated_at=now)
        log.addFilter(self._log_filter)  # "gpumemd[rank 1/2]: ..." in multi-process jobs
        self.step_clock.install_hook()
        self._step_ends.running = True
        try:
            self._components.start(self)
        except BaseException:  # those started were stopped: undo this method's hooks too
            self.step_clock.remove_hook()
            log.removeFilter(self._log_filter)
            self._step_ends.running = False
            raise
        self.step_clock.eve_callbacks = self._components.eve_callbacks()
        # The sampler's thread first, then the first reading: a new thread's stack and malloc arena take
        # ~70 MiB of address space, which a reading before them would count as headroom under RLIMIT_AS.
        self._sampler.start(self.tick, self.config.sample_interval_s)
        self.tick()
        atexit.register(self._stop_at_exit)
        self._signals.install()
        log.debug("gpumemd: attached (rank %d, output %s)", identity.rank, self.output_dir)
        state = self.state()
        facts = start_facts(state, self._probes, nvml_on="nvml" in self._probes, output_dir=settled.words(),
                            metrics_url=self.exporter_url, sampler_absent=self._sampler.absent_reason)
        say(start_line(facts), rank=state.identity.rank, quiet=self.config.quiet)
        warn_output(settled, rank=state.identity.rank, quiet=self.config.quiet)
        self._attached = True  # an agent whose start failed before this line says nothing at exit
        return self

    def stop(self, ending: str = "exit") -> None:
        """Remove every hook, thread and handler ``start`` installed. Idempotent.

        ``ending`` is how the job ended (``records.step.ending_words``): "exit" (detach), what ``atexit``
        learns (``signal_endings.ending_at_exit``), or the signal that ends it ("SIGTERM"). It is
        published first, so the last scrape, push, textfile and state file carry it: a reader tells
        this end from a vanished job."""
        if not self.running:
            return
        self._log.complete_quick(self._components.on_quick)  # the last steps' records, to the leak detector too
        self._step_ends.running = False
        self._signals.uninstall()
        self._sampler.stop()
        if self.published.ended is None:  # a fatal OOM recorded its own end ("oom") already
            self.publish(ended=ending, ended_at=self._wall())
        recent = self._step_ends.recent(self._clock())
        summary = exit_line(self.state(), self.output_dir, recent=recent) if self._attached else None
        self._attached = False
        self._components.stop()
        self.step_clock.remove_hook()
        log.removeFilter(self._log_filter)
        for probe in self._closed_at_stop:
            if probe is not None:
                probe.close()
        atexit.unregister(self._stop_at_exit)
        if summary is not None:
            say_exit(summary, self.state(), quiet=self.config.quiet)

    def _stop_at_exit(self) -> None:
        self.stop(ending_at_exit())  # an uncaught exception, Ctrl-C, or a normal exit

    def flush(self) -> None:
        """Write what the agent knows now (textfile, push, state file), without stopping: a signal the
        job handles itself may end the process next, or may not."""
        self._components.flush()

    @property
    def running(self) -> bool:
        """Started and not stopped, in the process that started it (``StepEnds.active``)."""
        return self._step_ends.active()

    def register(self, obj: Any) -> None:
        """Tell the agent about a model (nn.Module) or optimizer so tensors get their names."""
        if hasattr(obj, "named_parameters"):
            self.models.add(obj)
        elif hasattr(obj, "param_groups"):
            self.optimizers.add(obj)
        else:
            raise TypeError(
                f"gpumemd: register() takes an nn.Module or a torch.optim.Optimizer, got {type(obj).__name__}"
            )

    # --- steps: the step clock's, for the job and the components ---------------------------------

    def mark_step(self, step: int | None = None) -> StepRecord | None:
        """End a step by hand (``gpumemd.mark_step``); the record when the step end was sampled in full."""
        return self.step_clock.mark_step(step)

    def use_manual_steps(self) -> None:
        self.step_clock.use_manual_steps()

    def sample_within(self, steps: int = 1) -> None:
        self.step_clock.sample_within(steps)

    def sample_sparsely(self, on: bool) -> None:
        self._planner.sparse = on

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self.step_clock.phase(name)

    @property
    def current_step(self) -> int | None:
        return self.step_clock.current_step

    @property
    def current_phase(self) -> str:
        return self.step_clock.current_phase

    # --- the stride and the agent's own time ---------------------------------------------------

    @property
    def seconds_per_step(self) -> float | None:
        """The job's typical step time: the median over recent sampled steps (None before two)."""
        return self._planner.seconds_per_step

    @property
    def stride(self) -> int:
        """Steps per sample now: 1 when every step is sampled."""
        return self._planner.stride

    def add_census_seconds(self, seconds: float) -> None:
        """Components that run censuses report their time here (it is also training-thread time)."""
        self._step_ends.census_seconds += seconds

    # --- the sampler thread and the state ------------------------------------------------------

    def tick(self) -> None:
        """One background sample of allocator, NVML and host. The sampler thread calls it; tests too."""
        if not self.running:
            return
        allocator, nvml, host = self._sampler.read(self.published.identity.local_rank)
        workers = self._sampler.read_workers()
        state = self.published  # read again: a component may have published meanwhile
        self.publish(allocator=allocator or state.allocator, nvml=nvml, host=host or state.host,
                     workers=workers or state.workers)

    def publish(self, **changes: Any) -> AgentState:
        """Swap in a new immutable state with ``changes`` applied (plus fresh overhead/probe health).

        Components and the sampler call this; the per-step path does not (see ``state``)."""
        self._board.publish(changes)
        return self.state()

    def state(self) -> AgentState:
        """The latest immutable state (``gpumemd.state_board``): the newest step is built in on first read."""
        return self._board.state()

    def overhead(self) -> Overhead:
        """The agent's own cost so far (cheap: no state is built)."""
        return Overhead(
            training_thread_seconds_total=self._step_ends.thread_seconds,
            census_seconds_total=self._step_ends.census_seconds,
            sampler_seconds_total=self._sampler.seconds,
            wall_seconds=self._clock() - self._attached_clock,
            steps=self.step_clock.steps_total,
            samples=self._step_ends.samples,
        )

    @property
    def published(self) -> AgentState:
        """The last published state, without building one for the newest step: for per-step readers
        of what components publish (census, findings), which must not pay for ``state()``."""
        base = self._board.base
        if base is None:
            raise RuntimeError("gpumemd: the agent has not been started; use gpumemd.attach()")
        return base

    @property
    def steps_total(self) -> int:
        """Steps ended since attach, sampled or not (cheap: no state is built)."""
        return self.step_clock.steps_total

    @property
    def samples_total(self) -> int:
        """Steps sampled (records made) since attach."""
        return self._step_ends.samples

    def add_thread_seconds(self, seconds: float) -> None:
        """Training-thread time the agent spent outside step ends (gc callbacks): it counts too."""
        self._step_ends.thread_seconds += seconds

    def steps(self) -> list[StepRecord]:
        """The recorded step records, oldest first (at most ``keep_steps``), quick step ends' included."""
        return self._log.steps()

    def history(self) -> list[StepRecord]:
        """Step records since attach, thinned evenly to a bounded count (``gpumemd.step_history``)."""
        return self._log.history()

    def read_now(self) -> StepRecord | None:
        """The probes read now, as a record of the step that is running (one past the last that
        ended): kept nowhere, seen by no component. An OOM report ends its timeline with it, so the
        failing step is there even when the stride skipped the last step ends before it."""
        if not self.running:
            return None
        clock = self.step_clock
        current = clock.current_step
        return self._reader.now(0 if current is None else current + 1,
                                max(1, clock.steps_total + 1 - clock.sampled_total), clock.current_phase)

    def findings(self) -> list[Finding]:
        """Leak findings so far (empty when the leak detector is off or found nothing)."""
        return list(self.state().findings)

    def reports(self) -> list[str]:
        """OOM report directories written so far."""
        return list(self.state().reports)

    def census(self) -> Census:
        """Run a tensor census now and return it (it is also kept in the state): the census
        component's when one runs, so it joins the censuses the leak detector and OOM reports compare."""
        for component in self._components.items:
            if isinstance(component, TakesCensus):
                return component.take_outside_step()
        raise RuntimeError("gpumemd: this agent has no census component (gpumemd.attach() always builds one; "
                           "an Agent built by hand needs a CensusComponent among its components)")

    @property
    def exporter_url(self) -> str | None:
        """URL of this agent's ``/metrics`` endpoint, or None when the exporter is off."""
        return next((c.url for c in self._components.items if isinstance(c, Serving) and c.url), None)

    def component(self, kind: type[ComponentT]) -> ComponentT | None:
        """The running component of type ``kind`` (``agent.component(OomComponent)``), or None."""
        return self._components.find(kind)

