"""Lightning and Hugging Face Trainer callbacks on real CPU runs with tiny models built from config.

Each framework gets a clean run (the agent stays quiet) and a run with a planted leak (a list on
the model that keeps 64 KiB per step) that the agent finds and names.
"""

from __future__ import annotations

import itertools
import tempfile
from typing import Any

import pytest
import torch
from optional_extras import require_framework

import gpumemd

# Small windows so a leak is provable in ~100 steps; the clean runs use the very same settings.
AGENT = {
    "sample_interval_s": 0,
    "census_every_steps": 5,
    "leak_warmup_steps": 10,
    "leak_window_steps": 40,
    "leak_check_every_steps": 10,
    "leak_min_bytes_per_step": 16 * 1024,
}
LEAK_NUMEL = 16 * 1024  # float32: 64 KiB per step


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny models gain nothing from intra-op threads, and on a busy runner those threads spin:
    one thread makes these runs ~30x faster there (and changes nothing gpumemd sees)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _named(findings: list[Any], holder: str) -> bool:
    return any(holder in (c.holder or "") for f in findings for c in f.culprits)


# --- Lightning ---------------------------------------------------------------------------------


def _lightning_fit(out_dir: str, *, leak: bool, steps: int, accumulate: int = 1,
                   oom_at: int | None = None, settings: dict[str, Any] | None = None,
                   seed: int = 0) -> tuple[Any, Any, Any]:
    pl = require_framework("lightning.pytorch")  # the `frameworks` extra
    from torch.utils.data import DataLoader, TensorDataset

    from gpumemd.integrations.lightning import GpumemdCallback

    class Classifier(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
            self.leaky_cache: list[torch.Tensor] = []
            self.eval_phases: list[str] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if batch_idx == oom_at:
                torch.empty(2**60, dtype=torch.uint8)  # a CPU allocation failure inside the fit
            if leak and batch_idx % accumulate == 0:
                self.leaky_cache.append(torch.ones(LEAK_NUMEL))
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            agent = gpumemd.current()
            self.eval_phases.append(agent.current_phase if agent else "detached")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    seen: dict[str, Any] = {}

    class Spy(pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            seen["agent"] = gpumemd.current()

    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(64, 32), torch.randint(0, 4, (64,)))
    module = Classifier()
    callback = GpumemdCallback(output_dir=out_dir, **(AGENT if settings is None else settings))
    trainer = pl.Trainer(
        max_steps=steps, accumulate_grad_batches=accumulate, val_check_interval=20, check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, Spy()],
        default_root_dir=tempfile.mkdtemp(prefix="gpumemd-pl-"),
    )
    trainer.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    return seen["agent"], module, trainer


@pytest.mark.slow
def test_lightning_clean_fit_steps_phases_and_quiet(out_dir: str) -> None:
    agent, module, trainer = _lightning_fit(out_dir, leak=False, steps=110, accumulate=2)

    # One step per optimizer update (2 batches each), numbered like trainer.global_step.
    assert agent.state().steps_total == 110 == trainer.global_step and agent.state().step == 109
    records = agent.steps()
    assert [r.step for r in records][:3] == [0, 1, 2]  # sampled from then on: none missing, none twice
    assert all(b.step - a.step == b.steps for a, b in itertools.pairwise(records))
    assert {r.phase for r in agent.steps()} == {"train"}
    assert module.eval_phases and set(module.eval_phases) == {"eval"}
    assert module in set(agent.models) and trainer.optimizers[0] in set(agent.optimizers)
    assert not agent.running and gpumemd.current() is None  # detached at teardown
    assert agent.state().censuses_total >= 10  # the detector had data, and stayed quiet
    assert agent.findings() == []


@pytest.mark.slow
def test_lightning_planted_leak_is_named(out_dir: str) -> None:
    agent, _, _ = _lightning_fit(out_dir, leak=True, steps=110)
    findings = agent.findings()
    assert findings, [r.census_total_bytes for r in agent.steps()]
    assert _named(findings, "leaky_cache"), findings


