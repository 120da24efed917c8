"""The framework-free core of the Lightning / HF callbacks, and their import behaviour."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys

import pytest
import torch

import gpumemd
from gpumemd.integrations._session import FrameworkSession, guarded


def test_bad_options_fail_when_the_callback_is_built() -> None:
    with pytest.raises(ValueError, match=r"attach\(port=70000\) is not valid"):
        FrameworkSession("lightning", {"port": 70000})


def test_session_attaches_takes_over_steps_and_detaches(out_dir: str) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = FrameworkSession("lightning", {"output_dir": out_dir, "sample_interval_s": 0})

    agent = session.start(model=model, optimizers=[opt, None], rank=(0, 0, 1))
    assert session.owned and gpumemd.current() is agent
    assert model in set(agent.models) and opt in set(agent.optimizers)

    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # the framework ends steps now: the optimizer hook alone records nothing
    assert agent.steps() == []
    session.step(1)
    session.step(1)  # same counter (a micro-batch of an accumulation): no new step
    session.step(2)
    assert [r.step for r in agent.steps()] == [0, 1]

    session.enter_phase("eval")
    assert agent.current_phase == "eval"
    session.stop()  # leaves the phase, detaches what it attached
    assert agent.current_phase == "train" and gpumemd.current() is None


def test_session_joins_a_running_agent_and_leaves_it_running(out_dir: str) -> None:
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0)
    session = FrameworkSession("transformers", {})
    assert session.start(rank=(3, 1, 4), global_step=10) is agent
    ident = agent.state().identity
    assert (ident.rank, ident.local_rank, ident.world_size, ident.source) == (3, 1, 4, "transformers")
    session.step(10)  # resumed at global_step 10: nothing new yet
    session.step(11)
    assert [r.step for r in agent.steps()] == [10]
    session.stop()
    assert gpumemd.current() is agent


def test_a_failing_hook_is_logged_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    class Callback:
        calls = 0

        @guarded
        def on_step_end(self) -> None:
            Callback.calls += 1
            raise RuntimeError("broken probe")

    cb = Callback()
    with caplog.at_level(logging.WARNING, logger="gpumemd"):
        assert cb.on_step_end() is None
        assert cb.on_step_end() is None
    assert Callback.calls == 2
    lines = [r.getMessage() for r in caplog.records if "Callback.on_step_end" in r.getMessage()]
    assert lines == ["gpumemd: Callback.on_step_end failed (RuntimeError: broken probe); the job continues"]


@pytest.mark.parametrize(
    ("module", "blocked", "package"),
    [
        ("gpumemd.integrations.lightning", ("lightning", "lightning.pytorch", "pytorch_lightning"), "lightning"),
        ("gpumemd.integrations.transformers", ("transformers",), "transformers"),
    ],
)
def test_missing_framework_says_what_to_install(monkeypatch: pytest.MonkeyPatch, module: str,
                                                blocked: tuple[str, ...], package: str) -> None:
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail, as if not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=r"pip install 'gpumemd\[frameworks\]'") as info:
        importlib.import_module(module)
    assert f"`{package}`" in str(info.value) and info.value.name == package


def test_importing_gpumemd_integrations_imports_no_framework() -> None:
    code = ("import sys, gpumemd, gpumemd.integrations, gpumemd.cli.run; "
            "print(sorted(m for m in ('lightning', 'transformers', 'pytorch_lightning', 'torch') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
