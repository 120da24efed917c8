"""The agent: the only place with hooks, threads and global state.

One training step, as the agent sees it: ``optimizer.step()`` returns -> the global optimizer
post-step hook -> allocator stats (a cheap C++ call) and host RSS -> a ``StepRecord`` appended to
a bounded ring buffer -> each component's ``on_step`` (census, leak detector, ...) -> a new
immutable ``AgentState`` swapped in. Outputs (exporter, reports) only ever read that state.

What one "step" is:
- By default, one ``step()`` of the *primary* optimizer: the first optimizer seen stepping after
  attach. With several optimizers (GAN generator/discriminator, per-module optimizers) the others
  are registered for naming but do not end steps, so step N means the same thing all run long.
- Gradient accumulation: the hook fires per optimizer step, not per micro-batch, so a step is one
  optimizer update, which is the point where activations are gone and the baseline is clean.
- AMP ``GradScaler.step`` that skips an update on inf/nan never calls ``optimizer.step()``: no step
  is recorded, and the next record's duration spans both iterations.
- ``gpumemd.mark_step()`` is the manual way: once it is called, the optimizer hook stops ending
  steps, so there is never a double count.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from gpumemd.config import Config
from gpumemd.probes.identity import RankLogFilter, current_identity, refreshed_identity
from gpumemd.records.samples import HostSample
from gpumemd.records.step import AgentState, Identity, Overhead, StepRecord

if TYPE_CHECKING:
    from gpumemd.probes.allocator import AllocatorProbe
    from gpumemd.probes.host import HostProbe
    from gpumemd.probes.nvml import NvmlProbe
    from gpumemd.records.census import Census
    from gpumemd.records.findings import Finding

log = logging.getLogger("gpumemd")


class Component(Protocol):
    """A capability plugged into the agent (census, leak detection, OOM capture, exporter, ...).

    ``on_step`` runs on the training thread at every step end and must be cheap or self-spacing.
    Components publish results with ``agent.publish(field=value)``; they never mutate state.
    """

    name: str

    def start(self, agent: Agent) -> None: ...

    def on_step(self, record: StepRecord) -> None: ...

    def stop(self) -> None: ...


class Agent:
    """Samples memory every step into a bounded history and publishes an immutable state."""

    def __init__(
        self,
        config: Config,
        *,
        model: Any = None,
        optimizer: Any = None,
        allocator_probe: AllocatorProbe | None = None,
        host_probe: HostProbe | None = None,
        nvml_probe: NvmlProbe | None = None,
        identity: Identity | None = None,
        components: list[Component] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.output_dir = os.path.abspath(config.output_dir)
        self._clock = clock
        self._wall = wall_clock
        self._pid = os.getpid()
        self._allocator = allocator_probe
        self._host = host_probe
        self._nvml = nvml_probe
        self._identity = identity
        self._components: list[Component] = list(components) if components is not None else []
        self._default_components = components is None
        self._ring: collections.deque[StepRecord] = collections.deque(maxlen=config.history_steps)
        self._publish_lock = threading.Lock()  # writers only (training + sampler thread); readers never lock
        self._state: AgentState | None = None
        self._hook_handle: Any = None
        self._primary_optimizer: weakref.ref[Any] | None = None
        self._manual_steps = False
        self._last_step: int | None = None
        self._last_step_clock: float | None = None
        self._attached_clock = clock()
        self._thread_seconds = 0.0
        self._census_seconds = 0.0
        self._sampler_seconds = 0.0
        self._phase = "train"
        self._steps_total = 0
        self._pending: tuple[StepRecord, int] | None = None  # the newest step, not yet in a built state
        self._view: tuple[AgentState, tuple[StepRecord, int] | None, AgentState] | None = None
        self._health_key: tuple[Any, ...] = ()
        self._health: tuple[dict[str, int], dict[str, bool]] = ({}, {})
        # Jobs often attach before init_process_group: re-read the rank on the first steps (issue 8).
        self._identity_checks_left = 0 if identity is not None else _IDENTITY_REFRESH_STEPS
        self._log_filter = RankLogFilter(lambda: self._state.identity if self._state is not None else None)
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._running = False
        # Objects the user told us about (for naming); weak so we never keep a model alive.
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        if model is not None:
            self.register(model)
        if optimizer is not None:
            self.register(optimizer)

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> Agent:
        """Install hooks, start the sampler and the components; in that order (stop reverses it)."""
        if self._running:
            return self
        from gpumemd.probes.allocator import AllocatorProbe
        from gpumemd.probes.host import HostProbe
        from gpumemd.probes.nvml import NvmlProbe

        self._allocator = self._allocator or AllocatorProbe()
        self._host = self._host or HostProbe()
        if self._nvml is None and self.config.nvml:
            self._nvml = NvmlProbe()
        identity = self._identity or current_identity()
        now = self._wall()
        self._state = AgentState(identity=identity, attached_at=now, updated_at=now)
        log.addFilter(self._log_filter)  # "gpumemd[rank 1/2]: ..." in multi-process jobs
        self._install_step_hook()
        self._running = True
        if self._default_components:
            self._components = default_components(self.config)
        started: list[Component] = []
        try:
            for component in self._components:
                component.start(self)
                started.append(component)
        except BaseException:
            for component in reversed(started):
                self._stop_component(component)
            self._remove_step_hook()
            log.removeFilter(self._log_filter)
            self._running = False
            raise
        self._components = started
        self.tick()
        if self.config.sample_interval_s > 0:
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sampler_loop, name="gpumemd-sampler", daemon=True)
            self._sampler.start()
        atexit.register(self.stop)
        log.debug("gpumemd: attached (rank %d, output %s)", identity.rank, self.output_dir)
        return self

    def stop(self) -> None:
        """Remove every hook, thread and handler ``start`` installed. Idempotent."""
        if not self._running or not self._in_owner_process():
            return
        self._running = False
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=10)
            self._sampler = None
        for component in reversed(self._components):
            self._stop_component(component)
        self._remove_step_hook()
        log.removeFilter(self._log_filter)
        if self._nvml is not None:
            self._nvml.close()
        if self._host is not None:
            self._host.close()
        atexit.unregister(self.stop)

    @property
    def running(self) -> bool:
        return self._running and self._in_owner_process()

    def _in_owner_process(self) -> bool:
        # A DataLoader worker forked after attach inherits this object but is not the job's
        # training process: it must record nothing (and it has no sampler thread: fork drops threads).
        return os.getpid() == self._pid

    def _stop_component(self, component: Component) -> None:
        try:
            component.stop()
        except Exception:
            log.exception("gpumemd: component %s failed to stop", getattr(component, "name", component))

    # --- step detection --------------------------------------------------------------------

    def _install_step_hook(self) -> None:
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # torch < 2.0: mark_step() is the only way
            log.info("gpumemd: this torch has no global optimizer hooks; call gpumemd.mark_step() each step")
            return
        agent_ref = weakref.ref(self)

        def _post_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            agent = agent_ref()
            if agent is not None:
                agent._on_optimizer_step(optimizer)

        self._hook_handle = register_optimizer_step_post_hook(_post_step)

    def _remove_step_hook(self) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

    def _on_optimizer_step(self, optimizer: Any) -> None:
        if not self.running:
            return
        if optimizer not in self.optimizers:
            self.optimizers.add(optimizer)
        if self._manual_steps:
            return
        primary = self._primary_optimizer() if self._primary_optimizer is not None else None
        if primary is None:
            self._primary_optimizer = weakref.ref(optimizer)
            primary = optimizer
        if optimizer is primary:
            self._end_step(None)

    def mark_step(self, step: int | None = None) -> StepRecord | None:
        """End a step by hand; from then on the optimizer hook no longer ends steps."""
        if not self.running:
            return None
        self._manual_steps = True
        return self._end_step(step)

    def use_manual_steps(self) -> None:
        """A framework callback will end steps with ``mark_step``: the optimizer hook stops ending them
        now, before the first one, so the first step is not counted twice."""
        self._manual_steps = True

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

    # --- the per-step path (training thread) -------------------------------------------------

    def _end_step(self, step: int | None) -> StepRecord | None:
        start = self._clock()
        number = step if step is not None else (0 if self._last_step is None else self._last_step + 1)
        duration = None if self._last_step_clock is None else start - self._last_step_clock
        assert self._allocator is not None and self._host is not None and self._state is not None
        allocator = self._allocator.read()
        if self.config.reset_peak_each_step and allocator:
            _reset_peaks(allocator)
        rss = self._host.rss()
        previous = self._state
        host = None
        if rss is not None:
            base = previous.host  # the sampler's fuller reading: keep its available/total/pinned figures
            host = (
                HostSample(rss, base.available_bytes, base.total_bytes, base.pinned_bytes)
                if base is not None
                else HostSample(rss_bytes=rss)
            )
        record = StepRecord(
            step=number,
            wall_time=self._wall(),
            duration_s=duration,
            allocator=allocator,
            host=host,
            nvml=previous.nvml,
            phase=self._phase,
        )
        self._ring.append(record)
        self._last_step = number
        self._steps_total += 1
        # One reference assignment makes the step visible to state() readers (components below,
        # scrapes on other threads); the state object itself is built only when someone reads it.
        self._pending = (record, self._steps_total)
        if self._identity_checks_left:
            self._refresh_identity()
        for component in self._components:
            try:
                component.on_step(record)
            except Exception as exc:  # noqa: BLE001 - the job comes first
                _log_once(f"on_step:{getattr(component, 'name', '?')}:{type(exc).__name__}",
                          "gpumemd: %s failed on step %d (%s: %s); the job continues",
                          getattr(component, "name", component), number, type(exc).__name__, exc)
        end = self._clock()
        self._thread_seconds += end - start
        self._last_step_clock = end
        return record

    def _refresh_identity(self) -> None:
        self._identity_checks_left -= 1
        assert self._state is not None
        identity = refreshed_identity(self._state.identity)
        if identity is not None:
            self._identity_checks_left = 0
            self.publish(identity=identity)
            log.debug("gpumemd: rank %d of %d from torch.distributed", identity.rank, identity.world_size)

    def add_census_seconds(self, seconds: float) -> None:
        """Components that run censuses report their time here (it is also training-thread time)."""
        self._census_seconds += seconds

    # --- the sampler thread ------------------------------------------------------------------

    def _sampler_loop(self) -> None:
        while not self._stop.wait(self.config.sample_interval_s):
            self.tick()

    def tick(self) -> None:
        """One background sample of allocator, NVML and host. The sampler thread calls it; tests too."""
        if not self.running or self._allocator is None or self._host is None:
            return
        start = self._clock()
        allocator = self._allocator.read()
        nvml = self._nvml.read() if self._nvml is not None else ()
        host = self._host.read()
        self._sampler_seconds += self._clock() - start
        state = self._state
        assert state is not None
        self.publish(
            allocator=allocator or state.allocator,
            nvml=nvml,
            host=host or state.host,
        )

    # --- state ---------------------------------------------------------------------------------

    def publish(self, **changes: Any) -> AgentState:
        """Swap in a new immutable state with ``changes`` applied (plus fresh overhead/probe health).

        Components and the sampler call this; the per-step path does not (see ``state``)."""
        with self._publish_lock:
            current = self._state
            assert current is not None, "agent not started"
            errors, available = self._probe_health()
            self._state = dataclasses.replace(  # one reference assignment: readers see old or new
                current,
                updated_at=self._wall(),
                overhead=self.overhead(),
                probe_errors=errors,
                probes_available=available,
                phase=self._phase,
                **changes,
            )
        return self.state()

    def overhead(self) -> Overhead:
        """The agent's own cost so far (cheap: no state is built)."""
        return Overhead(
            training_thread_seconds_total=self._thread_seconds,
            census_seconds_total=self._census_seconds,
            sampler_seconds_total=self._sampler_seconds,
            wall_seconds=self._clock() - self._attached_clock,
            steps=self._steps_total,
        )

    @property
    def published(self) -> AgentState:
        """The last published state, without building one for the newest step: for per-step readers
        of what components publish (census, findings), which must not pay for ``state()``."""
        base = self._state
        if base is None:
            raise RuntimeError("gpumemd: the agent has not been started; use gpumemd.attach()")
        return base

    @property
    def steps_total(self) -> int:
        """Steps recorded since attach (cheap: no state is built)."""
        return self._steps_total

    def _probes(self) -> dict[str, Any]:
        return {"allocator": self._allocator, "host": self._host, "nvml": self._nvml}

    def _probe_health(self) -> tuple[dict[str, int], dict[str, bool]]:
        """Errors and availability per probe; the same dicts are reused while nothing changes, so
        the per-step publish allocates nothing for them."""
        probes = [(name, p.health) for name, p in self._probes().items() if p is not None]
        key = tuple((name, h.errors, h.available) for name, h in probes)
        if key != self._health_key:
            self._health_key = key
            self._health = ({n: h.errors for n, h in probes}, {n: bool(h.available) for n, h in probes})
        return self._health

    def state(self) -> AgentState:
        """The latest immutable state.

        The step path only records the newest step (one reference assignment); the state that
        includes it is built here, on first read, and cached until the next step or publish. So a
        step costs no state construction, and a reader never takes a lock the training thread holds.
        """
        base, pending = self._state, self._pending
        if base is None:
            raise RuntimeError("gpumemd: the agent has not been started; use gpumemd.attach()")
        view = self._view
        if view is not None and view[0] is base and view[1] is pending:
            return view[2]
        state = base if pending is None else self._with_step(base, *pending)
        self._view = (base, pending, state)
        return state

    def _with_step(self, base: AgentState, record: StepRecord, steps_total: int) -> AgentState:
        sampler_newer = base.updated_at > record.wall_time  # the sampler read after this step ended
        allocator = base.allocator if sampler_newer and base.allocator else (record.allocator or base.allocator)
        host = base.host if sampler_newer and base.host else (record.host or base.host)
        return dataclasses.replace(
            base,
            updated_at=max(base.updated_at, record.wall_time),
            step=record.step,
            steps_total=steps_total,
            last_step=record,
            allocator=allocator,
            host=host,
            overhead=self.overhead(),
            phase=self._phase,
        )

    def steps(self) -> list[StepRecord]:
        """The recorded step records, oldest first (at most ``history_steps``)."""
        return list(self._ring)

    def findings(self) -> list[Finding]:
        """Leak findings so far (empty when the leak detector is off or found nothing)."""
        return list(self.state().findings)

    def reports(self) -> list[str]:
        """OOM report directories written so far."""
        return list(self.state().reports)

    def census(self) -> Census:
        """Run a tensor census now and return it (it is also kept in the state)."""
        from gpumemd.probes.census import take_census

        start = self._clock()
        result = take_census(self)
        self.add_census_seconds(self._clock() - start)
        self.publish(census=result, censuses_total=self.state().censuses_total + 1)
        return result

    @property
    def exporter_url(self) -> str | None:
        """URL of this agent's ``/metrics`` endpoint, or None when the exporter is off."""
        for component in self._components:
            url = getattr(component, "url", None)
            if url:
                return str(url)
        return None

    def component(self, name: str) -> Component | None:
        for component in self._components:
            if component.name == name:
                return component
        return None

    # --- phases ------------------------------------------------------------------------------

    @property
    def current_phase(self) -> str:
        return self._phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the steps inside the block (``eval``, ``checkpoint``...) for the leak detector."""
        if not name or not isinstance(name, str):
            raise ValueError(f"gpumemd.phase(name) needs a non-empty string, got {name!r}")
        previous = self._phase
        self._phase = name
        try:
            yield
        finally:
            self._phase = previous


_IDENTITY_REFRESH_STEPS = 16  # steps on which a late init_process_group is noticed


def default_components(config: Config) -> list[Component]:
    """The capabilities a normal ``attach()`` turns on, in start order (they stop in reverse)."""
    from gpumemd.components import build_default

    return build_default(config)


def _reset_peaks(samples: tuple[Any, ...]) -> None:
    import torch

    for sample in samples:
        try:
            torch.cuda.reset_peak_memory_stats(sample.device)
        except (RuntimeError, AttributeError) as exc:
            _log_once("reset_peak", "gpumemd: could not reset peak stats (%s)", exc)


_logged: set[str] = set()
_LOGGED_MAX = 1024


def _log_once(key: str, message: str, *args: Any) -> None:
    if key in _logged:
        return
    if len(_logged) < _LOGGED_MAX:  # bounded: a week-long job must not grow this set forever
        _logged.add(key)
    log.warning(message, *args)
