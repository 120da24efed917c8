"""A culprit search runs one heap pass per step end once the step end has paid its share, so no single
pause of the job pays for a whole search on a big heap; on an ordinary heap it all runs at once."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpumemd.api import build_agent
from gpumemd.components.leak import LeakComponent
from gpumemd.components.leak_pending import SLICE_START_S, PendingEvaluation
from gpumemd.config import Config
from gpumemd.probes.heap.stepwise import Stepwise, hold_weakly, run_to_end
from tests.fakes import ManualClock


def _passes(clock: ManualClock, log: list[str], name: str, n: int, cost: float) -> Stepwise[str]:
    for i in range(n):
        clock.now += cost
        log.append(f"{name}{i}")
        if i < n - 1:
            yield
    return f"{name} done"


def test_one_costly_pass_per_step_end_then_the_results() -> None:
    clock, log = ManualClock(), []
    pending = PendingEvaluation(10, [], set(), [(("a", ""), _passes(clock, log, "a", 3, 0.1)),
                                                (None, _passes(clock, log, "look", 2, 0.1))])
    step_ends = 0
    while True:
        step_ends += 1
        done = pending.advance(clock, clock.now)
        if done:
            break
        assert step_ends < 10
    assert log == ["a0", "a1", "a2", "look0", "look1"]
    assert step_ends == 5  # each pass costs more than SLICE_START_S: one per step end
    assert pending.found == {("a", ""): "a done"}  # the look prepares a later search: no result of its own


def test_cheap_passes_all_run_in_one_step_end() -> None:
    clock, log = ManualClock(), []
    cost = SLICE_START_S / 20
    pending = PendingEvaluation(10, [], set(), [(("a", ""), _passes(clock, log, "a", 4, cost)),
                                                (("b", ""), _passes(clock, log, "b", 4, cost))])
    assert pending.advance(clock, clock.now)
    assert len(log) == 8 and set(pending.found) == {("a", ""), ("b", "")}


def test_finish_now_and_close() -> None:
    clock, log = ManualClock(), []
    released: list[str] = []

    def holding() -> Stepwise[str]:
        try:
            yield
            yield
            return "never"
        finally:
            released.append("released")

    pending = PendingEvaluation(1, [], set(), [(("a", ""), _passes(clock, log, "a", 3, 1.0))])
    pending.finish_now()
    assert pending.found == {("a", ""): "a done"} and not pending.work
    other = PendingEvaluation(1, [], set(), [(("b", ""), holding())])
    other.advance(clock, clock.now)
    other.close()
    assert released == ["released"] and not other.work


def test_a_tensor_waits_weakly_between_passes() -> None:
    t = torch.ones(3)
    held = hold_weakly(t)
    assert held() is t
    ref = weakref.ref(t)
    del t
    assert ref() is None and held() is None  # the search kept nothing alive across the step
    unweakable = [1, 2]
    assert hold_weakly(unweakable)() is unweakable  # lists take no weak references: held for the step
    assert run_to_end(_passes(ManualClock(), [], "x", 3, 0.0)) == "x done"


@pytest.fixture
def kept_outputs_run(out_dir: str, caplog: pytest.LogCaptureFixture) -> Iterator[Any]:
    def run(pass_cost: float) -> tuple[list[int], list[int], list[Any]]:
        """A job at the defaults that keeps one output per step; every pass of the culprit search
        costs ``pass_cost`` on the component's clock. -> the steps of the passes, of the warnings, and
        the findings."""
        config = Config(output_dir=out_dir, sample_interval_s=0, nvml=False)
        agent = build_agent(config)
        leak = agent.component(LeakComponent)
        assert leak is not None
        clock = ManualClock()
        leak._clock = clock
        passes: list[int] = []
        warned: list[int] = []
        model = torch.nn.Linear(8, 8)
        agent.register(model)
        agent.start()
        assert leak._parts is not None
        search = leak._parts.culprits.search

        def costly_search(status: Any) -> Stepwise[Any]:
            # a pass of its own first (as a census diff's census is), then the real search's passes
            clock.now += pass_cost
            passes.append(agent.current_step)
            yield
            inner = search(status)
            while True:
                clock.now += pass_cost
                passes.append(agent.current_step)
                try:
                    next(inner)
                except StopIteration as done:
                    return done.value
                yield

        leak._parts.culprits.search = costly_search  # type: ignore[method-assign]
        kept = []
        try:
            with caplog.at_level(logging.WARNING, logger="gpumemd"):
                for step in range(700):
                    out = model(torch.randn(4, 8))
                    out.sum().backward()
                    kept.append(out[:1].detach().clone())
                    before = len(caplog.records)
                    agent.mark_step(step)
                    warned += [step] * sum("leak" in r.getMessage() for r in caplog.records[before:])
            findings = list(agent.findings())
        finally:
            agent.stop()
        return passes, warned, findings

    yield run


def test_a_costly_search_is_spread_over_step_ends_and_still_names_the_holder(kept_outputs_run: Any) -> None:
    passes, warned, findings = kept_outputs_run(pass_cost=SLICE_START_S * 2)
    assert warned, "the leak was not reported"
    first_search = [s for s in passes if s <= warned[0]]
    assert len(first_search) >= 2, passes  # the search had several passes ...
    assert len(set(first_search)) == len(first_search), passes  # ... each in its own step end
    assert warned[0] == first_search[-1]  # said when its search is done, not before
    finding = findings[0]
    assert finding.first_step is not None and finding.first_step <= first_search[0]  # dated by the evaluation
    assert "`kept`" in (finding.headline or "")


def test_cheap_searches_run_whole_in_the_evaluation_step_end(kept_outputs_run: Any) -> None:
    passes, warned, _ = kept_outputs_run(pass_cost=0.0)
    first_search = [s for s in passes if s <= warned[0]]
    assert len(first_search) >= 2 and set(first_search) == {warned[0]}, (passes, warned)


_SEARCH = "def search(held, who):\n    yield\n    sample = held()\n    return who(sample, time_budget_s=2.0)\n"


def _generator_in(module_name: str) -> Any:
    namespace: dict[str, Any] = {"__name__": module_name}
    exec(compile(_SEARCH, f"<{module_name}>", "exec"), namespace)  # a fixed snippet, in a module of that name
    return namespace["search"]


@pytest.mark.parametrize("ours", [True, False])
def test_a_search_between_its_passes_is_not_the_holder_it_finds(ours: bool) -> None:
    from gpumemd.probes.holding.holders import who_holds

    kept_by_the_job = [torch.ones(4)]
    search = _generator_in("gpumemd.components.a_search" if ours else "users_module")
    work = search(lambda: kept_by_the_job[0], who_holds)
    next(work)
    with pytest.raises(StopIteration) as done:
        next(work)
    holder = done.value.value or ""
    # gpumemd's own search (running, the tensor in its frame) is never named; a user's generator is
    # a holder like any other code
    if ours:
        assert "kept_by_the_job" in holder and "generator" not in holder, holder
    else:
        assert "`sample` in search()" in holder, holder  # the running generator's own local
