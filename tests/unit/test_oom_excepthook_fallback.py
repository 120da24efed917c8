"""A job's ``sys.excepthook`` installed before attach that raises. Python then prints "Error in
sys.excepthook:", the hook's exception (its traceback starting in the hook) and "Original exception
was:" with the job's exception. The agent's hook wraps the job's: what is printed must not show the
wrapper (the subprocess comparison is in tests/integration/test_exception_transparency.py)."""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Iterator
from types import TracebackType
from typing import cast

import pytest

from gpumemd.components.base import AgentView
from gpumemd.components.census_component import CensusComponent, CensusOptions
from gpumemd.components.oom_component import OomComponent, OomOptions
from gpumemd.probes.census.census_steps import census_steps
from gpumemd.probes.snapshots.snapshot import SnapshotProbe


class _CpuProbe(SnapshotProbe):
    def cuda_available(self) -> bool:
        return False

    def cuda_initialized(self) -> bool:
        return False


def _census() -> CensusComponent:
    return CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01), census_fn=census_steps)


class _Agent:
    running = True
    steps_total = 0


def _failing_hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    raise ValueError(f"the job's excepthook failed on {exc_type.__name__}")


def _exiting_hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    raise SystemExit(5)


def _fail(step: int) -> None:
    raise LookupError(f"no shard for step {step}")


def _raised() -> LookupError:
    try:
        _fail(7)
    except LookupError as err:
        caught = err
    return caught


def _python_prints(exc: BaseException) -> str:
    """What python prints for ``exc`` when ``_failing_hook`` alone is sys.excepthook."""
    try:
        _failing_hook(type(exc), exc, exc.__traceback__)
    except ValueError as err:
        hook_error = err
    assert hook_error.__traceback__ is not None
    return ("Error in sys.excepthook:\n"
            + "".join(traceback.format_exception(type(hook_error), hook_error, hook_error.__traceback__.tb_next))
            + "\nOriginal exception was:\n" + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


@pytest.fixture
def component(monkeypatch: pytest.MonkeyPatch) -> Iterator[OomComponent]:
    monkeypatch.setattr(sys, "excepthook", _failing_hook)  # the job's, before attach
    oom = OomComponent(OomOptions(oom_max_reports=5, oom_cooldown_s=0.0, record_history=False,
                                  history_max_entries=0), snapshot_probe=_CpuProbe(),
                       census=_census())
    oom.start(cast(AgentView, _Agent()))
    try:
        assert sys.excepthook is not _failing_hook  # wrapped
        yield oom
    finally:
        oom.stop()


@pytest.mark.usefixtures("component")
def test_the_failing_job_hook_is_shown_as_python_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    exc = _raised()
    expected = _python_prints(exc)
    assert sys.excepthook(type(exc), exc, exc.__traceback__) is None  # as python calls it: no except block
    err = capsys.readouterr().err
    assert err == expected
    assert "sys_hook" not in err and ", in _failing_hook\n" in err


@pytest.mark.usefixtures("component")
def test_called_from_an_except_block_adds_no_context(capsys: pytest.CaptureFixture[str]) -> None:
    exc = _raised()
    try:
        raise exc
    except LookupError:  # gpumemd run hands the uncaught exception over from inside its except block
        sys.excepthook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    expected = _python_prints(exc)
    assert "During handling" not in err and err == expected


def test_a_system_exit_from_the_job_hook_still_ends_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "excepthook", _exiting_hook)
    oom = OomComponent(OomOptions(oom_max_reports=5, oom_cooldown_s=0.0, record_history=False,
                                  history_max_entries=0), snapshot_probe=_CpuProbe(),
                       census=_census())
    oom.start(cast(AgentView, _Agent()))
    try:
        exc = _raised()
        with pytest.raises(SystemExit) as info:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        assert info.value.code == 5
    finally:
        oom.stop()


def _failing_thread_hook(args: threading.ExceptHookArgs) -> None:
    raise ValueError(f"the job's thread excepthook failed on {args.exc_type.__name__}")


def _thread_output(capsys: pytest.CaptureFixture[str]) -> str:
    thread = threading.Thread(target=_fail, args=(3,), name="loader")
    thread.start()
    thread.join()
    return capsys.readouterr().err


def test_a_failing_job_thread_hook_is_shown_as_threading_shows_it(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(threading, "excepthook", _failing_thread_hook)  # the job's, before attach
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    expected = _thread_output(capsys)  # threading alone: "Exception in threading.excepthook:" ...
    assert expected.startswith("Exception in threading.excepthook:\n") and "_failing_thread_hook" in expected
    oom = OomComponent(OomOptions(oom_max_reports=5, oom_cooldown_s=0.0, record_history=False,
                                  history_max_entries=0), snapshot_probe=_CpuProbe(),
                       census=_census())
    oom.start(cast(AgentView, _Agent()))
    try:
        assert threading.excepthook is not _failing_thread_hook  # wrapped
        shown = _thread_output(capsys)
    finally:
        oom.stop()
    assert shown == expected
    assert "thread_hook" not in shown.replace("_failing_thread_hook", "")
