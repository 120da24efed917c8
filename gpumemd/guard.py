"""``gpumemd.oom_guard``: for code that catches out-of-memory errors and carries on.

    with gpumemd.oom_guard():            # writes the report, then the OOM propagates as always
        loss = model(batch).sum()

    @gpumemd.oom_guard(suppress=True)    # writes the report and swallows the OOM (skip the batch)
    def train_step(batch): ...

Only out-of-memory errors are touched (``torch.OutOfMemoryError``, CPU allocation failures); every
other exception passes through unchanged. An OOM that is re-raised keeps its traceback; the locals of
the frames that failed are cleared after the report, so their tensors are freed before your
``except`` block retries with a smaller batch.

``gpumemd.oom_report(exc)`` writes a report on request (for an OOM you caught yourself, or with no
exception, from the last observer capture); it is subject to ``oom_max_reports`` but not the cooldown.

Without an attached agent the guard writes nothing (there is no output directory or history to
report from): it re-raises, or suppresses when asked, exactly as it would with an agent.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable
from types import CodeType, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from gpumemd.log_once import log_once

if TYPE_CHECKING:
    from gpumemd.components.oom_component import OomComponent

_F = TypeVar("_F", bound=Callable[..., Any])


class oom_guard(contextlib.ContextDecorator):  # lower case: used like contextlib's
    """Context manager and decorator; ``last_report`` is the directory written on the last exit."""

    def __init__(self, suppress: bool = False) -> None:
        if not isinstance(suppress, bool):
            raise TypeError(f"gpumemd.oom_guard(suppress=...) takes a bool, got {suppress!r}")
        self.suppress = suppress
        self.last_report: str | None = None

    def __enter__(self) -> oom_guard:
        return self

    def __call__(self, func: _F) -> _F:
        """The decorator form: ContextDecorator's, with a wrapper that ``__exit__`` recognises."""

        @functools.wraps(func)
        def _oom_guard_wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return cast(_F, _oom_guard_wrapper)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            return False
        if tb is not None and tb.tb_frame.f_code is _WRAPPER_CODE:
            # The decorator form: drop the wrapper's frame, so the traceback reads as it would with no
            # decorator (the with statement's re-raise adds no frame; Python >= 3.11 re-raises with the
            # exception's own traceback, 3.10 with the one it had, wrapper included).
            tb = tb.tb_next
            exc.with_traceback(tb)
        try:
            return self._on_exception(exc, tb)
        except Exception as err:  # noqa: BLE001 - the job's exception propagates unchanged, always
            message = (f"gpumemd: oom_guard could not handle {type(exc).__name__} ({type(err).__name__}: {err}); "
                       "it propagates unchanged")
            log_once(message, message)
            return False

    def _on_exception(self, exc: BaseException, tb: TracebackType | None) -> bool:
        from gpumemd.analysis.oom_message import classify_exception

        if classify_exception(exc) is None:
            return False
        component = _oom_component()
        if component is not None:
            result = component.handle(exc, source="oom_guard")
            self.last_report = result if isinstance(result, str) else None
        elif self.suppress:
            traceback.clear_frames(tb)
        return self.suppress


_WRAPPER_CODE = next(c for c in oom_guard.__call__.__code__.co_consts
                     if isinstance(c, CodeType) and c.co_name == "_oom_guard_wrapper")


def oom_report(exc: BaseException | None = None) -> str | None:
    """Write an OOM report now; returns its directory, or None (no agent, reports off, cap reached)."""
    component = _oom_component()
    if component is None:
        return None
    try:
        return component.write_report(exc, source="request")
    except Exception as err:  # noqa: BLE001 - a diagnostic must not raise into the job's handler
        message = f"gpumemd: oom_report failed ({type(err).__name__}: {err})"
        log_once(message, message)
        return None


def _oom_component() -> OomComponent | None:
    """The running agent's OOM capture, or None (no agent, or OOM reports off)."""
    from gpumemd.api import current

    agent = current()
    if agent is None:
        return None
    from gpumemd.components.oom_component import OomComponent

    return agent.component(OomComponent)

