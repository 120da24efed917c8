"""Hugging Face ``transformers``: ``Trainer(..., callbacks=[GpumemdCallback(output_dir=...)])``.

- attaches when training begins (or at the first evaluation step of an evaluate-only run), or
  joins an agent already attached; registers the model and the optimizer;
- ends one step per optimizer update at ``on_step_end`` (after gradient accumulation), numbered
  like ``state.global_step``;
- marks evaluation and prediction (from the first prediction step to ``on_evaluate`` /
  ``on_predict``) as phase ``"eval"``;
- takes rank, local rank and world size from ``TrainingArguments``;
- stays attached after ``on_train_end`` so a following ``trainer.evaluate()`` is still recorded;
  the agent stops at process exit, with ``gpumemd.detach()``, or at train end when built with
  ``detach_at_train_end=True``.
"""

from __future__ import annotations

from typing import Any

from gpumemd.integrations._session import FrameworkSession, guarded, missing_framework, rank_of

try:
    from transformers import TrainerCallback as _TrainerCallback
except ImportError as _missing:
    raise missing_framework("Hugging Face Trainer", "transformers", _missing) from None

__all__ = ["GpumemdCallback"]


class GpumemdCallback(_TrainerCallback):  # type: ignore[misc,unused-ignore]  # Any without transformers
    """Attach gpumemd to a ``transformers.Trainer``. Keyword arguments are ``gpumemd.attach()`` options."""

    def __init__(self, *, detach_at_train_end: bool = False, **options: Any) -> None:
        self.session = FrameworkSession("transformers", options)
        self.detach_at_train_end = detach_at_train_end

    @property
    def agent(self) -> Any:
        """The agent this callback uses (None before training or evaluation starts)."""
        return self.session.agent

    def _ensure_started(self, args: Any, state: Any, model: Any, optimizer: Any) -> None:
        if self.session.agent is None or not self.session.agent.running:
            self.session.start(model=model, optimizers=(optimizer,),
                               rank=rank_of(args, "process_index", "local_process_index"),
                               global_step=int(getattr(state, "global_step", 0) or 0))
        else:
            self.session.register(model, (optimizer,))

    @guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ensure_started(args, state, kwargs.get("model"), kwargs.get("optimizer"))

    @guarded
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Called once per optimizer update (after gradient_accumulation_steps micro-batches);
        # global_step has already been incremented.
        self.session.step(int(state.global_step))

    @guarded
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ensure_started(args, state, kwargs.get("model"), None)
        self.session.enter_phase("eval")

    @guarded
    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.exit_phase()

    @guarded
    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self.session.exit_phase()

    @guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.detach_at_train_end:
            self.session.stop()
        else:
            self.session.exit_phase()
