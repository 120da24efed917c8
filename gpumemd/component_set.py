"""The agent's components as one set: started in order, stopped in reverse, flushed, looked up by type;
a component that fails to stop or flush is logged and the others go on."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from gpumemd.components.base import ComponentBase, Flushes
from gpumemd.log_once import log_once

if TYPE_CHECKING:
    from gpumemd.components.base import Component
    from gpumemd.records.step import StepRecord

log = logging.getLogger("gpumemd")

T = TypeVar("T")


class ComponentSet:
    """``items`` is the list the sampled step end walks (a plain list: no call per component)."""

    def __init__(self, components: Sequence[Component]) -> None:
        self.items: list[Component] = list(components)
        # The ones that take every record, a quick step end's too, later (``on_quick``): the rest see full ones.
        self.quick_takers: list[Any] = [c for c in self.items if callable(getattr(c, "on_quick", None))]

    def on_step(self, record: StepRecord) -> None:
        """A full sampled step end: each component's ``on_step``, in order; one that fails is logged once."""
        for component in self.items:
            try:
                component.on_step(record)
            except Exception as exc:  # noqa: BLE001 - the job comes first
                _failed(component, "on_step", record.step, exc)

    def on_quick(self, record: StepRecord, samples_total: int) -> None:
        """A quick step end's record, at the next full one: to the components that take every record."""
        for component in self.quick_takers:
            try:
                component.on_quick(record, samples_total)
            except Exception as exc:  # noqa: BLE001 - the job comes first
                _failed(component, "on_quick", record.step, exc)

    def eve_callbacks(self) -> list[Callable[[], None]]:
        """The ``on_eve`` of the components that do something on an eve (``ComponentBase``'s is a no-op,
        and a call per component every 10 steps adds up)."""
        return [c.on_eve for c in self.items if getattr(type(c), "on_eve", None) is not ComponentBase.on_eve]

    def start(self, agent: Any) -> None:
        """Start each in order; if one fails, stop those started (in reverse) and raise its error."""
        started: list[Component] = []
        try:
            for component in self.items:
                component.start(agent)
                started.append(component)
        except BaseException:
            for component in reversed(started):
                _stop(component)
            raise

    def stop(self) -> None:
        for component in reversed(self.items):
            _stop(component)

    def flush(self) -> None:
        """Write what each knows now (textfile, push, state file), without stopping."""
        for component in self.items:
            if isinstance(component, Flushes):
                try:
                    component.flush()
                except Exception:
                    log.debug("gpumemd: %s failed to flush", getattr(component, "name", component), exc_info=True)

    def find(self, kind: type[T]) -> T | None:
        """The first component that is a ``kind`` (a class, or a runtime-checkable protocol)."""
        return next((component for component in self.items if isinstance(component, kind)), None)


def _stop(component: Component) -> None:
    try:
        component.stop()
    except Exception:
        log.exception("gpumemd: component %s failed to stop", getattr(component, "name", component))


def _failed(component: Any, hook: str, step: int, exc: Exception) -> None:
    name = getattr(component, "name", component)
    log_once(f"{hook}:{name}:{type(exc).__name__}", "gpumemd: %s failed on step %d (%s: %s); the job continues",
             name, step, type(exc).__name__, exc)
