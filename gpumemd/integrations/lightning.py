"""PyTorch Lightning: ``Trainer(callbacks=[GpumemdCallback(output_dir=...)])``.

- attaches at fit start (or joins an agent already attached, e.g. by ``gpumemd run``) and
  registers the LightningModule, then the optimizers when training starts;
- ends one step per optimizer update: at ``on_train_batch_end`` when ``trainer.global_step`` moved,
  so ``accumulate_grad_batches=k`` gives one step per k batches, numbered like ``global_step``;
- marks validation and test as phase ``"eval"``;
- takes rank, local rank and world size from the trainer;
- detaches at teardown if it attached. After an exception it stays attached, so an OOM report can
  still be written; the agent stops at process exit.

Works with ``lightning`` (``lightning.pytorch``) and, failing that, the ``pytorch_lightning`` package.
"""

from __future__ import annotations

from typing import Any

from gpumemd.integrations._session import FrameworkSession, guarded, missing_framework, rank_of

try:
    from lightning.pytorch import Callback as _Callback
except ImportError as _lightning_missing:
    try:
        from pytorch_lightning import Callback as _Callback  # type: ignore[assignment,unused-ignore]
    except ImportError:
        raise missing_framework("PyTorch Lightning", "lightning", _lightning_missing) from None

__all__ = ["GpumemdCallback"]


class GpumemdCallback(_Callback):  # type: ignore[misc,unused-ignore]  # Any to mypy without lightning
    """Attach gpumemd to a Lightning run. Keyword arguments are ``gpumemd.attach()`` options."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.session = FrameworkSession("lightning", options)

    @property
    def agent(self) -> Any:
        """The agent this callback uses: None before fit starts; after fit, the finished agent
        (detached, its findings, steps and reports still readable)."""
        return self.session.agent

    @guarded
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.session.start(model=pl_module, optimizers=getattr(trainer, "optimizers", ()) or (),
                           rank=rank_of(trainer, "global_rank", "local_rank"), global_step=int(trainer.global_step))

    @guarded
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.session.register(pl_module, getattr(trainer, "optimizers", ()) or ())

    @guarded
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # global_step counts optimizer updates: it moves once per accumulate_grad_batches batches.
        self.session.step(int(trainer.global_step))

    @guarded
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.session.enter_phase("eval")

    @guarded
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.exit_phase()

    @guarded
    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self.session.enter_phase("eval")

    @guarded
    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.exit_phase()

    @guarded
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.exit_phase()  # stay attached: the OOM/crash capture still needs the agent

    @guarded
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.session.stop()
        else:
            self.session.exit_phase()
