"""The agent on real CPU training loops: steps, history, lifecycle, fork safety."""

from __future__ import annotations

import gc
import itertools
import os
import threading
from typing import Any

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

import gpumemd
from gpumemd.agent import MAX_STRIDE, Agent
from gpumemd.api import build_agent
from gpumemd.components.base import ComponentBase
from gpumemd.config import Config
from gpumemd.records.step import StepRecord


def make_job(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, accumulate: int = 1) -> None:
    for _ in range(steps):
        for _ in range(accumulate):
            model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_each_optimizer_step_is_one_step(out_dir: str) -> None:
    model, opt = make_job()
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0, census=False)
    train(model, opt, 7)
    records = agent.steps()
    state = agent.state()
    assert state.step == 6 and state.steps_total == 7
    # Every step is counted; records are sampled (every step until the cost is known, then every
    # Nth step on a job this fast), each standing for the steps since the previous one.
    assert [r.step for r in records[:3]] == [0, 1, 2] and all(r.steps == 1 for r in records[:3])
    assert all(b.step - a.step == b.steps for a, b in itertools.pairwise(records))
    assert records[0].duration_s is None and all(r.duration_s is not None and r.duration_s > 0 for r in records[1:])
    assert all(r.host is not None and r.host.rss_bytes > 0 for r in records)
    assert state.last_step == records[-1]
    assert state.probes_available["host"] is True
    if torch.version.cuda is None and torch.version.hip is None:  # CPU build: the allocator is absent, not zeros
        assert records[-1].allocator == () and state.probes_available["allocator"] is False
    else:  # a CUDA build (tests/gpu may have initialised CUDA in this process): present, reading only then
        assert state.probes_available["allocator"] is True
        assert records[-1].allocator == () or torch.cuda.is_initialized()


def test_a_fast_job_is_sampled_every_few_steps_and_every_step_is_counted(out_dir: str) -> None:
    model, opt = make_job()
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0, census=False)
    train(model, opt, 300)
    records = agent.steps()
    state = agent.state()
    assert state.steps_total == 300 and state.step == 299
    # Records cover the steps without gaps or overlaps: the last one ends at most a stride before.
    assert sum(r.steps for r in records) == records[-1].step + 1
    assert 299 - records[-1].step < agent.stride <= MAX_STRIDE
    assert state.overhead.samples == len(records) < 300  # a sub-millisecond step is not sampled every time

def test_attach_is_idempotent_and_detach_removes_the_hook(out_dir: str) -> None:
    hooks_before = len(_global_optimizer_post_hooks)
    first = gpumemd.attach(output_dir=out_dir, sample_interval_s=0)
    assert gpumemd.attach() is first and gpumemd.current() is first
    assert len(_global_optimizer_post_hooks) == hooks_before + 1
    gpumemd.detach()
    assert gpumemd.current() is None
    assert len(_global_optimizer_post_hooks) == hooks_before
    model, opt = make_job()
    train(model, opt, 2)
    assert first.steps() == []  # nothing recorded after detach
    gpumemd.detach()  # a second detach is harmless


def test_bad_config_fails_at_attach_not_in_the_loop(out_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMEMD_SAMPLE_INTERVAL_S", "often")
    with pytest.raises(ValueError, match="GPUMEMD_SAMPLE_INTERVAL_S='often' is not valid: expected a number"):
        gpumemd.attach(output_dir=out_dir)
    assert gpumemd.current() is None


def test_gradient_accumulation_counts_optimizer_updates(out_dir: str) -> None:
    model, opt = make_job()
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0) as agent:
        train(model, opt, 3, accumulate=4)
        assert len(agent.steps()) == 3


def test_only_the_primary_optimizer_ends_steps(out_dir: str) -> None:
    gen, opt_g = make_job(1)
    disc, opt_d = make_job(2)
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0) as agent:
        for _ in range(4):
            train(gen, opt_g, 1)
            train(disc, opt_d, 1)
        assert agent.state().steps_total == 4
        assert opt_g in agent.optimizers and opt_d in agent.optimizers


def test_an_optimizer_built_anew_ends_steps_once_the_old_one_is_gone(out_dir: str) -> None:
    # Once the primary optimizer is freed, a new one (a fine-tuning phase's) is taken as the primary and named.
    model, opt = make_job()
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0) as agent:
        train(model, opt, 30)
        del opt
        gc.collect()  # (an optimizer may sit in a reference cycle; the first one stays primary while it lives)
        rebuilt = torch.optim.SGD(model.parameters(), lr=0.01)
        train(model, rebuilt, 30)
        assert agent.state().steps_total == 60 and agent.state().step == 59
        assert list(agent.optimizers) == [rebuilt]
        second, opt_2 = make_job(1)
        train(second, opt_2, 1)  # another optimizer stepping: named, no step of its own
        assert agent.state().steps_total == 60 and opt_2 in agent.optimizers