@pytest.mark.slow
def test_lightning_oom_in_fit_keeps_the_agent_for_the_report(out_dir: str) -> None:
    """Lightning calls on_exception (not teardown) on a crash: the agent must still be there when
    the OOM reaches the user's guard (or the excepthook of `gpumemd run`)."""
    guard = gpumemd.oom_guard()
    with pytest.raises(RuntimeError, match="can't allocate memory"), guard:
        _lightning_fit(out_dir, leak=False, steps=30, oom_at=5)

    assert guard.last_report is not None and "oom-rank0-" in guard.last_report
    agent = gpumemd.current()
    assert agent is not None and agent.current_phase == "train"


# --- Hugging Face Trainer ----------------------------------------------------------------------


def _hf_train_evaluate(out_dir: str, *, leak: bool, steps: int, settings: dict[str, Any] | None = None,
                       seed: int = 0) -> tuple[Any, Any, Any]:
    transformers = require_framework("transformers")

    from gpumemd.integrations.transformers import GpumemdCallback

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model.leaky_cache = []  # type: ignore[assignment]
    if leak:
        def keep(module: Any, args: Any, output: Any) -> None:
            if module.training:
                module.leaky_cache.append(torch.ones(LEAK_NUMEL))

        model.register_forward_hook(keep)

    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    eval_phases: list[str] = []

    class Spy(transformers.TrainerCallback):  # type: ignore[misc,name-defined]
        def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            agent = gpumemd.current()
            eval_phases.append(agent.current_phase if agent else "detached")

    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="gpumemd-hf-"), max_steps=steps, per_device_train_batch_size=4,
        per_device_eval_batch_size=16, eval_strategy="steps", eval_steps=25, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = GpumemdCallback(output_dir=out_dir, **(AGENT if settings is None else settings))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
                                   callbacks=[callback, Spy()])
    trainer.train()
    trainer.evaluate()
    agent = callback.agent
    return agent, trainer, eval_phases


@pytest.mark.slow
def test_hf_trainer_clean_train_evaluate(out_dir: str) -> None:
    agent, trainer, eval_phases = _hf_train_evaluate(out_dir, leak=False, steps=110)

    assert agent.state().steps_total == 110 == trainer.state.global_step and agent.state().step == 109
    records = agent.steps()
    assert [r.step for r in records][:3] == [0, 1, 2]  # sampled from then on: none missing, none twice
    assert all(b.step - a.step == b.steps for a, b in itertools.pairwise(records))
    assert eval_phases and set(eval_phases) == {"eval"}  # in-training evals and the final evaluate()
    assert agent.current_phase == "train"  # left again after evaluate
    assert trainer.model in set(agent.models) and trainer.optimizer in set(agent.optimizers)
    assert agent.running  # stays attached after train so the final evaluate() is recorded
    assert agent.state().censuses_total >= 10
    assert agent.findings() == []


@pytest.mark.slow
def test_hf_trainer_planted_leak_is_named(out_dir: str) -> None:
    agent, _, _ = _hf_train_evaluate(out_dir, leak=True, steps=110)
    findings = agent.findings()
    assert findings, [r.census_total_bytes for r in agent.steps()]
    assert _named(findings, "leaky_cache"), findings


# --- the leak scenario suite's framework jobs: healthy fits at the DEFAULT settings -----------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lightning_fit_at_defaults_raises_nothing(out_dir: str, seed: int) -> None:
    """A 2,000-step Lightning fit (validation every 20 steps) under the callback with only
    ``output_dir`` set: what a user gets. No leak finding may fire."""
    from gpumemd.integrations.lightning import GpumemdCallback

    agent, _, trainer = _lightning_fit(out_dir, leak=False, steps=2000, settings={}, seed=seed)
    assert trainer.global_step == 2000 and agent is not None
    assert agent.findings() == [], [f.summary for f in agent.findings()]
    # After fit the callback keeps the finished run reachable, detached: no hooks, no threads.
    callback = next(c for c in trainer.callbacks if isinstance(c, GpumemdCallback))
    assert callback.agent is agent and not agent.running and gpumemd.current() is None
    assert len(callback.agent.steps()) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hf_trainer_fit_at_defaults_raises_nothing(out_dir: str, seed: int) -> None:
    """A 2,000-step Hugging Face Trainer fit (evaluation every 25 steps) at the defaults."""
    agent, trainer, _ = _hf_train_evaluate(out_dir, leak=False, steps=2000, settings={}, seed=seed)
    assert trainer.state.global_step == 2000 and agent is not None
    assert agent.findings() == [], [f.summary for f in agent.findings()]
