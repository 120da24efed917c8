"""The agent's step counting: which optimizer step ends a training step, the countdown to the next
sampled step end, manual steps and the job's phase labels.

What one "step" is:
- By default, one ``step()`` of the *primary* optimizer: the first optimizer seen stepping after
  attach. With several optimizers (GAN generator/discriminator, per-module optimizers) the others
  are registered for naming but do not end steps, so step N means the same thing all run long.
- Gradient accumulation: the hook fires per optimizer step, not per micro-batch, so a step is one
  optimizer update, which is the point where activations are gone and the baseline is clean.
- AMP ``GradScaler.step`` that skips an update on inf/nan never calls ``optimizer.step()``: no step
  is recorded, and the next record's duration spans both iterations.
- ``gpumemd.mark_step()`` is the manual way: once it is called, the optimizer hook stops ending
  steps, so there is never a double count.

The counting lives on the agent itself (this class is its base): the optimizer hook's fast path reads
and writes these counters directly, a few attribute lookups per step, because on a fast job most steps
end there.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpumemd.log_once import log_once

if TYPE_CHECKING:
    from gpumemd.records.step import StepRecord

log = logging.getLogger("gpumemd")


class StepCounting:
    """Counts steps and says which step ends are sampled; the agent (its subclass) samples them
    (``_end_step``) and knows whether it runs (``running``)."""

    optimizers: weakref.WeakSet[Any]

    def _reset_step_counts(self) -> None:
        self._hook_handle: Any = None
        self._primary_optimizer: weakref.ref[Any] | None = None
        self._manual_steps = False
        # Step numbering: the current step is _step_base + (_steps_total - _step_base_total), so an
        # unsampled step only counts (_steps_total) and the number is worked out when needed.
        self._step_base = -1
        self._step_base_total = 0
        self._sampled_total = 0  # _steps_total at the last sample
        self._until_sample = 1  # countdown: the step that brings it to 0 is sampled
        self._eve_callbacks: list[Callable[[], None]] = []
        self._steps_total = 0
        self._phase = "train"

    @property
    def running(self) -> bool:
        raise NotImplementedError

    def _end_step(self, step: int | None) -> StepRecord | None:
        raise NotImplementedError

    # --- step detection --------------------------------------------------------------------

    def _install_step_hook(self) -> None:
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # torch < 2.0: mark_step() is the only way
            log.info("gpumemd: this torch has no global optimizer hooks; call gpumemd.mark_step() each step")
            return
        agent_ref = weakref.ref(self)

        def _post_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            agent = agent_ref()
            if agent is None:
                return
            # _on_optimizer_step's fast path (an unsampled step of the primary optimizer), inlined:
            # most steps of a fast job end here, and the method call saved is ~0.5 µs of each after a
            # step of compute. Anything else goes to _on_optimizer_step, which starts from scratch.
            primary = agent._primary_optimizer
            left = agent._until_sample - 1
            if left > 0 and primary is not None and primary() is optimizer and not agent._manual_steps:
                agent._steps_total += 1
                agent._until_sample = left
                if left == 1 and agent._eve_callbacks:
                    agent._eve()
                return
            agent._on_optimizer_step(optimizer)

        self._hook_handle = register_optimizer_step_post_hook(_post_step)

    def _remove_step_hook(self) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

    def _on_optimizer_step(self, optimizer: Any) -> None:
        """A step the hook's fast path (``_install_step_hook``) did not end: a sampled step of the
        primary optimizer, or a step of any other optimizer (``_other_step``)."""
        primary = self._primary_optimizer
        if primary is not None and primary() is optimizer and not self._manual_steps:
            self._steps_total += 1
            self._end_step(None)
            return
        self._other_step(optimizer)

    def _other_step(self, optimizer: Any) -> None:
        """A step of an optimizer that is not (yet) the primary one, or any step once manual."""
        if not self.running:
            return
        if optimizer not in self.optimizers:
            self.optimizers.add(optimizer)
        if self._manual_steps:
            return
        primary = self._primary_optimizer() if self._primary_optimizer is not None else None
        if primary is None:
            self._primary_optimizer = weakref.ref(optimizer)
            self._steps_total += 1
            self._end_step(None)

    def mark_step(self, step: int | None = None) -> StepRecord | None:
        """End a step by hand; from then on the optimizer hook no longer ends steps.

        Returns the step's record when the step was sampled, else None (see the module docstring)."""
        if not self.running:
            return None
        self._manual_steps = True
        self._steps_total += 1
        if step is not None:
            self._step_base, self._step_base_total = step, self._steps_total
        left = self._until_sample - 1
        if left > 0:
            self._until_sample = left
            if left == 1 and self._eve_callbacks:
                self._eve()
            return None
        return self._end_step(step)

    def sample_within(self, steps: int = 1) -> None:
        """Make one of the next ``steps`` step ends a sampled one, the stride notwithstanding: 1 is
        the end of the step under way (a component that measured it) or, from ``on_step``, the next;
        a forced cadence (``census_every_steps``) asks for the step it is due at."""
        if steps < self._until_sample:
            self._until_sample = max(1, steps)

    @property
    def current_step(self) -> int | None:
        """The number of the last step that ended (sampled or not); None before the first."""
        if self._steps_total == 0:
            return None
        return self._step_base + (self._steps_total - self._step_base_total)

    def _eve(self) -> None:
        for callback in self._eve_callbacks:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - the job comes first
                log_once(f"on_eve:{type(exc).__name__}", "gpumemd: a step-end callback failed (%s: %s); "
                         "the job continues", type(exc).__name__, exc)

    def use_manual_steps(self) -> None:
        """A framework callback will end steps with ``mark_step``: the optimizer hook stops ending them
        now, before the first one, so the first step is not counted twice."""
        self._manual_steps = True


    # --- phases ------------------------------------------------------------------------------

    @property
    def current_phase(self) -> str:
        return self._phase

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the steps inside the block (``eval``, ``checkpoint``...) for the leak detector."""
        if not name or not isinstance(name, str):
            raise ValueError(f"gpumemd.phase(name) needs a non-empty string, got {name!r}")
        previous = self._phase
        self._phase = name
        self._until_sample = 1  # the first step of a phase is sampled, whatever the stride
        try:
            yield
        finally:
            self._phase = previous
            self._until_sample = 1
