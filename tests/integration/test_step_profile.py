"""The step profile component on real CPU training loops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpumemd
from gpumemd.components.step_profiler import StepProfileComponent
from gpumemd.probes.planning.trace import SavedTensorCounter
from gpumemd.records.device import CPU


def hooks_active() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 10))
    return model, torch.optim.Adam(model.parameters())


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = torch.randn(32, 100), torch.randint(0, 10, (32,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def expected_saved() -> int:
    return 4 * (32 * 100 + 32 * 256)  # the input (Linear1) and the ReLU output (ReLU, Linear2)


def test_sampled_steps_publish_exact_cpu_breakdown(out_dir: str) -> None:
    model, opt = make()
    published: list[int] = []
    with gpumemd.attached(model=model, optimizer=opt, output_dir=out_dir, step_profile=True,
                          step_profile_every_steps=3, sample_interval_s=0) as agent:
        for _ in range(7):
            train_step(model, opt)
            profile = agent.state().step_profile
            published.append(-1 if profile is None else profile.step)
        profile = agent.state().step_profile
    assert published == [-1, -1, 2, 2, 2, 5, 5]  # steps 2 and 5 of 0..6 are sampled
    assert profile is not None and profile.device == CPU
    assert profile.saved_for_backward_bytes == expected_saved()
    param_bytes = sum(p.nbytes for p in model.parameters())
    assert profile.parameter_bytes == param_bytes
    assert profile.gradient_bytes == param_bytes
    state_bytes = sum(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert profile.optimizer_state_bytes == state_bytes
    # CPU has no allocator statistics: device figures are absent, not guessed
    assert profile.forward_start_bytes is None and profile.forward_peak_bytes is None
    assert profile.after_backward_bytes is None and profile.after_step_bytes is None
    assert profile.optimizer_step_transient_bytes is None
    assert profile.figures() == {
        "saved_for_backward": expected_saved(),
        "parameters": param_bytes,
        "gradients": param_bytes,
        "optimizer_state": state_bytes,
    }
    assert profile.overhead_s > 0


def test_live_count_matches_an_independent_counter(out_dir: str) -> None:
    model, _ = make()
    x = torch.randn(32, 100)
    with SavedTensorCounter(exclude=model.parameters()) as counter:
        model(x)
    assert counter.bytes == expected_saved()


def test_root_model_discovered_without_registration(out_dir: str) -> None:
    model, opt = make()
    criterion = nn.CrossEntropyLoss()  # parameterless: must not be taken for the model
    saved: list[int] = []
    with gpumemd.attached(output_dir=out_dir, step_profile=True, step_profile_every_steps=1,
                          sample_interval_s=0) as agent:
        for _ in range(4):
            x, y = torch.randn(32, 100), torch.randint(0, 10, (32,))
            loss = criterion(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert not torch.nn.modules.module._global_forward_pre_hooks  # discovery hook removed
            profile = agent.state().step_profile
            assert profile is not None
            saved.append(profile.saved_for_backward_bytes)
    # the very first forward (where the model is discovered) is measured too
    assert saved == [expected_saved()] * 4


def test_hooks_only_on_sampled_steps_and_removed_on_detach(out_dir: str) -> None:
    model, opt = make()
    seen: list[bool] = []
    model[1].register_forward_pre_hook(lambda m, a: seen.append(hooks_active()))
    with gpumemd.attached(model=model, optimizer=opt, output_dir=out_dir, step_profile=True,
                          step_profile_every_steps=2, sample_interval_s=0):
        for _ in range(4):
            train_step(model, opt)
            assert not hooks_active()
    assert seen == [False, True, False, True]
    assert not model._forward_pre_hooks and not model._forward_hooks  # ours are gone
    train_step(model, opt)
    assert seen[-1] is False


def test_user_exception_propagates_and_hooks_are_popped(out_dir: str) -> None:
    model, opt = make()

    class Boom(Exception):
        pass

    def explode(module: nn.Module, args: object) -> None:
        raise Boom("user error")

    with gpumemd.attached(model=model, optimizer=opt, output_dir=out_dir, step_profile=True,
                          step_profile_every_steps=1, sample_interval_s=0) as agent:
        handle = model[2].register_forward_pre_hook(explode)
        with pytest.raises(Boom, match="user error"):
            model(torch.randn(4, 100))
        assert not hooks_active()
        handle.remove()
        opt.zero_grad()
        train_step(model, opt)  # the next step is measured normally
        profile = agent.state().step_profile
    assert profile is not None and profile.saved_for_backward_bytes == expected_saved()


def test_off_by_default(out_dir: str) -> None:
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0) as agent:
        assert agent.component(StepProfileComponent) is None
    with gpumemd.attached(output_dir=out_dir, sample_interval_s=0, step_profile=True) as agent:
        assert agent.component(StepProfileComponent) is not None


def test_a_failing_measurement_turns_the_step_profile_off_not_the_job(out_dir: str, caplog: pytest.LogCaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = make()
    with gpumemd.attached(model=model, optimizer=opt, output_dir=out_dir, step_profile=True,
                          step_profile_every_steps=1, sample_interval_s=0) as agent:
        component = agent.component(StepProfileComponent)

        def broken(*, reset_peak: bool) -> int:
            raise RuntimeError("allocator went away")

        monkeypatch.setattr(component, "_allocated", broken)
        for _ in range(3):
            train_step(model, opt)  # nothing raises into the loop
            assert not hooks_active()
        assert agent.state().step_profile is None
        assert agent.state().steps_total == 3
    assert "the step profile failed at" in caplog.text and "it is off for this run" in caplog.text
