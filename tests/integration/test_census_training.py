"""The census inside real CPU training loops, through ``gpumemd.attach``."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import gpumemd
from gpumemd.components.census_component import CensusComponent
from gpumemd.probes.census import census_steps as census_probe

SETTINGS: dict[str, Any] = {"sample_interval_s": 0, "nvml": False, "leak_detection": False}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    out = model(torch.randn(8, 12))
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return out


def test_censuses_run_on_their_cadence_and_name_what_attach_registered(out_dir: str) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=out_dir, census_every_steps=5, **SETTINGS)
    component = agent.component(CensusComponent)
    assert isinstance(component, CensusComponent)

    for _ in range(20):
        _step(model, opt)
    # In a full test session this process's heap can make a census pass a step end's share: the one
    # begun at step 19 then ends a step or two later (the next is not due before step 24).
    for _ in range(4):
        if component._running is None:
            break
        _step(model, opt)

    state = agent.state()
    assert state.censuses_total == 4
    assert state.census is not None and state.census.step == 19
    assert [c.step for c in component.recent_censuses()] == [4, 9, 14, 19]
    at = component.at_or_after(6)
    assert at is not None and at.step == 9
    census = state.census
    params = dict(model.named_parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    assert sum(g.nbytes for g in census.groups if g.key.name in params) == param_bytes
    adam = {f"Adam[{f}].{k}" for f in params for k in ("exp_avg", "exp_avg_sq", "step")}
    assert sum(g.nbytes for g in census.groups if g.key.name in adam) == 2 * param_bytes + 4 * len(params)
    assert state.overhead.census_seconds_total > 0


def test_agent_census_runs_one_now_and_keeps_it_in_the_state(out_dir: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    agent = gpumemd.attach(output_dir=out_dir, census=False, **SETTINGS)
    for _ in range(3):
        _step(model, opt)  # the step hook sees the optimizer: its state gets named without register()

    census = agent.census()

    assert agent.state().census is census and agent.state().censuses_total == 1
    assert census.step == 2
    momentum = [g for g in census.groups if g.key.name and g.key.name.startswith("SGD[")]
    assert momentum and all(str(g.key.name).endswith("].momentum_buffer") for g in momentum)
    assert sum(g.nbytes for g in momentum) == sum(p.numel() * 4 for p in model.parameters())


def _leaky_training(steps: int, agent: Any) -> tuple[Any, Any]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs_seen = []  # the leak: detached outputs kept "for later analysis"
    for i in range(steps):
        out = _step(model, opt)
        outputs_seen.append(out.detach())
        if i == 4:
            first = agent.component(CensusComponent).take_now()
    last = agent.component(CensusComponent).take_now()
    return first, last


def test_a_list_held_leak_is_diffed_and_named_by_its_variable(out_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(census_probe, "HOLDERS_TIME_BUDGET_S", 60.0)  # no timing assumptions
    agent = gpumemd.attach(output_dir=out_dir, census_every_steps=1000, **SETTINGS)

    first, last = _leaky_training(15, agent)

    deltas = [d for d in last.diff(first) if d.key.shape == (8, 4)]
    assert [(d.count_delta, d.bytes_delta, d.key.category) for d in deltas] == [(10, 10 * 8 * 4 * 4, "other")]
    holder = deltas[0].holder
    assert holder is not None and holder.startswith("`outputs_seen` in _leaky_training() at ")
    assert holder.endswith("→ list of 15 items")


def test_a_loss_summed_with_its_graph_is_seen_as_growing_graph_memory(
    out_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(census_probe, "HOLDERS_TIME_BUDGET_S", 60.0)  # no timing assumptions
    gc.collect()
    torch.manual_seed(0)
    agent = gpumemd.attach(output_dir=out_dir, census_every_steps=1000, **SETTINGS)
    component = agent.component(CensusComponent)
    assert isinstance(component, CensusComponent)
    model = nn.Sequential(nn.Linear(12, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    running = torch.zeros(())
    for i in range(12):
        opt.zero_grad()
        loss = model(torch.randn(16, 12)).pow(2).mean()
        loss.backward(retain_graph=True)  # the graph survives backward: its saved tensors stay
        opt.step()
        running = running + loss  # the classic leak: no .item()
        if i == 1:
            early = component.take_now()
    late = component.take_now()

    growth = late.bytes_by_category()["graph"] - early.bytes_by_category()["graph"]
    assert growth >= 10 * 16 * 256 * 4  # ten more steps of hidden activations
    hidden = [d for d in late.diff(early) if d.key.shape == (16, 256)]
    assert hidden and hidden[0].key.category == "graph" and hidden[0].count_delta == 10
    assert hidden[0].holder is not None and "`running` in test_a_loss_summed" in hidden[0].holder
    del running


def test_a_confirmed_leak_is_followed_by_a_census_that_shows_it(out_dir: str) -> None:
    """At DEFAULT settings a fast loop spaces its censuses thousands of steps apart: the census the
    state (and the demo's table) shows would predate the leak a confirmed finding states. The
    confirmation asks for one at the next step ends."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    onset, kept, confirmed_at = 60, [], None
    with gpumemd.attached(output_dir=out_dir) as agent:
        for step in range(3_000):
            out = _step(model, opt)
            if step >= onset:
                kept.append(out.detach().mean() + torch.zeros(64, 128))  # 32 KiB a step, in a list
            if confirmed_at is None and any(f.state == "confirmed" for f in agent.state().findings):
                confirmed_at = step
            if confirmed_at is not None and step >= confirmed_at + 10:
                break
        state = agent.state()
    finding = next(f for f in state.findings if f.state == "confirmed")
    census = state.census

    assert confirmed_at is not None and census is not None and census.step is not None
    assert finding.onset_step is not None and census.step > finding.onset_step
    assert census.step >= confirmed_at, (census.step, confirmed_at)  # taken after the confirmation
    # its figures show the leak: the kept group holds at least the growth the finding stated then
    group = next(g for g in census.groups if g.key.shape == (64, 128))
    assert group.count >= (census.step - onset) // 2 and group.nbytes >= finding.growth_bytes // 2, (group, finding)
