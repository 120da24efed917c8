"""What every framework callback does, framework-free: attach, register, end steps, mark eval.

The callbacks translate their framework's events into these calls. Every call is guarded: a
failure inside gpumemd is logged once and the training loop goes on (the job comes first).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import gpumemd
from gpumemd.config import Config

if TYPE_CHECKING:
    from gpumemd.agent import Agent

log = logging.getLogger("gpumemd")
_F = TypeVar("_F", bound=Callable[..., Any])

INSTALL_HINT = "pip install 'gpumemd[frameworks]'"


def missing_framework(framework: str, package: str, cause: ImportError) -> ImportError:
    """The ImportError a callback module raises when its framework is not installed."""
    err = ImportError(
        f"gpumemd's {framework} integration needs the `{package}` package, which is not importable "
        f"({cause}); install it with `pip install {package}` or `{INSTALL_HINT}`"
    )
    err.name = package
    return err


def guarded(method: _F) -> _F:
    """Run a callback hook; a gpumemd failure is logged once per kind and never reaches the job."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a hook must not break the user's training loop
            key = f"{type(self).__name__}.{method.__name__}:{type(exc).__name__}"
            if key not in _failed:
                if len(_failed) < 256:
                    _failed.add(key)
                log.warning("gpumemd: %s failed (%s: %s); the job continues", key.split(":", maxsplit=1)[0],
                            type(exc).__name__, exc)
            return None

    return wrapper  # type: ignore[return-value]


_failed: set[str] = set()


def rank_of(source: Any, rank: str, local_rank: str) -> tuple[int, int, int] | None:
    """(rank, local rank, world size) from the framework's trainer or arguments, whose attributes
    ``rank`` and ``local_rank`` name the first two; None when it lacks them."""
    try:
        return int(getattr(source, rank)), int(getattr(source, local_rank)), int(source.world_size)
    except (AttributeError, TypeError, ValueError):
        return None


class FrameworkSession:
    """One framework run as the agent sees it. ``options`` are ``attach()`` keyword arguments,
    validated now so a bad one fails when the callback is built, not mid-training."""

    def __init__(self, framework: str, options: dict[str, Any]) -> None:
        Config.from_sources(os.environ, **options)  # raises ValueError naming the bad option
        self.framework = framework
        self.options = dict(options)
        self.agent: Agent | None = None
        self.owned = False  # True when this session attached the agent (then it also detaches it)
        self._last_global_step: int | None = None
        self._phase: AbstractContextManager[None] | None = None

    def start(self, model: Any = None, optimizers: Iterable[Any] = (),
              rank: tuple[int, int, int] | None = None, global_step: int = 0) -> Agent:
        """Attach (or join the running agent), register objects, take over step ends, set the rank.

        ``global_step`` is the framework's optimizer-step counter now (non-zero when resuming).
        """
        agent = gpumemd.current()
        if agent is None:
            agent = gpumemd.attach(**self.options)
            self.owned = True
        self.agent = agent
        self.register(model, optimizers)
        # The framework knows where an optimizer update ends (accumulation, skipped AMP steps):
        # from now on only mark_step ends steps, so the global optimizer hook never double-counts.
        agent.use_manual_steps()
        self._last_global_step = global_step
        if rank is not None:
            self.set_rank(*rank)
        return agent

    def register(self, model: Any = None, optimizers: Iterable[Any] = ()) -> None:
        agent = self.agent
        if agent is None:
            return
        for obj in (model, *optimizers):
            if obj is not None and (hasattr(obj, "named_parameters") or hasattr(obj, "param_groups")):
                agent.register(obj)

    def set_rank(self, rank: int, local_rank: int, world_size: int) -> None:
        """Publish the framework's view of the rank when it differs from what the agent found."""
        import dataclasses

        agent = self.agent
        if agent is None:
            return
        current = agent.state().identity
        if (current.rank, current.local_rank, current.world_size) != (rank, local_rank, world_size):
            agent.publish(identity=dataclasses.replace(
                current, rank=rank, local_rank=local_rank, world_size=world_size, source=self.framework
            ))

    def step(self, global_step: int) -> None:
        """End a step when the framework's optimizer-step counter moved (once per update, not per
        micro-batch); the record carries the framework's own step number (0-based)."""
        agent = self.agent
        if agent is None or not agent.running or global_step == self._last_global_step:
            return
        self._last_global_step = global_step
        agent.mark_step(max(global_step - 1, 0))

    def enter_phase(self, name: str) -> None:
        agent = self.agent
        if agent is None or not agent.running or self._phase is not None:
            return
        self._phase = agent.phase(name)
        self._phase.__enter__()

    def exit_phase(self) -> None:
        phase, self._phase = self._phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def stop(self) -> None:
        """Leave any phase; detach only an agent this session attached. ``agent`` stays set: the
        finished run's findings, steps and report paths remain readable after fit (its hooks and
        threads are gone); the next ``start`` attaches afresh."""
        self.exit_phase()
        if self.owned and gpumemd.current() is self.agent:
            gpumemd.detach()
        self.owned = False
        self._last_global_step = None