def test_mark_step_overrides_the_optimizer_hook(out_dir: str) -> None:
    model, opt = make_job()
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0) as agent:
        train(model, opt, 2)
        record = gpumemd.mark_step(100)
        assert isinstance(record, StepRecord) and record.step == 100
        train(model, opt, 3)  # no longer ends steps: no double count
        gpumemd.mark_step()
        assert agent.state().step == 101 and agent.state().steps_total == 4
        assert [s.step for s in agent.steps()][:3] == [0, 1, 100]


def test_the_step_ring_is_bounded(out_dir: str) -> None:
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0, keep_steps=10) as agent:
        for _ in range(400):
            gpumemd.mark_step()
        steps = agent.steps()
        assert len(steps) == 10 and agent.state().overhead.samples > 10  # the oldest records went
        assert [s.step for s in steps] == sorted(s.step for s in steps) and 400 - MAX_STRIDE <= steps[-1].step <= 399


def test_phase_labels_steps(out_dir: str) -> None:
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0) as agent:
        gpumemd.mark_step()
        with gpumemd.phase("eval"):
            gpumemd.mark_step()
        gpumemd.mark_step()
        assert [s.phase for s in agent.steps()] == ["train", "eval", "train"]
    with pytest.raises(ValueError, match="non-empty string"), gpumemd.phase(""):
        pass


def test_state_is_swapped_not_mutated(out_dir: str) -> None:
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0) as agent:
        before = agent.state()
        gpumemd.mark_step()
        after = agent.state()
        assert before is not after and before.step is None and after.step == 0


def test_sampler_thread_refreshes_state_and_stops_on_detach(out_dir: str) -> None:
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0.01)
    first = agent.state()
    deadline = threading.Event()
    for _ in range(500):  # poll with a deadline: the sampler publishes a new state on its own
        if agent.state().updated_at > first.updated_at:
            break
        deadline.wait(0.01)
    assert agent.state().updated_at > first.updated_at
    assert agent.state().host is not None and agent.state().host.available_bytes is not None
    gpumemd.detach()
    assert not any(t.name == "gpumemd-sampler" for t in threading.enumerate())


class BrokenComponent(ComponentBase):
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0
        self.stopped = False

    def start(self, agent: Agent) -> None: ...

    def on_step(self, record: StepRecord) -> None:
        self.calls += 1
        raise KeyError("bug in a component")

    def stop(self) -> None:
        self.stopped = True


def test_a_failing_component_never_breaks_the_job(out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    broken = BrokenComponent()
    agent = build_agent(Config(output_dir=out_dir, sample_interval_s=0), components=[broken]).start()
    model, opt = make_job()
    with caplog.at_level("WARNING", logger="gpumemd"):
        train(model, opt, 3)
    agent.stop()
    assert broken.calls == 3 and broken.stopped and len(agent.steps()) == 3
    assert sum("bug in a component" in r.getMessage() for r in caplog.records) == 1


def test_user_exceptions_propagate_unchanged(out_dir: str) -> None:
    model, opt = make_job()
    error = ValueError("the user's own bug")
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0):
        with pytest.raises(ValueError) as info:
            train(model, opt, 1)
            raise error
    assert info.value is error


class ProbeInWorker(torch.utils.data.Dataset[Any]):
    """Each item reports what a forked DataLoader worker sees of the agent."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        agent = gpumemd.current()
        marked = gpumemd.mark_step()
        sampler_alive = any(t.name == "gpumemd-sampler" for t in threading.enumerate())
        return torch.tensor([os.getpid(), agent is None, marked is None, sampler_alive])


def test_forked_dataloader_workers_run_no_sampler_and_record_nothing(out_dir: str) -> None:
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0.05)
    loader = torch.utils.data.DataLoader(
        ProbeInWorker(), batch_size=1, num_workers=2, multiprocessing_context="fork"
    )
    rows = torch.cat(list(loader)).tolist()
    assert len(rows) == 4
    assert all(int(pid) != os.getpid() for pid, *_ in rows)
    assert all(no_agent and not_marked and not sampler for _, no_agent, not_marked, sampler in rows)
    assert agent.steps() == []  # the workers' mark_step calls recorded nothing here either


def test_a_second_attach_with_other_options_says_they_were_not_applied(
        out_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """Under `gpumemd run` the script's own attach(port=...) must not vanish silently."""
    first = gpumemd.attach(output_dir=out_dir, sample_interval_s=0, keep_steps=100)
    try:
        with caplog.at_level("WARNING", logger="gpumemd"):
            assert gpumemd.attach(keep_steps=100, sample_interval_s=0) is first  # same settings: quiet
            assert not caplog.records
            assert gpumemd.attach(keep_steps=50, census=True) is first
        [record] = caplog.records
        assert "attach(keep_steps=50)" in record.getMessage()
        assert "kept its settings (keep_steps=100)" in record.getMessage()
        assert first.config.keep_steps == 100
    finally:
        gpumemd.detach()
