"""Api.build_agent is the one place that builds probes, the allocation history and components."""

from __future__ import annotations

import ast
import pathlib

import pytest

import gpumemd
from gpumemd.api import build_agent, build_components
from gpumemd.components.census_component import CensusComponent
from gpumemd.components.exporter import ExporterComponent
from gpumemd.components.leak import LeakComponent, LeakOptions
from gpumemd.components.oom_component import OomComponent, OomOptions
from gpumemd.components.state_writer import LastStateComponent
from gpumemd.config import Config
from gpumemd.probes.device.allocation_history import AllocationHistory

PACKAGE = pathlib.Path(gpumemd.__file__).parent


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def test_the_agent_imports_no_component() -> None:
    imported = _imported_modules(PACKAGE / "agent.py")
    components = {m for m in imported if m.startswith("gpumemd.components")}
    assert components <= {"gpumemd.components.base"}, components


def test_components_see_the_agent_only_through_the_view() -> None:
    for path in sorted((PACKAGE / "components").glob("*.py")):
        assert "gpumemd.agent" not in _imported_modules(path), f"{path.name} imports the agent"


def test_one_allocation_history_is_shared_and_siblings_are_given_not_looked_up(out_dir: str) -> None:
    history = AllocationHistory(torch_module=object())
    config = Config(output_dir=out_dir, port=0)
    components = build_components(config, history=history)
    census = next(c for c in components if isinstance(c, CensusComponent))
    leak = next(c for c in components if isinstance(c, LeakComponent))
    oom = next(c for c in components if isinstance(c, OomComponent))
    exporter = next(c for c in components if isinstance(c, ExporterComponent))
    assert [type(c) for c in components] == [CensusComponent, LeakComponent, OomComponent, LastStateComponent,
                                             ExporterComponent]
    assert leak._census is census and leak._sites._history is history
    assert oom._probe._history is history and oom._on_fatal is exporter
    assert oom._census is census  # one census path: the OOM report's census is the census component's


def test_with_censuses_off_the_one_census_component_still_serves_the_oom_capture(out_dir: str) -> None:
    components = build_components(Config(output_dir=out_dir, census=False, leak_detection=False))
    assert [type(c) for c in components] == [CensusComponent, OomComponent, LastStateComponent]
    census, oom, _ = components
    assert isinstance(oom, OomComponent) and oom._census is census


def test_with_censuses_off_no_step_takes_one_but_the_job_can_ask(out_dir: str) -> None:
    config = Config(output_dir=out_dir, census=False, sample_interval_s=0, nvml=False, quiet=True)
    agent = build_agent(config).start()
    try:
        for step in range(5):
            agent.mark_step(step)
        assert agent.state().censuses_total == 0 and agent.state().census is None
        census = agent.census()  # the census component's path, as at an OOM
        assert agent.state().census is census and agent.state().censuses_total == 1
    finally:
        agent.stop()


def test_each_component_gets_its_own_options_from_the_config(out_dir: str) -> None:
    config = Config(output_dir=out_dir, leak_window_steps=800, oom_max_reports=2, census_every_steps=7)
    components = build_components(config)
    leak = next(c for c in components if isinstance(c, LeakComponent))
    oom = next(c for c in components if isinstance(c, OomComponent))
    census = next(c for c in components if isinstance(c, CensusComponent))
    assert leak._options == config.options(LeakOptions) and leak._options.leak_window_steps == 800
    assert oom.config == config.options(OomOptions) and oom.config.oom_max_reports == 2
    assert census.interval == 7 and census._budget == config.overhead_budget
    assert not any(isinstance(c, ExporterComponent) for c in components)  # nowhere to export to


def test_switched_off_components_are_not_built(out_dir: str) -> None:
    config = Config(output_dir=out_dir, census=False, leak_detection=False, oom_reports=False)
    # the one census path, and the state file a SIGKILL leaves (always: it is how a vanished job is told)
    assert [type(c) for c in build_components(config)] == [CensusComponent, LastStateComponent]
    leak_only = build_components(Config(output_dir=out_dir, census=False, oom_reports=False))
    assert [type(c) for c in leak_only] == [CensusComponent, LeakComponent, LastStateComponent]
    assert isinstance(leak_only[1], LeakComponent) and leak_only[1]._census is None  # no step censuses to read


def test_components_are_found_by_type(out_dir: str) -> None:
    agent = build_agent(Config(output_dir=out_dir, sample_interval_s=0, nvml=False, quiet=True)).start()
    try:
        oom = agent.component(OomComponent)
        assert isinstance(oom, OomComponent)
        assert agent.component(ExporterComponent) is None
    finally:
        agent.stop()


@pytest.mark.parametrize("every", [0, -3])
def test_step_profile_component_needs_a_positive_cadence(every: int) -> None:
    from gpumemd.components.step_profiler import StepProfileComponent, StepProfileOptions

    with pytest.raises(ValueError, match="every_steps"):
        StepProfileComponent(StepProfileOptions(step_profile_every_steps=every))
