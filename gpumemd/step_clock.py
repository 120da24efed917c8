"""The step clock: which optimizer step ends a training step, the countdown to the next sampled step
end, manual steps and the job's phase labels. The agent's ``StepEnds`` (``gpumemd.step_end``) makes one
and is called back (``on_sampled``) on the step ends it samples.

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

The optimizer hook's fast path reads and writes the clock's counters directly, a few attribute lookups
per step, because on a fast job most steps end there.
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

NO_REQUEST = 1 << 62
"""The countdown while a sampled step end runs, before anyone asked for a sample (``sample_within``)."""


class StepClock:
    """Counts steps and says which step ends are sampled: for those it calls ``on_sampled(step)``
    (the agent's sampled step end), while ``active()`` says the agent runs in this process."""

    def __init__(self, on_sampled: Callable[[int | None], StepRecord | None], active: Callable[[], bool]) -> None:
        self._on_sampled = on_sampled
        self._active = active
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        """Every optimizer seen stepping or registered (weakly: the job's, not ours to keep)."""
        self._hook_handle: Any = None
        self._primary_optimizer: weakref.ref[Any] | None = None
        self._manual_steps = False
        # Step numbering: the current step is step_base + (steps_total - step_base_total), so an
        # unsampled step only counts (steps_total) and the number is worked out when needed.
        self.step_base = -1
        self.step_base_total = 0
        self.sampled_total = 0  # steps_total at the last sample
        self.until_sample = 1  # countdown: the step that brings it to 0 is sampled
        self.asked_at = 1
        """``steps_total`` at which someone asked for a full sampled step end (``sample_within``, a
        phase's first step, the first step), until one runs; ``NO_REQUEST`` when none is asked for.
        A sampled step end the stride alone brings may be quick (``StepEnds.end``)."""
        self.eve_callbacks: list[Callable[[], None]] = []  # called on the step before a sampled one
        self.steps_total = 0
        self.current_phase = "train"
        """The label set with ``phase()`` for the steps running now ("train" by default)."""

    # --- step detection --------------------------------------------------------------------

    def install_hook(self) -> None:
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # torch < 2.0: mark_step() is the only way
            log.info("gpumemd: this torch has no global optimizer hooks; call gpumemd.mark_step() each step")
            return
        clock_ref = weakref.ref(self)  # the global hook must not keep a detached agent alive

        def _post_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            clock = clock_ref()
            if clock is None:
                return
            # _on_optimizer_step's fast path (an unsampled step of the primary optimizer), inlined:
            # most steps of a fast job end here, and the method call saved is ~0.5 µs of each after a
            # step of compute. Anything else goes to _on_optimizer_step, which starts from scratch.
            primary = clock._primary_optimizer
            left = clock.until_sample - 1
            if left > 0 and primary is not None and primary() is optimizer and not clock._manual_steps:
                clock.steps_total += 1
                clock.until_sample = left
                if left == 1 and clock.eve_callbacks:
                    clock._eve()
                return
            clock._on_optimizer_step(optimizer)

        self._hook_handle = register_optimizer_step_post_hook(_post_step)

    def remove_hook(self) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None

    def _on_optimizer_step(self, optimizer: Any) -> None:
        """A step the hook's fast path (``install_hook``) did not end: a sampled step of the
        primary optimizer, or a step of any other optimizer (``_other_step``)."""
        primary = self._primary_optimizer
        if primary is not None and primary() is optimizer and not self._manual_steps:
            self.steps_total += 1
            self._on_sampled(None)
            return
        self._other_step(optimizer)

    def _other_step(self, optimizer: Any) -> None:
        """A step of an optimizer that is not (yet) the primary one, or any step once manual."""
        if not self._active():
            return
        if optimizer not in self.optimizers:
            self.optimizers.add(optimizer)
        if self._manual_steps:
            return
        primary = self._primary_optimizer() if self._primary_optimizer is not None else None
        if primary is None:
            self._primary_optimizer = weakref.ref(optimizer)
            self.steps_total += 1
            self._on_sampled(None)

    def mark_step(self, step: int | None = None) -> StepRecord | None:
        """End a step by hand; from then on the optimizer hook no longer ends steps.

        Returns the step's record when its end was sampled in full, else None (a quick step end's record
        is made at the next full one: ``StepEnds.end``)."""
        if not self._active():
            return None
        self._manual_steps = True
        self.steps_total += 1
        if step is not None:
            self.step_base, self.step_base_total = step, self.steps_total
        left = self.until_sample - 1
        if left > 0:
            self.until_sample = left
            if left == 1 and self.eve_callbacks:
                self._eve()
            return None
        return self._on_sampled(step)

    def use_manual_steps(self) -> None:
        """A framework callback will end steps with ``mark_step``: the optimizer hook stops ending them
        now, before the first one, so the first step is not counted twice."""
        self._manual_steps = True

    # --- sampled step ends -----------------------------------------------------------------------

    def begin_sample(self, step: int | None) -> tuple[int, int]:
        """At a sampled step end: its number (``step`` when the job gave one) and how many steps the
        record stands for; the countdown waits for the next request (``sample_within``, ``planned``)."""
        self.until_sample = NO_REQUEST
        steps = max(1, self.steps_total - self.sampled_total)
        self.sampled_total = self.steps_total
        number = step if step is not None else self.step_base + (self.steps_total - self.step_base_total)
        self.step_base, self.step_base_total = number, self.steps_total
        return number, steps

    @property
    def asked(self) -> bool:
        """Whether the step end under way was asked for (it runs in full)."""
        return self.steps_total >= self.asked_at

    def asked_met(self) -> None:
        """A full sampled step end runs: every request so far is met."""
        self.asked_at = NO_REQUEST

    def planned(self, stride: int) -> None:
        """The next sampled step end at most ``stride`` steps on, or at the step asked for if sooner
        (a quick step end leaves the request standing)."""
        asked_in = max(1, self.asked_at - self.steps_total)
        self.until_sample = min(self.until_sample, stride, asked_in)
        if self.until_sample == 1 and self.eve_callbacks:
            self._eve()  # this step end is the eve of the next sampled one

    def sample_within(self, steps: int = 1) -> None:
        """Make one of the next ``steps`` step ends a sampled one, the stride notwithstanding: 1 is
        the end of the step under way (a component that measured it) or, from ``on_step``, the next;
        a forced cadence (``census_every_steps``) asks for the step it is due at."""
        steps = max(1, steps)
        self.asked_at = min(self.asked_at, self.steps_total + steps)
        self.until_sample = min(self.until_sample, steps)

    @property
    def current_step(self) -> int | None:
        """The number of the last step that ended (sampled or not); None before the first."""
        if self.steps_total == 0:
            return None
        return self.step_base + (self.steps_total - self.step_base_total)

    def _eve(self) -> None:
        for callback in self.eve_callbacks:
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - the job comes first
                log_once(f"on_eve:{type(exc).__name__}", "gpumemd: a step-end callback failed (%s: %s); "
                         "the job continues", type(exc).__name__, exc)

    # --- phases ------------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the steps inside the block (``eval``, ``checkpoint``...) for the leak detector."""
        if not name or not isinstance(name, str):
            raise ValueError(f"gpumemd.phase(name) needs a non-empty string, got {name!r}")
        previous = self.current_phase
        self.current_phase = name
        self.sample_within(1)  # the first step of a phase is sampled in full, whatever the stride
        try:
            yield
        finally:
            self.current_phase = previous
            self.sample_within(1)
