"""The public lifecycle: one agent per process, started by ``attach()`` and removed by ``detach()``."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpumemd.config import Config

if TYPE_CHECKING:
    from gpumemd.agent import Agent
    from gpumemd.records.step import StepRecord

_lock = threading.Lock()
_agent: Agent | None = None


def attach(*, model: Any = None, optimizer: Any = None, **overrides: Any) -> Agent:
    """Start the agent (or return the running one) with ``GPUMEMD_*`` env vars and ``overrides``.

    Bad configuration raises ``ValueError`` here, naming the variable, the value and what is
    accepted. A second call returns the running agent; its ``model``/``optimizer`` are registered.
    """
    global _agent
    config = Config.from_sources(os.environ, **overrides)  # validate even when already attached
    with _lock:
        agent = current()
        if agent is None:
            from gpumemd.agent import Agent

            agent = Agent(config, model=model, optimizer=optimizer)
            agent.start()
            _agent = agent
            return agent
    for obj in (model, optimizer):
        if obj is not None:
            agent.register(obj)
    _say_kept_settings(agent, config, overrides)
    return agent


def _say_kept_settings(agent: Agent, asked: Config, overrides: dict[str, Any]) -> None:
    """A second attach() keeps the running agent as it is: say so when it asked for something else
    (``gpumemd run`` attached first and the script's own ``attach(port=9400)`` would be lost silently)."""
    differ = sorted(k for k in overrides if getattr(asked, k, None) != getattr(agent.config, k, None))
    if not differ:
        return
    import logging

    wanted = ", ".join(f"{k}={getattr(asked, k)!r}" for k in differ)
    running = ", ".join(f"{k}={getattr(agent.config, k)!r}" for k in differ)
    logging.getLogger("gpumemd").warning(
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
    if agent is None or not agent.running:
        return None
    return agent


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
