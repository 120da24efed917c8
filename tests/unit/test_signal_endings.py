"""The signal wrappers' decisions, in this process (SIGUSR1/SIGUSR2 only, handled by Python handlers the
tests install, so nothing dies): what is wrapped, what is left alone, chaining, the lazy re-wrap, and
the deadline on a flush that cannot finish. Dying of a signal is the real child processes' test
(tests/integration/test_job_endings.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest

from gpumemd import signal_locks
from gpumemd.signal_endings import SignalEndings
from gpumemd.signal_locks import SIGNAL_WAIT_S, YieldingLock

USR1, USR2 = signal.SIGUSR1, signal.SIGUSR2


class Calls:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.active = True

    def endings(self, deadline_s: float = 5.0) -> SignalEndings:
        return SignalEndings(flush=lambda: self.log.append("flush"), finish=self.log.append,
                             active=lambda: self.active, deadline_s=deadline_s)

    def handler(self, name: str, then: object = None) -> object:
        def handle(signum: int, frame: FrameType | None) -> None:
            self.log.append(name)
            if callable(then):
                then(signum, frame)

        return handle


@pytest.fixture
def calls() -> Iterator[Calls]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, USR1, USR2)}
    # a plain Python job's dispositions (a test runner's worker may ignore SIGINT, for one)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, USR1, USR2):
        signal.signal(signum, signal.SIG_DFL)
    yield Calls()
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_handler_of_the_job_gets_the_flush_first_then_runs_and_is_put_back(calls: Calls) -> None:
    own = calls.handler("job")
    signal.signal(USR1, own)  # type: ignore[arg-type]
    endings = calls.endings()
    endings.install()
    assert signal.getsignal(USR1) is not own
    os.kill(os.getpid(), USR1)
    assert calls.log == ["flush", "job"]  # no "finish": the job's handler decides how it ends
    endings.uninstall()
    assert signal.getsignal(USR1) is own


def test_ignored_c_level_and_keyboard_interrupt_dispositions_are_left_alone(calls: Calls) -> None:
    signal.signal(USR2, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    endings = calls.endings()
    endings.install()
    assert signal.getsignal(USR2) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # KeyboardInterrupt stays the job's
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the default action is wrapped
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert calls.log == []
    endings.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_later_handler_that_chains_to_ours_gets_a_flush_and_no_death(calls: Calls) -> None:
    endings = calls.endings()
    endings.install()  # USR1 at its default: wrapped
    previous = signal.getsignal(USR1)
    # Lightning's way: install its own, and call the one it replaced
    signal.signal(USR1, calls.handler("lightning", then=previous))  # type: ignore[arg-type]
    os.kill(os.getpid(), USR1)
    assert calls.log == ["lightning", "flush"]  # the wrapped SIG_DFL was not "called": no finish, no death
    endings.uninstall()


def test_a_chaining_handler_wrapped_again_is_flushed_once_per_signal(calls: Calls) -> None:
    endings = calls.endings()
    endings.install()
    lightning = calls.handler("lightning", then=signal.getsignal(USR1))
    signal.signal(USR1, lightning)  # type: ignore[arg-type]
    endings.recheck()  # a step end: the newcomer is wrapped too, and still chains to our first wrapper
    os.kill(os.getpid(), USR1)
    assert calls.log == ["flush", "lightning"]
    endings.uninstall()
    assert signal.getsignal(USR1) is lightning


def test_a_later_handler_that_does_not_chain_is_wrapped_at_the_next_recheck(calls: Calls) -> None:
    endings = calls.endings()
    endings.install()
    late = calls.handler("late")
    signal.signal(USR1, late)  # type: ignore[arg-type]
    endings.recheck()
    os.kill(os.getpid(), USR1)
    assert calls.log == ["flush", "late"]
    endings.uninstall()
    assert signal.getsignal(USR1) is late


def test_nothing_is_installed_outside_the_main_thread(calls: Calls) -> None:
    endings = calls.endings()
    thread = threading.Thread(target=endings.install)
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_an_inactive_agent_is_the_wrapped_handler_alone(calls: Calls) -> None:
    signal.signal(USR1, calls.handler("job"))  # type: ignore[arg-type]
    endings = calls.endings()
    endings.install()
    calls.active = False  # a forked DataLoader worker, or an agent already stopped
    os.kill(os.getpid(), USR1)
    assert calls.log == ["job"]
    endings.uninstall()


def test_a_flush_that_cannot_finish_is_waited_for_at_most_the_deadline(calls: Calls) -> None:
    held = threading.Lock()
    held.acquire()  # the main thread holds a lock the flush needs (as the state board's writer could)

    def flush() -> None:
        held.acquire()

    endings = SignalEndings(flush=flush, finish=lambda name: None, active=lambda: True, deadline_s=0.2)
    signal.signal(USR1, calls.handler("job"))  # type: ignore[arg-type]
    endings.install()
    os.kill(os.getpid(), USR1)
    assert calls.log == ["job"]  # the job's own handler still ran, 0.2 s later
    held.release()
    endings.uninstall()
    flush = [t for t in threading.enumerate() if t.name == "gpumemd-signal-flush"]
    for thread in flush:
        thread.join(timeout=5)  # it takes the released lock and ends
    assert not any(t.is_alive() for t in flush)


def test_the_flush_gets_past_the_agents_locks_the_interrupted_thread_holds(calls: Calls) -> None:
    # The signal stops the training thread wherever it is: inside a census slice, a publish, each under
    # its lock. The flush (and the stop a SIGTERM brings) waited for that lock until the 25 s deadline,
    # and the job ended late and without its files (CI: test_a_job_killed_while_leaking_fires_...).
    # The agent's locks let a signal's writer go on without them after SIGNAL_WAIT_S.
    census, board = YieldingLock(), YieldingLock()
    wrote: list[str] = []

    def flush() -> None:
        with census:
            wrote.append("census")
        with board:
            wrote.append("board")

    endings = SignalEndings(flush=flush, finish=lambda name: None, active=lambda: True)  # the 25 s deadline
    signal.signal(USR1, calls.handler("job"))  # type: ignore[arg-type]
    endings.install()
    try:
        with census:  # the interrupted census slice
            started = time.monotonic()
            os.kill(os.getpid(), USR1)
            took = time.monotonic() - started
        assert wrote == ["census", "board"] and calls.log == ["job"]
        assert took < SIGNAL_WAIT_S + 5, took  # one wait, not the deadline
        assert not census.locked() and not board.locked()  # released by their holders, not by the writer
    finally:
        endings.uninstall()


def test_a_yielding_lock_is_a_plain_lock_to_any_other_thread() -> None:
    lock = YieldingLock()
    entered = threading.Event()

    def take() -> None:
        with lock:
            entered.set()

    with lock:
        thread = threading.Thread(target=take)
        thread.start()
        assert not entered.wait(SIGNAL_WAIT_S + 0.5)  # waits on, past the signal writer's limit
    thread.join(timeout=5)
    assert entered.is_set() and not lock.locked()
    with signal_locks.writing():  # a writer gets it at once when it is free
        with lock:
            assert lock.locked()
    assert not lock.locked()


def test_what_another_handler_raises_during_the_flush_comes_after_the_jobs_handler(calls: Calls) -> None:
    # A DataLoader's SIGCHLD handler raises "worker killed by signal" when the same SIGTERM reached its
    # workers: raised into our wait, it must neither cut the flush short nor overtake the job's handler.
    released = threading.Event()

    def other(signum: int, frame: FrameType | None) -> None:
        raise RuntimeError("worker killed")

    def flush() -> None:
        os.kill(os.getpid(), USR2)  # handled on the main thread, in the middle of our wait
        released.wait(0.3)
        calls.log.append("flush")

    endings = SignalEndings(flush=flush, finish=lambda name: None, active=lambda: True)
    signal.signal(USR2, other)
    signal.signal(USR1, calls.handler("job"))  # type: ignore[arg-type]
    endings.install()
    with pytest.raises(RuntimeError, match="worker killed"):
        os.kill(os.getpid(), USR1)
    assert calls.log == ["flush", "job"]
    endings.uninstall()
